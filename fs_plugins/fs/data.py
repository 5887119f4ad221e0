"""FS data plugin: `data.type: '<file.json|file.jsonl|builtin>@fsplug'`."""
from __future__ import annotations

from fs_plugins.config import client_overrides
from fs_plugins.data.federated import build_federated_records

DATA_SUFFIX = '@fsplug'
# client id -> name (source dataset), for result labels on the server of this process
CLIENT_NAMES: dict[int, str] = {}


def lookup_data(config, client_cfgs):
    if not str(config.data.type).endswith(DATA_SUFFIX):
        return None
    records = build_federated_records(config)
    client_overrides(client_cfgs, records.client_num)  # fails naming an unknown client id
    CLIENT_NAMES.clear()
    CLIENT_NAMES.update(records.client_names)
    config.federate.client_num = records.client_num
    if config.federate.mode.lower() == 'distributed':
        if config.distribute.role == 'server':
            return None, config
        idx = int(config.distribute.data_idx)
        if idx not in records.clients:
            raise ValueError(f"distribute.data_idx = {idx} is not a client of this split "
                             f"(1 .. {records.client_num})")
        return dict(records.clients[idx]), config
    return {cid: dict(splits) for cid, splits in records.clients.items()}, config

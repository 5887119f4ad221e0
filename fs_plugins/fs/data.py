"""FS data plugin: `data.type: '<file.json|file.jsonl|builtin>@fsplug'`, and FS-LLM's
'<name>@llm' when an fsplug method runs (fs_plugins.data.fs_llm)."""
from __future__ import annotations

from fs_plugins.fs.config import fs_known_keys
from fs_plugins.fs.logs import share_fs_logging
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.config import client_overrides
from fs_plugins.run.runtime import build_federated_records, resolved_override
from fs_plugins.schema.plugin import reads_data_type

# client id -> name (source dataset), for result labels on the server of this process
CLIENT_NAMES: dict[int, str] = {}
# client id -> its --client_cfg entry, for the server of this process (Method.client_configs)
CLIENT_OVERRIDES: dict[int, dict] = {}
# client id -> its training split's size, which caps the size it reports (every party splits
# the same records, a distributed server too)
CLIENT_TRAIN_SIZES: dict[int, int] = {}


def lookup_data(config, client_cfgs):
    if not reads_data_type(config):
        return None
    share_fs_logging()   # FS has configured its logger by now
    records = build_federated_records(config)
    config.federate.client_num = records.client_num
    # every client entry checked (ids, keys, values) before any model is built
    overrides = client_overrides(client_cfgs, config, fs_known_keys(config))
    # the keys a method derives from each client's records (UniFLoW's modalities), so this
    # process's server expects what each client will send
    method_cls = get_method_class(config.fsplug.method)
    for cid, splits in records.clients.items():
        override = resolved_override(config, overrides.get(cid), method_cls, splits)
        if override:
            overrides[cid] = override
    CLIENT_NAMES.clear()
    CLIENT_NAMES.update(records.client_names)
    CLIENT_OVERRIDES.clear()
    CLIENT_OVERRIDES.update(overrides)
    CLIENT_TRAIN_SIZES.clear()
    CLIENT_TRAIN_SIZES.update(records.train_sizes())
    if config.federate.mode.lower() == 'distributed':
        if config.distribute.role == 'server':
            return None, config
        idx = int(config.distribute.data_idx)
        if idx not in records.clients:
            raise ValueError(f"distribute.data_idx = {idx} is not a client of this split "
                             f"(1 .. {records.client_num})")
        return dict(records.clients[idx]), config
    return {cid: dict(splits) for cid, splits in records.clients.items()}, config

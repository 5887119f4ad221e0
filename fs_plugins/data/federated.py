"""From a config to per-client record splits (train / test), the same under both runners."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from fs_plugins import config as config_mod
from fs_plugins.data import splitters
from fs_plugins.data.builtin import ensure_builtin
from fs_plugins.data.instruction import load_records
from fs_plugins.seeding import derive_seed

logger = logging.getLogger(__name__)


class RecordList(list, torch.utils.data.Dataset):
    """Raw records of one split (tokenised by each client with its own tokenizer); a torch
    Dataset so that FS's trainer accepts it."""


@dataclass
class FederatedRecords:
    clients: dict[int, dict[str, RecordList]]   # client id (1-based) -> {'train', 'test'}
    client_names: dict[int, str]                 # e.g. the source dataset of by_source clients

    @property
    def client_num(self) -> int:
        return len(self.clients)


def resolve_data_path(cfg) -> str:
    name = config_mod.data_name(cfg)
    root = str(cfg.data.root)
    builtin = ensure_builtin(name, root)
    if builtin:
        return builtin
    path = name if os.path.isabs(name) else os.path.join(root, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Data file not found: {path} (from data.root = '{root}' and "
                                f"data.type = '{cfg.data.type}')")
    return path


def _train_test(indices: list[int], fraction: float, seed: int, client_id: int):
    rng = np.random.default_rng(derive_seed(seed, 'test_split', client_id))
    order = rng.permutation(indices)
    n_test = int(round(fraction * len(order)))
    if fraction > 0 and len(order) >= 2:
        n_test = min(max(n_test, 1), len(order) - 1)
    return sorted(order[n_test:].tolist()), sorted(order[:n_test].tolist())


def _split_from_records(records: list[dict], indices: list[int], client_id: int):
    """Train / test as the records' own "split" field says (fsplug.data.split_from_records)."""
    parts = {'train': [], 'test': []}
    for i in indices:
        split = records[i].get('split')
        if split not in parts:
            raise ValueError(f"fsplug.data.split_from_records is on, but record "
                             f"{records[i].get('id', i)} (client {client_id}) has split = "
                             f"{split!r}; expected 'train' or 'test'")
        parts[split].append(i)
    return parts['train'], parts['test']


def build_federated_records(cfg) -> FederatedRecords:
    data_cfg = cfg.fsplug.data
    records = load_records(resolve_data_path(cfg))
    if data_cfg.max_records:
        records = records[:data_cfg.max_records]
    parts = splitters.split(cfg.data.splitter, records, cfg.federate.client_num,
                            derive_seed(cfg.seed, 'split'), field=data_cfg.split_field,
                            alpha=data_cfg.dirichlet_alpha, min_size=data_cfg.min_client_size)
    names = (splitters.source_names(records, data_cfg.split_field)
             if cfg.data.splitter == 'by_source' else [f'client_{i + 1}' for i in range(len(parts))])
    clients, client_names = {}, {}
    for cid, indices in enumerate(parts, start=1):
        if not indices:
            raise ValueError(f"Client {cid} received no records from the "
                             f"'{cfg.data.splitter}' split; use fewer clients")
        if data_cfg.split_from_records:
            train_idx, test_idx = _split_from_records(records, indices, cid)
        else:
            train_idx, test_idx = _train_test(indices, data_cfg.test_fraction, cfg.seed,
                                              cid)
        clients[cid] = {'train': RecordList(records[i] for i in train_idx),
                        'test': RecordList(records[i] for i in test_idx)}
        client_names[cid] = names[cid - 1]
    logger.info('fsplug data: ' + ', '.join(
        f"client {c} ({client_names[c]}): {len(d['train'])} train / {len(d['test'])} test"
        for c, d in clients.items()))
    return FederatedRecords(clients, client_names)

"""From a split spec to per-client record splits (train / val / test), the same under both runners."""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fs_plugins.core.errors import ConfigError
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data import fs_llm, glue, splitters, stream
from fs_plugins.data.builtin import ensure_builtin
from fs_plugins.data.instruction import load_records
from fs_plugins.schema.specs import DataSource, SplitSpec

logger = logging.getLogger(__name__)


class RecordList(list, torch.utils.data.Dataset):
    """Raw records of one split (tokenised by each client with its own tokenizer); a torch
    Dataset so that FS's trainer accepts it."""


@dataclass
class FederatedRecords:
    # client id (1-based) -> {'train', 'test'[, 'val']}
    clients: dict[int, dict[str, RecordList]]
    client_names: dict[int, str]                 # e.g. the source dataset of by_source clients

    @property
    def client_num(self) -> int:
        return len(self.clients)


def resolve_data_path(source: DataSource) -> str:
    name, root = source.name, source.root
    builtin = ensure_builtin(name, root)
    if builtin:
        return builtin
    path = name if os.path.isabs(name) else os.path.join(root, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Data file not found: {path} (from data.root = '{root}' and "
                                f"data.type = '{source.type_value}')")
    return path


def source_records(source: DataSource, fields: Mapping[str, str] | None = None,
                   splitter: str = '', seed: int = 0, split_field: str = 'category') -> list[dict]:
    """Every record of a data source: FS-LLM's '@llm' data as FS-LLM makes it, else the
    record file or builtin dataset (fields: fsplug.data.fields; splitter, seed and
    split_field: what FS-LLM's loading depends on, fs_plugins.data.fs_llm)."""
    if source.is_fs_llm:
        return fs_llm.load_fs_llm_records(source, fields, splitter, seed, split_field)
    return load_records(resolve_data_path(source), fields)


def _held_out_count(fraction: float, total: int, available: int) -> int:
    """round(fraction · total) of `available` records, at least 1 when fraction > 0, leaving
    at least one."""
    count = int(round(fraction * total))
    if fraction > 0 and available >= 2:
        count = max(count, 1)
    return min(count, max(available - 1, 0))


def _train_val_test(indices: list[int], test_fraction: float, val_fraction: float, seed: int,
                    client_id: int) -> dict[str, list[int]]:
    """One seeded permutation per client: its first test_fraction is the test split, the next
    val_fraction the validation split (the test split does not depend on val_fraction)."""
    rng = np.random.default_rng(derive_seed(seed, 'test_split', client_id))
    order = rng.permutation(indices)
    n_test = _held_out_count(test_fraction, len(order), len(order))
    n_val = _held_out_count(val_fraction, len(order), len(order) - n_test)
    return {'train': sorted(order[n_test + n_val:].tolist()),
            'val': sorted(order[n_test:n_test + n_val].tolist()),
            'test': sorted(order[:n_test].tolist())}


SPLIT_NAMES = {'train': 'train', 'test': 'test', 'val': 'val', 'validation': 'val'}


def _split_from_records(records: list[dict], indices: list[int], client_id: int):
    """Train / val / test as the records' own "split" field says
    (fsplug.data.split_from_records)."""
    parts = {'train': [], 'val': [], 'test': []}
    for i in indices:
        split = records[i].get('split')
        if split not in SPLIT_NAMES:
            raise ValueError(f"fsplug.data.split_from_records is on, but record "
                             f"{records[i].get('id', i)} (client {client_id}) has split = "
                             f"{split!r}; expected one of {sorted(SPLIT_NAMES)}")
        parts[SPLIT_NAMES[split]].append(i)
    return parts


@dataclass
class LoadedRecords:
    records: list[dict]          # those the clients are split from (fsplug.data.select)
    from_records: bool           # whether their own 'split' field gives train / val / test
    left_out: list[dict]         # the file's records that `select` left out


def load_data_records(spec: SplitSpec) -> LoadedRecords:
    """The records of data.type and whether their own 'split' field gives train / test: a
    GLUE task (fs_plugins.data.glue) always (its files are the splits; max_records caps its
    training file), a record file, builtin dataset or FS-LLM's data as
    fsplug.data.split_from_records says."""
    data_cfg = spec.options
    glue_source = None if spec.source.is_fs_llm else glue.parse_data_type(spec.source.name,
                                                                          spec.source.root)
    if glue_source is not None:
        return LoadedRecords(glue.load_glue(glue_source, data_cfg.max_records), True, [])
    everything = source_records(spec.source, data_cfg.fields, spec.splitter, spec.seed,
                                data_cfg.split_field)
    records = select_records(everything, data_cfg.split_field, list(data_cfg.select))
    kept = {id(r) for r in records}
    left_out = [r for r in everything if id(r) not in kept]
    if data_cfg.max_records:
        records = records[:data_cfg.max_records]
    return LoadedRecords(records, data_cfg.split_from_records, left_out)


def select_records(records: list[dict], field: str, values: list[str]) -> list[dict]:
    """fsplug.data.select: the records whose `field` is one of `values` (all when empty)."""
    if not values:
        return records
    kept = [r for r in records if str(r.get(field)) in values]
    if not kept:
        found = sorted({str(r.get(field)) for r in records})
        raise ConfigError(f"fsplug.data.select = {values}: no record has fsplug.data.split_field "
                          f"'{field}' among them (values found: {found[:10]})")
    return kept


def split_records(spec: SplitSpec) -> FederatedRecords:
    data_cfg = spec.options
    loaded = load_data_records(spec)
    records, from_records = loaded.records, loaded.from_records
    parts = splitters.split(spec.splitter, records, spec.client_num,
                            derive_seed(spec.seed, 'split'), field=data_cfg.split_field,
                            alpha=data_cfg.dirichlet_alpha, min_size=data_cfg.min_client_size)
    names = (splitters.source_names(records, data_cfg.split_field)
             if spec.splitter == 'by_source' else [f'client_{i + 1}' for i in range(len(parts))])
    clients, client_names = {}, {}
    for cid, indices in enumerate(parts, start=1):
        if not indices:
            raise ValueError(f"Client {cid} received no records from the "
                             f"'{spec.splitter}' split; use fewer clients")
        if from_records:
            split = _split_from_records(records, indices, cid)
        else:
            split = _train_val_test(indices, data_cfg.test_fraction, data_cfg.val_fraction,
                                    spec.seed, cid)
        parts = {name: [records[i] for i in part] for name, part in split.items()}
        if data_cfg.task_field:
            parts = stream.annotate(parts, data_cfg.task_field, data_cfg.task_order, cid)
        clients[cid] = {name: RecordList(part) for name, part in parts.items()
                        if part or name != 'val'}
        client_names[cid] = names[cid - 1]
    if data_cfg.test_records == 'all':
        pool_test_records(clients, _test_records_of(loaded.left_out, from_records))
    if data_cfg.evaluate_others:
        add_others_split(clients)
    if data_cfg.dynamic:
        check_rounds_cover_tasks(clients, spec.total_rounds)
    logger.info('fsplug data: ' + ', '.join(
        f"client {c} ({client_names[c]}): " + ' / '.join(f'{len(d[s])} {s}' for s in d)
        for c, d in clients.items()))
    return FederatedRecords(clients, client_names)


def _test_records_of(left_out: list[dict], from_records: bool) -> list[dict]:
    """The test records of groups no client trains on: those with split = test when the
    records carry their split, else all of them."""
    if not from_records:
        return list(left_out)
    return [r for r in left_out if SPLIT_NAMES.get(r.get('split')) == 'test']


def pool_test_records(clients: dict[int, dict], extra: list[dict]) -> None:
    """fsplug.data.test_records = 'all': every client's test split becomes the test records
    of every client plus `extra` (one shared list, in client order)."""
    pooled = RecordList([r for cid in sorted(clients) for r in clients[cid]['test']] + extra)
    for splits in clients.values():
        splits['test'] = pooled


def add_others_split(clients: dict[int, dict]) -> None:
    """Each client's 'others' split: every other client's test records (FedMosaic's 'Others')."""
    for cid, splits in clients.items():
        splits['others'] = RecordList(
            {stream.OWNER: other, **r} if stream.OWNER not in r else r
            for other, theirs in clients.items() if other != cid for r in theirs['test'])


def check_rounds_cover_tasks(clients: dict[int, dict], total_rounds: int) -> None:
    most = max(len({r[stream.TASK_RANK] for r in s['train']}) for s in clients.values())
    if total_rounds < most:
        raise ValueError(f'fsplug.data.dynamic: federate.total_round_num = {total_rounds} is '
                         f'fewer than the {most} tasks of a client; every task needs a round')

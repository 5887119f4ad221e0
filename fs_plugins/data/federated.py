"""From a split spec to per-client record splits (train / val / test), the same under both runners."""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from fs_plugins.core.errors import ConfigError, DataFileError
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data import fs_llm, glue, splitters, stream
from fs_plugins.data.builtin import BUILTIN_DATASETS, builtin_path, ensure_builtin
from fs_plugins.data.instruction import load_records
from fs_plugins.data.record_files import FileRecords
from fs_plugins.schema.specs import DataSource, SplitSpec

logger = logging.getLogger(__name__)


class RecordList(list, torch.utils.data.Dataset):
    """Raw records of one split (tokenised by each client with its own tokenizer); a torch
    Dataset so that FS's trainer accepts it. `origin`: the data file (or folder) they come
    from, and `places`: each record's place in it ('line 3'; None where unknown), for errors
    about them."""

    def __init__(self, records=(), origin: str = '', places: list[str | None] | None = None):
        super().__init__(records)
        self.origin = origin
        self.places = places if places is not None else [None] * len(self)

    def describe(self, index: int) -> str:
        """Where record `index` comes from, e.g. 'line 3 of data/qa.jsonl'."""
        record, place = self[index], self.places[index] if index < len(self.places) else None
        name = place or (f"record {record['id']}" if isinstance(record, dict) and 'id' in record
                         else f'record {index} of the split')
        return f'{name} of {self.origin}' if self.origin else name


def nothing_fits_error(client_id: int, train: list, tok_len: int) -> DataFileError:
    """A client none of whose training records leaves an answer token within llm.tok_len
    (its prompts fill it): the error naming its data file and a record."""
    example = train.describe(0) if isinstance(train, RecordList) and train else 'its data'
    return DataFileError(f'Client {client_id}: none of its {len(train)} training record(s) '
                         f'leaves an answer token within llm.tok_len = {tok_len} tokens (e.g. '
                         f'{example}: its prompt alone fills them): raise llm.tok_len, or '
                         'shorten the prompts')


@dataclass
class FederatedRecords:
    # client id (1-based) -> {'train', 'test'[, 'val']}
    clients: dict[int, dict[str, RecordList]]
    client_names: dict[int, str]                 # e.g. the source dataset of by_source clients

    @property
    def client_num(self) -> int:
        return len(self.clients)

    def train_sizes(self) -> dict[int, int]:
        """Each client's training records (the most it can honestly report training on)."""
        return {cid: len(splits['train']) for cid, splits in self.clients.items()}


def data_path(source: DataSource) -> str:
    """Where the records of a record file or builtin dataset are (nothing written)."""
    name, root = source.name, source.root
    if name in BUILTIN_DATASETS:
        return builtin_path(name, root)
    return name if os.path.isabs(name) else os.path.join(root, name)


def resolve_data_path(source: DataSource) -> str:
    builtin = ensure_builtin(source.name, source.root)
    if builtin:
        return builtin
    path, root = data_path(source), source.root
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


def _split_from_records(records: list[dict], indices: list[int], client_id: int, origin: str):
    """Train / val / test as the records' own "split" field says
    (fsplug.data.split_from_records)."""
    parts = {'train': [], 'val': [], 'test': []}
    for i in indices:
        split = records[i].get('split')
        if split not in SPLIT_NAMES:
            raise DataFileError(f"fsplug.data.split_from_records is on, but record "
                                f"{records[i].get('id', i)} (client {client_id}) of {origin} has "
                                f"split = {split!r}: give it one of {sorted(SPLIT_NAMES)}, or "
                                "turn fsplug.data.split_from_records off")
        parts[SPLIT_NAMES[split]].append(i)
    if not parts['train']:
        raise DataFileError(f"Client {client_id}'s records in {origin} have no split = 'train' "
                            '(fsplug.data.split_from_records is on): mark some of them train, '
                            'or turn fsplug.data.split_from_records off')
    return parts


@dataclass
class LoadedRecords:
    records: list[dict]          # those the clients are split from (fsplug.data.select)
    from_records: bool           # whether their own 'split' field gives train / val / test
    left_out: list[dict]         # the file's records that `select` left out
    origin: str = ''             # the data file (or folder) they come from
    places: dict[int, str] = field(default_factory=dict)   # id(record) -> 'line 3'
    public: list[dict] = field(default_factory=list)   # held apart (fsplug.data.public_holdout)


def load_data_records(spec: SplitSpec) -> LoadedRecords:
    """The records of data.type and whether their own 'split' field gives train / test: a
    GLUE task (fs_plugins.data.glue) always (its files are the splits; max_records caps its
    training file), a record file, builtin dataset or FS-LLM's data as
    fsplug.data.split_from_records says."""
    data_cfg = spec.options
    glue_source = None if spec.source.is_fs_llm else glue.parse_data_type(spec.source.name,
                                                                          spec.source.root)
    if glue_source is not None:
        return LoadedRecords(glue.load_glue(glue_source, data_cfg.max_records), True, [],
                             glue_source.folder)
    everything = source_records(spec.source, data_cfg.fields, spec.splitter, spec.seed,
                                data_cfg.split_field)
    records = select_records(everything, data_cfg.split_field, list(data_cfg.select))
    kept = {id(r) for r in records}
    left_out = [r for r in everything if id(r) not in kept]
    if data_cfg.max_records:
        records = records[:data_cfg.max_records]
    held = held_apart(records, spec.public_holdout, spec.seed)
    if held:
        kept = {id(r) for r in held}
        records = [r for r in records if id(r) not in kept]
    return LoadedRecords(records, data_cfg.split_from_records, left_out,
                         data_origin(spec.source), record_places(everything), held)


def held_apart(records: list[dict], count: int, seed: int) -> list[dict]:
    """The `count` training records (no 'split' field, or 'train') held apart from every
    client as the run's public set (fsplug.data.public_holdout), a seeded choice in file order."""
    if count <= 0:
        return []
    train = [r for r in records if r.get('split', 'train') == 'train']
    if count >= len(train):
        raise DataFileError(f'fsplug.data.public_holdout = {count}: the data has {len(train)} '
                            f'training record(s); hold apart fewer')
    order = np.random.default_rng(derive_seed(seed, 'public_holdout')).permutation(len(train))[:count]
    return [train[int(i)] for i in sorted(order)]


def record_places(records: list[dict]) -> dict[int, str]:
    """id(record) -> its place in its file ('line 3'), for records read from one file."""
    if not isinstance(records, FileRecords):
        return {}
    return {id(record): records.position(i) for i, record in enumerate(records)}


def data_origin(source: DataSource) -> str:
    """The file (or folder) a source's records come from, for errors."""
    return fs_llm.source_path(source) if source.is_fs_llm else data_path(source)


def check_enough_records(loaded: LoadedRecords, spec: SplitSpec) -> None:
    """At least one record per client (federate.client_num)."""
    count, clients = len(loaded.records), spec.client_num
    if count >= clients:
        return
    options = spec.options
    narrowed = ' (after fsplug.data.select / fsplug.data.max_records)' \
        if options.select or options.max_records else ''
    where = 'Data file' if os.path.isfile(loaded.origin) else 'Data in'
    raise DataFileError(f'{where} {loaded.origin} gives {count} record(s){narrowed} for '
                        f'federate.client_num = {clients} clients: lower federate.client_num '
                        f'to at most {count}, or add records')


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
    check_enough_records(loaded, spec)
    records, from_records, origin = loaded.records, loaded.from_records, loaded.origin
    parts = splitters.split(spec.splitter, records, spec.client_num,
                            derive_seed(spec.seed, 'split'), field=data_cfg.split_field,
                            alpha=data_cfg.dirichlet_alpha, min_size=data_cfg.min_client_size)
    names = (splitters.source_names(records, data_cfg.split_field)
             if spec.splitter == 'by_source' else [f'client_{i + 1}' for i in range(len(parts))])
    clients, client_names = {}, {}
    for cid, indices in enumerate(parts, start=1):
        if not indices:
            raise DataFileError(f"Client {cid} received no records of {origin} from the "
                                f"'{spec.splitter}' split (data.splitter): lower "
                                'federate.client_num, or add records')
        if from_records:
            split = _split_from_records(records, indices, cid, origin)
        else:
            split = _train_val_test(indices, data_cfg.test_fraction, data_cfg.val_fraction,
                                    spec.seed, cid)
        parts = {name: [records[i] for i in part] for name, part in split.items()}
        places = {name: [loaded.places.get(id(r)) for r in part] for name, part in parts.items()}
        if data_cfg.task_field:
            parts = stream.annotate(parts, data_cfg.task_field, data_cfg.task_order, cid,
                                    origin)
        clients[cid] = {name: RecordList(part, origin, places[name])
                        for name, part in parts.items() if part or name != 'val'}
        client_names[cid] = names[cid - 1]
    if data_cfg.test_records == 'all':
        pool_test_records(clients, _test_records_of(loaded.left_out, from_records), origin)
    if data_cfg.evaluate_others:
        add_others_split(clients, origin)
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


def pool_test_records(clients: dict[int, dict], extra: list[dict], origin: str = '') -> None:
    """fsplug.data.test_records = 'all': every client's test split becomes the test records
    of every client plus `extra` (one shared list, in client order)."""
    pooled = RecordList([r for cid in sorted(clients) for r in clients[cid]['test']] + extra,
                        origin)
    for splits in clients.values():
        splits['test'] = pooled


def add_others_split(clients: dict[int, dict], origin: str = '') -> None:
    """Each client's 'others' split: every other client's test records (FedMosaic's 'Others')."""
    for cid, splits in clients.items():
        splits['others'] = RecordList(
            ({stream.OWNER: other, **r} if stream.OWNER not in r else r
             for other, theirs in clients.items() if other != cid for r in theirs['test']),
            origin)


def check_rounds_cover_tasks(clients: dict[int, dict], total_rounds: int) -> None:
    most = max(len({r[stream.TASK_RANK] for r in s['train']}) for s in clients.values())
    if total_rounds < most:
        raise ConfigError(f'fsplug.data.dynamic: federate.total_round_num = {total_rounds} is '
                         f'fewer than the {most} tasks of a client; every task needs a round')

"""Public (server-side or shared) records that methods use besides the clients' data:
FedMosaic's alignment data, PerAda's unlabelled distillation data, FedMKT's and TAKFL's public
sets. A public set is never drawn from the clients' training data unless the config says so:
its source is a record file, a builtin dataset, HELD_OUT (training records of the run's data
held apart from every client before the split: `fsplug.data.public_holdout`) or, explicitly,
CLIENTS (the clients' own training records)."""
from __future__ import annotations

import os

import numpy as np

from fs_plugins.core.errors import ConfigError, DataFileError
from fs_plugins.data.builtin import BUILTIN_DATASETS, ensure_builtin
from fs_plugins.data.federated import source_records
from fs_plugins.data.instruction import load_records
from fs_plugins.schema.specs import DataSource


def public_file_records(path: str, key: str) -> list[dict]:
    """The records of a public data file; a problem with it also names `key`, the config key
    that points at it."""
    try:
        return load_records(path)
    except DataFileError as exc:
        raise DataFileError([f'{key}: {problem}' for problem in exc.problems]) from None


HELD_OUT = 'held_out'   # training records held apart from every client (the default)
CLIENTS = 'clients'     # the clients' own training records: explicit only
# (source option, count option) of the methods' public data, under fsplug.<method>; the first
# is needed in every run (PerAda, FedMKT, TAKFL), so 'held_out' holds its count apart unless
# fsplug.data.public_holdout says how many; FedMosaic's alignment data is needed only when a
# client's model is not the pivot, so its 'held_out' takes fsplug.data.public_holdout's records
PUBLIC_OPTIONS = (('public_data', 'public_samples'), ('alignment_data', 'alignment_samples'))


def public_source(source: str, run_data: DataSource, holdout: int = 0) -> str:
    """Where a public set comes from, for the run's summary."""
    if source == HELD_OUT:
        return (f"{holdout} training records of {run_data.name} held apart from every client "
                f"(fsplug.data.public_holdout)")
    if source == CLIENTS:
        return f"the clients' own training records ({run_data.name}; explicit '{CLIENTS}')"
    return source


def public_records(source: str, run_data: DataSource, count: int, seed: int, key: str,
                   split=None) -> list[dict]:
    """`count` records (a seeded choice, in file order) from `source`: a .json/.jsonl file, a
    builtin dataset name, HELD_OUT (the run's held-apart records: `split`, its SplitSpec, is
    needed) or CLIENTS (the run's own training data, `run_data`). Records marked with another
    'split' than 'train' are left out. `key` is the config key `source` came from, for the
    errors."""
    name = source or run_data.name
    if not source:
        raise ConfigError(f"{key} = '': name the public set: a .json/.jsonl record file, a builtin "
                          f"dataset ({', '.join(sorted(BUILTIN_DATASETS))}), '{HELD_OUT}' (training "
                          f"records of the run's data held apart from every client) or "
                          f"'{CLIENTS}' (the clients' own training records)")
    if source == HELD_OUT:
        if split is None:
            raise ConfigError(f"{key} = '{HELD_OUT}' is not available here")
        from fs_plugins.data.federated import load_data_records  # lazy: federated imports this
        records = load_data_records(split).public
        if not records:
            raise ConfigError(f"{key} = '{HELD_OUT}': no record of the run's data is held apart: "
                              f"set fsplug.data.public_holdout (how many), or name a public file")
    elif source == CLIENTS:
        try:
            records = source_records(run_data)
        except FileNotFoundError as exc:
            raise ConfigError(f"{key} = '{CLIENTS}' (the run's data): {exc}") from None
    elif os.sep in source or source.endswith(('.json', '.jsonl')):
        if not os.path.isfile(source):
            raise ConfigError(f"{key}: file not found: {source}")
        records = public_file_records(source, key)
    elif source in BUILTIN_DATASETS:
        # through its JSONL under data.root: media paths resolved as for the run's own data
        records = public_file_records(ensure_builtin(source, run_data.root), key)
    else:
        raise ConfigError(f"{key} = {source!r}: give a .json/.jsonl record file or a builtin "
                          f"dataset ({', '.join(sorted(BUILTIN_DATASETS))})")
    records = [r for r in records if r.get('split', 'train') == 'train']
    if len(records) < 2:
        raise ConfigError(f"{key} ({name}): {len(records)} record(s); at least 2 are needed")
    order = np.random.default_rng(seed).permutation(len(records))[:count]
    return [records[int(i)] for i in sorted(order)]

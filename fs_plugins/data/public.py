"""Public (server-side or shared) records that methods use besides the clients' data:
FedMosaic's alignment data, PerAda's unlabelled distillation data."""
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


def public_records(source: str, run_data: DataSource, count: int, seed: int, key: str) -> list[dict]:
    """`count` records (a seeded choice, in file order) from `source`: a .json/.jsonl file,
    or a builtin dataset name; '' = the run's own data (`run_data`). Records marked with
    another 'split' than 'train' are left out. `key` is the config key `source` came from,
    for the errors."""
    name = source or run_data.name
    if not source:
        try:
            records = source_records(run_data)
        except FileNotFoundError as exc:
            raise ConfigError(f"{key} = '' (the run's data): {exc}") from None
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

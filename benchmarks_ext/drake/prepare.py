"""DRAKE for FedMosaic's PFL-Dynamic (§5 lines 151-173, A.24 lines 1164-1176, Table 34): ten
clients, four tasks each (40 tasks from 19 datasets, multi-image ones included), written as one
normalised multimodal JSONL.

    python -m benchmarks_ext.drake.prepare --raw RAW --out OUT/drake.jsonl [--per-task 10000]
        [--test-per-task 1000] [--seed 0] [--images symlink|copy|absolute]

RAW holds one folder per task of Table 34, RAW/<dataset>[/<subset>]/, with the task's
instruction records (readers.py; benchmarks_ext/drake/README.md).

Sizes (A.24, line 1168): "for each task, we subsample 10,000 training and 1,000 test samples,
if the dataset is large; otherwise, we split the data into training and test sets with an 8:2
ratio". Here:
- a task folder with train + test files: at most --per-task (10,000) training and
  --test-per-task (1,000) test records, a seeded draw from each file;
- a task folder with one data file (a pool): 10,000 + 1,000 drawn when it holds at least
  11,000 records ("large"), else a seeded 8:2 split of all of it (at least one test record).

What the paper does not give, and is left to the task files: how each task's instruction,
answer and images are built from the original dataset (e.g. Fashion200K's ClothCombination,
Bongard-HOI's ActionIncoherence). The 7 unseen tasks (A.24) are not prepared.
Task order within a client: Table 34's (pfl_task 't<k>_' prefix, fsplug.data.task_order: sorted).
"""
from __future__ import annotations

import os
import random
import sys

if __package__ in (None, ''):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks_ext.drake.readers import README, read_rows, task_files, to_candidate  # noqa: E402
from benchmarks_ext.drake.table import TABLE_34, DrakeTask  # noqa: E402
from benchmarks_ext.hflb.pfl_records import TaskPool, base_parser, draw, run_cli, write_benchmark  # noqa: E402
from fs_plugins.core.seeding import derive_seed  # noqa: E402

BENCHMARK = 'drake'
PER_TASK, TEST_PER_TASK = 10_000, 1_000   # A.24
TEST_SHARE = 0.2                          # the 8:2 split of small tasks


def split_pool(size: int, per_task: int | None, test_per_task: int | None, seed: int,
               tags: tuple) -> dict[str, list[int]]:
    """Row indices of a pooled task per split: per_task + test_per_task drawn when the pool has
    that many (and both are set), else 8:2; a seeded permutation, each split in file order."""
    order = list(range(size))
    random.Random(derive_seed(seed, *tags)).shuffle(order)
    if per_task is not None and test_per_task is not None and size >= per_task + test_per_task:
        n_test, n_train = test_per_task, per_task
    else:
        n_test = min(max(1, round(TEST_SHARE * size)), size - 1) if size >= 2 else 0
        n_train = size - n_test
    return {'test': sorted(order[:n_test]), 'train': sorted(order[n_test:n_test + n_train])}


def chosen_rows(raw: str, task: DrakeTask, client: str, key: str, per_task, test_per_task,
                seed: int) -> tuple[dict[str, list[tuple[int, dict, str]]], dict]:
    """The task's chosen (index, row, file) per split, and the raw counts for the summary."""
    files = task_files(raw, task)
    tags = (BENCHMARK, client, key)
    if 'pool' in files:
        rows = read_rows(files['pool'], task.dataset)
        indices = split_pool(len(rows), per_task, test_per_task, seed, tags + ('pool',))
        chosen = {split: [(i, rows[i], files['pool']) for i in part] for split, part in indices.items()}
        return chosen, {'pool': len(rows)}
    chosen, counts = {}, {}
    for split, size in (('train', per_task), ('test', test_per_task)):
        rows = [(i, row, files[split]) for i, row in enumerate(read_rows(files[split], task.dataset))]
        chosen[split] = draw(rows, size, seed, tags + (split,))
        counts[split] = len(rows)
    return chosen, counts


def build_pools(raw: str, seed: int, per_task, test_per_task) -> tuple[list[TaskPool], dict]:
    pools, raw_counts = [], {}
    for client in TABLE_34:
        for spec, task in client.specs():
            chosen, raw_counts[f'{client.name}/{spec.key}'] = chosen_rows(
                raw, task, client.name, spec.key, per_task, test_per_task, seed)
            pool = TaskPool(client.name, spec, client.kind)
            for split, rows in chosen.items():
                pool.candidates[split] = [to_candidate(row, i, path, raw, task) for i, row, path in rows]
            pools.append(pool)
    return pools, raw_counts


def prepare(raw: str, out_file: str, seed: int = 0, per_task: int | None = PER_TASK,
            test_per_task: int | None = TEST_PER_TASK, images: str = 'symlink') -> dict:
    """Writes out_file and <out_file stem>_summary.json; returns the summary."""
    pools, raw_counts = build_pools(raw, seed, per_task, test_per_task)
    return write_benchmark(BENCHMARK, pools, out_file, seed, {'train': None, 'test': None}, images, README,
                           notes={'per_task': {'train': per_task, 'test': test_per_task},
                                  'raw_records': raw_counts})


def main(argv=None) -> dict:
    parser = base_parser(' '.join(__doc__.split('\n\n')[0].split()), PER_TASK, TEST_PER_TASK)
    return run_cli(BENCHMARK, parser, argv, prepare, PER_TASK, TEST_PER_TASK)


if __name__ == '__main__':
    main(sys.argv[1:])

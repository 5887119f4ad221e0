"""PFL-Dynamic (FedMosaic §5, A.6; Koh et al. 2022 for the metrics): each client's data is a
stream of tasks that arrive one after another, training batches come from an episodic memory
of what has arrived, and evaluation follows what each client has seen.

- Tasks: the values of `fsplug.data.task_field` in a client's records, ordered by name
  ('sorted') or, 'rotated', starting at index (client − 1) mod T, so that clients are on
  different tasks at the same time. Records carry their task's rank and their client's task
  count (`annotate`), so any process can tell what is visible when.
- Schedule: with R rounds and T tasks, task s owns rounds [⌈sR/T⌉, ⌈(s+1)R/T⌉); in each of its
  rounds another equal share of its training records enters the memory (at the round's
  start), so by the end of its last round the whole task is in memory (`revealed`).
- Memory-only training with infinite memory (the paper's setup, A.6): every batch is drawn
  uniformly without replacement from everything that has arrived (`MemoryStream`).
- Evaluation after round k: 'Self' is the client's test records of the tasks it has started
  (rank <= its stage at k); 'Others' the other clients' test records of the tasks they have
  started (`visible`).
- Metrics: A_last, the accuracy at the last evaluation, and A_AUC, the area under the
  accuracy-per-evaluation curve divided by its length (the mean over evaluations taken at
  equal intervals) (`last_and_auc`).
"""
from __future__ import annotations

import math

import numpy as np

from fs_plugins.core.errors import DataFileError
from fs_plugins.core.seeding import derive_seed

TASK_RANK, TASK_COUNT, OWNER = '_task_rank', '_task_count', '_owner'


def task_order(records: list[dict], field: str, order: str, client_id: int) -> list:
    """The client's tasks in arrival order."""
    tasks = sorted({str(r[field]) for r in records})
    if order == 'rotated' and tasks:
        shift = (client_id - 1) % len(tasks)
        tasks = tasks[shift:] + tasks[:shift]
    return tasks


def annotate(splits: dict[str, list[dict]], field: str, order: str, client_id: int,
             origin: str = '') -> dict:
    """Copies of one client's records with their task rank, task count and owner (`origin`:
    the data file, for errors)."""
    everything = [r for part in splits.values() for r in part]
    missing = [r.get('id', i) for i, r in enumerate(everything) if field not in r]
    if missing:
        source = f' of {origin}' if origin else ''
        raise DataFileError(f"fsplug.data.task_field = '{field}': client {client_id}'s records "
                            f"{missing[:5]}{source} have no such field: add it to them, or set "
                            "fsplug.data.task_field to a field they have")
    ranks = {task: i for i, task in enumerate(task_order(everything, field, order, client_id))}
    return {name: [{**r, TASK_RANK: ranks[str(r[field])], TASK_COUNT: len(ranks),
                    OWNER: client_id} for r in part] for name, part in splits.items()}


def stage(round_idx: int, total_rounds: int, task_count: int) -> int:
    """The task (0-based rank) a client with `task_count` tasks is on in round `round_idx`."""
    return min(task_count - 1, (round_idx * task_count) // total_rounds)


def _stage_start(s: int, total_rounds: int, task_count: int) -> int:
    return math.ceil(s * total_rounds / task_count)


def revealed(ranked_counts: list[int], round_idx: int, total_rounds: int) -> int:
    """How many training records (sorted by task rank; ranked_counts[s] of task s) are in the
    memory during round `round_idx`."""
    tasks = len(ranked_counts)
    s = stage(round_idx, total_rounds, tasks)
    start, end = _stage_start(s, total_rounds, tasks), _stage_start(s + 1, total_rounds, tasks)
    share = (round_idx - start + 1) / max(end - start, 1)
    return sum(ranked_counts[:s]) + max(1, math.ceil(share * ranked_counts[s]))


def visible(record: dict, round_idx: int, total_rounds: int) -> bool:
    """Whether a (test) record's task has started by round `round_idx` for its owner."""
    return record[TASK_RANK] <= stage(round_idx, total_rounds, record[TASK_COUNT])


class MemoryStream:
    """Training batches drawn from an episodic memory: the first `size` examples of a dataset
    whose records are sorted by task rank. Draw d uses derive_seed(seed, 'memory', client, d)."""

    def __init__(self, dataset, collate, batch_size: int, seed: int, client_id: int):
        if len(dataset) == 0:
            raise ValueError(f"Client {client_id} has no training examples")
        self.dataset, self.collate = dataset, collate
        self.batch_size, self.seed, self.client_id = batch_size, seed, client_id
        self.size, self.draws = 0, 0

    def set_memory(self, size: int) -> None:
        self.size = max(1, min(size, len(self.dataset)))

    def next(self) -> dict:
        rng = np.random.default_rng(derive_seed(self.seed, 'memory', self.client_id, self.draws))
        self.draws += 1
        idx = rng.choice(self.size, size=min(self.batch_size, self.size), replace=False)
        return self.collate([self.dataset[int(i)] for i in sorted(idx)])

    def state_dict(self) -> dict:
        return {'size': self.size, 'draws': self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.size, self.draws = int(state['size']), int(state['draws'])


def last_and_auc(values: list[float]) -> tuple[float, float]:
    """(A_last, A_AUC) of one accuracy-per-evaluation curve (evaluations at equal intervals)."""
    if not values:
        return float('nan'), float('nan')
    return float(values[-1]), float(np.mean(values))

"""Deterministic batch order, owned by the plugin so both runners draw the same batches."""
from __future__ import annotations

import math

import numpy as np

from fs_plugins.core.seeding import derive_seed


class BatchStream:
    """An endless stream of training batches for one client.

    Epoch e is a permutation drawn from derive_seed(seed, 'batches', client_id, e); the stream
    continues across rounds, so every record is seen before any is repeated."""

    def __init__(self, dataset, collate, batch_size: int, seed: int, client_id: int):
        if len(dataset) == 0:
            raise ValueError(f"Client {client_id} has no training examples")
        self.dataset, self.collate = dataset, collate
        self.batch_size, self.seed, self.client_id = batch_size, seed, client_id
        self.epoch, self.order, self.pos = -1, np.empty(0, dtype=int), 0

    def _next_epoch(self):
        self.epoch += 1
        rng = np.random.default_rng(derive_seed(self.seed, 'batches', self.client_id, self.epoch))
        self.order, self.pos = rng.permutation(len(self.dataset)), 0

    def next(self) -> dict:
        if self.pos >= len(self.order):
            self._next_epoch()
        idx = self.order[self.pos:self.pos + self.batch_size]
        self.pos += len(idx)
        return self.collate([self.dataset[int(i)] for i in idx])

    def state_dict(self) -> dict:
        return {'epoch': self.epoch, 'pos': self.pos}

    def load_state_dict(self, state: dict) -> None:
        """Continues where `state` was taken (an epoch's order follows from its number)."""
        epoch = int(state['epoch'])
        self.epoch, self.order = -1, np.empty(0, dtype=int)
        if epoch >= 0:
            self.epoch = epoch - 1
            self._next_epoch()
        self.pos = int(state['pos'])


def local_steps(train_keys, num_train: int, batch_size: int) -> int:
    """Optimiser steps per round, with FS's meaning of train.local_update_steps (`train_keys`:
    FS's `train` section)."""
    if train_keys.batch_or_epoch == 'epoch':
        return int(train_keys.local_update_steps) * math.ceil(num_train / batch_size)
    return int(train_keys.local_update_steps)


def eval_batches(dataset, collate, batch_size: int):
    for start in range(0, len(dataset), batch_size):
        yield collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])

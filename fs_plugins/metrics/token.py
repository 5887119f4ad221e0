"""Token-level metrics on answer tokens (labels != ignore index)."""
from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100


def next_token_accuracy(labels, logits) -> float:
    """Share of answer tokens whose next-token prediction (argmax of the previous position's
    logits) is right. labels: (B, T) ints; logits: (B, T, V)."""
    labels, logits = np.asarray(labels), np.asarray(logits)
    target, pred = labels[:, 1:], logits[:, :-1].argmax(-1)
    mask = target != IGNORE_INDEX
    return float((pred[mask] == target[mask]).mean()) if mask.any() else float('nan')

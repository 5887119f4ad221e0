"""Token-level metrics on answer tokens (labels != IGNORE_INDEX), shared by the clients'
evaluation and the metric registered with FederatedScope."""
from __future__ import annotations

import torch

from fs_plugins.data.instruction import IGNORE_INDEX


def answer_token_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int, int]:
    """(summed cross-entropy, correct next-token predictions, answer tokens) for one batch.

    Position t's logits predict token t + 1; only targets != IGNORE_INDEX count.
    logits: (B, T, V); labels: (B, T)."""
    pred, target = logits[:, :-1].float(), labels[:, 1:]
    mask = target != IGNORE_INDEX
    loss_sum = torch.nn.functional.cross_entropy(pred[mask], target[mask], reduction='sum').item()
    correct = (pred.argmax(-1)[mask] == target[mask]).sum().item()
    return loss_sum, int(correct), int(mask.sum())


def next_token_accuracy(labels, logits) -> float:
    """Share of answer tokens whose next-token prediction is right (nan without any)."""
    _, correct, count = answer_token_stats(torch.as_tensor(logits), torch.as_tensor(labels))
    return correct / count if count else float('nan')

"""Server-side knowledge distillation maths (PerAda, after FedDF): the ensemble teacher and
the distillation loss, as pure functions over logits."""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F


def ensemble_logits(client_logits: Iterable[torch.Tensor]) -> torch.Tensor:
    """The teacher: the clients' logits averaged with equal weight (PerAda's Distillation,
    after FedDF: out_t = Σ_k logits_k / K), in float32. Summed as they come, so an iterable
    holds one client's logits at a time."""
    total, count = None, 0
    for logits in client_logits:
        if total is None:
            total = logits.float().clone()
        elif logits.shape != total.shape:
            raise ValueError(f"ensemble_logits: the clients' logits differ in shape: "
                             f"{tuple(total.shape)} and {tuple(logits.shape)}")
        else:
            total += logits.float()
        count += 1
    if not count:
        raise ValueError('ensemble_logits: no client logits')
    return total / count


def kd_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                  temperature: float = 1.0) -> torch.Tensor:
    """KL(softmax(t/T) ‖ softmax(s/T)) averaged over the rows (batchmean; PerAda's
    `divergence`, no T² factor), for (rows, classes) logits."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f'kd_divergence: student logits {tuple(student_logits.shape)} vs '
                         f'teacher {tuple(teacher_logits.shape)}')
    return F.kl_div(F.log_softmax(student_logits.float() / temperature, dim=-1),
                    F.softmax(teacher_logits.float() / temperature, dim=-1),
                    reduction='batchmean')

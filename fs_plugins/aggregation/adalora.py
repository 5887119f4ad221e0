"""AdaLoRA's rank allocation on the server (Zhang et al., "Adaptive Budget Allocation for
Parameter-Efficient Fine-Tuning", ICLR 2023): the cubic budget schedule (§3.3, eq. 11) and the
mask that keeps the `budget` singular-value triplets of highest importance (eq. 12), over all
adapted matrices at once. Schedule counted in federated rounds instead of optimiser steps."""
from __future__ import annotations

import torch


def adalora_budget(rounds_done: int, total_rounds: int, initial_rounds: int, final_rounds: int,
                   initial_budget: int, target_budget: int) -> int:
    """b(t) of AdaLoRA eq. 11 after `rounds_done` rounds: the initial budget during the first
    `initial_rounds`, the target budget during the last `final_rounds`, and between them
    b_T + (b_0 - b_T) (1 - (t - t_i) / (T - t_i - t_f))³ (rounded down, as peft's
    RankAllocator.budget_schedule)."""
    if rounds_done <= initial_rounds:
        return initial_budget
    if rounds_done > total_rounds - final_rounds:
        return target_budget
    span = total_rounds - final_rounds - initial_rounds
    remaining = 1 - (rounds_done - initial_rounds) / span
    return int((initial_budget - target_budget) * remaining ** 3 + target_budget)


def budget_mask(scores: dict[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
    """{name: bool (r_name,)}: True for the `budget` triplets of highest score across every
    matrix (ties: the earlier name in sorted order, then the lower index), False elsewhere."""
    names = sorted(scores)
    flat = torch.cat([scores[n].reshape(-1).double() for n in names])
    if not 0 <= budget <= flat.numel():
        raise ValueError(f'AdaLoRA budget {budget} outside [0, {flat.numel()}] triplets')
    order = torch.sort(-flat, stable=True).indices
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[order[:budget]] = True
    return dict(zip(names, keep.split([scores[n].numel() for n in names])))

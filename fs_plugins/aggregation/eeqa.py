"""SmartFed's Elastic Expert Quota Allocation (EEQA, Algorithm 1 of the SmartFed paper): how many
rank-wise experts each parameter matrix may activate (its top-q), given the matrices' importance.

    Phase 1 (proportional guarantee): q_j = min(⌊α_j·B⌋, M)
    Phase 2 (greedy residual):        R = B − Σ q_j; the matrices below the cap M, by α_j
                                      descending, each take min(M − q_j, R) until R = 0

α_j are the normalised importance scores (Σ α_j = 1), B = K·J the expert budget (K experts per
matrix on average over J matrices) and M the per-matrix cap. Ties in α keep the matrices' order
(a stable sort). When B > J·M the budget cannot be spent: every matrix gets M.
"""
from __future__ import annotations

import math

# α_j·B is floored after adding this, so that e.g. 0.29 · 100 = 28.999999999999996 gives 29
FLOOR_TOLERANCE = 1e-9


def normalised_importance(importance) -> list[float]:
    """The scores divided by their sum; negative, non-finite or all-zero scores fail, naming
    the matrix index."""
    scores = [float(x) for x in importance]
    for index, score in enumerate(scores):
        if not math.isfinite(score) or score < 0:
            raise ValueError(f"EEQA importance of matrix {index} is {score}: scores must be "
                             f"finite and non-negative")
    total = sum(scores)
    if not scores or total <= 0:
        raise ValueError(f"EEQA needs at least one positive importance score, got {scores}")
    return [s / total for s in scores]


def eeqa_quota(importance, budget: int, cap: int) -> list[int]:
    """Expert quota per matrix (Algorithm 1) from importance scores (normalised here),
    the total budget B and the per-matrix cap M."""
    if budget < 0 or cap < 0 or int(budget) != budget or int(cap) != cap:
        raise ValueError(f"EEQA budget ({budget}) and cap ({cap}) must be non-negative integers")
    alphas = normalised_importance(importance)
    quota = [min(math.floor(a * budget + FLOOR_TOLERANCE), cap) for a in alphas]
    residual = budget - sum(quota)
    with_room = sorted((j for j in range(len(quota)) if quota[j] < cap),
                       key=lambda j: -alphas[j])
    for j in with_room:
        if residual <= 0:
            break
        step = min(cap - quota[j], residual)
        quota[j] += step
        residual -= step
    return quota

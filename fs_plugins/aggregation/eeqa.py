"""SmartFed's Elastic Expert Quota Allocation (EEQA, Algorithm 1 of the SmartFed paper): how many
rank-wise experts each parameter matrix may activate (its top-q), given the matrices' importance.

    Phase 1 (proportional guarantee): q_j = min(⌊α_j·B⌋, M)
    Phase 2 (greedy residual):        R = B − Σ q_j; S = the matrices with q_j < M, sorted by
                                      α_j descending; each j in S in turn takes
                                      Δ = min(M − q_j, R) (all it can hold, not one at a time)
                                      until R = 0

α_j are the normalised importance scores (Σ α_j = 1), B = K·J the expert budget (K experts per
matrix on average over J matrices) and M the per-matrix upper bound. Algorithm 1 has one M; a
list of caps M_j (one per matrix, e.g. each matrix's own expert pool when pools differ) runs the
same two phases with M_j in place of M. Ties in α keep the matrices' order (a stable sort; the
paper does not say). When B ≥ Σ_j M_j the budget cannot be spent freely: every matrix gets its
cap whatever the importance (with one M: M ≤ K makes EEQA uniform).

Rounding: phase 1 is the paper's floor. The product α_j·B is floored after adding
FLOOR_TOLERANCE (1e-9), only so that a share whose exact value is an integer but whose floating
point product falls just below it (0.29 · 100 = 28.999999999999996) floors to that integer; no
product more than 1e-9 below an integer is affected (budgets here are at most thousands, where
float64's error is ~1e-13). Phase 1's floors leave R < J; phase 2 hands it out whole.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

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


def _caps(cap, count: int) -> list[int]:
    caps = list(cap) if isinstance(cap, Sequence) else [cap] * count
    if len(caps) != count:
        raise ValueError(f"EEQA: {len(caps)} caps for {count} matrices")
    return caps


def eeqa_quota(importance, budget: int, cap) -> list[int]:
    """Expert quota per matrix (Algorithm 1) from importance scores (normalised here), the
    total budget B and the per-matrix cap M (an int, or one cap M_j per matrix)."""
    alphas = normalised_importance(importance)
    caps = _caps(cap, len(alphas))
    if budget < 0 or int(budget) != budget or any(c < 0 or int(c) != c for c in caps):
        raise ValueError(f"EEQA budget ({budget}) and cap ({cap}) must be non-negative integers")
    quota = [min(math.floor(a * budget + FLOOR_TOLERANCE), m) for a, m in zip(alphas, caps)]
    residual = budget - sum(quota)
    with_room = sorted((j for j in range(len(quota)) if quota[j] < caps[j]),
                       key=lambda j: -alphas[j])
    for j in with_room:
        if residual <= 0:
            break
        step = min(caps[j] - quota[j], residual)
        quota[j] += step
        residual -= step
    return [int(q) for q in quota]


def eeqa_is_forced(budget: int, cap, count: int) -> bool:
    """Whether EEQA's allocation is the same for every importance: the budget fills every cap
    (B ≥ Σ M_j; with one M and B = K·J: M ≤ K)."""
    return budget >= sum(_caps(cap, count))

"""DoFIT's inter-domain aggregation (Xu et al., NeurIPS 2024; code github.com/1xbq1/DoFIT,
`federated_learning/fed_global.py`), over the domains' intra-domain (FedAvg) LoRA states.

1. importance of a LoRA unit u in domain d: I_d(u) = ‖θ_d[u]‖² (squared Frobenius norm);
2. Top_d: the k most important units of domain d; the overlap O = ∩_d Top_d;
3. θ̄[u] = (1/D) Σ_d θ_d[u] for u in O (uniform over domains);
4. each domain's next initialisation, for u in O only (the rest keep their intra-domain value):
   - 'assign' (DoFIT-base, paper Fig. 1b): θ_d[u] ← θ̄[u];
   - 'proximal' (DoFIT's proximal perturbation initialisation, as released):
     θ_d[u] ← θ_d[u] + λ·|θ_d[u] − θ̄[u]| / ‖θ_d[u] − θ̄[u]‖₂ (|·| element-wise); a unit equal to
     its mean (zero difference) stays as it is.

A unit is one tensor (the released code scores every lora_A and lora_B separately) or one
layer's (A, B) pair scored together, ‖A‖² + ‖B‖² (`units_of`).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fs_plugins.aggregation.pairs import is_lora_factor, lora_pairs

INITS = ('proximal', 'assign')
GRANULARITIES = ('tensor', 'module')


def units_of(names, granularity: str) -> dict[str, tuple[str, ...]]:
    """{unit: the tensor names it covers} over the LoRA factors among `names`."""
    factors = sorted(n for n in names if is_lora_factor(n))
    if granularity == 'tensor':
        return {n: (n,) for n in factors}
    if granularity == 'module':
        return dict(lora_pairs(factors))
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def importance(state: dict[str, torch.Tensor], units: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """I(u) = Σ over the unit's tensors of their squared Frobenius norm."""
    return {unit: sum(float(state[n].detach().double().pow(2).sum()) for n in names)
            for unit, names in units.items()}


def top_units(scores: dict[str, float], k: int) -> set[str]:
    """The k highest-scoring units (ties: the unit named first)."""
    ranked = sorted(scores, key=lambda unit: (-scores[unit], unit))
    return set(ranked[:k])


def overlap(states: Sequence[dict[str, torch.Tensor]], units: dict[str, tuple[str, ...]],
            k: int) -> list[str]:
    """O = ∩_d Top_d: the units among every domain's k most important."""
    tops = [top_units(importance(state, units), k) for state in states]
    return sorted(set.intersection(*tops))


def proximal_perturbation(own: torch.Tensor, mean: torch.Tensor, scale: float) -> torch.Tensor:
    """own + scale·|own − mean| / ‖own − mean‖₂ (own unchanged where own == mean)."""
    diff = (own.double() - mean.double())
    norm = diff.norm()
    if norm == 0:
        return own.clone()
    return (own.double() + scale * diff.abs() / norm).to(own.dtype)


def dofit_inter_domain(states: Sequence[dict[str, torch.Tensor]], k: int, init: str = 'proximal',
                       scale: float = 1.0, granularity: str = 'tensor'
                       ) -> tuple[list[dict[str, torch.Tensor]], list[str]]:
    """(each domain's next state, the overlapping units) from the domains' intra-domain states
    (same names and shapes; tensors that are not LoRA factors pass through unchanged)."""
    if len(states) < 2:
        raise ValueError(f"DoFIT's inter-domain step needs at least 2 domains, got {len(states)}")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    names = set(states[0])
    for d, state in enumerate(states[1:], start=1):
        if set(state) != names:
            raise ValueError(f"Domain {d} holds other tensors than domain 0: "
                             f"{sorted(set(state) ^ names)[:3]}")
    units = units_of(names, granularity)
    shared = overlap(states, units, k)
    out = [dict(state) for state in states]
    for unit in shared:
        for name in units[unit]:
            mean = sum(state[name].double() for state in states) / len(states)
            for d, state in enumerate(states):
                out[d][name] = (mean.to(state[name].dtype) if init == 'assign'
                                else proximal_perturbation(state[name], mean, scale))
    return out, shared

"""FLAME's activation-aware aggregation of expert LoRA factors, as pure functions.

Client i trained on |D_i| samples; f_i^j = a_i^j / S_i ∈ [0, 1] is how often expert j of an MoE
layer was activated there (paper §3, Eq. 6), from per-expert counts and a total
(`activation_frequency`): routed token slots of expert j / all routed token slots
(non-padding tokens × k_i), or activated steps / local steps S_i. The server weighs client i
on expert j by

    γ_i^j = (f_i^j)^t · |D_i|,      p_i^j = γ_i^j / Σ_l γ_l^j          (Eq. 6, 7)

(temperature t; t = 0 gives FedAvg's p_i = |D_i| / Σ|D_l|). An expert that no client of the
round activated keeps its previous global value.

Fused expert factors are split per expert with `aggregation.experts.split_experts`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fs_plugins.aggregation.average import weighted_average
from fs_plugins.aggregation.experts import block_of, is_expert_factor, merge_experts, split_experts

__all__ = ['activation_frequency', 'activation_aware_weights', 'frequency_summary',
           'split_experts', 'merge_experts', 'aggregate_expert_factor', 'activation_aware_average']


def activation_frequency(counts, totals) -> torch.Tensor:
    """(K × E) float64 frequencies f_i^j = a_i^j / S_i from (K × E) counts and (K,) totals
    (a (E,) count vector with a scalar total is one client). Each count must lie in [0, total];
    a client with total 0 has frequency 0."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    if counts.dim() == 1:
        counts = counts[None]
    totals = torch.as_tensor(totals, dtype=torch.float64).reshape(-1)
    if counts.dim() != 2:
        raise ValueError(f'counts must be (clients × experts), got shape {tuple(counts.shape)}')
    if totals.numel() != counts.shape[0]:
        raise ValueError(f'counts has {counts.shape[0]} clients but totals has {totals.numel()} entries')
    if (counts < 0).any() or (totals < 0).any():
        raise ValueError('activation counts and totals must be non-negative')
    if (counts > totals[:, None]).any():
        bad = int(torch.nonzero((counts > totals[:, None]).any(dim=1))[0])
        raise ValueError(f'client {bad}: an expert count exceeds its total {float(totals[bad]):g}')
    return torch.where(totals[:, None] > 0, counts / totals.clamp(min=1e-300)[:, None],
                       torch.zeros_like(counts))


def activation_aware_weights(frequency, sizes, temperature: float) -> torch.Tensor:
    """(K × E) float64 weights p_i^j = γ_i^j / Σ_l γ_l^j with γ_i^j = (f_i^j)^t · |D_i|.

    frequency: (K × E) activation frequencies in [0, 1] (`activation_frequency`); sizes: (K,)
    |D_i|. Columns sum to 1 for every expert some client activated; the column of an expert no
    client activated is all zero (for every t, so the caller keeps its previous value)."""
    frequency = torch.as_tensor(frequency, dtype=torch.float64)
    sizes = torch.as_tensor(sizes, dtype=torch.float64).reshape(-1)
    if frequency.dim() != 2:
        raise ValueError(f'frequency must be (clients × experts), got shape {tuple(frequency.shape)}')
    if sizes.numel() != frequency.shape[0]:
        raise ValueError(f'frequency has {frequency.shape[0]} clients but sizes has {sizes.numel()} entries')
    if (frequency < 0).any() or (frequency > 1).any() or (sizes < 0).any():
        raise ValueError('frequencies must lie in [0, 1] and sizes be non-negative')
    gamma = frequency.pow(float(temperature)) * sizes[:, None]
    gamma = gamma * (frequency > 0).any(dim=0)[None, :]
    total = gamma.sum(dim=0)
    return torch.where(total > 0, gamma / total.clamp(min=torch.finfo(torch.float64).tiny),
                       torch.zeros_like(gamma))


def frequency_summary(frequency) -> tuple[float, float, float]:
    """(min, median, max) of one MoE layer's (E,) activation frequencies."""
    frequency = torch.as_tensor(frequency, dtype=torch.float64).reshape(-1)
    return float(frequency.min()), float(frequency.median()), float(frequency.max())


def aggregate_expert_factor(key: str, client_tensors: Sequence[torch.Tensor],
                            weights: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """Σ_i p_i^j X_i^j per expert j of one fused factor; experts whose weight column is all zero
    keep `previous` (the global value). weights: (K × E) from `activation_aware_weights`.
    Accumulates in float32 (float64 for float64 inputs); returns the input dtype."""
    num_clients, num_experts = weights.shape
    if len(client_tensors) != num_clients:
        raise ValueError(f"'{key}': {len(client_tensors)} client tensors, {num_clients} weight rows")
    shapes = {tuple(t.shape) for t in client_tensors}
    if len(shapes) > 1:
        raise ValueError(f"'{key}': clients sent different shapes {sorted(shapes)}")
    dtype = client_tensors[0].dtype
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    acc = None
    for tensor, column in zip(client_tensors, weights):
        stack = split_experts(key, tensor.detach().to('cpu', acc_dtype), num_experts)
        term = column.to(acc_dtype).reshape(-1, 1, 1) * stack
        acc = term if acc is None else acc + term
    keep = weights.sum(dim=0) == 0
    if keep.any():
        if previous is None:
            raise ValueError(f"'{key}': experts {torch.nonzero(keep).flatten().tolist()} were "
                             f"activated by no client and there is no previous global value")
        old = split_experts(key, previous.detach().to('cpu', acc_dtype), num_experts)
        acc = torch.where(keep.reshape(-1, 1, 1), old, acc)
    return merge_experts(key, acc).to(dtype)


def activation_aware_average(previous: dict, states: Sequence[dict], sizes: Sequence[float],
                             counts: Sequence[dict], totals: Sequence[dict],
                             temperature: float) -> dict:
    """FLAME's server step as a pure function: every fused expert factor the clients share is
    averaged expert by expert with `activation_aware_weights` (experts no client activated
    keep `previous`); every other shared tensor is weighted FedAvg with `sizes`.

    states: the clients' shared tensors; counts / totals: per client {MoE block: (E,) counts}
    and {MoE block: () total} (`activation_frequency`); sizes: |D_i| (the FedAvg weights).
    Returns the merged tensors."""
    shared = set.intersection(*(set(s) for s in states))
    merged = weighted_average([{k: v for k, v in s.items() if not is_expert_factor(k)}
                               for s in states], sizes)
    weights = {}
    for key in sorted(k for k in shared if is_expert_factor(k)):
        block = block_of(key)
        if block not in weights:
            missing = [i for i, (c, t) in enumerate(zip(counts, totals))
                       if block not in c or block not in t]
            if missing:
                raise KeyError(f"'{key}': client(s) {missing} sent no activation counts for "
                               f"MoE block '{block}'")
            frequency = activation_frequency(
                torch.stack([torch.as_tensor(c[block], dtype=torch.float64) for c in counts]),
                torch.tensor([float(t[block]) for t in totals], dtype=torch.float64))
            weights[block] = activation_aware_weights(frequency, sizes, temperature)
        merged[key] = aggregate_expert_factor(key, [s[key] for s in states], weights[block],
                                              previous.get(key))
    return merged

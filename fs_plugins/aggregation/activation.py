"""FLAME's activation-aware aggregation of expert LoRA factors, as pure functions.

Client i trained S_i local steps on |D_i| samples; expert j of an MoE layer was selected for at
least one token in a_i^j of those steps. The server weighs client i on expert j by

    γ_i^j = (a_i^j / S_i)^t · |D_i|,      p_i^j = γ_i^j / Σ_l γ_l^j

(temperature t; t = 0 gives FedAvg's p_i = |D_i| / Σ|D_l|). An expert that no client of the
round activated keeps its previous global value.

Fused expert factors are split per expert with `aggregation.experts.split_experts`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from fs_plugins.aggregation.average import weighted_average
from fs_plugins.aggregation.experts import block_of, is_expert_factor, merge_experts, split_experts

__all__ = ['activation_aware_weights', 'split_experts', 'merge_experts',
           'aggregate_expert_factor', 'activation_aware_average']


def activation_aware_weights(counts, steps, sizes, temperature: float) -> torch.Tensor:
    """(K × E) float64 weights p_i^j = γ_i^j / Σ_l γ_l^j with γ_i^j = (a_i^j / S_i)^t · |D_i|.

    counts: (K × E) activated-step counts a_i^j; steps: (K,) local steps S_i; sizes: (K,)
    dataset sizes |D_i|. Columns sum to 1 for every expert some client activated; the column
    of an expert no client activated is all zero (for every t, so the caller keeps its previous
    value). A client with S_i = 0 has activation frequency 0."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    steps = torch.as_tensor(steps, dtype=torch.float64).reshape(-1)
    sizes = torch.as_tensor(sizes, dtype=torch.float64).reshape(-1)
    if counts.dim() != 2:
        raise ValueError(f'counts must be (clients × experts), got shape {tuple(counts.shape)}')
    clients = counts.shape[0]
    if steps.numel() != clients or sizes.numel() != clients:
        raise ValueError(f'counts has {clients} clients but steps has {steps.numel()} and sizes '
                         f'{sizes.numel()} entries')
    if (counts < 0).any() or (steps < 0).any() or (sizes < 0).any():
        raise ValueError('counts, steps and sizes must be non-negative')
    if (counts > steps[:, None]).any():
        bad = int(torch.nonzero((counts > steps[:, None]).any(dim=1))[0])
        raise ValueError(f'client {bad}: an expert count exceeds its {int(steps[bad])} local steps')
    frequency = torch.where(steps[:, None] > 0, counts / steps.clamp(min=1)[:, None],
                            torch.zeros_like(counts))
    gamma = frequency.pow(float(temperature)) * sizes[:, None]
    activated = (counts > 0).any(dim=0)
    gamma = gamma * activated[None, :]
    total = gamma.sum(dim=0)
    return torch.where(total > 0, gamma / total.clamp(min=torch.finfo(torch.float64).tiny),
                       torch.zeros_like(gamma))


def aggregate_expert_factor(key: str, client_tensors: Sequence[torch.Tensor],
                            weights: torch.Tensor, previous: Optional[torch.Tensor]) -> torch.Tensor:
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
                             steps: Sequence[float], counts: Sequence[dict],
                             temperature: float) -> dict:
    """FLAME's server step as a pure function: every fused expert factor the clients share is
    averaged expert by expert with `activation_aware_weights` (experts no client activated
    keep `previous`); every other shared tensor is sample-weighted FedAvg.

    states: the clients' shared tensors; counts: per client {MoE block: (E,) activated-step
    counts}; steps: local steps S_i; sizes: |D_i|. Returns the merged tensors."""
    shared = set.intersection(*(set(s) for s in states))
    merged = weighted_average([{k: v for k, v in s.items() if not is_expert_factor(k)}
                               for s in states], sizes)
    weights = {}
    for key in sorted(k for k in shared if is_expert_factor(k)):
        block = block_of(key)
        if block not in weights:
            missing = [i for i, c in enumerate(counts) if block not in c]
            if missing:
                raise KeyError(f"'{key}': client(s) {missing} sent no activation counts for "
                               f"MoE block '{block}'")
            weights[block] = activation_aware_weights(torch.stack([c[block] for c in counts]),
                                                      steps, sizes, temperature)
        merged[key] = aggregate_expert_factor(key, [s[key] for s in states], weights[block],
                                              previous.get(key))
    return merged

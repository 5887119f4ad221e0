"""FLAME's activation-aware aggregation of expert LoRA factors, as pure functions.

Client i trained S_i local steps on |D_i| samples; expert j of an MoE layer was selected for at
least one token in a_i^j of those steps. The server weighs client i on expert j by

    γ_i^j = (a_i^j / S_i)^t · |D_i|,      p_i^j = γ_i^j / Σ_l γ_l^j

(temperature t; t = 0 gives FedAvg's p_i = |D_i| / Σ|D_l|). An expert that no client of the
round activated keeps its previous global value.

Fused expert LoRA (peft `target_parameters` on a 3-D expert parameter, E experts, rank r):
lora_A is (E·r, d_in) with expert e's rows at [e·r, (e+1)·r) — i.e. reshape(E, r, d_in) — and
lora_B is (d_out, E·r) with expert e's columns at e, e+E, e+2E, … — i.e. reshape(d_out, r, E).
`split_experts` / `merge_experts` convert between that layout and a per-expert stack.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from fs_plugins.aggregation.pairs import is_lora_a

__all__ = ['activation_aware_weights', 'split_experts', 'merge_experts',
           'aggregate_expert_factor']


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


def split_experts(key: str, tensor: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Fused factor -> per-expert stack: A (E·r, d_in) -> (E, r, d_in); B (d_out, E·r) -> (E, d_out, r)."""
    if tensor.dim() != 2:
        raise ValueError(f"'{key}': a fused expert LoRA factor must be 2-D, got {tuple(tensor.shape)}")
    rank_dim = 0 if is_lora_a(key) else 1
    if tensor.shape[rank_dim] % num_experts:
        raise ValueError(f"'{key}': shape {tuple(tensor.shape)} is not {num_experts} experts × rank")
    if is_lora_a(key):
        return tensor.reshape(num_experts, -1, tensor.shape[1])
    return tensor.reshape(tensor.shape[0], -1, num_experts).permute(2, 0, 1)


def merge_experts(key: str, stack: torch.Tensor) -> torch.Tensor:
    """Inverse of `split_experts`."""
    if is_lora_a(key):
        return stack.reshape(-1, stack.shape[-1]).contiguous()
    num_experts, d_out, rank = stack.shape
    return stack.permute(1, 2, 0).reshape(d_out, rank * num_experts).contiguous()


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

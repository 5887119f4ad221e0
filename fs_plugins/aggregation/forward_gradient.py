"""FwdLLM's server maths (Xu et al., "FwdLLM: Efficient FedLLM using Forward Gradient", USENIX
ATC 2024): the spread of the clients' forward-gradient updates that paces the number of
perturbations (variance-controlled perturbation count)."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def relative_update_variance(updates: Sequence[torch.Tensor], weights: Sequence[float]) -> float:
    """Σ p_k ‖Δ_k − Δ̄‖² / ‖Δ̄‖² with p_k = w_k / Σw and Δ̄ = Σ p_k Δ_k (flat updates): how
    noisy the clients' forward-gradient estimates are relative to their consensus (inf when the
    consensus is zero)."""
    if len(updates) != len(weights) or not updates:
        raise ValueError(f'{len(updates)} updates but {len(weights)} weights')
    p = torch.tensor(weights, dtype=torch.float64)
    p = p / p.sum()
    stacked = torch.stack([u.double().reshape(-1) for u in updates])
    mean = (p[:, None] * stacked).sum(0)
    spread = float((p * (stacked - mean).pow(2).sum(1)).sum())
    consensus = float(mean.pow(2).sum())
    return spread / consensus if consensus > 0 else float('inf')


def next_perturbation_count(count: int, variance: float, threshold: float, maximum: int) -> int:
    """Doubles the perturbations per step while the clients' relative update variance exceeds
    `threshold`, up to `maximum`; keeps the count otherwise."""
    return min(2 * count, maximum) if variance > threshold else count

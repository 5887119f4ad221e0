"""Adaptive server optimisers (Reddi et al., "Adaptive Federated Optimization", ICLR 2021).

With the pseudo-gradient Δ = average(client params) − global params, per tensor:
    m ← β1 m + (1 − β1) Δ
    v ← v + Δ²                                   (FedAdagrad)
    v ← β2 v + (1 − β2) Δ²                       (FedAdam)
    v ← v − (1 − β2) Δ² sign(v − Δ²)             (FedYogi)
    x ← x + η m / (√v + τ)
State (m, v) is kept per tensor name across rounds.
"""
from __future__ import annotations

import torch

VARIANTS = ('adagrad', 'adam', 'yogi')


def adaptive_server_step(global_state: dict, average: dict, moments: dict, variant: str,
                         lr: float, beta1: float, beta2: float, tau: float) -> tuple[dict, dict]:
    """Returns (new global state, new moments) for the tensors in `average`."""
    if variant not in VARIANTS:
        raise ValueError(f"server optimiser '{variant}' is not one of {VARIANTS}")
    new_global, new_moments = dict(global_state), dict(moments)
    for name, avg in average.items():
        x = global_state[name].to(torch.float32)
        delta = avg.to(torch.float32) - x
        m, v = moments.get(name, (torch.zeros_like(x), torch.zeros_like(x)))
        m = beta1 * m + (1 - beta1) * delta
        sq = delta * delta
        if variant == 'adagrad':
            v = v + sq
        elif variant == 'adam':
            v = beta2 * v + (1 - beta2) * sq
        else:
            v = v - (1 - beta2) * sq * torch.sign(v - sq)
        new_global[name] = (x + lr * m / (v.sqrt() + tau)).to(global_state[name].dtype)
        new_moments[name] = (m, v)
    return new_global, new_moments

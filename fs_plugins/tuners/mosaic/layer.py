"""One FedMosaic layer: peft's LoRA Linear with a frozen global module and a gate (Eq. 7).

    h = W0 x + (1 - σ(β)) h_local + σ(β) h_global
    conventional LoRA:  h_* = s · B_* A_* x          (A, B local and trainable; global frozen)
    PQ-LoRA (Eq. 5):    h_* = s · B (P_* A x + Q_*)  (A, B frozen and shared by both modules;
                                                      only P (r × r) and Q (r) train and travel)

The local module keeps peft's parameter names (lora_A / lora_B) so a conventional layer
uploads what FedAvg-LoRA uploads; P, Q, the gate β and the global module live in a child
`mosaic`. For PQ layers, B is applied once to the mixed r-dim activation, which equals mixing
the two outputs because B is shared and linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

MOSAIC_ATTR = 'mosaic'


class MosaicState(nn.Module):
    """P, Q (PQ layers), the gate β and the frozen global module of one layer."""

    def __init__(self, lora_a: torch.Tensor, lora_b: torch.Tensor, pq: bool,
                 q_init_std: float, generator: torch.Generator | None = None):
        super().__init__()
        r, dtype, device = lora_a.shape[0], lora_a.dtype, lora_a.device
        self.pq = pq
        self.beta = nn.Parameter(torch.zeros((), dtype=dtype, device=device))
        if pq:
            q = torch.randn(r, generator=generator, dtype=torch.float32) * q_init_std
            self.P = nn.Parameter(torch.eye(r, dtype=dtype, device=device))
            self.Q = nn.Parameter(q.to(dtype=dtype, device=device))
            self.register_buffer('global_P', self.P.detach().clone())
            self.register_buffer('global_Q', self.Q.detach().clone())
        else:
            self.register_buffer('global_A', lora_a.detach().clone())
            self.register_buffer('global_B', lora_b.detach().clone())

    def gate(self) -> torch.Tensor:
        return torch.sigmoid(self.beta)


class MosaicLinear(LoraLinear):
    """peft's LoRA Linear whose 'default' adapter is FedMosaic's local module (class swapped
    in by `inject_mosaic`, so peft's names, saving and loading stay)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters:
            return result
        state: MosaicState = getattr(self, MOSAIC_ATTR)
        lora_a, lora_b = self.lora_A['default'].weight, self.lora_B['default'].weight
        inputs = self.lora_dropout['default'](x).to(lora_a.dtype)
        gate = state.gate()
        if state.pq:
            projected = F.linear(inputs, lora_a)
            local = F.linear(projected, state.P) + state.Q
            shared = F.linear(projected, state.global_P) + state.global_Q
            delta = F.linear((1 - gate) * local + gate * shared, lora_b)
        else:
            local = F.linear(F.linear(inputs, lora_a), lora_b)
            shared = F.linear(F.linear(inputs, state.global_A), state.global_B)
            delta = (1 - gate) * local + gate * shared
        return result + (delta * self.scaling['default']).to(result.dtype)


def dense_reference(module: MosaicLinear, x: torch.Tensor) -> torch.Tensor:
    """Eqs. 5 and 7 written out with the full ΔW matrices (tests only; no dropout)."""
    state = getattr(module, MOSAIC_ATTR)
    a, b = module.lora_A['default'].weight, module.lora_B['default'].weight
    s, gate = module.scaling['default'], state.gate()
    base = module.base_layer(x)
    if state.pq:
        local = x @ (b @ state.P @ a).T + b @ state.Q
        shared = x @ (b @ state.global_P @ a).T + b @ state.global_Q
    else:
        local, shared = x @ (b @ a).T, x @ (state.global_B @ state.global_A).T
    return base + s * ((1 - gate) * local + gate * shared)

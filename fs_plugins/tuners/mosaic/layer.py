"""One FedMosaic layer: peft's LoRA Linear with a frozen global module and a gate (Eq. 7).

    h = W0 x + (1 - σ(β)) h_local + σ(β) h_global
    conventional LoRA:  h_* = s · B_* A_* x          (A, B local and trainable; global frozen;
                                                      s = alpha / r, peft's scaling)
    PQ-LoRA (Eq. 5):    h_* = B (P_* A x + Q_*)      (A, B frozen and shared by both modules;
                                                      only P (r × r) and Q (r) train and travel;
                                                      no alpha / r unless pq_scale = alpha_over_r)

The local module keeps peft's parameter names (lora_A / lora_B) so a conventional layer
uploads what FedAvg-LoRA uploads; P, Q and the global module live in a child `mosaic`. The
gate β is per decoder layer (paper §4.2.2: "at the l-th layer ... a learnable gating parameter
β"; Algorithm 1: one β per layer): one `MosaicGate` child of the decoder layer, referenced by
every FedMosaic module of that layer, so it is one parameter ('…layers.<i>.mosaic_gate.beta')
whose gradient sums over the layer's modules. gate = per_module gives every module its own β
('….mosaic.beta'). For PQ layers, B is applied once to the mixed r-dim activation, which
equals mixing the two outputs because B is shared and linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

MOSAIC_ATTR = 'mosaic'
GATE_ATTR = 'mosaic_gate'      # the per-layer gate's child of a decoder layer


class MosaicGate(nn.Module):
    """β of one decoder layer (Eq. 7), shared by all the layer's FedMosaic modules."""

    def __init__(self, dtype: torch.dtype, device):
        super().__init__()
        self.beta = nn.Parameter(torch.zeros((), dtype=dtype, device=device))


class MosaicState(nn.Module):
    """P, Q (PQ layers), the gate β (its own, or a reference to the decoder layer's
    MosaicGate) and the frozen global module of one layer; `local_only`: neither gate nor
    global module, h = W0 x + the local module (SFT on FedMosaic's architecture)."""

    def __init__(self, lora_a: torch.Tensor, lora_b: torch.Tensor, pq: bool,
                 q_init_std: float, generator: torch.Generator | None = None,
                 layer_gate: MosaicGate | None = None, pq_scaled: bool = False,
                 local_only: bool = False):
        super().__init__()
        r, dtype, device = lora_a.shape[0], lora_a.dtype, lora_a.device
        self.pq = pq
        self.pq_scaled = pq_scaled       # PQ-LoRA multiplied by peft's alpha / r
        self.local_only = local_only
        if local_only:
            layer_gate = None
        # a tuple, so the layer's gate is not registered here again: β is listed once, under
        # the decoder layer, and every module of the layer adds to its gradient
        self.layer_gate = (layer_gate,) if layer_gate is not None else ()
        if layer_gate is None and not local_only:
            self.beta = nn.Parameter(torch.zeros((), dtype=dtype, device=device))
        if pq:
            q = torch.randn(r, generator=generator, dtype=torch.float32) * q_init_std
            self.P = nn.Parameter(torch.eye(r, dtype=dtype, device=device))
            self.Q = nn.Parameter(q.to(dtype=dtype, device=device))
            if not local_only:
                self.register_buffer('global_P', self.P.detach().clone())
                self.register_buffer('global_Q', self.Q.detach().clone())
        elif not local_only:
            self.register_buffer('global_A', lora_a.detach().clone())
            self.register_buffer('global_B', lora_b.detach().clone())

    def beta_parameter(self) -> nn.Parameter:
        """This module's β: the decoder layer's (per-layer gate) or its own."""
        return self.layer_gate[0].beta if self.layer_gate else self.beta

    def gate(self) -> torch.Tensor:
        return torch.sigmoid(self.beta_parameter())


def output_scale(module: LoraLinear, state: MosaicState) -> float:
    """The factor of the adapter's output: peft's alpha / r for conventional LoRA, 1 for
    PQ-LoRA (Eq. 5) unless pq_scaled."""
    return module.scaling['default'] if (not state.pq or state.pq_scaled) else 1.0


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
        if state.local_only:
            hidden = (F.linear(F.linear(inputs, lora_a), state.P) + state.Q if state.pq
                      else F.linear(inputs, lora_a))
            return result + (F.linear(hidden, lora_b) * output_scale(self, state)).to(result.dtype)
        gate = state.gate()
        if state.pq:
            projected = F.linear(inputs, lora_a)
            local = F.linear(projected, state.P) + state.Q
            shared = F.linear(projected, state.global_P) + state.global_Q
            delta = F.linear((1 - gate) * local + gate * shared, lora_b)
        else:
            # (1 - g) B_l A_l x + g B_g A_g x, gated in rank space: what autograd keeps for the
            # gate is r-wide, not two d_out-wide outputs (Table 15's memory)
            local = F.linear((1 - gate) * F.linear(inputs, lora_a), lora_b)
            delta = local + F.linear(gate * F.linear(inputs, state.global_A), state.global_B)
        return result + (delta * output_scale(self, state)).to(result.dtype)


def dense_reference(module: MosaicLinear, x: torch.Tensor) -> torch.Tensor:
    """Eqs. 5 and 7 written out with the full ΔW matrices (tests only; no dropout)."""
    state = getattr(module, MOSAIC_ATTR)
    a, b = module.lora_A['default'].weight, module.lora_B['default'].weight
    s, base = output_scale(module, state), module.base_layer(x)
    if state.local_only:
        local = x @ (b @ state.P @ a).T + b @ state.Q if state.pq else x @ (b @ a).T
        return base + s * local
    gate = state.gate()
    if state.pq:
        local = x @ (b @ state.P @ a).T + b @ state.Q
        shared = x @ (b @ state.global_P @ a).T + b @ state.global_Q
    else:
        local, shared = x @ (b @ a).T, x @ (state.global_B @ state.global_A).T
    return base + s * ((1 - gate) * local + gate * shared)

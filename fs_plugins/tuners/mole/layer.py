"""N routed LoRA experts and a per-token top-K router, with sparse dispatch.

    routed(x) = sum_{i in TopK(z)} g_i(x) * s * B_i A_i x,   z = W_r x,
    g = softmax over the K selected logits (the others are 0), s = alpha / r.

Only the selected experts run: the (token, expert) assignments are sorted by expert, each
expert multiplies only its own tokens (one gather of the inputs, two small matmuls per active
expert), and the gated results are added back per token with `index_add_`. Compute therefore
grows with K, not with N; `dense_reference` is the compute-everything-then-mask formula the
tests compare against.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fs_plugins.tuners.mole.config import MoleConfig


class RoutedLoraExperts(nn.Module):
    def __init__(self, in_features: int, out_features: int, config: MoleConfig,
                 dtype=torch.float32, device=None):
        super().__init__()
        n, r = config.num_experts, config.r
        self.top_k, self.scaling = config.top_k, config.scaling
        self.in_features, self.out_features = in_features, out_features
        # stacked per-expert factors in peft's layout: A_i (r, d_in), B_i (d_out, r)
        self.expert_A = nn.Parameter(torch.empty(n, r, in_features, dtype=dtype, device=device))
        self.expert_B = nn.Parameter(torch.zeros(n, out_features, r, dtype=dtype, device=device))
        self.router = nn.Parameter(torch.empty(n, in_features, dtype=dtype, device=device))
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.reset_parameters(config.router_init_std)

    @property
    def num_experts(self) -> int:
        return self.expert_A.shape[0]

    @torch.no_grad()
    def reset_parameters(self, router_init_std: float) -> None:
        for a in self.expert_A:  # like peft's LoRA A: kaiming-uniform(a=sqrt(5)); B = 0
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.expert_B.zero_()
        if router_init_std > 0:
            nn.init.normal_(self.router, std=router_init_std)
        else:
            self.router.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token (rows of x): the K selected experts and their renormalised gates."""
        top_logits, top_experts = F.linear(x, self.router).topk(self.top_k, dim=-1)
        return top_experts, top_logits.softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead_shape = x.shape[:-1]
        tokens = x.reshape(-1, self.in_features).to(self.expert_A.dtype)
        experts, gates = self.route(tokens)
        flat_experts = experts.reshape(-1)
        order = flat_experts.argsort(stable=True)          # assignments grouped by expert
        token_of = order // self.top_k
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        inputs = self.dropout(tokens).index_select(0, token_of).split(counts)
        # gates scale the rank-r activations, not the d_out-wide outputs (r << d_out)
        weights = (gates.reshape(-1).index_select(0, order) * self.scaling).unsqueeze(-1)
        weights = weights.split(counts)
        # split / unbind once: indexing per expert would give each use a full-size backward
        a_factors, b_factors = self.expert_A.unbind(0), self.expert_B.unbind(0)
        pieces = [F.linear(F.linear(chunk, a_factors[e]) * weights[e], b_factors[e])
                  for e, chunk in enumerate(inputs) if chunk.shape[0]]
        out = tokens.new_zeros(tokens.shape[0], self.out_features)
        out.index_add_(0, token_of, torch.cat(pieces))
        return out.reshape(*lead_shape, self.out_features)


def dense_reference(layer: RoutedLoraExperts, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, masked by the top-K gates (tests only; no dropout)."""
    tokens = x.reshape(-1, layer.in_features).to(layer.expert_A.dtype)
    experts, gates = layer.route(tokens)
    dense_gates = torch.zeros(tokens.shape[0], layer.num_experts, dtype=gates.dtype,
                              device=gates.device).scatter(1, experts, gates)
    low = torch.einsum('td,nrd->tnr', tokens, layer.expert_A)
    outs = torch.einsum('tnr,nor->tno', low, layer.expert_B)
    out = torch.einsum('tn,tno->to', dense_gates, outs) * layer.scaling
    return out.reshape(*x.shape[:-1], layer.out_features)

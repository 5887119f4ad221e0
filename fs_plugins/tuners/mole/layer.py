"""N routed LoRA experts and a per-token top-K router, with sparse dispatch.

    routed(x) = sum_{i in TopK(z)} g_i(x) * s * B_i A_i x,   z = W_r x,
    g = softmax over the K selected logits (the others are 0), s = alpha / r.

Only the selected experts run (grouped dispatch): the (token, expert) assignments are sorted
by expert and packed into equal blocks, each holding one expert's tokens (`ExpertBlocks`); two
`torch.bmm` over the blocks do every expert's down and up projection at once, and the gated
results are added back per token with `index_add_`. Compute grows with K, not with N, and no
Python loop runs over the experts. `per_expert_loop` is the previous dispatch (one pair of
matmuls per expert, in a loop), which the grouped one is tested against and benchmarked with;
`dense_reference` is the compute-everything-then-mask formula.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fs_plugins.tuners.mole.config import MoleConfig

# block size = ceil(T*K / (this * active experts)): 2 bounds the padding to half the
# assignments and keeps the blocks few (measured: 1 pads more on SmolLM2, 4 is slower on the
# tiny model, scripts/bench_fedmole.py)
BLOCKS_PER_ACTIVE_EXPERT = 2


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
        if tokens.shape[0] == 0:
            return tokens.new_zeros(*lead_shape, self.out_features)
        experts, gates = self.route(tokens)
        blocks = ExpertBlocks(experts, self.num_experts)
        inputs = blocks.pack(self.dropout(tokens), blocks.token_of_row)
        # gates scale the rank-r activations, not the d_out-wide outputs (r << d_out)
        weights = blocks.pack(gates.reshape(-1, 1) * self.scaling, blocks.assignment_of_row)
        a_factors = self.expert_A.index_select(0, blocks.expert_of_block)  # (blocks, r, d_in)
        # B_i^T gathered into a contiguous (blocks, r, d_out): MKL's matmuls with a (d_out, r)
        # operand of leading dimension r were 5-7x slower here (AMD EPYC), forward and backward
        b_factors_t = self.expert_B.transpose(1, 2).index_select(0, blocks.expert_of_block)
        low = torch.bmm(inputs, a_factors.transpose(1, 2)) * weights
        outputs = torch.bmm(low, b_factors_t).reshape(-1, self.out_features)
        out = tokens.new_zeros(tokens.shape[0] + 1, self.out_features)   # + padding's row
        out.index_add_(0, blocks.token_of_row, outputs.to(out.dtype))   # bmm under autocast: bf16
        return out[:-1].reshape(*lead_shape, self.out_features)


class ExpertBlocks:
    """The T*K (token, expert) assignments grouped by expert (stable: by token within an
    expert, the loop's order) and packed into blocks of `size` rows, each block holding one
    expert's assignments only, so all experts' matmuls run as one `torch.bmm` over the blocks.
    An expert with c assignments gets ceil(c / size) blocks (none if c = 0), so whatever the
    routing the padding is under size rows per active expert: at most half the assignments
    (`BLOCKS_PER_ACTIVE_EXPERT`). Padding rows point at assignment T*K, i.e. token T: one zero
    row past the real ones (`pack`), whose output is dropped.

    expert_of_block (blocks,), assignment_of_row and token_of_row (blocks * size,)."""

    def __init__(self, experts: torch.Tensor, num_experts: int):
        flat = experts.reshape(-1)
        num_assignments, top_k, device = flat.numel(), experts.shape[-1], flat.device
        order = flat.argsort(stable=True)       # assignments grouped by expert, then by token
        counts = torch.bincount(flat, minlength=num_experts)
        active = int(torch.count_nonzero(counts))
        self.size = -(-num_assignments // (BLOCKS_PER_ACTIVE_EXPERT * active))
        blocks_per_expert = (counts + self.size - 1) // self.size
        self.expert_of_block = torch.repeat_interleave(
            torch.arange(num_experts, device=device), blocks_per_expert)
        sorted_experts = flat.index_select(0, order)
        rank_in_expert = (torch.arange(num_assignments, device=device)
                          - (counts.cumsum(0) - counts).index_select(0, sorted_experts))
        first_row = (blocks_per_expert.cumsum(0) - blocks_per_expert) * self.size
        row = first_row.index_select(0, sorted_experts) + rank_in_expert
        self.assignment_of_row = torch.full((self.expert_of_block.numel() * self.size,),
                                            num_assignments, device=device, dtype=torch.long)
        self.assignment_of_row[row] = order
        self.token_of_row = self.assignment_of_row // top_k

    def pack(self, rows: torch.Tensor, source_of_row: torch.Tensor) -> torch.Tensor:
        """(n, m) rows -> (blocks, size, m): row `source_of_row[i]` of `rows` plus one zero
        row (index n, the padding's) at packed position i."""
        padded = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        return padded.index_select(0, source_of_row).view(-1, self.size, rows.shape[1])


def per_expert_loop(layer: RoutedLoraExperts, x: torch.Tensor) -> torch.Tensor:
    """The previous dispatch, one pair of matmuls per active expert in a Python loop: the
    reference the grouped dispatch is tested against and benchmarked with."""
    lead_shape = x.shape[:-1]
    tokens = x.reshape(-1, layer.in_features).to(layer.expert_A.dtype)
    experts, gates = layer.route(tokens)
    flat_experts = experts.reshape(-1)
    order = flat_experts.argsort(stable=True)
    token_of = order // layer.top_k
    counts = torch.bincount(flat_experts, minlength=layer.num_experts).tolist()
    inputs = layer.dropout(tokens).index_select(0, token_of).split(counts)
    weights = (gates.reshape(-1).index_select(0, order) * layer.scaling).unsqueeze(-1)
    weights = weights.split(counts)
    # split / unbind once: indexing per expert would give each use a full-size backward
    a_factors, b_factors = layer.expert_A.unbind(0), layer.expert_B.unbind(0)
    pieces = [F.linear(F.linear(chunk, a_factors[e]) * weights[e], b_factors[e])
              for e, chunk in enumerate(inputs) if chunk.shape[0]]
    out = tokens.new_zeros(tokens.shape[0], layer.out_features)
    out.index_add_(0, token_of, torch.cat(pieces))
    return out.reshape(*lead_shape, layer.out_features)


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

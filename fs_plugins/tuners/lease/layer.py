"""FedLEASE's adaptive top-M mixture of LoRA experts at one layer (Wang et al., NeurIPS 2025,
Sec. 3.3).

A client of cluster c holds M experts: its own, c (peft's LoRA adapter, trained), and the M − 1
others (frozen copies the server sent, `bank_A`/`bank_B`), plus a router G (2M − 1 × d_in):

    ω = softmax(G x),   slots 0..M−1 → the own expert, slot M + j → the j-th other expert,
    the top-M slots are kept and renormalised; an expert's weight w_e sums its kept slots,
    h = W0 x + Σ_e w_e · s · B_e A_e x.

With M slots the own expert is always among the top M (pigeonhole), so each token uses between
1 and M experts. M = 1 (before the server's clustering) is a plain LoRA layer.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def expert_weights(logits: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(..., M) weights per expert [own, other_0, …, other_{M−2}] from (..., 2M − 1) router
    logits: softmax in float32, top-M slots renormalised, summed per expert."""
    m = num_experts
    if logits.shape[-1] != 2 * m - 1:
        raise ValueError(f"{num_experts} experts need {2 * m - 1} router logits, got "
                         f"{logits.shape[-1]}")
    probs = logits.float().softmax(dim=-1)
    kept, slots = probs.topk(m, dim=-1)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    expert_of_slot = torch.cat([torch.zeros(m, dtype=torch.long, device=logits.device),
                                torch.arange(1, m, device=logits.device)])
    weights = torch.zeros(*logits.shape[:-1], m, dtype=kept.dtype, device=logits.device)
    return weights.scatter_add(-1, expert_of_slot[slots], kept)


class LeaseMixture(nn.Module):
    """The router and the frozen other experts of one LoRA layer (capacity `max_experts`)."""

    def __init__(self, in_features: int, out_features: int, max_experts: int, r: int,
                 scaling: float, dropout: float = 0.0, dtype=torch.float32, device=None):
        super().__init__()
        if max_experts < 2:
            raise ValueError(f"max_experts must be >= 2, got {max_experts}")
        self.scaling = scaling
        self.router = nn.Parameter(torch.empty(2 * max_experts - 1, in_features, dtype=dtype,
                                               device=device))
        nn.init.kaiming_uniform_(self.router, a=math.sqrt(5))   # the released code's nn.Linear
        self.register_buffer('bank_A', torch.zeros(max_experts - 1, r, in_features, dtype=dtype,
                                                   device=device))
        self.register_buffer('bank_B', torch.zeros(max_experts - 1, out_features, r, dtype=dtype,
                                                   device=device))
        # experts in use, M (1 until set_experts): a Python int, read on every forward without a
        # device synchronisation
        self.active = 1
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def set_experts(self, bank_a: torch.Tensor, bank_b: torch.Tensor) -> None:
        """Loads the other experts (M − 1 of them, stacked) and makes M the active count."""
        others = bank_a.shape[0]
        if (bank_b.shape[0] != others or others > self.bank_A.shape[0]
                or bank_a.shape[1:] != self.bank_A.shape[1:]
                or bank_b.shape[1:] != self.bank_B.shape[1:]):
            raise ValueError(f"Other experts A {tuple(bank_a.shape)}, B {tuple(bank_b.shape)} do "
                             f"not fit this layer: at most {self.bank_A.shape[0]} of A "
                             f"{tuple(self.bank_A.shape[1:])}, B {tuple(self.bank_B.shape[1:])}")
        with torch.no_grad():
            self.bank_A.zero_()
            self.bank_B.zero_()
            self.bank_A[:others].copy_(bank_a)
            self.bank_B[:others].copy_(bank_b)
        self.active = others + 1

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """(..., M) per-token expert weights, own expert first."""
        m = self.active
        return expert_weights(F.linear(x.to(self.router.dtype), self.router[:2 * m - 1]), m)

    def others(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ over the other experts of w_e · s · B_e A_e x (every expert on every token: M is
        small and the experts are rank r)."""
        m = self.active
        tokens = self.dropout(x.to(self.bank_A.dtype))
        low = torch.einsum('...d,erd->...er', tokens, self.bank_A[:m - 1])
        low = low * (weights[..., 1:].unsqueeze(-1) * self.scaling).to(low.dtype)
        return torch.einsum('...er,eor->...o', low, self.bank_B[:m - 1])

"""Routing of a sparse MoE model on one client: its MoE blocks, their top-k, and how often
each expert was selected."""
from __future__ import annotations

from functools import partial

import torch


def moe_blocks(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every sparse MoE block: a `gate` router with `top_k` and `experts`."""
    return [(name, module) for name, module in model.named_modules()
            if hasattr(module, 'experts') and hasattr(getattr(module, 'gate', None), 'top_k')]


class RoutingTracker:
    """Router top-k of every MoE block, and per block and expert the number of steps in which
    the expert was selected for at least one (non-padding) training token."""

    def __init__(self, blocks):
        self.blocks = [module for _, module in blocks]
        self.names = [name for name, _ in blocks]
        self.num_experts = {name: int(m.gate.num_experts) for name, m in blocks}
        self.full_top_k = int(self.blocks[0].gate.top_k)
        width = max(self.num_experts.values())
        self.counts = torch.zeros(len(blocks), width, dtype=torch.int64)
        self.steps = 0
        self.step_mask = self.token_mask = None
        for layer, (_, module) in enumerate(blocks):
            module.gate.register_forward_hook(partial(self._record, layer))

    @property
    def top_k(self) -> int:
        return int(self.blocks[0].gate.top_k)

    def set_top_k(self, k: int) -> None:
        for block in self.blocks:
            block.gate.top_k = int(k)

    def start_step(self, attention_mask) -> None:
        self.step_mask = torch.zeros_like(self.counts, dtype=torch.bool)
        self.token_mask = None if attention_mask is None else attention_mask.reshape(-1).bool()

    def _record(self, layer, module, inputs, output) -> None:
        if self.step_mask is None or not module.training:
            return
        indices = output[2]  # (tokens, top_k) selected experts
        if self.token_mask is not None and self.token_mask.numel() == indices.shape[0]:
            indices = indices[self.token_mask.to(indices.device)]
        self.step_mask[layer, indices.reshape(-1).unique().cpu()] = True

    def end_step(self) -> None:
        if self.step_mask is not None:
            self.counts += self.step_mask
            self.steps += 1
        self.step_mask = self.token_mask = None

    def take_round(self) -> tuple[dict[str, torch.Tensor], int]:
        """({block name: (E,) activated-step counts}, local steps) of the round; resets both."""
        counts = {name: self.counts[layer, :self.num_experts[name]].float()
                  for layer, name in enumerate(self.names)}
        steps = self.steps
        self.counts.zero_()
        self.steps = 0
        return counts, steps

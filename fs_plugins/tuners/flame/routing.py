"""Routing of a sparse MoE model on one client: its MoE blocks, their top-k, and how often
each expert was selected during local training.

Two readings of FLAME's activation frequency a_i^j / S_i (paper §3, Eq. 6) are counted at once:

- `token`: per block and expert, the routed token slots that went to expert j (each
  non-padding training token fills k_i slots, one per selected expert); total = all routed
  slots of the round (non-padding tokens × k_i). count / total is the expert's share of the
  client's routing, in [0, 1], and does not saturate with the batch size.
- `step`: per block and expert, the optimiser steps in which expert j was selected for at least
  one non-padding token; total = the round's steps S_i. With batches of hundreds of tokens
  nearly every expert is selected in every step, so count / total ≈ 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from fs_plugins.models.checkpointing import recomputing
from fs_plugins.models.olmoe import router_of

ACTIVATION_READINGS = ('token', 'step')


@dataclass
class RoundActivation:
    """One round's routing counts per MoE block (block name -> tensor)."""
    token_counts: dict[str, torch.Tensor]    # (E,) routed token slots per expert
    token_totals: dict[str, torch.Tensor]    # () all routed token slots (tokens × k_i)
    step_counts: dict[str, torch.Tensor]     # (E,) steps in which the expert was selected
    steps: int                               # optimiser steps S_i

    def reading(self, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """({block: (E,) counts}, {block: () total}) of the `token` or `step` reading."""
        if kind == 'token':
            return self.token_counts, self.token_totals
        if kind == 'step':
            steps = torch.tensor(float(self.steps), dtype=torch.float64)
            return self.step_counts, {block: steps for block in self.step_counts}
        raise ValueError(f"activation reading '{kind}' is not one of {ACTIVATION_READINGS}")


class RoutingTracker:
    """Router top-k of every MoE block, and per block and expert the routed token slots and the
    steps in which it was selected, over the (non-padding) training tokens of one round.

    `start_step(attention_mask)` opens a step (`fresh`: its first micro-batch; later ones add
    to it), the router hooks record its forwards, `end_step()` commits it (a step that is never
    committed, e.g. skipped for a non-finite loss, is not counted); forwards outside a step, in
    eval mode or recomputed by gradient checkpointing are not counted."""

    def __init__(self, blocks):
        self.blocks = [module for _, module in blocks]
        self.names = [name for name, _ in blocks]
        self.routers = [router_of(module) for _, module in blocks]
        self.num_experts = {name: int(router_of(m).num_experts) for name, m in blocks}
        self.full_top_k = int(self.routers[0].top_k)
        width = max(self.num_experts.values())
        self.step_counts = torch.zeros(len(blocks), width, dtype=torch.int64)
        self.token_counts = torch.zeros(len(blocks), width, dtype=torch.int64)
        self.token_totals = torch.zeros(len(blocks), dtype=torch.int64)
        self.steps = 0
        self._step = self.token_mask = None
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(partial(self._record, layer))

    @property
    def top_k(self) -> int:
        return int(self.routers[0].top_k)

    def set_top_k(self, k: int) -> None:
        for router in self.routers:
            router.top_k = int(k)

    def start_step(self, attention_mask, fresh: bool = True) -> None:
        if fresh or self._step is None:
            self._step = torch.zeros_like(self.token_counts), torch.zeros_like(self.token_totals)
        self.token_mask = None if attention_mask is None else attention_mask.reshape(-1).bool()

    def _record(self, layer, module, inputs, output) -> None:
        if self._step is None or not module.training or recomputing():
            return
        indices = output[2]  # (tokens, top_k) selected experts
        if self.token_mask is not None and self.token_mask.numel() == indices.shape[0]:
            indices = indices[self.token_mask.to(indices.device)]
        counts, totals = self._step
        counts[layer] += torch.bincount(indices.reshape(-1).cpu(), minlength=counts.shape[1])
        totals[layer] += indices.numel()

    def end_step(self) -> None:
        if self._step is not None:
            counts, totals = self._step
            self.token_counts += counts
            self.token_totals += totals
            self.step_counts += counts > 0
            self.steps += 1
        self._step = self.token_mask = None

    def state_dict(self) -> dict:
        """The counts so far and the routers' top-k (checkpoints)."""
        return {'step_counts': self.step_counts, 'token_counts': self.token_counts,
                'token_totals': self.token_totals, 'steps': self.steps, 'top_k': self.top_k}

    def load_state_dict(self, state: dict) -> None:
        for name in ('step_counts', 'token_counts', 'token_totals'):
            getattr(self, name).copy_(state[name])
        self.steps = int(state['steps'])
        self.set_top_k(state['top_k'])

    def take_round(self) -> RoundActivation:
        """This round's counts; resets them for the next round."""
        round_ = RoundActivation(
            token_counts={n: self.token_counts[i, :self.num_experts[n]].double()
                          for i, n in enumerate(self.names)},
            token_totals={n: self.token_totals[i].double() for i, n in enumerate(self.names)},
            step_counts={n: self.step_counts[i, :self.num_experts[n]].double()
                         for i, n in enumerate(self.names)},
            steps=self.steps)
        self.step_counts.zero_()
        self.token_counts.zero_()
        self.token_totals.zero_()
        self.steps = 0
        return round_

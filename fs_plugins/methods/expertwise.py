"""HetLoRA and FlexLoRA with per-client ranks on a sparse MoE model, expert by expert (FLAME's
baselines, paper §5 "HLoRA" and "FlexLoRA").

A fused expert factor is split into one rank-r LoRA pair per expert (aggregation.experts), so
truncation, padding and SVD act on each expert's own factors; the plain `hetlora` / `flexlora`
would treat the fused E·r rows as one rank-(E·r) factor. All k experts stay active.
"""
from __future__ import annotations

from dataclasses import replace

from fs_plugins.aggregation.experts import block_of, expert_rank, fit_expert_rank, fuse, is_expert_factor, unfuse
from fs_plugins.methods.flame import ExpertRoutingMethod, experts_per_block
from fs_plugins.methods.flexlora import FlexLoRA
from fs_plugins.methods.hetlora import HetLoRA
from fs_plugins.methods.lora_family import receive_at_own_rank
from fs_plugins.methods.registry import register_method


class ExpertwiseRanks(ExpertRoutingMethod):
    """Runs a mixed-rank method's aggregation on per-expert LoRA pairs."""

    def aggregate(self, server_state, updates):
        experts = experts_per_block(updates)
        split = [replace(u, shared=unfuse(u.shared, experts)) for u in updates]
        state = {**server_state, 'global': unfuse(server_state['global'], experts)}
        new_state = super().aggregate(state, split)
        return {**new_state, 'global': fuse(new_state['global'])}

    def receive(self, model, content, state):
        experts = state['routing'].num_experts
        params = dict(model.named_parameters())
        fitted, plain = {}, {}
        for key, value in content.items():
            target = params.get(key)
            if target is not None and is_expert_factor(key):
                count = experts[block_of(key)]
                fitted[key] = fit_expert_rank(key, value, expert_rank(key, target, count), count)
            else:
                plain[key] = value
        receive_at_own_rank(model, {**plain, **fitted})


@register_method
class HetLoRAExperts(ExpertwiseRanks, HetLoRA):
    name = 'hetlora_experts'
    summary = "HetLoRA applied expert by expert on fused MoE expert LoRA (FLAME's HLoRA baseline)"
    sent = 'as hetlora, + counts'


@register_method
class FlexLoRAExperts(ExpertwiseRanks, FlexLoRA):
    name = 'flexlora_experts'
    summary = "FlexLoRA applied expert by expert on fused MoE expert LoRA (FLAME's baseline)"
    sent = 'as flexlora, + counts'

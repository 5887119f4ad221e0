"""Shared pieces of the methods that aggregate LoRA factors layer by layer."""
from __future__ import annotations

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.pairs import fit_rank, is_lora_factor, lora_pairs, lora_rank, overlay_rank
from fs_plugins.methods.base import ClientUpdate, load_tensors, weights_of


def aggregate_by_layer(global_state: dict, updates: list[ClientUpdate], combine) -> dict:
    """New global state: `combine(As, Bs, weights) -> (A, B)` for every LoRA layer all
    updates share; sample-weighted averaging for any other shared tensor."""
    weights = weights_of(updates)
    pairs = lora_pairs(set.intersection(*(set(u.shared) for u in updates)))
    paired = {k for ab in pairs.values() for k in ab}
    out = dict(global_state)
    out.update(weighted_average([{k: v for k, v in u.shared.items() if k not in paired}
                                 for u in updates], weights))
    for a_key, b_key in pairs.values():
        out[a_key], out[b_key] = combine([u.shared[a_key] for u in updates],
                                         [u.shared[b_key] for u in updates], weights)
    return out


def receive_at_own_rank(model, content: dict) -> None:
    """Loads LoRA factors at this client's own rank: truncated to it, or, when the client's
    rank is higher, into its first components (the client keeps its own extra components)."""
    params = dict(model.named_parameters())
    fitted = {}
    for key, value in content.items():
        target = params.get(key)
        if target is not None and is_lora_factor(key):
            own_rank = lora_rank(key, target)
            value = (overlay_rank(key, value, target) if lora_rank(key, value) < own_rank
                     else fit_rank(key, value, own_rank))
        fitted[key] = value
    load_tensors(model, fitted)

"""Methods that fold a server-computed update into every client's frozen base weight
(FedEx-LoRA's residual, FLoRA's stacked update, FRLoRA's residual product).

The server keeps the cumulative update D of each LoRA layer and sends it whole under
`<key prefix><layer prefix>`; a client keeps the layer's base weight W0 as it was when the first
update arrived and sets W = W0 + s·D (s: the layer's LoRA scaling, or 1 when D already carries
it). So receiving twice is harmless, and a client that skipped rounds catches up. The download
is full size: that is these methods' cost."""
from __future__ import annotations

import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.pairs import is_lora_factor, lora_pairs
from fs_plugins.methods.base import Method, weights_of


class MergesIntoBase(Method):
    """What the methods of this module share: the clients' original base weights W0 in
    state['w0'], and the folded base weights saved with a client's model."""
    modifies_frozen_weights = True
    robust_aggregation_refusal = "it folds an update computed from every client's LoRA factors into the base weights"

    def init_client_state(self, model, cfg):
        return {'w0': {}}

    def artifact_extra(self, model, state):
        return {f'{prefix}.base_layer.weight': model.get_submodule(prefix).base_layer.weight
                for prefix in state['w0']}


def split_content(content: dict, key_prefix: str) -> tuple[dict, dict]:
    """(the ordinary tensors, {layer prefix: cumulative update}) of a client's content."""
    plain = {k: v for k, v in content.items() if not k.startswith(key_prefix)}
    updates = {k[len(key_prefix):]: v for k, v in content.items() if k.startswith(key_prefix)}
    return plain, updates


def fold_into_base(model, state: dict, updates: dict, scaled: bool) -> None:
    """W = W0 + s·D (or W0 + D when not `scaled`) for every layer of `updates`; W0 is kept in
    state['w0'] at a layer's first update."""
    w0 = state['w0']
    with torch.no_grad():
        for prefix, update in updates.items():
            layer = model.get_submodule(prefix)
            weight = layer.base_layer.weight
            if prefix not in w0:
                w0[prefix] = weight.detach().clone()
            scale = layer.scaling['default'] if scaled else 1.0
            weight.copy_((w0[prefix].float() + scale * update.to(weight.device).float())
                         .to(weight.dtype))


def accumulate(cumulative: dict, steps: dict) -> dict:
    """{layer: D + step}: this round's steps added to the cumulative updates."""
    out = dict(cumulative)
    for prefix, step in steps.items():
        out[prefix] = out[prefix] + step if prefix in out else step
    return out


def layer_steps(updates, step) -> tuple[dict, dict]:
    """(the weighted average of every shared tensor that is not a LoRA factor, {layer prefix:
    step(prefix, (A key, B key), As, Bs, weights)} over the LoRA layers all updates share)."""
    weights = weights_of(updates)
    pairs = lora_pairs(set.intersection(*(set(u.shared) for u in updates)))
    others = weighted_average([{k: v for k, v in u.shared.items() if not is_lora_factor(k)}
                               for u in updates], weights)
    steps = {prefix: step(prefix, keys, [u.shared[keys[0]] for u in updates],
                          [u.shared[keys[1]] for u in updates], weights)
             for prefix, keys in pairs.items()}
    return others, steps

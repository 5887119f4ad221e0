"""FedEx-LoRA (Singhal et al., 2025): A and B are averaged as in FedAvg, and the part of the
averaged update that the product of averages misses,
    R = Σ p_k B_k A_k − B̄ Ā   (per layer, d_out × d_in),
is folded into the frozen base weight: W ← W0 + s · Σ_rounds R (s = alpha / r). The server keeps
the cumulative residual and sends it with A and B, so clients that skipped rounds catch up and
receiving twice is harmless. The download is full size: that is the method's cost."""
import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.lora import fedex_residual
from fs_plugins.aggregation.pairs import lora_pairs
from fs_plugins.methods.base import Method, load_tensors, weights_of
from fs_plugins.methods.registry import register_method

RESIDUAL = 'residual/'


@register_method
class FedExLoRA(Method):
    name = 'fedex'
    summary = ('FedEx-LoRA: A, B averaged; the residual Σp_kB_kA_k − B̄Ā folded into the frozen '
               'base weight on every client')
    sent = 'A, B / A, B + full-size residual'
    modifies_frozen_weights = True

    def init_client_state(self, model, cfg):
        return {'w0': {}}

    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared), 'residual': {}}

    def aggregate(self, server_state, updates):
        weights = weights_of(updates)
        merged = weighted_average([u.shared for u in updates], weights)
        residual = dict(server_state['residual'])
        for prefix, (a_key, b_key) in lora_pairs(merged).items():
            step = fedex_residual([u.shared[a_key] for u in updates],
                                  [u.shared[b_key] for u in updates], weights,
                                  merged[a_key], merged[b_key])
            residual[prefix] = residual[prefix] + step if prefix in residual else step
        return {'global': {**server_state['global'], **merged}, 'residual': residual}

    def content_for(self, server_state, client_id):
        return {**server_state['global'],
                **{RESIDUAL + k: v for k, v in server_state['residual'].items()}}

    def artifact_extra(self, model, state):
        # the frozen base weights the residual was folded into
        return {f'{prefix}.base_layer.weight': model.get_submodule(prefix).base_layer.weight
                for prefix in state['w0']}

    def receive(self, model, content, state):
        load_tensors(model, {k: v for k, v in content.items() if not k.startswith(RESIDUAL)})
        with torch.no_grad():
            for key, residual in content.items():
                if not key.startswith(RESIDUAL):
                    continue
                prefix = key[len(RESIDUAL):]
                layer = model.get_submodule(prefix)
                weight = layer.base_layer.weight
                if prefix not in state['w0']:
                    state['w0'][prefix] = weight.detach().clone()
                scale = layer.scaling['default']
                weight.copy_((state['w0'][prefix].float() + scale * residual.to(weight.device).float())
                             .to(weight.dtype))

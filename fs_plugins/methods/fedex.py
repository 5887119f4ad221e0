"""FedEx-LoRA (Singhal et al., 2025): A and B are averaged as in FedAvg, and the part of the
averaged update that the product of averages misses,
    R = Σ p_k B_k A_k − B̄ Ā   (per layer, d_out × d_in),
is folded into the frozen base weight: W ← W0 + s · Σ_rounds R (s = alpha / r). The server keeps
the cumulative residual and sends it with A and B, so clients that skipped rounds catch up and
receiving twice is harmless (fs_plugins.methods.merged_base). The download is full size:
that is the method's cost."""
from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.lora import fedex_residual
from fs_plugins.aggregation.pairs import lora_pairs
from fs_plugins.methods.base import load_tensors, weights_of
from fs_plugins.methods.merged_base import MergesIntoBase, accumulate, fold_into_base, split_content
from fs_plugins.methods.registry import register_method

RESIDUAL = 'residual/'


@register_method
class FedExLoRA(MergesIntoBase):
    name = 'fedex'
    summary = ('FedEx-LoRA: A, B averaged; the residual Σp_kB_kA_k − B̄Ā folded into the frozen '
               'base weight on every client')
    sent = 'A, B / A, B + full-size residual'

    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared), 'residual': {}}

    def aggregate(self, server_state, updates):
        weights = weights_of(updates)
        merged = weighted_average([u.shared for u in updates], weights)
        steps = {prefix: fedex_residual([u.shared[a_key] for u in updates],
                                        [u.shared[b_key] for u in updates], weights,
                                        merged[a_key], merged[b_key])
                 for prefix, (a_key, b_key) in lora_pairs(merged).items()}
        return {'global': {**server_state['global'], **merged},
                'residual': accumulate(server_state['residual'], steps)}

    def content_for(self, server_state, client_id):
        return {**server_state['global'],
                **{RESIDUAL + k: v for k, v in server_state['residual'].items()}}

    def receive(self, model, content, state):
        plain, residuals = split_content(content, RESIDUAL)
        load_tensors(model, plain)
        fold_into_base(model, state, residuals, scaled=True)

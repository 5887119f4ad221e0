"""FlexLoRA (Bai et al., 2024): the server forms each layer's full update
ΔW = Σ p_k B_k A_k, factorises it by truncated SVD at the largest client rank, and each
client keeps the leading r_k singular components (= the rank-r_k truncated SVD of ΔW)."""
from fs_plugins.aggregation.lora import flexlora
from fs_plugins.methods.base import Method
from fs_plugins.methods.lora_family import aggregate_by_layer, receive_at_own_rank
from fs_plugins.methods.registry import register_method


@register_method
class FlexLoRA(Method):
    name = 'flexlora'
    summary = ('mixed ranks: ΔW = Σp_kB_kA_k, truncated SVD, client k keeps the top r_k '
               'components (√S split evenly)')
    sent = 'own-rank A, B / largest-rank A, B'
    robust_aggregation_refusal = "its LoRA factors come from an SVD of the weighted sum of the clients' products"

    def aggregate(self, server_state, updates):
        def combine(As, Bs, weights):
            rank = max(a.shape[0] for a in As)
            return flexlora(As, Bs, weights, [rank])[0]
        return {**server_state,
                'global': aggregate_by_layer(server_state['global'], updates, combine)}

    def receive(self, model, content, state):
        receive_at_own_rank(model, content)

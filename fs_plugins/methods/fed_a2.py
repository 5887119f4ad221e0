"""FedA²-LoRA (UniFLoW): per LoRA layer, A = Σ p_k A_k and B solves
min ‖B A − Σ p_k B_k A_k‖²_F (+ λ‖B‖²_F when A Aᵀ is ill conditioned), so the global
product B·A is the best rank-r fit of the averaged updates in A's row space. Computed without
forming any d_out × d_in matrix (aggregation.lora.fed_a2). Upload equals FedAvg-LoRA's."""
from fs_plugins.aggregation.lora import fed_a2
from fs_plugins.methods.base import Method
from fs_plugins.methods.lora_family import aggregate_by_layer
from fs_plugins.methods.registry import register_method


@register_method
class FedA2LoRA(Method):
    name = 'fed_a2'
    # ridge λ; null = 0 when A Aᵀ is well conditioned, else the documented fallback
    defaults = {'ridge': None}

    def aggregate(self, server_state, updates):
        lam = self.hparams.get('ridge')
        combine = lambda As, Bs, w: fed_a2(As, Bs, w, lam=None if lam is None else float(lam))  # noqa: E731
        return {**server_state,
                'global': aggregate_by_layer(server_state['global'], updates, combine)}

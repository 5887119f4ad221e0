"""FedA²-LoRA (UniFLoW): per LoRA layer, A = Σ p_k A_k and B solves
min ‖B A − Σ p_k B_k A_k‖²_F (+ λ‖B‖²_F when A Aᵀ is ill conditioned), so the global
product B·A is the best rank-r fit of the averaged updates in A's row space. Computed without
forming any d_out × d_in matrix (aggregation.lora.fed_a2). Upload equals FedAvg-LoRA's."""
from dataclasses import dataclass
from typing import Optional

from fs_plugins.aggregation.lora import fed_a2
from fs_plugins.methods.base import Method
from fs_plugins.methods.lora_family import aggregate_by_layer
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option


@dataclass
class FedA2Config:
    ridge: Optional[float] = option(
        None, 'ridge λ of the B solve; null: 0 when A Aᵀ is well conditioned, else the fallback '
              'of aggregation.lora.fed_a2', ge=0)


@register_method
class FedA2LoRA(Method):
    name = 'fed_a2'
    summary = ('FedA²-LoRA: A = Σp_kA_k, B = argmin‖BA − Σp_kB_kA_k‖² (+λ‖B‖² when AAᵀ is ill '
               'conditioned), no d_out×d_in matrix formed')
    sent = 'A, B / A, B'
    config_class = FedA2Config

    def aggregate(self, server_state, updates):
        lam = self.hparams.ridge
        combine = lambda As, Bs, w: fed_a2(As, Bs, w, lam=lam)  # noqa: E731
        return {**server_state,
                'global': aggregate_by_layer(server_state['global'], updates, combine)}

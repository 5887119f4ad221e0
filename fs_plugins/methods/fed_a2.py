"""FedA²-LoRA (UniFLoW): per LoRA layer, A = Σ p_k A_k and B solves
min ‖B A − Σ p_k B_k A_k‖²_F + λ‖B‖²_F, i.e. B = U Aᵀ (A Aᵀ + λI)⁻¹ with the Tikhonov term
applied every round (Algorithm 1 line 17; λ = 1 by default, §3 after Eq. 13), so the global
product B·A is the best ridge fit of the averaged updates in A's row space. Computed without
forming any d_out × d_in matrix (aggregation.lora.fed_a2). Clients of different LoRA ranks
(`--client_cfg` fsplug.model.lora.r) are zero-padded to the largest rank (appendix E.4,
Table 10) and each keeps the first r_k components of the global factors. Upload equals
FedAvg-LoRA's."""
from dataclasses import dataclass
from typing import Optional

from fs_plugins.aggregation.lora import fed_a2
from fs_plugins.aggregation.pairs import lora_pairs
from fs_plugins.methods.base import Method
from fs_plugins.methods.lora_family import aggregate_by_layer, receive_at_own_rank
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option


@dataclass
class FedA2Config:
    ridge: Optional[float] = option(
        1.0, 'Tikhonov λ of B = U Aᵀ(A Aᵀ + λI)⁻¹, applied every round (UniFLoW Alg. 1 line 17; '
             '§3 after Eq. 13: "in practice λ = 1"; Table 12 uses 0.1 on image/audio); '
             '0: the "w/o Tik." ablation of Table 12; null: Eq. 13\'s case split, λ only when '
             'A Aᵀ is ill conditioned (cond ≥ 1e6: the fallback ridge of aggregation.lora.fed_a2)',
        ge=0)


@register_method
class FedA2LoRA(Method):
    name = 'fed_a2'
    summary = ('FedA²-LoRA: A = Σp_kA_k, B = argmin‖BA − Σp_kB_kA_k‖² + λ‖B‖² (λ every round), '
               'no d_out×d_in matrix formed; mixed ranks zero-padded to the largest, each client '
               'keeps its first r_k components')
    sent = 'A, B / A, B (mixed ranks: own-rank / largest-rank)'
    config_class = FedA2Config

    @classmethod
    def config_problems(cls, hparams, cfg):
        adapter = cfg['fsplug']['model']['adapter']
        if adapter != 'lora':
            return [f"fsplug.model.adapter = {adapter!r}: fsplug.method = 'fed_a2' needs 'lora' "
                    f"(FedA² solves for each layer's B from its A/B pair; {adapter} has none)"]
        return []

    def aggregate(self, server_state, updates):
        if not lora_pairs(set.intersection(*(set(u.shared) for u in updates))):
            raise ValueError(f"fsplug.method = 'fed_a2': the clients share no LoRA A/B pair "
                             f"(sent: {sorted(updates[0].shared)[:4]} ...); FedA² needs "
                             f"fsplug.model.adapter: lora")
        lam = self.hparams.ridge

        def combine(As, Bs, weights):
            try:
                return fed_a2(As, Bs, weights, lam=lam, pad=True)
            except ValueError as err:
                raise ValueError(f'{err} (fsplug.fed_a2.ridge = {lam})') from None

        return {**server_state,
                'global': aggregate_by_layer(server_state['global'], updates, combine)}

    def receive(self, model, content, state):
        receive_at_own_rank(model, content)

"""HetLoRA / HLoRA-style aggregation for clients with different LoRA ranks: factors are
zero-padded to the largest rank, averaged (optionally with sparsity weights ∝ n_k ‖B_k A_k‖_F),
and each client keeps the first r_k components of the global factors. Per-client ranks come
from `--client_cfg` (fsplug.model.lora.r)."""
from dataclasses import dataclass

from fs_plugins.aggregation.lora import hetlora_pad
from fs_plugins.methods.base import Method
from fs_plugins.methods.lora_family import aggregate_by_layer, receive_at_own_rank
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option


@dataclass
class HetLoRAConfig:
    sparsity_weighted: bool = option(True, 'weigh clients by n_k ‖B_k A_k‖_F (HetLoRA) instead '
                                           'of n_k alone')


@register_method
class HetLoRA(Method):
    name = 'hetlora'
    summary = ('mixed ranks: zero-pad to the largest rank, average (sparsity-weighted ∝ '
               'n_k‖B_kA_k‖_F), each client keeps its first r_k components')
    sent = 'own-rank A, B / largest-rank A, B'
    robust_aggregation_refusal = 'its LoRA factors are zero-padded and averaged by rank, not coordinate-wise'
    config_class = HetLoRAConfig

    def aggregate(self, server_state, updates):
        weighted = self.hparams.sparsity_weighted
        combine = lambda As, Bs, w: hetlora_pad(As, Bs, w, sparsity_weighted=weighted)  # noqa: E731
        return {**server_state,
                'global': aggregate_by_layer(server_state['global'], updates, combine)}

    def receive(self, model, content, state):
        receive_at_own_rank(model, content)

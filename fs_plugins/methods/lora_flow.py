"""LoRA-Flow (Wang et al., "LoRA-Flow: Dynamic LoRA Fusion for Large Language Models in
Generative Tasks", ACL 2024), SmartFed's per-token, per-layer fusion baseline: a fusion gate
per decoder layer l reads the layer's input hidden state x_l and gives one weight per
library LoRA, w_l = softmax(W_l x_l) + b_l (LoRA-Flow Eq. 3); every LoRA module of the
layer adds Σ_n w_l,n B_n A_n x. All library LoRAs run (activated rank: the whole library's);
only the gates (W_l, b_l, initialised to zero: equal weights 1/N) train, averaged with FedAvg."""
from __future__ import annotations

from dataclasses import dataclass

from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.library_reuse import LibraryMethod
from fs_plugins.methods.registry import register_method
from fs_plugins.tuners.library import FlowMixture, attach_flow_gates, decoder_layer_of


@dataclass
class LoRAFlowConfig:
    pass


@register_method
class LoRAFlow(LibraryMethod):
    name = 'lora_flow'
    summary = ('LoRA-Flow: every frozen library LoRA runs; a fusion gate per decoder layer '
               '(softmax(W x_l) + b from the layer input) weighs the LoRAs per token; only the '
               'gates train (FedAvg)')
    sent = 'per-decoder-layer fusion gates / the same'
    config_class = LoRAFlowConfig

    def before_attach(self, model, library):
        try:
            self._gates = attach_flow_gates(model, library)
        except ValueError as exc:
            raise ConfigError(f'fsplug.model.library.adapters: {exc}') from exc

    def make_layer(self, name, A, B, owner):
        gate = self._gates[decoder_layer_of(name)]
        return FlowMixture(A, B, owner, lambda: gate)

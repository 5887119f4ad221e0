"""Attaches a composition layer (tuners.library.layers) to every linear layer that some
library adapter targets, and LoRA-Flow's per-decoder-layer gates."""
from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from fs_plugins.tuners.library.adapters import LibraryAdapter, stacked_factors, target_modules
from fs_plugins.tuners.library.layers import LIBRARY_ATTR, FlowGate, add_library_output

FLOW_GATE_ATTR = 'lora_flow_gate'
_DECODER_LAYER = re.compile(r'^(.*\.layers\.\d+)\.')
# modules of a decoder layer whose input is the layer's hidden state (its width)
_HIDDEN_INPUTS = ('q_proj', 'k_proj', 'v_proj', 'gate_proj', 'up_proj')


def attach_library(model: nn.Module, library: list[LibraryAdapter],
                   make_layer: Callable[[str, object, object, object], nn.Module]) -> dict:
    """`make_layer(module name, A, B, owner)` for every library target; returns
    {module name: composition layer}."""
    layers = {}
    for name in target_modules(library):
        module = model.get_submodule(name)
        if hasattr(module, LIBRARY_ATTR):
            raise ValueError(f"Module '{name}' already composes a library")
        A, B, owner = stacked_factors(library, name)
        layer = make_layer(name, A, B, owner)
        weight = module.weight
        module.add_module(LIBRARY_ATTR, layer.to(weight.device))
        module.register_forward_hook(add_library_output)
        layers[name] = layer
    return layers


def decoder_layer_of(module_name: str) -> str:
    match = _DECODER_LAYER.match(module_name)
    if match is None:
        raise ValueError(f"LoRA-Flow: module '{module_name}' is not inside a decoder layer "
                         f"('...layers.<i>....')")
    return match.group(1)


def _hidden_size(layer: nn.Module, layer_name: str) -> int:
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit('.', 1)[-1] in _HIDDEN_INPUTS:
            return module.in_features
    raise ValueError(f"LoRA-Flow: decoder layer '{layer_name}' has none of {_HIDDEN_INPUTS} "
                     f"to read its hidden size from")


def _observe_hidden(layer, args, kwargs):
    hidden = kwargs['hidden_states'] if 'hidden_states' in kwargs else args[0]
    getattr(layer, FLOW_GATE_ATTR).observe(hidden)


def attach_flow_gates(model: nn.Module, library: list[LibraryAdapter]) -> dict[str, FlowGate]:
    """One FlowGate per decoder layer holding library targets, fed the layer's input."""
    gates = {}
    for name in target_modules(library):
        layer_name = decoder_layer_of(name)
        if layer_name in gates:
            continue
        layer = model.get_submodule(layer_name)
        gate = FlowGate(_hidden_size(layer, layer_name), len(library))
        layer.add_module(FLOW_GATE_ATTR, gate.to(next(layer.parameters()).device))
        layer.register_forward_pre_hook(_observe_hidden, with_kwargs=True)
        gates[layer_name] = gate
    return gates

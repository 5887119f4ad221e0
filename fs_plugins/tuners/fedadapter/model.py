"""Attaches FedAdapter's bottleneck adapters to a model's target modules (a forward hook adds
each adapter to its module's output) and sets the active configuration: adapters of the top
`depth` transformer layers at `width` units, the others off."""
from __future__ import annotations

import re

from torch import nn

from fs_plugins.aggregation.fedadapter import top_layers
from fs_plugins.tuners.fedadapter.config import AdapterConfig
from fs_plugins.tuners.fedadapter.layer import BottleneckAdapter

ADAPTER_ATTR = 'fedadapter'
ADAPTER_TAG = f'.{ADAPTER_ATTR}.'
# a transformer layer's index: the first numeric part of a module's name
# (model.layers.3.self_attn.o_proj, bert.encoder.layer.3.output.dense)
_LAYER = re.compile(r'(?:^|\.)(\d+)\.')


def layer_of(name: str) -> int | None:
    """The transformer layer a module or parameter name belongs to, or None."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def _add_adapter(module, args, output):
    return module.fedadapter(output)


def inject_adapters(model: nn.Module, config: AdapterConfig) -> dict[str, BottleneckAdapter]:
    """Adds an adapter (off) after every Linear whose last name component is a target and that
    sits in a numbered layer; returns {module name: adapter}. Raises ValueError when none
    matches."""
    targets = set(config.target_modules)
    found = {name: module for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and name.rsplit('.', 1)[-1] in targets
             and layer_of(name) is not None}
    if not found:
        raise ValueError(f'no Linear module in a numbered layer is named one of {sorted(targets)}')
    for name, module in found.items():
        if hasattr(module, ADAPTER_ATTR):
            raise ValueError(f"module '{name}' already has a FedAdapter adapter")
        adapter = BottleneckAdapter(module.out_features, config.max_width, config.init_std,
                                    device=module.weight.device)
        module.add_module(ADAPTER_ATTR, adapter)
        module.register_forward_hook(_add_adapter)
    return adapter_layers(model)


def adapter_layers(model: nn.Module) -> dict[str, BottleneckAdapter]:
    """{module name: its adapter} for every adapted module."""
    return {name: getattr(module, ADAPTER_ATTR) for name, module in model.named_modules()
            if isinstance(getattr(module, ADAPTER_ATTR, None), BottleneckAdapter)}


def set_active(model: nn.Module, depth: int, width: int) -> None:
    """Adapters of the top `depth` layers (by index among the adapted ones) at `width` units;
    the others off."""
    adapters = adapter_layers(model)
    active = top_layers([layer_of(name) for name in adapters], depth)
    for name, adapter in adapters.items():
        adapter.set_width(width if layer_of(name) in active else 0)

"""Gradient checkpointing (fsplug.train.gradient_checkpointing) through transformers' own
per-layer switch, non-reentrant, so that it composes with peft and the plugin's adapters: a
checkpointed layer's forward runs again during backward with the same inputs and RNG state,
which gives the same loss and gradients.

Forward hooks that *record* something (FLAME's routing counts, SmartFed's importance) would see
that second forward; they ask `recomputing()` and skip it."""
from __future__ import annotations

import torch

from fs_plugins.core.errors import ConfigError


def recomputing() -> bool:
    """True while autograd runs a checkpointed forward again inside backward (the engine has
    a current graph task only during backward)."""
    return torch._C._current_graph_task_id() != -1


def enable_gradient_checkpointing(model: torch.nn.Module, builder: str) -> int:
    """Turns on checkpointing in every transformers model inside `model` that supports it (the
    language model; a vision tower or encoder too). A frozen tower whose input needs no
    gradient builds no graph, so nothing is recomputed there: it costs nothing. Returns how
    many layers checkpoint; none is a ConfigError naming the builder."""
    from transformers import PreTrainedModel
    kwargs = {'use_reentrant': False}
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.supports_gradient_checkpointing:
            if hasattr(module, 'activation_checkpointing_enable'):
                module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:   # transformers before activation_checkpointing_enable
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layers = sum(getattr(m, 'gradient_checkpointing', False) is True for m in model.modules())
    if not layers:
        raise ConfigError(f"fsplug.train.gradient_checkpointing: builder '{builder}' has no "
                          f"transformers layer stack that supports it")
    return layers

"""Puts FedMosaic's layers on the modules peft has wrapped with LoRA: PQ-LoRA on the target
modules of the block-end layers (`aggregation.mosaic.pq_block_layers`), conventional LoRA
with a gate and a global copy on all others."""
from __future__ import annotations

import re

import torch
from torch import nn

from fs_plugins.aggregation.mosaic import orthonormal_columns, orthonormal_rows, pq_block_layers
from fs_plugins.tuners.mosaic.layer import MOSAIC_ATTR, MosaicLinear, MosaicState

_LAYER = re.compile(r'\.layers\.(\d+)\.(.+)$')


def text_layer_count(model: nn.Module) -> int:
    """L, the number of decoder layers of the (language) model."""
    config = model.get_base_model().config if hasattr(model, 'get_base_model') else model.config
    config = getattr(config, 'text_config', None) or config
    return int(config.num_hidden_layers)


def layer_position(module_name: str) -> tuple[int, str] | None:
    """(1-based decoder layer, module path inside the layer) of a module name, or None."""
    found = _LAYER.search(module_name)
    return (int(found.group(1)) + 1, found.group(2)) if found else None


def pq_key(block: int, inner: str) -> str:
    """The architecture-independent name of a PQ-LoRA layer: its block and inner path."""
    return f'block{block}.{inner}'


def inject_mosaic(model: nn.Module, num_blocks: int, placement: str, q_init_std: float,
                  seed: int) -> dict[str, str]:
    """Turns every peft LoRA Linear into a MosaicLinear; those in the block-end layers become
    PQ-LoRA (A, B orthonormal and frozen). Returns {module name: pq key} of the PQ layers."""
    from peft.tuners.lora import Linear as LoraLinear
    num_layers = text_layer_count(model)
    block_of = {layer: k for k, layer in enumerate(pq_block_layers(num_layers, num_blocks,
                                                                   placement), start=1)}
    generator = torch.Generator().manual_seed(seed)
    pq_layers = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLinear) or isinstance(module, MosaicLinear):
            continue
        position = layer_position(name)
        block = block_of.get(position[0]) if position else None
        lora_a, lora_b = module.lora_A['default'].weight, module.lora_B['default'].weight
        if block is not None:
            _make_frozen_orthonormal(lora_a, lora_b, generator)
            pq_layers[name] = pq_key(block, position[1])
        module.__class__ = MosaicLinear
        module.add_module(MOSAIC_ATTR, MosaicState(lora_a, lora_b, block is not None,
                                                   q_init_std, generator))
    return pq_layers


@torch.no_grad()
def _make_frozen_orthonormal(lora_a: nn.Parameter, lora_b: nn.Parameter, generator) -> None:
    """Eq. 18: A A^T = I, B^T B = I, both frozen (then aligned across architectures)."""
    r, d_in = lora_a.shape
    d_out = lora_b.shape[0]
    lora_a.copy_(orthonormal_rows(r, d_in, generator).to(lora_a.dtype))
    lora_b.copy_(orthonormal_columns(d_out, r, generator).to(lora_b.dtype))
    lora_a.requires_grad_(False)
    lora_b.requires_grad_(False)

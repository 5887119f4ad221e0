"""Puts FedMosaic's layers on the modules peft has wrapped with LoRA: PQ-LoRA on the target
modules of the block-end layers (`aggregation.mosaic.pq_block_layers`), conventional LoRA
with a gate and a global copy on all others; the gates one per decoder layer (a `MosaicGate`
child of the layer) or one per module."""
from __future__ import annotations

import re

import torch
from torch import nn

from fs_plugins.aggregation.mosaic import orthonormal_columns, orthonormal_rows, pq_block_layers
from fs_plugins.tuners.mosaic.layer import GATE_ATTR, MOSAIC_ATTR, MosaicGate, MosaicLinear, MosaicState

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
                  seed: int, gate: str = 'per_layer', pq_scale: str = 'none',
                  pq_lora: bool = True, local_only: bool = False) -> dict[str, str]:
    """Turns every peft LoRA Linear into a MosaicLinear; those in the block-end layers become
    PQ-LoRA (A, B orthonormal and frozen). Returns {module name: pq key} of the PQ layers.

    gate: 'per_layer' (one β per decoder layer carrying LoRA, Eq. 7 / Algorithm 1) or
    'per_module'; pq_scale: 'none' (Eq. 5) or 'alpha_over_r' (peft's scaling on PQ-LoRA too,
    as the authors' code); pq_lora=False: conventional LoRA on every layer (the ablation
    without PQ-LoRA; num_blocks and placement are then unused); local_only=True: no gate and
    no global module (SFT on this architecture)."""
    from peft.tuners.lora import Linear as LoraLinear
    if gate not in ('per_layer', 'per_module') or pq_scale not in ('none', 'alpha_over_r'):
        raise ValueError(f"gate must be per_layer|per_module and pq_scale none|alpha_over_r, "
                         f"got {gate!r}, {pq_scale!r}")
    block_of = {}
    if pq_lora:
        num_layers = text_layer_count(model)
        block_of = {layer: k for k, layer in enumerate(pq_block_layers(num_layers, num_blocks,
                                                                       placement), start=1)}
    generator = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    pq_layers = {}
    for name, module in list(modules.items()):
        if not isinstance(module, LoraLinear) or isinstance(module, MosaicLinear):
            continue
        position = layer_position(name)
        block = block_of.get(position[0]) if position else None
        lora_a, lora_b = module.lora_A['default'].weight, module.lora_B['default'].weight
        if block is not None:
            _make_frozen_orthonormal(lora_a, lora_b, generator)
            pq_layers[name] = pq_key(block, position[1])
        layer_gate = (_layer_gate(modules, name, lora_a)
                      if gate == 'per_layer' and position and not local_only else None)
        module.__class__ = MosaicLinear
        module.add_module(MOSAIC_ATTR, MosaicState(lora_a, lora_b, block is not None,
                                                   q_init_std, generator, layer_gate,
                                                   pq_scaled=pq_scale == 'alpha_over_r',
                                                   local_only=local_only))
    return pq_layers


def decoder_layer_name(module_name: str) -> str | None:
    """The name of the decoder layer a module sits in ('….layers.<i>'), or None."""
    found = _LAYER.search(module_name)
    return f'{module_name[:found.start()]}.layers.{found.group(1)}' if found else None


def _layer_gate(modules: dict, name: str, like: torch.Tensor) -> MosaicGate:
    """The decoder layer's MosaicGate, created on its first FedMosaic module."""
    layer = modules[decoder_layer_name(name)]
    if not hasattr(layer, GATE_ATTR):
        layer.add_module(GATE_ATTR, MosaicGate(like.dtype, like.device))
    return getattr(layer, GATE_ATTR)


@torch.no_grad()
def _make_frozen_orthonormal(lora_a: nn.Parameter, lora_b: nn.Parameter, generator) -> None:
    """Eq. 18: A A^T = I, B^T B = I, both frozen (then aligned across architectures)."""
    r, d_in = lora_a.shape
    d_out = lora_b.shape[0]
    lora_a.copy_(orthonormal_rows(r, d_in, generator).to(lora_a.dtype))
    lora_b.copy_(orthonormal_columns(d_out, r, generator).to(lora_b.dtype))
    lora_a.requires_grad_(False)
    lora_b.requires_grad_(False)

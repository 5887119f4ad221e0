"""FLAME's rescaler s_i: each MoE block's output is multiplied by a client-local scale, so a
client that activates k_i < k experts can restore the output's magnitude.

- learnable: a scalar parameter (init 1), one per MoE block or one shared by all blocks;
- static: a buffer fixed at k / k_i (`set_static_scale`);
- none: no rescaling.
"""
from __future__ import annotations

import torch

RESCALE_NAME = 'flame_rescale'
RESCALE_MODES = ('learnable', 'static', 'none')


def _scaled(hidden: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # the scale stays float32 (its gradient is computed against the base-dtype output and
    # accumulated in float32); the output keeps the base dtype (bf16 stays bf16)
    return (hidden * scale).to(hidden.dtype)


def _rescale_output(module, inputs, output):
    scale = getattr(module, RESCALE_NAME)
    if isinstance(output, tuple):
        return (_scaled(output[0], scale),) + tuple(output[1:])
    return _scaled(output, scale)


def install_rescaler(blocks, mode: str, per_layer: bool = True) -> None:
    """Adds the rescaler to every MoE block (float32, whatever the base dtype)."""
    if mode not in RESCALE_MODES:
        raise ValueError(f"rescale mode '{mode}' is not one of {RESCALE_MODES}")
    if mode == 'none':
        return
    shared = torch.nn.Parameter(torch.ones((), dtype=torch.float32))
    for block in blocks:
        if mode == 'static':
            block.register_buffer(RESCALE_NAME, torch.ones((), dtype=torch.float32))
        else:
            block.register_parameter(
                RESCALE_NAME, torch.nn.Parameter(torch.ones((), dtype=torch.float32)) if per_layer else shared)
        block.register_forward_hook(_rescale_output)


def set_static_scale(blocks, value: float) -> None:
    with torch.no_grad():
        for block in blocks:
            getattr(block, RESCALE_NAME).fill_(value)

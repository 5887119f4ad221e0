"""Mixed precision and quantised bases.

The frozen base sits in fsplug.model.dtype (or, with fsplug.model.quantization, in 8-bit or
4-bit bitsandbytes weights computing in that dtype); everything that trains stays float32.
On CUDA the forward runs under autocast to the base dtype, so the float32 adapters' matmuls run
in that dtype too while their weights, gradients and optimiser state stay float32; float16
also scales the loss (GradScaler) against gradient underflow. On CPU there is no autocast:
peft and the plugin's adapters cast their input to float32 themselves.
"""
from __future__ import annotations

import contextlib
import importlib.util

import torch

from fs_plugins.core.errors import ConfigError
from fs_plugins.schema.plugin import DTYPE_NAMES
from fs_plugins.schema.specs import ModelSpec

# fsplug.model.dtype -> the torch dtype of the frozen base
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}

# builders whose base comes from transformers' from_pretrained, which takes a quantization_config
QUANTIZABLE_BUILDERS = ('causal_lm', 'tiny_llama', 'smollm2', 'olmoe', 'tiny_olmoe', 'llava',
                        'tiny_llava', 'qwen2_vl', 'tiny_qwen2_vl')
# stored bytes per weight of a quantised linear layer (4bit: NF4 + blockwise absmax with
# double quantisation, about 0.127 bits per weight, as the QLoRA paper counts it)
QUANTIZED_BYTES = {'8bit': 1.0, '4bit': 0.5 + 0.127 / 8}


def autocast_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The autocast dtype of the forward: the base dtype on CUDA when it is half precision."""
    if device.type == 'cuda' and dtype in (torch.bfloat16, torch.float16):
        return dtype
    return None


def forward_context(device: torch.device, dtype: torch.dtype):
    """Context of a training or evaluation forward (autocast on CUDA, nothing elsewhere)."""
    cast = autocast_dtype(device, dtype)
    return torch.autocast(device.type, dtype=cast) if cast is not None else contextlib.nullcontext()


def grad_scaler(device: torch.device, dtype: torch.dtype):
    """A GradScaler for float16 autocast on CUDA; a disabled one (a pass-through) otherwise."""
    enabled = autocast_dtype(device, dtype) is torch.float16
    return torch.amp.GradScaler('cuda' if enabled else 'cpu', enabled=enabled)


def is_quantized(model: torch.nn.Module) -> bool:
    return any(getattr(m, 'hf_quantizer', None) is not None
               or getattr(m, 'is_loaded_in_4bit', False) or getattr(m, 'is_loaded_in_8bit', False)
               for m in model.modules())


def place_model(model: torch.nn.Module, device: torch.device) -> None:
    """model.to(device); a bitsandbytes model is loaded on its GPU and refuses .to(), so there
    only the tensors elsewhere (adapters and method modules built on the CPU) move."""
    if not is_quantized(model):
        model.to(device)
        return
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device != device:
            tensor.data = tensor.data.to(device)


def check_quantization(spec: ModelSpec, method) -> None:
    """fsplug.model.quantization is usable here: CUDA, bitsandbytes, a from_pretrained builder
    and a method that never edits the frozen weights; a ConfigError naming what is missing."""
    mode, model_cfg = spec.model.quantization, spec.model
    if mode == 'none':
        return
    key = f"fsplug.model.quantization = '{mode}'"
    if method.modifies_frozen_weights:
        raise ConfigError(f"{key}: method '{method.name}' edits the frozen base weights every "
                          f"round, which a quantised base cannot take; use quantization: none")
    if model_cfg.builder not in QUANTIZABLE_BUILDERS:
        raise ConfigError(f"{key}: builder '{model_cfg.builder}' does not load through "
                          f"from_pretrained; quantisable builders: {list(QUANTIZABLE_BUILDERS)}")
    if not spec.use_gpu or not torch.cuda.is_available():
        raise ConfigError(f"{key} needs CUDA (bitsandbytes kernels) and use_gpu: True; "
                          f"use_gpu = {spec.use_gpu}, CUDA available = {torch.cuda.is_available()}")
    if importlib.util.find_spec('bitsandbytes') is None:
        raise ConfigError(f"{key} needs the bitsandbytes package: pip install bitsandbytes")


def quantization_kwargs(spec: ModelSpec) -> dict:
    """from_pretrained keyword arguments of fsplug.model.quantization ({} for none)."""
    mode = spec.model.quantization
    if mode == 'none':
        return {}
    from transformers import BitsAndBytesConfig
    compute = DTYPES[spec.model.dtype]
    if mode == '8bit':
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4',
                                    bnb_4bit_use_double_quant=True,
                                    bnb_4bit_compute_dtype=compute)
    device = spec.device if spec.device >= 0 else 0
    return {'quantization_config': config, 'device_map': {'': device}}

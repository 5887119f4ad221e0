"""Builds a client's (or the server's) model from its config: base model + tokenizer from a
builder, LoRA (or rsLoRA, VeRA) through peft with a seeded initialisation, then the method's
`adapt_model`."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from fs_plugins.config import ConfigError, model_path
from fs_plugins.seeding import derive_seed

logger = logging.getLogger(__name__)

_BUILDERS: dict[str, Callable] = {}
# Frozen base tensors already loaded in this process, keyed by (builder, path, dtype):
# clients of one process share them instead of holding a copy each.
_FROZEN_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}

DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


def register_builder(name: str):
    def wrap(fn):
        _BUILDERS[name] = fn
        return fn
    return wrap


def available() -> list[str]:
    return sorted(_BUILDERS)


def _looks_local(path: str) -> bool:
    # hub ids look like 'org/name'; anything rooted or relative-dotted is a directory
    return path.startswith(('/', '.', '~'))


@register_builder('causal_lm')
def load_causal_lm(cfg, path: str):
    """AutoModelForCausalLM + AutoTokenizer from a local directory or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    expanded = os.path.expanduser(path)
    if _looks_local(path) and not os.path.isdir(expanded):
        raise FileNotFoundError(f"Model directory not found: {path} (from model.type)")
    kwargs = dict(local_files_only=bool(cfg.fsplug.model.local_files_only))
    try:
        tokenizer = AutoTokenizer.from_pretrained(expanded, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            expanded, dtype=DTYPES[cfg.fsplug.model.dtype], **kwargs)
    except OSError as exc:
        raise FileNotFoundError(f"Cannot load model '{path}' (model.type) as a local directory "
                                f"or hub id: {exc}") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


@register_builder('tiny_llama')
def load_tiny_llama(cfg, path: str):
    """A tiny random Llama built locally; `path` '' or 'tiny-llama' uses the cache dir."""
    from fs_plugins.models.tiny import ensure_tiny_llama
    directory = ensure_tiny_llama(None if path in ('', 'tiny-llama') else path)
    return load_causal_lm(cfg, directory)


def adapter_config(model_cfg, seed: int):
    """peft config for fsplug.model.adapter: LoRA (optionally rsLoRA) or VeRA."""
    from peft import LoraConfig, TaskType, VeraConfig
    lora_cfg = model_cfg.lora
    if model_cfg.adapter == 'vera':
        return VeraConfig(task_type=TaskType.CAUSAL_LM, r=int(model_cfg.vera.r),
                          target_modules=list(lora_cfg.target_modules),
                          vera_dropout=float(lora_cfg.dropout),
                          d_initial=float(model_cfg.vera.d_initial), projection_prng_key=seed)
    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=int(lora_cfg.r),
                      lora_alpha=float(lora_cfg.alpha), lora_dropout=float(lora_cfg.dropout),
                      target_modules=list(lora_cfg.target_modules),
                      use_rslora=bool(lora_cfg.use_rslora))


def inject_adapter(model: torch.nn.Module, model_cfg, seed: int) -> torch.nn.Module:
    from peft import get_peft_model
    config = adapter_config(model_cfg, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, config)
        except ValueError as exc:
            raise ConfigError(f"fsplug.model.lora.target_modules = {list(model_cfg.lora.target_modules)}"
                              f" does not match the model: {exc}") from exc


def share_frozen_tensors(model: torch.nn.Module, key: tuple) -> None:
    """Points frozen parameters at tensors already loaded for `key` (same name and shape)."""
    cache = _FROZEN_CACHE.setdefault(key, {})
    for name, param in model.named_parameters():
        if param.requires_grad:
            continue
        cached = cache.get(name)
        if cached is not None and cached.shape == param.shape and cached.dtype == param.dtype:
            param.data = cached
        else:
            cache[name] = param.data


@dataclass
class BuiltModel:
    model: torch.nn.Module
    tokenizer: object
    trainable_names: list[str]


def build_model(cfg, method) -> BuiltModel:
    """The model for one participant with config `cfg` (a client's config under --client_cfg).

    Adapter initialisation depends only on cfg.seed, so every runner and process builds the
    same initial adapters for the same architecture."""
    builder_name = cfg.fsplug.model.builder
    if builder_name not in _BUILDERS:
        raise ConfigError(f"fsplug.model.builder = '{builder_name}' is not one of: "
                          f"{', '.join(available())}")
    path = model_path(cfg)
    base, tokenizer = _BUILDERS[builder_name](cfg, path)
    for param in base.parameters():
        param.requires_grad_(False)
    model = inject_adapter(base, cfg.fsplug.model, derive_seed(cfg.seed, 'adapter'))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, 'method_modules'))
        model = method.adapt_model(model, cfg)
    if not method.modifies_frozen_weights:
        share_frozen_tensors(model, (builder_name, path, cfg.fsplug.model.dtype))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError("The model has no trainable parameters after LoRA injection; "
                          "check fsplug.model.lora.target_modules")
    return BuiltModel(model, tokenizer, trainable)

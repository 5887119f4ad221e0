"""A library of existing LoRA adapters: ordinary peft adapter folders (adapter_config.json +
adapter_model.safetensors), read with peft's own loaders and checked against the model they
are composed on. Every factor stays frozen; scaling (alpha / r, or alpha / sqrt(r) for rsLoRA)
is folded into B, so an adapter's update on a module is exactly `B @ A`.

`builtin:<name>` names a library adapter made here (`BUILTIN_ADAPTERS`), built once into the
cache like the tiny models. `shape:r<rank>:<module>,<module>` (e.g. `shape:r32:q_proj,v_proj`)
names an adapter by its shapes alone — rank r on every linear layer whose name ends in one of
the modules, zero factors — for sizing a library that is not on this machine with
`fs-plugins estimate` (the model built from its architecture only); anything that trains or
evaluates refuses it."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fs_plugins.core.errors import ConfigError
from fs_plugins.models.builders import sizing_architecture_only
from fs_plugins.tuners.library.builtin import BUILTIN_ADAPTERS

CONFIG_FILE = 'adapter_config.json'
WEIGHT_FILES = ('adapter_model.safetensors', 'adapter_model.bin')
BUILTIN_PREFIX = 'builtin:'
SHAPE_PREFIX = 'shape:'
# peft's saved keys: 'base_model.model.<module path>.lora_A.weight'
KEY_PREFIX = 'base_model.model.'


@dataclass
class ModuleFactors:
    """One adapter's factors on one module: A (r, d_in), B (d_out, r) with scaling folded in."""
    A: torch.Tensor
    B: torch.Tensor

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass
class LibraryAdapter:
    path: str
    name: str
    base: str                              # adapter_config.json's base_model_name_or_path
    modules: dict[str, ModuleFactors]      # module path in the base model -> factors


def _builtin_adapters():
    return BUILTIN_ADAPTERS


def resolve_path(spec: str) -> str:
    """The folder of a library entry: a path, or `builtin:<name>` built on first use."""
    if not spec.startswith(BUILTIN_PREFIX):
        return os.path.expanduser(spec)
    name = spec[len(BUILTIN_PREFIX):]
    builtins = _builtin_adapters()
    if name not in builtins:
        raise ConfigError(f"fsplug.model.library.adapters: '{spec}' is not a builtin library "
                          f"adapter; builtin: {', '.join(BUILTIN_PREFIX + n for n in sorted(builtins))}")
    return builtins[name]()


def _read_config(path: str, spec: str):
    from peft import LoraConfig, PeftConfig
    if not os.path.isdir(path):
        raise ConfigError(f"fsplug.model.library.adapters: adapter folder '{spec}' does not exist")
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise ConfigError(f"fsplug.model.library.adapters: '{spec}' has no {CONFIG_FILE} (not a "
                          f"peft adapter folder)")
    if not any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES):
        raise ConfigError(f"fsplug.model.library.adapters: '{spec}' has no adapter weights "
                          f"({' or '.join(WEIGHT_FILES)})")
    config = PeftConfig.from_pretrained(path)
    if not isinstance(config, LoraConfig):
        raise ConfigError(f"fsplug.model.library.adapters: '{spec}' is a {config.peft_type} "
                          f"adapter; the library takes LoRA adapters")
    unsupported = [name for name, on in (('use_dora', config.use_dora),
                                         ('fan_in_fan_out', config.fan_in_fan_out),
                                         ('alpha_pattern', bool(config.alpha_pattern)),
                                         ('lora_bias', getattr(config, 'lora_bias', False)))
                   if on]
    if unsupported:
        raise ConfigError(f"fsplug.model.library.adapters: '{spec}' uses {unsupported}, which "
                          f"the rank-wise composition does not support")
    return config


def _same_base(recorded: str | None, model_base: str | None) -> bool:
    if not recorded or not model_base:
        return True
    name = lambda p: os.path.basename(os.path.normpath(str(p)))  # noqa: E731
    return name(recorded) == name(model_base)


def shape_adapter(spec: str, model: torch.nn.Module) -> LibraryAdapter:
    """A `shape:r<rank>:<modules>` entry: zero factors of that rank on every linear layer of
    `model` whose name ends in one of the modules (on the layer's device: 'meta' when sized);
    only inside `architecture_only` (fs-plugins estimate), where no weight is read."""
    parts = spec[len(SHAPE_PREFIX):].split(':')
    usage = (f"fsplug.model.library.adapters: '{spec}' is not of the form "
             f"'shape:r<rank>:<module>,<module>' (e.g. 'shape:r32:q_proj,v_proj')")
    if len(parts) != 2 or not parts[0].startswith('r') or not parts[0][1:].isdigit() \
            or int(parts[0][1:]) < 1 or not parts[1].strip():
        raise ConfigError(usage)
    if not sizing_architecture_only():
        raise ConfigError(f"fsplug.model.library.adapters: '{spec}' gives an adapter's shapes only "
                          f"(zero factors), for `fs-plugins estimate`; to train or evaluate, list "
                          f"peft LoRA adapter folders")
    rank, wanted = int(parts[0][1:]), {m.strip() for m in parts[1].split(',') if m.strip()}
    modules = {}
    for name, layer in model.named_modules():
        if isinstance(layer, torch.nn.Linear) and name.rsplit('.', 1)[-1] in wanted:
            device = layer.weight.device
            modules[name] = ModuleFactors(torch.zeros(rank, layer.in_features, device=device),
                                          torch.zeros(layer.out_features, rank, device=device))
    if not modules:
        raise ConfigError(f"fsplug.model.library.adapters: '{spec}': the model has no linear "
                          f"layer named {sorted(wanted)}")
    return LibraryAdapter(spec, spec, '', modules)


def load_adapter(spec: str, model: torch.nn.Module, check_base: bool = True) -> LibraryAdapter:
    """Reads one library entry and checks it against `model` (the plain base model): the
    base it was trained for, every module it targets, and every factor's shape."""
    from peft.utils import load_peft_weights
    if spec.startswith(SHAPE_PREFIX):
        return shape_adapter(spec, model)
    path = resolve_path(spec)
    config = _read_config(path, spec)
    model_base = getattr(getattr(model, 'config', None), '_name_or_path', None)
    if check_base and not _same_base(config.base_model_name_or_path, model_base):
        raise ConfigError(f"fsplug.model.library.adapters: '{spec}' was trained for base "
                          f"'{config.base_model_name_or_path}', the model is '{model_base}' "
                          f"(set fsplug.model.library.check_base: False if only the folder name "
                          f"differs)")
    weights = load_peft_weights(path, device='cpu')
    modules = _factors(weights, config, spec)
    linear = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = sorted(n for n in modules if n not in linear)
    if missing:
        raise ConfigError(f"fsplug.model.library.adapters: '{spec}' targets modules the model "
                          f"does not have as linear layers: {missing[:5]}"
                          f"{' …' if len(missing) > 5 else ''} (target_modules "
                          f"{sorted(config.target_modules or [])})")
    for name, factors in modules.items():
        layer = linear[name]
        want_a, want_b = (factors.rank, layer.in_features), (layer.out_features, factors.rank)
        if tuple(factors.A.shape) != want_a or tuple(factors.B.shape) != want_b:
            raise ConfigError(f"fsplug.model.library.adapters: '{spec}' module '{name}': lora_A "
                              f"{tuple(factors.A.shape)} / lora_B {tuple(factors.B.shape)}, the "
                              f"model's layer needs {want_a} / {want_b}")
    label = os.path.basename(os.path.normpath(path)) if not spec.startswith(BUILTIN_PREFIX) else spec
    return LibraryAdapter(path, label, config.base_model_name_or_path or '', modules)


def _factors(weights: dict, config, spec: str) -> dict[str, ModuleFactors]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in weights.items():
        for part in ('lora_A', 'lora_B'):
            tag = f'.{part}.weight'
            if key.endswith(tag):
                module = key[:-len(tag)]
                module = module[len(KEY_PREFIX):] if module.startswith(KEY_PREFIX) else module
                pairs.setdefault(module, {})[part] = value
    if not pairs:
        raise ConfigError(f"fsplug.model.library.adapters: '{spec}' holds no lora_A / lora_B "
                          f"weights")
    out = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {'lora_A', 'lora_B'}:
            raise ConfigError(f"fsplug.model.library.adapters: '{spec}' module '{module}' has "
                              f"{sorted(pair)} only")
        a, b = pair['lora_A'].float(), pair['lora_B'].float()
        rank = a.shape[0]
        alpha = config.lora_alpha
        scaling = alpha / (rank ** 0.5 if config.use_rslora else rank)
        out[module] = ModuleFactors(a, b * scaling)
    return out


def load_library(specs, model: torch.nn.Module, check_base: bool = True) -> list[LibraryAdapter]:
    """Every entry of fsplug.model.library.adapters, checked (see `load_adapter`)."""
    if not specs:
        raise ConfigError('fsplug.model.library.adapters is empty: the LoRA-reuse methods '
                          'compose existing peft LoRA adapters; list their folders')
    return [load_adapter(spec, model, check_base) for spec in specs]


def stacked_factors(library: list[LibraryAdapter], module: str):
    """All rank-1 experts of `module` across the library: A (E, d_in), B (d_out, E), and the
    adapter index of each expert (E,); None when no adapter targets the module."""
    parts = [(i, adapter.modules[module]) for i, adapter in enumerate(library)
             if module in adapter.modules]
    if not parts:
        return None
    a = torch.cat([f.A for _, f in parts])
    b = torch.cat([f.B for _, f in parts], dim=1)
    owner = torch.cat([torch.full((f.rank,), i, dtype=torch.long) for i, f in parts])
    return a, b, owner


def target_modules(library: list[LibraryAdapter]) -> list[str]:
    """Modules some library adapter targets, in model order of their names."""
    return sorted({m for adapter in library for m in adapter.modules})

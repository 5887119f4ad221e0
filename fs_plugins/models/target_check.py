"""A static check, when the model is built, that every module a peft config targets can receive
a gradient: peft adds a LoRA inside the targeted module's forward, so a module whose forward
never runs keeps its LoRA out of the computation, silently.

What it refuses (the cases known to bypass a module's forward):
- a child of torch.nn.MultiheadAttention (its `out_proj`): MultiheadAttention.forward hands
  `out_proj.weight` to F.multi_head_attention_forward and never calls `out_proj`;
- a MultiheadAttention subclass with a forward of its own (ImageBind's, called
  `attn(x, attn_mask)` and returning the output alone), targeted as a whole: peft's
  MultiheadAttention LoRA calls it and reads the result as (output, weights).
Plain MultiheadAttention targeted as a whole is peft's supported case and passes. Whether a
module's forward runs in general is only known by running the model: `fs-plugins audit` does
(a trainable tensor without a gradient is one of its problems).
"""
from __future__ import annotations

import torch

from fs_plugins.core.errors import ConfigError

SHOWN_NAMES = 4   # module names the error message lists per config key

WHY = {
    'child': 'inside torch.nn.MultiheadAttention, whose forward passes their weights to '
             'F.multi_head_attention_forward without calling them',
    'subclass': "that are torch.nn.MultiheadAttention subclasses with a forward of their own: "
                "peft's MultiheadAttention LoRA reads their result as (output, attention weights)",
}


def unreachable_targets(model: torch.nn.Module, config) -> dict[str, str]:
    """Module name -> reason (a key of WHY), for the modules of `model` that peft config `config`
    targets and whose LoRA would never receive a gradient (in model order)."""
    from peft.tuners.tuners_utils import check_target_module_exists
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.MultiheadAttention):
            continue
        if (name and type(module).forward is not torch.nn.MultiheadAttention.forward
                and check_target_module_exists(config, name)):
            found[name] = 'subclass'
        for child, _ in module.named_children():
            full = f'{name}.{child}' if name else child
            if check_target_module_exists(config, full):
                found[full] = 'child'
    return found


def _key_of(name: str, config, keys: dict[str, tuple]) -> str:
    """The first config key whose own target pattern (peft's target_modules) matches `name`."""
    import copy

    from peft.tuners.tuners_utils import check_target_module_exists
    for key, (pattern, _) in keys.items():
        alone = copy.copy(config)
        alone.target_modules = pattern
        if check_target_module_exists(alone, name):
            return key
    return next(iter(keys), 'LoRA targets')


def check_reachable_targets(model: torch.nn.Module, config, keys: dict[str, tuple]) -> None:
    """A ConfigError naming the config key, its value and the module names, when peft config
    `config` targets a module whose LoRA would never get a gradient. `keys`: config key ->
    (its part of config.target_modules, in peft's form; its value as configured)."""
    found = unreachable_targets(model, config)
    if not found:
        return
    groups: dict[tuple[str, str], list[str]] = {}
    for name, why in found.items():
        groups.setdefault((_key_of(name, config, keys), why), []).append(name)
    parts = []
    for (key, why), names in groups.items():
        shown = ', '.join(names[:SHOWN_NAMES])
        if len(names) > SHOWN_NAMES:
            shown += f' and {len(names) - SHOWN_NAMES} more'
        value = keys[key][1] if key in keys else None
        parts.append(f"{key} = {value} targets {len(names)} module(s) ({shown}) {WHY[why]}")
    raise ConfigError('LoRA would never receive a gradient: ' + '; '.join(parts) + '. Target '
                      "Linear modules the forward calls (e.g. an MLP's fc1 / fc2), or a plain "
                      'MultiheadAttention module itself (peft puts LoRA on its in_proj and '
                      "out_proj); the imagebind backend makes its trunks' out_proj trainable "
                      '(fs_plugins.models.imagebind_layout)')

"""Attaches routed LoRA experts to the modules peft has already wrapped with LoRA.

peft's LoRA adapter on a MoLE target is the shared expert and keeps its parameter names, so
what a client uploads is named exactly as in FedAvg-LoRA. The routed experts and the router
live in a child module `mole` of the LoRA-wrapped module; a forward hook adds their output.
Only LoRA-wrapped modules are eligible, so MoLE follows wherever a builder restricts LoRA
(e.g. to the language model of a multimodal model).
"""
from __future__ import annotations

from torch import nn

from fs_plugins.tuners.mole.config import MoleConfig
from fs_plugins.tuners.mole.layer import RoutedLoraExperts

MOLE_ATTR = 'mole'
_ROUTED_TAGS = (f'.{MOLE_ATTR}.expert_A', f'.{MOLE_ATTR}.expert_B')
_ROUTER_TAG = f'.{MOLE_ATTR}.router'


def is_routed_expert(name: str) -> bool:
    return any(tag in name for tag in _ROUTED_TAGS)


def is_router(name: str) -> bool:
    return _ROUTER_TAG in name


def _matches(module_name: str, targets) -> bool:
    # peft's rule for a list of target names: the full name or its last components
    return any(module_name == t or module_name.endswith('.' + t) for t in targets)


def _add_routed_output(module, args, output):
    if getattr(module, 'disable_adapters', False):
        return output
    routed = getattr(module, MOLE_ATTR)(args[0])
    return output + routed.to(output.dtype)


def lora_wrapped_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules peft has wrapped with a LoRA linear adapter, by name."""
    from peft.tuners.lora import Linear as LoraLinear
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def inject_mole(model: nn.Module, config: MoleConfig, adapter: str = 'default') -> list[str]:
    """Adds routed experts + router to every LoRA-wrapped module matching
    `config.target_modules`; returns the names of the modules changed. Raises ValueError
    naming the target that matches no LoRA-wrapped module."""
    wrapped = lora_wrapped_modules(model)
    chosen = {n: m for n, m in wrapped.items() if _matches(n, config.target_modules)}
    for target in config.target_modules:
        if not any(_matches(n, [target]) for n in chosen):
            raise ValueError(f"MoLE target '{target}' is not a LoRA-wrapped module of this model "
                             f"(LoRA-wrapped: {sorted({n.rsplit('.', 1)[-1] for n in wrapped})})")
    for name, module in chosen.items():
        if hasattr(module, MOLE_ATTR):
            raise ValueError(f"Module '{name}' already has routed experts")
        shared_a = module.lora_A[adapter].weight
        experts = RoutedLoraExperts(module.in_features, module.out_features, config,
                                    dtype=shared_a.dtype, device=shared_a.device)
        module.add_module(MOLE_ATTR, experts)
        module.register_forward_hook(_add_routed_output)
    return sorted(chosen)

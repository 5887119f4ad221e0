"""Attaches FedLEASE mixtures to the modules peft has wrapped with LoRA.

peft's LoRA adapter is the client's own expert and keeps its parameter names (what a client
uploads is named as in FedAvg-LoRA, plus the routers). Three hooks make the wrapped module
compute W0 x + Σ_e w_e s B_e A_e x once the layer has more than one expert:
a forward pre-hook routes the input x, a hook on peft's lora_B scales the own expert's output by
its per-token weight, and a forward hook adds the other experts.
"""
from __future__ import annotations

from torch import nn

from fs_plugins.tuners.lease.layer import LeaseMixture
from fs_plugins.tuners.mole.model import lora_wrapped_modules

LEASE_ATTR = 'lease'
ROUTER_TAG = f'.{LEASE_ATTR}.router'
_WEIGHTS = '_lease_weights'   # per-token weights of the forward pass under way


def is_lease_router(name: str) -> bool:
    return ROUTER_TAG in name


def _mixing(module) -> bool:
    return module.lease.active > 1 and not getattr(module, 'disable_adapters', False)


def _route(module, args):
    if _mixing(module):
        setattr(module, _WEIGHTS, module.lease.weights(args[0]))


def _scale_own_expert(owner):
    def hook(lora_b, args, output):
        weights = getattr(owner, _WEIGHTS, None)
        if weights is None:
            return output
        return output * weights[..., :1].to(output.dtype)
    return hook


def _add_other_experts(module, args, output):
    weights = getattr(module, _WEIGHTS, None)
    if weights is None:
        return output
    setattr(module, _WEIGHTS, None)
    return output + module.lease.others(args[0], weights).to(output.dtype)


def inject_lease(model: nn.Module, max_experts: int, adapter: str = 'default') -> list[str]:
    """Adds a FedLEASE mixture of capacity `max_experts` to every LoRA-wrapped module (its
    experts share the module's LoRA rank, scaling and dropout); returns the modules' names."""
    wrapped = lora_wrapped_modules(model)
    if not wrapped:
        raise ValueError('The model has no LoRA-wrapped module to attach experts to')
    for name, module in wrapped.items():
        if hasattr(module, LEASE_ATTR):
            raise ValueError(f"Module '{name}' already has FedLEASE experts")
        lora_a = module.lora_A[adapter].weight
        dropout = module.lora_dropout[adapter]
        mixture = LeaseMixture(module.in_features, module.out_features, max_experts,
                               r=lora_a.shape[0], scaling=float(module.scaling[adapter]),
                               dropout=getattr(dropout, 'p', 0.0), dtype=lora_a.dtype,
                               device=lora_a.device)
        module.add_module(LEASE_ATTR, mixture)
        module.register_forward_pre_hook(_route)
        module.lora_B[adapter].register_forward_hook(_scale_own_expert(module))
        module.register_forward_hook(_add_other_experts)
    return sorted(wrapped)


def lease_layers(model: nn.Module) -> dict[str, LeaseMixture]:
    """{LoRA layer prefix: its mixture}."""
    return {name: getattr(module, LEASE_ATTR) for name, module in lora_wrapped_modules(model).items()
            if hasattr(module, LEASE_ATTR)}

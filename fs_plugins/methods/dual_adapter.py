"""Pieces shared by the methods that keep a second LoRA adapter beside peft's 'default' one
(DITTO, FedSim, FedDAT): adding it with the same config, and an ℓ2 pull towards anchors."""
import copy

import torch


def add_twin_adapter(model: torch.nn.Module, name: str) -> None:
    """Adds peft adapter `name` with the config of 'default', its parameters trainable."""
    model.add_adapter(name, copy.deepcopy(model.peft_config['default']))
    for param_name, param in model.named_parameters():
        if f'.{name}.' in param_name:
            param.requires_grad_(True)


def proximal_term(model: torch.nn.Module, anchor: dict[str, torch.Tensor]) -> torch.Tensor:
    """Σ ‖θ − anchor‖² over the named parameters of `anchor`."""
    params = dict(model.named_parameters())
    return sum(((params[n] - a.to(params[n].device, params[n].dtype)) ** 2).sum()
               for n, a in anchor.items())

"""The worked example of docs/adding_a_method.md: FedSA-LoRA with a server step size.

Clients share lora_A and keep lora_B (their personal factor, as in FedSA-LoRA); the server
moves the global lora_A a fraction `server_lr` of the way to the clients' weighted average
(1: the plain average). tests/test_adding_a_method.py runs it in both runners.
"""
from dataclasses import dataclass

import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.methods import Method, register_method
from fs_plugins.methods.base import weights_of
from fs_plugins.schema import option


def damped_step(current: dict, target: dict, step: float) -> dict:
    """current + step * (target - current) for each tensor named in `target`."""
    return {name: current[name] + step * (value - current[name])
            for name, value in target.items()}


@dataclass
class DampedFedSAConfig:
    server_lr: float = option(1.0, "fraction of the way the global lora_A moves to the clients' "
                                   'weighted average each round (1: plain averaging)',
                              gt=0, le=1)


@register_method
class DampedFedSA(Method):
    name = 'damped_fedsa'                     # fsplug.method: damped_fedsa
    summary = ('example: lora_A averaged with a server step size (fsplug.damped_fedsa.server_lr), '
               'lora_B stays on the client')  # the method table of docs/reference.md
    sent = 'lora_A / lora_A'                  # what travels up / down
    config_class = DampedFedSAConfig          # the checked, documented fsplug.damped_fedsa node

    def is_shared(self, name: str) -> bool:
        return 'lora_A' in name

    def client_metrics(self, model, state) -> dict[str, float]:
        with torch.no_grad():
            squares = sum(float(p.pow(2).sum()) for n, p in model.named_parameters()
                          if 'lora_B' in n)
        return {'lora_B_norm': squares ** 0.5}

    def aggregate(self, server_state, updates):
        average = weighted_average([u.shared for u in updates], weights_of(updates))
        moved = damped_step(server_state['global'], average, self.hparams.server_lr)
        return {**server_state, 'global': {**server_state['global'], **moved}}

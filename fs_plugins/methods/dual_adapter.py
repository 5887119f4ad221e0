"""What the methods that keep more LoRA adapters beside peft's 'default' one share (DITTO,
FedSim, FedDAT, FedDPA): adding one with the same config."""
import copy

import torch


def add_twin_adapter(model: torch.nn.Module, name: str, weight: float = 1.0,
                     trainable: bool = True) -> None:
    """Adds peft adapter `name` with the config of 'default', its LoRA scaling times `weight`
    (through lora_alpha), its parameters trainable or frozen."""
    config = copy.deepcopy(model.peft_config['default'])
    config.lora_alpha = config.lora_alpha * weight
    model.add_adapter(name, config)
    for param_name, param in model.named_parameters():
        if f'.{name}.' in param_name:
            param.requires_grad_(trainable)



def needs_lora_adapter(method: str, cfg) -> list[str]:
    """The config problem of running a twin-adapter method without LoRA (its twin is built
    from the LoRA config; plain dicts)."""
    adapter = cfg['fsplug']['model']['adapter']
    if adapter != 'lora':
        return [f"fsplug.model.adapter = {adapter!r}: fsplug.method = '{method}' keeps a second "
                f"LoRA adapter and needs 'lora'"]
    return []

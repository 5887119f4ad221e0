"""FedAvg (McMahan et al., 2017) over the LoRA parameters, weighted by the clients' aggregation
weights (fsplug.aggregation.weights). Everything trainable is shared; the server averages and
broadcasts the same state to all. The behaviour is the `Method` base class's.

`full_finetune` (also an option of `standalone`) trains and, for FedAvg, averages every weight
of the model instead of LoRA: Fed-MoLE's Table 5 baseline "FedAvg + Full Fine-tune". There is
no peft adapter; every base weight trains in float32 (a base loaded in bfloat16 / float16 is
cast up: the trained weights, their gradients and optimiser state are float32, and on CUDA the
forward still runs under autocast in fsplug.model.dtype, as with adapters), and every weight is
uploaded in float32: Table 5's 141.5 GB per round for five LLaVA-1.5-7B clients is five times
the 14.15 GB bfloat16 model at 4 bytes per weight. A quantised base cannot be trained and is
refused. Weights and gradients alone take 8 bytes per parameter (the optimiser's state adds
AdamW's 8 more); a client whose weights and gradients exceed its device's memory is refused
when its model is built (`fs-plugins estimate` gives the whole peak, activations included)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.base import Method
from fs_plugins.methods.registry import register_method
from fs_plugins.methods.specs import device_for
from fs_plugins.schema import option

logger = logging.getLogger(__name__)

GIB = 1024 ** 3
WEIGHT_AND_GRADIENT_BYTES = 8   # a float32 weight and its float32 gradient


@dataclass
class FullFinetuneConfig:
    full_finetune: bool = option(
        False, 'train every weight of the model in float32 instead of LoRA (no peft adapter; '
               'fsplug.model.lora is unused); fedavg uploads and averages all of them, '
               "standalone none: Fed-MoLE Table 5 'FedAvg + Full Fine-tune' (141.5 GB per round "
               'for five LLaVA-1.5-7B clients, OOM on its 24 GB GPUs)')


def train_every_weight(model: torch.nn.Module) -> torch.nn.Module:
    """All parameters trainable, in float32 (buffers keep their dtype)."""
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.float()
        param.requires_grad_(True)
    return model


def device_memory_bytes(device: str) -> int | None:
    """Total memory of `device` ('cuda:i' or 'cpu'); None where it cannot be read."""
    if device.startswith('cuda'):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    try:
        return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    except (ValueError, OSError, AttributeError):
        return None


def check_full_finetune_fits(model: torch.nn.Module, device: str, key: str) -> None:
    """Logs what full fine-tuning's trained weights need; a ConfigError naming `key` when their
    float32 weights and gradients alone exceed `device`'s memory. A model on the meta device
    (estimates, the server's expected uploads) is not checked."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params or any(p.is_meta for p in params):
        return
    count = sum(p.numel() for p in params)
    needed = WEIGHT_AND_GRADIENT_BYTES * count
    logger.info(f'{key}: {count:,} weights train in float32: weights + gradients '
                f'{needed / GIB:.2f} GiB, plus the optimiser state (AdamW: 8 bytes per weight, '
                f'{8 * count / GIB:.2f} GiB) and activations (fs-plugins estimate)')
    available = device_memory_bytes(device)
    if available is not None and needed > available:
        raise ConfigError(f'{key} = True: {count:,} float32 weights and their gradients need '
                          f'{needed / GIB:.1f} GiB, more than the {available / GIB:.1f} GiB of '
                          f'{device} (before the optimiser state and activations; see '
                          f'fs-plugins estimate)')


class FullFinetuneOption(Method):
    """A method with the `full_finetune` option (its config_class has that field): when on, the
    model gets no peft adapter and every weight trains in float32; `is_shared` decides as
    the method does (FedAvg: all of them; standalone: none)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        if self.hparams.full_finetune:
            self.uses_peft_adapter = False

    @classmethod
    def config_problems(cls, hparams, cfg):
        if not hparams.full_finetune:
            return []
        key = f'fsplug.{cls.name}.full_finetune'
        problems = []
        if cfg['fsplug']['method'] != cls.name:
            problems.append(f"{key} = True applies to fsplug.method '{cls.name}' only, not "
                            f"'{cfg['fsplug']['method']}'")
        quantization = cfg['fsplug']['model'].get('quantization', 'none')
        if quantization != 'none':
            problems.append(f"{key} = True trains every base weight: fsplug.model.quantization = "
                            f"'{quantization}' cannot be trained; use quantization: none")
        return problems

    def adapt_model(self, model, cfg):
        if not self.hparams.full_finetune:
            return model
        return train_every_weight(model)

    def after_build(self, model, codec, cfg):
        if self.hparams.full_finetune:
            check_full_finetune_fits(model, device_for(cfg), f'fsplug.{self.name}.full_finetune')


@register_method
class FedAvg(FullFinetuneOption):
    name = 'fedavg'
    summary = ('FedAvg over all LoRA factors, weighted by samples trained '
               '(fsplug.fedavg.full_finetune: over every weight, no LoRA)')
    sent = 'A, B (full_finetune: every weight) / the same'
    config_class = FullFinetuneConfig

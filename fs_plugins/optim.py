"""Optimiser and scheduler from FS's `train.optimizer` / `train.scheduler` nodes."""
from __future__ import annotations

import torch

from fs_plugins.errors import ConfigError
from fs_plugins.schema.options import to_plain


def build_optimizer(params, optimizer_cfg) -> torch.optim.Optimizer:
    kwargs = to_plain(optimizer_cfg)
    name = kwargs.pop('type')
    cls = getattr(torch.optim, name, None)
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        raise ConfigError(f"train.optimizer.type = '{name}' is not a torch.optim optimiser")
    try:
        return cls(params, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"train.optimizer: {exc}") from exc


def build_scheduler(optimizer, scheduler_cfg, total_steps: int):
    kwargs = to_plain(scheduler_cfg)
    name = kwargs.pop('type', '')
    kwargs.pop('warmup_ratio', None)
    if not name:
        return None
    cls = getattr(torch.optim.lr_scheduler, name, None)
    if cls is None:
        raise ConfigError(f"train.scheduler.type = '{name}' is not in torch.optim.lr_scheduler")
    if name == 'CosineAnnealingLR':
        kwargs.setdefault('T_max', max(total_steps, 1))
    return cls(optimizer, **kwargs)

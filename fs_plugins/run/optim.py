"""Optimiser and scheduler from FS's `train.optimizer` / `train.scheduler` nodes."""
from __future__ import annotations

import warnings

import torch

from fs_plugins.core.errors import ConfigError
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


def build_scheduler(optimizer, scheduler_cfg, total_steps: int, start_step: int = 0):
    """The scheduler of train.scheduler over `total_steps` (CosineAnnealingLR's default T_max),
    advanced to `start_step` (a run-level schedule resumed in a later round)."""
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
    try:
        scheduler = cls(optimizer, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"train.scheduler: {exc}") from exc
    with warnings.catch_warnings():
        # stepping ahead before any optimiser step is intended here
        warnings.simplefilter('ignore', UserWarning)
        for _ in range(start_step):
            scheduler.step()
    return scheduler


def schedule_window(scope: str, round_idx: int, total_rounds: int, round_steps: int):
    """(total_steps, start_step) of this round's scheduler: 'run' spans R·S steps and starts at
    t·S (round t, 0-based, S steps a round); 'round' restarts over S steps every round."""
    if scope == 'run':
        return max(total_rounds, 1) * round_steps, round_idx * round_steps
    if scope == 'round':
        return round_steps, 0
    raise ConfigError(f"fsplug.train.lr_schedule = '{scope}' is not 'run' or 'round'")

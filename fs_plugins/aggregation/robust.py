"""Robust aggregation for untrusted clients (fsplug.aggregation.robust), as pure functions.

- `clip_update`: per-client clipping of an update's delta (what it changed against the content
  it was sent) to an L2 norm bound, before any aggregation;
- `coordinate_median` / `trimmed_mean`: what the weighted average becomes, coordinate by
  coordinate, once one of them is active (Flower's FedMedian and FedTrimmedAvg compute the same:
  unweighted, since the weights are what a client reports about itself).

The active average is set for the span of a server aggregation by `robust_averaging` and read
by `fs_plugins.aggregation.average.weighted_average`, through which every method averages its
shared tensors; a method whose aggregation is not that average declares
`Method.robust_aggregation_refusal`, and the config check refuses the combination
(`fs_plugins.schema.validate.robust_problems`).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RobustAverage:
    """The coordinate-wise average in use: 'weighted' (sum_k p_k x_k), 'median' or
    'trimmed_mean' (dropping the `trim_fraction` largest and smallest values per coordinate)."""
    mode: str = 'weighted'
    trim_fraction: float = 0.2


WEIGHTED = RobustAverage()
_ACTIVE: contextvars.ContextVar[RobustAverage | None] = contextvars.ContextVar(
    'fsplug_robust_average', default=None)


@contextlib.contextmanager
def robust_averaging(average: RobustAverage):
    """Makes `average` the one `weighted_average` computes inside the block."""
    token = _ACTIVE.set(average)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_average() -> RobustAverage:
    return _ACTIVE.get() or WEIGHTED


# ------------------------------------------------------------------ coordinate-wise averages
def _stacked(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The clients' values along a new first axis, in float32 at least (float64 stays)."""
    dtype = torch.float64 if all(t.dtype == torch.float64 for t in tensors) else torch.float32
    return torch.stack([t.detach().to('cpu', dtype) for t in tensors])


def coordinate_median(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per coordinate, the median of the clients' values (the mean of the two middle ones for
    an even count, as numpy's); float32 (float64 for float64 inputs)."""
    ordered = _stacked(tensors).sort(dim=0).values
    count = ordered.shape[0]
    upper = ordered[count // 2]
    return upper if count % 2 else (ordered[count // 2 - 1] + upper) / 2


def trimmed_count(count: int, trim_fraction: float) -> int:
    """Values dropped at each end: int(trim_fraction · count), as scipy's trim_mean."""
    return int(trim_fraction * count)


def trimmed_mean(tensors: Sequence[torch.Tensor], trim_fraction: float) -> torch.Tensor:
    """Per coordinate, the mean of the clients' values without the trimmed_count largest and
    smallest ones; float32 (float64 for float64 inputs)."""
    if not 0 <= trim_fraction < 0.5:
        raise ValueError(f'trim fraction {trim_fraction} is not in [0, 0.5)')
    ordered = _stacked(tensors).sort(dim=0).values
    cut = trimmed_count(ordered.shape[0], trim_fraction)
    return ordered[cut:ordered.shape[0] - cut].mean(dim=0)


def robust_combination(tensors: Sequence[torch.Tensor], average: RobustAverage) -> torch.Tensor:
    if average.mode == 'median':
        return coordinate_median(tensors)
    if average.mode == 'trimmed_mean':
        return trimmed_mean(tensors, average.trim_fraction)
    raise ValueError(f"robust average {average.mode!r} is not 'median' or 'trimmed_mean'")


# ------------------------------------------------------------------ per-client clipping
def delta_of(tensors: dict, reference: dict | None) -> dict[str, torch.Tensor]:
    """Each tensor minus the reference tensor of its name and shape (float64); a tensor the
    reference lacks (or has with another shape) counts whole."""
    reference = reference or {}
    delta = {}
    for name, value in tensors.items():
        value = value.detach().to('cpu', torch.float64)
        base = reference.get(name)
        if torch.is_tensor(base) and tuple(base.shape) == tuple(value.shape):
            value = value - base.detach().to('cpu', torch.float64)
        delta[name] = value
    return delta


def l2_norm(tensors: dict) -> float:
    """The L2 norm of all the tensors together (in float64, any dtype)."""
    return math.sqrt(sum(float(t.detach().to(torch.float64).pow(2).sum()) for t in tensors.values()))


def clip_update(tensors: dict, reference: dict | None, max_norm: float) -> tuple[dict, float]:
    """(`tensors` with their delta against `reference` scaled down to L2 norm `max_norm`, the
    delta's norm before): reference + delta · max_norm / ‖delta‖ when ‖delta‖ > max_norm, else
    the tensors unchanged. Dtypes are kept."""
    delta = delta_of(tensors, reference)
    norm = l2_norm(delta)
    if max_norm <= 0 or norm <= max_norm:
        return tensors, norm
    scale = max_norm / norm
    clipped = {}
    for name, value in tensors.items():
        base = value.detach().to('cpu', torch.float64) - delta[name]
        clipped[name] = (base + delta[name] * scale).to(value.dtype)
    return clipped, norm

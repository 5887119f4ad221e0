"""Server-side checks of a client update before it is aggregated (pure functions).

An update is rejected, with the reason, when a tensor it sends is not finite, when its shared
tensors are not exactly the expected ones (a missing or unexpected name, a wrong shape), or
when the L2 norm of its shared tensors together exceeds fsplug.validation.max_update_norm.
"""
from __future__ import annotations

import math

import torch

from fs_plugins.aggregation.signature import signature_of

MAX_NAMES_SHOWN = 3


def update_problem(shared: dict, extra: dict, expected: dict[str, tuple] | None,
                   max_norm: float) -> str | None:
    """Why an update (`shared` and `extra` tensors) must be rejected, or None. `expected`:
    the shared tensors' names and shapes (None: not known, not checked)."""
    for kind, tensors in (('shared', shared), ('extra', extra)):
        for name, value in tensors.items():
            if not torch.is_tensor(value):
                return f'{kind} {name} is a {type(value).__name__}, not a tensor'
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                return f'{kind} {name} {tuple(value.shape)} has non-finite values (NaN/Inf)'
    if expected is not None:
        problem = _shape_problem(signature_of(shared), expected)
        if problem:
            return problem
    norm = math.sqrt(sum(float(t.detach().double().pow(2).sum())
                         for t in shared.values() if t.is_floating_point()))
    if max_norm > 0 and norm > max_norm:
        return (f'L2 norm of the shared tensors {norm:.4g} exceeds '
                f'fsplug.validation.max_update_norm = {max_norm:g}')
    return None


def _shape_problem(got: dict[str, tuple], expected: dict[str, tuple]) -> str | None:
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing:
        return f'missing shared tensor(s) {_names(missing)}'
    if unexpected:
        return f'unexpected shared tensor(s) {_names(unexpected)}'
    for name in sorted(got):
        if got[name] != expected[name]:
            return f'shared {name} has shape {got[name]}, expected {expected[name]}'
    return None


def _names(names: list[str]) -> str:
    shown = ', '.join(names[:MAX_NAMES_SHOWN])
    return shown + (f' and {len(names) - MAX_NAMES_SHOWN} more' if len(names) > MAX_NAMES_SHOWN else '')

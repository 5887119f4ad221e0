"""Server-side checks of a client update before it is aggregated (pure functions).

An update is rejected, with the reason, when:
- a value it sends is not a tensor;
- its shared tensors are not exactly those of the signature the server built for that client
  (a missing or unexpected name, a wrong shape, a wrong dtype);
- a floating tensor it sends is not finite;
- an extra payload's name is not one its method declares (`Contract.extra`);
- its delta (the shared tensors minus the content the client was sent, where that content has
  a tensor of the same name and shape; integer and bool tensors count) has an L2 norm over
  fsplug.validation.max_update_norm, or its floating-point extra payload one over
  fsplug.validation.max_extra_norm (integer extras are ids, e.g. FedMosaic's model types);
- its counts (processed samples, training-set size) are not whole numbers in range.
"""
from __future__ import annotations

import fnmatch
import math
import numbers
from dataclasses import dataclass

import torch

from fs_plugins.aggregation.robust import delta_of, l2_norm

MAX_NAMES_SHOWN = 3
MAX_COUNT = 10 ** 12   # no client trains on more records than this


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix('torch.')


def typed_signature(tensors: dict) -> dict[str, tuple]:
    """{name: (shape, dtype name)} of a set of tensors: what the server expects a client to send."""
    return {name: (tuple(t.shape), dtype_name(t.dtype)) for name, t in tensors.items()}


@dataclass
class UpdateChecks:
    """What an update is checked against. `expected`: the shared tensors' typed_signature (a
    bare shape per name checks no dtype; None: not checked); `sent`: the content the client was
    sent (None: the deltas are the tensors themselves); `extra_patterns`: fnmatch patterns of the
    allowed extra names (None: not checked)."""
    expected: dict[str, tuple] | None = None
    max_norm: float = 0.0
    sent: dict | None = None
    extra_patterns: tuple[str, ...] | None = None
    max_extra_norm: float = 0.0


def update_problem(shared: dict, extra: dict, expected: dict[str, tuple] | None,
                   max_norm: float, **checks) -> str | None:
    """Why an update (`shared` and `extra` tensors) must be rejected, or None; `expected`,
    `max_norm` and `checks` are UpdateChecks' fields."""
    return checked_problem(shared, extra, UpdateChecks(expected, max_norm, **checks))


def checked_problem(shared: dict, extra: dict, checks: UpdateChecks) -> str | None:
    return (_type_problem(shared, extra)
            or (signature_problem(shared, checks.expected) if checks.expected is not None else None)
            or _finite_problem(shared, extra)
            or _extra_name_problem(extra, checks.extra_patterns)
            or _norm_problem(shared, extra, checks))


def _type_problem(shared: dict, extra: dict) -> str | None:
    for kind, tensors in (('shared', shared), ('extra', extra)):
        for name, value in tensors.items():
            if not torch.is_tensor(value):
                return f'{kind} {name} is a {type(value).__name__}, not a tensor'
    return None


def _finite_problem(shared: dict, extra: dict) -> str | None:
    for kind, tensors in (('shared', shared), ('extra', extra)):
        for name, value in tensors.items():
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                return f'{kind} {name} {tuple(value.shape)} has non-finite values (NaN/Inf)'
    return None


def signature_problem(shared: dict, expected: dict[str, tuple]) -> str | None:
    missing = sorted(set(expected) - set(shared))
    unexpected = sorted(set(shared) - set(expected))
    if missing:
        return f'missing shared tensor(s) {_names(missing)}'
    if unexpected:
        return f'unexpected shared tensor(s) {_names(unexpected)}'
    for name in sorted(shared):
        shape, dtype = _shape_and_dtype(expected[name])
        got = tuple(shared[name].shape)
        if got != shape:
            return f'shared {name} has shape {got}, expected {shape}'
        if dtype is not None and dtype_name(shared[name].dtype) != dtype:
            return f'shared {name} has dtype {dtype_name(shared[name].dtype)}, expected {dtype}'
    return None


def _shape_and_dtype(entry: tuple) -> tuple[tuple, str | None]:
    """A signature entry: (shape, dtype name), or a bare shape (dtype unchecked)."""
    if len(entry) == 2 and isinstance(entry[0], tuple) and isinstance(entry[1], str):
        return tuple(entry[0]), entry[1]
    return tuple(entry), None


def _extra_name_problem(extra: dict, patterns: tuple[str, ...] | None) -> str | None:
    if patterns is None:
        return None
    unexpected = sorted(n for n in extra if not any(fnmatch.fnmatchcase(n, p) for p in patterns))
    if unexpected:
        return f'unexpected extra payload(s) {_names(unexpected)}'
    return None


def _norm_problem(shared: dict, extra: dict, checks: UpdateChecks) -> str | None:
    if checks.max_norm > 0:
        norm = l2_norm(delta_of(shared, checks.sent))
        if not norm <= checks.max_norm:
            return (f'L2 norm of the change of the shared tensors {norm:.4g} exceeds '
                    f'fsplug.validation.max_update_norm = {checks.max_norm:g}')
    floating = {n: t for n, t in extra.items() if t.is_floating_point()}
    if checks.max_extra_norm > 0 and floating:
        norm = l2_norm(floating)
        if not norm <= checks.max_extra_norm:
            return (f'L2 norm of the extra payload {norm:.4g} exceeds '
                    f'fsplug.validation.max_extra_norm = {checks.max_extra_norm:g}')
    return None


def count_problem(value, what: str, minimum: int = 0) -> str | None:
    """Why `value` is not a whole number in [minimum, MAX_COUNT] (an integral float passes:
    FS's gRPC may carry numbers as floats), or None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f'{what} = {value!r} is not a number'
    if not isinstance(value, numbers.Integral) and not (math.isfinite(value)
                                                         and float(value).is_integer()):
        return f'{what} = {value!r} is not a whole number'
    if not minimum <= value <= MAX_COUNT:
        return f'{what} = {value!r} is not in [{minimum}, {MAX_COUNT:.0e}]'
    return None


def _names(names: list[str]) -> str:
    shown = ', '.join(names[:MAX_NAMES_SHOWN])
    return shown + (f' and {len(names) - MAX_NAMES_SHOWN} more' if len(names) > MAX_NAMES_SHOWN else '')

"""Metric names for FS's monitor: FS looks every name of `eval.metrics` up in its metric
registry (whether larger is better) even for metrics fsplug clients compute themselves, by
generation or per test modality; FS's own logits-based path never computes these."""
from __future__ import annotations

from federatedscope import register as fs_register

_REGISTERED: set[str] = set()


def named_metric_lookup(name: str, larger_is_better: bool):
    """A lookup that tells FS's monitor `name` exists and which way is better."""
    def not_from_logits(ctx, y_true, y_pred, y_prob, **kwargs):
        raise RuntimeError(f"'{name}' is computed by fsplug clients in their own evaluation, "
                           f"not from FS's evaluation logits")

    def lookup(types):
        return (name, not_from_logits, larger_is_better) if name in types else None
    return lookup


def register_named_metrics(names: dict[str, bool]) -> None:
    """Registers each {name: larger is better} once."""
    for name, larger in names.items():
        if name not in _REGISTERED:
            _REGISTERED.add(name)
            fs_register.register_metric(f'fsplug_{name}', named_metric_lookup(name, larger))

"""The names and shapes of a set of tensors: what tells clients of one architecture apart."""
from __future__ import annotations


def signature_of(tensors: dict) -> dict[str, tuple]:
    return {name: tuple(t.shape) for name, t in tensors.items()}


def tensor_signature(tensors: dict) -> tuple:
    """The names and shapes of a set of shared tensors: equal for clients of one architecture."""
    return tuple(sorted(signature_of(tensors).items()))

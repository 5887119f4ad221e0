"""Name -> Method class. Methods register themselves with `@register_method`."""
from __future__ import annotations

from fs_plugins.config import ConfigError

_METHODS: dict = {}


def register_method(cls):
    """Class decorator: makes `fsplug.method: <cls.name>` select `cls`."""
    if not getattr(cls, 'name', None):
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute 'name'")
    _METHODS[cls.name] = cls
    return cls


def all_methods() -> dict:
    _load_builtin_methods()
    return dict(_METHODS)


def get_method_class(name: str):
    methods = all_methods()
    if name not in methods:
        raise ConfigError(f"fsplug.method = '{name}' is not a known method; allowed: "
                          f"{', '.join(sorted(methods))}")
    return methods[name]


def _load_builtin_methods() -> None:
    # Imported here, not at module top, so that registry <- method modules has no cycle.
    from fs_plugins.methods import (fed_a2, fedavg, feddpa, fedex, fedmole, fedopt, fedprox,  # noqa: F401
                                    fedsa, ffa, flexlora, hetlora, scaffold, standalone)
    from fs_plugins.methods import flame  # noqa: F401

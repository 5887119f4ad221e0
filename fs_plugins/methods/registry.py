"""Name -> Method class. Every module in this package (and every module named in
`fsplug.import_modules`) registers its methods with `@register_method`; nothing lists them."""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from fs_plugins.core.errors import ConfigError
from fs_plugins.schema.options import undocumented_fields

_METHODS: dict = {}
_DISCOVERED = False


def register_method(cls):
    """Class decorator: makes `fsplug.method: <cls.name>` select `cls`, with the node
    `fsplug.<cls.name>` generated from `cls.config_class`."""
    if not getattr(cls, 'name', None):
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute 'name'")
    if not (cls.summary and cls.sent):
        raise TypeError(f"{cls.__name__} needs the class attributes 'summary' (what it does) and "
                        f"'sent' (what travels up / down), one line each")
    if not dataclasses.is_dataclass(cls.config_class):
        raise TypeError(f"{cls.__name__}.config_class must be a dataclass of "
                        f"fs_plugins.schema.option fields")
    undocumented = undocumented_fields(cls.config_class, f'fsplug.{cls.name}')
    if undocumented:
        raise TypeError(f"{cls.__name__}.config_class: give these keys a help text with "
                        f"option(...): {', '.join(undocumented)}")
    known = _METHODS.get(cls.name)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise ValueError(f"Method name '{cls.name}' is taken by {known.__module__}.{known.__qualname__}")
    _METHODS[cls.name] = cls
    return cls


def all_methods() -> dict:
    _discover_package_methods()
    return dict(_METHODS)


def get_method_class(name: str):
    methods = all_methods()
    if name not in methods:
        raise ConfigError(f"fsplug.method = '{name}' is not a known method; allowed: "
                          f"{', '.join(sorted(methods))}")
    return methods[name]


def _discover_package_methods() -> None:
    """Imports every module of fs_plugins.methods once (they register on import)."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    import fs_plugins.methods as package
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f'{package.__name__}.{module.name}')

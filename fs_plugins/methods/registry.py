"""Name -> Method class. Every module in this package (and every module named in
`fsplug.import_modules`) registers its methods with `@register_method`; nothing lists them."""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from fs_plugins.core.registry import METHODS
from fs_plugins.schema.options import undocumented_fields


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
    known = METHODS.registered(cls.name)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise ValueError(f"Method name '{cls.name}' is taken by {known.__module__}.{known.__qualname__}")
    METHODS.add(cls.name, cls)
    return cls


def all_methods() -> dict:
    return dict(METHODS.items())


def get_method_class(name: str):
    return METHODS.get(name)


def _discover_package_methods() -> None:
    """Imports every module of this package (they register on import)."""
    package = __name__.rsplit('.', 1)[0]
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(f'{package}.{module.name}')


METHODS.discover_with(_discover_package_methods)

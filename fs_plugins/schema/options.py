"""Typed, documented config sections as dataclasses, and checking raw values against them.

A section is a dataclass whose fields are made with `option(default, help, ...)` (a value) or
`section(cls, help)` (a sub-node). The field's annotation is its type (bool, int, float, str,
list[str], list[int], Optional[...]); the keyword arguments are its allowed range or choices.
`check_section` checks a raw mapping and returns every problem at once; `build` turns checked
values into the dataclass instance the code reads; `defaults_of` gives the YAML node.
"""
from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, field, fields
from typing import Any

from fs_plugins.core.errors import closest_spelling

# bookkeeping entries FS's CfgNode keeps inside every node
FS_AUX_KEYS = frozenset({'__cfg_check_funcs__', '__help_info__', 'is_ready_for_run'})
# marks a node of FS's key tree that accepts any key (a CfgNode with new_allowed)
OPEN_NODE = '__open__'


def to_plain(value):
    """FS CfgNode / attribute dicts -> plain nested dicts and lists (FS bookkeeping dropped)."""
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items() if k not in FS_AUX_KEYS}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


class Cfg(dict):
    """A nested dict with attribute access, shaped like FS's CfgNode, so core code reads
    `cfg.fsplug.model.lora.r` the same way under both runners."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc

    def __setattr__(self, name, value):
        self[name] = value

    @classmethod
    def wrap(cls, value):
        if isinstance(value, Mapping):
            return cls({k: cls.wrap(v) for k, v in value.items()})
        return value


def option(default, help: str, *, choices=None, ge=None, gt=None, le=None, lt=None,
           special=(), min_items: int = 0):
    """A checked, documented value. `choices`: allowed values (or, for a list, allowed items),
    a collection or a zero-argument callable returning one (a registry's names). `ge`/`gt`/
    `le`/`lt`: bounds (for a list, bounds of each item). `special`: values allowed outside the
    bounds (e.g. -1 meaning 'unset')."""
    meta = {'help': help, 'choices': choices, 'ge': ge, 'gt': gt, 'le': le, 'lt': lt,
            'special': tuple(special), 'min_items': min_items}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls, help: str):
    """A sub-node holding the dataclass `cls`."""
    return field(default_factory=cls, metadata={'help': help})


def is_open(cls) -> bool:
    """Open sections accept keys they do not declare (e.g. FS's train.optimizer kwargs)."""
    return bool(getattr(cls, 'open_keys', False))


# ------------------------------------------------------------------------------ types

def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _optional_inner(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and type(None) in typing.get_args(tp):
            return args[0]
    return None


def _list_item(tp):
    if typing.get_origin(tp) in (list, tuple):
        return (typing.get_args(tp) or (Any,))[0]
    return None


def _dict_value(tp):
    """The value type of a `dict[str, X]` annotation (its keys are strings), else None."""
    if typing.get_origin(tp) is dict:
        return (typing.get_args(tp) or (str, Any))[-1]
    return None


def type_name(tp) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f'{type_name(inner)} or null'
    value = _dict_value(tp)
    if value is not None:
        return f'mapping of str to {type_name(value)}'
    item = _list_item(tp)
    if item is not None:
        return f'list of {type_name(item)}'
    return {bool: 'bool', int: 'int', float: 'float', str: 'str'}.get(tp, getattr(tp, '__name__', str(tp)))


def _type_ok(value, tp) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return True


def _coerce(value, tp):
    inner = _optional_inner(tp)
    if inner is not None:
        return None if value is None else _coerce(value, inner)
    item = _list_item(tp)
    if item is not None:
        return [_coerce(v, item) for v in value]
    entry = _dict_value(tp)
    if entry is not None:
        return {k: _coerce(v, entry) for k, v in value.items()}
    if tp is float:
        return float(value)
    return value


# ------------------------------------------------------------------------------ checks

def unknown_key_message(path: str, key: str, allowed) -> str:
    allowed = sorted(str(a) for a in allowed)
    full = f'{path}.{key}' if path else str(key)
    close = closest_spelling(key, allowed)
    hint = f" Did you mean '{(path + '.') if path else ''}{close}'?" if close else ''
    listing = (f" Allowed keys under '{path or '<root>'}': {', '.join(allowed)}"
               if len(allowed) <= 25 else '')
    return f"Unknown config key '{full}'.{hint}{listing}"


def _resolve_choices(choices):
    if choices is None:
        return None
    return list(choices() if callable(choices) else choices)


def _bounds_problem(value, meta) -> str | None:
    if value in meta['special']:
        return None
    for key, test, word in (('ge', lambda v, b: v >= b, '>='), ('gt', lambda v, b: v > b, '>'),
                            ('le', lambda v, b: v <= b, '<='), ('lt', lambda v, b: v < b, '<')):
        bound = meta.get(key)
        if bound is not None and not test(value, bound):
            extra = f" (or {' / '.join(map(repr, meta['special']))})" if meta['special'] else ''
            return f'must be {word} {bound}{extra}'
    return None


def choice_message(key: str, value, choices) -> str:
    """'<key> = <value>: not one of: <choices>', with the closest spelling suggested."""
    message = f"{key} = {value!r}: not one of: {', '.join(map(str, choices))}"
    close = closest_spelling(value, choices) if isinstance(value, str) and value else None
    return message + (f". Did you mean '{close}'?" if close else '')


def check_value(key: str, value, tp, meta: Mapping, registries: bool = True) -> list[str]:
    """Problems of one value against its annotation and `option` metadata.

    registries: False skips choices given as a callable (a registry's names, which need the
    packages that fill the registry imported): the pre-check before those imports."""
    inner = _optional_inner(tp)
    if inner is not None:
        return [] if value is None else check_value(key, value, inner, meta, registries)
    item = _list_item(tp)
    if item is not None:
        if not isinstance(value, (list, tuple)):
            return [f'{key} = {value!r}: expected a {type_name(tp)}']
        problems = [f'{key} = {value!r}: needs at least {meta["min_items"]} item(s)'] \
            if len(value) < meta.get('min_items', 0) else []
        for i, entry in enumerate(value):
            problems += check_value(f'{key}[{i}]', entry, item, meta, registries)
        return problems
    if _dict_value(tp) is not None:
        return _mapping_problems(key, value, tp, meta, registries)
    if not _type_ok(value, tp):
        return [f'{key} = {value!r}: expected {type_name(tp)}']
    dynamic = callable(meta.get('choices'))
    choices = _resolve_choices(meta.get('choices')) if registries or not dynamic else None
    if choices is not None and value not in choices:
        return [choice_message(key, value, choices)]
    if tp in (int, float):
        problem = _bounds_problem(value, meta)
        if problem:
            return [f'{key} = {value!r}: {problem}']
    return []


def _mapping_problems(key: str, value, tp, meta: Mapping, registries: bool) -> list[str]:
    """A `dict[str, X]` option: `choices` are its allowed keys, bounds apply to each value."""
    if not isinstance(value, Mapping):
        return [f'{key} = {value!r}: expected a {type_name(tp)}']
    allowed = _resolve_choices(meta.get('choices'))
    problems = []
    for name, entry in value.items():
        if not isinstance(name, str) or (allowed is not None and name not in allowed):
            problems.append(unknown_key_message(key, str(name), allowed or ()))
            continue
        problems += check_value(f'{key}.{name}', entry, _dict_value(tp),
                                {**meta, 'choices': None}, registries)
    return problems


def check_section(cls, values, path: str = '', strict: bool = True,
                  registries: bool = True) -> tuple[dict, list[str]]:
    """(normalised values over the defaults, problems) of a raw mapping against section `cls`.

    strict: keys `cls` does not declare are problems (closest spelling suggested) unless the
    section is open; with strict=False they pass through unchecked (FS's own keys under FS).
    registries: False leaves out the choices a registry owns (see `check_value`)."""
    if not isinstance(values, Mapping):
        return defaults_of(cls), [f"{path or '<root>'} = {values!r}: expected a mapping"]
    hints, declared = _hints(cls), {f.name: f for f in fields(cls)}
    problems, out = [], {}
    for key, value in values.items():
        if key in FS_AUX_KEYS or key in declared:
            continue
        if strict and not is_open(cls):
            problems.append(unknown_key_message(path, key, declared))
        out[key] = value
    for name, fld in declared.items():
        key = f'{path}.{name}' if path else name
        value = values[name] if name in values else _default(fld)
        if _is_section(hints[name]):
            out[name], sub = check_section(hints[name], value, key, strict, registries)
            problems += sub
            continue
        found = check_value(key, value, hints[name], fld.metadata, registries)
        problems += found
        out[name] = value if found else _coerce(value, hints[name])
    return out, problems


def _default(fld):
    if fld.default_factory is not MISSING:
        return fld.default_factory()
    return copy.deepcopy(fld.default)


def defaults_of(cls) -> dict:
    """The plain nested dict of a section's defaults (the YAML node it generates)."""
    hints = _hints(cls)
    return {f.name: defaults_of(hints[f.name]) if _is_section(hints[f.name]) else _default(f)
            for f in fields(cls)}


def build(cls, values: Mapping | None = None):
    """The dataclass instance for checked values (missing keys take their defaults)."""
    values = values or {}
    hints, kwargs = _hints(cls), {}
    for fld in fields(cls):
        if fld.name not in values:
            continue
        tp = hints[fld.name]
        kwargs[fld.name] = build(tp, values[fld.name]) if _is_section(tp) else _coerce(values[fld.name], tp)
    return cls(**kwargs)


def undocumented_fields(cls, path: str = '') -> list[str]:
    """Keys of `cls` (recursively) made without `option`/`section`, i.e. without help."""
    hints, missing = _hints(cls), []
    for fld in fields(cls):
        key = f'{path}.{fld.name}' if path else fld.name
        if not fld.metadata.get('help'):
            missing.append(key)
        if _is_section(hints[fld.name]):
            missing += undocumented_fields(hints[fld.name], key)
    return missing


def walk_options(cls, path: str):
    """(dotted key, annotation, field) of every option under `cls`, sections recursed into."""
    hints = _hints(cls)
    for fld in fields(cls):
        key, tp = f'{path}.{fld.name}', hints[fld.name]
        if _is_section(tp):
            yield from walk_options(tp, key)
        else:
            yield key, tp, fld


def describe(cls, path: str) -> list[dict]:
    """One row per key (recursively): key, type, default, allowed, help — for documentation."""
    return [{'key': key, 'type': type_name(tp), 'default': _default(fld),
             'allowed': allowed_text(fld.metadata), 'help': fld.metadata.get('help', '')}
            for key, tp, fld in walk_options(cls, path)]


def allowed_text(meta: Mapping) -> str:
    choices = _resolve_choices(meta.get('choices'))
    if choices is not None:
        return ', '.join(map(str, choices))
    parts = [f'{word} {meta[k]}' for k, word in (('ge', '≥'), ('gt', '>'), ('le', '≤'), ('lt', '<'))
             if meta.get(k) is not None]
    if parts and meta.get('special'):
        parts.append('or ' + ' / '.join(map(str, meta['special'])))
    return ' '.join(parts)


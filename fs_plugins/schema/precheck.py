"""The config check that runs before torch and transformers are imported, so that a mistake in a
YAML or on the command line fails in about a second instead of after the heavy imports.

It is the full check (`fs_plugins.schema.loading.check_layers`, the same merges and messages)
with two differences:
- choices that a registry owns (model builders, adapters, encoder backends, splitters,
  generation metrics, reported metrics) and each method's own rules between keys are left to
  the full check after the imports: filling a registry imports the packages that own it;
- the registered methods, and the options of each one's `fsplug.<name>` node, come from
  `fs_plugins.schema.method_index`, a module generated from the method registry by
  `render_index` (never edited by hand; tests/test_precheck.py fails when it is stale;
  `python scripts/gen_reference.py` rewrites it).
A config naming `fsplug.import_modules` may register more methods: their names and nodes then
pass to the full check. Before it refuses a config, the pre-check makes sure the index is not
stale: the method names and option keys that the source of fs_plugins/methods declares (parsed
with `ast`, not imported) must be those of the index; otherwise (a method or option added and
the index not regenerated yet) the config goes on to the full check, which decides.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import os
from collections.abc import Mapping
from typing import Any

from fs_plugins.core.errors import ConfigError
from fs_plugins.schema import method_index
from fs_plugins.schema.fs_source_keys import fs_source_key_tree
from fs_plugins.schema.loading import check_layers, config_layers, layer_modules
from fs_plugins.schema.options import _default, _hints, _is_section, _list_item, _optional_inner, option
from fs_plugins.schema.placeholders import placeholder_problems
from fs_plugins.schema.validate import OPEN_NODE, KnownMethods, fs_defaults, fsplug_defaults

__all__ = ['precheck', 'index_methods', 'render_index', 'INDEX_PATH']

INDEX_PATH = method_index.__file__
# fs_plugins/methods, whose modules the index is generated from (a path, not an import)
METHODS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'methods')
# the option metadata the index keeps (the help text is the registry's business)
INDEX_META = ('choices', 'ge', 'gt', 'le', 'lt', 'special', 'min_items')
# the annotations an index entry may name: these, list[...] and Optional[...] of them
TYPE_NAMES = {'bool': bool, 'int': int, 'float': float, 'str': str, 'Any': Any}


# ------------------------------------------------------------------ the pre-check

def precheck(path: str | None, opts: list[str] | None = None, fs: bool = False,
             placeholders: bool = True) -> None:
    """Raises the ConfigError the full load would raise for the YAML at `path` plus the
    command line `opts`, for every problem that can be found without the registries.

    fs: the config goes to FederatedScope: its own keys are those its installed config modules
    declare (`fs_source_keys`, read without importing FS; when they cannot be read, any key
    outside those the plugin reads passes); problems are not prefixed by their source, as FS's
    merges do not prefix them; a missing file is left to FS's own message.

    placeholders: also refuse a key whose effective value is still a `/path/to/` placeholder,
    listed after the other problems (False: for a caller that swaps the model and data for tiny ones,
    as `audit --tiny` does)."""
    if fs and path and not os.path.isfile(path):
        return
    try:
        layers = config_layers(path, opts)
    except ConfigError:
        raise
    except Exception:    # noqa: BLE001 -- what the pre-check cannot read, the full check reports
        return
    left = placeholder_problems(layers, methods=frozenset(method_index.METHODS)) if placeholders else []
    try:
        incomplete = any(layer_modules(layer) for layer, _ in layers)
        known = KnownMethods(index_methods(), complete=not incomplete, registries=False)
        check_layers(layers, {**fs_defaults(), 'fsplug': fsplug_defaults(known)},
                     (fs_source_key_tree() or {OPEN_NODE: True}) if fs else None, known,
                     name_sources=not fs)
    except ConfigError as exc:
        if index_matches_sources():
            raise ConfigError(exc.problems + left) from None
    except Exception:    # noqa: BLE001 -- what the pre-check cannot read, the full check reports
        pass
    if left:
        raise ConfigError(left)


def index_matches_sources(index: Mapping | None = None, methods_dir: str = METHODS_DIR) -> bool:
    """Whether the index holds the methods, and each one's option keys, that the source of
    fs_plugins/methods declares: the `name = '...'` of each `@register_method` class and the
    fields of the dataclass it (or a base class) names as its `config_class`. Parsed with `ast`,
    not imported; only run when the pre-check is about to refuse a config."""
    index = method_index.METHODS if index is None else index
    return declared_in_sources(methods_dir) == {name: frozenset(options)
                                                for name, options in index.items()}


@functools.cache
def declared_in_sources(methods_dir: str = METHODS_DIR) -> dict[str, frozenset] | None:
    """{method name: its option keys} as the modules under `methods_dir` declare them (None
    when one cannot be read); read once per process."""
    classes: dict[str, ast.ClassDef] = {}
    try:
        for path in sorted(glob.glob(os.path.join(methods_dir, '**', '*.py'), recursive=True)):
            with open(path, encoding='utf-8') as handle:
                tree = ast.parse(handle.read(), path)
            classes.update((node.name, node) for node in ast.walk(tree) if isinstance(node, ast.ClassDef))
    except (OSError, SyntaxError, ValueError):
        return None
    declared = {}
    for node in classes.values():
        name = _class_value(node, 'name', classes)
        if _registered(node) and isinstance(name, ast.Constant):
            config = _class_value(node, 'config_class', classes)
            declared[name.value] = _fields(classes.get(getattr(config, 'id', None)), classes)
    return declared


def _registered(node: ast.ClassDef) -> bool:
    return any((d.id if isinstance(d, ast.Name) else getattr(d, 'attr', '')) == 'register_method'
               for d in node.decorator_list)


def _mro(node: ast.ClassDef, classes: Mapping) -> list[ast.ClassDef]:
    """The class and its bases in Python's method resolution order (C3), among the classes of
    the scanned modules (bases from elsewhere are left out)."""
    bases = [classes[b.id] for b in node.bases if isinstance(b, ast.Name) and b.id in classes
             and classes[b.id] is not node]
    pending = [_mro(base, classes) for base in bases] + [bases]
    order = [node]
    while any(pending):
        pending = [seq for seq in pending if seq]
        head = next((seq[0] for seq in pending
                     if not any(seq[0] in other[1:] for other in pending)), pending[0][0])
        order.append(head)
        pending = [seq[1:] if seq[0] is head else seq for seq in pending]
    return order


def _class_value(node: ast.ClassDef, attribute: str, classes: Mapping) -> ast.expr | None:
    """The value assigned to a class attribute, looked up as Python does (the MRO)."""
    for klass in _mro(node, classes):
        for statement in klass.body:
            for target, value in _assignments(statement):
                if target == attribute:
                    return value
    return None


def _fields(node: ast.ClassDef | None, classes: Mapping) -> frozenset:
    """The annotated (non-ClassVar) attributes of a dataclass and of its base classes."""
    if node is None:
        return frozenset()
    return frozenset(s.target.id for klass in _mro(node, classes) for s in klass.body
                     if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                     and 'ClassVar' not in ast.unparse(s.annotation))


def _assignments(statement) -> list[tuple[str, ast.expr]]:
    """(name, value) of `a = v`, `a: T = v` and `a, b = v, w` statements."""
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) \
            and statement.value is not None:
        return [(statement.target.id, statement.value)]
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
        return []
    target, value = statement.targets[0], statement.value
    if isinstance(target, ast.Name):
        return [(target.id, value)]
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
            and len(target.elts) == len(value.elts):
        return [(t.id, v) for t, v in zip(target.elts, value.elts) if isinstance(t, ast.Name)]
    return []


# ------------------------------------------------------------------ the index

def index_methods(index: Mapping | None = None) -> dict[str, type]:
    """name -> a config class equivalent to the method's (same keys, types, defaults, bounds
    and fixed choices), rebuilt from the generated index (the shipped one: once per process)."""
    if index is None:
        return dict(_shipped_index_methods())
    return {name: _section_class(f'{name}_options', options) for name, options in index.items()}


@functools.lru_cache(maxsize=1)
def _shipped_index_methods() -> dict[str, type]:
    return index_methods(method_index.METHODS)


def _section_class(name: str, options: Mapping) -> type:
    made = []
    for key, entry in options.items():
        if isinstance(entry, Mapping):     # a sub-section
            sub = _section_class(f'{name}_{key}', entry)
            made.append((key, sub, dataclasses.field(default_factory=sub)))
            continue
        annotation, default, meta = entry
        made.append((key, annotation_type(annotation), option(default, '', **meta)))
    return dataclasses.make_dataclass(name, made)


def annotation_type(text: str):
    """The annotation an index entry names ('Optional[list[str]]' -> Optional[list[str]])."""
    for wrapper, make in (('Optional[', lambda inner: inner | None),
                          ('list[', lambda item: list[item])):
        if text.startswith(wrapper) and text.endswith(']'):
            return make(annotation_type(text[len(wrapper):-1]))
    return TYPE_NAMES[text]


def annotation_text(tp) -> str:
    """An option's annotation as the index writes it ('Optional[list[str]]')."""
    inner = _optional_inner(tp)
    if inner is not None:
        return f'Optional[{annotation_text(inner)}]'
    item = _list_item(tp)
    if item is not None:
        return f'list[{annotation_text(item)}]'
    return tp.__name__ if tp in (bool, int, float, str) else 'Any'


def section_entry(cls) -> dict:
    """key -> (annotation, default, metadata) of every option of a config class, sub-sections
    as nested dicts. A choice given as a callable (a registry's names) is left out."""
    hints, out = _hints(cls), {}
    for fld in dataclasses.fields(cls):
        tp = hints[fld.name]
        if _is_section(tp):
            out[fld.name] = section_entry(tp)
            continue
        meta = {k: fld.metadata[k] for k in INDEX_META
                if fld.metadata.get(k) not in (None, ()) and (k, fld.metadata[k]) != ('min_items', 0)}
        if callable(meta.get('choices')):
            del meta['choices']
        elif 'choices' in meta:
            meta['choices'] = list(meta['choices'])
        out[fld.name] = (annotation_text(tp), _default(fld), meta)
    return out


def render_index(method_classes: Mapping[str, type]) -> str:
    """The text of fs_plugins/schema/method_index.py for the registered methods
    ({name: Method class}, e.g. `fs_plugins.methods.registry.all_methods()`)."""
    entries = {name: section_entry(cls.config_class) for name, cls in sorted(method_classes.items())}
    return f'"""{INDEX_DOC}"""\n\nMETHODS = {_render(entries, 0)}\n'


def _render(entries: Mapping, depth: int) -> str:
    """A nested dict of index entries as Python source, one option per line."""
    if not entries:
        return '{}'
    pad = '    ' * (depth + 1)
    lines = [f'{pad}{key!r}: {_render(value, depth + 1) if isinstance(value, Mapping) else repr(value)},'
             for key, value in entries.items()]
    return '{\n' + '\n'.join(lines) + '\n' + '    ' * depth + '}'


INDEX_DOC = '''GENERATED from the method registry by fs_plugins.schema.precheck.render_index: do not edit.

Every registered method's name and the options of its `fsplug.<name>` node (annotation,
default, bounds and fixed choices), so that the config pre-check knows them without importing
the methods (which import torch). tests/test_precheck.py fails when this is stale; regenerate
with `python scripts/gen_reference.py`.'''

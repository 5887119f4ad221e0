"""A config's layers, merged the way FederatedScope merges them: defaults <- a YAML file <-
overrides <- `key value` pairs of the command line, values decoded as FS's yacs decodes them,
the merged config checked (`fs_plugins.schema.validate`) after each layer as FS checks it after
each merge.

Shared by the full load (`fs_plugins.run.config.load_config`, after the registries are filled)
and the pre-check before torch is imported (`fs_plugins.schema.precheck`), so both read, merge
and word their problems alike."""
from __future__ import annotations

import ast
import copy
from collections.abc import Mapping

import yaml

from fs_plugins.core.errors import ConfigError
from fs_plugins.schema.fs_llm import layer_problems
from fs_plugins.schema.validate import KnownMethods, validate


def decode_value(value):
    """A raw value as FS's yacs decodes it: strings that are Python literals become them
    ('1e-3' -> 0.001, '8' -> 8, "['q_proj']" -> a list); anything else stays."""
    if isinstance(value, Mapping):
        return {k: decode_value(v) for k, v in value.items()}
    if not isinstance(value, str):
        return value
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def merge(base: dict, layer: Mapping) -> dict:
    """`layer` merged into a copy of `base`, recursively; values decoded as FS decodes them."""
    out = dict(base)
    for key, value in layer.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = decode_value(copy.deepcopy(value))
    return out


def client_entry_problems(entries: Mapping, source: str) -> list[str]:
    """The entries of a --client_cfg mapping (read from `source`) that are neither a mapping
    of config keys nor null: one line per entry, naming `source` and the client key. A client
    without an entry, or with a null or empty one, runs the run's config (as FS's FedRunner
    treats it, fed_runner.py `_setup_client`)."""
    return [f"{source}: {key} = {value!r}: expected a mapping of config keys, or nothing (the "
            f"run's config)" for key, value in entries.items()
            if value is not None and not isinstance(value, Mapping)]


def parse_opts(opts: list[str]) -> dict:
    """FS-style command line overrides: ['a.b', 'v', 'c', 'w'] -> nested dict (raw values)."""
    if len(opts) % 2:
        raise ConfigError(f"Overrides come in 'key value' pairs; got an odd list: {opts}")
    nested: dict = {}
    for key, raw in zip(opts[0::2], opts[1::2]):
        node = nested
        parts = key.split('.')
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"Override '{key}' goes below a key given a value earlier")
        node[parts[-1]] = raw
    return nested


def read_yaml(path: str) -> dict:
    try:
        with open(path, encoding='utf-8') as handle:
            loaded = yaml.safe_load(handle) or {}
    except FileNotFoundError:
        raise ConfigError(f"Config file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"Config file {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"Config file {path} must hold a mapping at top level")
    return loaded


def config_layers(path: str | None = None, opts: list[str] | None = None,
                  overrides: Mapping | None = None) -> list[tuple[Mapping, str]]:
    """(layer, its source's name) of a YAML file, overrides and the command line, in merge
    order; a missing file or broken YAML raises ConfigError."""
    layers = [(read_yaml(path), path)] if path else []
    layers += [(overrides, 'overrides')] if overrides else []
    layers += [(parse_opts(opts), 'command line')] if opts else []
    return layers


def layer_modules(layer: Mapping) -> list[str]:
    """The `fsplug.import_modules` a layer names (they may register methods)."""
    plug = layer.get('fsplug')
    modules = plug.get('import_modules') if isinstance(plug, Mapping) else None
    return list(modules) if isinstance(modules, (list, tuple)) else [modules] if modules else []


def checked(merged: dict, source: str, fs_known: Mapping | None = None,
            known: KnownMethods | None = None) -> dict:
    """The validated, normalised config; raises ConfigError with every problem, each prefixed
    by `source` when it is given."""
    normalised, problems = validate(merged, fs_known, known)
    if problems:
        raise ConfigError([f'{source}: {p}' for p in problems] if source else problems)
    return normalised


def check_layers(layers: list[tuple[Mapping, str]], base: dict, fs_known: Mapping | None = None,
                 known: KnownMethods | None = None, name_sources: bool = True) -> dict:
    """`layers` merged one by one into `base`, the config checked after each merge (only the
    defaults when there is no layer); the first layer with problems raises ConfigError.
    name_sources: prefix each problem with its layer's source (the embedded runner does; FS's
    merges do not)."""
    merged = base
    if not layers:
        merged = checked(merged, '', fs_known, known)
    fs_base = {k: v for k, v in base.items() if k != 'fsplug'}
    for layer, source in layers:
        before, merged = merged, checked(merge(merged, layer), source if name_sources else '',
                                         fs_known, known)
        problems = (layer_problems(layer, before, merged, fs_base) if merged['fsplug']['method']
                    else [])
        if problems:
            prefix = f'{source}: ' if name_sources and source else ''
            raise ConfigError([prefix + p for p in problems])
    return merged

"""Loading a config for the embedded runner: defaults <- YAML <- overrides, the way
FederatedScope merges them, each merged layer validated (`fs_plugins.schema.validate`).

Also the small helpers both runners use on a loaded config (`model_path`, `data_name`,
`client_config`). The schema itself lives in `fs_plugins.schema`."""
from __future__ import annotations

import copy
import importlib
from collections.abc import Mapping

# the packages that fill the registries the schema offers as allowed values
import fs_plugins.data  # noqa: F401  (splitters)
import fs_plugins.metrics  # noqa: F401  (generation and reported metrics)
import fs_plugins.models  # noqa: F401  (model builders, encoders, adapters)
from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.registry import get_method_class
from fs_plugins.schema.fs_llm import assign, changed_leaves, map_fs_llm_names
from fs_plugins.schema.loading import (
    check_layers,
    checked,
    client_entry_problems,
    config_layers,
    decode_value,
    layer_modules,
    merge,
    parse_opts,
    read_yaml,
)
from fs_plugins.schema.options import Cfg, to_plain
from fs_plugins.schema.specs import location_of
from fs_plugins.schema.validate import fs_defaults, fsplug_defaults, validate

__all__ = ['Cfg', 'ConfigError', 'load_config', 'parse_opts', 'read_yaml', 'to_plain',
           'client_overrides', 'client_config', 'model_path', 'data_name', 'resolve_derived',
           'import_extra_modules', 'merge', 'load_saved_config', 'checked', 'decode_value']


def import_extra_modules(modules) -> None:
    for name in modules or []:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"fsplug.import_modules: cannot import '{name}': {exc}") from exc


def load_config(path: str | None = None, opts: list[str] | None = None,
                overrides: Mapping | None = None) -> Cfg:
    """Loads a YAML the way FS would (defaults <- file <- overrides <- command line), checking
    the config after each layer as FS does after each merge (`fs_plugins.schema.loading`; the
    CLI runs the same merges and checks before the heavy imports: `fs_plugins.schema.precheck`)."""
    layers = config_layers(path, opts, overrides)
    for layer, _ in layers:  # first: they may register methods the schema must know
        import_extra_modules(layer_modules(layer))
    merged = check_layers(layers, {**fs_defaults(), 'fsplug': fsplug_defaults()})
    cfg = Cfg.wrap(merged)
    resolve_derived(cfg)
    return cfg


def known_part(plain: Mapping, known: Mapping) -> dict:
    """The keys of `plain` present in the key tree `known` (values under a key whose default
    is not a mapping are kept whole)."""
    out = {}
    for key, value in plain.items():
        if key not in known:
            continue
        if isinstance(value, Mapping) and isinstance(known[key], Mapping) and known[key]:
            out[key] = known_part(value, known[key])
        else:
            out[key] = value
    return out


def load_saved_config(plain: Mapping, source: str, trusted_modules=()) -> Cfg:
    """A config stored by a run (run_info.json, a saved model's JSON), loaded for the embedded
    code: FederatedScope's own keys the plugin does not read are dropped first. Its
    fsplug.import_modules are never imported (a results folder from elsewhere must not run
    code): only `trusted_modules`, which the caller was given (`--import-module`), are."""
    import_extra_modules(trusted_modules)
    fields = known_part(plain, {**fs_defaults(), 'fsplug': fsplug_defaults()})
    saved_modules = layer_modules(fields)
    if isinstance(fields.get('fsplug'), Mapping):
        fields['fsplug'] = {**fields['fsplug'], 'import_modules': list(trusted_modules)}
    try:
        return load_config(overrides=fields)
    except ConfigError as exc:
        untrusted = [m for m in saved_modules if m not in trusted_modules]
        hint = [f'{source} names fsplug.import_modules {untrusted}; pass '
                f'{" ".join("--import-module " + m for m in untrusted)} to trust it'] if untrusted else []
        raise ConfigError(hint + [f'{source}: {p}' for p in exc.problems]) from None


def resolve_derived(cfg) -> None:
    """Fills keys FS derives itself (sample_client_num from the rate) and those the method
    derives (`Method.resolve_config`)."""
    fed = cfg.federate
    if fed.sample_client_num <= 0 and fed.client_num > 0:
        rate = float(fed.sample_client_rate)
        fed.sample_client_num = max(1, int(rate * fed.client_num)) if rate > 0 else fed.client_num
    if cfg.fsplug.method:
        get_method_class(cfg.fsplug.method).resolve_config(cfg)


def client_overrides(client_cfgs, cfg, fs_known: Mapping | None = None) -> dict[int, dict]:
    """Checks a `--client_cfg` mapping ({'client_3': {...}}) against the run's config and
    returns {3: {...}}. Every problem is reported, each naming its client. fs_known: FS's key
    tree under FederatedScope (see `fs_plugins.schema.validate`)."""
    client_num = int(cfg.federate.client_num)
    out, problems = {}, []
    for key, value in (client_cfgs or {}).items():
        cid = None
        if isinstance(key, str) and key.startswith('client_') and key[7:].isdigit():
            cid = int(key[7:])
        if cid is None or not 1 <= cid <= client_num:
            problems.append(f"--client_cfg names '{key}', which is not a client of this run "
                            f"(expected client_1 .. client_{client_num})")
            continue
        not_a_mapping = client_entry_problems({key: value}, '--client_cfg')
        if not_a_mapping:
            problems += not_a_mapping
            continue
        override = to_plain(value) or {}
        merged, found = validate(merge(to_plain(cfg), override), fs_known)
        if not found and cfg.fsplug.method:
            found = get_method_class(cfg.fsplug.method).client_problems(to_plain(cfg), merged)
            override = with_plugin_names(to_plain(cfg), override)
        problems += [f'--client_cfg {key}: {p}' for p in found]
        out[cid] = override
    if problems:
        raise ConfigError(problems)
    return out


def with_plugin_names(plain: dict, override: Mapping) -> dict:
    """A client's entry plus the plugin keys its FS-LLM keys stand for (`map_fs_llm_names`),
    so that whoever merges the entry without the checks (FS's server side) sees the plugin's."""
    merged = merge(plain, override)
    mapped, _ = map_fs_llm_names(merged, fs_defaults())
    out = copy.deepcopy(dict(override))
    for key, value in changed_leaves(merged, mapped).items():
        assign(out, key, value)
    return out


def client_config(cfg, override: Mapping | None) -> Cfg:
    """The global config with one client's `--client_cfg` entry merged on top."""
    plain = to_plain(cfg)
    return Cfg.wrap(checked(merge(plain, override), '') if override else plain)


def model_path(cfg) -> str:
    """The model location part of `model.type` ('<path>@fsplug_llm')."""
    return location_of(cfg.model.type)


def data_name(cfg) -> str:
    """The data location part of `data.type` ('<file or builtin>@fsplug')."""
    return location_of(cfg.data.type)

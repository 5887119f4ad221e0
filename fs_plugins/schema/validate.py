"""Strict validation of a whole config, in one place, before anything is built.

`validate` takes a merged config as plain nested dicts and returns every problem at once (each
a line naming the key, the value and what is allowed) together with the normalised values.
The embedded runner calls it on each merged layer; under FederatedScope the binding calls it
when FS merges a YAML, a command line or a client config, and again in FS's config check.
The pre-check before torch is imported (`fs_plugins.schema.precheck`) runs the same checks with
the methods it knows from a generated index instead of the registry (`KnownMethods`)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from fs_plugins.core.registry import METHODS
from fs_plugins.schema.fs_keys import FSKeys, reported_metric_names
from fs_plugins.schema.fs_llm import map_fs_llm_names, refused_key_problems, unreported_metric_problems
from fs_plugins.schema.options import (
    FS_AUX_KEYS,
    OPEN_NODE,
    check_section,
    check_value,
    defaults_of,
    unknown_key_message,
)
from fs_plugins.schema.plugin import (
    DATA_TYPE_SUFFIX,
    FS_LLM_DATA_SUFFIX,
    FS_LLM_MODEL_SUFFIX,
    FS_LLM_TRAINER,
    MODEL_TYPE_SUFFIX,
    PLUGIN_NAME,
    PluginOptions,
    is_plugin_data_type,
)


def method_classes() -> dict:
    return dict(METHODS.items())


@dataclass(frozen=True)
class KnownMethods:
    """The methods a check knows: name -> the config class of its `fsplug.<name>` node.

    complete: False when modules not imported yet (fsplug.import_modules) may register more:
    method names and `fsplug.<key>` nodes outside `configs` then pass unchecked.
    registries: False for the pre-check before the registries are filled (that would import
    torch): choices a registry owns and each method's own rules between keys are left to the
    full check, and fsplug.method is checked against `configs`."""
    configs: Mapping[str, type]
    complete: bool = True
    registries: bool = True


def registered_methods() -> KnownMethods:
    """Every registered method (the registry's discovery imports them)."""
    return KnownMethods({name: cls.config_class for name, cls in method_classes().items()})


def fsplug_defaults(known: KnownMethods | None = None) -> dict:
    """The whole `fsplug` node: general keys plus one sub-node per method (registered ones
    unless `known` says otherwise)."""
    node = defaults_of(PluginOptions)
    for name, config_class in (known or registered_methods()).configs.items():
        node[name] = defaults_of(config_class)
    return node


def fs_defaults() -> dict:
    """FS's defaults for the FS keys the plugin reads (the embedded runner's FS part)."""
    return defaults_of(FSKeys)


def unknown_keys(values: Mapping, known: Mapping, path: str = '') -> list[str]:
    """Keys of `values` absent from the key tree `known` (closest spelling suggested)."""
    if known.get(OPEN_NODE):
        return []
    problems = []
    for key, value in values.items():
        if key in FS_AUX_KEYS or key == OPEN_NODE:
            continue
        full = f'{path}.{key}' if path else key
        if key not in known:
            problems.append(unknown_key_message(path, key, [k for k in known if k != OPEN_NODE]))
        elif isinstance(value, Mapping) and isinstance(known[key], Mapping):
            problems += unknown_keys(value, known[key], full)
    return problems


def check_plugin_node(plug: Mapping, known: KnownMethods | None = None) -> tuple[dict, list[str]]:
    """The `fsplug` node: general keys, then each method's node against its config class."""
    known = known or registered_methods()
    methods = known.configs
    declared = {f.name for f in fields(PluginOptions)}
    general = {k: v for k, v in plug.items() if k in declared}
    normalised, problems = check_section(PluginOptions, general, 'fsplug',
                                         registries=known.registries)
    if not known.registries and known.complete and isinstance(normalised['method'], str):
        # the registry-backed choice check_section left out, against the known names instead
        problems += check_value('fsplug.method', normalised['method'], str,
                                {'choices': [''] + sorted(methods)})
    for key in plug:
        if key not in declared and key not in methods and key not in FS_AUX_KEYS:
            if known.complete:
                problems.append(unknown_key_message('fsplug', key, declared | set(methods)))
            else:
                normalised[key] = plug[key]   # a method's node, once the modules are imported
    for name, config_class in methods.items():
        normalised[name], found = check_section(config_class, plug.get(name, {}),
                                                f'fsplug.{name}', registries=known.registries)
        problems += found
    return normalised, problems


def validate(cfg: Mapping, fs_known: Mapping | None = None, known: KnownMethods | None = None,
             fs_base: Mapping | None = None) -> tuple[dict, list[str]]:
    """(normalised config, problems) of a merged config given as plain nested dicts.

    fs_known: FS's own key tree under FederatedScope (FS keys are then checked against it and
    only the FS keys the plugin reads are type-checked); None in the embedded runner, which
    accepts only the FS keys it reads (`FSKeys`). known: the methods to check against (default:
    the registered ones; the pre-check passes those of its index). fs_base: FS's defaults under
    FederatedScope; FS keys set away from them are checked against the plugin's classification
    of FS's keys (`fs_plugins.schema.fs_llm`), which the embedded runner does with the defaults
    of `FSKeys` (under FS without fs_base, e.g. a client entry, FS's own merge checks them).

    With fsplug.method set, FS-LLM's names are mapped onto the plugin's first: the normalised
    config holds the plugin's names (`map_fs_llm_names`)."""
    plug = cfg.get('fsplug', {})
    if fs_known is not None and not plug.get('method'):
        return dict(cfg), []     # the plugin is off: FederatedScope checks its own keys
    known = known or registered_methods()
    base = fs_base if fs_base is not None else fs_defaults()
    fs_llm_problems = (refused_key_problems(cfg, base, fs_known)
                       if fs_known is None or fs_base is not None else [])
    if plug.get('method'):
        cfg, found = map_fs_llm_names(cfg, base)
        fs_llm_problems += found
    if known.registries:
        fs_llm_problems += unreported_metric_problems(cfg, reported_metric_names())
    fs_part = {k: v for k, v in cfg.items() if k != 'fsplug'}
    problems = unknown_keys(fs_part, fs_known) if fs_known is not None else []
    normalised, found = check_section(FSKeys, fs_part, strict=fs_known is None,
                                      registries=known.registries)
    problems += found + fs_llm_problems
    normalised['fsplug'], found = check_plugin_node(cfg.get('fsplug', {}), known)
    problems += found
    return normalised, problems + rule_problems(normalised, known)


def rule_problems(cfg: Mapping, known: KnownMethods | None = None) -> list[str]:
    """Rules between keys. A rule whose keys already failed their own check (wrong type) is
    skipped: its message would only repeat that problem."""
    known = known or registered_methods()
    if not cfg['fsplug']['method']:
        if not known.complete:
            return []       # the full check lists the imported modules' methods too
        return [f"fsplug.method is not set: name one of {', '.join(sorted(known.configs))}"]
    problems = []
    for rule in (RULES if known.registries else GENERAL_RULES):
        try:
            problems += rule(cfg)
        except (TypeError, ValueError, KeyError, AttributeError):
            continue
    return problems


def _plugin_workers(cfg) -> list[str]:
    return [f"{key} = {value!r}: must be '{PLUGIN_NAME}' (or FS-LLM's '{alias}') when "
            'fsplug.method is set'
            for key, value, alias in (('trainer.type', cfg['trainer']['type'], FS_LLM_TRAINER),
                                      ('federate.method', cfg['federate']['method'], 'FedAvg'))
            if str(value).lower() != PLUGIN_NAME]


def _model_and_data_types(cfg) -> list[str]:
    problems = []
    if not str(cfg['model']['type']).endswith('@' + MODEL_TYPE_SUFFIX):
        problems.append(f"model.type = {cfg['model']['type']!r}: must be "
                        f"'<local dir or hub id>@{MODEL_TYPE_SUFFIX}' (or FS-LLM's "
                        f"'@{FS_LLM_MODEL_SUFFIX}')")
    if not is_plugin_data_type(cfg['data']['type']):
        problems.append(f"data.type = {cfg['data']['type']!r}: must be "
                        f"'<file.json|file.jsonl|builtin name>@{DATA_TYPE_SUFFIX}' (or FS-LLM's "
                        f"'<name>@{FS_LLM_DATA_SUFFIX}')")
    return problems


def _federation(cfg) -> list[str]:
    fed = cfg['federate']
    if fed['sample_client_num'] > fed['client_num'] >= 1:
        return [f"federate.sample_client_num = {fed['sample_client_num']}: must be <= "
                f"federate.client_num = {fed['client_num']}"]
    return []


def _best_result_key(cfg) -> list[str]:
    """A val_* best-result key needs validation records (FS's default is FS-LLM's 'val_loss')."""
    key, data = cfg['eval']['best_res_update_round_wise_key'], cfg['fsplug']['data']
    if not str(key).startswith('val_') or data['val_fraction'] > 0 or data['split_from_records'] is True:
        return []
    return [f'eval.best_res_update_round_wise_key = {key!r} needs a validation split: set '
            'fsplug.data.val_fraction > 0 (FS-LLM: data.splits [train, val, test]) or '
            "fsplug.data.split_from_records, or use a test_* key (FS's default, 'val_loss', means "
            "'val_avg_loss')"]


def _task_stream(cfg) -> list[str]:
    data = cfg['fsplug']['data']
    if data['dynamic'] is True and not data['task_field']:
        return ['fsplug.data.dynamic = True: needs fsplug.data.task_field (the record field '
                "naming each record's task)"]
    if data['test_records'] == 'all' and (data['evaluate_others'] is True
                                          or data['dynamic'] is True):
        return ["fsplug.data.test_records = 'all' gives every client the same test set: it "
                'does not combine with fsplug.data.evaluate_others or fsplug.data.dynamic '
                '(whose test splits are per client)']
    return []


def _generation(cfg) -> list[str]:
    evaluation = cfg['fsplug']['eval']
    if evaluation['gen_metrics'] and evaluation['generate'] is not True:
        return [f"fsplug.eval.gen_metrics = {evaluation['gen_metrics']}: needs "
                f"fsplug.eval.generate: True"]
    return []


def _method_rules(cfg) -> list[str]:
    method_cls = method_classes()[cfg['fsplug']['method']]
    return method_cls.config_problems(method_cls.options(cfg), cfg) + robust_problems(method_cls, cfg)


def robust_problems(method_cls, cfg) -> list[str]:
    """fsplug.aggregation.robust.average other than 'weighted' with a method whose aggregation is
    not the weighted average (`Method.robust_aggregation_refusal`); `cfg` plain or Cfg."""
    average = cfg['fsplug']['aggregation']['robust']['average']
    refusal = getattr(method_cls, 'robust_aggregation_refusal', '')
    if average == 'weighted' or not refusal:
        return []
    return [f"fsplug.aggregation.robust.average = {average!r} does not apply to "
            f"{method_cls.name}: {refusal} (fsplug.aggregation.robust.clip_norm does)"]


# the rules that need no registry (the pre-check runs these), then those that do
GENERAL_RULES = (_plugin_workers, _model_and_data_types, _federation, _best_result_key, _generation,
                 _task_stream)
RULES = GENERAL_RULES + (_method_rules,)

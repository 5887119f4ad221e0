"""The plugin's config under FederatedScope: the `fsplug` node generated from the schema, and
the schema's checks run whenever FS merges a YAML, a command line or a client config.

FS's yacs merge coerces values to the defaults' types before any check function sees them
('8.5' -> 8 for an int key) and fails with tracebacks on the rest. So the merges of the root
config are wrapped: the raw layer is merged into a plain copy and validated with
`fs_plugins.schema.validate` (unknown keys checked against FS's own key tree), and every
problem is raised at once as a ConfigError before FS merges. FS-only constants live here.

Native FS runs (no `fsplug.method`) are left as FS makes them: the node is built from the
generated method index (importing no method, hence no torch, transformers or peft), and it is
removed when FS readies the config for the run, so that the saved config.yaml loads in FS
without the plugin (`drop_unused_node`).

With `fsplug.method` set, FS-LLM's names are mapped onto the plugin's (fs_plugins.schema.fs_llm):
the merge checks see the mapped config, and `check_fs_cfg` writes the mapping onto the CfgNode,
so FS builds the plugin's trainer, workers and model from an FS-LLM YAML as written. FS keys the
plugin refuses are compared with FS's defaults (`fs_default_values`) as the user merged them;
values FS's own checks derive are recognised (`fs_llm.DERIVED_FROM`, the accepted values).

FS's config module is imported only inside the functions that use it: importing it runs the
autoload hook's `register_all`, which imports this module.
"""
from __future__ import annotations

import functools
import itertools
import logging
import sys
from collections.abc import Mapping

from fs_plugins.core.errors import ConfigError
from fs_plugins.fs.metrics import register_named_metrics
from fs_plugins.fs.secure import raise_grpc_limits, read_credentials
from fs_plugins.methods.registry import get_method_class
from fs_plugins.metrics import REPORTED_METRICS
from fs_plugins.run.config import import_extra_modules, merge, parse_opts
from fs_plugins.schema.fs_llm import changed_leaves, layer_problems, map_fs_llm_names
from fs_plugins.schema.options import to_plain
from fs_plugins.schema.precheck import index_methods
from fs_plugins.schema.validate import OPEN_NODE, KnownMethods, fsplug_defaults, validate

logger = logging.getLogger(__name__)


def key_tree(node) -> dict:
    """FS's key tree of a CfgNode: nested dicts; nodes that accept new keys are marked open."""
    tree = {k: key_tree(v) if isinstance(v, Mapping) else None for k, v in node.items()}
    if getattr(node, 'is_new_allowed', lambda: False)():
        tree[OPEN_NODE] = True
    return tree


def fs_known_keys(cfg) -> dict:
    """FS's key tree without the plugin's node (the schema checks that one)."""
    tree = key_tree(cfg)
    tree.pop('fsplug', None)
    return tree


def _to_cfg_node(cls, values: dict):
    node = cls(new_allowed=True)
    for key, value in values.items():
        node[key] = _to_cfg_node(cls, value) if isinstance(value, dict) else value
    return node


def fill_missing(node, defaults: dict) -> None:
    """Adds defaults absent from `node` (sub-nodes of methods registered by import_modules
    after FS built its config)."""
    from federatedscope.core.configs.config import CN  # lazy: importing it runs register_all
    for key, value in defaults.items():
        if key not in node:
            node[key] = _to_cfg_node(CN, value) if isinstance(value, dict) else value
        elif isinstance(value, dict) and isinstance(node[key], dict):
            fill_missing(node[key], value)


def extend_cfg(cfg) -> None:
    """The `fsplug` node, from the generated method index (the same defaults as the registry's,
    tests/test_precheck.py; methods outside it are filled in by `check_fs_cfg`)."""
    from federatedscope.core.configs.config import CN  # lazy: importing it runs register_all
    cfg.fsplug = _to_cfg_node(CN, fsplug_defaults(KnownMethods(index_methods())))
    cfg.register_cfg_check_fun(check_fs_cfg)


def plain_config(cfg) -> dict:
    """A CfgNode as plain nested dicts, FS's `Argument` wrappers (fedopt.optimizer.*) unwrapped
    to their values (they compare by identity)."""
    from federatedscope.core.configs.yacs_config import Argument  # lazy: see the module docstring

    def unwrap(value):
        if isinstance(value, dict):
            return {k: unwrap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [unwrap(v) for v in value]
        return value.value if isinstance(value, Argument) else value
    return unwrap(to_plain(cfg))


@functools.cache
def fs_default_values() -> dict:
    """FS's defaults as plain dicts, from a freshly built global config (without `fsplug`)."""
    from federatedscope.core.configs.config import CN, init_global_cfg  # lazy: see the docstring
    fresh = CN()
    init_global_cfg(fresh)
    plain = plain_config(fresh)
    plain.pop('fsplug', None)
    return plain


def raise_problems(plain: dict, fs_known: dict) -> dict:
    """The config's problems raised at once; else the config with its values normalised."""
    import_extra_modules(plain.get('fsplug', {}).get('import_modules', []))
    normalised, problems = validate(plain, fs_known, fs_base=fs_default_values())
    if problems:
        raise ConfigError(problems)
    return normalised


def apply_fs_llm_names(cfg, plain: dict) -> None:
    """Writes FS-LLM's names, mapped onto the plugin's, into the CfgNode (FS builds its trainer,
    workers and model from these keys; FS-LLM's trainer would also halve the trainables for
    train.is_enable_half, which is reset once it became fsplug.model.dtype)."""
    mapped, _ = map_fs_llm_names(plain, fs_default_values())
    changes = changed_leaves(plain, mapped)
    for key, value in changes.items():
        *parents, leaf = key.split('.')
        node = cfg
        for part in parents:
            node = node[part]
        node[leaf] = value
    if changes:
        logger.info('fs-plugins: FS-LLM keys mapped onto the plugin\'s: '
                    + ', '.join(f'{key} = {value!r}' for key, value in changes.items()))


def check_fs_cfg(cfg) -> None:
    """FS config check function: the schema's checks on the merged config (every FS key the
    plugin refuses among them), FS-LLM's names written as the plugin's, then what only FS has
    (FS's monitor's metric list)."""
    if 'fsplug' not in cfg or not cfg.fsplug.method:
        return
    plain = plain_config(cfg)
    raise_problems(plain, fs_known_keys(cfg))
    fill_missing(cfg.fsplug, fsplug_defaults())
    apply_fs_llm_names(cfg, plain_config(cfg))
    get_method_class(cfg.fsplug.method).resolve_config(cfg)
    raise_grpc_limits(cfg)
    if str(cfg.federate.mode).lower() == 'distributed':
        read_credentials(cfg)   # every credentials problem named before a port opens
    if cfg.fsplug.data.evaluate_others and 'others' not in cfg.eval.split:
        cfg.eval.split.append('others')
    # FS's monitor only accepts metrics listed in eval.metrics (and registered)
    per_modality = modality_metric_names(cfg)
    register_named_metrics(per_modality)
    for name in list(REPORTED_METRICS) + list(cfg.fsplug.eval.gen_metrics) + list(per_modality):
        if name not in cfg.eval.metrics:
            cfg.eval.metrics.append(name)


def modality_metric_names(cfg) -> dict[str, bool]:
    """{metric: larger is better} of the per-test-modality metrics an encoder + LLM model with
    several encoders reports (run.evaluation.modality_groups: test_<label>_<metric>), which FS's
    monitor must know: every combination of the configured modalities, as labels join them."""
    model = cfg.fsplug.model
    encoders = model.multimodal
    configured = [m for m, sub in encoders.items() if isinstance(sub, Mapping) and sub.get('backend')]
    if model.builder != 'imagebind_vicuna' or len(configured) < 2:
        return {}
    bases = {'avg_loss': False, 'total': False, **REPORTED_METRICS,
             **dict.fromkeys(cfg.fsplug.eval.gen_metrics, True)}
    labels = ['+'.join(c) for k in range(1, len(configured) + 1)
              for c in itertools.combinations(configured, k)]
    return {f'{label}_{base}': larger for label in labels for base, larger in bases.items()}


def _is_plugin_root(node) -> bool:
    return isinstance(node, Mapping) and 'fsplug' in node and 'federate' in node


def _checked(merge_method, layer_of):
    @functools.wraps(merge_method)
    def merged_after_check(self, source, *args, **kwargs):
        if _is_plugin_root(self) and source is None:
            # FS's runners merge client_cfgs.get('client_<id>'): None for a client the file
            # leaves out or sets to null, which runs the run's config, as FS's FedRunner skips
            # it (fed_runner.py, _setup_client); yacs would refuse None
            return None
        if _is_plugin_root(self):
            layer, before = layer_of(self, source), plain_config(self)
            after = raise_problems(merge(before, layer), fs_known_keys(self))
            if (after.get('fsplug') or {}).get('method'):
                derived = layer_problems(layer, before, after, fs_default_values())
                if derived:
                    raise ConfigError(derived)
        return merge_method(self, source, *args, **kwargs)
    return merged_after_check


def _list_layer(node, opts) -> dict:
    return parse_opts(list(opts))


def _other_layer(node, other) -> dict:
    return plain_config(other)


def drop_unused_node(ready_for_run):
    """Wraps FS's CN.ready_for_run (CN.freeze runs it before saving config.yaml): a root
    config without `fsplug.method` loses the `fsplug` node once FS's checks have run, so a
    native run's saved config.yaml (and logged config) is FS's own."""
    @functools.wraps(ready_for_run)
    def ready_without_unused_node(self, *args, **kwargs):
        result = ready_for_run(self, *args, **kwargs)
        if _is_plugin_root(self) and not self.fsplug.method:
            del self['fsplug']
        return result
    return ready_without_unused_node


def install_checked_merges(cn_class) -> None:
    """Wraps FS's CN.merge_from_other_cfg (YAML files and client configs go through it) and
    CN.merge_from_list (the command line), and CN.ready_for_run (`drop_unused_node`)."""
    if getattr(cn_class, '_fsplug_checked', False):
        return
    cn_class.merge_from_other_cfg = _checked(cn_class.merge_from_other_cfg, _other_layer)
    cn_class.merge_from_list = _checked(cn_class.merge_from_list, _list_layer)
    cn_class.ready_for_run = drop_unused_node(cn_class.ready_for_run)
    cn_class._fsplug_checked = True


def install_error_report() -> None:
    """An uncaught ConfigError (a DataFileError among them; e.g. from `python
    federatedscope/main.py`) prints its lines without a traceback, and Python exits with 1;
    everything else is reported as before."""
    previous = sys.excepthook

    def report(kind, value, traceback):
        if isinstance(value, ConfigError):
            print(value.report(), file=sys.stderr)
            return
        previous(kind, value, traceback)
    sys.excepthook = report

"""Registers the plugins with FederatedScope: config keys, model, data, trainer, workers.

Called by the import hook right after `federatedscope.core.configs.config` has executed
(so `global_cfg` already exists and is extended in place)."""
from __future__ import annotations

import logging

from fs_plugins.metrics import REPORTED_METRICS, next_token_accuracy
from fs_plugins.metrics.generation_metrics import GENERATION_METRICS
from fs_plugins.config import (MODEL_TYPE_SUFFIX, PLUGIN_FEDERATE_METHOD, PLUGIN_TRAINER_TYPE,
                               ConfigError, import_extra_modules, fsplug_defaults, validate)

logger = logging.getLogger(__name__)
_REGISTERED = False
# what ClientProcedure.evaluate('test') reports (FS's early stopper reads one of them)
EVAL_METRICS = ('test_avg_loss', 'test_token_acc') + tuple(f'test_{n}' for n in GENERATION_METRICS)


def _to_cfg_node(cls, values: dict):
    node = cls(new_allowed=True)
    for key, value in values.items():
        node[key] = _to_cfg_node(cls, value) if isinstance(value, dict) else value
    return node


def _fill_missing(node, defaults: dict) -> None:
    """Adds defaults absent from `node` (sub-nodes of methods registered by import_modules
    after FS built its config)."""
    from federatedscope.core.configs.config import CN
    for key, value in defaults.items():
        if key not in node:
            node[key] = _to_cfg_node(CN, value) if isinstance(value, dict) else value
        elif isinstance(value, dict) and isinstance(node[key], dict):
            _fill_missing(node[key], value)


def check_fs_cfg(cfg) -> None:
    """FS config check function: plugin keys and the FS keys the plugin needs."""
    if not cfg.fsplug.method:
        return
    import_extra_modules(cfg.fsplug.import_modules)
    validate(cfg)
    _fill_missing(cfg.fsplug, fsplug_defaults())
    for key, expected in (('trainer.type', PLUGIN_TRAINER_TYPE),
                          ('federate.method', PLUGIN_FEDERATE_METHOD)):
        section, name = key.split('.')
        if str(cfg[section][name]).lower() != expected:
            raise ConfigError(f"fsplug.method is set, so {key} must be '{expected}' "
                              f"(got '{cfg[section][name]}')")
    # the fsplug workers carry their own message contents; these FS features act on FS's
    # default contents and are not wired into them (yet)
    for key, active in (('federate.use_ss', cfg.federate.use_ss),
                        ('quantization.method', cfg.quantization.method != 'none'),
                        ('asyn.use', cfg.asyn.use)):
        if active:
            raise ConfigError(f"{key} is not supported with fsplug methods; turn it off")
    # FS's monitor only accepts metrics listed in eval.metrics
    for name in list(REPORTED_METRICS) + list(cfg.fsplug.eval.gen_metrics):
        if name not in cfg.eval.metrics:
            cfg.eval.metrics.append(name)
    if cfg.eval.best_res_update_round_wise_key not in EVAL_METRICS:
        raise ConfigError(f"eval.best_res_update_round_wise_key = "
                          f"'{cfg.eval.best_res_update_round_wise_key}' is not a metric fsplug "
                          f"clients report; use one of: {', '.join(EVAL_METRICS)}")


def extend_cfg(cfg) -> None:
    from federatedscope.core.configs.config import CN
    cfg.fsplug = _to_cfg_node(CN, fsplug_defaults())
    cfg.register_cfg_check_fun(check_fs_cfg)


def lookup_model(model_cfg, input_shape):
    if str(model_cfg.type).endswith('@' + MODEL_TYPE_SUFFIX):
        from fs_plugins.fs.workers import DeferredModel
        return DeferredModel(model_cfg.type)
    return None


def lookup_trainer(trainer_type):
    if trainer_type == PLUGIN_TRAINER_TYPE:
        from fs_plugins.fs.trainer import PluginTrainer
        return PluginTrainer
    return None


def lookup_worker(method):
    if method == PLUGIN_FEDERATE_METHOD:
        from fs_plugins.fs.workers import PluginClient, PluginServer
        return {'client': PluginClient, 'server': PluginServer}
    return None


def lookup_metric(types):
    if 'token_acc' in types:
        def token_acc(ctx, y_true, y_pred, y_prob, **kwargs):
            return next_token_accuracy(y_true, y_prob)
        return 'token_acc', token_acc, REPORTED_METRICS['token_acc']
    return None


def generation_metric_lookup(name: str):
    """Tells FS's monitor that `name` exists and that larger is better. fsplug clients compute
    it in their own evaluation (by generation); FS's logits-based metric path cannot."""
    def not_from_logits(ctx, y_true, y_pred, y_prob, **kwargs):
        raise RuntimeError(f"'{name}' is computed by fsplug clients from generated answers "
                           f"(fsplug.eval.gen_metrics), not from FS's evaluation logits")

    def lookup(types):
        return (name, not_from_logits, True) if name in types else None
    return lookup


def register_all(config_module) -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    from federatedscope import register
    from fs_plugins.fs.data import lookup_data
    register.register_config('fsplug', extend_cfg)
    extend_cfg(config_module.global_cfg)  # global_cfg was built before we could register
    register.register_model('fsplug', lookup_model)
    register.register_data('fsplug', lookup_data)
    register.register_trainer('fsplug', lookup_trainer)
    register.register_worker('fsplug', lookup_worker)
    register.register_metric('fsplug', lookup_metric)
    for name in GENERATION_METRICS:
        register.register_metric(f'fsplug_{name}', generation_metric_lookup(name))
    # Self-registering FS modules must be imported now: importing them lazily inside a
    # lookup mutates the registry while FS iterates over it.
    import federatedscope.llm.trainer.trainer  # noqa: F401
    import fs_plugins.fs.trainer  # noqa: F401
    import fs_plugins.fs.workers  # noqa: F401

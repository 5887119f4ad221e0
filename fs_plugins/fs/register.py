"""Registers the plugins with FederatedScope: config keys, model, data, trainer, workers.

Called by the import hook right after `federatedscope.core.configs.config` has executed
(so `global_cfg` already exists and is extended in place). The modules that import FS beyond
its config (FS's trainer, the plugin's trainer and workers) are imported inside
`register_all` and the lookups: FS's config module must be complete, and the plugins
registered, before they load."""
from __future__ import annotations

import logging

import federatedscope.register as fs_register  # imported by FS's config module already

from fs_plugins.fs.config import extend_cfg, install_checked_merges, install_error_report
from fs_plugins.fs.data import lookup_data
from fs_plugins.metrics import REPORTED_METRICS, next_token_accuracy
from fs_plugins.metrics.generation_metrics import GENERATION_METRICS
from fs_plugins.schema.plugin import MODEL_TYPE_SUFFIX, PLUGIN_NAME

logger = logging.getLogger(__name__)
_REGISTERED = False


def lookup_model(model_cfg, input_shape):
    if str(model_cfg.type).endswith('@' + MODEL_TYPE_SUFFIX):
        from fs_plugins.fs.workers import DeferredModel  # lazy: FS's workers; loaded by register_all
        return DeferredModel(model_cfg.type)
    return None


def lookup_trainer(trainer_type):
    if trainer_type == PLUGIN_NAME:
        from fs_plugins.fs.trainer import PluginTrainer  # lazy: FS's trainer; loaded by register_all
        return PluginTrainer
    return None


def lookup_worker(method):
    if method == PLUGIN_NAME:
        from fs_plugins.fs.workers import PluginClient, PluginServer  # lazy: as in lookup_model
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
    install_checked_merges(config_module.CN)
    install_error_report()
    fs_register.register_config('fsplug', extend_cfg)
    extend_cfg(config_module.global_cfg)  # global_cfg was built before we could register
    fs_register.register_model('fsplug', lookup_model)
    fs_register.register_data('fsplug', lookup_data)
    fs_register.register_trainer('fsplug', lookup_trainer)
    fs_register.register_worker('fsplug', lookup_worker)
    fs_register.register_metric('fsplug', lookup_metric)
    for name in GENERATION_METRICS:
        fs_register.register_metric(f'fsplug_{name}', generation_metric_lookup(name))
    # Self-registering FS modules must be imported now: importing them lazily inside a
    # lookup mutates the registry while FS iterates over it.
    import federatedscope.llm.trainer.trainer  # noqa: F401  # lazy: self-registering, see above

    import fs_plugins.fs.trainer  # noqa: F401  # lazy: self-registering (via LLMTrainer), see above
    import fs_plugins.fs.workers  # noqa: F401  # lazy: FS's workers, once the plugins are registered

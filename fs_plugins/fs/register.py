"""Registers the plugins with FederatedScope: config keys, model, data, trainer, workers.

Called by the import hook right after `federatedscope.core.configs.config` has executed
(so `global_cfg` already exists and is extended in place). Every FS run imports FS's config,
so registering must stay cheap: only thin lookups are registered, each of which checks FS's
type string before importing anything heavy, and the `fsplug` node is built from the
generated method index (no method, torch, transformers or peft import). The modules that
import FS beyond its config (FS's LLM trainer, the plugin's trainer and workers) load once a
config with `fsplug.method` set passes FS's config check (`load_when_used`), before FS builds
anything; FS's config module must be complete, and the plugins registered, before they load."""
from __future__ import annotations

import logging

import federatedscope.register as fs_register  # imported by FS's config module already

from fs_plugins.fs.config import extend_cfg, install_checked_merges, install_error_report
from fs_plugins.fs.metrics import register_named_metrics
from fs_plugins.metrics.generation_metrics import GENERATION_METRICS
from fs_plugins.schema.plugin import MODEL_TYPE_SUFFIX, PLUGIN_NAME, reads_data_type

logger = logging.getLogger(__name__)
_REGISTERED = False


def load_fs_modules() -> None:
    """Imports the plugin's FS trainer and workers (once). FS's LLM trainer registers itself
    on import: importing it inside FS's loop over the trainer registry would change the
    registry while FS iterates over it (FS's trainer imports also register models), so this
    runs at the config check of a plugin config; the data and worker lookups, which FS's main
    calls before it builds models and trainers, load them too where that check was skipped."""
    import federatedscope.llm.trainer.trainer  # noqa: F401  # lazy: self-registering, see above

    import fs_plugins.fs.trainer  # noqa: F401  # lazy: self-registering (via LLMTrainer), see above
    import fs_plugins.fs.workers  # noqa: F401  # lazy: FS's workers, once the plugins are registered


def load_when_used(cfg) -> None:
    """FS config check function: loads the plugin's FS modules for a plugin config only."""
    if 'fsplug' in cfg and cfg.fsplug.method:
        load_fs_modules()


def extend_fs_cfg(cfg) -> None:
    """FS config extension: the `fsplug` node and the plugin's config check functions."""
    extend_cfg(cfg)
    cfg.register_cfg_check_fun(load_when_used)


def lookup_model(model_cfg, input_shape):
    if str(model_cfg.type).endswith('@' + MODEL_TYPE_SUFFIX):
        load_fs_modules()
        from fs_plugins.fs.workers import DeferredModel  # lazy: FS's workers
        return DeferredModel(model_cfg.type)
    return None


def lookup_data(config, client_cfgs):
    if reads_data_type(config):
        load_fs_modules()
        from fs_plugins.fs.data import lookup_data as plugin_data  # lazy: the plugin's runtime
        return plugin_data(config, client_cfgs)
    return None


def lookup_trainer(trainer_type):
    if trainer_type == PLUGIN_NAME:
        load_fs_modules()   # loaded already by the config check (see load_fs_modules)
        from fs_plugins.fs.trainer import PluginTrainer  # lazy: FS's trainer
        return PluginTrainer
    return None


def lookup_worker(method):
    if method == PLUGIN_NAME:
        load_fs_modules()
        from fs_plugins.fs.workers import PluginClient, PluginServer  # lazy: as in lookup_model
        return {'client': PluginClient, 'server': PluginServer}
    return None


def lookup_metric(types):
    if 'token_acc' in types:
        from fs_plugins.metrics import REPORTED_METRICS, next_token_accuracy  # lazy: on use

        def token_acc(ctx, y_true, y_pred, y_prob, **kwargs):
            return next_token_accuracy(y_true, y_prob)
        return 'token_acc', token_acc, REPORTED_METRICS['token_acc']
    return None


def register_all(config_module) -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    install_checked_merges(config_module.CN)
    install_error_report()
    fs_register.register_config('fsplug', extend_fs_cfg)
    extend_fs_cfg(config_module.global_cfg)  # global_cfg was built before we could register
    fs_register.register_model('fsplug', lookup_model)
    fs_register.register_data('fsplug', lookup_data)
    fs_register.register_trainer('fsplug', lookup_trainer)
    fs_register.register_worker('fsplug', lookup_worker)
    fs_register.register_metric('fsplug', lookup_metric)
    register_named_metrics(dict.fromkeys(GENERATION_METRICS, True))   # computed by generation

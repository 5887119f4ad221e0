"""The config schema: typed sections (`options`), the plugin's general nodes (`plugin`), the
FS keys it reads (`fs_keys`), validation (`validate`), reading and merging a config's layers
(`loading`; `fs_plugins.run.config` loads a config for a run with it) and the check before the
heavy imports (`precheck`, with the generated `method_index`). No FederatedScope, torch or
method import."""
from fs_plugins.schema.options import build, check_section, defaults_of, describe, option, section
from fs_plugins.schema.plugin import DATA_TYPE_SUFFIX, MODEL_TYPE_SUFFIX, PLUGIN_NAME, PluginOptions
from fs_plugins.schema.validate import fs_defaults, fsplug_defaults, validate

__all__ = ['build', 'check_section', 'defaults_of', 'describe', 'option', 'section',
           'DATA_TYPE_SUFFIX', 'MODEL_TYPE_SUFFIX', 'PLUGIN_NAME', 'PluginOptions',
           'fs_defaults', 'fsplug_defaults', 'validate']

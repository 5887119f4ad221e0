"""Model builders: a base model + tokenizer, LoRA via peft, then the method's own modules.

Builder modules register themselves in `fs_plugins.core.registry.MODEL_BUILDERS`; the registry
imports every module of this package the first time its names are asked for."""
import importlib
import pkgutil

from fs_plugins.core.registry import ENCODER_BACKENDS, MODEL_BUILDERS


def _import_package_modules() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f'{__name__}.{module.name}')


MODEL_BUILDERS.discover_with(_import_package_modules)
ENCODER_BACKENDS.discover_with(_import_package_modules)

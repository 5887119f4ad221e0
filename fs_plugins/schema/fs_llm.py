"""FederatedScope-LLM's config names under the plugin, and what the plugin does with every FS key.

With `fsplug.method` set, an FS-LLM YAML runs as written:
- `map_fs_llm_names` turns FS-LLM's names into the plugin's (trainer.type: llmtrainer, LoRA
  arguments in llm.adapter.args, train.is_enable_half, data.splits, ...);
- `FS_KEYS` classifies every key of FS's config tree: HONOURED (the plugin, or FS around the
  plugin's workers, acts on it), MAPPED (translated by `map_fs_llm_names`), INERT (read only by
  FS tools other than a `federatedscope/main.py` training run) or REFUSED;
- `refused_key_problems` turns a REFUSED key set away from FS's default into a problem naming
  the key and the plugin's alternative: no FS key is ignored silently.

Pure functions over plain nested dicts (no FS import, nothing heavy: the pre-check runs them
before torch is imported). FS's defaults come in as a plain dict: under FederatedScope those
of FS's own config tree, in the embedded runner those of `FSKeys`.
"""
from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

from fs_plugins.schema.options import FS_AUX_KEYS, OPEN_NODE, defaults_of
from fs_plugins.schema.plugin import (
    FS_LLM_METHOD,
    FS_LLM_MODEL_SUFFIX,
    FS_LLM_TRAINER,
    MODEL_TYPE_SUFFIX,
    PLUGIN_NAME,
    PluginOptions,
)

HONOURED, MAPPED, INERT, REFUSED = 'honoured', 'mapped', 'inert', 'refused'
_MISSING = object()


@dataclass(frozen=True)
class KeyClass:
    kind: str
    reason: str
    accepted: tuple = ()    # REFUSED keys: values accepted besides FS's default


def honoured(reason: str) -> KeyClass:
    return KeyClass(HONOURED, reason)


def mapped(reason: str) -> KeyClass:
    return KeyClass(MAPPED, reason)


def inert(reason: str) -> KeyClass:
    return KeyClass(INERT, reason)


def refused(reason: str, *accepted) -> KeyClass:
    return KeyClass(REFUSED, reason, tuple(accepted))


_PERSONALISED = 'the plugin\'s personalised methods (fsplug.method: ditto, fedsa, feddpa, perada, ...)'
_PLUGIN_DATA = ("FS's data pipeline; the plugin's data layer reads data.type, data.root, "
                'data.splitter and fsplug.data.*')
_ONE_PROCESS = "FS's multi-GPU standalone runner; fsplug clients share one process"

# A dotted key, or a prefix ending in '.' for every key below it; the longest match decides.
FS_KEYS: dict[str, KeyClass] = {
    'backend': honoured("FS's torch backend (the only one the plugin accepts)"),
    'use_gpu': honoured("the plugin's models run on cuda"),
    'device': honoured("GPU index of the plugin's models"),
    'check_completeness': honoured("FS's runner draws the plugin workers' message-handler graph"),
    'verbose': honoured("FS's logger"),
    'print_decimal_digits': honoured("FS's logger and monitor"),
    'seed': honoured("the plugin's seeding (split, adapters, client sampling)"),
    'cfg_file': inert('recorded by FS; no FS code reads it'),
    'outdir': honoured("FS's run folder, where the plugin's results go (unless fsplug.results_dir)"),
    'expname': honoured("FS's run folder name"),
    'expname_tag': honoured("FS's logger appends it to expname"),
    'hpo.': inert("read by FS's HPO entry point (federatedscope/hpo.py, autotune), not by a training run"),
    'hpo.fedex.use': refused("FS's FedEx workers, which the plugin's workers replace; no plugin equivalent"),
    'hpo.fts.use': refused("FS's FTS workers, which the plugin's workers replace; no plugin equivalent"),
    'hpo.pfedhpo.use': refused("FS's pFedHPO workers, which the plugin's workers replace; no plugin "
                               'equivalent'),
    'nbafl.': honoured("NbAFL noise on what the plugin's clients upload and its server broadcasts"),
    'nbafl.mu': refused("NbAFL's proximal term acts on FS's own trainer; use fsplug.method: fedprox "
                        '(fsplug.fedprox.mu)'),
    'sgdmf.': refused("FS's SGD-MF privacy for matrix factorisation; for LLM adapters use nbafl.use"),
    'quantization.': refused("FS quantises its own model messages; the plugin's workers send the "
                             "method's tensors (a quantised frozen base: fsplug.model.quantization)"),
    'data.': refused(_PLUGIN_DATA),
    'data.root': honoured('folder of the data files'),
    'data.type': mapped("FS-LLM's '<name>@llm' read by the plugin's data layer, or '<file|builtin>@fsplug'"),
    'data.splitter': mapped("'iid' and 'lda' are plugin splitters; FS-LLM's 'meta' -> 'by_source' "
                            'on the category field'),
    'data.splits': mapped('[train, val, test] -> fsplug.data.val_fraction / test_fraction (per '
                          'client; FS-LLM splits the whole set before the clients)'),
    'data.splitter_args': mapped('[{alpha: a}] -> fsplug.data.dirichlet_alpha'),
    'data.subsample': refused("FS-LLM's record subsampling; use fsplug.data.max_records"),
    'dataloader.': refused("FS's DataLoader; the plugin batches its records itself (evaluation: "
                           'fsplug.eval.batch_size)'),
    'dataloader.batch_size': honoured("the plugin's training batch size"),
    'feat_engr.': refused("FS's tabular feature engineering"),
    'trainer.': refused("options of FS's SAM, local-entropy and hetero-NLP trainers; the plugin's "
                        'trainer replaces them'),
    'trainer.type': mapped("FS-LLM's 'llmtrainer' -> 'fsplug'"),
    'train.local_update_steps': honoured("local steps (or epochs) of the plugin's clients"),
    'train.batch_or_epoch': honoured('unit of train.local_update_steps'),
    'train.optimizer.': honoured("the plugin's local optimiser: type, lr and keyword arguments"),
    'train.scheduler.': honoured("the plugin's learning-rate schedule (scope: fsplug.train.lr_schedule)"),
    'train.scheduler.warmup_ratio': refused("read only by FS's hetero-NLP trainer (FS's get_scheduler "
                                            'drops it); pick a torch scheduler, e.g. LinearLR'),
    'train.data_para_dids': refused("FS's DataParallel over its trainer's model; fsplug clients "
                                    'train on one device'),
    'train.is_enable_half': mapped('-> fsplug.model.dtype: float16 (half-precision frozen base, '
                                   'float32 trainables)'),
    'finetune.': refused(f"FS's fine-tuning before evaluation; use {_PERSONALISED}"),
    'grad.': honoured("gradient clipping and accumulation of the plugin's optimiser steps"),
    'early_stop.': honoured("FS's server stops the plugin's server when eval."
                            'best_res_update_round_wise_key stops improving (FS runs only)'),
    'aggregator.': refused("FS's robust aggregators; the plugin's methods aggregate "
                           '(fsplug.aggregation.*, fsplug.validation.*)'),
    'attack.': refused("FS's attack simulations replace FS's own workers"),
    'federate.': refused("FS's own federation options; the plugin's workers do not carry them"),
    'federate.client_num': honoured('number of clients'),
    'federate.sample_client_num': honoured('clients per round'),
    'federate.sample_client_rate': honoured('fraction of clients per round'),
    'federate.total_round_num': honoured('communication rounds'),
    'federate.mode': honoured('standalone or distributed'),
    'federate.method': mapped("FS's 'FedAvg' (any case) -> 'fsplug'"),
    'federate.share_local_model': mapped('True accepted as is: fsplug clients still build their own '
                                         'models (sharing the frozen base in a process either way); '
                                         "FS then keeps them on their device between routines"),
    'federate.restore_from': honoured("FS's server restores the global shared state"),
    'federate.save_to': honoured("FS's server saves the global shared state"),
    'federate.save_freq': honoured("rounds between FS's saves of the global shared state"),
    'federate.save_client_model': honoured("FS's clients save their models at their best round"),
    'federate.client_idx_for_local_train': refused('local training of one client; use '
                                                   'fsplug.method: standalone'),
    'federate.unseen_clients_rate': refused("FS's unseen clients; every fsplug client trains"),
    'federate.data_weighted_aggr': refused('use fsplug.aggregation.weights'),
    'federate.ignore_weight': refused('use fsplug.aggregation.weights: uniform'),
    'federate.online_aggr': refused("FS's online aggregator; the plugin's methods aggregate a round's "
                                    'updates together'),
    'federate.make_global_eval': refused("the plugin's server holds only the shared tensors and "
                                         'clients evaluate; one common test set: '
                                         'fsplug.data.test_records: all'),
    'federate.merge_test_data': refused('one common test set: fsplug.data.test_records: all'),
    'federate.merge_val_data': refused("FS's server-side validation; clients evaluate their own "
                                       'val split'),
    'federate.use_diff': refused("FS's model differences for FedEx / FTS"),
    'federate.use_ss': refused("FS's secret sharing of its own model messages"),
    'federate.join_in_info': refused("join-in details for FS's samplers and aggregators; the "
                                     "plugin's workers need none"),
    'federate.sampler': refused("the plugin samples clients uniformly with its seeded sampler"),
    'federate.resource_info_file': refused("FS's system-heterogeneity simulation"),
    # FS's config check lowers process_num to the GPU count: 0 on a machine without GPUs
    'federate.process_num': refused(_ONE_PROCESS, 0),
    'federate.master_addr': refused(_ONE_PROCESS),
    'federate.master_port': refused(_ONE_PROCESS),
    'federate.atc_vanilla': refused("FS's ATC for heterogeneous NLP tasks"),
    'federate.atc_load_from': refused("FS's ATC for heterogeneous NLP tasks"),
    'distribute.': honoured("FS's distributed mode (gRPC), run by the plugin's workers"),
    'vertical.': refused("FS's vertical federated learning"),
    'adapter.': inert("declared by FS's federation config; no FS code reads it"),
    'asyn.': refused("FS's asynchronous rounds act on FS's own messages; fsplug rounds are "
                     'synchronous'),
    'fedopt.': refused('use fsplug.method: fedadam / fedyogi / fedadagrad (server optimisers of the '
                       'shared tensors)'),
    'fedprox.': refused('use fsplug.method: fedprox'),
    'fedswa.': refused("FS's SWA of its server's model; no plugin equivalent"),
    'personalization.': refused(f'use {_PERSONALISED}'),
    'fedsageplus.': refused("FS's graph-learning methods"),
    'gcflplus.': refused("FS's graph-learning methods"),
    'flitplus.': refused("FS's graph-learning methods"),
    'eval.': refused("not read by FS's evaluation of fsplug clients"),
    'eval.freq': honoured('evaluation every freq rounds'),
    'eval.split': honoured("FS's clients evaluate these splits through the plugin"),
    'eval.report': honoured("FS's server summaries of the clients' results"),
    'eval.metrics': mapped("'loss' (reported as avg_loss) and the plugin's reported and generation "
                           'metrics accepted, others refused'),
    'eval.best_res_update_round_wise_key': mapped("FS-LLM's '<split>_loss' -> '<split>_avg_loss'; "
                                                  'val_* needs a validation split'),
    'eval.monitoring': refused("FS computes these in its own aggregation, which the plugin's "
                               'server replaces'),
    'eval.count_flops': honoured("FS's trainer hook counts the FLOPs of the plugin's forward "
                                 '(FS runs only)'),
    'wandb.': honoured("FS's monitor logs the results to Weights & Biases"),
    'model.': refused("options of FS's non-LLM models; the plugin builds model.type with "
                      'fsplug.model.*'),
    'model.type': mapped("FS-LLM's '<id>@huggingface_llm' -> '<id>@fsplug_llm'"),
    'criterion.type': refused('the plugin computes the language-model loss on answer tokens',
                              'CrossEntropyLoss'),
    'regularizer.': refused("FS's regulariser acts on FS's whole model; a proximal term: "
                            'fsplug.method: fedprox'),
    'llm.tok_len': honoured('maximum tokens per example'),
    'llm.retry_on_nan_loss': refused('fsplug clients skip a batch with a non-finite loss and do not '
                                     'retry'),
    'llm.cache.model': refused("FS-LLM's model cache; the plugin loads through transformers' cache "
                               '(HF_HOME) or a local folder in model.type'),
    'llm.chat.': inert("FS-LLM's chat tool (federatedscope/llm/misc/fschat.py)"),
    'llm.deepspeed.': refused('use fsplug.model.dtype, fsplug.model.quantization and '
                              'fsplug.train.gradient_checkpointing'),
    'llm.adapter.use': mapped('True: the LoRA of llm.adapter.args; fsplug methods always train adapters'),
    'llm.adapter.args': mapped('peft LoRA / VeRA arguments -> fsplug.model.lora.* / fsplug.model.vera.*'),
    'llm.adapter.mv_to_cpu': refused("FS-LLM's trainer moves trainables to the CPU after each "
                                     "routine; the plugin's trainer keeps them on its device"),
    'llm.offsite_tuning.': refused("FS-LLM's offsite tuning (emulator and adapters); no plugin "
                                   'equivalent'),
}
UNCLASSIFIED = refused('a key the plugin does not know; nothing reads it under fsplug methods')

# FS's config check fills these from another key when they are left at FS's default
DERIVED_FROM = {'personalization.local_update_steps': 'train.local_update_steps',
                'personalization.lr': 'train.optimizer.lr'}


def classify(key: str) -> KeyClass | None:
    """The class of a dotted FS key: its own entry, else that of its longest listed prefix."""
    if key in FS_KEYS:
        return FS_KEYS[key]
    prefixes = [p for p in FS_KEYS if p.endswith('.') and key.startswith(p)]
    return FS_KEYS[max(prefixes, key=len)] if prefixes else None


# ------------------------------------------------------------------ plain-dict helpers

def leaves(tree: Mapping, path: str = '') -> Iterator[tuple[str, object]]:
    """(dotted key, value) of every leaf; an empty mapping is a leaf (FS's `{}` defaults)."""
    for key, value in tree.items():
        if _is_bookkeeping(key):
            continue
        full = f'{path}.{key}' if path else str(key)
        if isinstance(value, Mapping) and not all(map(_is_bookkeeping, value)):
            yield from leaves(value, full)
        else:
            yield full, value


def _is_bookkeeping(key) -> bool:
    return key == OPEN_NODE or key in FS_AUX_KEYS


def lookup(tree: Mapping, key: str, default=None):
    node = tree
    for part in key.split('.'):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def assign(tree: dict, key: str, value) -> None:
    """Sets the dotted `key` of a nested dict, making the nodes on the way."""
    *parents, leaf = key.split('.')
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def changed_leaves(before: Mapping, after: Mapping) -> dict:
    """{dotted key: value} of the leaves of `after` that differ from `before`."""
    return {key: value for key, value in leaves(after) if lookup(before, key, _MISSING) != value}


@functools.cache
def _plugin_defaults() -> dict:
    return {'fsplug': defaults_of(PluginOptions)}


# ------------------------------------------------------------------ refusals

def refused_key_problems(cfg: Mapping, fs_base: Mapping, key_tree: Mapping | None = None) -> list[str]:
    """One problem per REFUSED FS key whose value differs from FS's default in `fs_base`
    (values FS's own check derives from another key count as the default). key_tree: the keys
    that exist (FS's key tree, whose open nodes take any key; default: those of `fs_base`);
    unknown keys are the unknown-key check's to report."""
    tree, problems = fs_base if key_tree is None else key_tree, []
    for key, value in leaves({k: v for k, v in cfg.items() if k != 'fsplug'}):
        rule = classify(key) or UNCLASSIFIED
        if rule.kind != REFUSED or not _exists(tree, key) \
                or _counts_as_default(key, value, rule, cfg, fs_base):
            continue
        default = lookup(fs_base, key, _MISSING)
        was = '' if default is _MISSING else f", FS's default: {default!r}"
        problems.append(f'{key} is not supported with fsplug methods (set to {value!r}{was}): '
                        f'{rule.reason}')
    return problems


def _exists(tree: Mapping, key: str) -> bool:
    node = tree
    for part in key.split('.'):
        if not isinstance(node, Mapping):
            return False
        if part not in node:
            return bool(node.get(OPEN_NODE))
        node = node[part]
    return True


def _counts_as_default(key: str, value, rule: KeyClass, cfg: Mapping, fs_base: Mapping) -> bool:
    # a derived key may hold the source's value of an earlier layer (FS derives it after each
    # merge, and a later layer may change the source): only a layer that sets it can tell
    # (`explicit_derived_problems`)
    return (value == lookup(fs_base, key, _MISSING) or value in rule.accepted
            or key in DERIVED_FROM)


# FS defaults a merged config cannot tell from unset: refused only where a layer writes them
REFUSED_WHEN_WRITTEN = {
    'llm.adapter.use': (False, 'every fsplug method trains adapters (fsplug.model.lora); '
                               "FS-LLM's full fine-tuning has no plugin equivalent"),
}


def layer_problems(layer: Mapping, before: Mapping, after: Mapping, fs_base: Mapping) -> list[str]:
    """What only a config layer (a YAML, a command line) shows: a DERIVED_FROM key it changes
    to a value other than FS's default and the one FS would derive, and a
    REFUSED_WHEN_WRITTEN value it writes. A layer that is a whole config (FS merges its data
    loader's copy back) repeats what earlier layers and FS's checks made: it passes. `after`:
    the config with the layer merged, its values decoded (a command line's are strings)."""
    if not isinstance(layer, Mapping) or set(before) <= set(layer):
        return []
    problems = []
    for key, source in DERIVED_FROM.items():
        if lookup(layer, key, _MISSING) is _MISSING:
            continue
        value = lookup(after, key, _MISSING)
        if value in (lookup(fs_base, key, _MISSING), lookup(before, key, _MISSING),
                     lookup(after, source, _MISSING)):
            continue
        problems.append(f'{key} is not supported with fsplug methods (set to {value!r}): '
                        f'{(classify(key) or UNCLASSIFIED).reason}')
    for key, (value, reason) in REFUSED_WHEN_WRITTEN.items():
        if lookup(layer, key, _MISSING) is not _MISSING and lookup(after, key, _MISSING) == value:
            problems.append(f'{key} = {value!r} is not supported with fsplug methods: {reason}')
    return problems


# ------------------------------------------------------------------ FS-LLM's names

# peft argument -> the plugin key it sets, per llm.adapter.args adapter_method
ADAPTER_ARGS = {
    'lora': {'r': 'fsplug.model.lora.r', 'lora_alpha': 'fsplug.model.lora.alpha',
             'lora_dropout': 'fsplug.model.lora.dropout',
             'target_modules': 'fsplug.model.lora.target_modules',
             'use_rslora': 'fsplug.model.lora.use_rslora'},
    'vera': {'r': 'fsplug.model.vera.r', 'd_initial': 'fsplug.model.vera.d_initial',
             'vera_dropout': 'fsplug.model.lora.dropout',
             'target_modules': 'fsplug.model.lora.target_modules'},
}
# peft's own defaults for what an entry leaves out, where they differ from the plugin's:
# FS-LLM's LoraConfig(**args) uses them (lora_alpha 8, the plugin's 16)
PEFT_DEFAULTS = {'lora': {'lora_alpha': 8}, 'vera': {}}
# peft arguments accepted at these values (peft's defaults), which change nothing
PEFT_NO_EFFECT = {'bias': ('none',), 'inference_mode': (False,), 'fan_in_fan_out': (False,)}
SPLIT_NAMES = ('train', 'val', 'test')


def map_fs_llm_names(cfg: Mapping, fs_base: Mapping) -> tuple[dict, list[str]]:
    """(a copy of `cfg` with FS-LLM's names mapped onto the plugin's, problems), for a config
    with fsplug.method set. `fs_base`: FS's defaults, which tell an FS-LLM key that is set from
    one left alone.

    The FS-LLM keys whose values move to plugin keys (llm.adapter.args, train.is_enable_half,
    data.splits, data.splitter_args) are reset to FS's defaults once moved: FS's own code does
    not act on them again (FS-LLM's trainer would halve the trainables too), and a later layer
    (command line, client config) overrides the plugin key the usual way."""
    out = copy.deepcopy(dict(cfg))
    problems = []
    for step in (_worker_names, _model_type, _adapter, _half_precision, _splits, _splitter,
                 _splitter_args, _best_result_key):
        problems += step(out, fs_base)
    return out, problems


def _carry(cfg: dict, target: str, value, source: str) -> list[str]:
    """Sets plugin key `target` to `value` (what FS-LLM's `source` says) unless it holds another
    value. An explicit value equal to the plugin's default cannot be told apart from an unset
    key in a merged config, so it counts as unset and the FS-LLM value wins."""
    current = lookup(cfg, target, _MISSING)
    if current in (_MISSING, value) or current == lookup(_plugin_defaults(), target, _MISSING):
        assign(cfg, target, value)
        return []
    return [f'{source} means {target} = {value!r}, but {target} = {current!r}: set only one of '
            'the two keys (or both alike)']


def _fill_unset(cfg: dict, target: str, value) -> None:
    if lookup(cfg, target, _MISSING) in (_MISSING, lookup(_plugin_defaults(), target, _MISSING)):
        assign(cfg, target, value)


def _reset(cfg: dict, key: str, fs_base: Mapping) -> None:
    assign(cfg, key, copy.deepcopy(lookup(fs_base, key)))


def _worker_names(cfg: dict, fs_base: Mapping) -> list[str]:
    for key, alias in (('trainer.type', FS_LLM_TRAINER), ('federate.method', FS_LLM_METHOD)):
        if str(lookup(cfg, key, '')).lower() == alias:
            assign(cfg, key, PLUGIN_NAME)
    return []


def _model_type(cfg: dict, fs_base: Mapping) -> list[str]:
    value, suffix = lookup(cfg, 'model.type', ''), '@' + FS_LLM_MODEL_SUFFIX
    if isinstance(value, str) and value.endswith(suffix):
        assign(cfg, 'model.type', value[:-len(suffix)] + '@' + MODEL_TYPE_SUFFIX)
    return []


def _adapter(cfg: dict, fs_base: Mapping) -> list[str]:
    """llm.adapter.args (peft arguments, as FS-LLM's AdapterModel takes them) -> fsplug.model.*.
    llm.adapter.use: False is FS's default, so only False together with args is refused."""
    args, use = lookup(cfg, 'llm.adapter.args', _MISSING), lookup(cfg, 'llm.adapter.use', False)
    if not isinstance(args, list) or args == lookup(fs_base, 'llm.adapter.args') or args in ([], [{}]):
        return []     # unset, or not a list (the type check names it)
    if not all(isinstance(entry, Mapping) for entry in args) or len(args) > 1:
        return [f'llm.adapter.args = {args!r}: expected one mapping of peft arguments '
                "(FS-LLM reads only the first), e.g. [{adapter_method: lora, r: 8}]"]
    if use is not True:
        return [f'llm.adapter.use = {use!r} with llm.adapter.args set: fsplug methods train '
                'adapters; set llm.adapter.use: True']
    problems = _adapter_entry(cfg, dict(args[0]))
    _reset(cfg, 'llm.adapter.args', fs_base)
    return problems


def _adapter_entry(cfg: dict, entry: dict) -> list[str]:
    source = 'llm.adapter.args[0]'
    package, method = entry.pop('adapter_package', 'peft'), entry.pop('adapter_method', 'lora')
    problems = [] if package == 'peft' else [
        f"{source}.adapter_package = {package!r}: fsplug methods build peft adapters ('peft')"]
    targets = ADAPTER_ARGS.get(method)
    if targets is None:
        return problems + [f'{source}.adapter_method = {method!r}: fsplug methods train '
                           f"{' or '.join(map(repr, ADAPTER_ARGS))} adapters"]
    problems += _carry(cfg, 'fsplug.model.adapter', method, f'{source}.adapter_method = {method!r}')
    for name, value in entry.items():
        if name in targets:
            problems += _carry(cfg, targets[name], value, f'{source}.{name} = {value!r}')
        elif value not in PEFT_NO_EFFECT.get(name, ()):
            problems.append(f"{source}.{name} = {value!r}: no fsplug equivalent; {method} "
                            f"arguments the plugin takes: {', '.join(targets)}")
    for name, value in PEFT_DEFAULTS[method].items():
        if name not in entry:
            _fill_unset(cfg, targets[name], value)
    return problems


def _half_precision(cfg: dict, fs_base: Mapping) -> list[str]:
    if lookup(cfg, 'train.is_enable_half') is not True:
        return []
    problems = _carry(cfg, 'fsplug.model.dtype', 'float16', 'train.is_enable_half = True')
    assign(cfg, 'train.is_enable_half', False)
    return problems


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _splits(cfg: dict, fs_base: Mapping) -> list[str]:
    """FS-LLM splits the whole data set [train, val, test] before the clients; the plugin
    holds out the same fractions of each client's records."""
    splits = lookup(cfg, 'data.splits', _MISSING)
    if not isinstance(splits, (list, tuple)) or not all(map(_is_number, splits)) \
            or list(splits) == lookup(fs_base, 'data.splits'):
        return []     # unset, or not numbers (the type check names it)
    if len(splits) != 3 or min(splits) < 0 or not math.isclose(sum(splits), 1.0, abs_tol=1e-6):
        return [f'data.splits = {list(splits)!r}: expected [train, val, test] fractions summing to 1']
    if lookup(cfg, 'fsplug.data.split_from_records') is True:
        return [f'data.splits = {list(splits)!r} and fsplug.data.split_from_records = True: the '
                "records' own split field and fractions exclude each other"]
    source = f'data.splits = {list(splits)!r}'
    problems = (_carry(cfg, 'fsplug.data.val_fraction', splits[1], source)
                + _carry(cfg, 'fsplug.data.test_fraction', splits[2], source))
    _reset(cfg, 'data.splits', fs_base)
    return problems


def _splitter(cfg: dict, fs_base: Mapping) -> list[str]:
    """FS-LLM's 'meta' splitter: one client per record category."""
    if lookup(cfg, 'data.splitter') != 'meta':
        return []
    assign(cfg, 'data.splitter', 'by_source')
    return _carry(cfg, 'fsplug.data.split_field', 'category', "data.splitter = 'meta'")


def _splitter_args(cfg: dict, fs_base: Mapping) -> list[str]:
    args = lookup(cfg, 'data.splitter_args', _MISSING)
    if not isinstance(args, list) or args == lookup(fs_base, 'data.splitter_args') or args in ([], [{}]):
        return []
    if len(args) > 1 or not isinstance(args[0], Mapping):
        return [f'data.splitter_args = {args!r}: expected [{{alpha: <float>}}] (FS\'s LDA splitter)']
    problems = []
    for name, value in args[0].items():
        source = f'data.splitter_args[0].{name} = {value!r}'
        problems += (_carry(cfg, 'fsplug.data.dirichlet_alpha', value, source) if name == 'alpha'
                     else [f'{source}: no fsplug equivalent (alpha -> fsplug.data.dirichlet_alpha)'])
    _reset(cfg, 'data.splitter_args', fs_base)
    return problems


def _best_result_key(cfg: dict, fs_base: Mapping) -> list[str]:
    """FS-LLM's '<split>_loss' is the summed loss; fsplug clients report the mean as
    <split>_avg_loss, which ranks the rounds of one split the same way."""
    key = lookup(cfg, 'eval.best_res_update_round_wise_key')
    if isinstance(key, str) and key in {f'{split}_loss' for split in SPLIT_NAMES}:
        assign(cfg, 'eval.best_res_update_round_wise_key', key[:-len('loss')] + 'avg_loss')
    return []


# ------------------------------------------------------------------ eval.metrics

# FS's metric calculator always computes these; 'loss' is the summed loss (reported as avg_loss)
FS_LOSS_METRICS = ('loss', 'avg_loss', 'total')
# a per-test-modality name: '<modality>[+<modality>...]_<metric>' (fs_plugins.fs.config)
_MODALITY_METRIC = re.compile(r'[a-z]+(?:\+[a-z]+)*_(?P<base>.+)')


def unreported_metric_problems(cfg: Mapping, reported: Collection[str]) -> list[str]:
    """eval.metrics may name only what fsplug clients report: FS's loss metrics, `reported`
    (the plugin's reported and generation metrics) and their per-modality variants."""
    metrics = lookup(cfg, 'eval.metrics', [])
    if not isinstance(metrics, list):
        return []
    accepted = set(FS_LOSS_METRICS) | set(reported)
    unknown = [m for m in metrics if not _is_reported(m, accepted)]
    if not unknown:
        return []
    return [f"eval.metrics = {metrics!r}: {', '.join(map(repr, unknown))} not reported by fsplug "
            f"clients; they report: {', '.join(sorted(accepted))}"]


def _is_reported(metric, accepted: set) -> bool:
    if metric in accepted:
        return True
    match = _MODALITY_METRIC.fullmatch(str(metric))
    return bool(match) and match['base'] in accepted

"""`federate.save_to` files that FS-LLM's own tools read, and `federate.restore_from` of them.

FS's server saves `{'cur_round': r, 'model': aggregator.model.state_dict()}`; here the model is
the plugin's `GlobalState` (fs_plugins.fs.workers), whose `save_checkpoint` (FS's aggregator's
save_model on the plugin's server) writes `save_checkpoint` below instead: the same two entries
and one more, 'fsplug' (`META_KEY`), which torch.load's weights-only mode reads.

FS-LLM reads such a file with `model = get_llm(cfg); model.load_state_dict(ckpt['model'])`
(federatedscope/llm/misc/fschat.py and the eval scripts built on it): `get_llm` wraps the
Hugging Face model's peft model (`get_peft_model`, adapter 'default') in an `AdapterModel`,
whose `state_dict` (the trainable tensors) and `load_state_dict` are the peft model's, the
latter always with strict=False: keys `base_model.model.<module path>.lora_A.default.weight`, and a key that does
not fit is skipped without a word. The plugin's models are peft models too, so a global
tensor's name differs from FS-LLM's key at most in the adapter name (`fs_llm_key`).

A method's global state is *plain LoRA* when it is exactly one LoRA adapter of a causal LM at
the configured rank and nothing else (FedAvg, FedProx, ...): then 'model' holds FS-LLM's keys,
in the dtypes of the model's adapter parameters, and FS-LLM's `get_llm` with the adapter
arguments recorded in 'fsplug' loads every tensor. Otherwise (Fed-MoLE's routed experts,
FLAME's expert LoRA, FFA's or FedSA's half of the LoRA, a changed rank, ...) 'model' holds the
plugin's global state under its own names, for `federate.restore_from`, and 'fsplug' says why
FS-LLM cannot load it and what to use instead.

Nothing here imports FederatedScope."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

META_KEY = 'fsplug'
FORMAT = 1
FS_LLM_ADAPTER = 'default'          # the adapter name get_peft_model gives FS-LLM's LoRA
ADAPTER_MODEL_PREFIX = 'model.'     # an AdapterModel's own module prefix (torch's state_dict of it)
_LORA_PARTS = ('lora_A', 'lora_B', 'lora_embedding_A', 'lora_embedding_B', 'lora_magnitude_vector')


# ------------------------------------------------------------------ key names
def fs_llm_key(name: str) -> str:
    """The key FS-LLM's AdapterModel has for the plugin's parameter `name` (both are peft
    model names; the LoRA's adapter name becomes FS-LLM's 'default')."""
    parts = name.split('.')
    for i, part in enumerate(parts[:-1]):
        if part in _LORA_PARTS:
            parts[i + 1] = FS_LLM_ADAPTER
            break
    return '.'.join(parts)


def plugin_names(keys, known) -> dict[str, str]:
    """{key of a saved 'model' dict: the plugin's name} for the keys that name one of `known`
    (the global state's names): the name itself, FS-LLM's key of it (`fs_llm_key`), either
    under an AdapterModel's 'model.' prefix. Keys naming nothing known are left out."""
    index = {name: name for name in known}
    for name in known:
        index.setdefault(fs_llm_key(name), name)
    out = {}
    for key in keys:
        bare = key[len(ADAPTER_MODEL_PREFIX):] if key.startswith(ADAPTER_MODEL_PREFIX) else key
        name = index.get(key, index.get(bare))
        if name is not None:
            out[key] = name
    return out


def restored_state(state_dict: dict, known: dict) -> tuple[dict, list[str], list[str]]:
    """A federate.restore_from file's 'model' dict against the global state `known`: (its
    tensors of `known` under the plugin's names, in `known`'s dtypes; the keys that name nothing
    of `known`, e.g. a whole peft model's frozen base weights from FS-LLM's
    AdapterModel.save_model; the names whose saved shape differs from `known`'s)."""
    names = plugin_names(state_dict, known)
    out, unknown, mismatched = {}, [], []
    for key, value in state_dict.items():
        name = names.get(key)
        if name is None:
            unknown.append(key)
            continue
        target = known[name]
        if torch.is_tensor(target) and torch.is_tensor(value):
            if tuple(value.shape) != tuple(target.shape):
                mismatched.append(name)
                continue
            value = value.to(target.dtype)
        out[name] = value
    return out, unknown, mismatched


def restore(state_dict: dict, known: dict, source: str = 'federate.restore_from') -> dict:
    """`restored_state`, checked: a ValueError when a tensor's shape differs or none fits;
    skipped keys and tensors the file lacks (which keep their values) are logged."""
    restored, unknown, mismatched = restored_state(state_dict, known)
    if mismatched:
        name = mismatched[0]
        raise ValueError(f'{source}: {len(mismatched)} tensor(s) have another shape than in this '
                         f'run (e.g. {name}: this run {tuple(known[name].shape)}); another base '
                         f'model or LoRA rank?')
    if not restored:
        raise ValueError(f"{source}: the file holds none of this run's global tensors (e.g. "
                         f"{next(iter(known), None)}; the file has {next(iter(state_dict), None)}); "
                         f'another method or base model?')
    if unknown:
        logger.info(f'fsplug: {source}: skipped {len(unknown)} entries outside the global state '
                    f'(e.g. {unknown[0]}; a whole model\'s frozen base weights)')
    missing = sorted(set(known) - set(restored))
    if missing:
        logger.warning(f'fsplug: {source}: {len(missing)} global tensor(s) not in the file keep '
                       f'their initial values (e.g. {missing[0]})')
    logger.info(f'fsplug: {source}: restored {len(restored)} global tensor(s)')
    return restored


# ---------------------------------------------------------------- what is saved
@dataclass
class CheckpointForm:
    """How the server's federate.save_to files are written, decided once at start from the
    method, the global model's layout (artifacts.ModelLayout) and the initial global state."""
    method: str
    plain_lora: bool
    reason: str = ''                       # why not plain LoRA
    adapter: str | None = None             # the plugin's adapter that is FS-LLM's 'default'
    shapes: dict = field(default_factory=dict)   # name -> (shape, dtype) of the initial state
    info: dict = field(default_factory=dict)     # base model, FS-LLM settings, the run
    export_refused: bool = False           # `fs-plugins export` refuses the method's models
    warned: bool = False


def _lora_args(config) -> dict:
    """FS-LLM's `llm.adapter.args[0]` for a peft LoraConfig."""
    targets = config.target_modules
    args = {'adapter_package': 'peft', 'adapter_method': 'lora', 'r': int(config.r),
            'lora_alpha': config.lora_alpha,
            'target_modules': targets if isinstance(targets, str) else sorted(targets or []),
            'lora_dropout': float(config.lora_dropout)}
    if getattr(config, 'use_rslora', False):
        args['use_rslora'] = True
    if getattr(config, 'bias', 'none') != 'none':
        args['bias'] = str(config.bias)
    return args


def _not_plain_reason(method, layout, names: set) -> tuple[str, str | None]:
    """('' and the adapter's name) when the global state is one complete LoRA adapter of a
    causal LM, else (why not, None)."""
    if method.hf_export_refusal:
        return method.hf_export_refusal, None
    if method.modifies_frozen_weights:
        return "the method changes the base model's frozen weights", None
    if layout is None or not layout.peft:
        return 'the model has no peft adapter', None
    if 'text_config' in layout.fingerprint:
        return "a vision-language model (FS-LLM's get_llm builds AutoModelForCausalLM)", None
    for adapter, (config, keys) in layout.peft.items():
        if set(keys) != names:
            continue
        if type(config).__name__ != 'LoraConfig':
            return f"a peft {type(config).__name__} adapter (FS-LLM's get_llm is given LoRA)", None
        if str(getattr(config, 'task_type', '')) not in ('CAUSAL_LM', 'TaskType.CAUSAL_LM'):
            return f"a {config.task_type} model (FS-LLM's get_llm builds a causal LM)", None
        if getattr(config, 'target_parameters', None):
            return 'LoRA on expert parameters (lora.target_parameters) of a layout the plugin ' \
                   'rearranges', None
        return '', adapter
    default = set(next(iter(layout.peft.values()))[1])
    missing, extra = sorted(default - names), sorted(names - default)
    if missing:
        return f'the global state lacks {len(missing)} of the LoRA tensors (e.g. {missing[0]})', None
    return f'the global state holds entries besides one LoRA adapter (e.g. {extra[0]})', None


def checkpoint_form(cfg, method, layout, initial: dict, run_dir: str) -> CheckpointForm:
    """The form of this run's federate.save_to files (see the module's docstring)."""
    tensors = {n: t for n, t in initial.items() if torch.is_tensor(t)}
    reason, adapter = _not_plain_reason(method, layout, set(initial))
    info = {'base_model': str(cfg.model.type), 'builder': str(cfg.fsplug.model.builder),
            'dtype': str(cfg.fsplug.model.dtype), 'run_dir': str(run_dir)}
    if layout is not None and layout.peft:
        config = layout.peft[adapter][0] if adapter else next(iter(layout.peft.values()))[0]
        path = getattr(config, 'base_model_name_or_path', None)
        if path:
            info['base_model_path'] = str(path)
        if type(config).__name__ == 'LoraConfig':
            info['fs_llm'] = {'model.type': f'{path}@huggingface_llm' if path else None,
                              'llm.adapter.use': True, 'llm.adapter.args': [_lora_args(config)]}
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    return CheckpointForm(str(method.name), not reason, reason, adapter, shapes, info,
                          export_refused=bool(method.hf_export_refusal))


def _advice(form: CheckpointForm, why: str) -> str:
    run = form.info['run_dir']
    head = f"not loadable by FS-LLM's get_llm ({why}); 'model' holds the plugin's global " \
           f"state for federate.restore_from. "
    if form.export_refused:
        return head + f"Use fs_plugins.load_trained('{run}') or `fs-plugins predict --run {run}`"
    return head + f'For a Hugging Face model: `fs-plugins export --run {run} --merge` ' \
                  f'(add --client K where the global state is not a whole model)'


def checkpoint(form: CheckpointForm, global_state: dict, cur_round: int) -> dict:
    """The federate.save_to file's content: {'cur_round', 'model', 'fsplug'}."""
    tensors = {n: t for n, t in global_state.items() if torch.is_tensor(t)}
    why = form.reason
    if not why:
        odd = sorted(n for n in set(global_state) | set(form.shapes)
                     if n not in form.shapes or not torch.is_tensor(global_state.get(n))
                     or tuple(global_state[n].shape) != form.shapes[n][0])
        if odd:
            why = f'the global LoRA no longer has the configured names and shapes (e.g. {odd[0]})'
    meta = {'format': FORMAT, 'method': form.method, 'plain_lora': not why,
            'round': int(cur_round), **{k: v for k, v in form.info.items()}}
    if why:
        meta.pop('fs_llm', None)   # no FS-LLM settings load it
        meta.update(keys='fsplug', reason=why, note=_advice(form, why))
        model = dict(global_state)
    else:
        meta.update(keys='fs_llm_adapter_model',
                    note="FS-LLM: get_llm(cfg) with the model.type and llm.adapter settings of "
                         "'fs_llm', then model.load_state_dict(ckpt['model'])")
        model = {fs_llm_key(n): t.detach().to('cpu', form.shapes[n][1])
                 for n, t in tensors.items()}
    return {'cur_round': cur_round, 'model': model, META_KEY: meta}


def save_checkpoint(form: CheckpointForm, global_state: dict, path: str, cur_round: int) -> dict:
    """Writes the federate.save_to file `path`; the first file that FS-LLM cannot load logs a
    warning saying why and what to use. Returns the 'fsplug' entry written."""
    ckpt = checkpoint(form, global_state, cur_round)
    torch.save(ckpt, path)
    meta = ckpt[META_KEY]
    if not meta['plain_lora'] and not form.warned:
        form.warned = True
        logger.warning(f"fsplug: federate.save_to {path} ({form.method}) is {meta['note']}")
    return meta

"""Fine-tuned models as artifacts (issue 18): what a run writes, and `load_trained`.

A run's results directory gets `adapters/`:

- `client_<id>/`: that client's model as it was evaluated (its personalised model):
  * the peft adapter folder of `save_pretrained` (adapter_config.json +
    adapter_model.safetensors; a second peft adapter, e.g. FedDPA's 'local', in its own
    sub-folder as peft writes it) — `PeftModel.from_pretrained(base, path)` loads it;
  * `method_modules.safetensors`: every trained tensor outside peft's adapter (FLAME's
    rescalers, a trained projector; Fed-MoLE's experts and routers are peft LoRA modules and
    go into adapter_model.safetensors) under its parameter name, plus the method's
    `artifact_extra` (tensors that are not trainable parameters but shape the model, e.g.
    FedEx-LoRA's base weights with the residual folded in, FLAME's assigned top-k);
  * `fsplug_artifact.json`: the method, the base model (model.type, builder, dtype and a
    fingerprint of its config), the client, the round, every tensor's name / kind / shape,
    and each file's size and sha256.
- `global/`: the server's global shared state (`ServerProcedure.state['global']`) in
  `global_state.safetensors` under the model's parameter names, with its `fsplug_artifact.json`.
  It is a complete model only for methods whose shared state covers every tensor a client
  trains (`covers_trainable` in the JSON; e.g. FedAvg, FedProx, FedOpt, SCAFFOLD), not for
  personalised ones (FedSA's local B, FedDPA's local adapter, FedEx's residual, ...).

Every folder is written into a temporary folder beside it and renamed into place; the previous
version is kept until the new one is complete, so a crash never leaves a half-written folder
(a crash between the two renames leaves `<folder>.old`, which the loader reads).

Nothing here imports FederatedScope: the embedded runner calls `save_models`, the FS binding
can call `ClientProcedure.save_model` / `ServerProcedure.save_global` the same way.
"""
from __future__ import annotations

import copy
import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from fs_plugins.methods.base import load_tensors
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.config import client_config, load_saved_config, model_path
from fs_plugins.schema.options import to_plain

logger = logging.getLogger(__name__)

FORMAT = 1
ARTIFACT_JSON = 'fsplug_artifact.json'
MODULES_FILE = 'method_modules.safetensors'
GLOBAL_FILE = 'global_state.safetensors'
PEFT_FILE = 'adapter_model.safetensors'
FINGERPRINT_KEYS = ('model_type', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
                    'num_attention_heads', 'num_key_value_heads', 'vocab_size', 'num_experts')


class ArtifactError(ValueError):
    """A saved model that cannot be loaded: the message names the file, client or base model."""


# ------------------------------------------------------------------------ paths
def adapters_dir(run_dir: str) -> str:
    return os.path.join(run_dir, 'adapters')


def client_dir(run_dir: str, client_id: int) -> str:
    return os.path.join(adapters_dir(run_dir), f'client_{client_id}')


def global_dir(run_dir: str) -> str:
    return os.path.join(adapters_dir(run_dir), 'global')


# ----------------------------------------------------------------- atomic writes
@contextmanager
def atomic_dir(target: str):
    """Yields a temporary folder beside `target`; on success it replaces `target` (the old
    version is kept as `<target>.old` until the new one is in place); on error it is removed
    and `target` is untouched."""
    parent, name = os.path.split(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(parent, f'.{name}.tmp-*')):
        shutil.rmtree(stale, ignore_errors=True)   # left by an earlier crash
    tmp = tempfile.mkdtemp(prefix=f'.{name}.tmp-', dir=parent)
    try:
        yield tmp
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = target + '.old'
    if os.path.isdir(target):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), 'rb') as handle:
                os.fsync(handle.fileno())


def readable_dir(path: str) -> str:
    """`path`, or its `.old` version left by a crash between the two renames."""
    if os.path.isfile(os.path.join(path, ARTIFACT_JSON)):
        return path
    old = path + '.old'
    if os.path.isfile(os.path.join(old, ARTIFACT_JSON)):
        logger.warning(f'{path} is missing; reading the previous version {old}')
        return old
    return path


# ----------------------------------------------------------------------- saving
def base_info(cfg) -> dict:
    return {'model': model_path(cfg), 'builder': str(cfg.fsplug.model.builder),
            'dtype': str(cfg.fsplug.model.dtype), 'adapter': str(cfg.fsplug.model.adapter)}


def base_fingerprint(model: torch.nn.Module) -> dict:
    """A few architecture numbers of the base model's config (and of its text config)."""
    base = model.get_base_model() if hasattr(model, 'get_base_model') else model
    config = getattr(base, 'config', None)
    if config is None:
        return {}
    plain = config.to_dict()
    out = {k: plain[k] for k in FINGERPRINT_KEYS if k in plain}
    text = plain.get('text_config')
    if isinstance(text, dict):
        out['text_config'] = {k: text[k] for k in FINGERPRINT_KEYS if k in text}
    return out


@dataclass
class ModelLayout:
    """What the server needs to write the global state as a model: the trainable parameter
    names of a model built from the global config and, per peft adapter, its config and the
    peft state-dict key of each of its parameters. Taken once from the model the server
    builds at start (`runtime.initial_global`), so the server holds no model."""
    trainable_names: list[str]
    peft: dict[str, tuple[object, dict[str, str]]] = field(default_factory=dict)
    fingerprint: dict = field(default_factory=dict)


def peft_keys(model) -> dict[str, dict[str, str]]:
    """Per peft adapter: {model parameter name: key in peft's saved state dict}."""
    from peft import get_peft_model_state_dict
    out = {}
    params = [n for n, _ in model.named_parameters()]
    for adapter in getattr(model, 'peft_config', {}):
        keys = set(get_peft_model_state_dict(model, adapter_name=adapter))
        out[adapter] = {n: n.replace(f'.{adapter}', '') for n in params
                        if n.replace(f'.{adapter}', '') in keys}
    return out


def model_layout(model, trainable_names) -> ModelLayout:
    configs = getattr(model, 'peft_config', {})
    return ModelLayout(list(trainable_names),
                       {a: (copy.deepcopy(configs[a]), keys) for a, keys in peft_keys(model).items()},
                       base_fingerprint(model))


def _save_tensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    import safetensors.torch
    safetensors.torch.save_file(
        {k: v.detach().to('cpu').contiguous().clone() for k, v in tensors.items()}, path)


def _describe(tensors: dict, kind) -> dict:
    return {name: {'kind': kind(name) if callable(kind) else kind, 'shape': list(t.shape),
                   'dtype': str(t.dtype).replace('torch.', '')} for name, t in tensors.items()}


def _file_table(folder: str) -> dict:
    table = {}
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            path = os.path.join(root, name)
            table[os.path.relpath(path, folder)] = {'bytes': os.path.getsize(path),
                                                    'sha256': _sha256(path)}
    return table


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, 'rb') as handle:
        for block in iter(lambda: handle.read(1 << 20), b''):
            digest.update(block)
    return digest.hexdigest()


def _write_meta(folder: str, meta: dict) -> int:
    meta['files'] = _file_table(folder)
    with open(os.path.join(folder, ARTIFACT_JSON), 'w', encoding='utf-8') as handle:
        json.dump(meta, handle, indent=2)
    return sum(f['bytes'] for f in meta['files'].values())


def save_client_model(path: str, client_id: int, round_idx: int, cfg, method, model,
                      trainable_names, state: dict) -> int:
    """Writes one client's model into `path` atomically; returns the bytes written."""
    peft_names = peft_keys(model)
    covered = {n for keys in peft_names.values() for n in keys}
    trainable = set(trainable_names)
    modules = {n: p for n, p in model.named_parameters()
               if (n in trainable or p.requires_grad) and n not in covered}
    extra = dict(method.artifact_extra(model, state))
    clash = set(modules) & set(extra)
    if clash:
        raise ValueError(f"Method '{method.name}': artifact_extra repeats trained tensors {sorted(clash)}")
    with atomic_dir(path) as tmp:
        if peft_names:
            save_peft_adapters(model, tmp)
        tensors = {**modules, **extra}
        if tensors:
            _save_tensors(tensors, os.path.join(tmp, MODULES_FILE))
        written = _write_meta(tmp, {
            'format': FORMAT, 'kind': 'client', 'client': client_id, 'round': round_idx,
            'method': method.name, 'base': base_info(cfg), 'base_config': base_fingerprint(model),
            'config': to_plain(cfg), 'peft_adapters': list(peft_names),
            'tensors': {**_describe(modules, 'trained'), **_describe(extra, 'extra')}})
    logger.info(f'fs-plugins: client {client_id} model (round {round_idx}) -> {path}: '
                f'{written} bytes')
    return written


def save_peft_adapters(model, folder: str) -> None:
    """What peft's `save_pretrained` writes for each adapter (adapter_config.json and
    adapter_model.safetensors, 'default' at the root, others below), without the model card
    it also renders (~0.5 s a client from huggingface_hub's template)."""
    from peft import get_peft_model_state_dict
    for adapter, config in model.peft_config.items():
        sub = _peft_subdir(folder, adapter)
        os.makedirs(sub, exist_ok=True)
        saved = copy.copy(config)   # with what save_pretrained fills in
        saved.inference_mode = True
        saved.base_model_name_or_path = (config.base_model_name_or_path
                                         or model.base_model.model.__dict__.get('name_or_path'))
        saved.save_pretrained(sub, auto_mapping_dict=None if config.task_type else {
            'base_model_class': type(model.base_model.model).__name__,
            'parent_library': type(model.base_model.model).__module__})
        _save_tensors(get_peft_model_state_dict(model, adapter_name=adapter),
                      os.path.join(sub, PEFT_FILE))


def _peft_subdir(folder: str, adapter: str) -> str:
    """Where peft's save_pretrained puts an adapter: 'default' at the root, others below."""
    return folder if adapter == 'default' else os.path.join(folder, adapter)


def save_global_state(path: str, round_idx: int, cfg, method, global_state: dict,
                      layout: ModelLayout | None = None) -> int:
    """Writes the server's global shared tensors into `path` atomically; returns the bytes.
    A peft adapter the global state holds completely is written as a peft adapter folder
    (`PeftModel.from_pretrained` loads it); every other tensor goes to global_state.safetensors."""
    tensors = {k: v for k, v in global_state.items() if torch.is_tensor(v)}
    peft_layout = layout.peft if layout is not None else {}
    complete = {a: keys for a, (_, keys) in peft_layout.items() if keys and set(keys) <= set(tensors)}
    in_peft = {n for keys in complete.values() for n in keys}
    rest = {k: v for k, v in tensors.items() if k not in in_peft}
    with atomic_dir(path) as tmp:
        for adapter, keys in complete.items():
            sub = _peft_subdir(tmp, adapter)
            os.makedirs(sub, exist_ok=True)
            peft_layout[adapter][0].save_pretrained(sub)
            _save_tensors({key: tensors[name] for name, key in keys.items()},
                          os.path.join(sub, PEFT_FILE))
        if rest:
            _save_tensors(rest, os.path.join(tmp, GLOBAL_FILE))
        meta = {'format': FORMAT, 'kind': 'global', 'round': round_idx, 'method': method.name,
                'base': base_info(cfg), 'config': to_plain(cfg), 'peft_adapters': list(complete),
                'tensors': {**_describe({n: tensors[n] for n in in_peft}, 'peft'),
                            **_describe(rest, 'shared')}}
        if layout is not None:
            meta['covers_trainable'] = set(layout.trainable_names) <= set(tensors)
            meta['base_config'] = layout.fingerprint
        written = _write_meta(tmp, meta)
    logger.info(f'fs-plugins: global state (round {round_idx}) -> {path}: {written} bytes')
    return written


def save_models(run_dir: str, round_idx: int, server, clients) -> int:
    """The run's models after round `round_idx`: the global state and every client's model
    (as the clients hold them after receiving the server's evaluation content)."""
    total = server.save_global(run_dir, round_idx)
    for client in clients:
        total += client.save_model(run_dir, round_idx)
    logger.info(f'fs-plugins: models of round {round_idx} -> {adapters_dir(run_dir)}: '
                f'{total} bytes')
    return total


# ---------------------------------------------------------------------- loading
def _read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise ArtifactError(f'{what} not found: {path}')
    try:
        with open(path, encoding='utf-8') as handle:
            data = json.load(handle)
    except (OSError, ValueError, RecursionError) as exc:
        raise ArtifactError(f'{what} is not readable JSON: {path} ({exc})') from None
    if not isinstance(data, dict):
        raise ArtifactError(f'{what} is not a JSON object: {path}')
    return data


def _check_files(folder: str, meta: dict) -> None:
    for rel, entry in meta.get('files', {}).items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            raise ArtifactError(f'Saved model file missing: {path}')
        size = os.path.getsize(path)
        if size != entry['bytes']:
            raise ArtifactError(f'Saved model file {path} has {size} bytes, {entry["bytes"]} '
                                f'were written: truncated or replaced')
        if _sha256(path) != entry['sha256']:
            raise ArtifactError(f'Saved model file {path} does not match the sha256 recorded in '
                                f'{ARTIFACT_JSON}: corrupted or replaced')


def _load_safetensors(path: str) -> dict[str, torch.Tensor]:
    import safetensors.torch
    try:
        return safetensors.torch.load_file(path)
    except Exception as exc:   # safetensors raises its own error types
        raise ArtifactError(f'Cannot read saved tensors {path}: {exc}') from exc


def _check_base(meta: dict, cfg, folder: str) -> None:
    """The saved model's base against the run's config (run_info.json)."""
    expected = base_info(cfg)
    saved = meta.get('base', {})
    diff = {k: (saved.get(k), v) for k, v in expected.items() if saved.get(k) != v}
    if diff:
        lines = ', '.join(f'{k}: saved {a!r}, run config {b!r}' for k, (a, b) in diff.items())
        raise ArtifactError(f'{folder} was saved from another base model than the run config '
                            f'in run_info.json ({lines})')


def _copy_checked(model, tensors: dict, source: str) -> None:
    """Loads saved tensors into the rebuilt model's parameters (names and shapes checked)."""
    try:
        load_tensors(model, tensors)
    except (KeyError, ValueError) as exc:
        raise ArtifactError(f'{source}: {exc.args[0]} (another base model or method?)') from exc


def _load_peft(model, folder: str, adapters: list[str]) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    for adapter in adapters:
        path = os.path.join(_peft_subdir(folder, adapter), PEFT_FILE)
        if not os.path.isfile(path):
            raise ArtifactError(f'Saved adapter file missing: {path}')
        saved = _load_safetensors(path)
        if adapter not in getattr(model, 'peft_config', {}):
            raise ArtifactError(f"{path}: the rebuilt model has no peft adapter '{adapter}'")
        expected = get_peft_model_state_dict(model, adapter_name=adapter)
        missing, unexpected = set(expected) - set(saved), set(saved) - set(expected)
        if missing or unexpected:
            raise ArtifactError(f'{path} does not fit the rebuilt model: missing '
                                f'{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]} '
                                f'(another base model or LoRA config?)')
        for key, value in saved.items():
            if tuple(value.shape) != tuple(expected[key].shape):
                raise ArtifactError(f"{path}: tensor '{key}' has shape {tuple(value.shape)}, the "
                                    f'rebuilt model has {tuple(expected[key].shape)} '
                                    f'(another base model or LoRA rank?)')
        set_peft_model_state_dict(model, saved, adapter_name=adapter)


def _run_info(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, 'run_info.json')
    return _read_json(path, 'run_info.json of the run') if os.path.exists(path) else None


def saved_clients(run_dir: str, info: dict | None) -> list[int]:
    """The run's client ids: from run_info.json, else from the adapters/client_<id> folders
    (a distributed client's results directory holds only its own)."""
    if info and info.get('client_names'):
        return sorted(int(k) for k in info['client_names'])
    found = set()
    if os.path.isdir(adapters_dir(run_dir)):
        for name in os.listdir(adapters_dir(run_dir)):
            tail = name[len('client_'):].split('.')[0]
            if name.startswith('client_') and tail.isdigit():
                found.add(int(tail))
    return sorted(found)


def artifact_folder(run_dir: str, client: int | None) -> str:
    """The saved model's folder of the global state (client None) or of `client`; one clear
    error for a missing run, an unknown client or a model never saved."""
    if not os.path.isdir(run_dir):
        raise ArtifactError(f'Run directory not found: {run_dir}')
    if client is None:
        folder = global_dir(run_dir)
    else:
        known = saved_clients(run_dir, _run_info(run_dir))
        if isinstance(client, bool) or not isinstance(client, int) or client not in known:
            listed = f'clients {known[0]} .. {known[-1]}' if known else 'no client model saved'
            raise ArtifactError(f'Client {client!r} is not a client of the run {run_dir} ({listed})')
        folder = client_dir(run_dir, client)
    folder = readable_dir(folder)
    if not os.path.isdir(folder):
        who = 'global state' if client is None else f'client {client}'
        raise ArtifactError(f'No saved model of the {who} in {run_dir}: {folder} is missing '
                            f'(was the run stopped before its first save?)')
    return folder


def read_artifact(folder: str) -> dict:
    """The folder's fsplug_artifact.json, its files checked against the sizes and hashes in it."""
    meta = _read_json(os.path.join(folder, ARTIFACT_JSON), 'Saved model description')
    if meta.get('format') != FORMAT:
        raise ArtifactError(f'{folder}/{ARTIFACT_JSON}: format {meta.get("format")!r}, '
                            f'this version reads {FORMAT}')
    problem = meta_problem(meta)
    if problem:
        raise ArtifactError(f'{folder}/{ARTIFACT_JSON}: {problem}')
    _check_files(folder, meta)
    return meta


def meta_problem(meta: dict) -> str | None:
    """What is malformed in a fsplug_artifact.json (the loader indexes into it), or None."""
    files, tensors = meta.get('files', {}), meta.get('tensors', {})
    if not isinstance(files, dict) or not all(
            _inside_name(rel) and isinstance(entry, dict) and isinstance(entry.get('bytes'), int)
            and isinstance(entry.get('sha256'), str) for rel, entry in files.items()):
        return "'files' is not a table of relative paths to {bytes, sha256}"
    if not isinstance(tensors, dict) or not all(
            isinstance(entry, dict) and isinstance(entry.get('kind'), str) for entry in tensors.values()):
        return "'tensors' is not a table of names to {kind, ...}"
    adapters = meta.get('peft_adapters', [])
    if not isinstance(adapters, list) or not all(
            isinstance(a, str) and _inside_name(a) and os.sep not in a for a in adapters):
        return "'peft_adapters' is not a list of adapter names"
    for key in ('base', 'base_config', 'config'):
        if not isinstance(meta.get(key, {}), dict):
            return f"'{key}' is not a mapping"
    return None


def _inside_name(rel) -> bool:
    """A relative path that stays inside its folder (a crafted table must not point out)."""
    return (isinstance(rel, str) and bool(rel) and not os.path.isabs(rel)
            and '..' not in rel.replace('\\', '/').split('/'))


def saved_config(run_dir: str, meta: dict, client: int | None, folder: str,
                 import_modules=()):
    """The config that built the saved model (stored with it), checked against the run's
    config in run_info.json when the run directory has one. Only `import_modules` are
    imported, never the saved configs' fsplug.import_modules."""
    if 'config' not in meta:
        raise ArtifactError(f'{folder}/{ARTIFACT_JSON} holds no config (written by an older version)')
    info = _run_info(run_dir)
    if info and 'config' in info:
        if not isinstance(info['config'], dict):
            raise ArtifactError(f"{run_dir}/run_info.json: 'config' is not a mapping")
        run_cfg = load_saved_config(info['config'], f'{run_dir}/run_info.json', import_modules)
        if client is not None:
            overrides = info.get('client_cfgs') or {}
            if not isinstance(overrides, dict):
                raise ArtifactError(f"{run_dir}/run_info.json: 'client_cfgs' is not a mapping")
            run_cfg = client_config(run_cfg, overrides.get(str(client)))
        _check_base(meta, run_cfg, folder)
    return load_saved_config(meta['config'], f'{folder}/{ARTIFACT_JSON}', import_modules)


def load_trained(run_dir: str, client: int | None = None, device: str = 'cpu',
                 import_modules=()):
    """Rebuilds a run's trained model from its results directory: `client=None` the global
    state on the global config's model, `client=<id>` that client's model as it was evaluated
    at the last save. Returns a `BuiltModel` (model in eval mode, codec, trainable names).
    `import_modules`: modules to import first, for a method or builder they register; the
    modules the saved config names are not imported (a results folder may come from anyone)."""
    built, _ = load_trained_with_config(run_dir, client, import_modules)
    built.model.to(device)
    return built


def load_trained_with_config(run_dir: str, client: int | None = None, import_modules=()):
    """`load_trained` on the CPU, with the config that built the model."""

    folder = artifact_folder(run_dir, client)
    meta = read_artifact(folder)
    cfg = saved_config(run_dir, meta, client, folder, tuple(import_modules))
    method = get_method_class(cfg.fsplug.method)(cfg)
    built = build_model(cfg, method)
    model = built.model
    saved_print = meta.get('base_config', {})
    if saved_print and saved_print != base_fingerprint(model):
        raise ArtifactError(f'{folder} was saved from a base model with config {saved_print}; '
                            f'the run config builds {base_fingerprint(model)} '
                            f'(model {base_info(cfg)["model"]})')
    _load_peft(model, folder, list(meta.get('peft_adapters', [])))
    kinds = {n: d['kind'] for n, d in meta.get('tensors', {}).items()}
    stored = {n for n, k in kinds.items() if k != 'peft'}
    if stored:
        path = os.path.join(folder, GLOBAL_FILE if client is None else MODULES_FILE)
        tensors = _load_safetensors(path)
        if set(tensors) != stored:
            raise ArtifactError(f'{path} does not hold the tensors {ARTIFACT_JSON} lists')
        _copy_checked(model, {n: t for n, t in tensors.items() if kinds[n] != 'extra'}, path)
        method.restore_artifact(model, {n: t for n, t in tensors.items() if kinds[n] == 'extra'})
    model.eval()
    return built, cfg

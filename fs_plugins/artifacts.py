"""Fine-tuned models as artifacts (issue 18): what a run writes, and `load_trained`.

A run's results directory gets `adapters/`:

- `client_<id>/`: that client's model as it was evaluated (its personalised model):
  * the peft adapter folder of `save_pretrained` (adapter_config.json +
    adapter_model.safetensors; a second peft adapter, e.g. FedDPA's 'local', in its own
    sub-folder as peft writes it) — `PeftModel.from_pretrained(base, path)` loads it;
  * `method_modules.safetensors`: every other trained tensor (Fed-MoLE's experts and routers,
    FLAME's rescalers, a trained projector) under its parameter name, plus the method's
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

import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager

import torch

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
    from fs_plugins.config import model_path
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


def _peft_names(model) -> dict[str, set[str]]:
    """Per peft adapter, the model's parameter names that peft's state dict covers."""
    from peft import get_peft_model_state_dict
    out = {}
    params = [n for n, _ in model.named_parameters()]
    for adapter in getattr(model, 'peft_config', {}):
        keys = set(get_peft_model_state_dict(model, adapter_name=adapter))
        out[adapter] = {n for n in params if n.replace(f'.{adapter}', '') in keys}
    return out


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
    peft_names = _peft_names(model)
    covered = set().union(*peft_names.values()) if peft_names else set()
    trainable = set(trainable_names)
    modules = {n: p for n, p in model.named_parameters()
               if (n in trainable or p.requires_grad) and n not in covered}
    extra = dict(method.artifact_extra(model, state))
    clash = set(modules) & set(extra)
    if clash:
        raise ValueError(f"Method '{method.name}': artifact_extra repeats trained tensors {sorted(clash)}")
    with atomic_dir(path) as tmp:
        if peft_names:
            model.save_pretrained(tmp)
        tensors = {**modules, **extra}
        if tensors:
            _save_tensors(tensors, os.path.join(tmp, MODULES_FILE))
        written = _write_meta(tmp, {
            'format': FORMAT, 'kind': 'client', 'client': client_id, 'round': round_idx,
            'method': method.name, 'base': base_info(cfg), 'base_config': base_fingerprint(model),
            'peft_adapters': list(peft_names),
            'tensors': {**_describe(modules, 'trained'), **_describe(extra, 'extra')}})
    logger.info(f'fs-plugins: client {client_id} model (round {round_idx}) -> {path}: '
                f'{written} bytes')
    return written


def save_global_state(path: str, round_idx: int, cfg, method, global_state: dict,
                      trainable_names=None) -> int:
    """Writes the server's global shared tensors into `path` atomically; returns the bytes.
    `trainable_names`: a client's trainable parameters under the global config, to record
    whether the global state is a complete model."""
    tensors = {k: v for k, v in global_state.items() if torch.is_tensor(v)}
    with atomic_dir(path) as tmp:
        _save_tensors(tensors, os.path.join(tmp, GLOBAL_FILE))
        meta = {'format': FORMAT, 'kind': 'global', 'round': round_idx, 'method': method.name,
                'base': base_info(cfg), 'tensors': _describe(tensors, 'shared')}
        if trainable_names is not None:
            meta['covers_trainable'] = set(trainable_names) <= set(tensors)
        written = _write_meta(tmp, meta)
    logger.info(f'fs-plugins: global state (round {round_idx}) -> {path}: {written} bytes')
    return written


def save_models(run_dir: str, round_idx: int, server, clients) -> int:
    """The run's models after round `round_idx`: the global state and every client's model
    (as the clients hold them after receiving the server's evaluation content)."""
    clients = list(clients)
    plain = [c for c in clients if c.cfg == server.cfg]   # a client built from the global config
    total = server.save_global(run_dir, round_idx,
                               plain[0].trainable_names if plain else None)
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
            return json.load(handle)
    except (OSError, ValueError) as exc:
        raise ArtifactError(f'{what} is not readable JSON: {path} ({exc})') from exc


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
    expected = base_info(cfg)
    saved = meta.get('base', {})
    diff = {k: (saved.get(k), v) for k, v in expected.items() if saved.get(k) != v}
    if diff:
        lines = ', '.join(f'{k}: saved {a!r}, run config {b!r}' for k, (a, b) in diff.items())
        raise ArtifactError(f'{folder} was saved from another base model than the run config '
                            f'in run_info.json ({lines})')


def _copy_checked(model, tensors: dict, source: str) -> None:
    """Loads saved tensors into the rebuilt model's parameters (names and shapes checked)."""
    from fs_plugins.methods.base import load_tensors
    try:
        load_tensors(model, tensors)
    except (KeyError, ValueError) as exc:
        raise ArtifactError(f'{source}: {exc.args[0]} (another base model or method?)') from exc


def _load_peft(model, folder: str, adapters: list[str]) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    for adapter in adapters:
        sub = folder if adapter == 'default' else os.path.join(folder, adapter)
        path = os.path.join(sub, PEFT_FILE)
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


def load_trained(run_dir: str, client: int | None = None, device: str = 'cpu'):
    """Rebuilds a run's trained model from its results directory: `client=None` the global
    state on the global config's model, `client=<id>` that client's model as it was evaluated
    at the last save. Returns a `BuiltModel` (model in eval mode, codec, trainable names)."""
    from fs_plugins.config import client_config, load_config
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.models.builders import build_model

    if not os.path.isdir(run_dir):
        raise ArtifactError(f'Run directory not found: {run_dir}')
    info = _read_json(os.path.join(run_dir, 'run_info.json'), 'run_info.json of the run')
    if 'config' not in info:
        raise ArtifactError(f'{run_dir}/run_info.json holds no config (written by an older version)')
    cfg = load_config(overrides=info['config'])
    overrides = info.get('client_cfgs') or {}
    if client is None:
        folder, ccfg = global_dir(run_dir), cfg
    else:
        known = sorted(int(k) for k in info.get('client_names', {})) or \
            list(range(1, int(cfg.federate.client_num) + 1))
        if not isinstance(client, int) or client not in known:
            raise ArtifactError(f'Client {client!r} is not a client of the run {run_dir} '
                                f'(clients {known[0]} .. {known[-1]})' if known else
                                f'Client {client!r} is not a client of the run {run_dir}')
        folder = client_dir(run_dir, client)
        ccfg = client_config(cfg, overrides.get(str(client)))
    folder = readable_dir(folder)
    if not os.path.isdir(folder):
        who = 'global state' if client is None else f'client {client}'
        raise ArtifactError(f'No saved model of the {who} in {run_dir}: {folder} is missing '
                            f'(was the run stopped before its first save?)')
    meta = _read_json(os.path.join(folder, ARTIFACT_JSON), 'Saved model description')
    if meta.get('format') != FORMAT:
        raise ArtifactError(f'{folder}/{ARTIFACT_JSON}: format {meta.get("format")!r}, '
                            f'this version reads {FORMAT}')
    _check_base(meta, ccfg, folder)
    _check_files(folder, meta)
    method = get_method_class(cfg.fsplug.method)(ccfg)
    built = build_model(ccfg, method)
    model = built.model
    if client is None:
        path = os.path.join(folder, GLOBAL_FILE)
        _copy_checked(model, _load_safetensors(path), path)
    else:
        saved_print = meta.get('base_config', {})
        if saved_print and saved_print != base_fingerprint(model):
            raise ArtifactError(f'{folder} was saved from a base model with config {saved_print}; '
                                f'the run config builds {base_fingerprint(model)} '
                                f'(model {base_info(ccfg)["model"]})')
        _load_peft(model, folder, list(meta.get('peft_adapters', [])))
        kinds = {n: d['kind'] for n, d in meta.get('tensors', {}).items()}
        if any(k in ('trained', 'extra') for k in kinds.values()):
            path = os.path.join(folder, MODULES_FILE)
            tensors = _load_safetensors(path)
            if set(tensors) != {n for n, k in kinds.items() if k in ('trained', 'extra')}:
                raise ArtifactError(f'{path} does not hold the tensors {ARTIFACT_JSON} lists')
            _copy_checked(model, {n: t for n, t in tensors.items() if kinds[n] == 'trained'}, path)
            method.restore_artifact(model, {n: t for n, t in tensors.items() if kinds[n] == 'extra'})
    model.to(device)
    model.eval()
    return built

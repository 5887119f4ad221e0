"""Whole-federation checkpoints: every party's state, so that a run resumed from round t ends
with the same numbers as the run that was never stopped.

`fsplug.checkpoint.freq: N` writes, at the end of every N-th round (after its evaluation),
one file per party into `<results dir>/checkpoint/`:

- `server.round<t>.safetensors`: the server's method state (global tensors, optimiser moments, RELA's
  EMA, SmartFed's routers, ...), the per-architecture states, the random generators' states
  and the results rows written so far;
- `client_<id>.round<t>.safetensors`: that client's trained tensors (routed experts, routers, local
  adapters, rescalers, gates), the method's `artifact_extra` (e.g. FedEx's folded base
  weights), its method state (counters, EMA gradients, SCAFFOLD controls, FLAME's routing
  counts, ...) and its batch stream's position.

Each file is written beside its target and renamed into place; the server's file goes last
and marks round t complete, and only then are the files of earlier rounds removed, so a crash
at any point leaves the previous complete checkpoint. Tensors go in the safetensors body;
everything else is a JSON skeleton in the file's metadata (no pickle: a checkpoint cannot run
code when it is read). An object in a state that is neither data nor config must have
`state_dict()` / `load_state_dict()`; it is restored in place, so references to it (e.g.
`model.flame_routing`) stay valid.

`fsplug.checkpoint.resume_from: <results dir>` (CLI: `fs-plugins run --resume DIR`) rebuilds
the run from its config, loads the checkpoint into it and continues from the next round,
appending to that directory's results; rows the interrupted run wrote after its checkpoint are
moved to `results.superseded.jsonl`, never deleted.
"""
from __future__ import annotations

import json
import os
import random
import re
import tempfile
from contextlib import contextmanager

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fs_plugins.core.errors import ConfigError
from fs_plugins.run.config import Cfg, to_plain

CHECKPOINT_DIR = 'checkpoint'
FORMAT = 1
META_KEY = 'fsplug_checkpoint'
INFO_KEY = 'fsplug_info'
# config keys that may differ between a run and its resumption
# (distribute: a relaunched distributed party may listen on other addresses, with other
# credentials)
RESUME_FREE_KEYS = ('fsplug.checkpoint', 'fsplug.overwrite', 'federate.total_round_num',
                    'outdir', 'expname', 'fsplug.results_dir', 'eval.freq', 'fsplug.save',
                    'distribute', 'fsplug.distribute')


# entries a checkpoint written before they existed lacks (restored with a default)
OPTIONAL_ENTRIES = ('dataset_sizes',)
# deeper JSON than any run writes: refused before the recursive code below walks it
MAX_NESTING = 100


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or resumed: the message names the file and key."""


@contextmanager
def reading(path: str):
    """Any failure while parsing or checking the checkpoint file `path` ends as one
    CheckpointError naming it: a crafted file gives no raw KeyError or RecursionError."""
    try:
        yield
    except ConfigError:
        raise
    except CheckpointError as exc:
        if path in str(exc):
            raise
        raise CheckpointError(f"checkpoint: {path}: {str(exc).removeprefix('checkpoint: ')}") from None
    except Exception as exc:
        raise CheckpointError(f'checkpoint: {path} is not a valid checkpoint '
                              f'({type(exc).__name__}: {exc})') from None


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINT_DIR)


def party_path(run_dir: str, party: str, round_idx: int) -> str:
    return os.path.join(checkpoint_dir(run_dir), f'{party}.round{int(round_idx)}.safetensors')


def checkpointed_rounds(run_dir: str, party: str = 'server') -> list[int]:
    """Rounds that `party` has a checkpoint file of, in order."""
    pattern = re.compile(re.escape(party) + r'\.round(\d+)\.safetensors$')
    folder = checkpoint_dir(run_dir)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(int(m.group(1)) for m in map(pattern.match, names) if m)


def latest_round(run_dir: str) -> int:
    """The round of the newest complete checkpoint: the server's file is written last."""
    rounds = checkpointed_rounds(run_dir)
    if not rounds:
        raise CheckpointError(f'checkpoint: {checkpoint_dir(run_dir)} has no server checkpoint '
                              f'(server.round<N>.safetensors); was fsplug.checkpoint.freq > 0?')
    return rounds[-1]


def prune(run_dir: str, keep_round: int) -> None:
    """Removes every party's files of other rounds once `keep_round` is complete."""
    folder = checkpoint_dir(run_dir)
    for name in os.listdir(folder):
        match = re.search(r'\.round(\d+)\.safetensors$', name)
        if match and int(match.group(1)) != keep_round:
            os.remove(os.path.join(folder, name))


def client_party(client_id: int) -> str:
    return f'client_{int(client_id)}'


def should_checkpoint(cfg, rounds_done: int) -> bool:
    freq = int(cfg.fsplug.checkpoint.freq)
    return freq > 0 and (rounds_done % freq == 0 or rounds_done == int(cfg.federate.total_round_num))


# ------------------------------------------------------------------ pack / unpack
def _is_static(value) -> bool:
    """Config objects: rebuilt from the run's config on resume, never saved."""
    try:
        from yacs.config import CfgNode
    except ImportError:   # pragma: no cover
        CfgNode = Cfg
    return isinstance(value, (Cfg, CfgNode))


def pack(value, tensors: dict, where: str):
    """A JSON-able skeleton of `value`; its tensors go into `tensors` under keys derived from
    `where` (the path of the value, used in error messages too)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if torch.is_tensor(value):
        key = f'{where}#{len(tensors)}'
        tensors[key] = value.detach().cpu().clone().contiguous()
        return {'__tensor__': key}
    if isinstance(value, np.ndarray):
        return {'__ndarray__': pack(torch.from_numpy(np.ascontiguousarray(value)), tensors, where)}
    if isinstance(value, np.generic):
        return value.item()
    if _is_static(value):
        return {'__static__': type(value).__name__}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {'__dict__': {k: pack(v, tensors, f'{where}/{k}') for k, v in value.items()}}
        return {'__items__': [[pack(k, tensors, f'{where}/key'), pack(v, tensors, f'{where}/{k}')]
                              for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        items = [pack(v, tensors, f'{where}/{i}') for i, v in enumerate(value)]
        return {'__tuple__': items} if isinstance(value, tuple) else items
    if hasattr(value, 'state_dict') and hasattr(value, 'load_state_dict'):
        return {'__state__': pack(value.state_dict(), tensors, where)}
    raise CheckpointError(f"checkpoint: '{where}' holds a {type(value).__name__}, which is "
                          f"neither data nor has state_dict()/load_state_dict()")


def unpack(skeleton, tensors: dict, target=None):
    """The value `pack` saved; objects saved through their state_dict are loaded into `target`
    (the freshly built run's object at the same place) and config objects are `target`."""
    if isinstance(skeleton, list):
        targets = target if isinstance(target, (list, tuple)) else []
        return [unpack(s, tensors, targets[i] if i < len(targets) else None)
                for i, s in enumerate(skeleton)]
    if not isinstance(skeleton, dict):
        return skeleton
    (kind, body), = skeleton.items()
    if kind == '__tensor__':
        return tensors[body]
    if kind == '__ndarray__':
        return unpack(body, tensors).numpy()
    if kind == '__tuple__':
        return tuple(unpack(s, tensors, None) for s in body)
    if kind == '__dict__':
        targets = target if isinstance(target, dict) else {}
        return {k: unpack(v, tensors, targets.get(k)) for k, v in body.items()}
    if kind == '__items__':
        pairs = [(unpack(k, tensors), v) for k, v in body]
        targets = target if isinstance(target, dict) else {}
        return {_hashable(k): unpack(v, tensors, targets.get(_hashable(k))) for k, v in pairs}
    if kind == '__static__':
        return target
    if kind == '__state__':
        if target is None:
            raise CheckpointError('checkpoint: an object saved through its state_dict has no '
                                  'counterpart in the rebuilt run')
        target.load_state_dict(unpack(body, tensors))
        return target
    raise CheckpointError(f'checkpoint: unknown entry {kind!r}')


def _hashable(value):
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_hashable(v) for v in value)
    return value


# ------------------------------------------------------------------ files
def write_party(path: str, payload: dict, info: dict | None = None) -> int:
    """Writes one party's checkpoint atomically; returns its size in bytes. `info`: plain JSON
    (round, rows, config) readable without the rest (`read_info`)."""
    tensors: dict = {}
    skeleton = pack(payload, tensors, os.path.basename(path).split('.')[0])
    return write_packed(path, skeleton, tensors, info)


def write_packed(path: str, skeleton, tensors: dict, info: dict | None = None) -> int:
    """`write_party` of a payload packed earlier (a snapshot taken before it is written)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix='.' + os.path.basename(path) + '.tmp-', dir=folder)
    os.close(handle)
    try:
        save_file(tensors, tmp, metadata={META_KEY: json.dumps({'format': FORMAT,
                                                                'skeleton': skeleton}),
                                          INFO_KEY: json.dumps(info or {})})
        with open(tmp, 'rb') as stream:
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return os.path.getsize(path)


def _read(path: str, tensors: bool) -> tuple[dict, dict]:
    """(metadata, tensors if asked) of a checkpoint file; unreadable ones are named."""
    if not os.path.isfile(path):
        raise CheckpointError(f'checkpoint: {path} does not exist')
    try:
        with safe_open(path, framework='pt') as handle:
            metadata = handle.metadata() or {}
            # safe_open handles are not iterable: keys() is needed
            return metadata, ({k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
                              if tensors else {})
    except Exception as exc:   # safetensors raises its own error types
        raise CheckpointError(f'checkpoint: {path} is not readable ({exc})') from None


def _json(path: str, metadata: dict, key: str, default: str):
    try:
        value = json.loads(metadata.get(key, default))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f'checkpoint: {path} is not readable ({exc})') from None
    if nesting(value) > MAX_NESTING:
        raise CheckpointError(f'checkpoint: {path}: its {key} entry is nested deeper than '
                              f'{MAX_NESTING} levels')
    return value


def nesting(value) -> int:
    """How deep lists and mappings nest in `value` (iterative: the value may be crafted);
    counting stops past MAX_NESTING."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_NESTING:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def read_info(path: str) -> dict:
    """The plain `info` a party's checkpoint was written with (round, rows and config checked
    when present)."""
    with reading(path):
        info = _json(path, _read(path, tensors=False)[0], INFO_KEY, '{}')
        if not isinstance(info, dict):
            raise CheckpointError(f'its info is a {type(info).__name__}, not a mapping')
        for key in ('round', 'rows'):
            if key in info and not _is_count(info[key]):
                raise CheckpointError(f'info {key!r} is {info[key]!r}, not a count')
        if not isinstance(info.get('config', {}), dict):
            raise CheckpointError("info 'config' is not a mapping")
        return info


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_party(path: str, target: dict | None = None) -> dict:
    """A party's checkpoint; `target`: the rebuilt run's objects at the same places. The
    payload must have the target's entries, of the same kinds (mappings, sequences, tensors)."""
    with reading(path):
        metadata, tensors = _read(path, tensors=True)
        meta = _json(path, metadata, META_KEY, 'null')
        if not isinstance(meta, dict) or meta.get('format') != FORMAT:
            raise CheckpointError(f'checkpoint: {path} is not an fs-plugins checkpoint '
                                  f'(format {FORMAT})')
        payload = unpack(meta['skeleton'], tensors, target or {})
        check_fits(payload, target or {}, 'payload')
        missing = set(target or {}) - set(payload) - set(OPTIONAL_ENTRIES)
        if missing:
            raise CheckpointError(f'the payload lacks {sorted(missing)}')
        if 'rng' in payload:
            check_rng_state(payload['rng'])
        return payload


def check_fits(value, target, where: str) -> None:
    """`value` has the structure of `target` (the rebuilt run's) wherever `target` has one:
    a mapping for a mapping, a sequence for a sequence, a tensor for a tensor; None and
    scalars are not checked (a method's state may change their kind between rounds)."""
    if value is None or target is None:
        return
    if isinstance(target, dict):
        if not isinstance(value, dict):
            raise CheckpointError(f"'{where}' is a {type(value).__name__}, expected a mapping")
        for key, sub in target.items():
            if key in value:
                check_fits(value[key], sub, f'{where}/{key}')
    elif isinstance(target, (list, tuple)) and not isinstance(value, (list, tuple)):
        raise CheckpointError(f"'{where}' is a {type(value).__name__}, expected a sequence")
    elif torch.is_tensor(target) and not torch.is_tensor(value):
        raise CheckpointError(f"'{where}' is a {type(value).__name__}, expected a tensor")


# ------------------------------------------------------------------ random generators
def rng_state() -> dict:
    state = {'torch': torch.get_rng_state(), 'numpy': _numpy_state(),
             'python': _python_state()}
    if torch.cuda.is_available():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state['torch'])
    kind, keys, pos, has_gauss, gauss = state['numpy']
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss = state['python']
    random.setstate((version, tuple(internal), gauss))
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])


def check_rng_state(state) -> None:
    """Raises unless `state` is one `set_rng_state` accepts: it is tried, and the current
    generators' state put back."""
    current = rng_state()
    try:
        set_rng_state(state)
    finally:
        set_rng_state(current)


def _numpy_state():
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]


def _python_state():
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


# ------------------------------------------------------------------ parties
def client_payload(client) -> dict:
    """What a ClientProcedure needs to continue as if never stopped."""
    params = {n: client.params[n] for n in client.trainable_names}
    return {'client_id': client.client_id, 'round': client.round_idx,
            'params': params, 'artifact_extra': client.method.artifact_extra(client.model, client.state),
            'state': client.state, 'stream': client.stream}


def restore_client(client, payload: dict) -> None:
    if not _is_count(payload['round']):
        raise CheckpointError(f"checkpoint of client {client.client_id}: round "
                              f"{payload['round']!r} is not a round")
    with torch.no_grad():
        for name, tensor in payload['params'].items():
            if name not in client.params or client.params[name].shape != tensor.shape:
                raise CheckpointError(
                    f'checkpoint of client {client.client_id}: parameter {name} '
                    f'{tuple(tensor.shape)} does not fit the rebuilt model')
            client.params[name].copy_(tensor)
    if payload['artifact_extra']:
        client.method.restore_artifact(client.model, payload['artifact_extra'])
    client.state.clear()
    client.state.update(payload['state'])
    client.round_idx = payload['round']


def server_payload(server) -> dict:
    return {'state': server.state, 'other_states': server.other_states,
            'client_signature': server.client_signature, 'rejections': server.rejections,
            'expected_shapes': server._expected, 'dataset_sizes': server.dataset_sizes,
            'rng': rng_state()}


def restore_server(server, payload: dict) -> None:
    """The server procedure's state; the random generators are the caller's to restore
    (`set_rng_state(payload['rng'])`) at the point the run continues."""
    server.state = payload['state']
    server.other_states = payload['other_states']
    server.client_signature = payload['client_signature']
    server.rejections = payload['rejections']
    server._expected = payload['expected_shapes']
    server.dataset_sizes = payload.get('dataset_sizes', {})   # NbAFL's m (run.privacy)


def write_client(run_dir: str, client, round_idx: int, with_rng: bool = False) -> int:
    """Client `client`'s file of round `round_idx`; `with_rng`: its process's random
    generators too (a process of its own, FS distributed)."""
    payload = client_payload(client)
    if with_rng:
        payload['rng'] = rng_state()
    return write_party(party_path(run_dir, client_party(client.client_id), round_idx), payload,
                       party_info(client.cfg, round_idx))


def party_info(cfg, round_idx: int, rows: int | None = None) -> dict:
    """The plain part of a party's file: its round and config, and for the server the number
    of results rows the round ends with."""
    info = {'round': round_idx, 'config': to_plain(cfg)}
    return info if rows is None else {**info, 'rows': rows}


def read_server(run_dir: str, round_idx: int, server) -> dict:
    """Restores `server` from its file of round `round_idx`; returns the random generators'
    state, for the caller to restore where the run continues."""
    path = party_path(run_dir, 'server', round_idx)
    with reading(path):
        payload = read_party(path, server_payload(server))
        restore_server(server, payload)
        return payload['rng']


# ------------------------------------------------------------------ one process
def save_federation(run_dir: str, round_idx: int, server, clients, rows: int) -> int:
    """Every party's checkpoint after round `round_idx` (the embedded runner); bytes written."""
    written = sum(write_client(run_dir, c, round_idx) for c in clients)
    written += write_party(party_path(run_dir, 'server', round_idx), server_payload(server),
                           party_info(server.cfg, round_idx, rows))
    prune(run_dir, round_idx)
    return written


def server_checkpoint_info(cfg, run_dir: str) -> dict:
    """The newest server checkpoint's round, results rows and config, checked against `cfg`."""
    path = party_path(run_dir, 'server', latest_round(run_dir))
    info = read_info(path)
    missing = [key for key in ('round', 'rows') if key not in info]
    if missing:
        raise CheckpointError(f'checkpoint: {path}: its info lacks {missing}')
    check_resumable(cfg, info.get('config', {}))
    return info


def resume_federation(run_dir: str, round_idx: int, server, clients) -> None:
    """Loads every party's checkpoint of round `round_idx` into the rebuilt run."""
    for client in clients:
        path = party_path(run_dir, client_party(client.client_id), round_idx)
        with reading(path):
            restore_client(client, read_party(path, client_payload(client)))
    set_rng_state(read_server(run_dir, round_idx, server))


def check_resumable(cfg, saved_config: dict) -> None:
    """The resumed run's config must equal the checkpointed run's, except RESUME_FREE_KEYS."""
    now, then = _flat(to_plain(cfg)), _flat(saved_config)
    differ = sorted(k for k in set(now) | set(then)
                    if now.get(k) != then.get(k) and not k.startswith(RESUME_FREE_KEYS))
    if differ:
        shown = ', '.join(f'{k} ({then.get(k)!r} -> {now.get(k)!r})' for k in differ[:8])
        raise ConfigError([f'fsplug.checkpoint.resume_from: the config differs from the '
                           f'checkpointed run in {shown}'])


def _flat(tree: dict) -> dict:
    """{'a.b': value} of a nested mapping (iterative: a saved config may be crafted)."""
    out, stack = {}, [('', tree)]
    while stack:
        prefix, node = stack.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                stack.append((f'{prefix}{key}.', value))
            else:
                out[f'{prefix}{key}'] = value
    return out

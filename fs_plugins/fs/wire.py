"""What travels in FS messages between fsplug workers.

Inside the FS worker, a message's content is a flat string-keyed dict: `shared/<name>` and
`extra/<name>` tensors, `metric/<name>` floats and `meta/dataset_size`. In standalone mode
that dict is passed as is (one process, no encoding).

In distributed mode (gRPC) the whole dict travels as ONE safetensors blob, base64-encoded
because FS's protobuf carries text: tensors in its body, the scalars as JSON in its metadata.
Nothing received is ever unpickled, so no payload can run code on the receiver; a payload that
is not such a blob, holds anything else, or whose scalars are out of range raises `WireError`
naming the sender and the key: every error decoding raises is turned into one, so a malformed
message is the sender's rejection, never the receiver's crash.
(FS's own `b64serializer` pickles; the plugin no longer uses it.)
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import struct

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from fs_plugins.methods.base import ClientUpdate
from fs_plugins.run.validation import count_problem

MARKER = '__fsplug__'     # never empty: FS's gRPC encoder cannot encode an empty dict
PAYLOAD = 'fsplug/payload'
SHARED, EXTRA, METRIC = 'shared/', 'extra/', 'metric/'
DATASET_SIZE = 'meta/dataset_size'
ENCODE_S = 'meta/encode_s'   # beside the blob: the seconds the client took to encode its update
SCALARS_KEY = 'fsplug_scalars'
SCALAR_TYPES = (bool, int, float, str)


class WireError(ValueError):
    """A received payload that is not what the fsplug workers send."""


# ------------------------------------------------------------------ blob
def _own_storage(tensor: torch.Tensor, seen: set) -> torch.Tensor:
    """safetensors refuses tensors sharing storage: views and repeats are copied."""
    tensor = tensor.detach().cpu().contiguous()
    storage = tensor.untyped_storage()
    if storage.nbytes() != tensor.numel() * tensor.element_size() or storage.data_ptr() in seen:
        tensor = tensor.clone()
    seen.add(tensor.untyped_storage().data_ptr())
    return tensor


def to_blob(flat: dict) -> str:
    """The base64 text of a safetensors blob holding `flat` (tensors and JSON scalars)."""
    tensors, scalars, seen = {}, {}, set()
    for key, value in flat.items():
        if torch.is_tensor(value):
            tensors[key] = _own_storage(value, seen)
        elif value is None or isinstance(value, SCALAR_TYPES):
            scalars[key] = value
        else:
            raise TypeError(f"wire: '{key}' is a {type(value).__name__}; only tensors and "
                            f"JSON scalars travel")
    data = save_tensors(tensors, metadata={SCALARS_KEY: json.dumps(scalars)})
    return base64.b64encode(data).decode('ascii')


def _header(data: bytes, sender: str) -> dict:
    if len(data) < 8:
        raise WireError(f'payload from {sender} is not a safetensors blob ({len(data)} bytes)')
    size, = struct.unpack('<Q', data[:8])
    if size > len(data) - 8:
        raise WireError(f'payload from {sender} is not a safetensors blob (header of {size} '
                        f'bytes in {len(data)})')
    try:
        header = json.loads(data[8:8 + size])
    except Exception as exc:   # noqa: BLE001 -- e.g. RecursionError of a deeply nested header
        raise WireError(f'payload from {sender} has an unreadable header '
                        f'({type(exc).__name__}: {_short(exc)})') from None
    if not isinstance(header, dict):
        raise WireError(f'payload from {sender} has an unreadable header')
    return header


def from_blob(text, sender: str) -> dict:
    """The flat dict `to_blob` encoded; anything else is a WireError naming `sender`."""
    if not isinstance(text, (str, bytes)):
        raise WireError(f"payload from {sender}: '{PAYLOAD}' is a {type(text).__name__}, "
                        f"not base64 text")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(f"payload from {sender}: '{PAYLOAD}' is not base64 ({exc})") from None
    header = _header(data, sender)
    try:
        metadata = header.get('__metadata__') or {}
        scalars = json.loads(metadata.get(SCALARS_KEY, '{}'))
        tensors = load_tensors(data)
    except Exception as exc:   # noqa: BLE001 -- safetensors' own errors, odd metadata
        raise WireError(f'payload from {sender} is not a valid safetensors blob '
                        f'({type(exc).__name__}: {_short(exc)})') from None
    if not isinstance(scalars, dict):
        raise WireError(f'payload from {sender}: its scalars are not a JSON object')
    for key, value in scalars.items():
        if value is not None and not isinstance(value, SCALAR_TYPES):
            raise WireError(f"payload from {sender}: '{key}' is a {type(value).__name__}")
    return {**scalars, **tensors}


def _short(exc: Exception, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + '...'


# ------------------------------------------------------------------ messages
def _message(flat: dict, distributed: bool) -> dict:
    return {MARKER: 1, PAYLOAD: to_blob(flat)} if distributed else {MARKER: 1, **flat}


def _flat(content, sender: str) -> dict:
    if not isinstance(content, dict):
        raise WireError(f'content from {sender} is a {type(content).__name__}, not a dict')
    if PAYLOAD in content:
        return from_blob(content[PAYLOAD], sender)
    strings = [k for k, v in content.items() if isinstance(v, (str, bytes)) and '/' in k]
    if strings:   # the old pickled encoding, or a forged one: never decoded
        raise WireError(f"content from {sender}: '{strings[0]}' is text, not a tensor "
                        f"(pickled payloads are not accepted)")
    return content


def _section(flat: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}


def encode_tensors(tensors: dict, distributed: bool) -> dict:
    return _message({SHARED + k: v for k, v in tensors.items()}, distributed)


def decode_tensors(content, sender: str = 'the server') -> dict:
    if not isinstance(content, dict):
        return {}
    try:
        return _section(_flat(content, sender), SHARED)
    except WireError:
        raise
    except Exception as exc:   # noqa: BLE001 -- whatever a malformed message raises
        raise WireError(f'content from {sender}: {type(exc).__name__}: {_short(exc)}') from None


def encode_update(update: ClientUpdate, distributed: bool) -> dict:
    flat = {SHARED + k: v for k, v in update.shared.items()}
    flat.update({EXTRA + k: v for k, v in update.extra.items()})
    flat.update({METRIC + k: float(v) for k, v in update.metrics.items()})
    flat[DATASET_SIZE] = int(update.dataset_size)
    return _message(flat, distributed)


def with_encode_time(message: dict, seconds: float) -> dict:
    """An encoded update with the seconds its encoding took (known only once it is encoded,
    so outside the blob); decode_update reports them as the update's encode_s metric."""
    return {**message, ENCODE_S: float(seconds)}


def decode_update(client_id: int, num_samples, content) -> ClientUpdate:
    """The ClientUpdate a client sent; WireError (naming the client) for anything malformed:
    any decoding error, a count that is not an integer in [0, MAX_COUNT] (`num_samples`,
    a dataset size under 1), a metric that is not a number or is infinite (NaN stays: it is
    the clients' own 'no value', e.g. the loss of a round without samples)."""
    sender = f'client {client_id}'
    try:
        flat = _flat(content, sender)
        return ClientUpdate(int(client_id), _count(num_samples, 'num_samples', sender),
                            _tensors(flat, SHARED, sender), _tensors(flat, EXTRA, sender),
                            {**_metrics(flat, sender), **_encode_time(content, sender)},
                            dataset_size=_count(flat.get(DATASET_SIZE), DATASET_SIZE, sender,
                                                minimum=1))
    except WireError:
        raise
    except Exception as exc:   # noqa: BLE001 -- no malformed update may escape as another error
        raise WireError(f'content from {sender}: {type(exc).__name__}: {_short(exc)}') from None


def _count(value, what: str, sender: str, minimum: int = 0) -> int:
    problem = count_problem(value, what, minimum)
    if problem:
        raise WireError(f'content from {sender}: {problem}')
    return int(value)


def _tensors(flat: dict, prefix: str, sender: str) -> dict:
    tensors = _section(flat, prefix)
    for name, value in tensors.items():
        if not torch.is_tensor(value):
            raise WireError(f"content from {sender}: '{prefix}{name}' is a "
                            f"{type(value).__name__}, not a tensor")
    return tensors


def _metrics(flat: dict, sender: str) -> dict[str, float]:
    metrics = {}
    for name, value in _section(flat, METRIC).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isinf(value):
            raise WireError(f"content from {sender}: metric '{name}' = {value!r} is not a "
                            f"finite number")
        metrics[name] = float(value)
    return metrics


def _encode_time(content: dict, sender: str) -> dict[str, float]:
    """{'encode_s': seconds} of an update that carries them (a finite number >= 0)."""
    if ENCODE_S not in content:
        return {}
    value = content[ENCODE_S]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise WireError(f"content from {sender}: '{ENCODE_S}' = {value!r} is not a number of "
                        f"seconds")
    return {'encode_s': float(value)}


def encoded_size(content: dict) -> int:
    """Bytes of the text fields of an encoded message (what gRPC's limits apply to)."""
    return sum(len(v) for v in content.values() if isinstance(v, (str, bytes)))


def decoded_updates(received: dict, reject) -> list[ClientUpdate]:
    """The updates of a round's FS messages ({client id: (num_samples, content)}); one that
    cannot be decoded, for whatever reason, goes to `reject(client_id, reason)` and the rest
    go on. In client id order, not arrival order: the aggregate (a float sum, a distillation
    over the updates) is then the same whatever order the network delivered them in."""
    updates = []
    for client_id, message in sorted(received.items(), key=lambda item: int(item[0])):
        try:
            num_samples, content = message
            updates.append(decode_update(client_id, num_samples, content))
        except Exception as exc:   # noqa: BLE001 -- a malformed message is its sender's
            reject(int(client_id), f'undecodable update: {exc}')
    return updates

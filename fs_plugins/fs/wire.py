"""What travels in FS messages between fsplug workers.

Inside the FS worker, a message's content is a flat string-keyed dict: `shared/<name>` and
`extra/<name>` tensors, `metric/<name>` floats and `meta/dataset_size`. In standalone mode
that dict is passed as is (one process, no encoding).

In distributed mode (gRPC) the whole dict travels as ONE safetensors blob, base64-encoded
because FS's protobuf carries text: tensors in its body, the scalars as JSON in its metadata.
Nothing received is ever unpickled, so no payload can run code on the receiver; a payload that
is not such a blob, or holds anything else, raises `WireError` naming the sender and the key.
(FS's own `b64serializer` pickles; the plugin no longer uses it.)
"""
from __future__ import annotations

import base64
import binascii
import json
import struct

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from fs_plugins.methods.base import ClientUpdate

MARKER = '__fsplug__'     # never empty: FS's gRPC encoder cannot encode an empty dict
PAYLOAD = 'fsplug/payload'
SHARED, EXTRA, METRIC = 'shared/', 'extra/', 'metric/'
DATASET_SIZE = 'meta/dataset_size'
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
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f'payload from {sender} has an unreadable header ({exc})') from None
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
        scalars = json.loads((header.get('__metadata__') or {}).get(SCALARS_KEY, '{}'))
        tensors = load_tensors(data)
    except Exception as exc:   # safetensors raises its own error type
        raise WireError(f'payload from {sender} is not a valid safetensors blob ({exc})') from None
    if not isinstance(scalars, dict):
        raise WireError(f'payload from {sender}: its scalars are not a JSON object')
    for key, value in scalars.items():
        if value is not None and not isinstance(value, SCALAR_TYPES):
            raise WireError(f"payload from {sender}: '{key}' is a {type(value).__name__}")
    return {**scalars, **tensors}


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
    return _section(_flat(content, sender), SHARED) if isinstance(content, dict) else {}


def encode_update(update: ClientUpdate, distributed: bool) -> dict:
    flat = {SHARED + k: v for k, v in update.shared.items()}
    flat.update({EXTRA + k: v for k, v in update.extra.items()})
    flat.update({METRIC + k: float(v) for k, v in update.metrics.items()})
    flat[DATASET_SIZE] = int(update.dataset_size)
    return _message(flat, distributed)


def decode_update(client_id: int, num_samples, content) -> ClientUpdate:
    """The ClientUpdate a client sent; WireError (naming the client) when it is malformed."""
    sender = f'client {client_id}'
    flat = _flat(content, sender)
    try:
        metrics = {k: float(v) for k, v in _section(flat, METRIC).items()}
        return ClientUpdate(int(client_id), int(num_samples), _section(flat, SHARED),
                            _section(flat, EXTRA), metrics,
                            dataset_size=int(flat.get(DATASET_SIZE, 0)))
    except (TypeError, ValueError) as exc:
        raise WireError(f'content from {sender}: {exc}') from None


def encoded_size(content: dict) -> int:
    """Bytes of the text fields of an encoded message (what gRPC's limits apply to)."""
    return sum(len(v) for v in content.values() if isinstance(v, (str, bytes)))

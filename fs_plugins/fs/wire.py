"""What travels in FS messages: flat string-keyed dicts (never empty: FS's gRPC encoder
cannot encode an empty dict). Tensors are b64-pickled in distributed mode with FS's own
serialiser, so every message type carries them exactly."""
from __future__ import annotations

import torch

from fs_plugins.methods.base import ClientUpdate

MARKER = '__fsplug__'
SHARED, EXTRA, METRIC = 'shared/', 'extra/', 'metric/'
DATASET_SIZE = 'meta/dataset_size'


def _serialise(value, distributed: bool):
    if distributed and torch.is_tensor(value):
        from federatedscope.core.auxiliaries.utils import b64serializer
        return b64serializer(value)
    return value


def _deserialise(value):
    if isinstance(value, (str, bytes)):
        from federatedscope.core.auxiliaries.utils import b64deserializer
        return b64deserializer(value)
    return value


def encode_tensors(tensors: dict, distributed: bool) -> dict:
    out = {MARKER: 1}
    out.update({SHARED + k: _serialise(v, distributed) for k, v in tensors.items()})
    return out


def decode_tensors(content) -> dict:
    if not isinstance(content, dict):
        return {}
    return {k[len(SHARED):]: _deserialise(v) for k, v in content.items() if k.startswith(SHARED)}


def encode_update(update: ClientUpdate, distributed: bool) -> dict:
    out = encode_tensors(update.shared, distributed)
    out.update({EXTRA + k: _serialise(v, distributed) for k, v in update.extra.items()})
    out.update({METRIC + k: float(v) for k, v in update.metrics.items()})
    out[DATASET_SIZE] = int(update.dataset_size)
    return out


def decode_update(client_id: int, num_samples: int, content: dict) -> ClientUpdate:
    extra = {k[len(EXTRA):]: _deserialise(v) for k, v in content.items() if k.startswith(EXTRA)}
    metrics = {k[len(METRIC):]: float(v) for k, v in content.items() if k.startswith(METRIC)}
    return ClientUpdate(int(client_id), int(num_samples), decode_tensors(content), extra, metrics,
                        dataset_size=int(content.get(DATASET_SIZE, 0)))

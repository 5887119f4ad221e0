"""Sample-weighted averaging of named tensors, and the client weights it uses."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fs_plugins.aggregation.robust import active_average, robust_combination


def normalise_weights(weights: Sequence[float]) -> torch.Tensor:
    """Non-negative weights -> float64 tensor summing to 1. Raises if they sum to 0."""
    w = torch.as_tensor([float(x) for x in weights], dtype=torch.float64)
    if (w < 0).any():
        raise ValueError(f"Aggregation weights must be non-negative, got {w.tolist()}")
    total = w.sum()
    if total <= 0:
        raise ValueError(f"Aggregation weights sum to {float(total)}; nothing to average")
    return w / total


def client_weights(mode: str, dataset_sizes: Sequence[int], processed: Sequence[int]) -> list[float]:
    """Unnormalised client weights p_k for `mode` (fsplug.aggregation.weights):
    'dataset_size' n_k (the papers' p_k = n_k / Σ n), 'processed' (samples trained this
    round), 'uniform' (1 each)."""
    if len(dataset_sizes) != len(processed):
        raise ValueError(f"{len(dataset_sizes)} dataset sizes but {len(processed)} processed counts")
    if mode == 'dataset_size':
        if any(int(n) <= 0 for n in dataset_sizes):
            raise ValueError(f"fsplug.aggregation.weights = 'dataset_size' needs every client's "
                             f"training-set size, got {list(dataset_sizes)}")
        return [float(n) for n in dataset_sizes]
    if mode == 'processed':
        return [float(n) for n in processed]
    if mode == 'uniform':
        return [1.0] * len(processed)
    raise ValueError(f"fsplug.aggregation.weights = '{mode}' is not one of "
                     f"'dataset_size', 'processed', 'uniform'")


def capped_dataset_size(reported: int, known: int | None, max_size: int) -> int:
    """A client's training-set size as its aggregation weight may use it: what it reports,
    at most the size the server knows for it (its split), else at most `max_size`
    (fsplug.aggregation.max_dataset_size; 0 = no cap)."""
    if known is not None:
        return min(int(reported), int(known))
    return min(int(reported), int(max_size)) if max_size > 0 else int(reported)


def weighted_average(states: Sequence[dict], weights: Sequence[float]) -> dict:
    """Per key: sum_k p_k x_k with p_k = w_k / sum w over the states holding that key.

    Keys present in only some states (heterogeneous clients) are averaged over those.
    Accumulates in float32 (float64 for float64 inputs) and returns the inputs' dtype, which
    must be one (the server checks every update's dtypes against its own model's). Inside
    `fs_plugins.aggregation.robust.robust_averaging` with 'median' or 'trimmed_mean', that
    unweighted coordinate-wise average replaces the weighted one.
    """
    if len(states) != len(weights):
        raise ValueError(f"{len(states)} states but {len(weights)} weights")
    average = active_average()
    keys = list(dict.fromkeys(k for state in states for k in state))
    out = {}
    for key in keys:
        holders = [i for i, state in enumerate(states) if key in state]
        tensors = [states[i][key] for i in holders]
        dtype = _common_dtype(key, tensors)
        if average.mode == 'weighted':
            out[key] = _weighted(tensors, [weights[i] for i in holders]).to(dtype)
        else:
            out[key] = robust_combination(tensors, average).to(dtype)
    return out


def _common_dtype(key: str, tensors: Sequence[torch.Tensor]) -> torch.dtype:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise ValueError(f"Cannot average '{key}': clients sent different shapes "
                         f"{sorted(shapes)} (clients on different models: set "
                         f"fsplug.aggregation.per_architecture: True)")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"Cannot average '{key}': clients sent different dtypes "
                         f"{sorted(str(d) for d in dtypes)}")
    return tensors[0].dtype


def _weighted(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    p = normalise_weights(weights)
    acc_dtype = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    acc = torch.zeros(tensors[0].shape, dtype=acc_dtype)
    for pk, t in zip(p, tensors):
        acc += float(pk) * t.detach().to('cpu', acc_dtype)
    return acc

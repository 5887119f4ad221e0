"""Splitting records into clients. Each splitter is a pure function of the records and a
seed, returning one list of record indices per client."""
from __future__ import annotations

import numpy as np

from fs_plugins.core.errors import ConfigError
from fs_plugins.core.registry import SPLITTERS

register_splitter = SPLITTERS.register


def split(name: str, records: list[dict], client_num: int, seed: int, **kwargs) -> list[list[int]]:
    return SPLITTERS.get(name)(records, client_num, seed, **kwargs)


def _labels(records: list[dict], field: str) -> list:
    missing = [i for i, r in enumerate(records) if field not in r]
    if missing:
        raise ConfigError(f"fsplug.data.split_field = '{field}' is missing from record "
                          f"{missing[0]} (and {len(missing) - 1} more)")
    return [str(r[field]) for r in records]


@register_splitter('iid')
def split_iid(records, client_num, seed, **_):
    order = np.random.default_rng(seed).permutation(len(records))
    return [sorted(part.tolist()) for part in np.array_split(order, client_num)]


@register_splitter('lda')  # FS's name for the same split
@register_splitter('dirichlet')
def split_dirichlet(records, client_num, seed, field='category', alpha=0.5, min_size=2,
                    max_tries=1000, **_):
    """Label-skewed split: for each label, client shares ~ Dirichlet(alpha * 1).

    Re-draws until every client holds at least `min_size` records."""
    labels = np.asarray(_labels(records, field))
    rng = np.random.default_rng(seed)
    classes = sorted(set(labels.tolist()))
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(client_num)]
        for cls in classes:
            idx = np.flatnonzero(labels == cls)
            rng.shuffle(idx)
            shares = rng.dirichlet(np.full(client_num, float(alpha)))
            cuts = (np.cumsum(shares) * len(idx)).astype(int)[:-1]
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [sorted(p) for p in parts]
    raise ConfigError(f"dirichlet split: no draw in {max_tries} tries gave every one of "
                      f"{client_num} clients >= {min_size} records (fsplug.data.min_client_size); "
                      f"lower it, raise fsplug.data.dirichlet_alpha or use fewer clients")


@register_splitter('by_source')
def split_by_source(records, client_num, seed, field='category', **_):
    """One client per distinct value of `field`, in sorted order of the values."""
    labels = _labels(records, field)
    values = sorted(set(labels))
    if client_num not in (0, len(values)):
        raise ConfigError(f"by_source split on '{field}' gives {len(values)} clients "
                          f"({', '.join(values)}) but federate.client_num = {client_num}; "
                          f"set it to {len(values)} or 0")
    return [[i for i, v in enumerate(labels) if v == value] for value in values]


def source_names(records: list[dict], field: str) -> list[str]:
    return sorted(set(_labels(records, field)))

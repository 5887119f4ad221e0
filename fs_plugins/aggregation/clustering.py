"""FedLEASE's expert allocation (Wang et al., NeurIPS 2025, Sec. 3.2): clients clustered by the
similarity of their LoRA B matrices, the number of clusters chosen by silhouette.

- `b_distances`: Eq. 2, d(i, j) = mean over adapted layers l of 1 − cos(vec B_i^l, vec B_j^l);
- `average_linkage` / `linkage_levels`: agglomerative clustering with average linkage on a
  precomputed distance matrix (the released code's `AgglomerativeClustering(linkage='average')`),
  every k from one pass of merges;
- `silhouette`: the mean silhouette coefficient of a labelling;
- `choose_clusters`: k = 2 .. min(max_clusters, N − 1), the k of the largest silhouette.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def b_distances(bs: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    """(N, N) float64 Eq. 2 distances between N clients, each given as {layer: B matrix}. Layers
    are those every client has; a zero B has cosine 0 with everything (distance 1)."""
    if len(bs) < 2:
        raise ValueError(f"Distances need at least 2 clients, got {len(bs)}")
    layers = sorted(set.intersection(*(set(b) for b in bs)))
    if not layers:
        raise ValueError('The clients share no LoRA B matrix to compare')
    n = len(bs)
    total = torch.zeros(n, n, dtype=torch.float64)
    for layer in layers:
        vectors = torch.stack([b[layer].detach().double().reshape(-1) for b in bs])
        # a zero vector stays zero (0 / tiny)
        units = vectors / vectors.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
        total += 1.0 - units @ units.T
    distances = total / len(layers)
    distances.fill_diagonal_(0.0)
    return distances.clamp_min(0.0)


def average_linkage(distances: torch.Tensor, k: int) -> list[int]:
    """Labels 0..k−1 of N points merged bottom-up, each step joining the two clusters of the
    smallest mean pairwise distance (ties: the pair listed first). Labels are numbered by each
    cluster's smallest member, so the result is deterministic."""
    return linkage_levels(distances, [k])[k]


def linkage_levels(distances: torch.Tensor, ks) -> dict[int, list[int]]:
    """{k: average_linkage labels} for every k in `ks`, from one pass of merges (each level's
    clusters are unions of the next finer level's). Cluster-to-cluster mean distances are kept
    in a matrix updated by the Lance–Williams rule for average linkage, d(a ∪ b, c) =
    (|a| d(a, c) + |b| d(b, c)) / (|a| + |b|)."""
    n = distances.shape[0]
    if any(not 1 <= k <= n for k in ks):
        raise ValueError(f"Cannot make {sorted(ks)} clusters of {n} points")
    link = distances.double().clone()
    link.fill_diagonal_(float('inf'))
    link = link.triu() + torch.full_like(link, float('inf')).tril()   # pairs (a, b), a < b
    members = {i: [i] for i in range(n)}
    levels = {n: _labels(members.values(), n)} if n in ks else {}
    while len(members) > min(ks):
        a, b = divmod(int(torch.argmin(link)), n)   # row-major: the first minimal pair
        na, nb = len(members[a]), len(members[b])
        merged = (na * torch.minimum(link[a], link[:, a]) + nb * torch.minimum(link[b], link[:, b])) / (na + nb)
        link[a, a + 1:], link[:a, a] = merged[a + 1:], merged[:a]
        link[b, :], link[:, b] = float('inf'), float('inf')
        members[a] = sorted(members[a] + members.pop(b))
        if len(members) in ks:
            levels[len(members)] = _labels(members.values(), n)
    return levels


def _labels(clusters, n: int) -> list[int]:
    labels = [0] * n
    for label, cluster in enumerate(sorted(clusters)):
        for i in cluster:
            labels[i] = label
    return labels


def silhouette(distances: torch.Tensor, labels: Sequence[int]) -> float:
    """Mean over points of (b − a) / max(a, b): a the mean distance to its own cluster's other
    points, b the smallest mean distance to another cluster; 0 for a point alone in its
    cluster (the usual convention)."""
    labels = list(labels)
    if len(set(labels)) < 2:
        raise ValueError('The silhouette needs at least 2 clusters')
    scores = []
    for i, own in enumerate(labels):
        mates = [j for j, lab in enumerate(labels) if lab == own and j != i]
        if not mates:
            scores.append(0.0)
            continue
        a = float(distances[i, mates].mean())
        b = min(float(distances[i, [j for j, lab in enumerate(labels) if lab == other]].mean())
                for other in set(labels) - {own})
        scores.append((b - a) / max(a, b) if max(a, b) > 0 else 0.0)
    return sum(scores) / len(scores)


def choose_clusters(distances: torch.Tensor, max_clusters: int) -> tuple[list[int], dict[int, float]]:
    """(labels of the best k, {k: silhouette}) over k = 2 .. min(max_clusters, N − 1); ties go
    to the smaller k."""
    n = distances.shape[0]
    top = min(max_clusters, n - 1)
    if top < 2:
        raise ValueError(f"Choosing between 2 and {max_clusters} clusters by silhouette needs at "
                         f"least 3 clients, got {n}")
    labelings = linkage_levels(distances, range(2, top + 1))
    scores = {k: silhouette(distances, labelings[k]) for k in sorted(labelings)}
    best = max(scores, key=lambda k: (scores[k], -k))
    return labelings[best], scores


def nearest_cluster(b: dict[str, torch.Tensor], centres: Sequence[dict[str, torch.Tensor]]) -> int:
    """The centre (by Eq. 2 distance) closest to a client's B matrices (ties: the first)."""
    distances = b_distances([b, *centres])[0, 1:]
    return int(torch.argmin(distances))

"""FedLEASE's expert allocation (Wang et al., NeurIPS 2025, Sec. 3.2): clients clustered by the
similarity of their LoRA B matrices, the number of clusters chosen by silhouette.

- `b_distances`: Eq. 2, d(i, j) = mean over adapted layers l of 1 − cos(vec B_i^l, vec B_j^l);
- `average_linkage`: agglomerative clustering with average linkage on a precomputed distance
  matrix (the released code's `AgglomerativeClustering(linkage='average')`);
- `silhouette`: the mean silhouette coefficient of a labelling;
- `choose_clusters`: k = 2 .. min(max_clusters, N − 1), the k of the largest silhouette.
"""
from __future__ import annotations

from typing import Sequence

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
        norms = vectors.norm(dim=1, keepdim=True)
        units = torch.where(norms > 0, vectors / norms.clamp_min(1e-300), torch.zeros_like(vectors))
        total += 1.0 - units @ units.T
    distances = total / len(layers)
    distances.fill_diagonal_(0.0)
    return distances.clamp_min(0.0)


def average_linkage(distances: torch.Tensor, k: int) -> list[int]:
    """Labels 0..k−1 of N points merged bottom-up, each step joining the two clusters of the
    smallest mean pairwise distance (ties: the pair listed first). Labels are numbered by each
    cluster's smallest member, so the result is deterministic."""
    n = distances.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"Cannot make {k} clusters of {n} points")
    clusters = [[i] for i in range(n)]
    while len(clusters) > k:
        best = None
        for a in range(len(clusters)):
            for b in range(a + 1, len(clusters)):
                link = float(distances[clusters[a]][:, clusters[b]].mean())
                if best is None or link < best[0]:
                    best = (link, a, b)
        _, a, b = best
        clusters[a] = sorted(clusters[a] + clusters.pop(b))
    labels = [0] * n
    for label, members in enumerate(sorted(clusters)):
        for i in members:
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
    scores, labelings = {}, {}
    for k in range(2, top + 1):
        labelings[k] = average_linkage(distances, k)
        scores[k] = silhouette(distances, labelings[k])
    best = max(scores, key=lambda k: (scores[k], -k))
    return labelings[best], scores


def nearest_cluster(b: dict[str, torch.Tensor], centres: Sequence[dict[str, torch.Tensor]]) -> int:
    """The centre (by Eq. 2 distance) closest to a client's B matrices (ties: the first)."""
    distances = b_distances([b, *centres])[0, 1:]
    return int(torch.argmin(distances))

"""FedAdapter's server arithmetic (Cai et al., "FedAdapter: Efficient Federated Learning for
Modern NLP", MobiCom 2022; the official code's trial_error.py): the trial configurations of adapter depth and width, the
clients' trial groups, the per-configuration average of the active slices (over the clients
that sent each tensor), and the switch to the configuration whose group did best.

A configuration is (depth, width): adapters on the top `depth` layers, each using its first
`width` units. From the current one the trials are the current, a wider (width + width_step,
at most max_width) and a deeper (depth + depth_step, at most the model's layers) configuration
(the official trial_error.py: width + 8, depth + 1); duplicates at the caps are dropped."""
from __future__ import annotations

import torch

Config = tuple[int, int]   # (depth, width)


def trial_configs(current: Config, num_layers: int, max_width: int, depth_step: int,
                  width_step: int) -> list[Config]:
    """[current, wider, deeper] without repeats (a capped step repeats the current)."""
    depth, width = current
    trials = [current, (depth, min(max_width, width + width_step)),
              (min(num_layers, depth + depth_step), width)]
    return list(dict.fromkeys(trials))


def trial_index(client_id: int, round_idx: int, count: int) -> int:
    """Which of `count` trial configurations client `client_id` trains in round `round_idx`:
    the groups rotate every round, so each configuration sees every client's data over an
    interval (ours: the paper allocates participant devices to trial groups)."""
    return (client_id + round_idx) % count


def top_layers(layers, depth: int) -> set[int]:
    """The `depth` highest of the layer indices `layers` (all of them when depth exceeds them)."""
    ordered = sorted(set(layers))
    return set(ordered[max(0, len(ordered) - depth):]) if depth > 0 else set()


def width_mask(shape: tuple[int, ...], width_axis: int | None, width: int) -> torch.Tensor:
    """bool mask of a tensor of `shape`: True on the first `width` indices along `width_axis`
    (everything when width_axis is None)."""
    mask = torch.zeros(shape, dtype=torch.bool)
    if width_axis is None:
        mask[...] = True
    else:
        mask.narrow(width_axis, 0, min(width, shape[width_axis])).fill_(True)
    return mask


def masked_average(previous: dict[str, torch.Tensor], uploads: list[dict[str, torch.Tensor]],
                   weights: list[float], masks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """For each tensor of `masks`: the weighted average, over the uploads that hold it, where
    the mask is True; the previous value elsewhere, and wherever no upload holds it (clients
    send their configuration's layers only; its inactive units stay as they were)."""
    merged = {}
    for name, mask in masks.items():
        senders = [(u[name], w) for u, w in zip(uploads, weights) if name in u]
        if not senders:
            merged[name] = previous[name]
            continue
        total = float(sum(w for _, w in senders))
        average = sum(t.float() * (w / total) for t, w in senders)
        merged[name] = torch.where(mask, average, previous[name].float()).to(previous[name].dtype)
    return merged


def best_config(trials: list[Config], losses: dict[Config, float]) -> Config:
    """The trial configuration with the lowest loss of its group; ties go to the earlier trial
    (the current, then the wider, then the deeper one, as the official code's comparison
    order); trials without a loss are skipped, and the current one stays when none has one."""
    scored = [(losses[c], i, c) for i, c in enumerate(trials) if c in losses]
    return min(scored)[2] if scored else trials[0]

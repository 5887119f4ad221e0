"""NbAFL, "noising before model aggregation" (Wei et al., "Federated Learning with Differential
Privacy: Algorithms and Performance Analysis", IEEE TIFS 2020, Algorithm 1), with FS's
`nbafl.*` keys: C = nbafl.w_clip, c = nbafl.constant, ε = nbafl.epsilon, T =
federate.total_round_num, N = federate.client_num.

- Client (uplink): what it uploads, w, is clipped to norm C, w ← w / max(1, ‖w‖/C), the norm
  taken over all the uploaded tensors together, then gets noise N(0, σ_U² I) with
  σ_U = c·L·ΔS_U/ε, ΔS_U = 2C/m (Theorem 1), L = T (a client's uploads over the run, as
  many as the rounds when it takes part in every one), m = the client's training records.
- Server (downlink): the content of a training round gets noise N(0, σ_D² I) with
  σ_D = 2cC·sqrt(T² − L²N)/(m·N·ε) when T > L·sqrt(N), else none (Theorem 2); L = clients
  per round, m = the smallest training set among the clients heard from. The first round's
  content (the initial state, built from no client's data) is sent as it is: Algorithm 1
  noises the broadcast of an aggregate.

Where FS's implementation (federatedscope/core/trainers/trainer_nbafl.py) differs:
- FS's σ_U is C·T·c/(m·ε), without the sensitivity's factor 2, and FS clips no upload;
- FS noises every parameter of ctx.model (with an LLM: the frozen base), after the plugin has
  taken the upload; here exactly the uploaded tensors are noised, never a model;
- FS's server clips the global model element-wise (w / max(1, |w|/C) per entry), in place, at
  every broadcast; here the server clips nothing (the paper does not) and noises a copy;
- FS's server m is the smallest `num_sample` clients report on joining (none unless
  federate.join_in_info asks for it, and then FS adds no noise at all).
Like FS (and FedML), L of Theorem 2 is read as the clients per round.

Only floating-point tensors are clipped and noised; integer tensors in a payload are protocol
values (cluster ids, budget levels, counters), not parameters. The noise is drawn from
generators seeded by the run seed (fs_plugins.core.seeding), so the same YAML and seed give the
same numbers in both runners.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fs_plugins.core.seeding import derive_seed


@dataclass(frozen=True)
class NbaflSettings:
    clip: float         # C
    constant: float     # c
    epsilon: float      # ε
    rounds: int         # T
    clients: int        # N
    per_round: int      # L of the downlink: clients per round


def nbafl_settings(cfg) -> NbaflSettings | None:
    """The run's NbAFL settings; None when nbafl.use is off."""
    if not bool(cfg.nbafl.use):
        return None
    clients = int(cfg.federate.client_num)
    sampled = int(cfg.federate.sample_client_num)
    per_round = sampled if 0 < sampled < clients else clients
    return NbaflSettings(float(cfg.nbafl.w_clip), float(cfg.nbafl.constant),
                         float(cfg.nbafl.epsilon), int(cfg.federate.total_round_num),
                         clients, per_round)


def upload_sigma(s: NbaflSettings, dataset_size: int) -> float:
    """σ_U = c·T·ΔS_U/ε with ΔS_U = 2C/m (m: the client's training records)."""
    sensitivity = 2.0 * s.clip / dataset_size
    return s.constant * s.rounds * sensitivity / s.epsilon


def broadcast_sigma(s: NbaflSettings, min_dataset_size: int) -> float:
    """σ_D = 2cC·sqrt(T² − L²N)/(m·N·ε) when T > L·sqrt(N), else 0."""
    if s.rounds <= s.per_round * math.sqrt(s.clients):
        return 0.0
    spread = math.sqrt(s.rounds ** 2 - s.per_round ** 2 * s.clients)
    return 2.0 * s.constant * s.clip * spread / (min_dataset_size * s.clients * s.epsilon)


def _floating(tensors: dict) -> list[str]:
    return sorted(n for n, t in tensors.items()
                  if isinstance(t, torch.Tensor) and t.is_floating_point())


def joint_norm(tensors: dict) -> float:
    """The L2 norm of all floating-point tensors of `tensors` as one vector."""
    return math.sqrt(sum(float(tensors[n].double().pow(2).sum()) for n in _floating(tensors)))


def clip_to_norm(tensors: dict, clip: float) -> dict:
    """w / max(1, ‖w‖/C) over the floating-point tensors together (new tensors; the others
    as they are)."""
    scale = max(1.0, joint_norm(tensors) / clip)
    floating = set(_floating(tensors))
    return {n: t / scale if n in floating else t for n, t in tensors.items()}


def add_gaussian_noise(tensors: dict, sigma: float, seed_of) -> dict:
    """Each floating-point tensor plus N(0, σ² I) noise, drawn on the CPU from a generator
    seeded by `seed_of(name)` (new tensors; the others as they are)."""
    if sigma <= 0:
        return dict(tensors)
    noised = dict(tensors)
    for name in _floating(tensors):
        tensor = tensors[name]
        generator = torch.Generator().manual_seed(seed_of(name))
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * sigma
        noised[name] = (tensor.float() + noise.to(tensor.device)).to(tensor.dtype)
    return noised


def private_upload(shared: dict, s: NbaflSettings, dataset_size: int, seed: int,
                   client_id: int, round_idx: int) -> dict:
    """A client's upload under NbAFL: clipped to norm C, then N(0, σ_U² I) noise."""
    clipped = clip_to_norm(shared, s.clip)
    return add_gaussian_noise(clipped, upload_sigma(s, dataset_size),
                              lambda name: derive_seed(seed, 'nbafl_upload', client_id,
                                                       round_idx, name))


def private_broadcast(content: dict, s: NbaflSettings, min_dataset_size: int, seed: int,
                      round_idx: int) -> dict:
    """A training round's content under NbAFL: plus N(0, σ_D² I) noise. The noise of a
    tensor depends on the round and its name only: clients sent the same tensor in a round get
    it with the same noise, as one broadcast (averaging several copies would undo it)."""
    return add_gaussian_noise(content, broadcast_sigma(s, min_dataset_size),
                              lambda name: derive_seed(seed, 'nbafl_broadcast', round_idx, name))

"""TAKFL's maths (Morafah et al., NeurIPS 2024, "Towards Diverse Device Heterogeneous Federated
Learning via Task Arithmetic Knowledge Integration"), as pure functions: clients grouped by
device prototype, the distillation loss with TAKFL's self-regularisation, the task vectors of
the per-teacher distillations, their merge by task arithmetic, and the candidate merging
coefficients of the released code's heuristic search. fs_plugins/methods/takfl.py runs them on
the server. The teacher ensemble is aggregation.distill.ensemble_logits, the KL terms are
aggregation.fedmkt.selective_kd_loss with every row kept."""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import torch

from fs_plugins.aggregation.fedmkt import selective_kd_loss


def group_by_prototype(prototypes: Mapping[int, Hashable]) -> dict[Hashable, list[int]]:
    """{prototype: its clients, in the order given} from {client: prototype}."""
    groups: dict[Hashable, list[int]] = {}
    for client, prototype in prototypes.items():
        groups.setdefault(prototype, []).append(client)
    return groups


def takfl_distillation_loss(student_logits: torch.Tensor, teacher_probs: torch.Tensor,
                            self_probs: torch.Tensor, temperature: float,
                            self_temperature: float, self_weight: float) -> torch.Tensor:
    """T²·KL(q_teacher ‖ softmax(s/T)) + γ·T_s²·KL(q_self ‖ softmax(s/T_s)), batch means:
    the distillation from one teacher prototype plus TAKFL's self-regularisation towards the
    student prototype's own averaged model (§4.2; q_self = softmax(z_avg/T_s)). Rows are public
    samples; both distributions are on the student's vocabulary."""
    every_row = torch.ones(student_logits.shape[0], dtype=torch.bool, device=student_logits.device)
    distillation = selective_kd_loss(student_logits, teacher_probs, every_row, temperature)
    regulariser = selective_kd_loss(student_logits, self_probs, every_row, self_temperature)
    return temperature ** 2 * distillation + self_weight * self_temperature ** 2 * regulariser


def task_vectors(distilled: Sequence[dict], base: dict) -> list[dict]:
    """τ_j = θ_j − θ_avg for each model distilled from teacher j, in float32, over the names
    of `base`."""
    vectors = []
    for index, state in enumerate(distilled):
        missing = set(base) - set(state)
        if missing:
            raise ValueError(f'task_vectors: distilled model {index} lacks {sorted(missing)[:3]}')
        vectors.append({name: state[name].float() - value.float() for name, value in base.items()})
    return vectors


def merge_task_vectors(base: dict, vectors: Sequence[dict], coefficients: Sequence[float]) -> dict:
    """θ_avg + Σ_j λ_j τ_j (task arithmetic), each tensor in `base`'s dtype."""
    if len(vectors) != len(coefficients):
        raise ValueError(f'merge_task_vectors: {len(vectors)} task vectors but '
                         f'{len(coefficients)} coefficients')
    merged = {}
    for name, value in base.items():
        total = value.float().clone()
        for vector, coefficient in zip(vectors, coefficients):
            total += float(coefficient) * vector[name]
        merged[name] = total.to(value.dtype)
    return merged


def candidate_coefficients(num_teachers: int, draws: int, rng: np.random.Generator) -> list[list[float]]:
    """The merging coefficients the released TAKFL code's heuristic tries: the uniform 1/J,
    then for each exponent e in (1, 5, 10) `draws` vectors of Beta(1, 100)^e draws, sorted
    ascending (teachers ordered from the smallest prototype up, so larger prototypes get
    larger coefficients) and normalised to sum to 1."""
    if num_teachers < 1:
        raise ValueError('candidate_coefficients: no teacher')
    candidates = [[1.0 / num_teachers] * num_teachers]
    for exponent in (1, 5, 10):
        for _ in range(draws):
            values = np.sort(rng.beta(1.0, 100.0, size=num_teachers) ** exponent)
            candidates.append((values / values.sum()).tolist())
    return candidates

"""FedMKT's maths (Fan et al., COLING 2025), as pure functions: minimum-edit-distance token
alignment between two vocabularies, the teacher distribution carried over to the student's
vocabulary, the selective (dual minimum cross-entropy) choice of teachers, and the selective
distillation loss. fs_plugins/methods/fedmkt.py runs them on the server."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# byte-level BPE ('Ġ') and SentencePiece ('▁') mark a leading space differently
SPACE_MARKERS = ('Ġ', '▁')


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions, each costing 1)."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def canonical_token(token: str) -> str:
    """The token with every tokenizer's space marker written as a space."""
    for marker in SPACE_MARKERS:
        token = token.replace(marker, ' ')
    return token


def min_edit_distance_alignment(source: Sequence[str], target: Sequence[str]) -> torch.Tensor:
    """For each source token (by id), the id of the target token at the minimum edit distance
    (FedMKT's MinED alignment, after FuseLLM): the same spelling when the target has it, else
    the closest one, ties to the lowest target id. Space markers count as the same character."""
    if not target:
        raise ValueError('min_edit_distance_alignment: the target vocabulary is empty')
    canonical_target = [canonical_token(t) for t in target]
    exact: dict[str, int] = {}
    for index, token in enumerate(canonical_target):
        exact.setdefault(token, index)
    mapping = []
    for token in map(canonical_token, source):
        if token in exact:
            mapping.append(exact[token])
        else:
            distances = [edit_distance(token, t) for t in canonical_target]
            mapping.append(distances.index(min(distances)))
    return torch.tensor(mapping, dtype=torch.long)


def align_probabilities(probs: torch.Tensor, mapping: torch.Tensor, target_size: int) -> torch.Tensor:
    """(rows, source vocab) probabilities carried over to the target vocabulary: each source
    token's mass goes to the target token `mapping` names (q_j = Σ_{i: map(i)=j} p_i)."""
    if probs.shape[-1] != mapping.shape[0]:
        raise ValueError(f'align_probabilities: {probs.shape[-1]} source tokens but a mapping '
                         f'of {mapping.shape[0]}')
    out = probs.new_zeros(*probs.shape[:-1], target_size)
    return out.index_add_(-1, mapping.to(probs.device), probs)


def answer_losses(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """(rows,) each sample's mean next-token cross-entropy over its answer tokens (labels
    other than `ignore_index`, after the causal shift)."""
    shifted, targets = logits[:, :-1].float(), labels[:, 1:]
    token_losses = F.cross_entropy(shifted.transpose(1, 2), targets, ignore_index=ignore_index,
                                   reduction='none')
    counts = (targets != ignore_index).sum(1)
    if bool((counts == 0).any()):
        raise ValueError('answer_losses: a sample has no answer token')
    return token_losses.sum(1) / counts


def prompt_end_rows(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """(rows, vocab) the logits at each sample's last prompt token (the position that predicts
    the first answer token)."""
    first_answer = (labels != ignore_index).float().argmax(1)
    return logits[torch.arange(logits.shape[0], device=logits.device), first_answer - 1]


def select_teachers(teacher_losses: torch.Tensor, student_losses: torch.Tensor):
    """FedMKT's selective knowledge transfer (dual minimum cross-entropy): for each sample the
    teacher with the lowest loss, kept only where that loss is below the student's.
    teacher_losses (teachers, rows), student_losses (rows,) -> (teacher index (rows,),
    keep mask (rows,))."""
    if teacher_losses.dim() != 2 or teacher_losses.shape[1] != student_losses.shape[0]:
        raise ValueError(f'select_teachers: teacher losses {tuple(teacher_losses.shape)} vs '
                         f'student losses {tuple(student_losses.shape)}')
    best, index = teacher_losses.min(0)
    return index, best < student_losses


def selective_kd_loss(student_logits: torch.Tensor, teacher_probs: torch.Tensor,
                      keep: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Σ_{rows kept} KL(q ‖ softmax(s/T)) / rows: the rows not kept contribute 0 (and the
    loss is 0 when none is kept). q: teacher probabilities on the student's vocabulary."""
    if student_logits.shape != teacher_probs.shape:
        raise ValueError(f'selective_kd_loss: student logits {tuple(student_logits.shape)} vs '
                         f'teacher {tuple(teacher_probs.shape)}')
    log_student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    row_kl = (torch.xlogy(teacher_probs, teacher_probs) - teacher_probs * log_student).sum(-1)
    return (row_kl * keep.to(row_kl.dtype)).sum() / student_logits.shape[0]

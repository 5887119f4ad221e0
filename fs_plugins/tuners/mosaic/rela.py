"""RELA's client side (paper §4.1, Eqs. 1-3, Algorithm 1): every f local steps, the gradient
of the loss on the current batch with respect to the output layer (the "last layer", the LM
head) of a small frozen pre-trained model W_s; each gradient is subsampled with the mask M
all clients share and noised (Eq. 3); the round's sanitised gradients are averaged and
folded into the client's EMA ĝ (Eq. 2), which is what the client uploads.

The output layer's gradient is computed in closed form from its input h and its logits z on
the answer tokens (the positions whose next token has a label): ∂ℓ/∂W = (softmax(z) − y)ᵀ h / n,
the gradient of the mean cross-entropy the training loss uses. This needs no backward pass
and is exact for tied and untied heads alike (for a tied head it is the head's share of the
gradient only, which is what "last layer" means).
"""
from __future__ import annotations

import torch

from fs_plugins.aggregation.mosaic import ema_update, sanitise_gradient, shared_mask
from fs_plugins.data.instruction import IGNORE_INDEX


def output_layer(model: torch.nn.Module) -> torch.nn.Module:
    head = model.get_output_embeddings()
    if head is None or getattr(head, 'bias', None) is not None:
        raise ValueError(f'FedMosaic RELA needs a bias-free output layer (LM head) on W_s; '
                         f'{type(model).__name__} has {head!r}')
    return head


@torch.no_grad()
def labelled_tokens(batch: dict) -> int:
    """The positions whose next token has a label (what output_layer_gradient averages)."""
    return int((batch['labels'][:, 1:] != IGNORE_INDEX).sum())


def output_layer_gradient(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """∂ mean-CE / ∂ W_head of a frozen causal (vision-)language model on one batch, flattened
    (vocab · hidden,) float32; zeros when the batch has no labelled token."""
    head = output_layer(model)
    seen = {}
    handle = head.register_forward_hook(
        lambda _m, args, out: seen.update(h=args[0].detach(), z=out.detach()))
    try:
        model(**{k: v for k, v in batch.items() if k != 'labels'})
    finally:
        handle.remove()
    labels = batch['labels'][:, 1:]
    keep = labels != IGNORE_INDEX
    hidden = seen['h'][:, :-1][keep].float()
    logits = seen['z'][:, :-1][keep].float()
    if not hidden.shape[0]:
        return torch.zeros(head.weight.numel())
    probs = torch.softmax(logits, dim=-1)
    probs[torch.arange(probs.shape[0]), labels[keep]] -= 1.0
    return (probs.T @ hidden / hidden.shape[0]).flatten()


def step_gradient(parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The mean gradient over all the tokens of a step's micro-batches (one part: as it is)."""
    if len(parts) == 1:
        return parts[0][0]
    total = sum(tokens for _, tokens in parts)
    if not total:
        return parts[0][0]
    return sum(gradient * (tokens / total) for gradient, tokens in parts)


class RelaGradients:
    """One client's RELA state: the shared mask, the round's sanitised gradients, the EMA.

    A due step's gradient is recorded per micro-batch (`record`, with its labelled tokens) and
    sanitised once at the step's end: with gradient accumulation it is the gradient of the
    step's whole batch, and the every-f count is in optimiser steps."""

    def __init__(self, every: int, keep_fraction: float, noise_std: float, ema_ratio: float,
                 mask_seed: int, noise_seed: int):
        self.every, self.keep_fraction = every, keep_fraction
        self.noise_std, self.ema_ratio, self.mask_seed = noise_std, ema_ratio, mask_seed
        self.generator = torch.Generator().manual_seed(noise_seed)
        self.mask: torch.Tensor | None = None
        self.round: list[torch.Tensor] = []
        self.ema: torch.Tensor | None = None
        self.steps = 0
        self.step_parts: list[tuple[torch.Tensor, int]] = []   # (gradient, tokens) this step

    def due(self) -> bool:
        """Whether this step's batch feeds RELA (steps 0, f, 2f, ... of the client's run)."""
        return self.steps % self.every == 0

    def record(self, gradient: torch.Tensor, tokens: int = 1) -> None:
        """One micro-batch's mean gradient over its `tokens` labelled tokens."""
        self.step_parts.append((gradient.to('cpu', torch.float32), int(tokens)))

    def end_step(self) -> None:
        if self.step_parts:
            self._sanitise(step_gradient(self.step_parts))
            self.step_parts = []
        self.steps += 1

    def _sanitise(self, gradient: torch.Tensor) -> None:
        if self.mask is None:
            self.mask = shared_mask(gradient.numel(), self.keep_fraction, self.mask_seed)
        self.round.append(sanitise_gradient(gradient, self.mask, self.noise_std, self.generator))

    def state_dict(self) -> dict:
        """Everything that changes during the run (checkpoints); the options come from config."""
        return {'generator': self.generator.get_state(), 'mask': self.mask, 'round': self.round,
                'ema': self.ema, 'steps': self.steps, 'step_parts': self.step_parts}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state['generator'])
        self.mask, self.round, self.ema = state['mask'], list(state['round']), state['ema']
        self.steps = int(state['steps'])
        self.step_parts = [(gradient, int(tokens)) for gradient, tokens in state['step_parts']]

    def end_round(self) -> torch.Tensor | None:
        """ĝ ← (1 − a)·ĝ + a·mean(this round's g̃) (Algorithm 1); the EMA, or None before any
        gradient was taken."""
        if self.step_parts:   # a step still open (its end_step not called)
            self._sanitise(step_gradient(self.step_parts))
            self.step_parts = []
        if self.round:
            self.ema = ema_update(self.ema, torch.stack(self.round).mean(dim=0), self.ema_ratio)
            self.round = []
        return self.ema

"""RELA's client side (paper §4.1, Eqs. 1-3, Algorithm 1): every f local steps, the gradient
of the mean cross-entropy on the current batch with respect to one "last layer" weight of a
small frozen pre-trained model W_s; the client's gradients are folded into an EMA ĝ (Eq. 2)
and subsampled with the mask M all clients share and noised (Eq. 3) into what it uploads.

Which weight (`gradient_layer`):
- 'last_down_proj' (default): the MLP down projection of W_s's last decoder layer
  (`layers[-1].mlp.down_proj.weight`, hidden × intermediate), as the authors' code hooks it;
  its size is what A.9's 8.6 % (3.4 % at N_s = 40 %) of a client's LoRA upload measures
  (docs/fedmosaic.md). Computed with a backward pass of the batch's mean CE through W_s with
  only that weight requiring grad (torch.autograd.grad: no .grad is left on W_s, and autograd
  records only the final norm and the head after it).
- 'lm_head': the output layer (vocab × hidden), in closed form from its input h and its logits
  z on the answer tokens: ∂ℓ/∂W = (softmax(z) − y)ᵀ h / n. Exact for tied and untied heads
  (for a tied head it is the head's share of the gradient only).

From which model (`rela_model`):
- 'small' (default, §4.1): the frozen pre-trained W_s above; `small_quantization` runs it with
  k-bit weights (A.20, Table 31): every linear layer but the output layer quantised and
  dequantised as bitsandbytes stores it (`quantise_linear_weights`).
- 'training' (Table 30 'Training model gradients'): the client's own training model, on the
  current batch, through the backward pass the step takes anyway: the gradients of the local
  P, Q of its last block's PQ-LoRA layers (`last_block_pq_gradient`). Its last block ends at
  the last decoder layer (I_{N_B} = L), and P, Q are the only weights of that layer whose
  gradients have the same size and meaning on every model type (aligned A, B), which the
  cosine of Eq. 4 needs across heterogeneous clients.

In which order (`sanitise_order`):
- 'equations' (default; Eqs. 2-3 and Fig. 2: "EMA updated to ĝ and then compressed to g̃"):
  every gradient g(t) updates the full-size ĝ(t) = (1 − a)·ĝ(t−1) + a·g(t); at the round's end
  the client sends g̃ = M ⊙ (ĝ + μ·ε) (the kept coordinates, fresh noise each upload).
- 'algorithm' (Algorithm 1 and the authors' code): each gradient is subsampled and noised
  at once, the round's sanitised gradients are averaged, and ĝ ← (1 − a)·ĝ + a·mean; ĝ (kept
  coordinates only) is sent.
"""
from __future__ import annotations

import re

import torch

from fs_plugins.aggregation.mosaic import ema_update, fake_quantise, sanitise_gradient, shared_mask
from fs_plugins.data.instruction import IGNORE_INDEX
from fs_plugins.tuners.mosaic.layer import GATE_ATTR, MOSAIC_ATTR

GRADIENT_LAYERS = ('last_down_proj', 'lm_head')
SANITISE_ORDERS = ('equations', 'algorithm')
_DOWN_PROJ = re.compile(r'(?:^|\.)layers\.(\d+)\.mlp\.down_proj$')


def output_layer(model: torch.nn.Module) -> torch.nn.Module:
    head = model.get_output_embeddings()
    if head is None or getattr(head, 'bias', None) is not None:
        raise ValueError(f'FedMosaic RELA needs a bias-free output layer (LM head) on W_s; '
                         f'{type(model).__name__} has {head!r}')
    return head


def last_down_proj(model: torch.nn.Module) -> torch.nn.Module:
    """The MLP down projection of the language model's last decoder layer (a vision tower's
    layers left out)."""
    found = {}
    for name, module in model.named_modules():
        match = _DOWN_PROJ.search(name)
        if match and 'vision' not in name and isinstance(getattr(module, 'weight', None),
                                                          torch.Tensor):
            found[int(match.group(1))] = module
    if not found:
        raise ValueError(f'FedMosaic RELA (gradient_layer = last_down_proj): W_s '
                         f'({type(model).__name__}) has no layers.<i>.mlp.down_proj; use '
                         f"gradient_layer: 'lm_head'")
    return found[max(found)]


def gradient_weight(model: torch.nn.Module, gradient_layer: str) -> torch.Tensor:
    """The weight of W_s whose gradient RELA takes."""
    if gradient_layer == 'lm_head':
        return output_layer(model).weight
    if gradient_layer == 'last_down_proj':
        return last_down_proj(model).weight
    raise ValueError(f'gradient_layer must be one of {GRADIENT_LAYERS}, got {gradient_layer!r}')


@torch.no_grad()
def quantise_linear_weights(model: torch.nn.Module, mode: str) -> int:
    """Replaces, in place, the weight of every nn.Linear of frozen `model` but its output layer
    by its k-bit quantised-and-dequantised copy (`aggregation.mosaic.fake_quantise`), the
    modules bitsandbytes converts under transformers' defaults; returns how many ('none': 0)."""
    if mode == 'none':
        return 0
    head = model.get_output_embeddings()
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            module.weight.copy_(fake_quantise(module.weight, mode))
            count += 1
    return count


def last_block_pq_layers(pq_layers: dict[str, str]) -> list[str]:
    """The module names of the PQ-LoRA layers of the last block (the highest 'block<k>.'),
    ordered by their architecture-independent pq key, so every model type orders them alike."""
    if not pq_layers:
        raise ValueError('rela_model = training needs PQ-LoRA layers (fsplug.fedmosaic.pq_lora)')
    block = max(int(key.split('.', 1)[0][len('block'):]) for key in pq_layers.values())
    last = {key: name for name, key in pq_layers.items() if key.startswith(f'block{block}.')}
    return [last[key] for key in sorted(last)]


def last_block_pq_gradient(model: torch.nn.Module, pq_layers: dict[str, str]) -> torch.Tensor:
    """The current gradients (.grad, after backward) of the local P, Q of the last block's
    PQ-LoRA layers, flattened and concatenated (P then Q per layer) in float32; a tensor
    without a gradient counts as zeros."""
    modules = dict(model.named_modules())
    parts = []
    for name in last_block_pq_layers(pq_layers):
        state = getattr(modules[name], MOSAIC_ATTR)
        for param in (state.P, state.Q):
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            parts.append(grad.detach().to('cpu', torch.float32).flatten())
    return torch.cat(parts)


@torch.no_grad()
def labelled_tokens(batch: dict) -> int:
    """The positions whose next token has a label (what the gradients average over)."""
    return int((batch['labels'][:, 1:] != IGNORE_INDEX).sum())


def rela_gradient(model: torch.nn.Module, batch: dict, gradient_layer: str) -> torch.Tensor:
    """∂ mean-CE / ∂ W of the chosen layer of frozen W_s on one batch, flattened float32."""
    if gradient_layer == 'lm_head':
        return output_layer_gradient(model, batch)
    return weight_gradient(model, batch, gradient_weight(model, gradient_layer))


def is_adapter_parameter(name: str) -> bool:
    """Whether a trainable parameter belongs to an adapter (peft's LoRA, FedMosaic's P, Q and
    gates, peft's modules_to_save copies): switched off, the model is its frozen base."""
    return any(part in name for part in ('lora_', f'.{MOSAIC_ATTR}.', GATE_ATTR,
                                         'modules_to_save'))


def frozen_base_gradient(model: torch.nn.Module, batch: dict, gradient_layer: str) -> torch.Tensor:
    """rela_gradient of the pre-trained model under a peft `model`'s adapters: the same model
    with its adapters off (peft's disable_adapter) and in eval mode, as W_s's own copy runs;
    W_s then needs no second copy of the base's weights."""
    was_training = model.training
    # peft's disable_adapter re-activates the adapter on exit, switching requires_grad on for
    # every LoRA factor, PQ-LoRA's frozen A and B too: the flags are put back as they were
    flags = {name: param.requires_grad for name, param in model.named_parameters()}
    model.eval()
    try:
        with model.disable_adapter():
            return rela_gradient(model, batch, gradient_layer)
    finally:
        model.train(was_training)
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])


def weight_gradient(model: torch.nn.Module, batch: dict, weight: torch.Tensor) -> torch.Tensor:
    """∂ mean-CE / ∂ `weight` (a parameter of frozen `model`) on one batch by autograd,
    flattened (numel,) float32; zeros when the batch has no labelled token. Only `weight`
    requires grad during the pass, and its flag is restored; no .grad is written."""
    if not labelled_tokens(batch):
        return torch.zeros(weight.numel())
    flag = weight.requires_grad
    try:
        with torch.enable_grad():
            weight.requires_grad_(True)
            loss = model(**batch).loss
            gradient, = torch.autograd.grad(loss, [weight])
    finally:
        weight.requires_grad_(flag)
    return gradient.detach().float().flatten()


def output_layer_gradient(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """∂ mean-CE / ∂ W_head of a frozen causal (vision-)language model on one batch, flattened
    (vocab · hidden,) float32; zeros when the batch has no labelled token."""
    head = output_layer(model)
    seen = {}
    handle = head.register_forward_hook(
        lambda _m, args, out: seen.update(h=args[0].detach(), z=out.detach()))
    try:
        with torch.no_grad():
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
    """One client's RELA state: the shared mask, the EMA ĝ and, in 'algorithm' order, the
    round's sanitised gradients.

    A due step's gradient is recorded per micro-batch (`record`, with its labelled tokens) and
    used once at the step's end: with gradient accumulation it is the gradient of the step's
    whole batch, and the every-f count is in optimiser steps."""

    def __init__(self, every: int, keep_fraction: float, noise_std: float, ema_ratio: float,
                 mask_seed: int, noise_seed: int, order: str = 'equations'):
        if order not in SANITISE_ORDERS:
            raise ValueError(f'order must be one of {SANITISE_ORDERS}, got {order!r}')
        self.every, self.keep_fraction, self.order = every, keep_fraction, order
        self.noise_std, self.ema_ratio, self.mask_seed = noise_std, ema_ratio, mask_seed
        self.generator = torch.Generator().manual_seed(noise_seed)
        self.mask: torch.Tensor | None = None
        # 'algorithm': the sum and count of this round's sanitised gradients (a running sum: one
        # kept-size vector whatever the round's length)
        self.round_sum: torch.Tensor | None = None
        self.round_count = 0
        # 'equations': the full-size EMA of raw gradients; 'algorithm': the EMA of the round
        # means of sanitised gradients (kept coordinates)
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
        self._close_step()
        self.steps += 1

    def _close_step(self) -> None:
        if self.step_parts:
            self._take(step_gradient(self.step_parts))
            self.step_parts = []

    def _take(self, gradient: torch.Tensor) -> None:
        if self.mask is None:
            self.mask = shared_mask(gradient.numel(), self.keep_fraction, self.mask_seed)
        if self.order == 'equations':
            self.ema = ema_update(self.ema, gradient, self.ema_ratio)        # Eq. 2
        else:
            sanitised = sanitise_gradient(gradient, self.mask, self.noise_std, self.generator)
            self.round_sum = sanitised if self.round_sum is None else self.round_sum + sanitised
            self.round_count += 1

    def state_dict(self) -> dict:
        """Everything that changes during the run (checkpoints); the options come from config."""
        return {'generator': self.generator.get_state(), 'mask': self.mask,
                'round_sum': self.round_sum, 'round_count': self.round_count,
                'ema': self.ema, 'steps': self.steps, 'step_parts': self.step_parts}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state['generator'])
        self.mask, self.ema = state['mask'], state['ema']
        if 'round' in state:   # a checkpoint that kept the round's gradients as a list
            gradients = list(state['round'])
            self.round_sum = torch.stack(gradients).sum(dim=0) if gradients else None
            self.round_count = len(gradients)
        else:
            self.round_sum, self.round_count = state['round_sum'], int(state['round_count'])
        self.steps = int(state['steps'])
        self.step_parts = [(gradient, int(tokens)) for gradient, tokens in state['step_parts']]

    def end_round(self) -> torch.Tensor | None:
        """What the client uploads, or None before any gradient was taken.
        'equations': g̃ = M ⊙ (ĝ + μ·ε) of the EMA of every gradient so far (Eq. 3);
        'algorithm': ĝ ← (1 − a)·ĝ + a·mean(this round's g̃), sent as it is (Algorithm 1)."""
        self._close_step()     # a step still open (its end_step not called)
        if self.order == 'equations':
            if self.ema is None:
                return None
            return sanitise_gradient(self.ema, self.mask, self.noise_std, self.generator)
        if self.round_count:
            self.ema = ema_update(self.ema, self.round_sum / self.round_count, self.ema_ratio)
            self.round_sum, self.round_count = None, 0
        return self.ema


def rela_state_bytes(order: str, numel: int, kept: int) -> int:
    """Bytes a client's RelaGradients holds at most for a W_s weight of `numel` entries, `kept`
    of them sent: the shared mask (bool), one step's gradient (float32, full size) and the EMA
    (float32: full size in 'equations' order; kept size in 'algorithm' order, beside the
    round's running sum)."""
    ema = 4 * (numel if order == 'equations' else 2 * kept)
    return numel + 4 * numel + ema

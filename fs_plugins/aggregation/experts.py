"""Fused MoE expert LoRA factors by parameter name: which keys are expert factors, and
converting between one fused factor and one LoRA pair per expert (pure functions).

A fused factor (peft `target_parameters` on a 3-D expert parameter, E experts, rank r): lora_A
is (E·r, d_in) with expert e's rows at [e·r, (e+1)·r) — i.e. reshape(E, r, d_in) — and lora_B
is (d_out, E·r) with expert e's columns at e, e+E, e+2E, … — i.e. reshape(d_out, r, E).
`split_experts` / `merge_experts` convert between that layout and a per-expert stack. `unfuse` gives each expert its own
virtual key '….experts.expert<e>.lora_A.…', so mixed-rank methods (HetLoRA, FlexLoRA) act on
each expert's own factors; `fuse` is its inverse.
"""
from __future__ import annotations

import re

import torch

from fs_plugins.aggregation.pairs import A_TAG, B_TAG, fit_rank, is_lora_a, is_lora_factor

EXPERTS_TAG = '.experts.'
_VIRTUAL_EXPERT = re.compile(r'\.expert(\d+)(\.lora_[AB]\.)')


def split_experts(key: str, tensor: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Fused factor -> per-expert stack: A (E·r, d_in) -> (E, r, d_in); B (d_out, E·r) -> (E, d_out, r)."""
    if tensor.dim() != 2:
        raise ValueError(f"'{key}': a fused expert LoRA factor must be 2-D, got {tuple(tensor.shape)}")
    rank_dim = 0 if is_lora_a(key) else 1
    if tensor.shape[rank_dim] % num_experts:
        raise ValueError(f"'{key}': shape {tuple(tensor.shape)} is not {num_experts} experts × rank")
    if is_lora_a(key):
        return tensor.reshape(num_experts, -1, tensor.shape[1])
    return tensor.reshape(tensor.shape[0], -1, num_experts).permute(2, 0, 1)


def merge_experts(key: str, stack: torch.Tensor) -> torch.Tensor:
    """Inverse of `split_experts`."""
    if is_lora_a(key):
        return stack.reshape(-1, stack.shape[-1]).contiguous()
    num_experts, d_out, rank = stack.shape
    return stack.permute(1, 2, 0).reshape(d_out, rank * num_experts).contiguous()


def is_expert_factor(key: str) -> bool:
    return EXPERTS_TAG in key and is_lora_factor(key)


def block_of(key: str) -> str:
    """The MoE block a fused expert factor belongs to ('….mlp' of '….mlp.experts.lora_A…')."""
    return key.split(EXPERTS_TAG)[0]


def num_experts_of(key: str, experts: dict[str, int]) -> int:
    if block_of(key) not in experts:
        raise KeyError(f"'{key}': no expert count for MoE block '{block_of(key)}'")
    return experts[block_of(key)]


def _virtual_key(key: str, expert: int) -> str:
    tag = A_TAG if A_TAG in key else B_TAG
    return key.replace(tag, f'.expert{expert}{tag}', 1)


def unfuse(tensors: dict, experts: dict[str, int]) -> dict:
    """Fused expert factors -> one LoRA factor per expert under a virtual key; other tensors
    unchanged. experts: {MoE block name: E}."""
    out = {}
    for key, value in tensors.items():
        if not is_expert_factor(key):
            out[key] = value
            continue
        for e, factor in enumerate(split_experts(key, value, num_experts_of(key, experts))):
            out[_virtual_key(key, e)] = factor
    return out


def fuse(tensors: dict) -> dict:
    """Inverse of `unfuse`."""
    out, stacks = {}, {}
    for key, value in tensors.items():
        match = _VIRTUAL_EXPERT.search(key)
        if match is None:
            out[key] = value
            continue
        fused_key = key[:match.start()] + match.group(2) + key[match.end():]
        stacks.setdefault(fused_key, {})[int(match.group(1))] = value
    for key, per_expert in stacks.items():
        out[key] = merge_experts(key, torch.stack([per_expert[e] for e in sorted(per_expert)]))
    return out


def fit_expert_rank(key: str, value: torch.Tensor, rank: int, num_experts: int) -> torch.Tensor:
    """A fused expert factor with every expert's factor truncated or zero-padded to `rank`."""
    stack = split_experts(key, value, num_experts)
    return merge_experts(key, torch.stack([fit_rank(key, factor, rank) for factor in stack]))


def expert_rank(key: str, fused: torch.Tensor, num_experts: int) -> int:
    """The per-expert rank of a fused factor."""
    return fused.shape[0 if is_lora_a(key) else 1] // num_experts

"""SCAFFOLD's control-variate updates (Karimireddy et al., 2020, option II), as pure functions.

Client i starts a round at x, ends at y after K local steps with learning rate η:
    c_i⁺ = c_i − c + (x − y) / (K η)
Server, with S the sampled clients of the round and N all clients:
    c ← c + (|S| / N) · mean_{i∈S} Δc_i,     Δc_i = c_i⁺ − c_i
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def scaffold_client_control(c_i: torch.Tensor, c: torch.Tensor, start: torch.Tensor,
                            end: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    """The client's new control variate c_i⁺."""
    if steps < 1 or lr <= 0:
        raise ValueError(f'SCAFFOLD needs steps >= 1 and lr > 0, got steps={steps}, lr={lr}')
    return c_i - c + (start - end) / (steps * lr)


def scaffold_server_control(c: torch.Tensor, deltas: Sequence[torch.Tensor], num_sampled: int,
                            num_clients: int) -> torch.Tensor:
    """The server's new control variate from the round's Δc_i (unchanged when there are none)."""
    if not deltas:
        return c
    return c + (num_sampled / max(num_clients, 1)) * torch.stack([d.float() for d in deltas]).mean(0)

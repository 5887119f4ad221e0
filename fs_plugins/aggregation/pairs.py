"""peft parameter naming: grouping LoRA factors by layer, and fitting factors to a rank."""
from __future__ import annotations

import torch

A_TAG, B_TAG = '.lora_A.', '.lora_B.'


def lora_pairs(keys) -> dict[str, tuple[str, str]]:
    """{layer prefix: (A key, B key)} for every layer whose two factors are both in `keys`."""
    keys = set(keys)
    pairs = {}
    for key in keys:
        if A_TAG in key:
            b_key = key.replace(A_TAG, B_TAG)
            if b_key in keys:
                pairs[key.split(A_TAG)[0]] = (key, b_key)
    return dict(sorted(pairs.items()))


def is_lora_a(key: str) -> bool:
    return A_TAG in key


def is_lora_factor(key: str) -> bool:
    return A_TAG in key or B_TAG in key


def lora_rank(key: str, tensor: torch.Tensor) -> int:
    """Rank of a LoRA factor: rows of A (r, d_in), columns of B (d_out, r)."""
    return tensor.shape[0] if is_lora_a(key) else tensor.shape[1]


def overlay_rank(key: str, received: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """`own` (rank r) with its first r' components replaced by `received` (rank r' <= r): a
    client of a higher rank than the global factors keeps training its extra components (zero
    padding would freeze them: a zero row of A and zero column of B get no gradient)."""
    rank = lora_rank(key, received)
    if rank > lora_rank(key, own):
        raise ValueError(f"'{key}': received rank {rank} exceeds the client's rank "
                         f"{lora_rank(key, own)}")
    out = own.detach().clone().to(received.dtype)
    if is_lora_a(key):
        out[:rank] = received
    else:
        out[:, :rank] = received
    return out


def fit_rank(key: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """Truncates (keeps the first `rank` components) or zero-pads a LoRA factor to `rank`."""
    current = lora_rank(key, tensor)
    if current == rank:
        return tensor
    if is_lora_a(key):
        if current > rank:
            return tensor[:rank].clone()
        return torch.cat([tensor, tensor.new_zeros(rank - current, tensor.shape[1])], dim=0)
    if current > rank:
        return tensor[:, :rank].clone()
    return torch.cat([tensor, tensor.new_zeros(tensor.shape[0], rank - current)], dim=1)


# VeRA (peft): per layer '<prefix>.vera_lambda_d.<adapter>' (r) and '<prefix>.vera_lambda_b.<adapter>'
# (d_out) over frozen projections shared by all layers
VERA_D_TAG, VERA_B_TAG = '.vera_lambda_d.', '.vera_lambda_b.'


def vera_pairs(keys) -> dict[str, tuple[str, str]]:
    """{layer prefix: (λ_d key, λ_b key)} for every VeRA layer whose two vectors are in `keys`."""
    keys = set(keys)
    return dict(sorted((key.split(VERA_D_TAG)[0], (key, key.replace(VERA_D_TAG, VERA_B_TAG)))
                       for key in keys
                       if VERA_D_TAG in key and key.replace(VERA_D_TAG, VERA_B_TAG) in keys))


def is_input_factor(key: str) -> bool:
    """The trained factor next to the adapter's input: LoRA's A (r × d_in) or VeRA's λ_d (r),
    as opposed to the output side, LoRA's B or VeRA's λ_b (initialised at zero by peft)."""
    return A_TAG in key or VERA_D_TAG in key

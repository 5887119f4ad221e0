"""Hyper-parameters of FedAdapter's bottleneck adapters."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterConfig:
    # module names (last name component) whose output gets an adapter: the attention output
    # projection and the feed-forward output, Houlsby et al.'s two places per layer
    target_modules: tuple[str, ...] = ('o_proj', 'down_proj')
    # the fixed bottleneck size; a configuration uses its first `width` units
    max_width: int = 64
    # std of the down-projection's normal initialisation (the up-projection starts at zero,
    # so a new adapter is the identity)
    init_std: float = 0.01

    def __post_init__(self):
        if self.max_width < 1:
            raise ValueError(f'max_width must be >= 1, got {self.max_width}')
        if not self.target_modules:
            raise ValueError('target_modules is empty')

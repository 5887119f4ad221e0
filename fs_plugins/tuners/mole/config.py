"""Hyper-parameters of the routed part of a hybrid MoLE layer."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoleConfig:
    # module names (last name component, peft's list matching) that get routed experts;
    # every one must also be a LoRA target: its LoRA adapter is the shared expert
    target_modules: tuple[str, ...] = ('up_proj',)
    num_experts: int = 8
    top_k: int = 2
    # routed experts have the shared expert's rank, alpha and dropout (a complete LoRA each)
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    use_rslora: bool = False
    # router W_r (num_experts x d_in) ~ N(0, std^2); 0 gives an all-zero router
    router_init_std: float = 0.02

    def __post_init__(self):
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], "
                             f"got {self.top_k}")
        if self.r < 1:
            raise ValueError(f"r must be >= 1, got {self.r}")

    @property
    def scaling(self) -> float:
        return self.alpha / (self.r ** 0.5 if self.use_rslora else self.r)

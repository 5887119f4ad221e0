"""Linear arithmetic over a LoRA library (SmartFed §2's parameter-level merging baseline):
one weight λ_n per library LoRA, and on every layer the merged LoRA
(Σ λ_n B_n)(Σ λ_n A_n) x — SmartFed's Eq. 3, cross-task terms λ_m λ_n B_m A_n included; all
adapters on a layer must share one rank. Activated rank: that rank.

Choice (the paper does not say how λ is set in its federated runs): λ starts at `init_weight`
and trains by gradient on the clients, averaged with FedAvg (N numbers per round)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.library_reuse import LibraryMethod
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option
from fs_plugins.tuners.library import MergedLora

WEIGHTS_ATTR = 'library_weights'   # model child holding λ (parameter 'weight', one per adapter)


class LibraryWeights(nn.Module):
    def __init__(self, num_adapters: int, init: float):
        super().__init__()
        self.weight = nn.Parameter(torch.full((num_adapters,), float(init)))


class MergedLibraryMethod(LibraryMethod):
    """Linear arithmetic and LoRAHub: one merged LoRA from library-wide weights."""
    initial_weight = 0.0

    def before_attach(self, model, library):
        self._weights = LibraryWeights(len(library), self.initial_weight)
        model.add_module(WEIGHTS_ATTR, self._weights)

    def make_layer(self, name, A, B, owner):
        holder = self._weights
        try:
            return MergedLora(A, B, owner, lambda: holder.weight)
        except ValueError as exc:
            raise ConfigError(f"fsplug.model.library.adapters: module '{name}': {exc} "
                              f"('{self.name}' merges A's and B's element-wise)") from exc

    def layer_rank(self, layer):
        return float(layer.rank)


@dataclass
class LinearArithmeticConfig:
    init_weight: float = option(1.0, 'λ_n at start, every library LoRA (1: their plain sum)')


@register_method
class LinearArithmetic(MergedLibraryMethod):
    name = 'linear_arithmetic'
    summary = ('linear arithmetic: one merged LoRA (Σ λ_n B_n)(Σ λ_n A_n) from the frozen '
               'library (SmartFed Eq. 3); the N weights λ train and are averaged (FedAvg)')
    sent = 'N merge weights / the same'
    config_class = LinearArithmeticConfig

    @property
    def initial_weight(self):
        return self.hparams.init_weight

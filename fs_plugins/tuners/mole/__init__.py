"""Hybrid mixture of LoRA experts (Fed-MoLE): routed LoRA experts and a top-K router added
next to peft's LoRA adapter, which stays the shared expert.

- `config`: `MoleConfig`, the layer's hyper-parameters;
- `layer`: `RoutedLoraExperts`, the routed experts + router with sparse top-K dispatch;
- `model`: `inject_mole`, which attaches the routed experts to LoRA-wrapped modules, and the
  parameter-name helpers (`is_routed_expert`, `is_router`).
"""
from fs_plugins.tuners.mole.config import MoleConfig
from fs_plugins.tuners.mole.layer import RoutedLoraExperts, dense_reference
from fs_plugins.tuners.mole.model import MOLE_ATTR, inject_mole, is_routed_expert, is_router

__all__ = ['MoleConfig', 'RoutedLoraExperts', 'dense_reference', 'MOLE_ATTR', 'inject_mole',
           'is_router', 'is_routed_expert']

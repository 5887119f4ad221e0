"""MoLE (Wu, Huang & Wei, "Mixture of LoRA Experts", ICLR 2024), SmartFed's module-level
routing baseline: on every layer the library targets, each library LoRA is one expert and
all of them run; a learnable gate per layer weighs them per token from their normalised,
concatenated outputs, softmax(W_g · Norm(concat_n E_n(x)) / τ) (MoLE §3.2). Only the gates
train; they are averaged with FedAvg. Activated rank: the whole library's rank on the layer.

Left out: MoLE's gate-balancing loss and hierarchical weight control (the SmartFed paper
compares against the gated mixture only)."""
from __future__ import annotations

from dataclasses import dataclass

from fs_plugins.methods.library_reuse import LibraryMethod
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option
from fs_plugins.tuners.library import LoraGate


@dataclass
class MoLEConfig:
    temperature: float = option(1.0, 'τ of the gate softmax (MoLE Eq. 4)', gt=0)


@register_method
class MoLE(LibraryMethod):
    name = 'mole'
    summary = ('MoLE: every frozen library LoRA runs on each layer it targets; a per-layer '
               'gate over whole LoRAs (from their normalised outputs) mixes them per token; '
               'only the gates train (FedAvg)')
    sent = 'per-layer gates / the same'
    config_class = MoLEConfig

    def make_layer(self, name, A, B, owner):
        return LoraGate(A, B, owner, self.hparams.temperature)

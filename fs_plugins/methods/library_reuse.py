"""The LoRA-reuse family (SmartFed and the baselines of its Table 1): the base model stays
frozen and gets no new LoRA; a library of existing peft LoRA adapters
(fsplug.model.library.adapters) is loaded, frozen, and composed on every layer it targets by
a method-specific layer (tuners.library); only the composition's own small parameters
(routers, gates, merge weights) train and travel.

"Activated rank" (the paper's Table 1 column) is the mean, over the library's matrices, of
the rank-1 experts a token uses there; every method here reports it as a client metric."""
from __future__ import annotations

from statistics import mean

from torch import nn

from fs_plugins.methods.base import Method
from fs_plugins.tuners.library import attach_library, load_library

LAYERS_ATTR = 'library_layers'   # model attribute: {module name: composition layer}


class LibraryMethod(Method):
    uses_peft_adapter = False
    hf_export_refusal = ('its composition of the frozen library adapters is a module of its '
                         'own (the saved model holds the trained routers / gates / weights)')

    @classmethod
    def config_problems(cls, hparams, cfg):
        if not cfg['fsplug']['model']['library']['adapters']:
            return [f"fsplug.model.library.adapters is empty: '{cls.name}' composes existing "
                    f"peft LoRA adapters; list their folders"]
        return []

    def make_layer(self, name: str, A, B, owner) -> nn.Module:
        raise NotImplementedError

    def adapt_model(self, model, cfg):
        options = cfg.fsplug.model.library
        library = load_library(list(options.adapters), model, bool(options.check_base))
        self.before_attach(model, library)
        layers = attach_library(model, library, self.make_layer)
        object.__setattr__(model, LAYERS_ATTR, layers)   # a plain dict, not submodules
        return model

    def before_attach(self, model, library) -> None:
        """Model-level modules the layers refer to (merge weights, LoRA-Flow gates)."""

    def layer_rank(self, layer) -> float:
        """Rank-1 experts a token activates on one layer (default: all of them)."""
        return float(layer.num_experts)

    def activated_rank(self, model) -> float:
        return mean(self.layer_rank(layer) for layer in getattr(model, LAYERS_ATTR).values())

    def client_metrics(self, model, state):
        return {'activated_rank': self.activated_rank(model)}

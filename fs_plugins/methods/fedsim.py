"""FedSim (Pillutla et al., ICML 2022, "Federated Learning with Partial Model
Personalization", Algorithm 1 with simultaneous updates) with LoRA adapters, as FedMosaic's
tables use it (A.9: "dual adapter").

The model is split into shared parameters u (the 'default' LoRA adapter: sent, averaged) and
personal parameters v_k (a second LoRA adapter 'local' on the same layers: never sent). Both
are active in the forward pass (their low-rank updates add up) and every local step takes a
gradient step on u and v_k together, from one forward and backward pass. (FedAlt, the
paper's alternating variant, updates v_k first and then u; FedDPA-LoRA here trains the global
adapter first, then the local one.)
"""
from fs_plugins.methods.base import Method, activate_adapters
from fs_plugins.methods.dual_adapter import add_twin_adapter, needs_lora_adapter
from fs_plugins.methods.registry import register_method

SHARED, PERSONAL = 'default', 'local'


@register_method
class FedSim(Method):
    name = 'fedsim'
    summary = ('FedSim: a shared LoRA (averaged) + a personal LoRA (kept), both active and '
               'trained together at every step')
    sent = 'shared A, B / shared A, B'
    # FedMosaic Table 15: "Double Forward", 1.487 × SFT per iteration (here both adapters share
    # one forward, so the measured ratio is about 1: the declared one keeps the paper's budget)
    # Table 15 costs FedSim at a double forward (1.487); this FedSim shares one forward between
    # its two adapters, so its cost is measured (about 2/3 of SFT's on the tiny model)
    relative_cost = None
    paper_relative_cost = 1.487

    @classmethod
    def config_problems(cls, hparams, cfg):
        return needs_lora_adapter(cls.name, cfg)

    def adapt_model(self, model, cfg):
        add_twin_adapter(model, PERSONAL)
        activate_adapters(model, (SHARED, PERSONAL))
        return model

    def is_shared(self, name):
        return f'.{PERSONAL}.' not in name   # the shared adapter and e.g. a trained projector

"""FedDPA-LoRA (Yang et al., 2024), dual personalising adapters: every client carries a
global LoRA adapter ('default', shared and averaged) and a local one ('local', never sent),
both active in the forward pass. Local round: first the global adapter trains
(`global_fraction` of the steps), then the local adapter with the global one frozen. Trained
tensors outside the adapters (e.g. LLaVA's projector) go with the global adapter. With VeRA
(FedDPA-VeRA of UniFLoW Table 4) both adapters are VeRA adapters over the same frozen
projections (peft shares them), each with its own λ_d, λ_b."""
import copy
from dataclasses import dataclass

from fs_plugins.methods.base import Method, Phase, activate_adapters
from fs_plugins.methods.dual_adapter import add_twin_adapter
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option

LOCAL = '.local.'


def is_local(name: str) -> bool:
    """A parameter of the 'local' adapter: '….lora_A.local.weight' (LoRA) or
    '….vera_lambda_b.local' (VeRA, the adapter name ends the parameter name)."""
    return LOCAL in name or name.endswith(LOCAL[:-1])


@dataclass
class FedDPAConfig:
    global_fraction: float = option(0.5, 'fraction of the local steps that train the global '
                                         'adapter (the rest train the local one)', ge=0, le=1)


@register_method
class FedDPALoRA(Method):
    name = 'feddpa'
    summary = ('FedDPA-LoRA: a global adapter (averaged) + a local adapter (kept); first the '
               'global, then the local one trains')
    sent = 'global A, B / global A, B'
    config_class = FedDPAConfig
    # not FedMosaic Table 15's 2.051 ("Double Forward/Backward"): that counts a full pass for each
    # adapter, and this round splits one pass between them (global_fraction), so its cost is
    # about one SFT round; 'matched' measures it (fs_plugins.run.flops)
    relative_cost = None           # measured: this FedDPA's step is about one SFT step
    paper_relative_cost = 2.051    # Table 15 (double forward / backward)

    def adapt_model(self, model, cfg):
        if cfg.fsplug.model.adapter == 'vera':   # add_twin_adapter scales LoRA's lora_alpha
            model.add_adapter('local', copy.deepcopy(model.peft_config['default']))
            for name, param in model.named_parameters():
                if is_local(name):
                    param.requires_grad_(True)
        else:
            add_twin_adapter(model, 'local')
        activate_adapters(model, ('default', 'local'))
        return model

    def is_shared(self, name):
        return not is_local(name)   # the global adapter and e.g. a trained projector

    def phases(self, num_steps, cfg):
        first = int(round(self.hparams.global_fraction * num_steps))
        return [Phase('global', first, lambda n: not is_local(n)),
                Phase('local', num_steps - first, is_local)]

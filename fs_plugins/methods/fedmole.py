"""Fed-MoLE (hybrid mixture of LoRA experts with alternating disentanglement-alignment).

Model: on `fedmole.target_modules` (default up_proj; each must be a LoRA target) peft's LoRA
adapter is the shared expert and N routed LoRA experts + a top-K router are added
(`fs_plugins.tuners.mole`); every other LoRA target stays plain LoRA.
Local round (ADA): phase 'routed' trains routed experts + routers (shared expert and plain
LoRA frozen), then phase 'shared' trains the shared experts + plain LoRA (routed + routers
frozen). Upload: the shared experts and plain-LoRA layers only (same names and bytes as
FedAvg-LoRA), sample-weighted FedAvg; routed experts and routers stay on the client.

Ablations (paper Tables 3-4): `alternating: false` is V1 (one phase, everything trains);
`aggregate: all` is M1, `none` is M2, `shared_router` is M3.
"""
from __future__ import annotations

from fs_plugins.config import ConfigError
from fs_plugins.methods.base import Method, Phase
from fs_plugins.methods.registry import register_method
from fs_plugins.tuners.mole import MoleConfig, inject_mole, is_router, is_routed_expert

SHARED, ROUTED, ROUTER = 'shared', 'routed', 'router'
# what leaves the client under each `aggregate` setting ('shared' = shared experts and
# plain-LoRA layers)
AGGREGATED_KINDS = {'shared': {SHARED},
                    'all': {SHARED, ROUTED, ROUTER},   # M1
                    'none': set(),                     # M2
                    'shared_router': {SHARED, ROUTER}}  # M3


def parameter_kind(name: str) -> str:
    if is_routed_expert(name):
        return ROUTED
    if is_router(name):
        return ROUTER
    return SHARED


@register_method
class FedMoLE(Method):
    name = 'fedmole'
    defaults = {
        'target_modules': ['up_proj'],
        'num_experts': 8,
        'top_k': 2,
        # router init N(0, std^2); 0 = all-zero router
        'router_init_std': 0.02,
        # ADA; false = ablation V1 (all parameters trained jointly in one phase)
        'alternating': True,
        # fraction of the local steps in the first phase (routed experts + routers)
        'routed_fraction': 0.5,
        # shared (paper) | all (M1) | none (M2) | shared_router (M3)
        'aggregate': 'shared',
    }

    def __init__(self, cfg):
        super().__init__(cfg)
        aggregate = self.hparams['aggregate']
        if aggregate not in AGGREGATED_KINDS:
            raise ConfigError(f"fsplug.fedmole.aggregate = '{aggregate}' is not one of: "
                              f"{', '.join(AGGREGATED_KINDS)}")
        if not 0.0 <= float(self.hparams['routed_fraction']) <= 1.0:
            raise ConfigError(f"fsplug.fedmole.routed_fraction must be in [0, 1], got "
                              f"{self.hparams['routed_fraction']}")
        self.aggregated = AGGREGATED_KINDS[aggregate]

    def mole_config(self, cfg) -> MoleConfig:
        lora = cfg.fsplug.model.lora
        try:
            return MoleConfig(target_modules=tuple(self.hparams['target_modules']),
                              num_experts=int(self.hparams['num_experts']),
                              top_k=int(self.hparams['top_k']), r=int(lora.r),
                              alpha=float(lora.alpha), dropout=float(lora.dropout),
                              use_rslora=bool(lora.use_rslora),
                              router_init_std=float(self.hparams['router_init_std']))
        except ValueError as exc:
            raise ConfigError(f"fsplug.fedmole: {exc}") from exc

    def adapt_model(self, model, cfg):
        if cfg.fsplug.model.adapter != 'lora':
            raise ConfigError(f"fsplug.method = fedmole needs fsplug.model.adapter = lora, "
                              f"got '{cfg.fsplug.model.adapter}'")
        config = self.mole_config(cfg)
        try:
            inject_mole(model, config)
        except ValueError as exc:
            raise ConfigError(f"fsplug.fedmole.target_modules = {list(config.target_modules)} "
                              f"must be among fsplug.model.lora.target_modules = "
                              f"{list(cfg.fsplug.model.lora.target_modules)}: {exc}") from exc
        for name, param in model.named_parameters():
            if parameter_kind(name) != SHARED:
                param.requires_grad_(True)
        return model

    def is_shared(self, name):
        return parameter_kind(name) in self.aggregated

    def phases(self, num_steps, cfg):
        if not self.hparams['alternating']:
            return [Phase('joint', num_steps)]
        first = int(round(float(self.hparams['routed_fraction']) * num_steps))
        return [Phase('routed', first, lambda n: parameter_kind(n) != SHARED),
                Phase('shared', num_steps - first, lambda n: parameter_kind(n) == SHARED)]

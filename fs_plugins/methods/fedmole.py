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

from dataclasses import dataclass

from fs_plugins.errors import ConfigError
from fs_plugins.methods.base import Method, Phase
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option
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


@dataclass
class FedMoLEConfig:
    target_modules: list[str] = option(
        ['up_proj'], 'LoRA targets that get N routed experts + a router (their LoRA adapter is the '
                     'shared expert); each must be in fsplug.model.lora.target_modules', min_items=1)
    num_experts: int = option(8, 'routed LoRA experts N per MoLE layer', ge=1)
    top_k: int = option(2, 'experts K each token is routed to (top-K router)', ge=1)
    router_init_std: float = option(0.02, 'router init N(0, std²); 0 = all-zero router', ge=0)
    alternating: bool = option(True, 'ADA: routed phase, then shared phase; false = ablation V1 '
                                     '(everything trains jointly)')
    routed_fraction: float = option(0.5, 'fraction of the local steps in the routed phase', ge=0, le=1)
    aggregate: str = option('shared', 'what is aggregated: shared (paper) | all (M1) | none (M2) | '
                                      'shared_router (M3)', choices=tuple(AGGREGATED_KINDS))


def _last_name(module: str) -> str:
    return module.rsplit('.', 1)[-1]


@register_method
class FedMoLE(Method):
    name = 'fedmole'
    summary = ("Fed-MoLE: on fedmole.target_modules a shared LoRA expert (peft's adapter) + N "
               'routed LoRA experts with a top-K router (sparse dispatch); ADA: routed experts + '
               'router train first, then the shared expert; only shared experts and plain-LoRA '
               'layers are averaged, routed experts and routers stay on the client')
    sent = "shared A, B / shared A, B (bytes = FedAvg-LoRA's)"
    config_class = FedMoLEConfig

    def __init__(self, cfg):
        super().__init__(cfg)
        self.aggregated = AGGREGATED_KINDS[self.hparams.aggregate]

    @classmethod
    def config_problems(cls, hparams, cfg):
        problems = []
        if hparams.top_k > hparams.num_experts:
            problems.append(f'fsplug.fedmole.top_k = {hparams.top_k}: must be <= '
                            f'fsplug.fedmole.num_experts = {hparams.num_experts}')
        model = cfg['fsplug']['model']
        if model['adapter'] != 'lora':
            problems.append(f"fsplug.model.adapter = {model['adapter']!r}: fedmole needs 'lora' "
                            f"(its LoRA adapter is the shared expert)")
        lora_targets = {_last_name(t) for t in model['lora']['target_modules']}
        missing = [t for t in hparams.target_modules if _last_name(t) not in lora_targets]
        if missing:
            problems.append(f"fsplug.fedmole.target_modules = {hparams.target_modules}: {missing} "
                            f"not among fsplug.model.lora.target_modules = "
                            f"{model['lora']['target_modules']}")
        return problems

    def mole_config(self, cfg) -> MoleConfig:
        lora, hp = cfg.fsplug.model.lora, self.hparams
        return MoleConfig(target_modules=tuple(hp.target_modules), num_experts=hp.num_experts,
                          top_k=hp.top_k, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                          use_rslora=lora.use_rslora, router_init_std=hp.router_init_std)

    def adapt_model(self, model, cfg):
        config = self.mole_config(cfg)
        try:
            inject_mole(model, config)
        except ValueError as exc:
            raise ConfigError(f"fsplug.fedmole.target_modules = {list(config.target_modules)}: "
                              f"{exc}") from exc
        for name, param in model.named_parameters():
            if parameter_kind(name) != SHARED:
                param.requires_grad_(True)
        return model

    def is_shared(self, name):
        return parameter_kind(name) in self.aggregated

    def phases(self, num_steps, cfg):
        if not self.hparams.alternating:
            return [Phase('joint', num_steps)]
        first = int(round(self.hparams.routed_fraction * num_steps))
        return [Phase('routed', first, lambda n: parameter_kind(n) != SHARED),
                Phase('shared', num_steps - first, lambda n: parameter_kind(n) == SHARED)]

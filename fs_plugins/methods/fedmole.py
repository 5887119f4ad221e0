"""Fed-MoLE (hybrid mixture of LoRA experts with alternating disentanglement-alignment).

Model: on `fedmole.target_modules` (default up_proj) peft's LoRA adapter is the shared expert
and N routed LoRA experts + a top-K router are added (`fs_plugins.tuners.mole`); every other
LoRA target stays plain LoRA. Left at its default, `fedmole.target_modules` joins
`fsplug.model.lora.target_modules` where missing (`resolve_config`, logged at INFO), so
`fsplug.method: fedmole` composes with any LoRA targets; set to other modules, each must
already be a LoRA target (a ConfigError names both keys).
Local round (ADA, Algorithm 1): phase 'routed' trains routed experts + routers (shared expert
and plain LoRA frozen), then phase 'shared' trains the shared experts + plain LoRA (routed +
routers frozen); each phase is a full local pass by default (`phase_steps: each`). Upload: the
shared experts and plain-LoRA layers only (same names and bytes as FedAvg-LoRA), sample-weighted
FedAvg; routed experts and routers stay on the client.

Ablations (paper Tables 3-4): `alternating: false` is V1 (one phase, everything trains);
`aggregate: all` is M1, `none` is M2, `shared_router` is M3.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.base import Contract, Method, PaperClaim, Phase
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option
from fs_plugins.tuners.mole import MoleConfig, inject_mole, is_routed_expert, is_router

logger = logging.getLogger(__name__)

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
                     'shared expert); left at its default, it joins '
                     'fsplug.model.lora.target_modules where missing; any other value must be '
                     'among them (§4.1: "Fed-MoLE is applied only to the up_proj layer")',
        min_items=1)
    num_experts: int = option(8, 'routed LoRA experts N per MoLE layer (§4.1: N = 8 by default)',
                              ge=1)
    top_k: int = option(2, 'experts K each token is routed to, top-K router with softmax over the '
                           'K selected logits (Eq. 7; §4.1: K = 2)', ge=1)
    router_init_std: float = option(0.02, 'router init N(0, std²); 0 = all-zero router (the paper '
                                          'does not say; a small normal spreads tokens from step 1)',
                                    ge=0)
    alternating: bool = option(True, 'ADA (Algorithm 1): routed phase, then shared phase; false = '
                                     'ablation V1 of Table 3 (everything trains jointly)')
    phase_steps: str = option('each', "ADA phase budget: 'each' = every phase is a full local pass "
                                      '(train.local_update_steps), as Algorithm 1 loops over D_k '
                                      "once per phase; 'split' = the phases share one pass "
                                      '(routed_fraction of it routed)', choices=('each', 'split'))
    routed_fraction: float = option(0.5, "phase_steps: split: fraction of the local steps in the "
                                         'routed phase', ge=0, le=1)
    aggregate: str = option('shared', 'what is aggregated: shared (paper, Algorithm 1 last line) | '
                                      'all (M1) | none (M2) | shared_router (M3) (Table 4)',
                            choices=tuple(AGGREGATED_KINDS))


def _last_name(module: str) -> str:
    return module.rsplit('.', 1)[-1]


def _missing_lora_targets(mole_targets, lora_targets) -> list[str]:
    """The MoLE targets that no LoRA target matches (by last name, as peft matches)."""
    names = {_last_name(t) for t in lora_targets}
    return [t for t in mole_targets if _last_name(t) not in names]


def default_targets() -> list[str]:
    """fsplug.fedmole.target_modules' default (the paper's up_proj)."""
    return next(f.default_factory() for f in fields(FedMoLEConfig) if f.name == 'target_modules')


def add_default_targets(cfg, hparams, where: str = '') -> None:
    """Method default -> LoRA targets: when fsplug.fedmole.target_modules is at its default,
    its modules missing from fsplug.model.lora.target_modules are appended there (logged at
    INFO naming both keys). Targets set to other values are left to `config_problems`."""
    if list(hparams.target_modules) != default_targets():
        return
    lora = cfg.fsplug.model.lora
    missing = _missing_lora_targets(hparams.target_modules, lora.target_modules)
    if not missing:
        return
    before = list(lora.target_modules)
    lora.target_modules = before + missing
    logger.info(f"fsplug.method = 'fedmole'{where}: fsplug.fedmole.target_modules (default "
                f"{list(hparams.target_modules)}) added {missing} to "
                f"fsplug.model.lora.target_modules: {before} -> {before + missing}")


@register_method
class FedMoLE(Method):
    name = 'fedmole'
    summary = ("Fed-MoLE: on fedmole.target_modules a shared LoRA expert (peft's adapter) + N "
               'routed LoRA experts with a top-K router (sparse dispatch); ADA: routed experts + '
               'router train first, then the shared expert; only shared experts and plain-LoRA '
               'layers are averaged, routed experts and routers stay on the client')
    sent = "shared A, B / shared A, B (bytes = FedAvg-LoRA's)"
    config_class = FedMoLEConfig
    hf_export_refusal = 'its routed LoRA experts and routers are modules of its own'
    contract = Contract(claim=PaperClaim(
        source='Fed-MoLE paper, §4.4 and Table 5 (Fed-VQA, LLaVA-1.5-7B, per-round communication '
               'cost of five clients): FedAvg + LoRA 226.8 MB, Fed-MoLE 226.8 MB; "Compared to '
               'FedAvg+LoRA, Fed-MoLE introduces no additional communication overhead, as it aligns '
               'only a single LoRA adapter across clients"',
        up_ratio=1.0))

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
        missing = _missing_lora_targets(hparams.target_modules, model['lora']['target_modules'])
        # at its default the targets join the LoRA targets when the config is resolved
        if missing and list(hparams.target_modules) != default_targets():
            problems.append(f"fsplug.fedmole.target_modules = {hparams.target_modules}: {missing} "
                            f"not among fsplug.model.lora.target_modules = "
                            f"{model['lora']['target_modules']} (add them there, or leave "
                            f"fsplug.fedmole.target_modules at its default {default_targets()}, "
                            f"which joins the LoRA targets by itself)")
        return problems

    @classmethod
    def resolve_config(cls, cfg) -> None:
        add_default_targets(cfg, cls.options(cfg))

    @classmethod
    def resolve_client_config(cls, cfg, records: dict) -> None:
        # a --client_cfg entry may set its own LoRA targets: the same rule on the client's config
        add_default_targets(cfg, cls.options(cfg), ' (a client config)')

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
        if self.hparams.phase_steps == 'each':
            routed_steps, shared_steps = num_steps, num_steps
        else:
            routed_steps = int(round(self.hparams.routed_fraction * num_steps))
            shared_steps = num_steps - routed_steps
        return [Phase('routed', routed_steps, lambda n: parameter_kind(n) != SHARED),
                Phase('shared', shared_steps, lambda n: parameter_kind(n) == SHARED)]

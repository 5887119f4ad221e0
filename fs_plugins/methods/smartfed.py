"""SmartFed (Wu, Li, Guo & Li, "Don't Reinvent the Wheel, Just Realign the Spokes:
Resource-Efficient Federated Fine-Tuning via Rank-Wise Expert Assembly", ICML 2026 / arXiv
2512.00902): reuse a library of existing LoRA adapters instead of training new ones.

MoRE (§ Mixture of Rank-Wise Experts): every library LoRA of rank r on a weight matrix is r
rank-1 experts b_i a_iᵀ; the matrix's pool holds the experts of every library LoRA on it. A
per-matrix router W_r (E_j × d_in) scores the pool per token, z = W_r x (`router_input:
experts` is a lighter variant: z = W_r (A x) with W_r E_j × E_j); the top-q_j experts run
(only they are computed: tuners.library.rank_one_mixture) with gates softmax over the selected
logits, times q_j (`gate_scale`), Δh = Σ_{i ∈ top-q_j} g_i b_i a_iᵀ x. The backbone and the
library stay frozen; only the routers train, and they are averaged with FedAvg.

EEQA (Algorithm 1, fs_plugins.aggregation.eeqa_quota): for the first `warmup_rounds` rounds
every matrix uses q_j = K; meanwhile every client measures each matrix's importance and sends
it with its routers. After the warm-up the server averages the clients' importance
(sample-weighted), normalises it to α_j and allocates q_j = EEQA(α, B = K·J, M); the quotas
travel with the routers from then on and every client applies them as per-matrix top-q_j.

Importance (the paper says only "contribution to model performance"; a documented choice):
- `taylor` (default): |Σ_tokens ⟨∂L/∂Δh_j, Δh_j⟩| summed over the warm-up's local steps — the
  first-order change of the loss if matrix j's MoRE output were removed;
- `output_norm`: the mean norm of Δh_j per token, relative to nothing (cheaper, no gradient).

"Activated rank" (Table 1): the mean over matrices of q_j (capped by the pool size E_j).
Ablation "w/o EEQA" (Table 3): `eeqa: False` keeps q_j = K everywhere.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fs_plugins.aggregation import eeqa_quota, weighted_average
from fs_plugins.methods.base import Contract, PaperClaim, weights_of
from fs_plugins.methods.library_reuse import LAYERS_ATTR, LibraryMethod
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option
from fs_plugins.tuners.library import RankWiseExperts

logger = logging.getLogger(__name__)

ROUTER_SUFFIX = '.library.router'
IMPORTANCE_KEY = 'smartfed.importance'   # client -> server: (J,) float64, routers' order
QUOTA_KEY = 'smartfed.quota'             # server -> client: (J,) int64, routers' order
ARTIFACT_QUOTA = 'smartfed/quota'


@dataclass
class SmartFedConfig:
    budget: int = option(8, 'K: rank-1 experts a matrix activates on average; EEQA spends '
                            'B = K·J over the J library matrices (Algorithm 1). The paper sets '
                            'K to one library LoRA\'s rank (Table 1: activated rank 32 with '
                            'r = 32 LoRAs); the default 8 is the rank of the easyvqa library '
                            'here: set it to your library\'s rank', ge=1)
    quota_cap: int = option(0, "M: Algorithm 1's per-matrix upper bound; 0 = the smallest "
                               'expert pool of any matrix', ge=0)
    eeqa: bool = option(True, 'allocate the quotas with EEQA after the warm-up; False = q_j = K '
                              'on every matrix (ablation "w/o EEQA", Table 3)')
    warmup_rounds: int = option(1, 'rounds at q_j = K in which clients measure importance; '
                                   'EEQA allocates after them', ge=1)
    importance: str = option('taylor', "matrix importance for EEQA: 'taylor' = |Σ ⟨∂L/∂Δh, "
                                       "Δh⟩| over the warm-up's steps; 'output_norm' = mean "
                                       '‖Δh‖ per token', choices=('taylor', 'output_norm'))
    gate_scale: str = option('quota', "'quota': gates are q_j·softmax over the selected "
                                      'experts (uniform gates = the selected experts at weight '
                                      "1, as in the LoRAs they come from); 'one': softmax alone",
                             choices=('quota', 'one'))
    router_input: str = option('hidden', "'hidden': z = W_r x, W_r E_j × d_in (the paper's "
                                         "router); 'experts': z = W_r (A x), W_r E_j × E_j over "
                                         "the experts' own activations a_iᵀx — far fewer bytes "
                                         'per round than a LoRA (a lighter variant, not the '
                                         "paper's)", choices=('hidden', 'experts'))
    router_init_std: float = option(0.02, 'routers W_r ~ N(0, std²) at start (0 = zeros, '
                                          'which ties every logit)', ge=0)


def router_names(names) -> list[str]:
    """The routers in the fixed order quotas and importance use (by name)."""
    return sorted(n for n in names if n.endswith(ROUTER_SUFFIX))


@register_method
class SmartFed(LibraryMethod):
    name = 'smartfed'
    summary = ('SmartFed: frozen library LoRAs split into rank-1 experts (MoRE); a per-matrix '
               'router runs the top-q_j per token; only routers train (FedAvg); EEQA '
               '(Algorithm 1) sets q_j from importance measured in the warm-up')
    sent = 'routers (+ importance in the warm-up) / routers + quotas'
    config_class = SmartFedConfig
    contract = Contract(extra=(IMPORTANCE_KEY,), claim=PaperClaim(
        source='SmartFed paper (ICML poster), no ratio given: "Reuse existing LoRA modules, '
               'freeze adapter weights, and train only a lightweight rank-wise router for '
               'efficient federated adaptation"; "Train only the router while keeping backbone '
               'and LoRAs frozen"; Figure 7 (overhead on LLaMA2-7B, Chinese+Math) gives no '
               'figure in the text'))

    @classmethod
    def config_problems(cls, hparams, cfg):
        problems = super().config_problems(hparams, cfg)
        if hparams.quota_cap and hparams.quota_cap < hparams.budget:
            problems.append(f'fsplug.smartfed.quota_cap = {hparams.quota_cap}: must be 0 or '
                            f'>= fsplug.smartfed.budget = {hparams.budget}')
        return problems

    # ------------------------------------------------------------------ model
    def make_layer(self, name, A, B, owner):
        hp = self.hparams
        return RankWiseExperts(A, B, owner, hp.budget, hp.gate_scale, hp.router_init_std,
                               hp.router_input)

    def layer_rank(self, layer):
        return float(max(0, min(layer.quota, layer.num_experts)))

    @staticmethod
    def _layers_by_router(model) -> dict[str, RankWiseExperts]:
        return {f'{name}{ROUTER_SUFFIX}': layer
                for name, layer in getattr(model, LAYERS_ATTR).items()}

    # ----------------------------------------------------------------- client
    def init_client_state(self, model, cfg):
        return {'importance': {}, 'quota_set': False}

    def _measuring(self, state) -> bool:
        return self.hparams.eeqa and not state['quota_set'] \
            and self.round_idx < self.hparams.warmup_rounds

    def loss(self, model, batch, state):
        measuring = self._measuring(state)
        for router, layer in self._layers_by_router(model).items():
            layer.importance_hook = (self._recorder(router, state['importance'])
                                     if measuring else None)
        return model(**batch).loss

    def _recorder(self, router: str, totals: dict):
        def record(delta: torch.Tensor) -> None:
            if self.hparams.importance == 'output_norm':
                value = delta.detach().norm(dim=-1).mean().double()
                totals[router] = totals.get(router, 0.0) + value
            elif delta.requires_grad:
                kept = delta.detach()

                def taylor(grad):
                    value = (grad * kept).sum().abs().double()
                    totals[router] = totals.get(router, 0.0) + value
                delta.register_hook(taylor)
        return record

    def extra_payload_shapes(self, model, cfg):
        """Importance of each router, sent in the warm-up rounds (EEQA) only."""
        if not (self.hparams.eeqa and self.hparams.warmup_rounds):
            return {}
        return {IMPORTANCE_KEY: ((len(self._layers_by_router(model)),), torch.float64)}

    def client_extra(self, model, state):
        totals, state['importance'] = state['importance'], {}
        if not totals:
            return {}
        routers = router_names(self._layers_by_router(model))
        return {IMPORTANCE_KEY: torch.tensor([float(totals.get(r, 0.0)) for r in routers],
                                             dtype=torch.float64)}

    def receive(self, model, content, state):
        content = dict(content)
        quota = content.pop(QUOTA_KEY, None)
        super().receive(model, content, state)
        if quota is not None:
            self.apply_quota(model, quota)
            state['quota_set'] = True

    def apply_quota(self, model, quota: torch.Tensor) -> None:
        layers = self._layers_by_router(model)
        routers = router_names(layers)
        if len(quota) != len(routers):
            raise ValueError(f'{QUOTA_KEY}: {len(quota)} quotas for {len(routers)} matrices')
        for router, q in zip(routers, quota.tolist()):
            layers[router].quota = int(min(q, layers[router].num_experts))

    def artifact_extra(self, model, state):
        layers = self._layers_by_router(model)
        return {ARTIFACT_QUOTA: torch.tensor([layers[r].quota for r in router_names(layers)])}

    def restore_artifact(self, model, extra):
        extra = dict(extra)
        quota = extra.pop(ARTIFACT_QUOTA, None)
        super().restore_artifact(model, extra)
        if quota is not None:
            self.apply_quota(model, quota)

    # ----------------------------------------------------------------- server
    def init_server_state(self, initial_shared):
        routers = router_names(initial_shared)
        pools = [initial_shared[r].shape[0] for r in routers]
        cap = self.hparams.quota_cap or min(pools)
        return {'global': dict(initial_shared), 'routers': routers, 'pools': pools,
                'cap': cap, 'quota': None, 'rounds': 0, 'importance': []}

    def aggregate(self, server_state, updates):
        shared = [u.shared for u in updates]
        merged = weighted_average(shared, weights_of(updates))
        state = {**server_state, 'global': {**server_state['global'], **merged},
                 'rounds': server_state['rounds'] + 1}
        measured = [(u, u.extra[IMPORTANCE_KEY]) for u in updates if IMPORTANCE_KEY in u.extra]
        if measured and state['quota'] is None:
            state['importance'] = state['importance'] + [
                (float(weights_of([u])[0]), value) for u, value in measured]
        if (self.hparams.eeqa and state['quota'] is None
                and state['rounds'] >= self.hparams.warmup_rounds and state['importance']):
            state['quota'] = self.allocate(state)
            state['importance'] = []
        return state

    def allocate(self, state) -> torch.Tensor:
        """EEQA over the clients' sample-weighted mean importance."""
        weights = torch.tensor([w for w, _ in state['importance']], dtype=torch.float64)
        values = torch.stack([v.to(torch.float64) for _, v in state['importance']])
        importance = (weights[:, None] * values).sum(0) / weights.sum()
        if not torch.isfinite(importance).all() or float(importance.sum()) <= 0:
            logger.warning('SmartFed: no usable importance measured; keeping q_j = K')
            importance = torch.ones_like(importance)
        budget = self.hparams.budget * len(state['routers'])
        quota = eeqa_quota(importance.tolist(), budget, state['cap'])
        logger.info(f'SmartFed EEQA: budget {budget} over {len(quota)} matrices, cap '
                    f"{state['cap']}: quotas {quota}")
        return torch.tensor(quota, dtype=torch.int64)

    def content_for(self, server_state, client_id):
        if server_state.get('quota') is None:
            return server_state['global']
        return {**server_state['global'], QUOTA_KEY: server_state['quota']}

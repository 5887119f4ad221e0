"""LoRAHub (Huang et al., "LoraHub: Efficient Cross-Task Generalization via Dynamic LoRA
Composition", COLM 2024), SmartFed's gradient-free baseline: one weight w_n per library LoRA,
merged element-wise as in linear arithmetic, m = (Σ w_n A_n)(Σ w_n B_n) (LoRAHub §3), with the
weights found by a gradient-free search that minimises loss + α·Σ|w_n| (α = 0.05, w in
[-1.5, 1.5], starting from w = 0: LoRAHub's defaults).

Federated search (a choice: LoRAHub runs nevergrad's NGOpt on one machine): every round the
server proposes `population` candidates — the current mean and draws from N(mean, σ²) —
each client scores every candidate by its loss on its local batches (forward passes only, no
gradient: Method.gradient_free), and the server ranks the candidates by the clients'
sample-weighted mean loss + the L1 term, moves the mean and σ to the `elite` best
(cross-entropy method) and keeps the best candidate of the round as the model's weights.
Nothing but N weights per candidate travels down and one loss per candidate up.
Activated rank: the merged LoRA's rank."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fs_plugins.core.seeding import derive_seed
from fs_plugins.methods.base import Contract, weights_of
from fs_plugins.methods.linear_arithmetic import WEIGHTS_ATTR, MergedLibraryMethod
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option

CANDIDATES_KEY = 'lorahub.candidates'   # server -> client: (P, N) weights to score
WEIGHTS_KEY = 'lorahub.weights'         # server -> client: (N,) the best weights so far
LOSSES_KEY = 'lorahub.losses'           # client -> server: (P,) mean loss of each candidate


@dataclass
class LoraHubConfig:
    population: int = option(8, 'candidates scored per round (the first is the current mean)',
                             ge=2)
    elite: int = option(2, 'best candidates the next mean and σ are fitted to', ge=1)
    init_sigma: float = option(0.5, 'σ of the first round\'s draws around w = 0', gt=0)
    min_sigma: float = option(0.05, 'floor of σ (keeps the search moving)', ge=0)
    l1: float = option(0.05, 'α of the L1 term on the weights (LoRAHub default)', ge=0)
    bound: float = option(1.5, 'weights are clipped to [-bound, bound] (LoRAHub default)', gt=0)


@register_method
class LoraHub(MergedLibraryMethod):
    name = 'lorahub'
    robust_aggregation_refusal = "its server searches composition weights from the clients' losses"
    summary = ('LoRAHub: one merged LoRA (Σ w_n A_n)(Σ w_n B_n) from the frozen library; the '
               'weights come from a federated gradient-free search (cross-entropy method: '
               'clients score candidates by their local loss, no backward)')
    sent = 'candidate losses / candidate weights'
    contract = Contract(extra=(LOSSES_KEY,))
    config_class = LoraHubConfig
    gradient_free = True

    @classmethod
    def config_problems(cls, hparams, cfg):
        problems = super().config_problems(hparams, cfg)
        if hparams.elite > hparams.population:
            problems.append(f'fsplug.lorahub.elite = {hparams.elite}: must be <= '
                            f'fsplug.lorahub.population = {hparams.population}')
        return problems

    # ----------------------------------------------------------------- client
    def is_shared(self, name):
        return False

    def init_client_state(self, model, cfg):
        return {'candidates': None, 'loss_sums': None, 'batches': 0}

    def receive(self, model, content, state):
        if WEIGHTS_KEY not in content:   # e.g. FS's closing message carries no state
            return
        weights = getattr(model, WEIGHTS_ATTR).weight
        with torch.no_grad():
            weights.copy_(content[WEIGHTS_KEY].to(weights))
        state['candidates'] = content[CANDIDATES_KEY]
        state['loss_sums'] = torch.zeros(len(state['candidates']), dtype=torch.float64)
        state['batches'] = 0

    def loss(self, model, batch, state):
        weights = getattr(model, WEIGHTS_ATTR).weight
        current = weights.detach().clone()
        with torch.no_grad():
            for index, candidate in enumerate(state['candidates']):
                weights.copy_(candidate.to(weights))
                state['loss_sums'][index] += float(model(**batch).loss)
            weights.copy_(current)
            loss = model(**batch).loss
        state['batches'] += 1
        return loss

    def client_extra(self, model, state):
        batches = max(1, state['batches'])
        return {LOSSES_KEY: state['loss_sums'] / batches}

    def extra_payload_shapes(self, model, cfg):
        """The (P,) mean losses of the population's candidates (float64)."""
        return {LOSSES_KEY: ((self.hparams.population,), torch.float64)}

    # ----------------------------------------------------------------- server
    def init_server_state(self, initial_shared):
        count = len(self.cfg.fsplug.model.library.adapters)
        mean = torch.zeros(count, dtype=torch.float64)
        state = {'global': {}, 'mean': mean, 'sigma': torch.full_like(mean, self.hparams.init_sigma),
                 'best': mean.clone(), 'rounds': 0}
        state['candidates'] = self._propose(state)
        return state

    def _propose(self, state) -> torch.Tensor:
        generator = torch.Generator().manual_seed(derive_seed(self.cfg.seed,
                                                              f"lorahub-{state['rounds']}"))
        count = self.hparams.population - 1
        draws = torch.randn(count, len(state['mean']), generator=generator, dtype=torch.float64)
        draws = state['mean'] + draws * state['sigma']
        bound = self.hparams.bound
        return torch.cat([state['mean'][None], draws]).clamp(-bound, bound)

    def scores(self, candidates: torch.Tensor, updates) -> torch.Tensor:
        """Sample-weighted mean loss of every candidate + α·Σ|w| (lower is better)."""
        weights = torch.tensor(weights_of(updates), dtype=torch.float64)
        losses = torch.stack([u.extra[LOSSES_KEY].to(torch.float64) for u in updates])
        mean_loss = (weights[:, None] * losses).sum(0) / weights.sum()
        return mean_loss + self.hparams.l1 * candidates.abs().sum(1)

    def aggregate(self, server_state, updates):
        candidates = server_state['candidates']
        order = self.scores(candidates, updates).argsort()
        elite = candidates[order[:self.hparams.elite]]
        sigma = elite.std(0, unbiased=False) if len(elite) > 1 else server_state['sigma']
        state = {**server_state, 'mean': elite.mean(0), 'best': candidates[order[0]].clone(),
                 'sigma': sigma.clamp(min=self.hparams.min_sigma),
                 'rounds': server_state['rounds'] + 1}
        state['candidates'] = self._propose(state)
        return state

    def content_for(self, server_state, client_id):
        return {WEIGHTS_KEY: server_state['best'].float(),
                CANDIDATES_KEY: server_state['candidates'].float()}

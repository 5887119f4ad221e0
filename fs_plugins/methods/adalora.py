"""AdaLoRA in federated training (Zhang et al., "Adaptive Budget Allocation for
Parameter-Efficient Fine-Tuning", ICLR 2023), SmartFed's Table 1 baseline.

Each adapted matrix gets peft's AdaLoRA update P Λ Q (`AdaLoraConfig`: lora_B = P, lora_E = the
diagonal Λ, lora_A = Q; initial rank `fsplug.model.lora.r`), trained with AdaLoRA's orthogonality
penalty γ (‖PᵀP − I‖ + ‖QQᵀ − I‖, added by peft's forward).

Federated rank allocation (our choice: AdaLoRA is a single-machine method):
- client: during its local steps it smooths the sensitivity of every P, Λ, Q entry,
  Ī = β₁Ī + (1−β₁)|w·∇w| and Ū = β₂Ū + (1−β₂)|I − Ī| (eq. 8-9, reset each round), and sends, with
  P, Λ, Q, each triplet's importance S_i = s(λ_i) + mean_j s(Q_ij) + mean_j s(P_ji) (eq. 10,
  s = Ī·Ū) as one vector (`adalora.importance`);
- server: averages P, Λ, Q and the importance vectors with the clients' weights (p_k = n_k/Σn),
  and zeroes the Λ entries outside the `b(t)` most important triplets across all matrices
  (eq. 12), b(t) the cubic schedule of eq. 11 counted in rounds (`initial_fraction`,
  `final_fraction` of federate.total_round_num) from b₀ = r · matrices to
  b_T = `target_r` · matrices;
- between maskings a pruned λ may grow back on the clients (AdaLoRA masks every ΔT steps; here
  ΔT is one round); in the final rounds the mask is fixed (the one chosen when the final phase
  starts, as peft's rank_pattern) and the clients keep the masked λ at zero after every step.
Activated rank: `target_r` per matrix on average once the budget is reached. peft's own
`update_and_allocate` is not used (its allocator keeps client-local state across steps)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.adalora import adalora_budget, budget_mask
from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.base import Contract, Method, load_tensors, weights_of
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option

IMPORTANCE_KEY = 'adalora.importance'   # client -> server: (Σ r,) triplet importance
MASK_PREFIX = 'adalora.mask.'           # server -> client in the final phase: per Λ, (r,) 1 kept / 0


@dataclass
class AdaLoraConfig:
    target_r: int = option(8, 'average rank per matrix at the end of the budget schedule, b_T / '
                              'matrices (AdaLoRA §3.3; fsplug.model.lora.r is the initial rank: the '
                              "paper's b_0 = 1.5 b_T is r = 12 for target_r = 8, peft's defaults)",
                           ge=1)
    initial_fraction: float = option(0.1, 'fraction of the rounds at the initial budget before '
                                          'pruning starts (t_i of AdaLoRA eq. 11, in rounds)',
                                     ge=0, lt=1)
    final_fraction: float = option(0.2, 'fraction of the rounds at the target budget with a fixed '
                                        'mask (t_f of AdaLoRA eq. 11, in rounds)', ge=0, lt=1)
    beta1: float = option(0.85, 'β₁ of the sensitivity smoothing (AdaLoRA eq. 8; peft default)',
                          ge=0, lt=1)
    beta2: float = option(0.85, 'β₂ of the uncertainty smoothing (AdaLoRA eq. 9; peft default)',
                          ge=0, lt=1)
    orth_reg_weight: float = option(0.1, 'γ of the orthogonality penalty on P and Q (AdaLoRA '
                                         'eq. 4; the paper uses 0.1)', ge=0)


def sensitivity_step(average: torch.Tensor, uncertainty: torch.Tensor, weight: torch.Tensor,
                     grad: torch.Tensor, beta1: float, beta2: float):
    """One step of AdaLoRA eq. 8-9: (Ī, Ū) from the previous ones and I = |w·∇w|."""
    importance = (weight * grad).abs()
    average = beta1 * average + (1 - beta1) * importance
    uncertainty = beta2 * uncertainty + (1 - beta2) * (importance - average).abs()
    return average, uncertainty


def triplet_importance(score_q: torch.Tensor, score_e: torch.Tensor,
                       score_p: torch.Tensor) -> torch.Tensor:
    """S_i = s(λ_i) + mean_j s(Q_ij) + mean_j s(P_ji) (AdaLoRA eq. 10): Q (r, in) = lora_A,
    Λ (r, 1) = lora_E, P (out, r) = lora_B; returns (r,)."""
    return score_e.reshape(-1) + score_q.mean(dim=1) + score_p.mean(dim=0)


def lambda_names(names) -> list[str]:
    return sorted(n for n in names if '.lora_E.' in n)


def factor_names(lambda_name: str) -> tuple[str, str, str]:
    """(Q, Λ, P) parameter names of the triplets whose Λ is `lambda_name`."""
    return (lambda_name.replace('.lora_E.', '.lora_A.'), lambda_name,
            lambda_name.replace('.lora_E.', '.lora_B.'))


@register_method
class AdaLora(Method):
    name = 'adalora'
    summary = ('AdaLoRA: SVD-form P Λ Q adapters; clients send P, Λ, Q and triplet importance, '
               'the server averages both and masks Λ to the cubic rank budget')
    sent = 'P, Λ, Q + triplet importance / P, Λ, Q (+ final rank mask)'
    uses_peft_adapter = False
    robust_aggregation_refusal = "its server masks Λ by the clients' averaged importance"
    contract = Contract(extra=(IMPORTANCE_KEY,), rank_options=('target_r',))
    config_class = AdaLoraConfig

    @classmethod
    def config_problems(cls, hparams, cfg):
        problems = []
        model = cfg['fsplug']['model']
        if model['adapter'] != 'lora':
            problems.append(f"fsplug.model.adapter = {model['adapter']!r}: adalora brings its own "
                            f"peft AdaLoRA adapter on the LoRA targets; leave it 'lora'")
        if hparams.target_r > model['lora']['r']:
            problems.append(f"fsplug.adalora.target_r = {hparams.target_r}: must be <= the initial "
                            f"rank fsplug.model.lora.r = {model['lora']['r']}")
        if hparams.initial_fraction + hparams.final_fraction >= 1:
            problems.append(f'fsplug.adalora.initial_fraction + final_fraction = '
                            f'{hparams.initial_fraction + hparams.final_fraction}: must be < 1')
        if model['vision']['tower_lora_targets'] or model['lora']['target_parameters']:
            problems.append('fsplug.model.vision.tower_lora_targets / '
                            'fsplug.model.lora.target_parameters: adalora adapts '
                            'fsplug.model.lora.target_modules only')
        return problems

    # ------------------------------------------------------------------ model
    def adapt_model(self, model, cfg):
        from peft import AdaLoraConfig as PeftAdaLoraConfig
        from peft import TaskType, get_peft_model
        lora = cfg.fsplug.model.lora
        config = PeftAdaLoraConfig(
            task_type=TaskType.CAUSAL_LM, init_r=int(lora.r), target_r=self.hparams.target_r,
            lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
            target_modules=list(lora.target_modules), beta1=self.hparams.beta1,
            beta2=self.hparams.beta2, orth_reg_weight=self.hparams.orth_reg_weight,
            total_step=1)   # peft's own schedule is unused (the server allocates)
        try:
            return get_peft_model(model, config)
        except ValueError as exc:
            raise ConfigError(f'fsplug.model.lora.target_modules = {list(lora.target_modules)} '
                              f'does not match the model: {exc}') from exc

    # ----------------------------------------------------------------- client
    def init_client_state(self, model, cfg):
        return {'average': {}, 'uncertainty': {}, 'mask': {}}

    def receive(self, model, content, state):
        state['mask'] = {n[len(MASK_PREFIX):]: m for n, m in content.items()
                         if n.startswith(MASK_PREFIX)}
        load_tensors(model, {n: v for n, v in content.items() if not n.startswith(MASK_PREFIX)})

    def after_step(self, model, state):
        beta1, beta2 = self.hparams.beta1, self.hparams.beta2
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, param in params.items():
                if param.grad is None or '.lora_' not in name:
                    continue
                zeros = torch.zeros_like(param, dtype=torch.float32)
                state['average'][name], state['uncertainty'][name] = sensitivity_step(
                    state['average'].get(name, zeros), state['uncertainty'].get(name, zeros),
                    param.float(), param.grad.float(), beta1, beta2)
            for name, keep in state['mask'].items():
                params[name].mul_(keep.to(params[name]).reshape(-1, 1))

    def client_extra(self, model, state):
        params = dict(model.named_parameters())
        scores = []
        for name in lambda_names(params):
            parts = [state['average'].get(n, torch.zeros_like(params[n], dtype=torch.float32))
                     * state['uncertainty'].get(n, torch.zeros_like(params[n], dtype=torch.float32))
                     for n in factor_names(name)]
            scores.append(triplet_importance(*parts))
        state['average'], state['uncertainty'] = {}, {}   # eq. 8-9 restart every round
        return {IMPORTANCE_KEY: torch.cat(scores).cpu()}

    def extra_payload_shapes(self, model, cfg):
        params = dict(model.named_parameters())
        return {IMPORTANCE_KEY: (sum(params[n].shape[0] for n in lambda_names(params)),)}

    def client_metrics(self, model, state):
        params = dict(model.named_parameters())
        names = lambda_names(params)
        active = sum(int(params[n].detach().ne(0).sum()) for n in names)
        return {'active_rank': active / max(len(names), 1)}

    # ----------------------------------------------------------------- server
    def init_server_state(self, initial_shared):
        return {'global': initial_shared, 'rounds': 0, 'final_mask': {}}

    def aggregate(self, server_state, updates):
        weights = weights_of(updates)
        average = weighted_average([u.shared for u in updates], weights)
        importance = weighted_average([{IMPORTANCE_KEY: u.extra[IMPORTANCE_KEY]} for u in updates],
                                      weights)[IMPORTANCE_KEY]
        rounds = server_state['rounds'] + 1
        mask = server_state['final_mask'] or {
            name: keep.float() for name, keep in budget_mask(
                self._split(importance, average), self._budget(rounds, average)).items()}
        final = rounds > self._total_rounds() - self._final_rounds()
        masked = {name: average[name] * keep.to(average[name]).reshape(-1, 1)
                  for name, keep in mask.items()}
        return {'global': {**server_state['global'], **average, **masked}, 'rounds': rounds,
                'final_mask': mask if final else {}}

    def content_for(self, server_state, client_id):
        masks = {MASK_PREFIX + n: keep for n, keep in server_state['final_mask'].items()}
        return {**server_state['global'], **masks}

    def _split(self, importance, shared) -> dict[str, torch.Tensor]:
        names = lambda_names(shared)
        sizes = [shared[n].shape[0] for n in names]
        if importance.numel() != sum(sizes):
            raise ValueError(f'{IMPORTANCE_KEY}: {importance.numel()} scores for {sum(sizes)} '
                             f'triplets of the shared Λ tensors')
        return dict(zip(names, importance.split(sizes)))

    def _budget(self, rounds_done: int, shared) -> int:
        matrices = len(lambda_names(shared))
        total = self._total_rounds()
        return adalora_budget(rounds_done, total, round(self.hparams.initial_fraction * total),
                              self._final_rounds(),
                              int(self.cfg.fsplug.model.lora.r) * matrices,
                              self.hparams.target_r * matrices)

    def _total_rounds(self) -> int:
        return int(self.cfg.federate.total_round_num)

    def _final_rounds(self) -> int:
        return round(self.hparams.final_fraction * self._total_rounds())

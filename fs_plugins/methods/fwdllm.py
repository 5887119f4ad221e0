"""FwdLLM (Xu et al., "FwdLLM: Efficient FedLLM using Forward Gradient", USENIX ATC 2024),
SmartFed's Table 1 baseline: backpropagation-free federated LoRA fine-tuning.

Client (forward passes only: `gradient_free`): each local step estimates the gradient of the
loss on its batch from K random perturbations v_k of the LoRA parameters,
g = (1/K) Σ_k (∇L·v_k) v_k (an unbiased estimate of ∇L for v ~ N(0, I)), the directional
derivative ∇L·v_k by forward-mode AD (`torch.func.jvp`) or, where an operator has no forward-mode
rule (PyTorch's CPU fused attention), by the central difference (L(θ+εv) − L(θ−εv)) / 2ε; then
θ ← θ − lr·g (plain SGD with `train.optimizer.lr`; the optimiser type is not used).
Discriminative perturbation sampling: `candidate_factor`·K Gaussian candidates are drawn and the
K with the largest |cos(v, d)| kept, d the previous round's global update (sent down; every
candidate is kept in round 0, where d = 0). Variance-controlled pacing: the server measures the
clients' relative update variance Σ p_k‖Δ_k − Δ̄‖²/‖Δ̄‖² and doubles K (up to
`max_perturbations`) while it exceeds `variance_threshold`.
Choices (the paper could not be read here): clients run `train.local_update_steps` forward-
gradient steps and the server averages the LoRA parameters (FedAvg), instead of the clients
uploading gradient estimates; K only grows; d is the global update of the last round."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.forward_gradient import next_perturbation_count, relative_update_variance
from fs_plugins.core.seeding import derive_seed
from fs_plugins.methods.base import Contract, Method, load_tensors, weights_of
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option

logger = logging.getLogger(__name__)

DIRECTION_KEY = 'fwdllm.direction'         # server -> client: flat previous global update
PERTURBATIONS_KEY = 'fwdllm.perturbations'  # server -> client: () int64, K


@dataclass
class FwdLLMConfig:
    perturbations: int = option(10, 'perturbations K per step in the first round (FwdLLM §4: '
                                    'the count the variance-controlled pacing starts from)', ge=1)
    max_perturbations: int = option(80, 'largest K the variance-controlled pacing may reach',
                                    ge=1)
    variance_threshold: float = option(1.0, "K doubles while the clients' relative update "
                                            'variance Σp‖Δ_k − Δ̄‖²/‖Δ̄‖² exceeds this (FwdLLM '
                                            'variance-controlled pacing)', gt=0)
    candidate_factor: int = option(4, 'candidates drawn per kept perturbation in the '
                                      'discriminative sampling (1: plain random perturbations)',
                                   ge=1)
    derivative: str = option('auto', 'directional derivative: jvp (forward-mode AD), '
                                     'finite_difference, or auto (jvp, falling back to finite '
                                     'differences where an operator has no forward-mode rule)',
                             choices=('auto', 'jvp', 'finite_difference'))
    epsilon: float = option(1e-3, 'ε of the central finite difference', gt=0)


def forward_gradient(derivatives: torch.Tensor, perturbations: torch.Tensor) -> torch.Tensor:
    """(1/K) Σ_k d_k v_k for K directional derivatives d (K,) along perturbations v (K, P)."""
    return (derivatives[:, None] * perturbations).mean(0)


def most_aligned(candidates: torch.Tensor, direction: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` candidates (C, P) with the largest |cos| to `direction` (P,), in
    increasing order; the first `keep` when the direction is zero."""
    if float(direction.norm()) == 0:
        return torch.arange(keep)
    cosines = (candidates @ direction).abs() / (candidates.norm(dim=1) * direction.norm())
    return torch.sort(torch.sort(-cosines, stable=True).indices[:keep]).values


@register_method
class FwdLLM(Method):
    name = 'fwdllm'
    summary = ('FwdLLM: backpropagation-free LoRA training with forward gradients (jvp or finite '
               'differences) along perturbations aligned with the last global update; K paced by '
               "the clients' update variance")
    sent = 'LoRA / LoRA + last global update + K'
    gradient_free = True
    config_class = FwdLLMConfig
    contract = Contract()

    @classmethod
    def config_problems(cls, hparams, cfg):
        problems = []
        if hparams.perturbations > hparams.max_perturbations:
            problems.append(f'fsplug.fwdllm.perturbations = {hparams.perturbations}: must be <= '
                            f'fsplug.fwdllm.max_perturbations = {hparams.max_perturbations}')
        dropout = cfg['fsplug']['model']['lora']['dropout']
        if dropout:
            problems.append(f'fsplug.model.lora.dropout = {dropout}: fwdllm needs 0 (a directional '
                            f'derivative compares forward passes of one function)')
        return problems

    # ----------------------------------------------------------------- client
    def init_client_state(self, model, cfg):
        return {'direction': None, 'perturbations': self.hparams.perturbations,
                'gradient': None, 'batches': 0, 'calls': 0, 'jvp_failed': False}

    def receive(self, model, content, state):
        if DIRECTION_KEY in content:
            state['direction'] = content[DIRECTION_KEY].float()
            state['perturbations'] = int(content[PERTURBATIONS_KEY])
            state['calls'] = 0   # the perturbations' seeds count the round's batches
        load_tensors(model, {n: v for n, v in content.items() if not n.startswith('fwdllm.')})

    def loss(self, model, batch, state):
        params = trainable(model)
        flat = torch.cat([p.detach().reshape(-1).float() for p in params.values()])
        vectors = self._perturbations(flat.numel(), state)
        derivatives, losses = zip(*(self._directional(model, params, unflatten(v, params), batch,
                                                      state) for v in vectors))
        # the perturbations and the estimate live on the CPU (seeded there), whatever the device
        estimate = forward_gradient(torch.stack(derivatives).float().cpu(), vectors)
        state['gradient'] = estimate if state['gradient'] is None else state['gradient'] + estimate
        state['batches'] += 1
        state['calls'] += 1
        return torch.stack(losses).mean()

    def after_step(self, model, state):
        if state['gradient'] is None:
            return
        step = unflatten(state['gradient'] / state['batches'] * float(self.cfg.train.optimizer.lr),
                         trainable(model))
        with torch.no_grad():
            for name, param in trainable(model).items():
                param.sub_(step[name].to(param))
        state['gradient'], state['batches'] = None, 0

    def _perturbations(self, size: int, state) -> torch.Tensor:
        """K perturbations (K, P): the candidates most aligned with the last global update."""
        keep = state['perturbations']
        count = keep * self.hparams.candidate_factor
        generator = torch.Generator().manual_seed(derive_seed(
            self.cfg.seed, 'fwdllm', self.client_id, self.round_idx, state['calls']))
        candidates = torch.randn(count, size, generator=generator)
        direction = state['direction'] if state['direction'] is not None else torch.zeros(size)
        return candidates[most_aligned(candidates, direction, keep)]

    def _directional(self, model, params, tangent, batch, state):
        """(∇L·v, L) at the model's parameters, by jvp or central differences."""
        mode = self.hparams.derivative
        if mode == 'jvp' or (mode == 'auto' and not state['jvp_failed']):
            try:
                loss, derivative = torch.func.jvp(
                    lambda p: functional_loss(model, p, batch), (detached(params),), (tangent,))
                return derivative.detach(), loss.detach()
            # an operator without a forward-mode rule, or a hook that forward-mode AD refuses
            # (gradient checkpointing's input requires_grad_); a genuine error fails below too
            except (NotImplementedError, RuntimeError) as exc:
                if mode == 'jvp':
                    raise
                logger.info(f'fwdllm: jvp unavailable ({str(exc).splitlines()[0][:120]}); '
                            f'central finite differences instead')
                state['jvp_failed'] = True
        eps = self.hparams.epsilon
        with torch.no_grad():
            plus = functional_loss(model, shifted(params, tangent, eps), batch)
            minus = functional_loss(model, shifted(params, tangent, -eps), batch)
        return (plus - minus) / (2 * eps), (plus + minus) / 2

    # ----------------------------------------------------------------- server
    def init_server_state(self, initial_shared):
        return {'global': initial_shared, 'perturbations': self.hparams.perturbations,
                'direction': torch.zeros(sum(v.numel() for v in initial_shared.values()))}

    def aggregate(self, server_state, updates):
        weights = weights_of(updates)
        previous = server_state['global']
        average = weighted_average([u.shared for u in updates], weights)
        names = sorted(average)
        deltas = [flatten({n: u.shared[n].float() - previous[n].float() for n in names})
                  for u in updates]
        variance = relative_update_variance(deltas, weights)
        count = next_perturbation_count(server_state['perturbations'], variance,
                                        self.hparams.variance_threshold,
                                        self.hparams.max_perturbations)
        direction = flatten({n: average[n].float() - previous[n].float() for n in names})
        return {'global': {**previous, **average}, 'perturbations': count, 'direction': direction}

    def content_for(self, server_state, client_id):
        return {**server_state['global'], DIRECTION_KEY: server_state['direction'],
                PERTURBATIONS_KEY: torch.tensor(server_state['perturbations'])}


def trainable(model) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters in sorted name order (the order of the flat vectors)."""
    return dict(sorted((n, p) for n, p in model.named_parameters() if p.requires_grad))


def flatten(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[n].reshape(-1).float() for n in sorted(tensors)])


def unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    pieces = flat.split([p.numel() for p in like.values()])
    return {n: piece.reshape(p.shape).to(device=p.device, dtype=p.dtype)
            for (n, p), piece in zip(like.items(), pieces)}


def detached(params):
    return {n: p.detach() for n, p in params.items()}


def shifted(params, tangent, eps: float):
    return {n: p.detach() + eps * tangent[n] for n, p in params.items()}


def functional_loss(model, params, batch) -> torch.Tensor:
    return torch.func.functional_call(model, params, args=(), kwargs=batch, strict=False).loss

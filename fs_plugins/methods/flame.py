"""FLAME (resource-adaptive federated LoRA on sparse mixture-of-experts LLMs).

Every client trains the full-rank LoRA of every expert (peft `target_parameters` on the fused
expert tensors, fsplug.model.lora.target_parameters) but its router selects only k_i experts
per token (`fsplug.flame.top_k` from --client_cfg, else the budget level the server assigns
round-robin by client id from `budget_levels`). Each MoE block's output is multiplied by the
client-local rescaler (tuners.flame.rescaler). Each client counts, per layer and expert, how
often the expert was selected in local training (tuners.flame.routing; `fsplug.flame.activation`:
its share of the routed token slots, or the steps it was selected in) and sends the counts and
their total beside its update; the server averages each expert's LoRA slices with
activation-aware weights and every other shared tensor with FedAvg
(aggregation.activation.activation_aware_average).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from statistics import mean

import torch

from fs_plugins.aggregation.activation import activation_aware_average, activation_frequency, frequency_summary
from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.base import Contract, Method, load_tensors, weights_of
from fs_plugins.methods.registry import register_method
from fs_plugins.models.olmoe import EXPERT_LORA_PARAMETERS
from fs_plugins.schema import option
from fs_plugins.tuners.flame import (
    ACTIVATION_READINGS,
    RESCALE_MODES,
    RESCALE_NAME,
    RoutingTracker,
    install_rescaler,
    moe_blocks,
    set_static_scale,
)

logger = logging.getLogger(__name__)

# the MoE models to name when a dense one is configured (builders 'olmoe' / 'tiny_olmoe')
OLMOE_MODEL_TYPE = 'allenai/OLMoE-1B-7B-0924@fsplug_llm'
TINY_OLMOE_MODEL_TYPE = 'tiny-olmoe@fsplug_llm'
COUNTS_PREFIX = 'flame.counts.'       # + MoE block name: (E,) activation counts a_i^j (float64)
TOTALS_PREFIX = 'flame.total.'        # + MoE block name: () their total S_i (float64)
STEPS_KEY = 'flame.steps'             # local steps of the round
DEFAULT_TOP_K_KEY = 'flame.top_k'     # server -> client: the budget level assigned by id
ARTIFACT_TOP_K = 'flame/top_k'      # the client's top-k in its saved model (fs_plugins.run.artifacts)
METRICS_KEY = 'flame_metrics'         # client state: this round's a/S summary (client_metrics)


def dense_model_message(method: str, cfg) -> str:
    """Why a dense model cannot run an expert-routing method, and which MoE model to use."""
    return (f"fsplug.method = '{method}' needs a sparse mixture-of-experts model: model.type = "
            f"'{cfg.model.type}' (fsplug.model.builder: {cfg.fsplug.model.builder}) has no MoE "
            f"block. Use OLMoE: model.type: {OLMOE_MODEL_TYPE} with fsplug.model.builder: olmoe "
            f"(yamls/flame/dolly_flame.yaml), or the tiny random one for tests: model.type: "
            f"{TINY_OLMOE_MODEL_TYPE} with fsplug.model.builder: tiny_olmoe (yamls/flame/tiny.yaml); "
            f"LoRA reaches the experts through fsplug.model.lora.target_parameters, e.g. "
            f"{EXPERT_LORA_PARAMETERS}")


class ExpertRoutingMethod(Method):
    """Installs the routing tracker and sends activation counts (every MoE method here)."""
    contract = Contract(extra=(COUNTS_PREFIX + '*', TOTALS_PREFIX + '*', STEPS_KEY))

    @property
    def activation(self) -> str:
        """Which reading of the activation frequency is sent ('token' unless configured)."""
        return getattr(self.hparams, 'activation', 'token')

    def adapt_model(self, model, cfg):
        blocks = moe_blocks(model)
        if not blocks:
            raise ConfigError(dense_model_message(self.name, cfg))
        model.flame_routing = RoutingTracker(blocks)
        return model

    def init_client_state(self, model, cfg):
        return {'routing': model.flame_routing}

    def loss(self, model, batch, state):
        state['routing'].start_step(batch.get('attention_mask'), fresh=self.micro_index == 0)
        return model(**batch).loss

    def after_step(self, model, state):
        state['routing'].end_step()

    def client_extra(self, model, state):
        round_ = state['routing'].take_round()
        counts, totals = round_.reading(self.activation)
        payload = {COUNTS_PREFIX + block: value for block, value in counts.items()}
        payload.update({TOTALS_PREFIX + block: value for block, value in totals.items()})
        payload[STEPS_KEY] = torch.tensor(float(round_.steps))
        summary = [frequency_summary(activation_frequency(counts[b], totals[b])) for b in counts]
        state[METRICS_KEY] = {
            'flame_freq_min': mean(s[0] for s in summary),
            'flame_freq_median': mean(s[1] for s in summary),
            'flame_freq_max': mean(s[2] for s in summary),
            'flame_top_k': float(state['routing'].top_k)}
        return payload

    def extra_payload_shapes(self, model, cfg):
        """Per MoE block, its (E,) counts and () total (float64), and the steps (float32)."""
        tracker = model.flame_routing
        shapes = {COUNTS_PREFIX + n: ((tracker.num_experts[n],), torch.float64) for n in tracker.names}
        shapes.update({TOTALS_PREFIX + n: ((), torch.float64) for n in tracker.names})
        shapes[STEPS_KEY] = ()
        return shapes

    def client_metrics(self, model, state) -> dict[str, float]:
        """This round's activation-frequency summary (min / median / max over the experts of a
        layer, averaged over the MoE layers) and k_i; set by `client_extra`."""
        return dict(state.get(METRICS_KEY, {}))


def _per_block(update, prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in update.extra.items() if k.startswith(prefix)}


def counts_of(update) -> dict[str, torch.Tensor]:
    """{MoE block: (E,) counts} from one client's payload."""
    return _per_block(update, COUNTS_PREFIX)


def totals_of(update) -> dict[str, torch.Tensor]:
    """{MoE block: () total of the counts} from one client's payload."""
    return _per_block(update, TOTALS_PREFIX)


def experts_per_block(updates) -> dict[str, int]:
    """{MoE block name: E} from the clients' activation-count payloads."""
    return {block: int(v.numel()) for u in updates for block, v in counts_of(u).items()}


def log_activation(update, reading: str) -> None:
    """One line per client and round: min / median / max of a/S over each MoE layer's experts."""
    counts, totals = counts_of(update), totals_of(update)
    parts = []
    for block in counts:
        low, mid, high = frequency_summary(activation_frequency(counts[block], totals[block]))
        parts.append(f'{block.rsplit("layers.", 1)[-1]}: {low:.3f}/{mid:.3f}/{high:.3f}')
    logger.info(f'FLAME client {update.client_id}: activation frequency a/S ({reading}) '
                f'min/median/max per MoE layer: ' + ', '.join(parts))


@dataclass
class FlameConfig:
    activation: str = option('token', 'activation frequency a/S of Eq. 6 (paper §3): token = expert '
                                      "j's share of the client's routed token slots (non-padding "
                                      'tokens × k_i) over the round; step = steps in which j was '
                                      'selected for some token / S_i (saturates at 1 with large '
                                      'batches, then Eq. 6 is FedAvg)', choices=ACTIVATION_READINGS)
    temperature: float = option(2.0, 'temperature t of γ = (a/S)^t · |D| (paper Eq. 6; 0 = FedAvg; '
                                     'the paper finds t = 2..4 best, §5 Figure 3)', ge=0)
    rescale: str = option('learnable', 'rescaler s_i: learnable scalar (init 1), static k/k_i, or '
                                       'none (paper Table 5)', choices=RESCALE_MODES)
    rescaler_per: str = option('layer', "learnable rescaler: one per MoE 'layer' or one per "
                                        "'client' shared by all layers", choices=('layer', 'client'))
    top_k: int = option(0, "this client's active experts k_i (set per client in --client_cfg); "
                           '0 = the level the server assigns from budget_levels', ge=0)
    budget_levels: list[int] = option([8, 4, 2, 1], 'budget levels β1..βn as active experts '
                                                    '(paper A1.2: k ∈ {8, 4, 2, 1}); client c gets '
                                                    'budget_levels[(c-1) % n]', ge=1, min_items=1)


@register_method
class Flame(ExpertRoutingMethod):
    name = 'flame'
    robust_aggregation_refusal = "its expert factors are weighted by each client's activation counts"
    summary = ('FLAME on sparse-MoE models (OLMoE): LoRA on every expert (peft '
               'target_parameters), client i routes to k_i experts (training and evaluation), a '
               'client-local rescaler on the MoE output, activation-aware aggregation γ_i^j = '
               '(a_i^j/S_i)^t·|D_i| per expert; an expert nobody activated keeps its global value')
    sent = 'A, B + per-layer expert activation counts and their total / A, B + k_i'
    config_class = FlameConfig
    hf_export_refusal = ("the client's rescalers (forward hooks on the MoE blocks) and its "
                         "top-k are not part of a Hugging Face OLMoE")

    # ------------------------------------------------------------------ client
    def adapt_model(self, model, cfg):
        model = super().adapt_model(model, cfg)
        install_rescaler(model.flame_routing.blocks, self.hparams.rescale,
                         per_layer=self.hparams.rescaler_per == 'layer')
        if self.hparams.top_k > 0:
            self._apply_top_k(model, self.hparams.top_k)
        return model

    def _apply_top_k(self, model, k: int) -> None:
        routing = model.flame_routing
        if not 1 <= k <= routing.full_top_k:
            raise ConfigError(f"FLAME top-k {k} (fsplug.flame.top_k or budget_levels) must be "
                              f"between 1 and the model's num_experts_per_tok {routing.full_top_k}")
        routing.set_top_k(k)
        if self.hparams.rescale == 'static':
            set_static_scale(routing.blocks, routing.full_top_k / k)

    def is_shared(self, name):
        return RESCALE_NAME not in name

    def receive(self, model, content, state):
        content = dict(content)
        assigned = content.pop(DEFAULT_TOP_K_KEY, None)
        if self.hparams.top_k == 0 and assigned is not None and int(assigned) != model.flame_routing.top_k:
            self._apply_top_k(model, int(assigned))
        load_tensors(model, content)

    def artifact_extra(self, model, state):
        # the top-k the server assigned (budget levels) is part of the client's model
        return {ARTIFACT_TOP_K: torch.tensor(model.flame_routing.top_k)}

    def restore_artifact(self, model, extra):
        k = extra.get(ARTIFACT_TOP_K)
        if k is not None and int(k) != model.flame_routing.top_k:
            self._apply_top_k(model, int(k))

    # ------------------------------------------------------------------ server
    def aggregate(self, server_state, updates):
        for update in updates:
            log_activation(update, self.activation)
        merged = activation_aware_average(
            server_state['global'], [u.shared for u in updates], weights_of(updates),
            [counts_of(u) for u in updates], [totals_of(u) for u in updates],
            self.hparams.temperature)
        return {**server_state, 'global': {**server_state['global'], **merged}}

    def content_for(self, server_state, client_id):
        levels = self.hparams.budget_levels
        level = levels[(int(client_id) - 1) % len(levels)]
        return {**server_state['global'], DEFAULT_TOP_K_KEY: torch.tensor(level)}

    def client_groups(self, client_ids) -> dict[str, list[int]]:
        """Clients by budget level, as the server assigns them (paper Tables 2-3 report β1..βn):
        {'β1 (k=8)': [1, 5, …], …}. A client's own fsplug.flame.top_k is not reflected here
        (its actual k_i is the 'flame_top_k' train metric)."""
        levels = self.hparams.budget_levels
        groups = {}
        for index, level in enumerate(levels):
            members = sorted(int(c) for c in client_ids if (int(c) - 1) % len(levels) == index)
            if members:
                groups[f'β{index + 1} (k={level})'] = members
        return groups

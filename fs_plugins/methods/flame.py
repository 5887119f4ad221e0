"""FLAME (resource-adaptive federated LoRA on sparse mixture-of-experts LLMs), and the two
mixed-rank baselines applied expert by expert on the same MoE model.

FLAME: every client trains the full-rank LoRA of every expert (peft `target_parameters` on the
fused expert tensors, fsplug.model.lora.target_parameters) but its router selects only k_i
experts per token (`fsplug.flame.top_k` from --client_cfg, else the budget level the server
assigns round-robin by client id from `fsplug.flame.budget_levels`). The MoE block's output is
multiplied by a client-local rescaler (`rescale`: learnable scalar init 1 — one per MoE layer or
one per client, `rescaler_per` —, static k/k_i, or none). Each client counts, per layer and
expert, the local steps in which the expert was selected for at least one (non-padding) token
and sends the counts beside its update; the server averages each expert's LoRA slices with
activation-aware weights (fs_plugins.aggregation.activation) and every other shared tensor with
sample-weighted FedAvg.

`hetlora_experts` / `flexlora_experts`: HetLoRA / FlexLoRA with per-client ranks where a fused
expert factor is split into one rank-r LoRA pair per expert, so truncation, padding and SVD act
on each expert's own factors (the plain `hetlora` / `flexlora` would treat the fused E·r rows
as one rank-(E·r) factor). All k experts stay active for them.
"""
from __future__ import annotations

import re
from functools import partial

import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.activation import (activation_aware_weights,
                                               aggregate_expert_factor, merge_experts,
                                               split_experts)
from fs_plugins.aggregation.pairs import A_TAG, B_TAG, fit_rank, is_lora_factor
from fs_plugins.config import ConfigError
from fs_plugins.methods.base import ClientUpdate, Method, load_tensors
from fs_plugins.methods.flexlora import FlexLoRA
from fs_plugins.methods.hetlora import HetLoRA
from fs_plugins.methods.registry import register_method

COUNTS_PREFIX = 'flame.counts.'       # + MoE block name: (E,) activated-step counts
STEPS_KEY = 'flame.steps'             # local steps S_i of the round
DEFAULT_TOP_K_KEY = 'flame.top_k'     # server -> client: the budget level assigned by id
EXPERTS_TAG = '.experts.'
RESCALE_NAME = 'flame_rescale'
_VIRTUAL_EXPERT = re.compile(r'\.expert(\d+)(\.lora_[AB]\.)')


# ------------------------------------------------------------------ routing on the client

def moe_blocks(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every sparse MoE block: a `gate` router with `top_k` and `experts`."""
    return [(name, module) for name, module in model.named_modules()
            if hasattr(module, 'experts') and hasattr(getattr(module, 'gate', None), 'top_k')]


def is_expert_factor(key: str) -> bool:
    return EXPERTS_TAG in key and is_lora_factor(key)


def block_of(key: str) -> str:
    return key.split(EXPERTS_TAG)[0]


class RoutingTracker:
    """Per-client routing bookkeeping: router top-k and activated-step counts per MoE block."""

    def __init__(self, blocks):
        self.blocks = [module for _, module in blocks]
        self.names = [name for name, _ in blocks]
        self.num_experts = {name: int(m.gate.num_experts) for name, m in blocks}
        self.full_top_k = int(self.blocks[0].gate.top_k)
        width = max(self.num_experts.values())
        self.counts = torch.zeros(len(blocks), width, dtype=torch.int64)
        self.steps = 0
        self.step_mask = self.token_mask = None
        for layer, (_, module) in enumerate(blocks):
            module.gate.register_forward_hook(partial(self._record, layer))

    @property
    def top_k(self) -> int:
        return int(self.blocks[0].gate.top_k)

    def set_top_k(self, k: int) -> None:
        for block in self.blocks:
            block.gate.top_k = int(k)

    def start_step(self, attention_mask) -> None:
        self.step_mask = torch.zeros_like(self.counts, dtype=torch.bool)
        self.token_mask = None if attention_mask is None else attention_mask.reshape(-1).bool()

    def _record(self, layer, module, inputs, output) -> None:
        if self.step_mask is None or not module.training:
            return
        indices = output[2]  # (tokens, top_k) selected experts
        if self.token_mask is not None and self.token_mask.numel() == indices.shape[0]:
            indices = indices[self.token_mask.to(indices.device)]
        self.step_mask[layer, indices.reshape(-1).unique().cpu()] = True

    def end_step(self) -> None:
        if self.step_mask is not None:
            self.counts += self.step_mask
            self.steps += 1
        self.step_mask = self.token_mask = None

    def take_round(self) -> dict[str, torch.Tensor]:
        """The round's counts as a payload; resets them."""
        payload = {COUNTS_PREFIX + name: self.counts[layer, :self.num_experts[name]].float()
                   for layer, name in enumerate(self.names)}
        payload[STEPS_KEY] = torch.tensor(float(self.steps))
        self.counts.zero_()
        self.steps = 0
        return payload


class ExpertRoutingMethod(Method):
    """Installs the routing tracker and sends activation counts (all MoE methods here)."""

    def adapt_model(self, model, cfg):
        blocks = moe_blocks(model)
        if not blocks:
            raise ConfigError(f"fsplug.method = '{self.name}' needs a sparse MoE model (e.g. "
                              f"fsplug.model.builder: tiny_olmoe or olmoe); model.type = "
                              f"'{cfg.model.type}' has no MoE block")
        model.flame_routing = RoutingTracker(blocks)
        return model

    def init_client_state(self, model, cfg):
        return {'routing': model.flame_routing}

    def loss(self, model, batch, state):
        state['routing'].start_step(batch.get('attention_mask'))
        return model(**batch).loss

    def after_step(self, model, state):
        state['routing'].end_step()

    def client_extra(self, model, state):
        return state['routing'].take_round()


def experts_per_block(updates: list[ClientUpdate]) -> dict[str, int]:
    """{MoE block name: E} from the clients' activation-count payloads."""
    out = {}
    for update in updates:
        for key, value in update.extra.items():
            if key.startswith(COUNTS_PREFIX):
                out[key[len(COUNTS_PREFIX):]] = int(value.numel())
    return out


def _num_experts(key: str, experts: dict[str, int]) -> int:
    if block_of(key) not in experts:
        raise KeyError(f"'{key}': no client sent activation counts for MoE block "
                       f"'{block_of(key)}'")
    return experts[block_of(key)]


# ------------------------------------------------------------------------------- FLAME

@register_method
class Flame(ExpertRoutingMethod):
    name = 'flame'
    defaults = {
        # t in γ = (a/S)^t·|D|; 0 = FedAvg
        'temperature': 2.0,
        # learnable (scalar, init 1) | static (k/k_i) | none
        'rescale': 'learnable',
        # learnable rescaler: one per MoE 'layer' or one per 'client' shared by all layers
        'rescaler_per': 'layer',
        # active experts k_i of this client (set per client in --client_cfg); 0 = the level
        # the server assigns by client id from budget_levels
        'top_k': 0,
        # budget levels β1..βn as active experts; client c gets budget_levels[(c-1) % n]
        'budget_levels': [8, 4, 2, 1],
    }

    def __init__(self, cfg):
        super().__init__(cfg)
        hp = self.hparams
        for key, allowed in (('rescale', ('learnable', 'static', 'none')),
                             ('rescaler_per', ('layer', 'client'))):
            if hp[key] not in allowed:
                raise ConfigError(f"fsplug.flame.{key} = '{hp[key]}' is not one of: "
                                  f"{', '.join(allowed)}")
        if float(hp['temperature']) < 0:
            raise ConfigError(f"fsplug.flame.temperature must be >= 0, got {hp['temperature']}")
        levels = list(hp['budget_levels'])
        if not levels or any(int(k) < 1 for k in levels):
            raise ConfigError(f"fsplug.flame.budget_levels must be a non-empty list of "
                              f"positive expert counts, got {levels}")
        if int(hp['top_k']) < 0:
            raise ConfigError(f"fsplug.flame.top_k must be >= 0, got {hp['top_k']}")

    # ------------------------------------------------------------------ client
    def adapt_model(self, model, cfg):
        model = super().adapt_model(model, cfg)
        self._install_rescaler(model)
        if int(self.hparams['top_k']) > 0:
            self._apply_top_k(model, int(self.hparams['top_k']))
        return model

    def _install_rescaler(self, model) -> None:
        mode = self.hparams['rescale']
        if mode == 'none':
            return
        blocks = model.flame_routing.blocks
        dtype = blocks[0].gate.weight.dtype
        shared = torch.nn.Parameter(torch.ones((), dtype=dtype))
        for block in blocks:
            if mode == 'static':
                block.register_buffer(RESCALE_NAME, torch.ones((), dtype=dtype))
            else:
                per_layer = self.hparams['rescaler_per'] == 'layer'
                block.register_parameter(
                    RESCALE_NAME, torch.nn.Parameter(torch.ones((), dtype=dtype)) if per_layer else shared)
            block.register_forward_hook(_rescale_output)

    def _apply_top_k(self, model, k: int) -> None:
        routing = model.flame_routing
        if not 1 <= k <= routing.full_top_k:
            raise ConfigError(f"FLAME top-k {k} (fsplug.flame.top_k or budget_levels) must be "
                              f"between 1 and the model's num_experts_per_tok {routing.full_top_k}")
        routing.set_top_k(k)
        if self.hparams['rescale'] == 'static':
            with torch.no_grad():
                for block in routing.blocks:
                    getattr(block, RESCALE_NAME).fill_(routing.full_top_k / k)

    def is_shared(self, name):
        return RESCALE_NAME not in name

    def receive(self, model, content, state):
        content = dict(content)
        assigned = content.pop(DEFAULT_TOP_K_KEY, None)
        own = int(self.hparams['top_k'])
        if own == 0 and assigned is not None and int(assigned) != model.flame_routing.top_k:
            self._apply_top_k(model, int(assigned))
        load_tensors(model, content)

    # ------------------------------------------------------------------ server
    def aggregate(self, server_state, updates):
        sizes = [u.num_samples for u in updates]
        experts = experts_per_block(updates)
        shared_keys = set.intersection(*(set(u.shared) for u in updates))
        expert_keys = sorted(k for k in shared_keys if is_expert_factor(k))
        merged = weighted_average([{k: v for k, v in u.shared.items() if not is_expert_factor(k)}
                                   for u in updates], sizes)
        steps = [float(u.extra[STEPS_KEY]) for u in updates]
        weights = {}
        for key in expert_keys:
            block = block_of(key)
            if block not in weights:
                _num_experts(key, experts)
                counts = torch.stack([u.extra[COUNTS_PREFIX + block] for u in updates])
                weights[block] = activation_aware_weights(
                    counts, steps, sizes, float(self.hparams['temperature']))
            merged[key] = aggregate_expert_factor(key, [u.shared[key] for u in updates],
                                                  weights[block], server_state['global'].get(key))
        return {**server_state, 'global': {**server_state['global'], **merged}}

    def content_for(self, server_state, client_id):
        levels = list(self.hparams['budget_levels'])
        level = int(levels[(int(client_id) - 1) % len(levels)])
        return {**server_state['global'], DEFAULT_TOP_K_KEY: torch.tensor(level)}


def _rescale_output(module, inputs, output):
    scale = getattr(module, RESCALE_NAME)
    if isinstance(output, tuple):
        return (output[0] * scale,) + tuple(output[1:])
    return output * scale


# ------------------------------------------------- mixed-rank baselines, expert by expert

def _virtual_key(key: str, expert: int) -> str:
    tag = A_TAG if A_TAG in key else B_TAG
    return key.replace(tag, f'.expert{expert}{tag}', 1)


def unfuse(tensors: dict, experts: dict[str, int]) -> dict:
    """Fused expert factors -> one LoRA factor per expert under a virtual key
    ('….experts.expert<e>.lora_A.…'); other tensors unchanged."""
    out = {}
    for key, value in tensors.items():
        if not is_expert_factor(key):
            out[key] = value
            continue
        for e, factor in enumerate(split_experts(key, value, _num_experts(key, experts))):
            out[_virtual_key(key, e)] = factor
    return out


def fuse(tensors: dict) -> dict:
    """Inverse of `unfuse`."""
    out, stacks = {}, {}
    for key, value in tensors.items():
        match = _VIRTUAL_EXPERT.search(key)
        if match is None:
            out[key] = value
            continue
        fused_key = key[:match.start()] + match.group(2) + key[match.end():]
        stacks.setdefault(fused_key, {})[int(match.group(1))] = value
    for key, per_expert in stacks.items():
        out[key] = merge_experts(key, torch.stack([per_expert[e] for e in sorted(per_expert)]))
    return out


class ExpertwiseRanks(ExpertRoutingMethod):
    """Runs a mixed-rank method's aggregation on per-expert LoRA pairs."""

    def aggregate(self, server_state, updates):
        experts = experts_per_block(updates)
        split = [ClientUpdate(u.client_id, u.num_samples, unfuse(u.shared, experts), u.extra,
                              u.metrics) for u in updates]
        state = {**server_state, 'global': unfuse(server_state['global'], experts)}
        new_state = super().aggregate(state, split)
        return {**new_state, 'global': fuse(new_state['global'])}

    def receive(self, model, content, state):
        experts = state['routing'].num_experts
        params = dict(model.named_parameters())
        fitted = {}
        for key, value in content.items():
            target = params.get(key)
            if target is not None and is_expert_factor(key):
                stack = split_experts(key, value, experts[block_of(key)])
                own_rank = split_experts(key, target, experts[block_of(key)]).shape[
                    1 if A_TAG in key else 2]
                value = merge_experts(key, torch.stack([fit_rank(key, f, own_rank) for f in stack]))
            elif target is not None and is_lora_factor(key):
                rank = target.shape[0] if A_TAG in key else target.shape[1]
                value = fit_rank(key, value, rank)
            fitted[key] = value
        load_tensors(model, fitted)


@register_method
class HetLoRAExperts(ExpertwiseRanks, HetLoRA):
    name = 'hetlora_experts'
    defaults = dict(HetLoRA.defaults)


@register_method
class FlexLoRAExperts(ExpertwiseRanks, FlexLoRA):
    name = 'flexlora_experts'

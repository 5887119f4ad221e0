"""FedAdapter (Cai et al., "FedAdapter: Efficient Federated Learning for Modern NLP", MobiCom
2022): bottleneck adapters whose configuration, depth (how many of the top layers carry an
active adapter) and width (its bottleneck units), starts small and grows during training.

The paper's choices:
- adapters on the top layers only, small first, deeper and wider later (its "progressive
  training"); start at depth 1, width 8; trials one layer deeper and 8 units wider (the official
  trial_error.py: --depth 1, --width 8, --step 1, width + 8, width at most 64);
- trial groups (its "sideline trials"): each round the participants train, in groups, the
  current, the wider and the deeper configuration; the server keeps one global per configuration and after each
  trial interval continues from the configuration whose group did best, whose global every
  configuration inherits (trial_error.py: inherit_model; ties: current, wider, deeper).

Ours, where the paper is silent or does not fit this framework:
- the interval is `trial_rounds` rounds (the paper's is wall-clock time from a device latency
  model); a group's score is its clients' mean training loss in the interval's last round,
  lower is better (the paper compares the trial models' test accuracy; the server has no
  evaluation data here);
- the groups rotate every round (fs_plugins.aggregation.fedadapter.trial_index);
- fixed shapes: every layer's target modules carry an adapter of `max_width` units from the
  start and a configuration is a selection of them (the server, checkpoints, messages and saved
  models expect the same tensors every round); a client trains only its configuration's layers,
  the unused units are sliced off in the forward pass, and the server averages each
  configuration's active slice only;
- what travels (the paper's communication saving, at tensor granularity): a client uploads only
  the adapters of its configuration's layers, whole (`max_width` units; the unused units are
  unchanged), and the server accepts exactly those (`expected_upload`, from the configuration
  it sent); each configuration's average of a tensor is over its clients that sent it;
- the last round's content (final evaluation and saved models) is the current configuration's
  global for every client; the evaluation content of earlier rounds is the client's trial
  configuration of the next round.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fs_plugins.aggregation.fedadapter import (
    best_config,
    masked_average,
    top_layers,
    trial_configs,
    trial_index,
    width_mask,
)
from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.base import Contract, Method, Phase, load_tensors, weights_of
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option
from fs_plugins.tuners.fedadapter import ADAPTER_TAG, AdapterConfig, inject_adapters, layer_of, set_active

CONFIG_KEY = 'fedadapter.config'   # the (depth, width) a content or saved model uses


@dataclass
class FedAdapterConfig:
    target_modules: list[str] = option(
        ['o_proj', 'down_proj'], 'modules (last name component) whose output gets a bottleneck '
        "adapter: the attention output and the feed-forward output, Houlsby et al.'s places "
        '(FedAdapter, its adapter background)')
    max_width: int = option(64, 'fixed adapter width; a configuration uses its first `width` units '
                                '(FedAdapter official code: the wider trial stops at 64)', ge=1)
    start_depth: int = option(1, 'layers (from the top) with an active adapter at the start '
                                 '(FedAdapter, progressive training; official code --depth 1)', ge=1)
    start_width: int = option(8, 'adapter units in use at the start (FedAdapter, progressive training; official '
                                 'code --width 8)', ge=1)
    depth_step: int = option(1, 'layers the deeper trial configuration adds (FedAdapter, sideline trials; '
                                'official code --step 1)', ge=1)
    width_step: int = option(8, 'units the wider trial configuration adds (FedAdapter, sideline trials; '
                                'official code width + 8)', ge=1)
    trial_rounds: int = option(10, 'rounds of one trial interval, after which the best trial '
                                   'configuration becomes the current one (ours: the paper '
                                   'measures the interval in wall-clock time)', ge=1)


def config_key(config) -> str:
    return f'{int(config[0])},{int(config[1])}'


def config_of(key: str) -> tuple[int, int]:
    depth, width = key.split(',')
    return int(depth), int(width)


def width_axis(name: str) -> int | None:
    """The axis of an adapter tensor that runs over the bottleneck units (None: none does)."""
    if name.endswith(('down.weight', 'down.bias')):
        return 0
    return 1 if name.endswith('up.weight') else None


def active_layers(names, depth: int) -> set[int]:
    """The top `depth` of the layers whose adapters `names` (parameter names) hold."""
    return top_layers([layer_of(n) for n in names if ADAPTER_TAG in n], depth)


def in_layers(name: str, layers: set[int]) -> bool:
    """Whether parameter `name` belongs to a configuration whose adapters are on `layers`
    (every non-adapter tensor does): what such a client trains and sends."""
    return ADAPTER_TAG not in name or layer_of(name) in layers


def active_masks(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """{name: bool mask}: the elements configuration (depth, width) trains."""
    depth, width = config
    layers = active_layers(tensors, depth)
    masks = {}
    for name, tensor in tensors.items():
        if not in_layers(name, layers):
            masks[name] = torch.zeros(tensor.shape, dtype=torch.bool)
        else:
            axis = width_axis(name) if ADAPTER_TAG in name else None
            masks[name] = width_mask(tuple(tensor.shape), axis, width)
    return masks


@register_method
class FedAdapter(Method):
    name = 'fedadapter'
    summary = ('bottleneck adapters on the top layers, depth and width grown by trial groups '
               '(current / wider / deeper), the best group\'s configuration kept (Cai et al., '
               'MobiCom 2022)')
    sent = ('its configuration\'s layers\' adapters / its trial configuration\'s global adapters '
            '+ (depth, width)')
    config_class = FedAdapterConfig
    uses_peft_adapter = False
    hf_export_refusal = 'its bottleneck adapters are forward hooks of its own, not a peft adapter'
    robust_aggregation_refusal = ('it averages each trial configuration\'s clients over that '
                                  'configuration\'s active units only')
    # a client's layers outside its configuration's depth neither train nor travel in a round
    contract = Contract(depth_options=('start_depth',), gated_trains=(f'*{ADAPTER_TAG}*',))

    def __init__(self, cfg):
        super().__init__(cfg)
        # client side: the adapted layers' indices (set by adapt_model), the configuration in
        # use, and the layers of the one the server assigned (set by receive; None before any:
        # every adapter is shared, as the server's signature and initial global expect)
        self.layers: list[int] = []
        self.active = (self.hparams.start_depth, self.hparams.start_width)
        self.assigned_layers: set[int] | None = None

    @classmethod
    def config_problems(cls, hparams, cfg):
        if hparams.start_width > hparams.max_width:
            return [f'fsplug.fedadapter.start_width = {hparams.start_width} exceeds '
                    f'fsplug.fedadapter.max_width = {hparams.max_width}']
        if cfg['fsplug']['aggregation']['per_architecture']:
            return ['fsplug.aggregation.per_architecture: FedAdapter clients send only their '
                    'configuration\'s layers, so what a client sends does not identify its model '
                    '(use one model for every client)']
        return []

    # ------------------------------------------------------------------ model
    def adapt_model(self, model, cfg):
        h = self.hparams
        try:
            adapters = inject_adapters(model, AdapterConfig(tuple(h.target_modules), h.max_width))
        except ValueError as exc:
            raise ConfigError(f'fsplug.fedadapter.target_modules = {list(h.target_modules)}: '
                              f'{exc}') from exc
        self.layers = sorted({layer_of(n) for n in adapters})
        if h.start_depth > len(self.layers):
            raise ConfigError(f'fsplug.fedadapter.start_depth = {h.start_depth} exceeds the '
                              f"model's {len(self.layers)} adapted layers")
        self._activate(model, (h.start_depth, h.start_width))
        return model

    def _activate(self, model, config) -> None:
        set_active(model, *config)
        self.active = (int(config[0]), int(config[1]))

    # ----------------------------------------------------------------- client
    def phases(self, num_steps, cfg):
        active = top_layers(self.layers, self.active[0])
        return [Phase('train', num_steps, lambda name: in_layers(name, active))]

    def is_shared(self, name):
        return self.assigned_layers is None or in_layers(name, self.assigned_layers)

    def receive(self, model, content, state):
        config = content.get(CONFIG_KEY)
        if config is not None:
            self._activate(model, config.tolist())
            self.assigned_layers = top_layers(self.layers, self.active[0])
        load_tensors(model, {n: v for n, v in content.items() if n != CONFIG_KEY})

    def artifact_extra(self, model, state):
        return {CONFIG_KEY: torch.tensor(self.active, dtype=torch.int64)}

    def restore_artifact(self, model, extra):
        self.receive(model, extra, {})

    # ----------------------------------------------------------------- server
    def init_server_state(self, initial_shared):
        h = self.hparams
        start = (h.start_depth, h.start_width)
        return {'global': dict(initial_shared), 'current': list(start), 'round': 0,
                'trials': {config_key(c): dict(initial_shared) for c in self._trials(start, initial_shared)},
                'losses': {}}

    def _trials(self, current, tensors) -> list[tuple[int, int]]:
        h = self.hparams
        num_layers = len({layer_of(n) for n in tensors if ADAPTER_TAG in n})
        return trial_configs(tuple(current), num_layers, h.max_width, h.depth_step, h.width_step)

    def aggregate(self, server_state, updates):
        current, round_idx = tuple(server_state['current']), server_state['round']
        trials = self._trials(current, server_state['global'])
        trial_globals, losses = dict(server_state['trials']), dict(server_state['losses'])
        for i, config in enumerate(trials):
            members = [u for u in updates if trial_index(u.client_id, round_idx, len(trials)) == i]
            if not members:
                continue
            key, weights = config_key(config), weights_of(members)
            previous = trial_globals[key]
            trial_globals[key] = {**previous, **masked_average(
                previous, [u.shared for u in members], weights, active_masks(previous, config))}
            losses[key] = sum(float(u.metrics.get('train_avg_loss', float('nan'))) * w
                              for u, w in zip(members, weights)) / sum(weights)
        round_idx += 1
        if round_idx % self.hparams.trial_rounds == 0:
            scored = {config_of(k): v for k, v in losses.items() if v == v}   # NaN: no loss
            current = best_config(trials, scored)
            winner = trial_globals[config_key(current)]
            trial_globals = {config_key(c): dict(winner) for c in self._trials(current, winner)}
            losses = {}
        return {'global': trial_globals[config_key(current)], 'current': list(current),
                'round': round_idx, 'trials': trial_globals, 'losses': losses}

    def content_for(self, server_state, client_id):
        current, round_idx = tuple(server_state['current']), server_state['round']
        config = current
        if round_idx < int(self.cfg.federate.total_round_num):
            trials = self._trials(current, server_state['global'])
            config = trials[trial_index(client_id, round_idx, len(trials))]
        tensors = server_state['trials'].get(config_key(config), server_state['global'])
        return {**tensors, CONFIG_KEY: torch.tensor(config, dtype=torch.int64)}

    def expected_upload(self, signature, sent):
        """The adapters of the layers of the configuration the server sent, and every
        non-adapter tensor of the signature."""
        config = None if sent is None else sent.get(CONFIG_KEY)
        if config is None:
            return signature
        layers = active_layers(signature, int(config[0]))
        return {name: entry for name, entry in signature.items() if in_layers(name, layers)}

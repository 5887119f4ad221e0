"""The server's side of a run, shared by the FS server worker and the embedded runner:
client sampling, per-client content, aggregation through the method, results logging."""
from __future__ import annotations

import logging

import numpy as np
import torch

from fs_plugins.aggregation.average import client_weights
from fs_plugins.aggregation.signature import signature_of, tensor_signature
from fs_plugins.core.seeding import derive_seed, use_deterministic_algorithms
from fs_plugins.methods.base import ClientUpdate, Method
from fs_plugins.methods.building import build_model
from fs_plugins.models.builders import architecture_only
from fs_plugins.run.artifacts import global_dir, save_global_state
from fs_plugins.run.config import to_plain
from fs_plugins.run.privacy import broadcast_sigma, nbafl_settings, private_broadcast
from fs_plugins.run.results import ResultsLog, payload_bytes
from fs_plugins.run.validation import update_problem

logger = logging.getLogger(__name__)


def sample_clients(seed: int, round_idx: int, client_ids, k: int) -> list[int]:
    """k clients for a round, seeded by the run seed and the round (all when k >= count)."""
    ids = sorted(client_ids)
    if k <= 0 or k >= len(ids):
        return ids
    rng = np.random.default_rng(derive_seed(seed, 'sample', round_idx))
    return sorted(int(c) for c in rng.choice(ids, size=k, replace=False))


class ServerProcedure:
    def __init__(self, cfg, method: Method, initial_shared: dict, results: ResultsLog,
                 layout=None):
        """layout: the global model's `artifacts.ModelLayout` (for saving the global state)."""
        self.cfg, self.method, self.results, self.layout = cfg, method, results, layout
        use_deterministic_algorithms(bool(cfg.fsplug.train.deterministic))
        results.client_groups = method.client_groups
        self.state = method.init_server_state(initial_shared)
        self.bytes_down: dict[int, int] = {}
        # fsplug.aggregation.per_architecture: one state per model architecture; `state` is
        # the run's own architecture's
        self.per_architecture = bool(cfg.fsplug.aggregation.per_architecture)
        self.own_signature = tensor_signature(initial_shared)
        self.other_states: dict[tuple, dict] = {}
        self.client_signature: dict[int, tuple] = {}
        self.rejections: list[dict] = []   # {'round', 'client', 'reason'} of rejected updates
        # whether method.client_configs holds every client's override (not so for a
        # distributed server, which may not have the clients' --client_cfg)
        self.all_client_configs_known = True
        self._expected: dict[int, dict | None] = {}
        self.nbafl = nbafl_settings(cfg)
        # NbAFL's m: each client's training records, as its updates report them
        self.dataset_sizes: dict[int, int] = {}
        self.content_round = 0   # the training round whose content content_for gives

    def sample(self, round_idx: int, client_ids) -> list[int]:
        self.content_round = round_idx
        return sample_clients(self.cfg.seed, round_idx, client_ids,
                              int(self.cfg.federate.sample_client_num))

    def content_for(self, client_id: int, for_training: bool = True) -> dict:
        content = self.method.content_for(self._state_of(client_id), client_id)
        if for_training:
            content = self.private_content(content)
            self.bytes_down[client_id] = payload_bytes(content)
        return content

    def private_content(self, content: dict) -> dict:
        """nbafl.use: a training round's content with NbAFL's downlink noise
        (fs_plugins.run.privacy); the state itself stays noise-free. Before any update the
        content is the initial state, which holds no client's data, and goes as it is."""
        if self.nbafl is None:
            return content
        if not self.dataset_sizes:
            if self.content_round > 0 and broadcast_sigma(self.nbafl, 1) > 0:
                raise RuntimeError(
                    f'nbafl: round {self.content_round}: no client training-set size known '
                    f"for the server's noise (NbAFL's m); a resumed run needs them in the "
                    f'server checkpoint')
            return content
        return private_broadcast(content, self.nbafl, min(self.dataset_sizes.values()),
                                 self.cfg.seed, self.content_round)

    def aggregate(self, round_idx: int, updates: list[ClientUpdate]) -> None:
        """Aggregates the round's valid updates (invalid ones are logged and left out)."""
        updates = sorted(updates, key=lambda u: u.client_id)
        self.content_round = round_idx + 1
        for update in updates:
            sent = payload_bytes(update.shared) + payload_bytes(update.extra)
            self.results.log_train(round_idx, update.client_id, update.num_samples, sent,
                                   self.bytes_down.pop(update.client_id, 0), update.metrics)
            if update.dataset_size >= 1:
                self.dataset_sizes[update.client_id] = int(update.dataset_size)
        updates = self.accepted(round_idx, updates)
        if not updates:
            logger.warning(f'fsplug: round {round_idx}: no valid update, the state is unchanged')
            return
        weights = client_weights(self.cfg.fsplug.aggregation.weights,
                                 [u.dataset_size for u in updates], [u.num_samples for u in updates])
        for update, weight in zip(updates, weights):
            update.weight = weight
        if not self.per_architecture:
            self.state = self.method.aggregate(self.state, updates)
            return
        groups: dict[tuple, list[ClientUpdate]] = {}
        for update in updates:
            signature = tensor_signature(update.shared)
            self.client_signature[update.client_id] = signature
            groups.setdefault(signature, []).append(update)
        for signature, members in groups.items():
            if signature == self.own_signature:
                self.state = self.method.aggregate(self.state, members)
            else:   # another architecture: its state starts from its first update
                state = self.other_states.get(signature) or self.method.init_server_state(
                    {n: t.clone() for n, t in members[0].shared.items()})
                self.other_states[signature] = self.method.aggregate(state, members)

    def accepted(self, round_idx: int, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """The updates that pass fs_plugins.run.validation; each rejection is logged (warning and
        a 'rejected' results row naming the client and the reason)."""
        max_norm = float(self.cfg.fsplug.validation.max_update_norm)
        kept = []
        for update in updates:
            expected = self.expected_shapes(update.client_id)
            reason = update_problem(update.shared, update.extra, expected, max_norm)
            if reason is None:
                if expected is None:   # trusted from now on: later updates must match it
                    self._expected[update.client_id] = signature_of(update.shared)
                kept.append(update)
                continue
            self.reject(round_idx, update.client_id, reason)
        return kept

    def reject(self, round_idx: int, client_id: int, reason: str) -> None:
        """Leaves client `client_id`'s update of this round out, with a warning and a
        'rejected' results row."""
        logger.warning(f'fsplug: round {round_idx}: update of client {client_id} '
                       f'rejected: {reason}')
        self.rejections.append({'round': round_idx, 'client': client_id, 'reason': reason})
        self.results.log_rejection(round_idx, client_id, reason)

    def expected_shapes(self, client_id: int) -> dict | None:
        """The shared tensors client `client_id` sends: the run's own when its config is the
        run's, else those of its own model (built on the meta device from its config); None
        when that cannot be known here (the first valid update then sets them)."""
        if client_id not in self._expected:
            self._expected[client_id] = self._shapes_from_config(client_id)
        return self._expected[client_id]

    def _shapes_from_config(self, client_id: int) -> dict | None:
        client_cfg = self.method.client_configs.get(client_id)
        if not self.own_signature:   # the server was given no model to compare with
            return None
        if client_cfg is None:   # no override: the run's model, if every override is known
            known = self.all_client_configs_known and not self.per_architecture
            return dict(self.own_signature) if known else None
        if to_plain(client_cfg) == to_plain(self.cfg):
            return dict(self.own_signature)
        return client_shared_shapes(client_cfg, type(self.method))

    def _state_of(self, client_id: int) -> dict:
        """The server state whose content client `client_id` receives."""
        if not self.per_architecture:
            return self.state
        signature = self.client_signature.get(client_id)
        if signature is None:   # not reported yet: it keeps its own initial adapters
            return self.method.init_server_state({})
        return self.state if signature == self.own_signature else self.other_states[signature]

    def should_evaluate(self, rounds_done: int) -> bool:
        total = int(self.cfg.federate.total_round_num)
        freq = max(int(self.cfg.eval.freq), 1)
        return rounds_done % freq == 0 or rounds_done == total

    def should_save(self, rounds_done: int) -> bool:
        return self.should_save_round(self.cfg, rounds_done)

    @staticmethod
    def should_save_round(cfg, rounds_done: int) -> bool:
        """Models are written at the end and every fsplug.save.freq rounds (0: end only)."""
        freq = int(cfg.fsplug.save.freq)
        return rounds_done == int(cfg.federate.total_round_num) or (
            freq > 0 and rounds_done % freq == 0)

    def save_global(self, run_dir: str, round_idx: int) -> int:
        """Writes the global shared state under `run_dir`/adapters/global/ (fs_plugins.run.artifacts)."""
        return save_global_state(global_dir(run_dir), round_idx, self.cfg, self.method,
                                 self.state['global'], self.layout)


def client_shared_shapes(client_cfg, method_cls) -> dict | None:
    """Names and shapes of what a client with `client_cfg` shares, from its model built on the
    meta device (no weight read); None when it cannot be built so."""
    try:
        method = method_cls(client_cfg)
        with architecture_only(device='meta'):
            built = build_model(client_cfg, method, share_frozen=False)
        with _StayOnMeta():
            return signature_of(method.shared_tensors(built.model, built.trainable_names))
    except Exception as exc:   # noqa: BLE001 -- any builder: fall back to the first update
        logger.info(f'fsplug: shapes of a client model not known before its update ({exc})')
        return None


class _StayOnMeta(torch.overrides.TorchFunctionMode):
    """`Tensor.to(...)` of a meta tensor returns it unchanged (methods copy what they share to
    the CPU; on the meta device only the shapes are wanted)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to and args and getattr(args[0], 'is_meta', False):
            return args[0]
        return func(*args, **(kwargs or {}))


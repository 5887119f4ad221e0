"""The server's side of a run, shared by the FS server worker and the embedded runner:
client sampling, per-client content, aggregation through the method, results logging.

Every update is checked before it is used (fs_plugins.run.validation) against what the server
itself knows: the tensors of the model it builds for that client (never what a client sent
earlier) and the content it sent that client; a bad update is a rejection, and the round goes on
with the others. Aggregation weights use training-set sizes capped at what the server knows,
and fsplug.aggregation.robust bounds what one client can move (fs_plugins.aggregation.robust)."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from fs_plugins.aggregation.average import capped_dataset_size, client_weights
from fs_plugins.aggregation.robust import RobustAverage, clip_update, robust_averaging
from fs_plugins.aggregation.signature import tensor_signature
from fs_plugins.core.errors import ConfigError
from fs_plugins.core.seeding import derive_seed, use_deterministic_algorithms
from fs_plugins.methods.base import ClientUpdate, Method
from fs_plugins.methods.building import build_model
from fs_plugins.models.builders import architecture_only
from fs_plugins.run.artifacts import global_dir, save_global_state
from fs_plugins.run.config import to_plain
from fs_plugins.run.privacy import broadcast_sigma, nbafl_settings, private_broadcast
from fs_plugins.run.results import ResultsLog, payload_bytes
from fs_plugins.run.validation import (
    UpdateChecks,
    checked_problem,
    count_problem,
    signature_problem,
    typed_signature,
)
from fs_plugins.schema.validate import robust_problems

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
        problems = robust_problems(type(method), cfg)
        if problems:
            raise ConfigError(problems)
        robust = cfg.fsplug.aggregation.robust
        self.robust = RobustAverage(str(robust.average), float(robust.trim_fraction))
        use_deterministic_algorithms(bool(cfg.fsplug.train.deterministic))
        results.client_groups = method.client_groups
        self.state = method.init_server_state(initial_shared)
        self.bytes_down: dict[int, int] = {}
        # fsplug.aggregation.per_architecture: one state per model architecture; `state` is
        # the run's own architecture's
        self.per_architecture = bool(cfg.fsplug.aggregation.per_architecture)
        self.own_signature = tensor_signature(initial_shared)
        self.own_typed_signature = typed_signature(initial_shared)
        # a server given no model at all (tests of the maths) has no signature to check with
        self.checks_signature = bool(initial_shared) or layout is not None
        self.other_states: dict[tuple, dict] = {}
        self.client_signature: dict[int, tuple] = {}
        self.rejections: list[dict] = []   # {'round', 'client', 'reason'} of rejected updates
        # whether method.client_configs holds every client's override (not so for a
        # distributed server, which may not have the clients' --client_cfg): a client without
        # one is expected to send the run's own model, as the server builds it
        self.all_client_configs_known = True
        self._expected: dict[int, dict | None] = {}   # client -> typed_signature
        self._unbuildable: set[int] = set()   # clients whose model the server cannot build
        # client -> the training content it was last sent (its update's deltas are against it)
        self.sent: dict[int, dict] = {}
        # client -> its training-set size where the server knows its split (the runner sets it)
        self.known_dataset_sizes: dict[int, int] = {}
        self.nbafl = nbafl_settings(cfg)
        # NbAFL's m: each client's training records, as its accepted updates report them
        self.dataset_sizes: dict[int, int] = {}
        self.content_round = 0   # the training round whose content content_for gives
        self.round_times: dict | None = None   # the open round's server row (`finish_round`)

    def sample(self, round_idx: int, client_ids) -> list[int]:
        """The round's clients; the round's clock starts here (`finish_round` logs it)."""
        self.finish_round()
        self.round_times = {'round': round_idx, 'started': time.perf_counter(),
                            'aggregate_s': 0.0, 'encode_s': 0.0, 'decode_s': 0.0}
        self.content_round = round_idx
        return sample_clients(self.cfg.seed, round_idx, client_ids,
                              int(self.cfg.federate.sample_client_num))

    @property
    def evaluates_received_content(self) -> bool:
        return evaluates_received_content(self.cfg)

    def content_for(self, client_id: int, for_training: bool = True) -> dict:
        content = self.method.content_for(self._state_of(client_id), client_id)
        if for_training:
            content = self.private_content(content)
            self.bytes_down[client_id] = payload_bytes(content)
            self.sent[client_id] = content
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

    def add_wire_times(self, encode_s: float = 0.0, decode_s: float = 0.0) -> None:
        """Seconds the server's transport spent encoding content and decoding updates in
        the open round (FS's wire; the embedded runner has none)."""
        if self.round_times is not None:
            self.round_times['encode_s'] += encode_s
            self.round_times['decode_s'] += decode_s

    def finish_round(self) -> None:
        """Logs the open round's server row (aggregate_s, encode_s, decode_s, and round_s:
        wall seconds from `sample` to now), if a round is open. The runners call it once the
        round's evaluation and saving are done, before a checkpoint counts the rows."""
        if self.round_times is None:
            return
        times, self.round_times = self.round_times, None
        round_s = time.perf_counter() - times.pop('started')
        self.results.log_server(times.pop('round'), {**times, 'round_s': round_s})

    def aggregate(self, round_idx: int, updates: list[ClientUpdate]) -> None:
        """Aggregates the round's valid updates (invalid ones are logged and left out);
        its seconds, validation included, are the round's aggregate_s."""
        started = time.perf_counter()
        try:
            self._aggregate(round_idx, updates)
        finally:
            if self.round_times is not None:
                self.round_times['aggregate_s'] += time.perf_counter() - started

    def _aggregate(self, round_idx: int, updates: list[ClientUpdate]) -> None:
        updates = sorted(updates, key=lambda u: u.client_id)
        self.content_round = round_idx + 1
        for update in updates:
            sent = payload_bytes(update.shared) + payload_bytes(update.extra)
            self.results.log_train(round_idx, update.client_id, update.num_samples, sent,
                                   self.bytes_down.pop(update.client_id, 0), update.metrics)
        try:
            self.aggregate_valid(round_idx, self.accepted(round_idx, updates))
        finally:
            for update in updates:
                self.sent.pop(update.client_id, None)

    def aggregate_valid(self, round_idx: int, updates: list[ClientUpdate]) -> None:
        for update in updates:
            update.dataset_size = self.weighed_dataset_size(update)
            if update.dataset_size >= 1:
                self.dataset_sizes[update.client_id] = int(update.dataset_size)
        if not updates:
            logger.warning(f'fsplug: round {round_idx}: no valid update, the state is unchanged')
            return
        weights = client_weights(self.cfg.fsplug.aggregation.weights,
                                 [u.dataset_size for u in updates], [u.num_samples for u in updates])
        for update, weight in zip(updates, weights):
            update.weight = weight
        self.clip(round_idx, updates)
        with robust_averaging(self.robust):
            self.aggregate_accepted(updates)

    def aggregate_accepted(self, updates: list[ClientUpdate]) -> None:
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

    def weighed_dataset_size(self, update: ClientUpdate) -> int:
        """The training-set size the client's weight may use: capped at its known split, else
        at fsplug.aggregation.max_dataset_size."""
        return capped_dataset_size(update.dataset_size,
                                   self.known_dataset_sizes.get(update.client_id),
                                   int(self.cfg.fsplug.aggregation.max_dataset_size))

    def clip(self, round_idx: int, updates: list[ClientUpdate]) -> None:
        """fsplug.aggregation.robust.clip_norm: each update's delta against the content it was
        sent scaled down to that norm (every method, before its aggregation)."""
        max_norm = float(self.cfg.fsplug.aggregation.robust.clip_norm)
        if max_norm <= 0:
            return
        for update in updates:
            update.shared, norm = clip_update(update.shared, self.sent.get(update.client_id),
                                              max_norm)
            if norm > max_norm:
                logger.info(f'fsplug: round {round_idx}: update of client {update.client_id} '
                            f'clipped from norm {norm:.4g} to {max_norm:g}')

    def accepted(self, round_idx: int, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """The updates that pass fs_plugins.run.validation; each rejection is logged (warning and
        a 'rejected' results row naming the client and the reason)."""
        kept = []
        for update in updates:
            reason = self.update_problem(update)
            if reason is None:
                kept.append(update)
            else:
                self.reject(round_idx, update.client_id, reason)
        return kept

    def update_problem(self, update: ClientUpdate) -> str | None:
        """Why client `update.client_id`'s update must be rejected, or None."""
        validation = self.cfg.fsplug.validation
        expected = self.expected_signature(update.client_id) if self.checks_signature else None
        if self.checks_signature and expected is None:
            return (f"the server cannot build client {update.client_id}'s model to check its "
                    f'update (see the log)')
        if expected is not None:
            expected = self.method.expected_upload(expected, self.sent.get(update.client_id))
        declared = tuple(self.method.contract.extra)
        checks = UpdateChecks(expected, float(validation.max_update_norm),
                              self.sent.get(update.client_id), declared or None,
                              float(validation.max_extra_norm))
        problem = checked_problem(update.shared, update.extra, checks)
        if problem and self.config_unknown(update.client_id) and \
                problem == signature_problem(update.shared, expected or {}):
            problem += (" (the server expects the run's own model from a client whose "
                        '--client_cfg it was not given)')
        return problem or self.count_problem(update)

    def config_unknown(self, client_id: int) -> bool:
        return not self.all_client_configs_known and client_id not in self.method.client_configs

    def count_problem(self, update: ClientUpdate) -> str | None:
        by_size = self.cfg.fsplug.aggregation.weights == 'dataset_size'
        return (count_problem(update.num_samples, 'num_samples')
                or count_problem(update.dataset_size, 'dataset_size', minimum=1 if by_size else 0))

    def reject(self, round_idx: int, client_id: int, reason: str) -> None:
        """Leaves client `client_id`'s update of this round out, with a warning and a
        'rejected' results row."""
        logger.warning(f'fsplug: round {round_idx}: update of client {client_id} '
                       f'rejected: {reason}')
        self.rejections.append({'round': round_idx, 'client': client_id, 'reason': reason})
        self.results.log_rejection(round_idx, client_id, reason)

    def expected_signature(self, client_id: int) -> dict | None:
        """The typed_signature of what client `client_id` shares, from the model the server
        builds for it: the run's own when its config is the run's or unknown here, else that
        of its own model (built on the meta device from its config); None when it cannot be
        built."""
        if client_id in self._unbuildable:
            return None
        if not _is_typed(self._expected.get(client_id)):   # not yet, or an older checkpoint's
            self._expected[client_id] = self._signature_from_config(client_id)
            if self._expected[client_id] is None:
                self._unbuildable.add(client_id)
        return self._expected[client_id]

    def _signature_from_config(self, client_id: int) -> dict | None:
        client_cfg = self.method.client_configs.get(client_id)
        if client_cfg is None or to_plain(client_cfg) == to_plain(self.cfg):
            return dict(self.own_typed_signature)
        return client_shared_signature(client_cfg, type(self.method))

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


def client_shared_signature(client_cfg, method_cls) -> dict | None:
    """typed_signature of what a client with `client_cfg` shares, from its model built on the
    meta device (no weight read), else built for real; None when it cannot be built."""
    try:
        method = method_cls(client_cfg)
        with architecture_only(device='meta'):
            built = build_model(client_cfg, method, share_frozen=False)
        with _StayOnMeta():
            return typed_signature(method.shared_tensors(built.model, built.trainable_names))
    except Exception as exc:   # noqa: BLE001 -- any builder: try a real build
        logger.info(f'fsplug: a client model cannot be built on the meta device ({exc})')
    try:
        method = method_cls(client_cfg)
        built = build_model(client_cfg, method, share_frozen=False)
        return typed_signature(method.shared_tensors(built.model, built.trainable_names))
    except Exception as exc:   # noqa: BLE001 -- its updates are then rejected, naming this
        logger.warning(f"fsplug: the server cannot build a client's model to check its "
                       f'updates ({type(exc).__name__}: {exc})')
        return None


def client_shared_shapes(client_cfg, method_cls) -> dict | None:
    """Names and shapes of what a client with `client_cfg` shares (client_shared_signature
    without the dtypes)."""
    signature = client_shared_signature(client_cfg, method_cls)
    return None if signature is None else {name: shape for name, (shape, _) in signature.items()}


def _is_typed(signature) -> bool:
    return isinstance(signature, dict) and all(
        isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], str)
        for entry in signature.values())


class _StayOnMeta(torch.overrides.TorchFunctionMode):
    """`Tensor.to(...)` of a meta tensor returns it unchanged (methods copy what they share to
    the CPU; on the meta device only the shapes are wanted)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to and args and getattr(args[0], 'is_meta', False):
            return args[0]
        return func(*args, **(kwargs or {}))


def evaluates_received_content(cfg) -> bool:
    """Whether a client loads the server's content before it is evaluated or saved
    (fsplug.eval.point 'received'); 'trained': its model as local training left it."""
    return cfg.fsplug.eval.point == 'received'

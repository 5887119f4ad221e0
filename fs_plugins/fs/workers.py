"""`federate.method: fsplug` — FS Client/Server subclasses that run the method's procedures.

What they change in FS's flow, and why:
- the model: FS's get_model returns a `DeferredModel` for '@fsplug_llm'; each worker builds
  the real one from its full (client-specific) config, with the plugin's seeding;
- the server holds only the global shared state (`GlobalState`), not a second LLM;
- server -> client: one message per client with `method.content_for(state, client)`,
  so content may be personalised; clients are sampled by the plugin's seeded sampler;
- client -> server: shared parameters plus the method's extra payload and train metrics;
- aggregation: `method.aggregate` on decoded updates (no FS aggregator involved);
- `finish` is sent once (upstream sends it twice in distributed mode, which can hang);
- models are saved as artifacts (fs_plugins.run.artifacts) at the rounds `should_save` names: the
  server writes the global state, every client its own model after it receives the evaluation
  content (or, at a save round without evaluation, a SAVE_MSG with that content);
- whole-federation checkpoints and resume (fs_plugins.fs.checkpoints); a distributed client
  process that was restarted rejoins, restores its checkpoint and gets its round's content
  again;
- distributed mode, where messages come from other processes: the server checks every message
  before its handler runs and turns a bad one, or a handler's exception, into a rejection
  naming the client (`PluginServer._dispatch`); a round has a deadline
  (fsplug.distribute.round_timeout_s), after which the missing clients are logged and the
  round is aggregated with what arrived, or the federation stops; a waiting client ends when
  the server is gone (server_lost_timeout_s) or silent (client_idle_timeout_s).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import OrderedDict

import torch
from federatedscope.core.message import Message
from federatedscope.core.workers import Client, Server
from yacs.config import CfgNode as YacsCfgNode

from fs_plugins.core.errors import ConfigError
from fs_plugins.fs import fs_llm_checkpoint
from fs_plugins.fs.checkpoints import CHECKPOINT_MSG, CHECKPOINTED_MSG, ServerCheckpoints, resume_client
from fs_plugins.fs.data import CLIENT_NAMES, CLIENT_OVERRIDES, CLIENT_TRAIN_SIZES
from fs_plugins.fs.logs import share_fs_logging
from fs_plugins.fs.secure import UNREADABLE_MSG, plugin_comm_manager, received_message_bound, tensor_bytes
from fs_plugins.fs.wire import (
    MARKER,
    decoded_updates,
    encode_tensors,
    encode_update,
    encoded_size,
    with_encode_time,
)
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.checkpoint import CheckpointError, read_server, server_checkpoint_info, set_rng_state, write_client
from fs_plugins.run.client import ClientProcedure
from fs_plugins.run.config import Cfg, merge, to_plain
from fs_plugins.run.results import ResultsLog, is_time_column
from fs_plugins.run.runtime import (
    initial_global,
    predictions_path,
    resolved_client_config,
    results_dir,
    run_info,
    use_thread_setting,
)
from fs_plugins.run.server import ServerProcedure, evaluates_received_content

logger = logging.getLogger(__name__)

SAVE_MSG = 'fsplug_save'   # server -> client: the evaluation content; the client saves its model
JOIN_TYPES = ('join_in', 'join_in_info')
METRICS_ROW_KEYS = ('round', 'client', 'kind')   # a results row's own keys: no metric's name
MAX_METRICS = 1000         # per evaluation message (each is a column of results.csv)
MAX_METRIC_NAME = 200
MIN_UPDATES = 1            # a round that reaches its deadline is aggregated with at least this many
PROBE_S = 5.0              # how often a waiting client checks that the server still listens
MAX_REASON_CHARS = 300     # of a rejection's reason, which may quote what a client sent


class MessageTooLarge(RuntimeError):
    """A message this party would send is over the gRPC limit."""


class FederationStopped(SystemExit):
    """Ends a distributed party's process with this message and exit code 1, no traceback:
    a round deadline with on_round_timeout: stop, or a client whose server is gone."""


# the server's own failures: they end the run rather than being blamed on a client's message
SERVER_FAILURES = (ConfigError, CheckpointError, MessageTooLarge, OSError)


class DeferredModel(torch.nn.Module):
    """Stands in for an '@fsplug_llm' model until a PluginClient/PluginServer builds it."""

    def __init__(self, model_type: str):
        super().__init__()
        self.model_type = model_type

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"model.type '{self.model_type}' is built by the fsplug workers; "
                           f"set federate.method: fsplug and trainer.type: fsplug")


class GlobalState(torch.nn.Module):
    """The server's 'model': the global shared tensors, with state_dict semantics so FS's
    checkpointing (federate.save_to / restore_from) saves and restores them. FS's
    restore_from (in FS's Server.__init__, before `serve_fs_checkpoints`) maps and checks the
    file's keys, FS-LLM's included; after it, `save_checkpoint` writes FS's save_to files in
    the form FS-LLM's get_llm loads where the method's global state is plain LoRA
    (fs_plugins.fs.fs_llm_checkpoint)."""

    def __init__(self, tensors: dict, form: fs_llm_checkpoint.CheckpointForm | None = None):
        super().__init__()
        self.tensors = OrderedDict(tensors)
        self.form = form
        self._restoring = True   # only FS's restore_from loads before serve_fs_checkpoints

    def state_dict(self, *args, **kwargs):
        return OrderedDict(self.tensors)

    def load_state_dict(self, state_dict, strict=False):
        self.tensors.update(fs_llm_checkpoint.restore(state_dict, self.tensors) if self._restoring
                            else state_dict)

    def serve_fs_checkpoints(self, aggregator) -> None:
        """From now on FS's aggregator writes federate.save_to files with `save_checkpoint`."""
        self._restoring = False
        if self.form is not None:
            aggregator.save_model = self.save_checkpoint

    def save_checkpoint(self, path, cur_round=-1):
        fs_llm_checkpoint.save_checkpoint(self.form, self.tensors, path, cur_round)

    def forward(self, *args, **kwargs):
        raise RuntimeError('The fsplug server holds only the global shared state; '
                           'evaluation runs on the clients (federate.make_global_eval: False)')


def _is_distributed(cfg) -> bool:
    return cfg.federate.mode.lower() == 'distributed'


def check_message_size(cfg, content: dict, what: str) -> None:
    """FS's gRPC drops a message over its limit with only a warning, and the federation then
    waits for it for ever: refuse it here instead, naming the size and the key to raise."""
    if not _is_distributed(cfg):
        return
    size = encoded_size(content)
    limit = min(int(cfg.distribute.grpc_max_send_message_length),
                int(cfg.distribute.grpc_max_receive_message_length))
    if size > limit:
        raise MessageTooLarge(f'fsplug: {what} is {size / 2**20:.1f} MiB encoded, over the gRPC '
                           f'limit of {limit / 2**20:.1f} MiB (fsplug.distribute.max_message_mb, '
                           f"at most 2047: gRPC's ceiling)")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _quoted(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + '...'


def metrics_problem(content) -> str | None:
    """Why a client's evaluation metrics can be neither logged nor merged (None: they can):
    FS merges every value with float(), and a results row has its own round/client/kind.
    NaN and infinity pass: a client whose training diverged reports them honestly."""
    if not isinstance(content, dict):
        return f'the metrics are {type(content).__name__}, not a dict of numbers'
    if len(content) > MAX_METRICS:
        return f'{len(content)} metrics, over {MAX_METRICS}'
    for key, value in content.items():
        if not isinstance(key, str) or key in METRICS_ROW_KEYS or len(key) > MAX_METRIC_NAME:
            return f'{_quoted(key)} is not a metric name'
        if not _is_number(value):
            return f'metric {_quoted(key)} is {_quoted(value)}, not a number'
    return None


def address_problem(content) -> str | None:
    """Why a join's content is not an address FS can send to ('host:port' or {host, port})."""
    if isinstance(content, dict):
        host, port = content.get('host'), content.get('port')
        if isinstance(host, str) and (_is_int(port) or (isinstance(port, str) and port.isdigit())):
            return None
    elif isinstance(content, str) and content.rpartition(':')[2].isdigit():
        return None
    return f'the address {_quoted(content)} is not host:port'


def _fs_worker_init(cfg, receive_limit: int | None = None):
    """Around FS's worker __init__: in distributed mode it builds the plugin's gRPC comm
    manager (TLS, authentication, `receive_limit` bytes a message; fs_plugins.fs.secure)."""
    return (plugin_comm_manager(cfg, receive_limit) if _is_distributed(cfg)
            else contextlib.nullcontext())


def _log_traffic(worker) -> None:
    if hasattr(worker.comm_manager, 'summary'):
        logger.info(f'fs-plugins: {worker.comm_manager.summary()}')


def _torch_device(device):
    return torch.device(f'cuda:{device}' if isinstance(device, int) else device)


class PluginServer(Server):
    def __init__(self, ID=-1, state=0, config=None, data=None, model=None, client_num=5,
                 total_round_num=10, device='cpu', strategy=None, unseen_clients_id=None,
                 **kwargs):
        share_fs_logging()
        resume_dir = str(config.fsplug.checkpoint.resume_from)
        checkpoint = server_checkpoint_info(config, resume_dir) if resume_dir else None
        method = get_method_class(config.fsplug.method)(config)
        # FS has checked these entries and merges them itself on the clients' side
        method.client_configs = {cid: Cfg.wrap(merge(to_plain(config), override))
                                 for cid, override in CLIENT_OVERRIDES.items()}
        shared, layout = initial_global(config, method)
        model = GlobalState(shared, fs_llm_checkpoint.checkpoint_form(
            config, method, layout, shared, resume_dir or results_dir(config, outdir_is_final=True)))
        if checkpoint:
            state = checkpoint['round'] + 1
        receive_limit = received_message_bound(
            tensor_bytes(shared), config.distribute.grpc_max_receive_message_length) \
            if _is_distributed(config) else None
        with _fs_worker_init(config, receive_limit):
            super().__init__(ID, state, config, data, model, client_num, total_round_num,
                             device, strategy, unseen_clients_id, **kwargs)
        model.serve_fs_checkpoints(self.aggregator)   # federate.save_to files
        run_dir = resume_dir or results_dir(config, outdir_is_final=True)
        results = ResultsLog(run_dir, run_info(config, 'federatedscope', CLIENT_NAMES),
                             overwrite=bool(config.fsplug.overwrite),
                             resume_rows=checkpoint['rows'] if checkpoint else None)
        # built after FS's __init__, which may have restored the global state from a checkpoint
        self.procedure = ServerProcedure(config, method, model.state_dict(), results, layout)
        self.procedure.known_dataset_sizes = dict(CLIENT_TRAIN_SIZES)
        self.procedure.all_client_configs_known = not _is_distributed(config)
        self.checkpoints = ServerCheckpoints(config, self.procedure, run_dir,
                                             checkpoint['round'] if checkpoint else -1)
        self._resumed_rng = None   # restored at the first broadcast, where the run continues
        if checkpoint:
            self._resumed_rng = read_server(run_dir, checkpoint['round'], self.procedure)
            self.models[0].load_state_dict(self.procedure.state['global'])
            logger.info(f'fs-plugins: resumed from the checkpoint of round {checkpoint["round"]} '
                        f'in {run_dir}')
        self.register_handlers(CHECKPOINTED_MSG, self.callback_funcs_for_checkpointed, [None])
        self._round_receivers: list[int] = []   # of the latest training round (none: not started)
        self._finish_sent = False
        self._deadline: float | None = None      # time.monotonic() of the round's deadline
        self._eval_round: int | None = None      # the round whose evaluation was asked for last
        self._eval_receivers: set[int] = set()
        self._eval_answered: set[int] = set()
        self._eval_merged = True

    def register_noise_injector(self, func):
        """FS's runner registers NbAFL's broadcast noise for nbafl.use; it would clip and
        noise the server's model in place, and broadcast_model_para here never calls it. The
        plugin noises the training rounds' content itself (ServerProcedure.content_for)."""
        logger.info('fs-plugins: nbafl: the plugin applies NbAFL itself (fs_plugins.run.privacy); '
                    "FS's server noise injector is not used")

    def broadcast_model_para(self, msg_type='model_para', sample_client_num=-1,
                             filter_unseen_clients=True):
        client_ids = sorted(self.comm_manager.get_neighbors().keys())
        training = msg_type == 'model_para'
        if self._resumed_rng is not None:
            set_rng_state(self._resumed_rng)
            self._resumed_rng = None
        if training:   # the previous round's evaluation was asked before: its row is complete
            self.procedure.finish_round()
        if training and self.checkpoints.due(rounds_done=self.state):
            self._ask_checkpoint(self.state - 1)
        if training:
            receivers = self._round_receivers = self.procedure.sample(self.state, client_ids)
            if self.sampler is not None:
                self.sampler.change_state(receivers, 'working')
        else:
            receivers = client_ids
        if msg_type == 'evaluate':
            self._eval_round, self._eval_receivers = self.state - 1, set(receivers)
            self._eval_answered, self._eval_merged = set(), False
        # evaluation content belongs to the round just done
        self._send_content(msg_type, receivers, self.state if training else self.state - 1)
        self._start_deadline()

    def _send_content(self, msg_type: str, receivers, round_idx: int) -> None:
        training = msg_type == 'model_para'
        for cid in receivers:
            # fsplug.eval.point 'trained': evaluation and saving use the client's own model
            content = (self.procedure.content_for(cid, for_training=training)
                       if training or self.procedure.evaluates_received_content else {})
            started = time.perf_counter()
            encoded = encode_tensors(content, _is_distributed(self._cfg))
            self.procedure.add_wire_times(encode_s=time.perf_counter() - started)
            check_message_size(self._cfg, encoded, f'{msg_type} for client {cid}')
            self.comm_manager.send(Message(
                msg_type=msg_type, sender=self.ID, receiver=[cid],
                state=min(round_idx, self.total_round_num), timestamp=self.cur_timestamp,
                content=encoded))

    def _ask_checkpoint(self, round_idx: int) -> None:
        """Every client writes its file of round `round_idx`; the server writes its own once
        all have answered (callback_funcs_for_checkpointed)."""
        client_ids = sorted(self.comm_manager.get_neighbors().keys())
        self.checkpoints.begin(round_idx, client_ids)
        self.comm_manager.send(Message(msg_type=CHECKPOINT_MSG, sender=self.ID,
                                       receiver=client_ids, state=round_idx,
                                       timestamp=self.cur_timestamp, content={MARKER: 1}))

    def callback_funcs_for_checkpointed(self, message):
        self.checkpoints.answered(int(message.state), int(message.sender))
        return False

    def _wait_for_checkpoints(self) -> None:
        """Distributed: the final checkpoint's answers arrive after FS's loop has ended; a
        client that has not answered by the round deadline leaves its rounds incomplete."""
        self._start_deadline()
        while self.checkpoints.pending:
            message = self.comm_manager.receive(timeout=self._seconds_to_deadline())
            if message is not None:
                self._dispatch(message)
                continue
            for round_idx, (_, _, waiting) in sorted(self.checkpoints.pending.items()):
                logger.warning(f'fsplug: checkpoint of round {round_idx} abandoned: no answer '
                               f'from clients {sorted(waiting)} within '
                               f'fsplug.distribute.round_timeout_s ({self._round_timeout():g} s)')
            self.checkpoints.pending.clear()

    # ------------------------------------------------------------ distributed: the loop
    def run(self):
        """FS's distributed loop (join, then rounds), with every message through `_dispatch`
        and the round deadline; standalone runs never call it (FS's runner dispatches)."""
        while self.join_in_client_num < self.client_num:
            self._dispatch(self.comm_manager.receive())
        while self.state <= self.total_round_num:
            message = self.comm_manager.receive(timeout=self._seconds_to_deadline())
            if message is None:
                self._on_round_deadline()
            else:
                self._dispatch(message)
        self.terminate(msg_type='finish')

    def _dispatch(self, message):
        """One client message, checked before its handler runs; a bad one, or one whose
        handler raises, is a rejection naming the client and the federation goes on. An
        error after the round has moved on, or one of SERVER_FAILURES, is the server's own
        and ends the run."""
        verdict, why = self._triage(message)
        if verdict == 'ignore':
            logger.warning(f'fsplug: {why}; ignored')
            return False
        if verdict == 'reject':
            self._reject(message, why)
            return False
        round_before = self.state
        try:
            return self.msg_handlers[message.msg_type](message)
        except SERVER_FAILURES:
            raise
        except Exception as exc:
            if self.state != round_before:
                raise
            logger.exception(f'fsplug: the {message.msg_type!r} message of client '
                             f'{message.sender} failed')
            self._forget(message)
            self._reject(message, f'{type(exc).__name__}: {exc}')
            return False

    def _reject(self, message, why: str) -> None:
        sender = message.sender if _is_int(message.sender) else -1
        what = message.msg_type if isinstance(message.msg_type, str) else '?'
        reason = f'{_quoted(what, 40)} message: {why}'
        self.procedure.reject(self.state, sender, reason[:MAX_REASON_CHARS])

    def _forget(self, message) -> None:
        """What a failed handler may have buffered of the message, so that no later
        aggregation or merge uses it."""
        for by_round in self.msg_buffer.values():
            by_round.get(message.state, {}).pop(message.sender, None)
        if message.msg_type == 'metrics':
            self._eval_answered.discard(message.sender)

    # ------------------------------------------------------------ distributed: checks
    def _triage(self, message) -> tuple[str, str]:
        """('accept', ''), ('ignore', why): late, or ('reject', why)."""
        problem = self._envelope_problem(message)
        if problem:
            return 'reject', problem
        check = {'model_para': self._update_verdict, 'metrics': self._metrics_verdict,
                 'join_in': self._join_verdict,
                 'join_in_info': self._join_info_verdict}.get(message.msg_type)
        return check(message) if check else ('accept', '')

    def _envelope_problem(self, message) -> str | None:
        msg_type, sender = message.msg_type, message.sender
        if msg_type == UNREADABLE_MSG:
            return str(message.content)
        if not isinstance(msg_type, str) or msg_type not in self.msg_handlers:
            return f'the type {_quoted(msg_type)} is not one the server handles'
        if not _is_int(sender):
            return f'the sender {_quoted(sender)} is not a client id'
        if msg_type in JOIN_TYPES:
            if sender != -1 and not 1 <= sender <= self.client_num:
                return f'client id {sender} is not one of 1 .. {self.client_num}'
        elif sender not in self.comm_manager.neighbors:
            return f'client {sender} has not joined'
        if not _is_int(message.state):
            return f'the round {_quoted(message.state)} is not an integer'
        timestamp = message.timestamp
        if not _is_number(timestamp) or not math.isfinite(timestamp) or \
                timestamp < self.cur_timestamp:
            return (f"the timestamp {_quoted(timestamp)} is not a number at or above the "
                    f"server's ({self.cur_timestamp})")
        # FS's clock is simulated; a client may not move it (one huge timestamp would make
        # every honest message after it 'lower')
        message.timestamp = self.cur_timestamp
        return None

    def _update_verdict(self, message) -> tuple[str, str]:
        round_idx, sender = message.state, message.sender
        if not (isinstance(message.content, (list, tuple)) and len(message.content) == 2):
            return 'reject', 'an update is (num_samples, tensors)'
        if round_idx < self.state:
            return 'ignore', (f'late update of client {sender} for round {round_idx} (round '
                              f'{self.state} is in progress)')
        if round_idx > self.state or self.state >= self.total_round_num:
            return 'reject', f'an update for round {round_idx}, which is not in progress'
        if sender not in self._round_receivers:
            return 'reject', f'client {sender} was not sampled for round {round_idx}'
        if sender in self.msg_buffer['train'].get(round_idx, {}):
            return 'reject', f'a second update for round {round_idx}'
        return 'accept', ''

    def _metrics_verdict(self, message) -> tuple[str, str]:
        round_idx, sender = message.state, message.sender
        problem = metrics_problem(message.content)
        if problem:
            return 'reject', problem
        if self._eval_round is None:
            return 'reject', 'no evaluation was asked for'
        if round_idx < self._eval_round:
            return 'ignore', f'late metrics of client {sender} for round {round_idx}'
        if round_idx > self._eval_round or sender not in self._eval_receivers:
            return 'reject', f'metrics for round {round_idx}, which was not asked of client {sender}'
        if sender in self._eval_answered:
            return 'reject', f'second metrics for round {round_idx}'
        return 'accept', ''

    def _join_verdict(self, message) -> tuple[str, str]:
        problem = address_problem(message.content)
        return ('reject', problem) if problem else ('accept', '')

    def _join_info_verdict(self, message) -> tuple[str, str]:
        """Only the answer to FS's ask_for_join_in_info: FS's handler starts the federation
        again on any (its round's content would go out twice)."""
        asked = bool(self._cfg.federate.join_in_info) and not self._round_receivers
        if not asked or message.sender not in self.comm_manager.neighbors:
            return 'reject', 'join information that was not asked for'
        if not isinstance(message.content, dict):
            return 'reject', 'join information is not a dict'
        return 'accept', ''

    # ------------------------------------------------------------ distributed: deadline
    def _round_timeout(self) -> float:
        return float(self._cfg.fsplug.distribute.round_timeout_s)

    def _start_deadline(self) -> None:
        limit = self._round_timeout()
        self._deadline = time.monotonic() + limit if limit > 0 else None

    def _seconds_to_deadline(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _missing_updates(self) -> list[int]:
        if self.state >= self.total_round_num:
            return []
        arrived = self.msg_buffer['train'].get(self.state, {})
        return [cid for cid in self._round_receivers if cid not in arrived]

    def _missing_metrics(self) -> list[int]:
        return [] if self._eval_merged else sorted(self._eval_receivers - self._eval_answered)

    def _on_round_deadline(self) -> None:
        """The round's time is up: the missing clients are logged, then the round goes on
        with what arrived (on_round_timeout: aggregate) or the federation stops."""
        self._deadline = None
        updates, metrics = self._missing_updates(), self._missing_metrics()
        if not updates and not metrics:
            return
        limit = f'fsplug.distribute.round_timeout_s ({self._round_timeout():g} s)'
        if updates:
            logger.warning(f'fsplug: round {self.state}: no update within {limit} from '
                           f'clients {updates}')
        if metrics:
            logger.warning(f'fsplug: round {self._eval_round}: no metrics within {limit} '
                           f'from clients {metrics}')
        if self._cfg.fsplug.distribute.on_round_timeout == 'stop':
            self._stop(f'round {self.state} missed its deadline ({limit}; '
                       f'fsplug.distribute.on_round_timeout: stop)')
        if metrics:
            self._merge_metrics_arrived()
        if updates and not self.is_finish:
            self._aggregate_arrived(updates, limit)

    def _merge_metrics_arrived(self) -> None:
        self.msg_buffer['eval'].setdefault(self._eval_round, {})
        self.check_and_move_on(check_eval_result=True, min_received_num=len(self._eval_answered))

    def _aggregate_arrived(self, missing: list[int], limit: str) -> None:
        arrived = len(self.msg_buffer['train'].get(self.state, {}))
        if arrived < MIN_UPDATES:
            self._stop(f'round {self.state}: no update arrived within {limit}; nothing to '
                       f'aggregate')
        for cid in missing:
            self.procedure.reject(self.state, cid, f'no update within {limit}')
        try:
            self.check_and_move_on(min_received_num=arrived)
        except SERVER_FAILURES:
            raise
        except Exception as exc:
            logger.exception(f'fsplug: round {self.state} cannot be aggregated')
            self._stop(f'round {self.state} cannot be aggregated ({type(exc).__name__}: {exc})')

    def _merge_and_format_eval_results(self):
        self._eval_merged = True
        return super()._merge_and_format_eval_results()

    def merge_eval_results_from_all_clients(self):
        """FS's summary of the clients' metrics; in distributed mode one that FS cannot
        compute (metric sets that differ between clients, a split without its '_total') is
        left out with a warning: results.jsonl holds every client's metrics either way."""
        if not _is_distributed(self._cfg):
            return super().merge_eval_results_from_all_clients()
        try:
            return super().merge_eval_results_from_all_clients()
        except Exception as exc:   # any inconsistency among the metrics the clients sent
            logger.warning(f"fsplug: round {self._eval_round}: FS's summary of the clients' "
                           f'metrics cannot be made ({type(exc).__name__}: {exc}); '
                           f"results.jsonl has each client's")
            return {}

    def _stop(self, reason: str) -> None:
        """Ends the federation now: the clients get 'finish', the results so far are
        written, and this process exits with `reason`."""
        logger.error(f'fsplug: {reason}; the federation stops')
        self._send_finish()
        self.procedure.finish_round()
        self.procedure.results.close(completed=False)
        raise FederationStopped(f'fsplug: the server stopped the federation: {reason}')

    def _send_finish(self, msg_type: str = 'finish') -> None:
        self._finish_sent = self.is_finish = True
        self.comm_manager.send(Message(
            msg_type=msg_type, sender=self.ID,
            receiver=list(self.comm_manager.neighbors.keys()), state=self.state,
            timestamp=self.cur_timestamp, content={MARKER: 1}))

    def callback_funcs_for_join_in(self, message):
        """A client process that was restarted joins again under its id: it gets the current
        round's training content if its update is still awaited (it restores its checkpoint
        when that content arrives)."""
        sender = int(message.sender)
        joined = 'info' not in message.msg_type and sender in self.comm_manager.get_neighbors()
        if joined and not self._round_receivers:   # FS would count it twice and start early
            self.comm_manager.add_neighbors(neighbor_id=sender, address=message.content)
            logger.warning(f'fsplug: client {sender} joined again before the start')
            return False
        if not joined:
            return super().callback_funcs_for_join_in(message)
        self.comm_manager.add_neighbors(neighbor_id=sender, address=message.content)
        logger.warning(f'fsplug: client {sender} rejoined in round {self.state}')
        self.checkpoints.abandon_waiting_for(sender)
        awaited = sender in self._round_receivers and \
            sender not in self.msg_buffer['train'].get(self.state, {})
        if awaited and self.state < self.total_round_num:
            self._send_content('model_para', [sender], self.state)
        return False

    def _decoded_updates(self, buffer: dict) -> list:
        return decoded_updates(buffer, lambda cid, reason: self.procedure.reject(self.state, cid, reason))

    def _perform_federated_aggregation(self):
        started = time.perf_counter()
        updates = self._decoded_updates(self.msg_buffer['train'][self.state])
        self.procedure.add_wire_times(decode_s=time.perf_counter() - started)
        if self.staled_msg_buffer:
            logger.warning(f'fsplug: ignoring {len(self.staled_msg_buffer)} stale update(s)')
        self.procedure.aggregate(self.state, updates)
        self.models[0].load_state_dict(self.procedure.state['global'])
        self._save_models(rounds_done=self.state + 1)
        return len(updates)

    def _save_models(self, rounds_done: int) -> None:
        """The global state here; the clients save theirs when they evaluate this round, or on
        SAVE_MSG when this round is not evaluated (FS evaluates at the same rounds)."""
        if not self.procedure.should_save(rounds_done):
            return
        self.procedure.save_global(self.procedure.results.out_dir, rounds_done - 1)
        if not self.procedure.should_evaluate(rounds_done):
            self._send_content(SAVE_MSG, sorted(self.comm_manager.get_neighbors().keys()),
                               rounds_done - 1)

    def callback_funcs_for_metrics(self, message):
        self._eval_answered.add(message.sender)
        self.procedure.results.log_eval(int(message.state), int(message.sender),
                                        dict(message.content))
        # FS's summary needs '<split>_total' beside every metric: the seconds stay in results
        message.content = {k: v for k, v in message.content.items() if not is_time_column(k)}
        return super().callback_funcs_for_metrics(message)

    def terminate(self, msg_type='finish'):
        if self._finish_sent:
            return
        self._finish_sent = True
        self.procedure.finish_round()
        if self.checkpoints.due(rounds_done=self.total_round_num):
            self._ask_checkpoint(self.total_round_num - 1)
            if _is_distributed(self._cfg):
                self._wait_for_checkpoints()
        self._monitor.finish_fl()
        self._send_finish(msg_type)
        _log_traffic(self)
        summary = self.procedure.results.close()
        print(f'\nPer-client results ({self._cfg.fsplug.method}, FederatedScope '
              f'{self._cfg.federate.mode}, seed {self._cfg.seed}):\n{summary}\n'
              f'Files: {self.procedure.results.out_dir}/results.jsonl, results.csv, summary.md')


class PluginClient(Client):
    def __init__(self, ID=-1, server_id=None, state=-1, config=None, data=None, model=None,
                 device='cpu', strategy=None, is_unseen_client=False, *args, **kwargs):
        if _is_distributed(config) and ID == -1 and int(config.distribute.data_idx) > 0:
            ID = int(config.distribute.data_idx)  # results and seeds follow the data, not join order
        share_fs_logging()
        method_cls = get_method_class(config.fsplug.method)
        # FS has merged this client's --client_cfg entry; the keys its method derives from its
        # records are added here as the embedded runner adds them (run.runtime.build_clients)
        own = resolved_client_config(config, None, method_cls, data)
        own = own if to_plain(own) != to_plain(config) else config
        method = method_cls(own)
        use_thread_setting(own)   # a distributed client builds no initial global model
        built = build_model(own, method)
        with _fs_worker_init(config), self._without_fs_nbafl(config):
            super().__init__(ID, server_id, state, config, data, built.model, device, strategy,
                             is_unseen_client, *args, **kwargs)
        procedure = ClientProcedure(self.ID, own, method, built, data, _torch_device(device))
        resume_dir = str(config.fsplug.checkpoint.resume_from)
        self.run_dir = resume_dir or results_dir(config, outdir_is_final=True)
        self._resume_pending = bool(resume_dir)
        procedure.predictions_path = predictions_path(self.run_dir, self.ID)
        self.trainer.bind(procedure)
        self.register_handlers(SAVE_MSG, self.callback_funcs_for_save, [None])
        self.register_handlers(CHECKPOINT_MSG, self.callback_funcs_for_checkpoint, [None])

    @staticmethod
    @contextlib.contextmanager
    def _without_fs_nbafl(config):
        """FS's trainer builder wraps the trainer for nbafl.use (wrap_nbafl_trainer): hooks
        that deep-copy every parameter and add noise to all of ctx.model (the frozen base the
        clients of a process share) after the upload was taken, and a proximal regulariser over
        the whole model. The plugin applies NbAFL to the upload itself
        (ClientProcedure.end_round, fs_plugins.run.privacy), so FS builds the trainer without
        seeing nbafl.use, rather than having its wrapping undone afterwards."""
        if not config.nbafl.use:
            yield
            return
        frozen = config.is_frozen()
        config.defrost()
        config.nbafl.use = False
        try:
            yield
        finally:
            config.nbafl.use = True
            if frozen:   # yacs' own freeze: FS's re-checks the config and rewrites config.yaml
                YacsCfgNode.freeze(config)

    def _resume_before(self, round_idx: int) -> None:
        """On resume, before the first content is used: this client's newest checkpoint
        before round `round_idx` (in one process, the server restores the generators)."""
        if not self._resume_pending:
            return
        self._resume_pending = False
        restored = resume_client(self.run_dir, self.trainer.procedure, round_idx,
                                 with_rng=_is_distributed(self._cfg))
        logger.info(f'fs-plugins: client {self.ID} resumed from its checkpoint of round {restored}')

    def callback_funcs_for_checkpoint(self, message):
        round_idx = int(message.state)
        write_client(self.run_dir, self.trainer.procedure, round_idx,
                     with_rng=_is_distributed(self._cfg))
        self.comm_manager.send(Message(msg_type=CHECKPOINTED_MSG, sender=self.ID,
                                       receiver=[message.sender], state=round_idx,
                                       timestamp=self._gen_timestamp(message.timestamp, 0),
                                       content={MARKER: 1}))

    def _save_if_due(self, round_idx: int) -> None:
        procedure = self.trainer.procedure
        if procedure is not None and ServerProcedure.should_save_round(procedure.cfg, round_idx + 1):
            procedure.save_model(self.run_dir, round_idx)

    def callback_funcs_for_evaluate(self, message):
        self._resume_before(int(message.state) + 1)
        self.trainer.procedure.round_idx = int(message.state)   # PFL-Dynamic: what is visible
        self.trainer.start_evaluation()
        if not evaluates_received_content(self._cfg):
            message.content = None   # evaluated as its last local training left it
        super().callback_funcs_for_evaluate(message)
        self._save_if_due(int(message.state))

    def callback_funcs_for_save(self, message):
        self._resume_before(int(message.state) + 1)
        if evaluates_received_content(self._cfg):
            self.trainer.update(message.content)
        self._save_if_due(int(message.state))

    def callback_funcs_for_model_para(self, message):
        self._resume_before(int(message.state))
        self.state = message.state
        self.trainer.procedure.round_idx = int(message.state)
        self.trainer.update(message.content)
        self.trainer.train()
        update = self.trainer.last_update
        started = time.perf_counter()
        encoded = encode_update(update, _is_distributed(self._cfg))
        encoded = with_encode_time(encoded, time.perf_counter() - started)
        check_message_size(self._cfg, encoded, f'the update of client {self.ID}')
        self.comm_manager.send(Message(
            msg_type='model_para', sender=self.ID, receiver=[message.sender], state=self.state,
            timestamp=self._gen_timestamp(init_timestamp=message.timestamp,
                                          instance_number=update.num_samples),
            content=(update.num_samples, encoded)))

    def callback_funcs_for_finish(self, message):
        result = super().callback_funcs_for_finish(message)
        _log_traffic(self)
        return result

    # ------------------------------------------------------------ distributed: the loop
    def run(self):
        """FS's distributed client loop, waiting through `_next_message` (which ends the
        process when the server is gone or silent for too long)."""
        server = self.comm_manager.neighbors[self.server_id]
        logger.info(f'fs-plugins: client {self.ID} joined the server at {server}')
        while True:
            message = self._next_message(server)
            if message.msg_type not in self.msg_handlers:
                logger.warning(f'fsplug: client {self.ID}: ignored a message of type '
                               f'{_quoted(message.msg_type)} ({_quoted(message.content)})')
                continue
            if self.state <= message.state:
                self.msg_handlers[message.msg_type](message)
            if message.msg_type == 'finish':
                return

    def _next_message(self, server: str):
        opts = self._cfg.fsplug.distribute
        lost_after, idle_after = float(opts.server_lost_timeout_s), float(opts.client_idle_timeout_s)
        waiting_since, unreachable_since = time.monotonic(), None
        while True:
            message = self.comm_manager.receive(timeout=min(PROBE_S, lost_after / 2 or PROBE_S))
            if message is not None:
                return message
            now = time.monotonic()
            if idle_after and now - waiting_since >= idle_after:
                raise FederationStopped(
                    f'fsplug: client {self.ID}: no message from the server at {server} for '
                    f'{idle_after:g} s (fsplug.distribute.client_idle_timeout_s); ending')
            if not lost_after or self.comm_manager.reachable(self.server_id):
                unreachable_since = None
                continue
            unreachable_since = unreachable_since or now
            if now - unreachable_since >= lost_after:
                raise FederationStopped(
                    f'fsplug: client {self.ID}: the server at {server} has not accepted '
                    f'connections for {lost_after:g} s: it has stopped or is unreachable '
                    f'(fsplug.distribute.server_lost_timeout_s); ending')

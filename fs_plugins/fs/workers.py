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
  again.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict

import torch
from federatedscope.core.message import Message
from federatedscope.core.workers import Client, Server
from yacs.config import CfgNode as YacsCfgNode

from fs_plugins.fs import fs_llm_checkpoint
from fs_plugins.fs.checkpoints import CHECKPOINT_MSG, CHECKPOINTED_MSG, ServerCheckpoints, resume_client
from fs_plugins.fs.data import CLIENT_NAMES, CLIENT_OVERRIDES
from fs_plugins.fs.logs import share_fs_logging
from fs_plugins.fs.secure import plugin_comm_manager
from fs_plugins.fs.wire import MARKER, WireError, decode_update, encode_tensors, encode_update, encoded_size
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.checkpoint import read_server, server_checkpoint_info, set_rng_state, write_client
from fs_plugins.run.client import ClientProcedure
from fs_plugins.run.config import Cfg, merge, to_plain
from fs_plugins.run.results import ResultsLog
from fs_plugins.run.runtime import initial_global, predictions_path, resolved_client_config, results_dir, run_info
from fs_plugins.run.server import ServerProcedure

logger = logging.getLogger(__name__)

SAVE_MSG = 'fsplug_save'   # server -> client: the evaluation content; the client saves its model


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
        raise RuntimeError(f'fsplug: {what} is {size / 2**20:.1f} MiB encoded, over the gRPC '
                           f'limit of {limit / 2**20:.1f} MiB (fsplug.distribute.max_message_mb, '
                           f"at most 2047: gRPC's ceiling)")


def _fs_worker_init(cfg):
    """Around FS's worker __init__: in distributed mode it builds the plugin's gRPC comm
    manager (TLS, authentication; fs_plugins.fs.secure)."""
    return plugin_comm_manager(cfg) if _is_distributed(cfg) else contextlib.nullcontext()


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
        with _fs_worker_init(config):
            super().__init__(ID, state, config, data, model, client_num, total_round_num,
                             device, strategy, unseen_clients_id, **kwargs)
        model.serve_fs_checkpoints(self.aggregator)   # federate.save_to files
        run_dir = resume_dir or results_dir(config, outdir_is_final=True)
        results = ResultsLog(run_dir, run_info(config, 'federatedscope', CLIENT_NAMES),
                             overwrite=bool(config.fsplug.overwrite),
                             resume_rows=checkpoint['rows'] if checkpoint else None)
        # built after FS's __init__, which may have restored the global state from a checkpoint
        self.procedure = ServerProcedure(config, method, model.state_dict(), results, layout)
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
        if training and self.checkpoints.due(rounds_done=self.state):
            self._ask_checkpoint(self.state - 1)
        if training:
            receivers = self._round_receivers = self.procedure.sample(self.state, client_ids)
            if self.sampler is not None:
                self.sampler.change_state(receivers, 'working')
        else:
            receivers = client_ids
        # evaluation content belongs to the round just done
        self._send_content(msg_type, receivers, self.state if training else self.state - 1)

    def _send_content(self, msg_type: str, receivers, round_idx: int) -> None:
        training = msg_type == 'model_para'
        for cid in receivers:
            content = self.procedure.content_for(cid, for_training=training)
            encoded = encode_tensors(content, _is_distributed(self._cfg))
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
        """Distributed: the final checkpoint's answers arrive after FS's loop has ended."""
        while self.checkpoints.pending:
            message = self.comm_manager.receive()
            self.msg_handlers[message.msg_type](message)

    def callback_funcs_for_join_in(self, message):
        """A client process that was restarted joins again under its id: it gets the current
        round's training content if its update is still awaited (it restores its checkpoint
        when that content arrives)."""
        sender = int(message.sender)
        rejoining = (bool(self._round_receivers) and 'info' not in message.msg_type
                     and sender in self.comm_manager.get_neighbors())
        if not rejoining:
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
        """The round's updates; one that cannot be decoded is rejected, the rest go on."""
        updates = []
        for cid, received in buffer.items():
            try:
                num_samples, content = received
                updates.append(decode_update(cid, num_samples, content))
            except (WireError, TypeError, ValueError) as exc:
                self.procedure.reject(self.state, int(cid), f'undecodable update: {exc}')
        return updates

    def _perform_federated_aggregation(self):
        updates = self._decoded_updates(self.msg_buffer['train'][self.state])
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
        self.procedure.results.log_eval(int(message.state), int(message.sender),
                                        dict(message.content))
        return super().callback_funcs_for_metrics(message)

    def terminate(self, msg_type='finish'):
        if self._finish_sent:
            return
        self._finish_sent = True
        if self.checkpoints.due(rounds_done=self.total_round_num):
            self._ask_checkpoint(self.total_round_num - 1)
            if _is_distributed(self._cfg):
                self._wait_for_checkpoints()
        self.is_finish = True
        self._monitor.finish_fl()
        self.comm_manager.send(Message(
            msg_type=msg_type, sender=self.ID,
            receiver=list(self.comm_manager.neighbors.keys()), state=self.state,
            timestamp=self.cur_timestamp, content={MARKER: 1}))
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
        super().callback_funcs_for_evaluate(message)
        self._save_if_due(int(message.state))

    def callback_funcs_for_save(self, message):
        self._resume_before(int(message.state) + 1)
        self.trainer.update(message.content)
        self._save_if_due(int(message.state))

    def callback_funcs_for_model_para(self, message):
        self._resume_before(int(message.state))
        self.state = message.state
        self.trainer.procedure.round_idx = int(message.state)
        self.trainer.update(message.content)
        self.trainer.train()
        update = self.trainer.last_update
        encoded = encode_update(update, _is_distributed(self._cfg))
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

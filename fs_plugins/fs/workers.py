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
- models are saved as artifacts (fs_plugins.artifacts) at the rounds `should_save` names: the
  server writes the global state, every client its own model after it receives the evaluation
  content (or, at a save round without evaluation, a SAVE_MSG with that content).
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from federatedscope.core.message import Message
from federatedscope.core.workers import Client, Server

from fs_plugins.client import ClientProcedure
from fs_plugins.config import Cfg, merge, to_plain
from fs_plugins.fs.data import CLIENT_NAMES, CLIENT_OVERRIDES
from fs_plugins.fs.logs import share_fs_logging
from fs_plugins.fs.wire import MARKER, decode_update, encode_tensors, encode_update
from fs_plugins.methods.registry import get_method_class
from fs_plugins.models.builders import build_model
from fs_plugins.results import ResultsLog
from fs_plugins.runtime import initial_global, predictions_path, results_dir, run_info
from fs_plugins.server import ServerProcedure

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
    checkpointing (federate.save_to / restore_from) saves and restores them."""

    def __init__(self, tensors: dict):
        super().__init__()
        self.tensors = OrderedDict(tensors)

    def state_dict(self, *args, **kwargs):
        return OrderedDict(self.tensors)

    def load_state_dict(self, state_dict, strict=False):
        self.tensors.update(state_dict)

    def forward(self, *args, **kwargs):
        raise RuntimeError('The fsplug server holds only the global shared state; '
                           'evaluation runs on the clients (federate.make_global_eval: False)')


def refuse_checkpoint_keys(cfg) -> None:
    """Whole-federation checkpoints are written and resumed by the embedded runner only so far;
    under FS the keys would silently do nothing, so they are refused."""
    from fs_plugins.errors import ConfigError
    if int(cfg.fsplug.checkpoint.freq) > 0 or cfg.fsplug.checkpoint.resume_from:
        raise ConfigError(['fsplug.checkpoint.freq / resume_from: whole-federation checkpoints '
                           'run in the embedded runner only (fs-plugins run --runner embedded); '
                           "under FederatedScope use FS's federate.save_to / restore_from for "
                           'the global state'])


def _is_distributed(cfg) -> bool:
    return cfg.federate.mode.lower() == 'distributed'


def _torch_device(device):
    return torch.device(f'cuda:{device}' if isinstance(device, int) else device)


class PluginServer(Server):
    def __init__(self, ID=-1, state=0, config=None, data=None, model=None, client_num=5,
                 total_round_num=10, device='cpu', strategy=None, unseen_clients_id=None,
                 **kwargs):
        share_fs_logging()
        refuse_checkpoint_keys(config)
        method = get_method_class(config.fsplug.method)(config)
        # FS has checked these entries and merges them itself on the clients' side
        method.client_configs = {cid: Cfg.wrap(merge(to_plain(config), override))
                                 for cid, override in CLIENT_OVERRIDES.items()}
        shared, layout = initial_global(config, method)
        model = GlobalState(shared)
        super().__init__(ID, state, config, data, model, client_num, total_round_num, device,
                         strategy, unseen_clients_id, **kwargs)
        results = ResultsLog(results_dir(config, outdir_is_final=True),
                             run_info(config, 'federatedscope', CLIENT_NAMES),
                             overwrite=bool(config.fsplug.overwrite))
        # built after FS's __init__, which may have restored the global state from a checkpoint
        self.procedure = ServerProcedure(config, method, model.state_dict(), results, layout)
        self.procedure.all_client_configs_known = not _is_distributed(config)
        self._finish_sent = False

    def broadcast_model_para(self, msg_type='model_para', sample_client_num=-1,
                             filter_unseen_clients=True):
        client_ids = sorted(self.comm_manager.get_neighbors().keys())
        training = msg_type == 'model_para'
        if training:
            receivers = self.procedure.sample(self.state, client_ids)
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
            self.comm_manager.send(Message(
                msg_type=msg_type, sender=self.ID, receiver=[cid],
                state=min(round_idx, self.total_round_num), timestamp=self.cur_timestamp,
                content=encode_tensors(content, _is_distributed(self._cfg))))

    def _perform_federated_aggregation(self):
        buffer = self.msg_buffer['train'][self.state]
        updates = [decode_update(cid, n, content) for cid, (n, content) in buffer.items()]
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
        self.is_finish = True
        self._monitor.finish_fl()
        self.comm_manager.send(Message(
            msg_type=msg_type, sender=self.ID,
            receiver=list(self.comm_manager.neighbors.keys()), state=self.state,
            timestamp=self.cur_timestamp, content={MARKER: 1}))
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
        method = get_method_class(config.fsplug.method)(config)
        built = build_model(config, method)
        super().__init__(ID, server_id, state, config, data, built.model, device, strategy,
                         is_unseen_client, *args, **kwargs)
        procedure = ClientProcedure(self.ID, config, method, built, data, _torch_device(device))
        self.run_dir = results_dir(config, outdir_is_final=True)
        procedure.predictions_path = predictions_path(self.run_dir, self.ID)
        self.trainer.bind(procedure)
        self.register_handlers(SAVE_MSG, self.callback_funcs_for_save, [None])

    def _save_if_due(self, round_idx: int) -> None:
        procedure = self.trainer.procedure
        if procedure is not None and ServerProcedure.should_save_round(procedure.cfg, round_idx + 1):
            procedure.save_model(self.run_dir, round_idx)

    def callback_funcs_for_evaluate(self, message):
        self.trainer.procedure.round_idx = int(message.state)   # PFL-Dynamic: what is visible
        super().callback_funcs_for_evaluate(message)
        self._save_if_due(int(message.state))

    def callback_funcs_for_save(self, message):
        self.trainer.update(message.content)
        self._save_if_due(int(message.state))

    def callback_funcs_for_model_para(self, message):
        self.state = message.state
        self.trainer.procedure.round_idx = int(message.state)
        self.trainer.update(message.content)
        self.trainer.train()
        update = self.trainer.last_update
        self.comm_manager.send(Message(
            msg_type='model_para', sender=self.ID, receiver=[message.sender], state=self.state,
            timestamp=self._gen_timestamp(init_timestamp=message.timestamp,
                                          instance_number=update.num_samples),
            content=(update.num_samples, encode_update(update, _is_distributed(self._cfg)))))

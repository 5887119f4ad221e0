"""Liveness and message checks of FederatedScope's distributed mode (fs_plugins.fs.workers):
the server's checks of every message before its handler (unknown types, bad senders,
timestamps and contents, handlers that raise), the round deadline, and clients that end when
the server is gone. The checks and the deadline run on a server built in this process (no
other party: what it sends to the clients' addresses is not delivered); the stalled client
and the dead server run as processes on 127.0.0.1. Skipped, with the reason, where
FederatedScope (and its gRPC) is not installed."""
import json
import logging
import os
import signal
import sys
import time

import pytest
from helpers import TESTS_DIR, env_with_tests, tiny_config, write_yaml

pytest.importorskip('federatedscope', reason='FederatedScope is not installed (install its llm '
                                             'branch, see README)')
pytest.importorskip('grpc', reason="FederatedScope's distributed mode needs grpcio")
pytestmark = pytest.mark.fs   # the fs tier

from federatedscope.core.message import Message  # noqa: E402

from fs_plugins.commands.launch import LocalFederation  # noqa: E402
from fs_plugins.fs.ports import free_ports  # noqa: E402
from fs_plugins.fs.secure import UNREADABLE_MSG  # noqa: E402
from fs_plugins.fs.wire import encode_update  # noqa: E402
from fs_plugins.fs.workers import FederationStopped, PluginServer  # noqa: E402
from fs_plugins.methods.base import ClientUpdate  # noqa: E402

ADDRESS = {'host': '127.0.0.1', 'port': 1}   # nothing listens: the server's sends fail and it goes on


# ------------------------------------------------------------------ a server in this process
def _server_yaml(folder, data_root, rounds=1, **distribute):
    folder.mkdir()
    cfg = tiny_config(folder, 'fedavg', rounds=rounds,
                      federate={'client_num': 2, 'sample_client_num': 2, 'mode': 'distributed'},
                      data={'splitter': 'iid'},
                      distribute={'use': True, 'role': 'server', 'server_host': '127.0.0.1',
                                  'server_port': free_ports(1)[0]})
    cfg['data']['root'] = str(data_root)
    cfg['fsplug']['distribute'] = distribute
    return write_yaml(folder / 'server.yaml', cfg)


def _build_server(cfg_path) -> PluginServer:
    """What FS's main.py does for the server of a distributed run, up to runner.run()."""
    from fs_plugins.fs import autoload
    autoload.install(force=True)
    from federatedscope.core.auxiliaries.data_builder import get_data
    from federatedscope.core.auxiliaries.runner_builder import get_runner
    from federatedscope.core.auxiliaries.worker_builder import get_client_cls, get_server_cls
    from federatedscope.core.configs.config import global_cfg
    cfg = global_cfg.clone()
    cfg.merge_from_file(cfg_path)
    data, modified = get_data(config=cfg.clone(), client_cfgs=None)
    cfg.merge_from_other_cfg(modified)
    cfg.freeze()
    runner = get_runner(data=data, server_class=get_server_cls(cfg), client_class=get_client_cls(cfg),
                        config=cfg.clone(), client_configs=None)
    return runner.server


@pytest.fixture(scope='module')
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp('data')


@pytest.fixture
def make_server(tmp_path, data_root):
    built = []

    def make(**distribute):
        server = _build_server(_server_yaml(tmp_path / f'server{len(built)}', data_root,
                                            **distribute))
        built.append(server)
        return server
    yield make
    for server in built:
        server.comm_manager.grpc_server.stop(0)


@pytest.fixture
def logged(caplog):
    """caplog for fs_plugins' lines, which go to FS's handlers only (share_fs_logging)."""
    ours = logging.getLogger('fs_plugins')
    ours.addHandler(caplog.handler)
    yield caplog
    ours.removeHandler(caplog.handler)


def _message(msg_type, sender, state=0, content=None, timestamp=0):
    return Message(msg_type=msg_type, sender=sender, receiver=[0], state=state,
                   timestamp=timestamp, content=content)


def _started(server) -> PluginServer:
    """Clients 1 and 2 join: round 0 starts."""
    for cid in (1, 2):
        server._dispatch(_message('join_in', cid, content=dict(ADDRESS)))
    assert server._round_receivers == [1, 2]
    return server


def _update(server, cid, round_idx=0):
    shared = {name: tensor.clone() for name, tensor in server.procedure.state['global'].items()}
    update = ClientUpdate(cid, 8, shared, {}, {'loss': 1.0}, dataset_size=8)
    return _message('model_para', cid, round_idx, (8, encode_update(update, distributed=True)))


def _rejected(server) -> list[tuple]:
    return [(r['round'], r['client'], r['reason']) for r in server.procedure.rejections]


@pytest.mark.parametrize('message, reason', [
    (_message('no_such_type', 1), "the type 'no_such_type' is not one the server handles"),
    (_message(UNREADABLE_MSG, 1, content='unreadable message (TypeError: x)'),
     'unreadable message (TypeError: x)'),
    (_message('metrics', 1, content='not a dict'), 'the metrics are str, not a dict of numbers'),
    (_message('metrics', 1, content={'kind': 1.0}), "'kind' is not a metric name"),
    (_message('metrics', 1, content={'loss': 'high'}), "metric 'loss' is 'high', not a number"),
    (_message('model_para', 1, timestamp=-1.0, content=(8, {})),
     "the timestamp -1.0 is not a number at or above the server's (0)"),
    (_message('model_para', 1, timestamp=float('nan'), content=(8, {})), 'the timestamp nan'),
    (_message('model_para', 1, content='x'), 'an update is (num_samples, tensors)'),
    (_message('model_para', 1, state=5, content=(8, {})), 'an update for round 5, which is not in'),
    (_message('model_para', 'one', content=(8, {})), "the sender 'one' is not a client id"),
    (_message('model_para', 7, content=(8, {})), 'client 7 has not joined'),
    (_message('join_in', 9, content=dict(ADDRESS)), 'client id 9 is not one of 1 .. 2'),
    (_message('join_in', 1, content=['x']), "the address ['x'] is not host:port"),
    (_message('join_in_info', 1, content={}), 'join information that was not asked for'),
    (_message('model_para', 1, state='0', content=(8, {})), "the round '0' is not an integer"),
])
def test_a_bad_message_is_rejected_naming_the_client(make_server, message, reason):
    server = _started(make_server())
    assert server._dispatch(message) is False
    [(round_idx, client, why)] = _rejected(server)
    assert (round_idx, client) == (0, message.sender if isinstance(message.sender, int) else -1)
    assert reason in why
    rows = server.procedure.results.rows
    assert rows[-1]['kind'] == 'rejected' and reason in rows[-1]['reason']
    # the round goes on: both honest updates aggregate it
    for cid in (1, 2):
        server._dispatch(_update(server, cid))
    assert server.state == 1


def test_a_handler_that_raises_is_a_rejection_and_its_update_is_dropped(make_server):
    server = _started(make_server())

    def failing(message):
        server.msg_buffer['train'].setdefault(0, {})[message.sender] = message.content
        raise KeyError('boom')
    honest = server.msg_handlers['model_para']
    server.msg_handlers['model_para'] = failing
    assert server._dispatch(_update(server, 1)) is False
    assert _rejected(server) == [(0, 1, "'model_para' message: KeyError: 'boom'")]
    assert 1 not in server.msg_buffer['train'][0]
    server.msg_handlers['model_para'] = honest
    server._dispatch(_update(server, 2))
    assert server.state == 0   # client 1's update, dropped, is still awaited


def test_the_servers_own_failures_end_the_run(make_server):
    server = _started(make_server())

    def disk_full(message):
        raise OSError(28, 'No space left on device')
    server.msg_handlers['model_para'] = disk_full
    with pytest.raises(OSError):
        server._dispatch(_update(server, 1))


def test_a_client_cannot_move_the_servers_clock(make_server):
    """FS asserts that a timestamp is not below the server's, and takes the highest as its
    clock: one huge timestamp would have every honest message after it fail."""
    server = _started(make_server())
    huge = _update(server, 1)
    huge.timestamp = 1e300
    server._dispatch(huge)
    assert server.cur_timestamp == 0
    server._dispatch(_update(server, 2))
    assert server.state == 1 and _rejected(server) == []


def test_late_and_unasked_messages(make_server, logged):
    server = _started(make_server())
    server._dispatch(_update(server, 1))
    server._dispatch(_update(server, 1))
    assert 'a second update for round 0' in _rejected(server)[-1][2]
    server._dispatch(_update(server, 2))
    assert server.state == 1
    server._dispatch(_update(server, 2, round_idx=0))   # late: logged, not a rejection
    assert 'late update of client 2 for round 0 (round 1 is in progress); ignored' in logged.text
    assert len(_rejected(server)) == 1
    server._dispatch(_message('metrics', 1, state=3, content={'loss': 1.0}))
    assert 'metrics for round 3, which was not asked of client 1' in _rejected(server)[-1][2]


def test_a_duplicate_join_before_the_start_is_not_counted(make_server):
    server = make_server()
    server._dispatch(_message('join_in', 1, content=dict(ADDRESS)))
    server._dispatch(_message('join_in', 1, content=dict(ADDRESS)))
    assert server.join_in_client_num == 1 and not server._round_receivers


def test_an_unparsable_request_comes_out_of_receive_as_unreadable(make_server):
    from federatedscope.core.proto import gRPC_comm_manager_pb2
    server = make_server()
    assert server.comm_manager.receive(timeout=0.05) is None
    request = gRPC_comm_manager_pb2.MessageRequest()
    request.msg['msg_type'].single_msg.str_value = 'model_para'   # no sender, state, content
    server.comm_manager.server_funcs.msg_queue.append(request)
    message = server.comm_manager.receive(timeout=1)
    assert message.msg_type == UNREADABLE_MSG and 'unreadable message' in message.content


# ------------------------------------------------------------------ the round deadline
def test_at_the_deadline_the_round_aggregates_what_arrived(make_server, logged):
    server = _started(make_server(round_timeout_s=60))
    assert 59 < server._seconds_to_deadline() <= 60
    server._dispatch(_update(server, 1))
    server._on_round_deadline()
    assert 'round 0: no update within fsplug.distribute.round_timeout_s (60 s) from clients [2]' \
        in logged.text
    assert [(r, c) for r, c, _ in _rejected(server)] == [(0, 2)]
    assert server.state == 1 and server._eval_receivers == {1, 2}   # the final evaluation
    server._dispatch(_message('metrics', 1, content={'test_avg_loss': 2.0, 'test_total': 4}))
    server._on_round_deadline()   # client 2's metrics never come
    assert 'round 0: no metrics within' in logged.text and server.is_finish
    server._dispatch(_update(server, 2, round_idx=0))   # late: ignored
    kinds = [(r['kind'], r['client']) for r in server.procedure.results.rows]
    assert kinds == [('rejected', 2), ('train', 1), ('eval', 1), ('server', 0)]


def test_metrics_fs_cannot_summarise_do_not_stop_the_run(make_server, logged):
    """FS's summary needs every metric's '<split>_total' and the same metrics from every
    client; the clients' own rows are kept without it."""
    server = _started(make_server())
    for cid in (1, 2):
        server._dispatch(_update(server, cid))
    server._dispatch(_message('metrics', 1, content={'test_avg_loss': 2.0, 'test_total': 4}))
    server._dispatch(_message('metrics', 2, content={'val_avg_loss': 1.0}))
    assert "FS's summary of the clients' metrics cannot be made" in logged.text
    assert server.is_finish and _rejected(server) == []
    assert [r['client'] for r in server.procedure.results.rows if r['kind'] == 'eval'] == [1, 2]


def test_a_round_with_no_update_stops_the_federation(make_server):
    server = _started(make_server(round_timeout_s=60))
    with pytest.raises(FederationStopped, match='round 0: no update arrived within'):
        server._on_round_deadline()
    assert server._finish_sent


def test_on_round_timeout_stop(make_server):
    server = _started(make_server(round_timeout_s=60, on_round_timeout='stop'))
    server._dispatch(_update(server, 1))
    with pytest.raises(FederationStopped, match='on_round_timeout: stop'):
        server._on_round_deadline()


def test_a_checkpoint_a_client_never_answers_is_abandoned_at_the_deadline(make_server, logged):
    server = make_server(round_timeout_s=0.2)
    server.checkpoints.pending[0] = ({}, {}, {2})
    server._wait_for_checkpoints()
    assert not server.checkpoints.pending
    assert 'checkpoint of round 0 abandoned: no answer from clients [2]' in logged.text


def test_no_deadline_with_round_timeout_0(make_server):
    server = _started(make_server(round_timeout_s=0))
    assert server._seconds_to_deadline() is None


# ------------------------------------------------------------------ processes on 127.0.0.1
STALLING_CLIENT = f"""
import sys, time
sys.path.insert(0, {TESTS_DIR!r})
import fs_plugins.fs.workers as workers
from fs_plugins.commands.cli import main

def stall(self, message):
    print('stalling in round', message.state, flush=True)
    time.sleep(3600)

workers.PluginClient.callback_funcs_for_model_para = stall
sys.exit(main(['run', '--runner', 'fs'] + sys.argv[1:]))
"""


def _federation(tmp_path, name, clients, rounds=1, client_cfg=None, **distribute):
    cfg = tiny_config(tmp_path, 'fedavg', rounds=rounds,
                      federate={'client_num': clients, 'sample_client_num': clients},
                      data={'splitter': 'iid'})
    cfg['fsplug']['results_dir'] = str(tmp_path / name)
    cfg['fsplug']['distribute'] = distribute
    return LocalFederation(write_yaml(tmp_path / f'{name}.yaml', cfg), env=env_with_tests(),
                           client_cfg=client_cfg and write_yaml(tmp_path / 'clients.yaml', client_cfg))


def _log(party) -> str:
    with open(party.log_path, encoding='utf-8', errors='replace') as handle:
        return handle.read()


def _wait_for(predicate, what, timeout=180):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f'{what} did not happen within {timeout} s')
        time.sleep(0.2)


def test_a_stalled_client_is_left_out_at_the_deadline(tmp_path):
    """Client 2 stops answering when round 0's content arrives: after round_timeout_s the
    server logs it, aggregates client 1's update, evaluates and finishes."""
    federation = _federation(tmp_path, 'stall', clients=2, round_timeout_s=15)
    server, honest, stalled = federation.parties
    try:
        federation.start(server)
        federation.wait_listening(server, 120)
        federation.start(honest)
        federation.start(stalled, command=[sys.executable, '-c', STALLING_CLIENT,
                                           '--cfg', stalled.cfg_path])
        server.process.wait(timeout=300)
        assert honest.process.wait(timeout=60) == 0, _log(honest)[-3000:]
    finally:
        federation.stop_all()
    log = _log(server)
    assert server.process.returncode == 0, log[-3000:]
    assert 'stalling in round 0' in _log(stalled)
    assert 'round 0: no update within fsplug.distribute.round_timeout_s (15 s) from clients [2]' in log
    assert 'round 0: no metrics within fsplug.distribute.round_timeout_s (15 s) from clients [2]' in log
    with open(os.path.join(federation.run_dir, 'results.jsonl')) as handle:
        rows = [json.loads(line) for line in handle]
    assert sorted((r['kind'], r['round'], r['client']) for r in rows) == [
        ('eval', 0, 1), ('rejected', 0, 2), ('server', 0, 0), ('train', 0, 1)]


def test_clients_end_when_the_server_is_gone_or_silent(tmp_path):
    """A server of 3 clients waits for client 3, which never starts. Client 1
    (client_idle_timeout_s 4) ends on the silence; the server is then killed and client 2
    ends once the server's port has been closed for server_lost_timeout_s (3 s)."""
    federation = _federation(tmp_path, 'gone', clients=3, server_lost_timeout_s=3,
                             client_cfg={'client_1': {'fsplug': {'distribute': {
                                 'client_idle_timeout_s': 4}}}})
    server, silent, orphan, _ = federation.parties
    try:
        federation.start(server)
        federation.wait_listening(server, 120)
        for party in (silent, orphan):
            federation.start(party)
        for party in (silent, orphan):
            _wait_for(lambda p=party: 'joined the server at' in _log(p), f'{party.name} joining')
        assert silent.process.wait(timeout=30) == 1
        assert orphan.process.poll() is None
        os.killpg(server.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert orphan.process.wait(timeout=30) == 1
        ended_after = time.monotonic() - killed
    finally:
        federation.stop_all()
    assert 'client 1: no message from the server at 127.0.0.1:' in _log(silent)
    assert 'for 4 s (fsplug.distribute.client_idle_timeout_s); ending' in _log(silent)
    assert 'client 2: the server at 127.0.0.1:' in _log(orphan)
    assert 'has not accepted connections for 3 s' in _log(orphan)
    assert 'Traceback' not in _log(orphan) + _log(silent)
    assert 3 <= ended_after < 3 + 2 * 3 + 5   # the timeout, probes and process exit

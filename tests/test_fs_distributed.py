"""FederatedScope's distributed mode through `fs-plugins launch` on 127.0.0.1: the launcher,
whole-federation checkpoints and resume under FS, a client killed and restarted mid-round,
a rogue client's pickled payloads, and a message over 100 MB through FS's gRPC. Skipped, with
the reason, where FederatedScope (and its gRPC) is not installed."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import TESTS_DIR, env_with_tests, tiny_config, untimed_rows, write_yaml

from fs_plugins.commands.launch import LocalFederation, party_command
from fs_plugins.run.checkpoint import party_path

pytestmark = pytest.mark.fs   # the fs tier: skipped, with the reason, without FederatedScope

_env = env_with_tests


def _config(tmp_path, name, method='fedmole', rounds=3, steps=3, clients=2, **fsplug):
    cfg = tiny_config(tmp_path, method, rounds=rounds, steps=steps,
                      federate={'client_num': clients, 'sample_client_num': clients},
                      data={'splitter': 'iid'})
    cfg['fsplug']['results_dir'] = str(tmp_path / name)
    cfg['fsplug'].update(fsplug)
    return write_yaml(tmp_path / f'{name}.yaml', cfg)


def _rows(run_dir):
    """The run's rows without their times (helpers.untimed_rows), in a fixed order."""
    with open(os.path.join(run_dir, 'results.jsonl')) as handle:
        rows = untimed_rows([json.loads(line) for line in handle])
    return sorted(rows, key=lambda r: (r['kind'], r['round'], r['client']))


def _launch(cfg_path, *args, timeout=300):
    return subprocess.run([sys.executable, '-m', 'fs_plugins.commands.cli', 'launch', '--cfg', cfg_path,
                           '--timeout', str(timeout), *args], env=_env(), capture_output=True,
                          text=True, timeout=timeout + 60)


def _wait_for(predicate, what, timeout=180):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f'{what} did not happen within {timeout}s')
        time.sleep(0.02)


def _log(federation, name):
    with open(os.path.join(federation.run_dir, 'launch', f'{name}.log')) as handle:
        return handle.read()


def test_launch_runs_a_local_federation(tmp_path):
    cfg = _config(tmp_path, 'run', method='fedavg', rounds=2)
    proc = _launch(cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert 'round 2/2' in proc.stdout
    rows = _rows(str(tmp_path / 'run'))
    assert [(r['kind'], r['round'], r['client']) for r in rows] == sorted(
        [(k, r, c) for k in ('train', 'eval') for r in (0, 1) for c in (1, 2)]
        + [('server', r, 0) for r in (0, 1)])   # one server row per round
    for name in ('server', 'client_1', 'client_2'):   # each party's derived YAML and log
        assert os.path.isfile(tmp_path / 'run' / 'launch' / f'{name}.yaml')
        assert os.path.getsize(tmp_path / 'run' / 'launch' / f'{name}.log') > 0


def test_launch_stops_every_process_when_one_fails(tmp_path, monkeypatch, capsys):
    import fs_plugins.commands.launch as launch
    federation = LocalFederation(_config(tmp_path, 'fail', method='fedavg', rounds=50), env=_env())
    failing = federation.parties[2].cfg_path

    def command(cfg_path, switches, client_cfg=None):
        if cfg_path == failing:
            return [sys.executable, '-c', 'import sys, time; time.sleep(2); sys.exit(3)']
        return party_command(cfg_path, switches, client_cfg)
    monkeypatch.setattr(launch, 'party_command', command)
    assert federation.run(timeout=300) == 1
    assert 'client_2 exited with code 3' in capsys.readouterr().out
    assert all(p.process.poll() is not None for p in federation.parties)


@pytest.mark.parametrize('mode', ['standalone', 'distributed'])
def test_fs_resume_continues_to_the_same_results(tmp_path, mode):
    """A 2-round run with checkpoints, resumed to 3 rounds, ends with the rows of the 3-round
    run (fedmole: routed experts and routers are client-local state)."""
    checkpoint = {'checkpoint': {'freq': 1}}
    full, cut = _config(tmp_path, 'full', **checkpoint), _config(tmp_path, 'cut', rounds=2, **checkpoint)
    if mode == 'standalone':
        def run(cfg, *args):
            return subprocess.run([sys.executable, '-m', 'fs_plugins.commands.cli', 'run', '--runner', 'fs',
                                   '--cfg', cfg, *args], env=_env(), capture_output=True,
                                  text=True, timeout=300)
    else:
        run = _launch
    for proc in (run(full), run(cut),
                 run(cut, '--resume', str(tmp_path / 'cut'), 'federate.total_round_num', '3')):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _rows(str(tmp_path / 'cut')) == _rows(str(tmp_path / 'full'))
    assert sorted(os.listdir(tmp_path / 'cut' / 'checkpoint')) == [
        'client_1.round2.safetensors', 'client_2.round2.safetensors', 'server.round2.safetensors']


def test_client_killed_mid_round_rejoins_from_its_checkpoint(tmp_path):
    """Client 2 is killed while it trains round 1 and restarted with --resume: it restores its
    round-0 checkpoint, rejoins, gets round 1's content again, and the run ends with the
    numbers of a run that was never interrupted."""
    steps = {'steps': 30}
    reference = _launch(_config(tmp_path, 'uninterrupted', **steps))
    assert reference.returncode == 0, reference.stdout[-3000:]
    federation = LocalFederation(_config(tmp_path, 'killed', **steps, checkpoint={'freq': 1}),
                                 env=_env())
    server, _, victim = federation.parties
    try:
        federation.start(server)
        federation.wait_listening(server, 120)
        for party in federation.parties[1:]:
            federation.start(party)
        round0 = party_path(federation.run_dir, 'client_2', 0)
        _wait_for(lambda: os.path.isfile(round0), 'client 2 checkpointing round 0')
        os.killpg(victim.process.pid, signal.SIGKILL)   # it is training round 1 now
        victim.process.wait()
        federation.start(victim, switches=['--resume', federation.run_dir])
        federation.follow(timeout=300)
    finally:
        federation.stop_all()
    assert 'client 2 rejoined in round 1' in _log(federation, 'server')
    assert 'client 2 resumed from its checkpoint of round 0' in _log(federation, 'client_2')
    assert _rows(federation.run_dir) == _rows(str(tmp_path / 'uninterrupted'))


def _run_with_rogue_last(federation, marker: str, timeout: float) -> None:
    """Runs `federation` with its last client as tests/rogue_client.py (argument `marker`)."""
    server, *honest, rogue = federation.parties
    try:
        federation.start(server)
        federation.wait_listening(server, 120)
        for party in honest:
            federation.start(party)
        federation.start(rogue, command=[sys.executable, os.path.join(TESTS_DIR, 'rogue_client.py'),
                                         marker, '--cfg', rogue.cfg_path])
        federation.follow(timeout=timeout)
    finally:
        federation.stop_all()


def test_rogue_client_pickles_are_never_unpickled(tmp_path):
    """Client 3 sends pickles that would create a file when unpickled, as a `shared/` value and
    as the whole payload: the file never appears, each is rejected naming client 3, and the
    run completes with the honest clients."""
    marker = tmp_path / 'pwned'
    federation = LocalFederation(_config(tmp_path, 'rogue', method='fedavg', clients=3, rounds=2),
                                 env=_env())
    _run_with_rogue_last(federation, str(marker), timeout=300)
    assert not marker.exists()
    rows = _rows(federation.run_dir)
    rejected = [r for r in rows if r['kind'] == 'rejected']
    assert [(r['round'], r['client']) for r in rejected] == [(0, 3), (1, 3)]
    assert 'is text, not a tensor' in rejected[0]['reason']
    assert 'is not a safetensors blob' in rejected[1]['reason']
    assert {r['client'] for r in rows if r['kind'] == 'train'} == {1, 2}


@pytest.mark.parametrize('method', ['fedavg', 'scaffold'])   # scaffold: control variates as extras
def test_an_enrolled_rogue_client_neither_crashes_nor_steers_the_federation(tmp_path, method):
    """Issue 41 live, over TLS + tokens: client 3 holds its own valid token and forges its
    update with a different attack every round (tests/rogue_client.py ATTACKS), and sends an
    unknown message type, non-dict metrics and a stale timestamp every round. Each update is
    rejected naming client 3, the honest clients train every round, the run finishes, and the
    global adapter stays what honest training makes it (finite, small)."""
    from rogue_client import ATTACKS
    rounds = len(ATTACKS)
    federation = LocalFederation(_config(tmp_path, 'attacked', method=method, clients=3,
                                         rounds=rounds, steps=2),
                                 env=_env(ROGUE_MODE='attacks'), secure='token')
    _run_with_rogue_last(federation, 'unused', timeout=600)
    rows = _rows(federation.run_dir)
    rejected = [(r['round'], r['reason']) for r in rows if r['kind'] == 'rejected']
    for round_idx, (name, _, reason) in enumerate(ATTACKS):
        assert any(t == round_idx and reason in why for t, why in rejected), (name, rejected)
    for bad_message in ("type 'fsplug_bogus' is not one the server handles",
                        'the metrics are str, not a dict', 'the timestamp -1000000000.0'):
        assert sum(bad_message in why for _, why in rejected) >= rounds - 1, (bad_message, rejected)
    assert {(r['round'], r['client']) for r in rows if r['kind'] == 'train' and r['client'] != 3} == \
        {(t, c) for t in range(rounds) for c in (1, 2)}
    assert 'Traceback' not in _log(federation, 'server')
    import safetensors.torch
    global_dir = os.path.join(federation.run_dir, 'adapters', 'global')
    tensors = [t for f in os.listdir(global_dir) if f.endswith('.safetensors')
               for t in safetensors.torch.load_file(os.path.join(global_dir, f)).values()]
    assert tensors and all(t.dtype == torch.float32 and t.isfinite().all() and t.abs().max() < 10
                           for t in tensors)


def _lora_update(rank=128, layers=32, hidden=4096):
    """LLaVA-1.5-7B's language model with LoRA r=128 on q_proj and v_proj: 268 MB in float32."""
    from fs_plugins.methods.base import ClientUpdate
    generator = torch.Generator().manual_seed(0)
    shared = {}
    for layer in range(layers):
        for module in ('q_proj', 'v_proj'):
            prefix = f'model.layers.{layer}.self_attn.{module}'
            shared[f'{prefix}.lora_A.weight'] = torch.randn(rank, hidden, generator=generator)
            shared[f'{prefix}.lora_B.weight'] = torch.randn(hidden, rank, generator=generator)
    return ClientUpdate(1, 8, shared, {}, {'loss': 1.0}, dataset_size=8)


def test_message_over_100mb_through_fs_grpc(tmp_path):
    """A LLaVA-7B r=128 update (256 MiB, 341 MiB encoded) through the workers' gRPC comm
    managers on 127.0.0.1: refused with a clear error at FS's default limit (300 MiB),
    delivered intact once fsplug.distribute.max_message_mb has raised it."""
    from federatedscope.core.configs.config import global_cfg
    from federatedscope.core.message import Message

    from fs_plugins.fs.config import raise_grpc_limits
    from fs_plugins.fs.secure import party_comm_manager
    from fs_plugins.fs.wire import decode_update, encode_update, encoded_size
    from fs_plugins.fs.workers import check_message_size

    cfg = global_cfg.clone()
    cfg.federate.mode = 'distributed'
    update = _lora_update()
    content = encode_update(update, distributed=True)
    size = encoded_size(content)
    assert size > 300 * 2 ** 20   # FS's default limit
    with pytest.raises(RuntimeError, match=r'over the gRPC limit of 300\.0 MiB'):
        check_message_size(cfg, content, 'the update of client 1')
    raise_grpc_limits(cfg)
    check_message_size(cfg, content, 'the update of client 1')
    receiver, sender = party_comm_manager('server'), party_comm_manager('client')
    try:
        sender.add_neighbors(0, f'127.0.0.1:{receiver.port}')
        started = time.perf_counter()
        sender.send(Message(msg_type='model_para', sender=1, receiver=[0], state=0,
                            timestamp=0, content=(8, content)))
        message = receiver.receive()
        seconds = time.perf_counter() - started
    finally:
        receiver.grpc_server.stop(0)
        sender.grpc_server.stop(0)
    received = decode_update(1, *message.content)
    assert received.shared.keys() == update.shared.keys()
    assert all(torch.equal(received.shared[k], v) for k, v in update.shared.items())
    print(f'\n{size / 2**20:.1f} MiB encoded through FS gRPC in {seconds:.1f} s')

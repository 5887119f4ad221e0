"""Time in the results: train rows' train_s / extra_s / tokens_per_s, eval rows' eval_s, one
server row per round (aggregate_s, encode_s, decode_s, round_s), and the summary's split of
the rounds' time (fs_plugins.run.results.time_split), in the embedded runner and FS standalone.
No assertion depends on how fast this machine is: only on the clocks' nesting and on
hand-made rows."""
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import env_with_tests, tiny_config, write_yaml

from fs_plugins.fs.wire import WireError, decode_update, encode_update, with_encode_time
from fs_plugins.methods.base import ClientUpdate
from fs_plugins.run import client as client_mod
from fs_plugins.run.config import load_config
from fs_plugins.run.results import time_split, without_times
from fs_plugins.sim.runner import run_embedded

TRAIN_TIMES = ('train_s', 'extra_s', 'tokens_per_s')
SERVER_TIMES = ('aggregate_s', 'encode_s', 'decode_s', 'round_s')
SPLIT_KEYS = {f'{part}_{unit}' for part in ('train', 'extra', 'eval', 'aggregation_wire', 'other')
              for unit in ('s', 'pct')} | {'total_s', 'rounds'}


def _kind(rows, kind):
    return [r for r in rows if r['kind'] == kind]


def _read_rows(run_dir):
    with open(os.path.join(run_dir, 'results.jsonl')) as handle:
        return [json.loads(line) for line in handle]


@pytest.mark.slow
def test_embedded_rows_carry_the_times_and_the_summary_splits_them(tmp_path, capsys):
    rounds = 2
    cfg = load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, 'fedavg', rounds=rounds)))
    results = run_embedded(cfg)
    rows = results.rows
    for row in _kind(rows, 'train'):
        assert all(row[k] > 0 for k in TRAIN_TIMES), row
    for row in _kind(rows, 'eval'):
        assert row['eval_s'] > 0 and {'eval_prefill_s', 'eval_generate_s'} <= set(row), row
    servers = _kind(rows, 'server')
    assert [r['round'] for r in servers] == list(range(rounds))
    for server in servers:
        assert server['aggregate_s'] > 0 and server['round_s'] > 0
        assert server['encode_s'] == server['decode_s'] == 0.0   # no wire in one process
        # the clients' clocks run inside the server's round, one client after another
        clients = [r for r in rows if r['round'] == server['round'] and r['kind'] in ('train', 'eval')]
        inside = sum(r.get('train_s', 0) + r.get('extra_s', 0) + r.get('eval_s', 0) for r in clients)
        assert inside + server['aggregate_s'] <= server['round_s']
    split = time_split(rows)
    assert set(split) == SPLIT_KEYS and split['rounds'] == rounds
    assert split['total_s'] == pytest.approx(sum(r['round_s'] for r in servers))
    assert sum(split[f'{p}_pct'] for p in ('train', 'extra', 'eval', 'aggregation_wire', 'other')) \
        == pytest.approx(100.0)
    assert min(split[k] for k in SPLIT_KEYS) >= 0
    out = capsys.readouterr().out
    assert "Where the rounds' time went" in out and '| training | method extra |' in out
    with open(os.path.join(results.out_dir, 'summary.md')) as handle:
        summary = handle.read()
    assert "Where the rounds' time went" in summary
    assert '| server' not in summary and 'eval_s' not in summary   # no client row, no time column
    with open(os.path.join(results.out_dir, 'results.csv')) as handle:
        header = handle.readline().strip().split(',')
    assert set(TRAIN_TIMES) | set(SERVER_TIMES) | {'eval_s'} <= set(header)


def test_without_times_drops_time_columns_and_server_rows():
    rows = [{'round': 0, 'client': 1, 'kind': 'train', 'train_avg_loss': 1.5, 'train_s': 0.2,
             'tokens_per_s': 900.0, 'encode_s': 0.01},
            {'round': 0, 'client': 0, 'kind': 'server', 'round_s': 1.0},
            {'round': 0, 'client': 1, 'kind': 'eval', 'test_avg_loss': 2.0, 'eval_s': 0.3}]
    assert without_times(rows) == [
        {'round': 0, 'client': 1, 'kind': 'train', 'train_avg_loss': 1.5},
        {'round': 0, 'client': 1, 'kind': 'eval', 'test_avg_loss': 2.0}]


def _hand_made_rows():
    """Two rounds of two clients; round 1 without evaluation."""
    return [
        {'round': 0, 'client': 1, 'kind': 'train', 'train_s': 3.0, 'extra_s': 1.0, 'encode_s': 0.5},
        {'round': 0, 'client': 2, 'kind': 'train', 'train_s': 2.0, 'extra_s': 0.0, 'encode_s': 0.5},
        {'round': 0, 'client': 1, 'kind': 'eval', 'eval_s': 1.0},
        {'round': 0, 'client': 2, 'kind': 'eval', 'eval_s': 4.0},
        {'round': 0, 'client': 0, 'kind': 'server', 'aggregate_s': 1.0, 'encode_s': 0.5,
         'decode_s': 0.5, 'round_s': 20.0},
        {'round': 0, 'client': 2, 'kind': 'rejected', 'reason': 'ignored by the split'},
        {'round': 1, 'client': 1, 'kind': 'train', 'train_s': 4.0, 'extra_s': 2.0},
        {'round': 1, 'client': 2, 'kind': 'train', 'train_s': 1.0, 'extra_s': 0.0},
        {'round': 1, 'client': 0, 'kind': 'server', 'aggregate_s': 1.0, 'encode_s': 0.0,
         'decode_s': 0.0, 'round_s': 10.0},
        {'round': 2, 'client': 1, 'kind': 'train', 'train_s': 9.0},   # no server row: not counted
    ]


def test_time_split_of_clients_one_after_another():
    split = time_split(_hand_made_rows())
    # train 3+2+4+1, extra 1+2, eval 1+4, wire: clients' 0.5+0.5, server's 1+0.5+0.5 and 1
    expected = {'train_s': 10.0, 'extra_s': 3.0, 'eval_s': 5.0, 'aggregation_wire_s': 4.0,
                'other_s': 8.0, 'total_s': 30.0, 'rounds': 2}
    assert {k: split[k] for k in expected} == pytest.approx(expected)
    assert split['train_pct'] == pytest.approx(100 * 10 / 30)
    assert split['other_pct'] == pytest.approx(100 * 8 / 30)


def test_time_split_of_parallel_clients_takes_each_rounds_slowest():
    split = time_split(_hand_made_rows(), parallel=True)
    # round 0: client 2 (2+0+4+0.5 = 6.5) over client 1 (3+1+1+0.5 = 5.5); round 1: client 1
    expected = {'train_s': 2.0 + 4.0, 'extra_s': 0.0 + 2.0, 'eval_s': 4.0,
                'aggregation_wire_s': 0.5 + 2.0 + 1.0, 'total_s': 30.0}
    expected['other_s'] = 30.0 - sum(v for k, v in expected.items() if k != 'total_s')
    assert {k: split[k] for k in expected} == pytest.approx(expected)
    assert sum(split[k] for k in split if k.endswith('_pct')) == pytest.approx(100.0)


def test_time_split_when_the_parts_exceed_the_rounds():
    """Clocks of different processes: the parts are the total, other is 0, shares sum to 100."""
    rows = [{'round': 0, 'client': 1, 'kind': 'train', 'train_s': 6.0, 'extra_s': 2.0},
            {'round': 0, 'client': 0, 'kind': 'server', 'aggregate_s': 2.0, 'round_s': 5.0}]
    split = time_split(rows)
    assert split['total_s'] == 10.0 and split['other_s'] == 0.0
    assert (split['train_pct'], split['extra_pct'], split['aggregation_wire_pct']) == (60.0, 20.0, 20.0)
    assert time_split([])['rounds'] == 0 and time_split([])['total_s'] == 0.0


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_loss_time_outside_the_models_forward_is_method_extra(monkeypatch):
    """RoundClock.extra_beside: inside a loss, the model's own forward is training, the rest
    (e.g. FedMosaic's RELA gradient on another model) the method's extra."""
    clock = _FakeClock()
    monkeypatch.setattr(client_mod.time, 'perf_counter', clock)

    class Model(torch.nn.Module):
        def forward(self, x):
            clock.now += 5.0
            return x

    model, round_clock = Model(), client_mod.RoundClock()
    round_clock.begin()
    with round_clock.extra_beside(model):
        clock.now += 2.0   # the method's own work before the forward
        model(torch.zeros(1))
        model(torch.zeros(1))   # a second forward (e.g. a teacher pass) is training too
        clock.now += 1.0
    with round_clock.extra():
        clock.now += 0.5
    clock.now += 4.0          # the rest of the round: optimiser steps, batches
    round_clock.tokens = 140
    assert round_clock.take() == {'train_s': 14.0, 'extra_s': 3.5, 'tokens_per_s': 10.0}
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert round_clock.take()['extra_s'] == 0.0


def test_trained_tokens_counts_the_attention_mask():
    batch = {'input_ids': torch.ones(2, 4, dtype=torch.long),
             'attention_mask': torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])}
    assert client_mod.trained_tokens(batch) == 5
    assert client_mod.trained_tokens({'input_ids': torch.ones(2, 3)}) == 6


@pytest.mark.parametrize('distributed', [False, True])
def test_an_update_carries_its_encoding_seconds(distributed):
    update = ClientUpdate(3, 4, {'w': torch.ones(2)}, {}, {'train_s': 1.0}, dataset_size=8)
    message = with_encode_time(encode_update(update, distributed), 0.25)
    assert decode_update(3, 4, message).metrics == {'train_s': 1.0, 'encode_s': 0.25}
    assert 'encode_s' not in decode_update(3, 4, encode_update(update, distributed)).metrics
    for bad in (-1.0, float('inf'), 'fast', True):
        with pytest.raises(WireError, match="client 3: 'meta/encode_s'"):
            decode_update(3, 4, {**message, 'meta/encode_s': bad})


@pytest.mark.fs
def test_fs_standalone_rows_carry_the_embedded_runners_time_columns(tmp_path):
    import federatedscope
    cfg = tiny_config(tmp_path, 'fedavg', rounds=2)
    cfg['fsplug']['results_dir'] = str(tmp_path / 'fs')
    proc = subprocess.run([sys.executable, 'federatedscope/main.py', '--cfg',
                           write_yaml(tmp_path / 'fs.yaml', cfg)],
                          cwd=os.path.dirname(os.path.dirname(federatedscope.__file__)),
                          env=env_with_tests(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Where the rounds' time went" in proc.stdout
    rows = _read_rows(str(tmp_path / 'fs'))
    for row in _kind(rows, 'train'):
        assert all(row[k] > 0 for k in TRAIN_TIMES) and row['encode_s'] >= 0, row
    for row in _kind(rows, 'eval'):
        assert row['eval_s'] > 0 and {'eval_prefill_s', 'eval_generate_s'} <= set(row), row
    servers = _kind(rows, 'server')
    assert [r['round'] for r in servers] == [0, 1]
    assert all(s['aggregate_s'] > 0 and s['round_s'] > 0 and s['encode_s'] > 0 and s['decode_s'] > 0
               for s in servers)
    embedded = run_embedded(load_config(write_yaml(tmp_path / 'emb.yaml',
                                                   tiny_config(tmp_path, 'fedavg', rounds=2))))
    columns = {kind: set().union(*(set(r) for r in _kind(embedded.rows, kind)))
               for kind in ('train', 'eval', 'server')}
    for kind, names in columns.items():
        fs_names = set().union(*(set(r) for r in _kind(rows, kind)))
        own = {'encode_s'} if kind == 'train' else set()   # the FS clients' wire
        assert fs_names == names | own, kind


@pytest.mark.slow
def test_a_resumed_run_keeps_one_server_row_per_round(tmp_path, monkeypatch):
    """The server row of a round is logged before its checkpoint counts the rows: a run that
    fails while writing round 1's checkpoint resumes from round 0's with round 0's server row,
    repeats round 1, and ends with the uninterrupted run's rows (times aside)."""
    from fs_plugins.run import checkpoint

    def run(name, *opts):
        cfg = tiny_config(tmp_path, 'fedavg', rounds=2, fsplug={
            'results_dir': str(tmp_path / name), 'checkpoint': {'freq': 1}})
        return run_embedded(load_config(write_yaml(tmp_path / f'{name}.yaml', cfg), list(opts)))

    full = run('full')
    original = checkpoint.write_party

    def failing(path, payload, info=None):
        if os.path.basename(path) == 'server.round1.safetensors':
            raise RuntimeError('injected checkpoint fault')
        return original(path, payload, info)
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, 'write_party', failing)
        with pytest.raises(RuntimeError, match='injected'):
            run('cut')
    cut = str(tmp_path / 'cut')
    resumed = run('cut', 'fsplug.checkpoint.resume_from', cut)
    assert [r['round'] for r in _kind(_read_rows(cut), 'server')] == [0, 1]
    assert without_times(_read_rows(cut)) == without_times(full.rows) == without_times(resumed.rows)
    with open(os.path.join(cut, 'results.superseded.jsonl')) as handle:
        superseded = [json.loads(line) for line in handle]
    assert {(r['round'], r['kind']) for r in superseded} == {(1, 'train'), (1, 'eval'), (1, 'server')}

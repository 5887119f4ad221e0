"""The extension points every paper method relies on, exercised with tests/toy_methods.py:
(a) client-local state persists, (b) phases, (c) extra payloads and personalised content,
(e) server state across rounds. (d) heterogeneity is in test_embedded_runs.py."""
import pytest
import torch
import toy_methods  # noqa: F401  (registers toy_phased)
from helpers import tiny_config, write_yaml

from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.client import ClientProcedure
from fs_plugins.run.config import load_config
from fs_plugins.run.results import ResultsLog
from fs_plugins.run.runtime import build_federated_records, initial_global
from fs_plugins.run.server import ServerProcedure
from fs_plugins.sim import runner as runner_mod

TOY = {'fsplug': {'import_modules': ['toy_methods'], 'toy_phased': {'first_phase_steps': 2}}}


def _cfg(tmp_path, rounds=2, steps=5, **updates):
    from helpers import deep_update
    return load_config(write_yaml(tmp_path / 'toy.yaml', deep_update(
        tiny_config(tmp_path, 'toy_phased', rounds=rounds, steps=steps, **updates), TOY)))


def _client(cfg, cid=1):
    method = get_method_class('toy_phased')(cfg)
    records = build_federated_records(cfg)
    return ClientProcedure(cid, cfg, method, build_model(cfg, method), records.clients[cid])


def _snapshot(proc):
    return {n: proc.params[n].detach().clone() for n in proc.trainable_names}


def test_phases_train_exactly_their_parameters(tmp_path):
    """(b) Step 1-2 change only lora_A, steps 3-5 only lora_B; frozen ones get no grad."""
    cfg = _cfg(tmp_path, train={'optimizer': {'type': 'AdamW', 'lr': 0.01, 'weight_decay': 0.1}})
    proc = _client(cfg)
    proc.begin_round()
    history = []
    for _ in range(5):
        before = _snapshot(proc)
        batch = proc.next_batch()
        loss = proc.compute_loss(batch)
        proc.optimise(loss)
        with_grad = {n for n in proc.trainable_names if proc.params[n].grad is not None}
        changed = {n for n in proc.trainable_names if not torch.equal(before[n], proc.params[n])}
        history.append((with_grad, changed))
    a_names = {n for n in proc.trainable_names if 'lora_A' in n}
    b_names = {n for n in proc.trainable_names if 'lora_B' in n}
    for step, (with_grad, changed) in enumerate(history):
        expected = a_names if step < 2 else b_names
        assert with_grad == expected, f'step {step}'
        # AdamW weight decay and moments must not move the frozen set
        assert changed == expected, f'step {step}'
    proc.end_round()
    assert all(proc.params[n].requires_grad for n in proc.trainable_names)


@pytest.mark.slow
def test_only_shared_keys_leave_and_counters_persist(tmp_path):
    """(a)+(c) lora_B stays local; the step counter survives rounds and is sent as extra."""
    cfg = _cfg(tmp_path)
    proc = _client(cfg)
    first = proc.run_round(0)
    assert first.shared and all('lora_A' in n for n in first.shared)
    assert int(first.extra['steps_total'][0]) == 5
    b_before = {n: proc.params[n].detach().clone() for n in proc.trainable_names if 'lora_B' in n}
    proc.receive({n: torch.zeros_like(t) for n, t in first.shared.items()})
    for n, t in b_before.items():                       # receiving leaves local params alone
        assert torch.equal(proc.params[n], t)
    assert all(torch.count_nonzero(proc.params[n]) == 0 for n in first.shared)
    second = proc.run_round(1)
    assert int(second.extra['steps_total'][0]) == 10


@pytest.mark.slow
def test_server_state_and_personalised_content(tmp_path):
    """(c)+(e) the server keeps state across rounds and sends each client its own content."""
    cfg = _cfg(tmp_path)
    method = get_method_class('toy_phased')(cfg)
    server = ServerProcedure(cfg, method, initial_global(cfg, method)[0],
                             ResultsLog(str(tmp_path / 'res'), {}))
    clients = {cid: _client(cfg, cid) for cid in (1, 2, 3)}
    for round_idx in range(2):
        updates = []
        for cid, proc in clients.items():
            proc.receive(server.content_for(cid))
            updates.append(proc.run_round(round_idx))
        server.aggregate(round_idx, updates)
    assert server.state['rounds'] == 2
    assert server.state['counters'] == {1: 10, 2: 10, 3: 10}
    contents = [server.content_for(cid) for cid in (1, 2, 3)]
    key = next(iter(contents[0]))
    assert not torch.equal(contents[0][key], contents[1][key])
    expected = (updates[1].shared[key] * updates[1].num_samples + updates[2].shared[key] * updates[2].num_samples) \
        / (updates[1].num_samples + updates[2].num_samples)
    torch.testing.assert_close(contents[0][key], expected)


@pytest.mark.slow
def test_local_state_persists_through_embedded_runner(tmp_path, monkeypatch):
    """(a) in the embedded runner: lora_B differs between clients, and a client's lora_B is
    exactly what its own training left (aggregation never touches it)."""
    captured = {}
    original = runner_mod.build_clients

    def spy(*args, **kwargs):
        captured.update(original(*args, **kwargs))
        return captured
    monkeypatch.setattr(runner_mod, 'build_clients', spy)
    results = runner_mod.run_embedded(_cfg(tmp_path, rounds=3))
    b_name = next(n for n in captured[1].trainable_names if 'lora_B' in n)
    assert not torch.equal(captured[1].params[b_name], captured[2].params[b_name])
    assert captured[1].state['steps_total'] == 15
    uploads = [r['bytes_up'] for r in results.rows if r['kind'] == 'train']
    a_numel = sum(p.numel() for n, p in captured[1].params.items() if 'lora_A' in n)
    assert set(uploads) == {a_numel * 4 + 8}                  # lora_A float32 + one int64 counter


@pytest.mark.slow
def test_failure_mid_run_keeps_results(tmp_path):
    cfg = _cfg(tmp_path, rounds=4, fsplug={'toy_phased': {'fail_at_round': 2}})
    with pytest.raises(RuntimeError, match='planned failure'):
        runner_mod.run_embedded(cfg)
    import json
    import os
    with open(os.path.join(str(tmp_path / 'results'), 'results.jsonl')) as handle:
        rows = [json.loads(x) for x in handle]
    assert {r['round'] for r in rows if r['kind'] == 'eval'} == {0, 1}
    assert os.path.exists(os.path.join(str(tmp_path / 'results'), 'summary.md'))

"""Both baselines end to end through the embedded runner, and the results format."""
import csv
import json
import os

import pytest
import torch
from helpers import tiny_config, untimed_results_file, untimed_rows, write_yaml

from fs_plugins.run.config import load_config
from fs_plugins.sim.runner import run_embedded


def _run(tmp_path, method, client_cfgs=None, **updates):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_config(write_yaml(tmp_path / f'{method}.yaml', tiny_config(tmp_path, method, **updates)))
    return run_embedded(cfg, client_cfgs)


def _rows(results, kind):
    return [r for r in results.rows if r['kind'] == kind]


@pytest.mark.slow
@pytest.mark.parametrize('method', ['fedavg', 'standalone'])
def test_results_files_and_table(tmp_path, method, capsys):
    results = _run(tmp_path, method)
    out = capsys.readouterr().out
    assert 'Per-client results' in out and '| average |' in out
    with open(os.path.join(results.out_dir, 'results.jsonl')) as handle:
        lines = handle.read().splitlines()
    rows = [json.loads(line) for line in lines]
    train = [r for r in rows if r['kind'] == 'train']
    evals = [r for r in rows if r['kind'] == 'eval']
    assert len(train) == 2 * 4 and len(evals) == 2 * 4          # eval.freq 1, 2 rounds, 4 clients
    assert {r['client'] for r in evals} == {1, 2, 3, 4}
    assert [(r['round'], r['client']) for r in rows if r['kind'] == 'server'] == [(0, 0), (1, 0)]
    for r in train:
        assert r['samples'] == 3 * 8 and r['train_steps'] == 3
        assert set(r) >= {'round', 'client', 'bytes_up', 'bytes_down', 'train_avg_loss'}
    for r in evals:
        assert 0.0 <= r['test_token_acc'] <= 1.0 and r['test_avg_loss'] > 0
    with open(os.path.join(results.out_dir, 'results.csv')) as handle:
        assert len(list(csv.DictReader(handle))) == len(rows)
    # the per-client table (header, rule, 4 clients, average), then the time split
    summary = untimed_results_file(results.out_dir, 'summary.md')
    assert summary.count('\n') == 2 + 4 + 1 and '1 (arith)' in summary
    with open(os.path.join(results.out_dir, 'run_info.json')) as handle:
        info = json.load(handle)
    assert info['runner'] == 'embedded' and info['method'] == method


@pytest.mark.slow
def test_fedavg_communicates_lora_and_syncs_clients(tmp_path):
    results = _run(tmp_path, 'fedavg')
    train = _rows(results, 'train')
    # 4 target modules x 2 layers x (A: r x d_in + B: d_out x r), float32
    lora_numel = 2 * 8 * ((64 + 64) * 2 + (64 + 128) + (128 + 64))
    assert all(r['bytes_up'] == 4 * lora_numel for r in train)
    assert all(r['bytes_down'] == 4 * lora_numel for r in train)


@pytest.mark.slow
def test_standalone_sends_nothing_and_clients_diverge(tmp_path):
    from helpers import run_embedded_keeping_clients
    # the same run as _run(tmp_path, 'standalone'), keeping the clients to inspect them
    cfg = load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, 'standalone')))
    results, clients = run_embedded_keeping_clients(cfg)
    assert all(r['bytes_up'] == 0 and r['bytes_down'] == 0 for r in _rows(results, 'train'))
    assert len(_rows(results, 'train')) == 2 * 4
    # and on the parameters: every client trained its own LoRA B away from peft's zero init,
    # and no two clients ended with the same one
    assert sorted(clients) == [1, 2, 3, 4]
    b_keys = [n for n in clients[1].trainable_names if 'lora_B' in n]
    assert b_keys
    # the initial adapters (they depend only on the seed): peft starts every lora_B at zero
    from fs_plugins.methods.building import build_model
    from fs_plugins.methods.registry import get_method_class
    initial = dict(build_model(cfg, get_method_class('standalone')(cfg)).model.named_parameters())
    for key in b_keys:
        assert torch.count_nonzero(initial[key]) == 0, key
        for cid, proc in clients.items():
            assert torch.count_nonzero(proc.params[key]) > 0, (cid, key)   # moved from zeros
            assert not torch.allclose(proc.params[key], initial[key]), (cid, key)
        assert not torch.equal(clients[1].params[key], clients[2].params[key]), key
        for i in clients:
            for j in clients:
                if i < j:
                    assert not torch.allclose(clients[i].params[key], clients[j].params[key]), (i, j, key)


@pytest.mark.slow
def test_same_seed_same_numbers_other_seed_differs(tmp_path):
    a = untimed_rows(_rows(_run(tmp_path / 'a', 'fedavg'), 'eval'))
    b = untimed_rows(_rows(_run(tmp_path / 'b', 'fedavg'), 'eval'))
    c = _rows(_run(tmp_path / 'c', 'fedavg', seed=2), 'eval')
    assert a == b
    assert [r['test_avg_loss'] for r in a] != [r['test_avg_loss'] for r in c]


@pytest.mark.slow
def test_lora_dropout_is_seeded(tmp_path):
    """Dropout draws from torch's global generator, which the client reseeds every round."""
    dropout = {'fsplug': {'model': {'lora': {'dropout': 0.3}}}}
    a = untimed_rows(_rows(_run(tmp_path / 'a', 'fedavg', **dropout), 'train'))
    torch.rand(7)   # whatever drew from the global generator between the runs
    b = untimed_rows(_rows(_run(tmp_path / 'b', 'fedavg', **dropout), 'train'))
    assert a == b


@pytest.mark.slow
def test_eval_freq_and_final_eval(tmp_path):
    results = _run(tmp_path, 'fedavg', rounds=3, eval={'freq': 2})
    assert sorted({r['round'] for r in _rows(results, 'eval')}) == [1, 2]


@pytest.mark.slow
def test_partial_participation_is_seeded(tmp_path):
    a = _run(tmp_path / 'a', 'fedavg', rounds=3, federate={'sample_client_num': 2})
    b = _run(tmp_path / 'b', 'fedavg', rounds=3, federate={'sample_client_num': 2})
    per_round = lambda res: [sorted(r['client'] for r in _rows(res, 'train') if r['round'] == k)  # noqa: E731
                             for k in range(3)]
    assert per_round(a) == per_round(b)
    assert all(len(c) == 2 for c in per_round(a))


def test_missing_data_file_named(tmp_path):
    with pytest.raises(FileNotFoundError, match='nothere.jsonl'):
        _run(tmp_path, 'fedavg', data={'type': 'nothere.jsonl@fsplug'})


def test_missing_model_dir_named(tmp_path):
    with pytest.raises(FileNotFoundError, match='/no/such/model'):
        _run(tmp_path, 'fedavg', model={'type': '/no/such/model@fsplug_llm'},
             fsplug={'model': {'builder': 'causal_lm'}})


def test_bad_target_modules_named(tmp_path):
    from fs_plugins.run.config import ConfigError
    with pytest.raises(ConfigError, match='target_modules'):
        _run(tmp_path, 'fedavg', fsplug={'model': {'lora': {'target_modules': ['nope_proj']}}})


def test_heterogeneous_ranks_and_lr_per_client(tmp_path):
    """(d) `--client_cfg` really changes the client: its LoRA rank and its learning rate."""
    from helpers import run_embedded_keeping_clients
    client_cfgs = {'client_1': {'fsplug': {'model': {'lora': {'r': 2}}}},
                   'client_2': {'fsplug': {'model': {'lora': {'r': 16}}},
                                'train': {'optimizer': {'lr': 0.05}}}}
    cfg = load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, 'standalone')))
    results, clients = run_embedded_keeping_clients(cfg, client_cfgs)
    assert len(_rows(results, 'eval')) == 8
    a_key = next(n for n in clients[1].trainable_names if 'lora_A' in n)
    ranks = {cid: clients[cid].params[a_key].shape[0] for cid in (1, 2, 3)}
    assert ranks == {1: 2, 2: 16, 3: 8}
    clients[2].begin_round()
    clients[3].begin_round()
    assert clients[2].optimizer.param_groups[0]['lr'] == 0.05
    assert clients[3].optimizer.param_groups[0]['lr'] == cfg.train.optimizer.lr == 0.01


def test_fedavg_with_mixed_ranks_fails_naming_the_tensor(tmp_path):
    with pytest.raises(ValueError, match='lora_A'):
        _run(tmp_path, 'fedavg', {'client_2': {'fsplug': {'model': {'lora': {'r': 4}}}}})

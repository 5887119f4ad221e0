"""The aggregation-family methods: what each uploads and downloads, and its defining
behaviour, end to end on the tiny model through the embedded runner."""
import pytest
import torch

from fs_plugins.aggregation.server_opt import adaptive_server_step
from fs_plugins.config import load_config
from fs_plugins.methods.registry import get_method_class
from helpers import run_embedded_keeping_clients, tiny_config, write_yaml

# tiny model: 2 layers; targets q,v (64x64), up (128<-64), down (64<-128); r = 8
TARGETS = {'q_proj': (64, 64), 'v_proj': (64, 64), 'up_proj': (128, 64), 'down_proj': (64, 128)}
R = 8
A_NUMEL = 2 * sum(R * d_in for d_out, d_in in TARGETS.values())
B_NUMEL = 2 * sum(d_out * R for d_out, d_in in TARGETS.values())
FULL_NUMEL = 2 * sum(d_out * d_in for d_out, d_in in TARGETS.values())


def run(tmp_path, method, client_cfgs=None, rounds=2, **updates):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, method, rounds=rounds,
                                                                  steps=2, **updates)))
    return run_embedded_keeping_clients(cfg, client_cfgs)


def train_rows(results):
    return [r for r in results.rows if r['kind'] == 'train']


def test_ffa_trains_and_sends_only_b(tmp_path):
    results, clients = run(tmp_path, 'ffa')
    proc = clients[1]
    assert proc.trainable_names and all('lora_B' in n for n in proc.trainable_names)
    assert {r['bytes_up'] for r in train_rows(results)} == {4 * B_NUMEL}
    a = {n: p for n, p in proc.params.items() if 'lora_A' in n}
    other = clients[2].params
    assert all(torch.equal(p, other[n]) for n, p in a.items())   # common frozen init


def test_fedsa_keeps_b_local(tmp_path):
    results, clients = run(tmp_path, 'fedsa')
    assert {r['bytes_up'] for r in train_rows(results)} == {4 * A_NUMEL}
    b_key = next(n for n in clients[1].trainable_names if 'lora_B' in n)
    assert not torch.equal(clients[1].params[b_key], clients[2].params[b_key])
    a_key = next(n for n in clients[1].trainable_names if 'lora_A' in n)
    # after the final evaluation broadcast every client holds the same averaged A
    assert torch.equal(clients[1].params[a_key], clients[2].params[a_key])


def test_fedprox_adds_the_proximal_term(tmp_path):
    results, clients = run(tmp_path, 'fedprox', rounds=1, fsplug={'fedprox': {'mu': 0.5}})
    assert {r['bytes_up'] for r in train_rows(results)} == {4 * (A_NUMEL + B_NUMEL)}
    proc = clients[1]
    anchor = proc.state['anchor']
    batch = proc.collate([proc.train_data[0]])
    with torch.no_grad():
        for name in anchor:
            proc.params[name].add_(0.1)
        plain = proc.model(**batch).loss
        with_prox = proc.method.loss(proc.model, batch, proc.state)
    expected = 0.5 * 0.5 * sum(0.01 * anchor[n].numel() for n in anchor)
    assert float(with_prox - plain) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize('variant', ['adagrad', 'adam', 'yogi'])
def test_adaptive_server_step_formula(variant):
    g = {'w': torch.tensor([1.0, -2.0])}
    avg = {'w': torch.tensor([1.5, -2.5])}
    m0, v0 = torch.tensor([0.1, 0.1]), torch.tensor([0.2, 0.3])
    new, moments = adaptive_server_step(g, avg, {'w': (m0, v0)}, variant, 0.1, 0.9, 0.99, 1e-3)
    d = avg['w'] - g['w']
    m = 0.9 * m0 + 0.1 * d
    v = {'adagrad': v0 + d * d, 'adam': 0.99 * v0 + 0.01 * d * d,
         'yogi': v0 - 0.01 * d * d * torch.sign(v0 - d * d)}[variant]
    torch.testing.assert_close(new['w'], g['w'] + 0.1 * m / (v.sqrt() + 1e-3))
    torch.testing.assert_close(moments['w'][1], v)


@pytest.mark.parametrize('method', ['fedadam', 'fedyogi', 'fedadagrad'])
def test_server_optimisers_run_and_keep_moments(tmp_path, method):
    results, _ = run(tmp_path, method)
    assert {r['bytes_up'] for r in train_rows(results)} == {4 * (A_NUMEL + B_NUMEL)}


def test_scaffold_controls(tmp_path):
    results, clients = run(tmp_path, 'scaffold')
    proc = clients[1]
    shared = A_NUMEL + B_NUMEL
    # uploads y and Δc_i (both float32, same size); downloads x and c
    assert {r['bytes_up'] for r in train_rows(results)} == {4 * 2 * shared}
    assert {r['bytes_down'] for r in train_rows(results)} == {4 * 2 * shared}
    assert proc.state['c_i'] and all(torch.count_nonzero(v) > 0 for v in proc.state['c_i'].values())
    # the correction really is g + c - c_i
    name = next(iter(proc.state['c_i']))
    param = proc.params[name]
    param.grad = torch.zeros_like(param)
    proc.method.before_optimizer_step(proc.model, proc.state)
    torch.testing.assert_close(param.grad, proc.state['c'][name] - proc.state['c_i'][name])
    param.grad = None


def test_fed_a2_runs_and_uploads_like_fedavg(tmp_path):
    results, _ = run(tmp_path, 'fed_a2')
    assert {r['bytes_up'] for r in train_rows(results)} == {4 * (A_NUMEL + B_NUMEL)}


def test_fedex_folds_the_residual_and_pays_full_size(tmp_path):
    results, clients = run(tmp_path, 'fedex', rounds=3)
    down = {r['round']: r['bytes_down'] for r in train_rows(results) if r['client'] == 1}
    assert down[0] == 4 * (A_NUMEL + B_NUMEL)                     # no residual yet
    assert down[1] == down[2] == 4 * (A_NUMEL + B_NUMEL + FULL_NUMEL)
    proc = clients[1]
    prefix, w0 = next(iter(proc.state['w0'].items()))
    layer = proc.model.get_submodule(prefix)
    assert not torch.equal(layer.base_layer.weight, w0)           # residual folded in
    assert layer.base_layer.weight.data_ptr() != clients[2].model.get_submodule(prefix).base_layer.weight.data_ptr()


def test_feddpa_local_adapter_stays_local(tmp_path):
    results, clients = run(tmp_path, 'feddpa')
    proc = clients[1]
    assert any('.local.' in n for n in proc.trainable_names)
    assert {r['bytes_up'] for r in train_rows(results)} == {4 * (A_NUMEL + B_NUMEL)}
    local_b = next(n for n in proc.trainable_names if 'lora_B.local' in n)
    assert torch.count_nonzero(proc.params[local_b]) > 0
    assert not torch.equal(proc.params[local_b], clients[2].params[local_b])


MIXED_RANKS = {'client_1': {'fsplug': {'model': {'lora': {'r': 2}}}},
               'client_2': {'fsplug': {'model': {'lora': {'r': 4}}}},
               'client_3': {'fsplug': {'model': {'lora': {'r': 8}}}},
               'client_4': {'fsplug': {'model': {'lora': {'r': 16}}}}}


@pytest.mark.parametrize('method', ['hetlora', 'flexlora'])
def test_heterogeneous_ranks_end_to_end(tmp_path, method):
    results, clients = run(tmp_path, method, MIXED_RANKS)
    per_rank = (A_NUMEL + B_NUMEL) // R * 4                       # bytes per unit of rank
    ups = {r['client']: r['bytes_up'] for r in train_rows(results) if r['round'] == 1}
    assert ups == {1: 2 * per_rank, 2: 4 * per_rank, 3: 8 * per_rank, 4: 16 * per_rank}
    a_key = next(n for n in clients[1].trainable_names if 'lora_A' in n)
    assert clients[1].params[a_key].shape[0] == 2 and clients[4].params[a_key].shape[0] == 16
    # every client holds the leading components of the same global factors
    torch.testing.assert_close(clients[1].params[a_key], clients[4].params[a_key][:2])


def test_vera_adapter_shares_only_scaling_vectors(tmp_path):
    results, clients = run(tmp_path, 'fedavg', fsplug={'model': {'adapter': 'vera',
                                                                 'vera': {'r': 16}}})
    names = clients[1].trainable_names
    assert names and all('vera_lambda' in n for n in names)
    numel = sum(clients[1].params[n].numel() for n in names)
    assert {r['bytes_up'] for r in train_rows(results)} == {4 * numel}


def test_rslora_scaling(tmp_path):
    _, clients = run(tmp_path, 'fedavg', rounds=1, fsplug={'model': {'lora': {'use_rslora': True}}})
    layer = next(m for n, m in clients[1].model.named_modules() if n.endswith('q_proj') and hasattr(m, 'scaling'))
    assert layer.scaling['default'] == pytest.approx(16 / R ** 0.5)


def test_every_method_is_registered():
    for name in ['standalone', 'fedavg', 'fed_a2', 'fedex', 'ffa', 'fedsa', 'feddpa', 'flexlora',
                 'hetlora', 'fedprox', 'fedadam', 'fedyogi', 'fedadagrad', 'scaffold']:
        assert get_method_class(name).name == name

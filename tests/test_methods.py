"""The aggregation-family methods: what each uploads and downloads, and its defining
behaviour, end to end on the tiny model through the embedded runner."""
import math

import pytest
import torch
from helpers import run_embedded_keeping_clients, tiny_config, write_yaml

from fs_plugins.aggregation.server_opt import adaptive_server_step
from fs_plugins.methods.base import ClientUpdate
from fs_plugins.methods.fedex import RESIDUAL
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.config import load_config

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


def direct_method(tmp_path, method, **updates):
    """The method object built from a loaded tiny config, for driving its server side by hand."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_config(write_yaml(tmp_path / 'direct.yaml', tiny_config(tmp_path, method, **updates)))
    return get_method_class(method)(cfg)


def naive_weighted_mean(values, weights):
    """Σ n_k x_k / Σ n_k over tensors, in float64."""
    return sum(float(n) * x.double() for n, x in zip(weights, values)) / float(sum(weights))


def lora_pair(gen, r, d_in, d_out, prefix='m.q_proj'):
    """{A key: (r, d_in), B key: (d_out, r)} with peft's key names, float32."""
    return {f'{prefix}.lora_A.default.weight': torch.randn(r, d_in, generator=gen),
            f'{prefix}.lora_B.default.weight': torch.randn(d_out, r, generator=gen)}


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


SERVER_OPT_HP = {'server_lr': 0.05, 'beta1': 0.8, 'beta2': 0.95, 'tau': 0.01}


def _sign(x):
    return (x > 0) - (x < 0)


def _naive_server_round(variant, x, m, v, avg, hp):
    """One round of Reddi et al.'s update, element by element in Python floats (the formulas of
    aggregation/server_opt.py's docstring). Returns new (x, m, v) lists."""
    x2, m2, v2 = [], [], []
    for xj, mj, vj, aj in zip(x, m, v, avg):
        d = aj - xj
        mj = hp.beta1 * mj + (1 - hp.beta1) * d
        if variant == 'fedadagrad':
            vj = vj + d * d
        elif variant == 'fedadam':
            vj = hp.beta2 * vj + (1 - hp.beta2) * d * d
        else:
            vj = vj - (1 - hp.beta2) * d * d * _sign(vj - d * d)
        x2.append(xj + hp.server_lr * mj / (math.sqrt(vj) + hp.tau))
        m2.append(mj)
        v2.append(vj)
    return x2, m2, v2


@pytest.mark.slow
@pytest.mark.parametrize('method', ['fedadam', 'fedyogi', 'fedadagrad'])
def test_server_optimisers_run_and_keep_moments(tmp_path, method):
    results, _ = run(tmp_path, method)
    assert {r['bytes_up'] for r in train_rows(results)} == {4 * (A_NUMEL + B_NUMEL)}
    # the server side against a naive re-implementation, two rounds so the moments carry over
    opt = direct_method(tmp_path / 'direct', method, fsplug={method: SERVER_OPT_HP})
    hp = opt.hparams
    assert {k: getattr(hp, k) for k in SERVER_OPT_HP} == SERVER_OPT_HP   # config reaches it
    x0 = [1.0, -2.0, 0.5, 0.0]
    rounds = [  # (n1, client 1's w), (n2, client 2's w)
        ((3, [1.4, -2.6, 0.5, 0.2]), (1, [0.2, -1.0, 0.9, -0.3])),
        ((2, [0.1, -1.5, 2.0, 0.4]), (5, [1.9, -2.2, -0.7, 0.1])),
    ]
    state = opt.init_server_state({'w': torch.tensor(x0)})
    x, m, v = list(x0), [0.0] * 4, [0.0] * 4
    for k, ((n1, w1), (n2, w2)) in enumerate(rounds):
        state = opt.aggregate(state, [ClientUpdate(1, n1, {'w': torch.tensor(w1)}),
                                      ClientUpdate(2, n2, {'w': torch.tensor(w2)})])
        avg = [(n1 * a + n2 * b) / (n1 + n2) for a, b in zip(w1, w2)]
        x_before = list(x)
        x, m, v = _naive_server_round(method, x, m, v, avg, hp)
        assert state['global']['w'].dtype == torch.float32
        torch.testing.assert_close(state['global']['w'].double(), torch.tensor(x, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-6, msg=f'{method} global, round {k}')
        m_got, v_got = state['moments']['w']
        torch.testing.assert_close(m_got.double(), torch.tensor(m, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-6, msg=f'{method} m, round {k}')
        torch.testing.assert_close(v_got.double(), torch.tensor(v, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-7, msg=f'{method} v, round {k}')
    # round 2 really used round 1's moments: restarting them from zero gives other numbers
    x_fresh, _, _ = _naive_server_round(method, x_before, [0.0] * 4, [0.0] * 4, avg, hp)
    assert max(abs(a - b) for a, b in zip(x_fresh, x)) > 1e-3


@pytest.mark.slow
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


def _naive_fed_a2(updates, lam):
    """A = Σ p_k A_k, B = (Σ p_k B_k A_k) Aᵀ (A Aᵀ + λ I)⁻¹ in float64 for the one LoRA pair."""
    a_key, b_key = sorted(k for k in updates[0].shared if '.lora_' in k)
    n = [u.num_samples for u in updates]
    A = naive_weighted_mean([u.shared[a_key] for u in updates], n)
    U = naive_weighted_mean([u.shared[b_key].double() @ u.shared[a_key].double() for u in updates], n)
    G = A @ A.T + lam * torch.eye(A.shape[0], dtype=torch.float64)
    return a_key, b_key, A, U @ A.T @ torch.linalg.inv(G)


def test_fed_a2_method_passes_the_ridge_through(tmp_path):
    gen = torch.Generator().manual_seed(3)
    r, d_in, d_out = 3, 7, 5
    updates = [ClientUpdate(1, 4, {**lora_pair(gen, r, d_in, d_out),
                                   'm.norm.weight': torch.randn(d_in, generator=gen)}),
               ClientUpdate(2, 1, {**lora_pair(gen, r, d_in, d_out),
                                   'm.norm.weight': torch.randn(d_in, generator=gen)})]
    initial = {**{k: torch.zeros_like(v) for k, v in updates[0].shared.items()},
               'm.other.weight': torch.ones(2)}
    results = {}
    for lam in (0.5, 0.0):
        method = direct_method(tmp_path / f'lam{lam}', 'fed_a2',
                               fsplug={'fed_a2': {'ridge': lam, 'ridge_mode': 'always'}})
        assert method.hparams.ridge == lam
        state = method.aggregate(method.init_server_state(dict(initial)), updates)
        a_key, b_key, A_ref, B_ref = _naive_fed_a2(updates, lam)
        out = state['global']
        torch.testing.assert_close(out[a_key].double(), A_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[b_key].double(), B_ref, rtol=1e-5, atol=1e-6)
        # other shared tensors are sample-weighted means; untouched globals are kept
        torch.testing.assert_close(out['m.norm.weight'].double(),
                                   naive_weighted_mean([u.shared['m.norm.weight'] for u in updates], [4, 1]),
                                   rtol=1e-6, atol=1e-6)
        assert torch.equal(out['m.other.weight'], torch.ones(2))
        results[lam] = out[b_key]
    # λ = 0.5 measurably changes B here (the A Aᵀ of this test is well conditioned, so the
    # the default, λ = 1 every round, is tests/test_fed_a2.py's)
    assert float((results[0.5] - results[0.0]).abs().max()) > 1e-2


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
    # receive folds a given cumulative residual: W = W0 + s · R (not accumulated on W)
    gen = torch.Generator().manual_seed(0)
    weight = layer.base_layer.weight
    a_key = f'{prefix}.lora_A.default.weight'
    new_a = torch.randn(proc.params[a_key].shape, generator=gen)
    w0_before = w0.clone()
    for _ in range(2):                                            # receiving twice is harmless
        residual = torch.randn(weight.shape, generator=gen)
        proc.method.receive(proc.model, {a_key: new_a, RESIDUAL + prefix: residual}, proc.state)
        assert torch.equal(proc.state['w0'][prefix], w0_before)   # W0 is kept, not overwritten
        torch.testing.assert_close(weight.detach(),
                                   proc.state['w0'][prefix] + layer.scaling['default'] * residual)
        torch.testing.assert_close(proc.params[a_key].detach(), new_a)
    assert layer.scaling['default'] == pytest.approx(16 / R)


def _naive_residual(updates, prefix):
    """Σ p_k B_k A_k − B̄ Ā with Ā, B̄ the p-weighted means, float64."""
    a_key, b_key = f'{prefix}.lora_A.default.weight', f'{prefix}.lora_B.default.weight'
    n = [u.num_samples for u in updates]
    A_avg = naive_weighted_mean([u.shared[a_key] for u in updates], n)
    B_avg = naive_weighted_mean([u.shared[b_key] for u in updates], n)
    product = naive_weighted_mean([u.shared[b_key].double() @ u.shared[a_key].double() for u in updates], n)
    return product - B_avg @ A_avg


def test_fedex_server_accumulates_the_residual(tmp_path):
    method = direct_method(tmp_path, 'fedex')
    gen = torch.Generator().manual_seed(5)
    prefixes = {'m.q_proj': (6, 4), 'm.up_proj': (9, 4)}           # (d_out, d_in)
    r = 2

    def update(cid, n):
        shared = {}
        for prefix, (d_out, d_in) in prefixes.items():
            shared.update(lora_pair(gen, r, d_in, d_out, prefix))
        return ClientUpdate(cid, n, shared)

    initial = {k: torch.zeros_like(v) for k, v in update(0, 1).shared.items()}
    state = method.init_server_state(initial)
    rounds = [[update(1, 3), update(2, 1)], [update(1, 2), update(2, 5)]]
    expected = {p: torch.zeros(d_out, d_in, dtype=torch.float64) for p, (d_out, d_in) in prefixes.items()}
    for updates in rounds:
        state = method.aggregate(state, updates)
        for prefix in prefixes:
            expected[prefix] = expected[prefix] + _naive_residual(updates, prefix)
            assert state['residual'][prefix].dtype == torch.float32
            torch.testing.assert_close(state['residual'][prefix].double(), expected[prefix],
                                       rtol=1e-5, atol=1e-5)
        for key in initial:
            torch.testing.assert_close(
                state['global'][key].double(),
                naive_weighted_mean([u.shared[key] for u in updates], [u.num_samples for u in updates]),
                rtol=1e-6, atol=1e-6)
    # both rounds contribute (the second round's residual is not simply the cumulative one)
    last = _naive_residual(rounds[1], 'm.q_proj')
    assert float((expected['m.q_proj'] - last).abs().max()) > 1e-2
    # and the content for a client carries the cumulative residual under RESIDUAL + prefix
    content = method.content_for(state, 1)
    for prefix in prefixes:
        assert torch.equal(content[RESIDUAL + prefix], state['residual'][prefix])


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
    # the rank-16 client (above the base YAML's r = 8 the global factors start at) trains its
    # components 8..15 too: zero padding would have frozen them (zero A rows, zero B columns)
    b_key = a_key.replace('lora_A', 'lora_B')
    assert torch.count_nonzero(clients[4].params[b_key][:, R:]) > 0
    assert torch.count_nonzero(clients[4].params[a_key][R:]) > 0


def test_higher_rank_client_keeps_its_extra_components(tmp_path):
    from fs_plugins.aggregation.pairs import overlay_rank
    own_a, own_b = torch.randn(4, 6), torch.randn(5, 4)
    got_a, got_b = torch.randn(2, 6), torch.randn(5, 2)
    a = overlay_rank('m.lora_A.default.weight', got_a, own_a)
    b = overlay_rank('m.lora_B.default.weight', got_b, own_b)
    assert torch.equal(a[:2], got_a) and torch.equal(a[2:], own_a[2:])
    assert torch.equal(b[:, :2], got_b) and torch.equal(b[:, 2:], own_b[:, 2:])
    with pytest.raises(ValueError, match='exceeds'):
        overlay_rank('m.lora_A.default.weight', own_a, got_a)


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


# ------------------------------------------------------------------------------ FLoRA, FRLoRA

def _factor_update(gen, cid, n, prefixes, rank, extra=None):
    shared = {}
    for prefix, (d_out, d_in) in prefixes.items():
        shared.update(lora_pair(gen, rank, d_in, d_out, prefix))
    return ClientUpdate(cid, n, shared, extra or {})


def test_flora_server_stacks_exactly_at_mixed_ranks(tmp_path):
    from fs_plugins.methods.flora import MERGED, ROUNDS_MERGED, SCALE
    method = direct_method(tmp_path, 'flora')
    gen = torch.Generator().manual_seed(2)
    prefixes = {'m.q_proj': (6, 4), 'm.up_proj': (9, 4)}
    scale_of = {1: 2.0, 2: 4.0}                          # α = 16 at r = 8 and r = 4
    rank_of = {1: 8 // 2, 2: 4 // 2}

    def update(cid, n):
        return _factor_update(gen, cid, n, prefixes, rank_of[cid],
                              {SCALE + p: torch.tensor(scale_of[cid]) for p in prefixes})

    state = method.init_server_state({'head.weight': torch.zeros(3)})
    expected = {p: torch.zeros(d_out, d_in, dtype=torch.float64) for p, (d_out, d_in) in prefixes.items()}
    for updates in ([update(1, 3), update(2, 1)], [update(1, 1), update(2, 1)]):
        state = method.aggregate(state, updates)
        for prefix in prefixes:
            a_key, b_key = f'{prefix}.lora_A.default.weight', f'{prefix}.lora_B.default.weight'
            expected[prefix] += naive_weighted_mean(
                [scale_of[u.client_id] * u.shared[b_key].double() @ u.shared[a_key].double()
                 for u in updates], [u.num_samples for u in updates])
            torch.testing.assert_close(state['merged'][prefix].double(), expected[prefix],
                                       rtol=1e-5, atol=1e-5)
    content = method.content_for(state, 1)
    assert int(content[ROUNDS_MERGED]) == 2
    assert not any('lora_' in k for k in content)        # every client draws a fresh LoRA
    assert torch.equal(content[MERGED + 'm.q_proj'], state['merged']['m.q_proj'])


def test_flora_clients_merge_the_same_update_and_restart_from_a_fresh_lora(tmp_path):
    results, clients = run(tmp_path, 'flora', {'client_2': {'fsplug': {'model': {'lora': {'r': 4}}}}},
                           rounds=2)
    down = {r['round']: r['bytes_down'] for r in train_rows(results) if r['client'] == 1}
    assert down[1] > 4 * FULL_NUMEL                                  # the dense merged update
    one, two = clients[1], clients[2]
    for prefix, w0 in one.state['w0'].items():
        base = one.model.get_submodule(prefix).base_layer.weight
        assert not torch.equal(base, w0)                             # merged into the base
        other = two.model.get_submodule(prefix).base_layer.weight
        torch.testing.assert_close(base, other)                      # whatever the client's rank
    for proc in (one, two):
        assert all(float(p.detach().abs().max()) == 0 for n, p in proc.params.items()
                   if 'lora_B' in n)
    a_one = {n: p for n, p in one.params.items() if 'lora_A' in n}
    a_three = {n: p for n, p in clients[3].params.items() if 'lora_A' in n}
    assert all(torch.equal(p, a_three[n]) for n, p in a_one.items())  # the round's common A


def test_frlora_starts_function_identical_to_the_base(tmp_path):
    from fs_plugins.aggregation.lora import principal_factors
    from fs_plugins.methods.building import build_model
    models = {}
    for method in ('fedavg', 'frlora'):
        cfg = load_config(write_yaml(tmp_path / f'{method}.yaml', tiny_config(tmp_path, method)))
        models[method] = build_model(cfg, get_method_class(method)(cfg)).model.eval()
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain, principal = (models[m](input_ids=tokens).logits for m in ('fedavg', 'frlora'))
    torch.testing.assert_close(principal, plain, rtol=1e-4, atol=1e-4)
    layer = models['frlora'].get_submodule(next(n for n, m in models['frlora'].named_modules()
                                                if n.endswith('q_proj') and hasattr(m, 'lora_A')))
    original = models['fedavg'].get_submodule(
        next(n for n, m in models['fedavg'].named_modules() if n.endswith('q_proj') and hasattr(m, 'lora_A')))
    A0, B0 = principal_factors(original.base_layer.weight, R, layer.scaling['default'])
    torch.testing.assert_close(layer.lora_A['default'].weight.detach(), A0)
    torch.testing.assert_close(layer.lora_B['default'].weight.detach(), B0)


def test_frlora_server_sums_the_residual_product(tmp_path):
    from fs_plugins.methods.frlora import MERGED
    method = direct_method(tmp_path, 'frlora')
    gen = torch.Generator().manual_seed(4)
    prefixes = {'m.q_proj': (6, 4)}
    start = _factor_update(gen, 0, 1, prefixes, 2).shared
    state = method.init_server_state(start)
    a_key, b_key = 'm.q_proj.lora_A.default.weight', 'm.q_proj.lora_B.default.weight'
    expected = torch.zeros(6, 4, dtype=torch.float64)
    for updates in ([_factor_update(gen, 1, 3, prefixes, 2), _factor_update(gen, 2, 1, prefixes, 2)],
                    [_factor_update(gen, 1, 2, prefixes, 2), _factor_update(gen, 2, 2, prefixes, 2)]):
        state = method.aggregate(state, updates)
        n = [u.num_samples for u in updates]
        expected += (naive_weighted_mean([u.shared[b_key] for u in updates], n)
                     @ naive_weighted_mean([u.shared[a_key] for u in updates], n)
                     - start[b_key].double() @ start[a_key].double())
        torch.testing.assert_close(state['merged']['m.q_proj'].double(), expected,
                                   rtol=1e-5, atol=1e-5)
    content = method.content_for(state, 2)
    assert torch.equal(content[a_key], start[a_key]) and torch.equal(content[b_key], start[b_key])
    assert torch.equal(content[MERGED + 'm.q_proj'], state['merged']['m.q_proj'])


@pytest.mark.slow
@pytest.mark.parametrize('freeze_a', [False, True])
def test_frlora_clients_reset_to_the_principal_start(tmp_path, monkeypatch, freeze_a):
    from fs_plugins.methods.frlora import FRLoRA
    sent = []
    aggregate = FRLoRA.aggregate
    def recorded(self, state, updates):
        sent.append((state, updates, aggregate(self, state, updates)))
        return sent[-1][2]
    monkeypatch.setattr(FRLoRA, 'aggregate', recorded)
    results, clients = run(tmp_path, 'frlora', rounds=2, fsplug={'frlora': {'freeze_a': freeze_a}})
    start, updates = sent[0][0]['global'], sent[0][1]
    a_keys = [k for k in start if 'lora_A' in k]
    a_moved = any(not torch.equal(u.shared[k], start[k]) for u in updates for k in a_keys)
    assert a_moved != freeze_a                                    # freeze_a: only B trains
    proc = clients[1]
    for key, value in start.items():                             # back at (A0, B0) after the run
        torch.testing.assert_close(proc.params[key].detach(), value)
    merged = sent[-1][2]['merged']                              # W = W_res + s Σ_t step_t
    assert len(sent) == 2 and set(proc.state['w0']) == set(merged)
    for prefix, w0 in proc.state['w0'].items():
        layer = proc.model.get_submodule(prefix)
        torch.testing.assert_close(layer.base_layer.weight.detach(),
                                   w0 + layer.scaling['default'] * merged[prefix])

"""FedA² for VeRA (aggregation.lora.fed_a2_vera against naive formulas, under the same
`ridge_mode` / `singular_cond` rule as LoRA with its own λ `vera_ridge`), the two-stage
schedule `fsplug.fed_a2.fedavg_rounds` (FedAvg first, FedA² after), and tiny VeRA runs of
fed_a2 and of the baselines of UniFLoW Table 4 (FFA-, FedSA-, FedDPA-VeRA)."""
import os

import pytest
import torch
from helpers import REPO, run_embedded_keeping_clients, tiny_yaml_of

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.lora import FED_A2_RIDGE_EPS, fed_a2, fed_a2_vera, fed_a2_vera_naive, hetlora_pad
from fs_plugins.aggregation.pairs import is_input_factor, vera_pairs
from fs_plugins.methods.base import ClientUpdate, weights_of
from fs_plugins.methods.fed_a2 import FedA2LoRA
from fs_plugins.methods.feddpa import is_local
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.config import ConfigError, client_overrides, load_config
from fs_plugins.run.results import ResultsLog
from fs_plugins.run.server import ServerProcedure

TINY = os.path.join(REPO, 'yamls', 'fed_a2', 'tiny.yaml')
VERA = ['fsplug.model.adapter', 'vera', 'fsplug.model.vera.r', '16']


def _vera_case(K, r=5, d_in=17, d_out=11, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    return (randn(r, d_in), randn(d_out, r), [randn(r) for _ in range(K)],
            [randn(d_out) for _ in range(K)])


def _p(weights):
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    return w / w.sum()


def _formula(A, B, ds, bs, weights, lam):
    """The row-wise closed form, one row at a time: λ_b[i] = Σ_k p_k λ_b,k[i] c_i G c_{k,i}ᵀ /
    (c_i G c_iᵀ + λ), c_i = B[i] ∘ λ_d, c_{k,i} = B[i] ∘ λ_d,k, G = A Aᵀ."""
    p = _p(weights)
    A, B = A.double(), B.double()
    d = sum(pk * dk.double() for pk, dk in zip(p, ds))
    G = A @ A.T
    out = torch.zeros(B.shape[0], dtype=torch.float64)
    for i in range(B.shape[0]):
        c = B[i] * d
        num = sum(pk * bk.double()[i] * (c @ G @ (B[i] * dk.double())) for pk, dk, bk in zip(p, ds, bs))
        out[i] = num / (c @ G @ c + lam)
    return d, out


def _rel(x, y):
    return float((x.double() - y.double()).norm() / y.double().norm())


# ------------------------------------------------------------------------------ maths

@pytest.mark.parametrize('K,weights', [(1, [2.0]), (3, [1, 2, 3]), (4, [5, 0, 1, 1])])
@pytest.mark.parametrize('lam', [0.0, 0.3, None])
def test_fed_a2_vera_matches_naive_and_the_formula(K, weights, lam):
    A, B, ds, bs = _vera_case(K, seed=K)
    mode = 'when_singular' if lam is None else 'always'
    d, b = fed_a2_vera(A, B, ds, bs, weights, lam=lam, ridge_mode=mode)
    d_ref, b_ref = fed_a2_vera_naive(A, B, ds, bs, weights, lam=lam, ridge_mode=mode)
    assert torch.equal(d, d_ref)
    assert torch.equal(d, weighted_average([{'d': x} for x in ds], weights)['d'])   # FedAvg's
    assert _rel(b, b_ref) < 1e-10
    assert _rel(b, _formula(A, B, ds, bs, weights, lam or 0.0)[1]) < 1e-10


def test_fed_a2_vera_minimises_the_objective():
    """λ_b is the minimiser: the objective's gradient vanishes there (λ = 0.5)."""
    A, B, ds, bs = _vera_case(3, seed=7)
    p, lam = _p([1, 1, 2]), 0.5
    d, b = fed_a2_vera(A, B, ds, bs, [1, 1, 2], lam=lam, ridge_mode='always')
    U = sum(pk * (bk[:, None] * B) @ (dk[:, None] * A) for pk, dk, bk in zip(p, ds, bs))
    x = b.clone().requires_grad_(True)
    loss = ((x[:, None] * (B @ (d[:, None] * A)) - U) ** 2).sum() + lam * (x ** 2).sum()
    loss.backward()
    assert float(x.grad.norm()) < 1e-9 * float(U.norm())


def test_float32_inputs_keep_their_dtype_and_match():
    A, B, ds, bs = _vera_case(3, r=16, d_in=64, d_out=48, dtype=torch.float32, seed=3)
    d, b = fed_a2_vera(A, B, ds, bs, [3, 1, 2], lam=1.0, ridge_mode='always')
    assert d.dtype == b.dtype == torch.float32 and d.shape == (16,) and b.shape == (48,)
    assert _rel(b, fed_a2_vera_naive(A, B, ds, bs, [3, 1, 2], lam=1.0, ridge_mode='always')[1]) < 1e-6


def test_common_lambda_d_gives_shrunk_fedavg_of_lambda_b():
    """All λ_d,k equal: λ = 0 gives exactly the FedAvg of λ_b (exact aggregation, as FFA)."""
    A, B, ds, bs = _vera_case(3, seed=4)
    ds = [ds[0].clone() for _ in ds]
    _, b = fed_a2_vera(A, B, ds, bs, [1, 2, 3], lam=0.0)
    avg = sum(pk * bk for pk, bk in zip(_p([1, 2, 3]), bs))
    torch.testing.assert_close(b, avg, rtol=1e-12, atol=1e-12)


def test_a_zero_row_gets_zero_and_none_resolves_a_ridge():
    A, B, ds, bs = _vera_case(2, seed=5)
    B[3] = 0.0                                          # c_3 A = 0: any λ_b[3] fits
    for lam in (0.0, None):
        _, b = fed_a2_vera(A, B, ds, bs, [1, 1], lam=lam)
        _, b_ref = fed_a2_vera_naive(A, B, ds, bs, [1, 1], lam=lam)
        assert b[3] == 0.0 and torch.isfinite(b).all()
        assert _rel(b, b_ref) < 1e-8
    # None: ill conditioned (max/min of c_i G c_iᵀ = ∞) -> ridge eps · mean
    d = sum(pk * dk for pk, dk in zip(_p([1, 1]), ds))
    den = torch.stack([(B[i] * d) @ A @ A.T @ (B[i] * d) for i in range(B.shape[0])])
    lam = FED_A2_RIDGE_EPS * float(den.mean())
    _, b = fed_a2_vera(A, B, ds, bs, [1, 1], lam=None)
    assert _rel(b, _formula(A, B, ds, bs, [1, 1], lam)[1]) < 1e-10


def test_vera_ridge_mode_uses_the_shared_singular_rule():
    """The λ_b problem's Gram matrix is diag(c_i G c_iᵀ): when_singular applies λ only when its
    max/min reaches singular_cond (the LoRA path's rule, aggregation.lora.ridge_lambda), always
    applies it every round."""
    A, B, ds, bs = _vera_case(3, seed=9)
    d = sum(pk * dk for pk, dk in zip(_p([1, 2, 3]), ds))
    den = torch.stack([(B[i] * d) @ A @ A.T @ (B[i] * d) for i in range(B.shape[0])])
    assert float(den.max() / den.min()) < 1e6                        # well conditioned
    exact = _formula(A, B, ds, bs, [1, 2, 3], 0.0)[1]
    ridged = _formula(A, B, ds, bs, [1, 2, 3], 0.4)[1]
    split = {'ridge_mode': 'when_singular'}
    assert _rel(fed_a2_vera(A, B, ds, bs, [1, 2, 3], lam=0.4, **split)[1], exact) < 1e-10
    assert _rel(fed_a2_vera(A, B, ds, bs, [1, 2, 3], lam=0.4, ridge_mode='always')[1], ridged) < 1e-10
    below = float(den.max() / den.min()) * 0.9                      # the same rows now "singular"
    assert _rel(fed_a2_vera(A, B, ds, bs, [1, 2, 3], lam=0.4, singular_cond=below, **split)[1],
                ridged) < 1e-10
    B[2] *= 1e-4                                                     # one row's c_i G c_iᵀ ~1e-8 of the rest
    info = {}
    _, b = fed_a2_vera(A, B, ds, bs, [1, 2, 3], lam=0.4, info=info, **split)
    assert info['cond'] >= 1e6 and info['lam'] == 0.4
    assert _rel(b, _formula(A, B, ds, bs, [1, 2, 3], 0.4)[1]) < 1e-10


def test_malformed_inputs_name_the_client():
    A, B, ds, bs = _vera_case(2)
    with pytest.raises(ValueError, match=r'client 1: lambda_b .*shape \(11,\)'):
        fed_a2_vera(A, B, ds, [bs[0], bs[1][:5]], [1, 1])
    with pytest.raises(ValueError, match='ranks differ'):
        fed_a2_vera(A, B[:, :3], ds, bs, [1, 1])
    with pytest.raises(ValueError, match='weights'):
        fed_a2_vera(A, B, ds, bs, [1])


def test_vera_naming():
    keys = {'m.q.vera_lambda_d.default', 'm.q.vera_lambda_b.default', 'm.v.vera_lambda_b.default'}
    assert vera_pairs(keys) == {'m.q': ('m.q.vera_lambda_d.default', 'm.q.vera_lambda_b.default')}
    assert is_input_factor('m.q.lora_A.default.weight') and is_input_factor('m.q.vera_lambda_d.x')
    assert not is_input_factor('m.q.lora_B.default.weight')
    assert not is_input_factor('m.q.vera_lambda_b.default')
    assert is_local('m.q.lora_A.local.weight') and is_local('m.q.vera_lambda_b.local')
    assert not is_local('m.q.lora_A.default.weight') and not is_local('m.q.vera_lambda_d.default')


# ------------------------------------------------------------------------------ schedule

A_KEY, B_KEY = 'm.q.lora_A.default.weight', 'm.q.lora_B.default.weight'


def _lora_updates(gen, ranks=(4, 4, 4), d_in=12, d_out=10):
    return [ClientUpdate(k + 1, 3 + k, {A_KEY: torch.randn(r, d_in, generator=gen),
                                        B_KEY: torch.randn(d_out, r, generator=gen),
                                        'm.proj.weight': torch.randn(3, generator=gen)},
                         dataset_size=10 + k)
            for k, r in enumerate(ranks)]


def _schedule_check(method, updates_of, n, rounds, b_key):
    """Server state after each aggregation: FedAvg's (method 'fedavg') for the first n, then
    FedA²'s (fed_a2 with fedavg_rounds 0) from the same previous state."""
    fedavg = get_method_class('fedavg')(method.cfg)
    direct = FedA2LoRA(method.cfg)
    direct.hparams.fedavg_rounds = 0
    direct.projections = method.projections
    state = method.init_server_state({})
    for t in range(rounds):
        updates = updates_of(t)
        expected = (fedavg if t < n else direct).aggregate(state, updates)['global']
        averaged = fedavg.aggregate(state, updates)['global']
        state = method.aggregate(state, updates)
        assert state['rounds'] == t + 1
        assert state['global'].keys() == expected.keys()
        assert all(torch.equal(state['global'][k], expected[k]) for k in expected), t
        assert torch.equal(state['global'][b_key], averaged[b_key]) == (t < n)


def test_fedavg_rounds_switches_after_n_rounds_lora():
    method = FedA2LoRA(load_config(TINY, ['fsplug.fed_a2.fedavg_rounds', '2']))
    assert method.hparams.fedavg_rounds == 2
    gen = torch.Generator().manual_seed(0)
    _schedule_check(method, lambda t: _lora_updates(gen), 2, 4, B_KEY)


def test_fedavg_rounds_default_is_fed_a2_from_the_start():
    method = FedA2LoRA(load_config(TINY))
    assert method.hparams.fedavg_rounds == 0
    updates = _lora_updates(torch.Generator().manual_seed(1))
    state = method.aggregate(method.init_server_state({}), updates)
    A, B = fed_a2([u.shared[A_KEY] for u in updates], [u.shared[B_KEY] for u in updates],
                  weights_of(updates), lam=1.0, pad=True, ridge_mode='when_singular')
    assert torch.equal(state['global'][A_KEY], A) and torch.equal(state['global'][B_KEY], B)
    with pytest.raises(ConfigError, match='fedavg_rounds'):
        load_config(TINY, ['fsplug.fed_a2.fedavg_rounds', '-1'])


def test_fedavg_stage_zero_pads_mixed_ranks():
    method = FedA2LoRA(load_config(TINY, ['fsplug.fed_a2.fedavg_rounds', '1']))
    updates = _lora_updates(torch.Generator().manual_seed(2), ranks=(8, 4, 8))
    state = method.aggregate(method.init_server_state({}), updates)
    A, B = hetlora_pad([u.shared[A_KEY] for u in updates], [u.shared[B_KEY] for u in updates],
                       weights_of(updates))
    assert torch.equal(state['global'][A_KEY], A) and torch.equal(state['global'][B_KEY], B)
    assert state['rounds'] == 1


def test_fedavg_rounds_through_the_server_procedure(tmp_path):
    """ServerProcedure, which the embedded runner and the FS server worker both drive, keeps
    the counter in its state across rounds."""
    cfg = load_config(TINY, ['fsplug.fed_a2.fedavg_rounds', '1',
                             'fsplug.results_dir', str(tmp_path / 'results')])
    method = FedA2LoRA(cfg)
    server = ServerProcedure(cfg, method, {}, ResultsLog(str(tmp_path / 'results'), {}))
    fedavg = get_method_class('fedavg')(cfg)
    gen = torch.Generator().manual_seed(3)
    for t in range(2):
        updates = _lora_updates(gen)
        before = server.state
        server.aggregate(t, updates)
        avg = fedavg.aggregate(before, updates)['global']
        assert server.state['rounds'] == t + 1
        assert torch.equal(server.state['global'][B_KEY], avg[B_KEY]) == (t == 0)


_D, _B = 'base_model.model.model.layers.0.self_attn.q_proj.vera_lambda_d.default', \
    'base_model.model.model.layers.0.self_attn.q_proj.vera_lambda_b.default'


def test_fedavg_rounds_switches_after_n_rounds_vera():
    """VeRA: the method rebuilds the projections from the run's config when it has built no
    model (here); FedAvg of λ_d, λ_b for one round, then FedA²."""
    method = FedA2LoRA(load_config(TINY, VERA + ['fsplug.fed_a2.fedavg_rounds', '1']))
    layer = method.vera_projections()[_D]
    assert layer.A.shape == (16, 64) and layer.B.shape == (64, 16)
    gen = torch.Generator().manual_seed(4)

    def updates(t):
        return [ClientUpdate(k, 2 + k, {_D: torch.randn(16, generator=gen),
                                        _B: torch.randn(64, generator=gen)}) for k in (1, 2, 3)]
    _schedule_check(method, updates, 1, 3, _B)


def test_vera_uses_vera_ridge_not_ridge():
    method = FedA2LoRA(load_config(TINY, VERA + ['fsplug.fed_a2.vera_ridge', '0.5',
                                                 'fsplug.fed_a2.ridge', '0',
                                                 'fsplug.fed_a2.ridge_mode', 'always']))
    assert FedA2LoRA(load_config(TINY, VERA)).hparams.vera_ridge is None
    gen = torch.Generator().manual_seed(5)
    updates = [ClientUpdate(k, 1, {_D: torch.randn(16, generator=gen),
                                   _B: torch.randn(64, generator=gen)}) for k in (1, 2)]
    state = method.aggregate(method.init_server_state({}), updates)
    layer = method.vera_projections()[_D]
    d, b = fed_a2_vera(layer.A, layer.B, [u.shared[_D] for u in updates],
                       [u.shared[_B] for u in updates], [1, 1], lam=0.5, ridge_mode='always')
    assert torch.equal(state['global'][_D], d) and torch.equal(state['global'][_B], b)
    plain = fed_a2_vera(layer.A, layer.B, [u.shared[_D] for u in updates],
                        [u.shared[_B] for u in updates], [1, 1], lam=0.0)[1]
    assert _rel(b, plain) > 1e-3                                      # λ = 0.5 really applied
    # the default mode: the same updates, whose diagonal Gram matrix is well conditioned, get
    # the exact fit (no λ), as for LoRA
    default = FedA2LoRA(load_config(TINY, VERA + ['fsplug.fed_a2.vera_ridge', '0.5']))
    state = default.aggregate(default.init_server_state({}), updates)
    assert _rel(state['global'][_B], plain) < 1e-6


# ------------------------------------------------------------------------------ config

def test_vera_loads_and_clients_keep_the_runs_adapter_and_projections():
    cfg = load_config(TINY, VERA)
    assert cfg.fsplug.model.adapter == 'vera'
    with pytest.raises(ConfigError) as err:
        client_overrides({'client_2': {'fsplug': {'model': {'vera': {'r': 8}}}}}, cfg)
    assert any(p.startswith('--client_cfg client_2:') and 'fsplug.model.vera' in p
               for p in err.value.problems)
    with pytest.raises(ConfigError) as err:
        client_overrides({'client_1': {'fsplug': {'model': {'adapter': 'lora'}}}}, cfg)
    assert any('fsplug.model.adapter' in p for p in err.value.problems)
    assert client_overrides({'client_1': {'train': {'optimizer': {'lr': 0.1}}}}, cfg)


# ------------------------------------------------------------------------------ tiny runs

def _tiny(tmp_path, method, *opts):
    return load_config(tiny_yaml_of(method), [
        'federate.total_round_num', '2', 'train.local_update_steps', '2',
        'data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
        'fsplug.results_dir', str(tmp_path / 'results'), *VERA, *opts])


def _vector(model, name):
    return dict(model.named_parameters())[name].detach().cpu()


def test_tiny_vera_run_of_fed_a2(tmp_path, monkeypatch):
    """Round 0 FedAvg (fedavg_rounds 1), round 1 FedA²-VeRA with the server's projections,
    which equal every client's; each client holds the final global vectors."""
    cfg = _tiny(tmp_path, 'fed_a2', 'fsplug.fed_a2.fedavg_rounds', '1')
    calls = []
    original = FedA2LoRA.aggregate

    def spy(self, server_state, updates):
        out = original(self, server_state, updates)
        calls.append((self, updates, out['global']))
        return out
    monkeypatch.setattr(FedA2LoRA, 'aggregate', spy)
    results, clients = run_embedded_keeping_clients(cfg)
    assert len(calls) == 2
    assert all(torch.isfinite(torch.tensor(r['test_avg_loss'])) for r in results.rows
               if r['kind'] == 'eval')
    server, model = calls[0][0], clients[1].model
    pairs = vera_pairs(clients[1].trainable_names)
    assert len(pairs) == 8 and set(clients[1].trainable_names) == {k for p in pairs.values() for k in p}
    modules = dict(model.named_modules())
    for d_key in (d for d, _ in pairs.values()):
        module = modules[d_key.split('.vera_lambda_d.')[0]]
        layer = server.projections[d_key]
        assert torch.equal(layer.A, module.vera_A['default'][:, :module.in_features].cpu())
        assert torch.equal(layer.B, module.vera_B['default'][:module.out_features, :].cpu())
    (_, first, g0), (_, second, g1) = calls
    assert all(torch.equal(g0[k], v) for k, v in
               weighted_average([u.shared for u in first], weights_of(first)).items())
    for d_key, b_key in pairs.values():
        layer = server.projections[d_key]
        d, b = fed_a2_vera(layer.A, layer.B, [u.shared[d_key] for u in second],
                           [u.shared[b_key] for u in second], weights_of(second), lam=None)
        assert torch.equal(g1[d_key], d) and torch.equal(g1[b_key], b)
        for proc in clients.values():
            assert torch.equal(_vector(proc.model, b_key), g1[b_key])
    assert server.projections is not None and clients[1].method.projections is None


def test_tiny_vera_run_of_ffa(tmp_path):
    """FFA-VeRA: λ_d frozen at d_initial on every client, λ_b trained, sent and averaged."""
    results, clients = run_embedded_keeping_clients(_tiny(tmp_path, 'ffa'))
    proc = clients[1]
    assert proc.trainable_names and all('.vera_lambda_b.' in n for n in proc.trainable_names)
    d_keys = [n for n, _ in proc.model.named_parameters() if '.vera_lambda_d.' in n]
    for other in clients.values():
        for d_key in d_keys:
            assert torch.equal(_vector(other.model, d_key), torch.full((16,), 0.1))
        for b_key in proc.trainable_names:
            assert torch.equal(_vector(other.model, b_key), _vector(proc.model, b_key))
    assert float(_vector(proc.model, proc.trainable_names[0]).abs().sum()) > 0   # it trained
    up = [r['bytes_up'] for r in results.rows if r['kind'] == 'train']
    assert up[0] == 4 * sum(_vector(proc.model, n).numel() for n in proc.trainable_names)


def test_tiny_vera_run_of_fedsa(tmp_path):
    """FedSA-VeRA: λ_d shared and averaged (equal on all clients), λ_b local (they differ)."""
    results, clients = run_embedded_keeping_clients(_tiny(tmp_path, 'fedsa'))
    pairs = vera_pairs(clients[1].trainable_names)
    assert len(pairs) == 8
    for d_key, b_key in pairs.values():
        ds = [_vector(p.model, d_key) for p in clients.values()]
        bs = [_vector(p.model, b_key) for p in clients.values()]
        assert all(torch.equal(d, ds[0]) for d in ds)
        assert not torch.equal(bs[0], bs[1])
    up = [r['bytes_up'] for r in results.rows if r['kind'] == 'train']
    assert up[0] == 4 * 16 * 8                           # r floats per layer, 8 layers


def test_tiny_vera_run_of_feddpa(tmp_path):
    """FedDPA-VeRA: a global and a local VeRA adapter over the same projections; the global
    vectors are averaged, the local ones train and stay on the client."""
    results, clients = run_embedded_keeping_clients(_tiny(tmp_path, 'feddpa'))
    proc = clients[1]
    local = [n for n in proc.trainable_names if is_local(n)]
    glob = [n for n in proc.trainable_names if not is_local(n)]
    assert len(local) == len(glob) == 16
    assert set(proc.method.shared_tensors(proc.model, proc.trainable_names)) == set(glob)
    for name in glob:
        assert all(torch.equal(_vector(p.model, name), _vector(proc.model, name))
                   for p in clients.values())
    b_local = [n for n in local if '.vera_lambda_b.' in n]
    assert any(not torch.equal(_vector(clients[1].model, n), _vector(clients[2].model, n))
               for n in b_local)
    assert any(float(_vector(proc.model, n).abs().sum()) > 0 for n in b_local)   # trained
    layer = next(m for m in proc.model.modules() if hasattr(m, 'vera_lambda_d')
                 and isinstance(getattr(m, 'r', None), dict))
    assert layer.vera_A['local'] is layer.vera_A['default']

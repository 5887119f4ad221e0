"""The fed_a2 method (FedA²-LoRA, UniFLoW): when the Tikhonov λ applies (`ridge_mode`:
Eq. 13 / Algorithm 1's case split by default, λ = 1 only when A Aᵀ is singular; `always` for
Table 12's λ every round), the config checks of those keys, mixed LoRA ranks by zero padding
(appendix E.4, Table 10) with each client truncated to its own rank, and a clear config error
for a client on another adapter than the run's."""
import os

import pytest
import torch
from helpers import REPO, run_embedded_keeping_clients

from fs_plugins.aggregation import fed_a2_naive
from fs_plugins.aggregation.lora import FED_A2_SINGULAR_COND
from fs_plugins.methods.base import ClientUpdate, weights_of
from fs_plugins.methods.fed_a2 import FedA2LoRA
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.config import ConfigError, client_overrides, load_config, read_yaml

TINY = os.path.join(REPO, 'yamls', 'fed_a2', 'tiny.yaml')
CLIENTS = os.path.join(REPO, 'yamls', 'fed_a2', 'tiny_clients.yaml')
LAYER = 'm.layers.0.q_proj'
A_KEY, B_KEY = f'{LAYER}.lora_A.default.weight', f'{LAYER}.lora_B.default.weight'


def _method(*opts) -> FedA2LoRA:
    return get_method_class('fed_a2')(load_config(TINY, list(opts)))


def _updates(gen, ranks, d_in=12, d_out=10, samples=(3, 1, 2, 5)):
    return [ClientUpdate(k + 1, samples[k], {A_KEY: torch.randn(r, d_in, generator=gen),
                                             B_KEY: torch.randn(d_out, r, generator=gen)})
            for k, r in enumerate(ranks)]


def _naive(updates, lam, pad=False, ridge_mode='always'):
    return fed_a2_naive([u.shared[A_KEY] for u in updates], [u.shared[B_KEY] for u in updates],
                        weights_of(updates), lam=lam, pad=pad, ridge_mode=ridge_mode)


def _rel(x, y):
    return float((x.double() - y.double()).norm() / y.double().norm())


def _cond(A):
    eig = torch.linalg.eigvalsh(A.double() @ A.double().T)
    return float(eig[-1] / eig[0]) if eig[0] > 0 else float('inf')


def _ill_conditioned(updates, scale=1e-5):
    """Every client's A shares a direction: A Aᵀ's smallest eigenvalue ~scale² of the largest
    (condition number ≥ 1e6), yet A Aᵀ is invertible, so λ = 0 would still solve."""
    for u in updates:
        A = u.shared[A_KEY]
        A[1] = A[0] + scale * A[1]
    return updates


# ------------------------------------------------------------------------------ when λ applies

def test_default_is_the_case_split_with_lambda_one():
    """Default config (Eq. 13, Algorithm 1 lines 14-18): a well-conditioned A Aᵀ gives the
    exact least-squares B = U Aᵀ (A Aᵀ)⁻¹ in each of two rounds, not the λ = 1 ridge."""
    method = _method()
    assert (method.hparams.ridge_mode, method.hparams.ridge) == ('when_singular', 1.0)
    assert method.hparams.singular_cond == FED_A2_SINGULAR_COND == 1e6
    gen = torch.Generator().manual_seed(0)
    state = method.init_server_state({A_KEY: torch.zeros(4, 12), B_KEY: torch.zeros(10, 4)})
    for _ in range(2):
        updates = _updates(gen, [4, 4, 4])
        state = method.aggregate(state, updates)
        A, B = state['global'][A_KEY], state['global'][B_KEY]
        A_ref, B_exact = _naive(updates, 0.0)
        torch.testing.assert_close(A, A_ref)
        assert _cond(A) < 1e3                                          # well conditioned
        assert _rel(B, B_exact) < 1e-5
        # the exact least-squares solution: (B A − U) Aᵀ = 0
        U = sum(p * u.shared[B_KEY].double() @ u.shared[A_KEY].double()
                for p, u in zip(torch.tensor(weights_of(updates)) / sum(weights_of(updates)), updates))
        grad = (B.double() @ A.double() - U) @ A.double().T
        assert float(grad.norm()) < 1e-5 * float((U @ A.double().T).norm())
        assert _rel(B, _naive(updates, 1.0)[1]) > 1e-2                 # λ = 1 would differ


def test_ill_conditioned_AAt_gets_lambda_under_when_singular(caplog):
    method = _method('fsplug.fed_a2.ridge', '0.5')
    updates = _ill_conditioned(_updates(torch.Generator().manual_seed(4), [4, 4, 4]))
    with caplog.at_level('INFO', logger='fs_plugins.methods.fed_a2'):
        state = method.aggregate(method.init_server_state({}), updates)
    A, B = state['global'][A_KEY], state['global'][B_KEY]
    assert _cond(A) >= 1e6
    assert _rel(B, _naive(updates, 0.5)[1]) < 1e-5                     # the λ = 0.5 ridge
    assert _rel(B, _naive(updates, 0.0)[1]) > 1e-2
    assert 'singular' in caplog.text and 'λ = 0.5' in caplog.text
    # a larger threshold makes the same A "invertible": the exact solution, no λ
    exact = _method('fsplug.fed_a2.ridge', '0.5', 'fsplug.fed_a2.singular_cond', '1e12')
    state = exact.aggregate(exact.init_server_state({}), updates)
    assert _rel(state['global'][B_KEY], _naive(updates, 0.0)[1]) < 1e-4


@pytest.mark.parametrize('value,lam', [('0', 0.0), ('0.1', 0.1), ('1', 1.0)])
def test_always_applies_lambda_every_round(value, lam):
    """ridge_mode always: Table 12's setting (λ = 0.1; λ = 0 its "w/o Tik." row), λ on a
    well-conditioned A Aᵀ too."""
    method = _method('fsplug.fed_a2.ridge_mode', 'always', 'fsplug.fed_a2.ridge', value)
    assert method.hparams.ridge == lam
    gen = torch.Generator().manual_seed(1)
    state = method.init_server_state({})
    for _ in range(2):
        updates = _updates(gen, [4, 4])
        state = method.aggregate(state, updates)
        assert _cond(state['global'][A_KEY]) < 1e3
        assert _rel(state['global'][B_KEY], _naive(updates, lam)[1]) < 1e-5


def test_lambda_one_every_round_shrinks_B_at_peft_init():
    """Why the mode matters: peft's kaiming-uniform A (d_in = 64) has A Aᵀ ≈ I/3, so λ = 1 every
    round multiplies B by ~1/4 each round, while the case split leaves FedAvg's B."""
    gen = torch.Generator().manual_seed(5)
    bound = 1 / 64 ** 0.5
    A0 = (torch.rand(8, 64, generator=gen) * 2 - 1) * bound
    updates = [ClientUpdate(k, 1, {A_KEY: A0.clone(), B_KEY: torch.randn(32, 8, generator=gen)})
               for k in (1, 2)]
    B_avg = (updates[0].shared[B_KEY] + updates[1].shared[B_KEY]) / 2
    results = {}
    for mode in ('when_singular', 'always'):
        method = _method('fsplug.fed_a2.ridge_mode', mode)
        B = method.aggregate(method.init_server_state({}), updates)['global'][B_KEY]
        results[mode] = float(B.norm() / B_avg.norm())
    assert abs(results['when_singular'] - 1) < 1e-4
    assert 0.15 < results['always'] < 0.35


def test_ridge_zero_with_singular_AAt_names_the_keys():
    method = _method('fsplug.fed_a2.ridge', '0')
    updates = _updates(torch.Generator().manual_seed(2), [3, 3])
    for u in updates:
        u.shared[A_KEY][1] = 0                                        # A Aᵀ exactly singular
    with pytest.raises(ValueError, match=r"singular.*ridge_mode = 'when_singular', ridge = 0\.0"):
        method.aggregate(method.init_server_state({}), updates)


@pytest.mark.parametrize('opts,message', [
    (['fsplug.fed_a2.ridge', 'None'], 'fsplug.fed_a2.ridge = null is no longer accepted'),
    (['fsplug.fed_a2.ridge_mode', 'sometimes'], 'fsplug.fed_a2.ridge_mode'),
    (['fsplug.fed_a2.singular_cond', '1'], 'fsplug.fed_a2.singular_cond'),
    (['fsplug.fed_a2.ridge', '-0.1'], 'fsplug.fed_a2.ridge'),
])
def test_config_checks_name_the_key(opts, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, opts)
    assert message in str(err.value)


def test_old_ridge_null_is_refused_with_the_mapping():
    """`ridge: null` (the former case split with a 1e-6 λ) is an error that says what replaced
    it, also in a YAML and inside UniFLoW, rather than a silent change of the singular branch's λ."""
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ['fsplug.fed_a2.ridge', 'None'])
    assert 'ridge_mode: when_singular' in str(err.value) and 'ridge_mode: always' in str(err.value)
    uniflow = os.path.join(REPO, 'yamls', 'uniflow', 'tiny.yaml')
    with pytest.raises(ConfigError, match='no longer accepted'):
        load_config(uniflow, ['fsplug.fed_a2.ridge', 'None'])


def test_shipped_yamls_use_the_papers_lambdas():
    tiny = load_config(TINY).fsplug.fed_a2
    assert (tiny.ridge_mode, tiny.ridge) == ('when_singular', 1.0)               # Eq. 13, §3 λ = 1
    for name in ('mnli', 'qqp', 'rte', 'sst2', 'tiny'):
        glue = read_yaml(os.path.join(REPO, 'yamls', 'glue', f'{name}.yaml'))['fsplug']['fed_a2']
        assert (glue['ridge_mode'], glue['ridge']) == ('when_singular', 1.0), name
    # Table 12's setting (λ = 0.1 every round) in the multimodal YAMLs
    for path in (('fed_a2', 'easyvqa.yaml'), ('uniflow', 'pandagpt_image.yaml'),
                 ('uniflow', 'heysquad_audio.yaml'), ('uniflow', 'heysquad_pandagpt.yaml'),
                 ('uniflow', 'easyvqa_image_audio.yaml'), ('uniflow', 'tiny.yaml')):
        node = read_yaml(os.path.join(REPO, 'yamls', *path))['fsplug']['fed_a2']
        assert (node['ridge_mode'], node['ridge']) == ('always', 0.1), path


# ------------------------------------------------------------------------------ mixed ranks

def test_mixed_ranks_are_zero_padded_in_the_method():
    method = _method()
    updates = _updates(torch.Generator().manual_seed(3), [8, 4, 8, 4])
    state = method.aggregate(method.init_server_state({}), updates)
    A, B = state['global'][A_KEY], state['global'][B_KEY]
    A_ref, B_ref = _naive(updates, 1.0, pad=True, ridge_mode='when_singular')
    assert A.shape == (8, 12) and B.shape == (10, 8)
    torch.testing.assert_close(A, A_ref)
    assert _rel(B, B_ref) < 1e-5


def test_tiny_mixed_rank_run(tmp_path, monkeypatch):
    """yamls/fed_a2/tiny.yaml with --client_cfg yamls/fed_a2/tiny_clients.yaml (ranks 8/4/8/4):
    every round's global factors are the padded FedA² solution (the default case split, λ = 1
    when singular) of the clients' uploads,
    and each client holds the global factors truncated to its own rank."""
    cfg = load_config(TINY, ['federate.total_round_num', '2', 'train.local_update_steps', '2',
                             'data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
                             'fsplug.results_dir', str(tmp_path / 'results')])
    client_cfgs = read_yaml(CLIENTS)
    calls = []
    original = FedA2LoRA.aggregate

    def spy(self, server_state, updates):
        out = original(self, server_state, updates)
        calls.append((updates, out['global']))
        return out
    monkeypatch.setattr(FedA2LoRA, 'aggregate', spy)
    results, clients = run_embedded_keeping_clients(cfg, client_cfgs)
    assert len(calls) == 2
    evals = [r for r in results.rows if r['kind'] == 'eval']
    assert len(evals) == 8 and all(torch.isfinite(torch.tensor(r['test_avg_loss'])) for r in evals)
    a_keys = [n for n in clients[1].trainable_names if '.lora_A.' in n]
    assert len(a_keys) == 8                                    # 2 layers x q, v, up, down
    ranks = {cid: proc.params[a_keys[0]].shape[0] for cid, proc in clients.items()}
    assert ranks == {1: 8, 2: 4, 3: 8, 4: 4}
    for updates, global_state in calls:
        assert sorted(u.shared[a_keys[0]].shape[0] for u in updates) == [4, 4, 8, 8]
        for a_key in a_keys:
            b_key = a_key.replace('.lora_A.', '.lora_B.')
            A_ref, B_ref = fed_a2_naive([u.shared[a_key] for u in updates],
                                        [u.shared[b_key] for u in updates],
                                        weights_of(updates), lam=1.0, pad=True,
                                        ridge_mode='when_singular')
            torch.testing.assert_close(global_state[a_key], A_ref)
            assert _rel(global_state[b_key], B_ref) < 1e-4, a_key
    final = calls[-1][1]
    for cid, proc in clients.items():                          # received before the last eval
        r = ranks[cid]
        for a_key in a_keys:
            b_key = a_key.replace('.lora_A.', '.lora_B.')
            assert torch.equal(proc.params[a_key].detach().cpu(), final[a_key][:r])
            assert torch.equal(proc.params[b_key].detach().cpu(), final[b_key][:, :r])


# ------------------------------------------------------------------------------ VeRA

def test_vera_run_loads_but_a_client_switch_to_vera_names_both_keys():
    """VeRA for the whole run is FedA²-VeRA (tests/test_fed_a2_vera.py); one client switched
    to VeRA through --client_cfg is refused."""
    assert load_config(TINY, ['fsplug.model.adapter', 'vera']).fsplug.model.adapter == 'vera'
    with pytest.raises(ConfigError) as err:
        client_overrides({'client_2': {'fsplug': {'model': {'adapter': 'vera'}}}}, load_config(TINY))
    assert any(p.startswith('--client_cfg client_2:') and 'fsplug.model.adapter' in p
               and 'fsplug.method' in p for p in err.value.problems)


def test_aggregate_refuses_updates_without_lora_pairs():
    method = _method()
    updates = [ClientUpdate(k, 1, {'m.vera_lambda_b.default': torch.randn(4)}) for k in (1, 2)]
    with pytest.raises(ValueError, match='no LoRA A/B pair'):
        method.aggregate(method.init_server_state({}), updates)

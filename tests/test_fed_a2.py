"""The fed_a2 method (FedA²-LoRA, UniFLoW): the Tikhonov λ applied in every round by default
(Algorithm 1 line 17, λ = 1), mixed LoRA ranks by zero padding (appendix E.4, Table 10) with
each client truncated to its own rank, and a clear config error for a client on another
adapter than the run's."""
import os

import pytest
import torch
from helpers import REPO, run_embedded_keeping_clients

from fs_plugins.aggregation import fed_a2_naive
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


def _naive(updates, lam, pad=False):
    return fed_a2_naive([u.shared[A_KEY] for u in updates], [u.shared[B_KEY] for u in updates],
                        weights_of(updates), lam=lam, pad=pad)


def _rel(x, y):
    return float((x.double() - y.double()).norm() / y.double().norm())


# ------------------------------------------------------------------------------ λ every round

def test_default_ridge_is_one_and_applied_every_round():
    """Default config: B = U Aᵀ(A Aᵀ + 1·I)⁻¹ in each of two rounds, although A Aᵀ is well
    conditioned there (Eq. 13's case split, ridge: null, would have used λ = 0)."""
    method = _method()
    assert method.hparams.ridge == 1.0
    gen = torch.Generator().manual_seed(0)
    state = method.init_server_state({A_KEY: torch.zeros(4, 12), B_KEY: torch.zeros(10, 4)})
    for _ in range(2):
        updates = _updates(gen, [4, 4, 4])
        state = method.aggregate(state, updates)
        A, B = state['global'][A_KEY], state['global'][B_KEY]
        A_ref, B_ref = _naive(updates, 1.0)
        torch.testing.assert_close(A, A_ref)
        assert _rel(B, B_ref) < 1e-5
        G = A.double() @ A.double().T
        eig = torch.linalg.eigvalsh(G)
        assert float(eig[-1] / eig[0]) < 1e3                         # well conditioned
        B_no_ridge = _naive(updates, 0.0)[1]
        assert torch.equal(B_no_ridge, _naive(updates, None)[1])      # so null would mean λ = 0
        assert _rel(B, B_no_ridge) > 1e-2                             # and λ = 1 really differs


@pytest.mark.parametrize('value,lam', [('0', 0.0), ('0.1', 0.1), ('None', None)])
def test_ridge_zero_is_the_ablation_and_null_the_case_split(value, lam):
    method = _method('fsplug.fed_a2.ridge', value)
    assert method.hparams.ridge == lam
    updates = _updates(torch.Generator().manual_seed(1), [4, 4])
    state = method.aggregate(method.init_server_state({}), updates)
    assert _rel(state['global'][B_KEY], _naive(updates, lam)[1]) < 1e-5


def test_ridge_zero_with_singular_AAt_names_the_key():
    method = _method('fsplug.fed_a2.ridge', '0')
    updates = _updates(torch.Generator().manual_seed(2), [3, 3])
    for u in updates:
        u.shared[A_KEY][1] = 0                                        # A Aᵀ exactly singular
    with pytest.raises(ValueError, match=r'singular.*fsplug\.fed_a2\.ridge = 0\.0'):
        method.aggregate(method.init_server_state({}), updates)


def test_shipped_yamls_use_the_papers_lambdas():
    assert load_config(TINY).fsplug.fed_a2.ridge == 1.0                        # §3: λ = 1
    easyvqa = load_config(os.path.join(REPO, 'yamls', 'fed_a2', 'easyvqa.yaml'))
    assert easyvqa.fsplug.method == 'fed_a2' and easyvqa.fsplug.fed_a2.ridge == 0.1  # Table 12


# ------------------------------------------------------------------------------ mixed ranks

def test_mixed_ranks_are_zero_padded_in_the_method():
    method = _method()
    updates = _updates(torch.Generator().manual_seed(3), [8, 4, 8, 4])
    state = method.aggregate(method.init_server_state({}), updates)
    A, B = state['global'][A_KEY], state['global'][B_KEY]
    A_ref, B_ref = _naive(updates, 1.0, pad=True)
    assert A.shape == (8, 12) and B.shape == (10, 8)
    torch.testing.assert_close(A, A_ref)
    assert _rel(B, B_ref) < 1e-5


def test_tiny_mixed_rank_run(tmp_path, monkeypatch):
    """yamls/fed_a2/tiny.yaml with --client_cfg yamls/fed_a2/tiny_clients.yaml (ranks 8/4/8/4):
    every round's global factors are the padded FedA² solution (λ = 1) of the clients' uploads,
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
                                        weights_of(updates), lam=1.0, pad=True)
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

"""Federated AdaLoRA: the budget schedule against peft's RankAllocator, the budget mask, the
sensitivity and triplet importance against naive loops, the server's aggregation, and a tiny run
whose final rounds hold the target budget."""
import pytest
import torch
from helpers import run_embedded_keeping_clients, tiny_config, write_yaml
from test_methods import direct_method, naive_weighted_mean, train_rows

from fs_plugins.aggregation.adalora import adalora_budget, budget_mask
from fs_plugins.methods.adalora import (
    IMPORTANCE_KEY,
    MASK_PREFIX,
    lambda_names,
    sensitivity_step,
    triplet_importance,
)
from fs_plugins.methods.base import ClientUpdate
from fs_plugins.run.config import load_config


def peft_allocator(total, tinit, tfinal, init_r=6, target_r=2):
    """peft's own RankAllocator on a two-matrix toy model (init budget 12, target 4)."""
    from peft import AdaLoraConfig, get_peft_model
    from peft.tuners.adalora.layer import RankAllocator
    toy = torch.nn.Sequential()
    toy.add_module('q', torch.nn.Linear(5, 5))
    toy.add_module('v', torch.nn.Linear(5, 5))
    config = AdaLoraConfig(init_r=init_r, target_r=target_r, target_modules=['q', 'v'],
                           total_step=total, tinit=tinit, tfinal=tfinal)
    model = get_peft_model(toy, config)
    return RankAllocator(model, config, 'default')


@pytest.mark.parametrize('total,tinit,tfinal', [(10, 1, 2), (20, 0, 5), (7, 3, 0)])
def test_budget_schedule_is_peft_rank_allocators(total, tinit, tfinal):
    allocator = peft_allocator(total, tinit, tfinal)
    assert (allocator.init_bgt, allocator.target_bgt) == (12, 4)
    for t in range(total + 1):
        expected, _ = allocator.budget_schedule(t)
        assert adalora_budget(t, total, tinit, tfinal, 12, 4) == expected, t


def test_budget_mask_keeps_the_top_triplets_across_matrices():
    gen = torch.Generator().manual_seed(0)
    scores = {'b.lora_E': torch.rand(5, generator=gen), 'a.lora_E': torch.rand(3, generator=gen)}
    for budget in range(9):
        mask = budget_mask(scores, budget)
        pairs = sorted(((float(scores[n][i]), n, i) for n in scores for i in range(len(scores[n]))),
                       reverse=True)
        kept = {(n, i) for _, n, i in pairs[:budget]}
        assert {(n, i) for n in mask for i in range(len(mask[n])) if mask[n][i]} == kept
    with pytest.raises(ValueError, match='budget 9'):
        budget_mask(scores, 9)


def test_sensitivity_and_triplet_importance_match_the_paper_loops():
    gen = torch.Generator().manual_seed(1)
    r, d_in, d_out, beta1, beta2 = 3, 4, 5, 0.8, 0.7
    shapes = {'Q': (r, d_in), 'E': (r, 1), 'P': (d_out, r)}
    smoothed = {k: (torch.zeros(s), torch.zeros(s)) for k, s in shapes.items()}
    naive = {k: [[0.0, 0.0] for _ in range(s[0] * s[1])] for k, s in shapes.items()}
    for _ in range(4):
        for key, shape in shapes.items():
            weight, grad = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
            smoothed[key] = sensitivity_step(*smoothed[key], weight, grad, beta1, beta2)
            for j, (w, g) in enumerate(zip(weight.flatten().tolist(), grad.flatten().tolist())):
                avg = beta1 * naive[key][j][0] + (1 - beta1) * abs(w * g)
                naive[key][j] = [avg, beta2 * naive[key][j][1] + (1 - beta2) * abs(abs(w * g) - avg)]
    score = {k: a * u for k, (a, u) in smoothed.items()}
    got = triplet_importance(score['Q'], score['E'], score['P'])
    s = {k: [a * u for a, u in v] for k, v in naive.items()}
    for i in range(r):
        expected = (s['E'][i] + sum(s['Q'][i * d_in + j] for j in range(d_in)) / d_in
                    + sum(s['P'][j * r + i] for j in range(d_out)) / d_out)
        assert float(got[i]) == pytest.approx(expected, rel=1e-5)


def shared_state(gen, r=4):
    return {f'm.{t}.{f}.default': torch.randn(*shape, generator=gen)
            for t in ('q_proj', 'v_proj')
            for f, shape in (('lora_A', (r, 3)), ('lora_E', (r, 1)), ('lora_B', (3, r)))}


def test_server_averages_and_masks_lambda_by_averaged_importance(tmp_path):
    # 6 rounds, budget 8 -> 2: round 1 is the initial phase (t_i = 1), rounds 2-4 prune,
    # rounds 5-6 are final (t_f = 2)
    method = direct_method(tmp_path, 'adalora', federate={'total_round_num': 6},
                           fsplug={'model': {'lora': {'r': 4}},
                                   'adalora': {'target_r': 1, 'initial_fraction': 0.2,
                                               'final_fraction': 0.4}})
    gen = torch.Generator().manual_seed(2)
    states, weights = [shared_state(gen), shared_state(gen)], [3, 1]
    importances = [torch.rand(8, generator=gen), torch.rand(8, generator=gen)]
    updates = [ClientUpdate(k, w, s, {IMPORTANCE_KEY: i})
               for k, (w, s, i) in enumerate(zip(weights, states, importances))]
    server = method.init_server_state(shared_state(gen))
    mean_importance = naive_weighted_mean(importances, weights)
    lambdas = lambda_names(states[0])
    # b(t) = int(6·(1 − (t − 1)/3)³ + 2): b(2) = int(3.78), b(3) = int(2.22)
    for rounds, budget in [(1, 8), (2, 3), (3, 2), (4, 2), (5, 2)]:
        server = method.aggregate(server, updates)
        kept = set(mean_importance.argsort(descending=True)[:budget].tolist())
        for name in states[0]:
            expected = naive_weighted_mean([s[name] for s in states], weights)
            if name in lambdas:
                offset = 4 * lambdas.index(name)
                keep = torch.tensor([float(offset + i in kept) for i in range(4)]).reshape(-1, 1)
                expected = expected * keep
            torch.testing.assert_close(server['global'][name].double(), expected)
        content = method.content_for(server, 0)
        assert bool(server['final_mask']) == (rounds >= 5)
        assert {n for n in content if n.startswith(MASK_PREFIX)} == (
            {MASK_PREFIX + n for n in lambdas} if rounds >= 5 else set())
    # in the final phase the mask is the one fixed when the phase began
    updates[0].extra[IMPORTANCE_KEY] = torch.arange(8.0)
    fixed = {n: m.clone() for n, m in server['final_mask'].items()}
    server = method.aggregate(server, updates)
    assert all(torch.equal(fixed[n], server['final_mask'][n]) for n in fixed)


def test_adalora_target_r_must_not_exceed_the_initial_rank(tmp_path):
    from fs_plugins.core.errors import ConfigError
    with pytest.raises(ConfigError, match='fsplug.adalora.target_r = 16'):
        load_config(write_yaml(tmp_path / 'a.yaml', tiny_config(
            tmp_path, 'adalora', fsplug={'adalora': {'target_r': 16}})))


@pytest.mark.slow
def test_adalora_end_to_end_final_rounds_hold_the_target_budget(tmp_path):
    cfg = tiny_config(tmp_path, 'adalora', rounds=5, steps=2,
                      fsplug={'model': {'lora': {'r': 4}},
                              'adalora': {'target_r': 2, 'initial_fraction': 0.2,
                                          'final_fraction': 0.4}})
    results, clients = run_embedded_keeping_clients(load_config(write_yaml(tmp_path / 'c.yaml', cfg)))
    rows = train_rows(results)
    assert {r['round'] for r in rows} == set(range(5))
    for client in clients.values():
        lambdas = {n: p for n, p in client.params.items() if '.lora_E.' in n}
        assert len(lambdas) == 8   # 2 layers x 4 target modules of the tiny Llama
        # the mask is enforced on the client in the final phase: 2 per matrix on average
        assert sum(int(p.detach().ne(0).sum()) for p in lambdas.values()) == 2 * len(lambdas)
    final = [r['active_rank'] for r in rows if r['round'] == 4]
    assert final and all(a == 2 for a in final)
    first = [r['active_rank'] for r in rows if r['round'] == 0]
    assert all(a > 2 for a in first)

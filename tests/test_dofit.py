"""DoFIT: the inter-domain step against a naive reading of its definition, and the method's
per-domain states end to end."""
import pytest
import torch
from helpers import run_embedded_keeping_clients, tiny_config, write_yaml
from test_methods import direct_method, lora_pair, naive_weighted_mean, train_rows

from fs_plugins.aggregation.domains import dofit_inter_domain, proximal_perturbation
from fs_plugins.methods.base import ClientUpdate
from fs_plugins.run.config import load_config

LAYERS = ('m.l0', 'm.l1', 'm.l2')


def domain_state(gen, scales):
    """A LoRA state of three layers whose tensors' norms follow `scales` (A, B per layer)."""
    state = {}
    for layer, (sa, sb) in zip(LAYERS, scales):
        pair = lora_pair(gen, 2, 4, 3, layer)
        a_key, b_key = sorted(pair)
        state[a_key], state[b_key] = sa * pair[a_key], sb * pair[b_key]
    state['head.weight'] = torch.randn(3, generator=gen)
    return state


def naive_inter_domain(states, k, init, scale, unit_of):
    """Rank each domain's units by Σ x² (a plain loop), intersect the tops, average the overlap
    over domains, then assign or perturb element by element."""
    units = sorted({unit_of(n) for n in states[0] if 'lora_' in n})
    tops = []
    for state in states:
        score = {u: sum(float((state[n].double() ** 2).sum()) for n in state if 'lora_' in n
                        and unit_of(n) == u) for u in units}
        tops.append(set(sorted(units, key=lambda u: (-score[u], u))[:k]))
    chosen = set.intersection(*tops)
    out = [dict(s) for s in states]
    for name in states[0]:
        if 'lora_' not in name or unit_of(name) not in chosen:
            continue
        mean = sum(s[name].double() for s in states) / len(states)
        for d, s in enumerate(states):
            if init == 'assign':
                out[d][name] = mean.float()
            else:
                diff = s[name].double() - mean
                norm = float(diff.pow(2).sum().sqrt())
                out[d][name] = (s[name].double() + scale * diff.abs() / norm).float()
    return out, sorted(chosen)


@pytest.mark.parametrize('granularity', ['tensor', 'module'])
@pytest.mark.parametrize('init', ['proximal', 'assign'])
@pytest.mark.parametrize('k', [1, 3, 6])
def test_inter_domain_step_matches_its_definition(granularity, init, k):
    gen = torch.Generator().manual_seed(k)
    states = [domain_state(gen, [(1, 5), (3, 0.1), (2, 2)]),
              domain_state(gen, [(1, 4), (0.2, 0.1), (3, 3)]),
              domain_state(gen, [(6, 5), (3, 0.3), (2, 1)])]
    unit_of = (lambda n: n) if granularity == 'tensor' else (lambda n: n.split('.lora_')[0])
    got, overlap = dofit_inter_domain(states, k, init, 0.7 if init == 'proximal' else 1.0,
                                      granularity)
    expected, chosen = naive_inter_domain(states, k, init, 0.7, unit_of)
    assert overlap == chosen and (overlap or k == 1)            # k = 1: the tops differ
    for g, e in zip(got, expected):
        assert set(g) == set(e)
        for name in e:
            torch.testing.assert_close(g[name], e[name], rtol=1e-6, atol=1e-6)


def test_units_outside_the_overlap_keep_their_intra_domain_value():
    gen = torch.Generator().manual_seed(0)
    states = [domain_state(gen, [(9, 9), (1, 1), (0.1, 0.1)]),
              domain_state(gen, [(0.1, 0.1), (1, 1), (9, 9)])]
    got, overlap = dofit_inter_domain(states, 2, 'assign')
    assert overlap == []                                        # their top-2 are disjoint
    assert all(torch.equal(g[n], s[n]) for g, s in zip(got, states) for n in s)
    same = proximal_perturbation(states[0]['head.weight'], states[0]['head.weight'], 1.0)
    assert torch.equal(same, states[0]['head.weight'])          # no difference, no shift
    with pytest.raises(ValueError, match='at least 2 domains'):
        dofit_inter_domain(states[:1], 2)


def test_server_keeps_one_state_per_domain(tmp_path):
    method = direct_method(tmp_path, 'dofit', fsplug={'dofit': {'domains': [0, 1, 0, 1],
                                                                'top_k': 2, 'init': 'assign'}})
    gen = torch.Generator().manual_seed(3)
    start = domain_state(gen, [(1, 1)] * 3)
    state = method.init_server_state(start)
    updates = [ClientUpdate(c, c, domain_state(gen, [(1, 1), (2, 2), (3, 3)])) for c in (1, 2, 3)]
    state = method.aggregate(state, updates)
    domain0 = {n: naive_weighted_mean([updates[0].shared[n], updates[2].shared[n]], [1, 3]) for n in start}
    domain1 = {n: updates[1].shared[n].double() for n in start}
    expected, _ = dofit_inter_domain([{n: v.float() for n, v in domain0.items()},
                                      {n: v.float() for n, v in domain1.items()}], 2, 'assign')
    for client, domain in ((1, 0), (2, 1), (3, 0), (4, 1)):
        content = method.content_for(state, client)
        for name in start:
            torch.testing.assert_close(content[name], expected[domain][name], rtol=1e-5, atol=1e-6)
    assert state['overlap'] and all(torch.equal(method.content_for(state, 1)[n],
                                                method.content_for(state, 2)[n])
                                    for n in state['overlap'])


def test_dofit_config_needs_two_domains_one_per_client(tmp_path):
    from fs_plugins.core.errors import ConfigError
    for domains, message in (([0, 0, 0, 0], 'at least two domains'),
                             ([0, 1], 'one label per client')):
        with pytest.raises(ConfigError, match=message):
            load_config(write_yaml(tmp_path / 'd.yaml', tiny_config(
                tmp_path, 'dofit', fsplug={'dofit': {'domains': domains}})))


def test_dofit_end_to_end_clients_of_a_domain_share_its_lora(tmp_path):
    cfg = tiny_config(tmp_path, 'dofit', rounds=2, steps=2,
                      fsplug={'dofit': {'domains': [0, 0, 1, 1], 'top_k': 4}})
    results, clients = run_embedded_keeping_clients(load_config(write_yaml(tmp_path / 'c.yaml', cfg)))
    assert len(train_rows(results)) == 8

    def lora(c):
        return {n: p for n, p in clients[c].params.items() if 'lora_' in n}
    assert all(torch.equal(p, lora(2)[n]) for n, p in lora(1).items())
    assert all(torch.equal(p, lora(4)[n]) for n, p in lora(3).items())
    assert not all(torch.equal(p, lora(3)[n]) for n, p in lora(1).items())

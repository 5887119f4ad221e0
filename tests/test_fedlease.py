"""FedLEASE: the clustering maths against naive formulas, the top-M mixture layer against its
formula, and the method's warm-up / clustering / per-cluster averaging end to end."""
import itertools
import math

import pytest
import torch
from helpers import run_embedded_keeping_clients, tiny_config, write_yaml
from test_methods import direct_method, lora_pair, naive_weighted_mean, train_rows

from fs_plugins.aggregation.clustering import average_linkage, b_distances, choose_clusters, nearest_cluster, silhouette
from fs_plugins.methods.base import ClientUpdate
from fs_plugins.tuners.lease import LeaseMixture, expert_weights


# ------------------------------------------------------------------ clustering maths
def naive_distance(b_i, b_j):
    """Eq. 2 written out: mean over layers of 1 − <b_i, b_j> / (|b_i| |b_j|)."""
    terms = []
    for layer in b_i:
        x, y = b_i[layer].double().flatten(), b_j[layer].double().flatten()
        terms.append(1 - float(x @ y) / (math.sqrt(float(x @ x)) * math.sqrt(float(y @ y))))
    return sum(terms) / len(terms)


def random_bs(n, seed=0, layers=(('l0', (6, 2)), ('l1', (4, 2)))):
    gen = torch.Generator().manual_seed(seed)
    return [{name: torch.randn(*shape, generator=gen) for name, shape in layers} for _ in range(n)]


def test_b_distances_are_eq2():
    bs = random_bs(5)
    distances = b_distances(bs)
    for i, j in itertools.product(range(5), repeat=2):
        expected = 0.0 if i == j else naive_distance(bs[i], bs[j])
        assert float(distances[i, j]) == pytest.approx(expected, abs=1e-12)


def naive_silhouette(distances, labels):
    n, scores = len(labels), []
    for i in range(n):
        own = [j for j in range(n) if labels[j] == labels[i] and j != i]
        if not own:
            scores.append(0.0)
            continue
        a = sum(float(distances[i, j]) for j in own) / len(own)
        b = min(sum(float(distances[i, j]) for j in range(n) if labels[j] == c)
                / sum(1 for j in range(n) if labels[j] == c)
                for c in set(labels) if c != labels[i])
        scores.append((b - a) / max(a, b))
    return sum(scores) / n


def naive_average_linkage(distances, k):
    """Every merge sequence's cost compared by brute force is too much; instead re-derive the
    merges from the definition with a different loop order (over point pairs)."""
    clusters = {i: {i} for i in range(distances.shape[0])}
    while len(clusters) > k:
        def link(a, b):
            return sum(float(distances[i, j]) for i in clusters[a] for j in clusters[b]) / (
                len(clusters[a]) * len(clusters[b]))
        a, b = min(((a, b) for a in clusters for b in clusters if a < b),
                   key=lambda pair: (link(*pair), pair))
        clusters[a] |= clusters.pop(b)
    groups = sorted(sorted(c) for c in clusters.values())
    return [next(g for g, members in enumerate(groups) if i in members)
            for i in range(distances.shape[0])]


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_average_linkage_and_silhouette_match_their_definitions(seed):
    distances = b_distances(random_bs(7, seed))
    for k in range(1, 8):
        labels = average_linkage(distances, k)
        assert labels == naive_average_linkage(distances, k)
        if 2 <= k <= 6:
            assert silhouette(distances, labels) == pytest.approx(naive_silhouette(distances, labels))


def test_clustering_matches_scikit_learn():
    metrics = pytest.importorskip('sklearn.metrics')
    cluster = pytest.importorskip('sklearn.cluster')
    distances = b_distances(random_bs(9, seed=3))
    for k in range(2, 8):
        labels = average_linkage(distances, k)
        theirs = cluster.AgglomerativeClustering(n_clusters=k, metric='precomputed',
                                                 linkage='average').fit(distances.numpy()).labels_
        # the same partition (label numbers may differ)
        assert len({(a, int(b)) for a, b in zip(labels, theirs)}) == k
        assert silhouette(distances, labels) == pytest.approx(
            metrics.silhouette_score(distances.numpy(), labels, metric='precomputed'))


def test_silhouette_picks_the_planted_clusters():
    gen = torch.Generator().manual_seed(0)
    centres = [torch.randn(8, 2, generator=gen) for _ in range(3)]
    planted = [0, 1, 2, 0, 1, 2, 0]
    bs = [{'l': centres[c] + 0.05 * torch.randn(8, 2, generator=gen)} for c in planted]
    labels, scores = choose_clusters(b_distances(bs), max_clusters=5)
    assert sorted(scores) == [2, 3, 4, 5]
    assert labels == [0, 1, 2, 0, 1, 2, 0]
    assert nearest_cluster({'l': centres[2]}, [bs[0], bs[1], bs[2]]) == 2
    with pytest.raises(ValueError, match='at least 3 clients'):
        choose_clusters(b_distances(bs[:2]), 4)


# ------------------------------------------------------------------ the mixture layer
def naive_expert_weights(logits, m):
    """Per token: softmax, keep the M largest slots, renormalise, slots 0..M−1 → own (0),
    slot M + j → expert 1 + j."""
    out = torch.zeros(logits.shape[0], m, dtype=torch.float64)
    for t, row in enumerate(logits.double()):
        probs = row.softmax(0)
        kept = sorted(range(2 * m - 1), key=lambda s: -float(probs[s]))[:m]
        total = sum(float(probs[s]) for s in kept)
        for s in kept:
            out[t, 0 if s < m else s - m + 1] += float(probs[s]) / total
    return out


@pytest.mark.parametrize('m', [1, 2, 3, 5])
def test_expert_weights_follow_the_slot_rule(m):
    logits = torch.randn(11, 2 * m - 1, generator=torch.Generator().manual_seed(m))
    weights = expert_weights(logits, m)
    torch.testing.assert_close(weights.double(), naive_expert_weights(logits, m), rtol=1e-6, atol=1e-6)
    assert bool((weights[:, 0] > 0).all())           # the own expert is always used
    torch.testing.assert_close(weights.sum(-1), torch.ones(11))


def _lora_linear(d_in=6, d_out=5, r=2, alpha=4, seed=0):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    net = torch.nn.Sequential()
    net.add_module('proj', torch.nn.Linear(d_in, d_out, bias=False))
    model = get_peft_model(net, LoraConfig(r=r, lora_alpha=alpha, target_modules=['proj']))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if 'lora_B' in name:
                param.normal_()
    return model


def test_mixture_forward_is_the_papers_formula_and_m1_is_plain_lora():
    from fs_plugins.tuners.lease import inject_lease, lease_layers
    model = _lora_linear()
    x = torch.randn(3, 4, 6)
    plain = model(x)
    inject_lease(model, max_experts=4)
    (prefix, layer), = lease_layers(model).items()
    torch.testing.assert_close(model(x), plain)       # one expert: the LoRA itself
    gen = torch.Generator().manual_seed(1)
    others_a, others_b = torch.randn(2, 2, 6, generator=gen), torch.randn(2, 5, 2, generator=gen)
    layer.set_experts(others_a, others_b)
    wrapped = model.get_submodule(prefix)
    own_a, own_b = wrapped.lora_A['default'].weight, wrapped.lora_B['default'].weight
    s = wrapped.scaling['default']
    w = naive_expert_weights((x.reshape(-1, 6) @ layer.router[:5].T).detach(), 3).float()
    experts = [(own_a, own_b), *zip(others_a, others_b)]
    expected = x.reshape(-1, 6) @ wrapped.base_layer.weight.T + sum(
        w[:, e:e + 1] * s * (x.reshape(-1, 6) @ a.T @ b.T) for e, (a, b) in enumerate(experts))
    torch.testing.assert_close(model(x).reshape(-1, 5), expected, rtol=1e-5, atol=1e-5)


def test_only_the_own_expert_and_the_router_get_gradients():
    from fs_plugins.tuners.lease import inject_lease, lease_layers
    model = _lora_linear()
    inject_lease(model, max_experts=3)
    layer, = lease_layers(model).values()
    layer.set_experts(torch.randn(2, 2, 6), torch.randn(2, 5, 2))
    layer.router.requires_grad_(True)
    model(torch.randn(4, 6)).square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads) == {'base_model.model.proj.lora_A.default.weight',
                          'base_model.model.proj.lora_B.default.weight',
                          'base_model.model.proj.lease.router'}
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads.values())
    assert not any(n.endswith(('bank_A', 'bank_B')) for n, _ in model.named_parameters())


def test_set_experts_names_the_shapes_that_do_not_fit():
    layer = LeaseMixture(6, 5, max_experts=3, r=2, scaling=2.0)
    with pytest.raises(ValueError, match=r'at most 2 of A \(2, 6\)'):
        layer.set_experts(torch.zeros(3, 2, 6), torch.zeros(3, 5, 2))


# ------------------------------------------------------------------ the method
def _update(cid, n, b_direction, gen):
    shared = lora_pair(gen, 2, 4, 6, 'm.q_proj')
    shared['m.q_proj.lora_B.default.weight'] = b_direction + 0.01 * torch.randn(6, 2, generator=gen)
    shared['m.q_proj.lease.router'] = torch.randn(5, 4, generator=gen)
    return ClientUpdate(cid, n, shared)


def test_server_clusters_after_warm_up_and_averages_within_clusters(tmp_path):
    from fs_plugins.methods.fedlease import CLUSTER, OTHERS_A, OTHERS_B
    method = direct_method(tmp_path, 'fedlease', fsplug={'fedlease': {'warmup_rounds': 2}})
    gen = torch.Generator().manual_seed(0)
    directions = [torch.randn(6, 2, generator=gen) for _ in range(2)]
    group = {1: 0, 2: 1, 3: 0, 4: 1}
    state = method.init_server_state({'m.q_proj.lora_A.default.weight': torch.zeros(2, 4)})
    assert method.content_for(state, 1)                          # round 0: the common start
    first = [_update(c, c, directions[group[c]], gen) for c in group]
    state = method.aggregate(state, first)
    assert not state['assignment'] and method.content_for(state, 1) == {}   # warming up
    warm = [_update(c, c, directions[group[c]], gen) for c in group]
    state = method.aggregate(state, warm)
    assert state['assignment'] == {1: 0, 2: 1, 3: 0, 4: 1}
    for j, members in ((0, [1, 3]), (1, [2, 4])):                 # Eq. 3: the clusters' means
        for key in warm[0].shared:
            torch.testing.assert_close(
                state['experts'][j][key].double(),
                naive_weighted_mean([warm[c - 1].shared[key] for c in members], members))
    content = method.content_for(state, 2)
    assert int(content[CLUSTER]) == 1
    assert torch.equal(content['m.q_proj.lora_B.default.weight'],
                       state['experts'][1]['m.q_proj.lora_B.default.weight'])
    assert torch.equal(content[OTHERS_A + 'm.q_proj'][0],
                       state['experts'][0]['m.q_proj.lora_A.default.weight'])
    assert content[OTHERS_B + 'm.q_proj'].shape == (1, 6, 2)
    # afterwards: each expert (and router) averages its own cluster only; a client the server
    # never saw joins the nearest expert
    later = [_update(1, 1, directions[0], gen), _update(3, 3, directions[0], gen),
             _update(5, 2, directions[1], gen)]
    state2 = method.aggregate(state, later)
    assert state2['assignment'][5] == 1
    for key in later[0].shared:
        torch.testing.assert_close(state2['experts'][0][key].double(),
                                   naive_weighted_mean([later[0].shared[key], later[1].shared[key]], [1, 3]))
        torch.testing.assert_close(state2['experts'][1][key], later[2].shared[key])


def test_local_routers_stay_on_the_clients(tmp_path):
    method = direct_method(tmp_path, 'fedlease', fsplug={'fedlease': {'warmup_rounds': 1,
                                                                      'router_aggregation': 'local'}})
    gen = torch.Generator().manual_seed(1)
    directions = [torch.randn(6, 2, generator=gen) for _ in range(2)]
    state = method.init_server_state({})
    state = method.aggregate(state, [_update(c, 1, directions[c % 2], gen) for c in (1, 2, 3)])
    assert not any('router' in k for k in method.content_for(state, 1))


def test_fedlease_end_to_end(tmp_path):
    from fs_plugins.run.config import load_config
    from fs_plugins.tuners.lease import lease_layers
    cfg = tiny_config(tmp_path, 'fedlease', rounds=3, steps=2,
                      fsplug={'fedlease': {'warmup_rounds': 1, 'max_experts': 3}})
    results, clients = run_embedded_keeping_clients(load_config(write_yaml(tmp_path / 'c.yaml', cfg)))
    rows = train_rows(results)
    assert all('fedlease_cluster' not in r for r in rows if r['round'] == 0)
    later = [r for r in rows if r['round'] > 0]
    assert later and all(r['fedlease_experts'] >= 2 for r in later)
    clusters = {r['client']: r['fedlease_cluster'] for r in later}
    experts = len(set(clusters.values()))
    assert all(layer.active == experts for proc in clients.values()
               for layer in lease_layers(proc.model).values())
    for a, b in itertools.combinations(sorted(clients), 2):   # after the last round: the
        lora_a = {n: p for n, p in clients[a].params.items() if 'lora_' in n}   # cluster's expert
        same = all(torch.equal(p, clients[b].params[n]) for n, p in lora_a.items())
        assert same == (clusters[a] == clusters[b])

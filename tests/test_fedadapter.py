"""FedAdapter: the server arithmetic against naive references, the bottleneck adapter's
slicing, the switch to the best trial group, and a tiny embedded run (FS standalone:
tests/test_fs_integration.py runs every registered method, fedadapter included)."""
import itertools

import pytest
import torch
from helpers import assert_reloaded_models_match, run_embedded_keeping_clients, tiny_config, write_yaml

from fs_plugins.aggregation.fedadapter import (
    best_config,
    masked_average,
    top_layers,
    trial_configs,
    trial_index,
    width_mask,
)
from fs_plugins.methods.base import ClientUpdate
from fs_plugins.methods.fedadapter import CONFIG_KEY, FedAdapter, active_masks
from fs_plugins.run.config import load_config
from fs_plugins.tuners.fedadapter import BottleneckAdapter


# ---------------------------------------------------------------------------- pure maths
@pytest.mark.parametrize('depth, width', itertools.product([1, 3, 4], [8, 28, 32]))
def test_trial_configs_are_current_wider_deeper_capped_without_repeats(depth, width):
    expected = [(depth, width)]
    for candidate in ((depth, min(32, width + 8)), (min(4, depth + 1), width)):
        if candidate not in expected:
            expected.append(candidate)
    assert trial_configs((depth, width), num_layers=4, max_width=32, depth_step=1,
                         width_step=8) == expected


def test_trial_groups_rotate_and_cover_every_configuration():
    for count in (1, 2, 3):
        for round_idx in range(5):
            groups = [trial_index(cid, round_idx, count) for cid in range(1, 7)]
            assert set(groups) == set(range(count))
            assert groups == [(cid + round_idx) % count for cid in range(1, 7)]
        assert {trial_index(1, r, count) for r in range(count)} == set(range(count))


def test_top_layers_are_the_highest_indices():
    layers = [5, 0, 3, 3, 1]
    for depth in range(6):
        assert top_layers(layers, depth) == set(sorted({0, 1, 3, 5}, reverse=True)[:depth])


def test_width_mask_against_a_loop():
    for shape, axis, width in (((6, 4), 0, 2), ((4, 6), 1, 5), ((6,), 0, 9), ((3, 2), None, 1)):
        mask = width_mask(shape, axis, width)
        for index in itertools.product(*map(range, shape)):
            assert bool(mask[index]) == (axis is None or index[axis] < width)


def test_masked_average_averages_the_mask_over_the_clients_that_sent_each_tensor():
    torch.manual_seed(0)
    previous = {'a': torch.randn(3, 4), 'b': torch.randn(5), 'c': torch.randn(2), 'd': torch.randn(2)}
    uploads = [{'a': torch.randn(3, 4), 'b': torch.randn(5), 'd': torch.randn(2)},
               {'a': torch.randn(3, 4)},
               {'a': torch.randn(3, 4), 'b': torch.randn(5), 'd': torch.randn(2)}]
    weights = [1.0, 2.0, 5.0]
    masks = {'a': width_mask((3, 4), 1, 2), 'b': width_mask((5,), 0, 3),
             'c': torch.ones(2, dtype=torch.bool), 'd': torch.zeros(2, dtype=torch.bool)}
    merged = masked_average(previous, uploads, weights, masks)
    for name, mask in masks.items():
        senders = [(u[name], w) for u, w in zip(uploads, weights) if name in u]
        for index in itertools.product(*map(range, mask.shape)):
            naive = float(previous[name][index])
            if mask[index] and senders:
                naive = sum(float(t[index]) * w for t, w in senders) / sum(w for _, w in senders)
            assert float(merged[name][index]) == pytest.approx(naive, rel=1e-6, abs=1e-6)
    assert merged['c'] is previous['c']   # nobody sent it
    assert masked_average(previous, [], [], masks)['a'] is previous['a']


def test_best_config_lowest_loss_ties_to_the_earlier_trial():
    trials = [(1, 8), (1, 16), (2, 8)]
    assert best_config(trials, {(1, 8): 0.9, (1, 16): 0.5, (2, 8): 0.7}) == (1, 16)
    assert best_config(trials, {(1, 8): 0.5, (1, 16): 0.5, (2, 8): 0.5}) == (1, 8)
    assert best_config(trials, {(2, 8): 0.9}) == (2, 8)
    assert best_config(trials, {}) == (1, 8)


# ------------------------------------------------------------------------------ adapter
def test_adapter_uses_its_first_width_units_in_float32_over_bfloat16():
    torch.manual_seed(0)
    adapter = BottleneckAdapter(6, max_width=4, init_std=0.5)
    with torch.no_grad():
        adapter.up.weight.normal_()
    output = torch.randn(2, 3, 6, dtype=torch.bfloat16)
    assert torch.equal(adapter(output), output)   # width 0: off
    adapter.set_width(2)
    result = adapter(output)
    hidden = torch.relu(output.float() @ adapter.down.weight.T + adapter.down.bias)
    hidden[..., 2:] = 0
    naive = output + (hidden @ adapter.up.weight.T + adapter.up.bias).to(torch.bfloat16)
    assert result.dtype == torch.bfloat16 and torch.equal(result, naive)
    result.float().sum().backward()
    assert adapter.down.weight.dtype == torch.float32
    assert not adapter.down.weight.grad[2:].any() and adapter.down.weight.grad[:2].any()
    assert not adapter.up.weight.grad[:, 2:].any() and adapter.up.weight.grad[:, :2].any()
    with pytest.raises(ValueError, match='adapter width 5'):
        adapter.set_width(5)


# ------------------------------------------------------------------------------- server
def _method(tmp_path, **options):
    node = {'max_width': 8, 'start_depth': 1, 'start_width': 4, 'width_step': 4,
            'trial_rounds': 2, **options}
    cfg = tiny_config(tmp_path, 'fedadapter', rounds=10, fsplug={'fedadapter': node})
    return FedAdapter(load_config(write_yaml(tmp_path / 'c.yaml', cfg)))


def _adapters(value: float) -> dict:
    return {f'model.layers.{i}.mlp.down_proj.fedadapter.{part}': torch.full(shape, value)
            for i in range(2) for part, shape in (('down.weight', (8, 3)), ('down.bias', (8,)),
                                                  ('up.weight', (3, 8)), ('up.bias', (3,)))}


def _layer_names(layers) -> set:
    return {n for n in _adapters(0.0) if int(n.split('.')[2]) in layers}


def test_the_expected_upload_is_the_assigned_layers(tmp_path):
    method = _method(tmp_path)
    signature = {n: (tuple(t.shape), 'float32') for n, t in _adapters(0.0).items()}
    for depth, layers in ((1, {1}), (2, {0, 1}), (5, {0, 1})):
        sent = {CONFIG_KEY: torch.tensor([depth, 4])}
        assert set(method.expected_upload(signature, sent)) == _layer_names(layers)
    assert method.expected_upload(signature, None) == signature
    assert method.expected_upload(signature, {}) == signature


def test_server_switches_to_the_best_group_and_every_trial_inherits_it(tmp_path):
    """Each client sends its configuration's layers only; each trial's global moves on its
    active slice only; after the interval the deeper group's global is everyone's."""
    method = _method(tmp_path)
    state = method.init_server_state(_adapters(0.0))
    assert sorted(state['trials']) == ['1,4', '1,8', '2,4']
    losses = {(1, 4): 3.0, (1, 8): 2.0, (2, 4): 1.0}   # the deeper group does best
    for round_idx in range(2):
        trials = trial_configs((1, 4), 2, 8, 1, 4)
        updates = []
        for cid in (1, 2, 3):
            config = trials[trial_index(cid, round_idx, 3)]
            sent = method.content_for(state, cid)
            assert sent[CONFIG_KEY].tolist() == list(config)
            upload = {n: v + cid for n, v in sent.items() if n in _layer_names(range(2 - config[0], 2))}
            updates.append(ClientUpdate(cid, 10, upload, metrics={'train_avg_loss': losses[config]}))
        state = method.aggregate(state, updates)
        if round_idx == 0:   # each trial's global moved on its active slice only
            for key, global_ in state['trials'].items():
                masks = active_masks(global_, tuple(map(int, key.split(','))))
                for name, tensor in global_.items():
                    assert torch.equal(tensor != 0, masks[name]), (key, name)
    assert state['current'] == [2, 4] and state['losses'] == {}
    assert sorted(state['trials']) == ['2,4', '2,8']
    winner = state['global']
    assert winner['model.layers.0.mlp.down_proj.fedadapter.up.bias'].abs().sum() > 0
    for global_ in state['trials'].values():
        assert all(torch.equal(global_[n], winner[n]) for n in winner)


def _server(tmp_path):
    from fs_plugins.run.results import ResultsLog
    from fs_plugins.run.server import ServerProcedure

    class MemoryLog(ResultsLog):
        def __init__(self):
            self.rows = []

        def log(self, row):
            self.rows.append(row)
    method = _method(tmp_path)
    return ServerProcedure(method.cfg, method, _adapters(0.0), MemoryLog())


def test_the_server_accepts_exactly_the_assigned_layers_and_names_any_other_tensor(tmp_path):
    """Round 0's trials are (1, 4), (1, 8), (2, 4): client 1 trains depth 1 (layer 1), client 2
    depth 2. A tensor outside the assigned layers, or one missing from them, is rejected with
    its name; the exact slice is accepted."""
    server = _server(tmp_path)
    sent = {cid: server.content_for(cid) for cid in (1, 2)}
    assert sent[1][CONFIG_KEY].tolist() == [1, 8] and sent[2][CONFIG_KEY].tolist() == [2, 4]
    outside = 'model.layers.0.mlp.down_proj.fedadapter.up.bias'
    missing = 'model.layers.1.mlp.down_proj.fedadapter.down.weight'
    only_layer_1 = {n: sent[1][n] + 1 for n in _layer_names({1})}
    extra = ClientUpdate(1, 4, {**only_layer_1, outside: sent[1][outside]}, dataset_size=4)
    short = ClientUpdate(2, 4, {n: sent[2][n] for n in _layer_names({0, 1}) if n != missing},
                         dataset_size=4)
    assert server.accepted(0, [extra, short]) == []
    assert [r['reason'] for r in server.rejections] == [
        f'unexpected shared tensor(s) {outside}', f'missing shared tensor(s) {missing}']
    exact = [ClientUpdate(1, 4, only_layer_1, dataset_size=4),
             ClientUpdate(2, 4, {n: sent[2][n] for n in _layer_names({0, 1})}, dataset_size=4)]
    assert server.accepted(0, exact) == exact


def test_last_round_content_is_the_current_configuration_for_everyone(tmp_path):
    method = _method(tmp_path)
    state = {**method.init_server_state(_adapters(0.0)), 'round': 10, 'current': [2, 8]}
    state['global'] = _adapters(1.0)
    for cid in (1, 2, 3):
        sent = method.content_for(state, cid)
        bias = sent['model.layers.0.mlp.down_proj.fedadapter.up.bias']
        assert sent[CONFIG_KEY].tolist() == [2, 8] and torch.equal(bias, torch.ones(3))


def test_start_width_above_max_width_names_the_keys(tmp_path):
    from fs_plugins.core.errors import ConfigError
    cfg = tiny_config(tmp_path, 'fedadapter',
                      fsplug={'fedadapter': {'max_width': 4, 'start_width': 8}})
    with pytest.raises(ConfigError, match='start_width = 8 exceeds fsplug.fedadapter.max_width'):
        load_config(write_yaml(tmp_path / 'c.yaml', cfg))


def test_per_architecture_aggregation_is_refused_naming_the_key(tmp_path):
    from fs_plugins.core.errors import ConfigError
    cfg = tiny_config(tmp_path, 'fedadapter', fsplug={'aggregation': {'per_architecture': True}})
    with pytest.raises(ConfigError, match='fsplug.aggregation.per_architecture: FedAdapter clients'):
        load_config(write_yaml(tmp_path / 'c.yaml', cfg))


# ------------------------------------------------------------------------------ audit
def test_the_audit_exempts_unassigned_layers_but_not_a_trainable_one_without_gradient(
        tmp_path, monkeypatch):
    """Client 1 trains depth 1 of 2 in the audited round: its layer-0 adapters neither train
    nor travel (Contract.gated_trains). Made trainable while the forward still skips them,
    they are reported as trainable without a gradient."""
    from fs_plugins.methods.base import Phase
    from fs_plugins.run.audit import audit
    assert not audit(_method(tmp_path).cfg).problems
    monkeypatch.setattr(FedAdapter, 'phases', lambda self, n, cfg: [Phase('train', n)])
    problems = audit(_method(tmp_path).cfg).problems
    assert problems and all('layers.*' in p and 'no gradient' in p and p.endswith('(client 1)')
                            for p in problems), problems


# ------------------------------------------------------------------------------ end to end
def test_tiny_run_trains_only_active_units_and_saved_models_reload(tmp_path):
    """Depth 1 of 2 at width 4 of 8, a switch after round 2: every client ends on the server's
    current configuration with the same adapters, the units no configuration used are still
    at their initial values (zero up-projection columns), and the saved models reload."""
    node = {'max_width': 8, 'start_depth': 1, 'start_width': 4, 'width_step': 2, 'trial_rounds': 2}
    cfg = load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(
        tmp_path, 'fedadapter', rounds=3, steps=3, fsplug={'fedadapter': node})))
    results, clients = run_embedded_keeping_clients(cfg)
    actives = {proc.method.active for proc in clients.values()}
    assert len(actives) == 1
    depth, width = actives.pop()
    assert (depth, width) in {(1, 4), (1, 6), (2, 4)}
    first = clients[1].params
    for proc in clients.values():
        for name, param in proc.params.items():
            if '.fedadapter.' in name:
                assert torch.equal(param, first[name]), name
    trained_width = 6   # the widest configuration any trial used
    for name, param in first.items():
        if name.endswith('fedadapter.up.weight'):
            assert not param[:, trained_width:].any(), name
    assert any(first[n][:, :4].any() for n in first
               if n.endswith('fedadapter.up.weight') and 'layers.1.' in n)
    assert not [r for r in results.rows if r['kind'] == 'rejected']
    layer_bytes = {layer: sum(p.numel() * p.element_size() for n, p in first.items()
                              if '.fedadapter.' in n and f'layers.{layer}.' in n) for layer in (0, 1)}
    uploads = {r['bytes_up'] for r in results.rows if r['kind'] == 'train'}
    assert uploads == {layer_bytes[1], layer_bytes[0] + layer_bytes[1]}   # depth 1 and depth 2
    assert_reloaded_models_match(results, clients)

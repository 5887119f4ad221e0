"""Protocol pieces every method shares (issue 17): aggregation weights p_k = n_k / Σn, the
learning-rate schedule over the whole run, and the train / validation / test split."""
import math

import pytest
import torch
from helpers import tiny_config, write_yaml

from fs_plugins.aggregation.average import client_weights
from fs_plugins.methods.base import ClientUpdate
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.client import ClientProcedure
from fs_plugins.run.config import load_config
from fs_plugins.run.optim import build_scheduler, schedule_window
from fs_plugins.run.results import ResultsLog
from fs_plugins.run.runtime import build_federated_records
from fs_plugins.run.server import ServerProcedure


def _load(tmp_path, **updates):
    return load_config(write_yaml(tmp_path / 'cfg.yaml', tiny_config(tmp_path, **updates)))


# ------------------------------------------------------------------ aggregation weights
def test_client_weights_per_mode():
    sizes, processed = [10, 30, 60], [8, 8, 8]
    assert client_weights('dataset_size', sizes, processed) == [10.0, 30.0, 60.0]
    assert client_weights('processed', sizes, processed) == [8.0, 8.0, 8.0]
    assert client_weights('uniform', sizes, processed) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="'dataset_size' needs every client's training-set size"):
        client_weights('dataset_size', [10, 0], [8, 8])


def _update(cid, value, dataset_size, processed=8):
    return ClientUpdate(cid, processed, {'w': torch.full((2,), float(value))},
                        dataset_size=dataset_size)


@pytest.mark.parametrize('mode,expected', [
    ('dataset_size', (1 * 10 + 2 * 30 + 4 * 60) / 100),   # p_k = n_k / Σ n
    ('processed', (1 + 2 + 4) / 3),                        # fixed local steps: uniform
    ('uniform', (1 + 2 + 4) / 3)])
def test_server_averages_with_the_configured_weights(tmp_path, mode, expected):
    cfg = _load(tmp_path, fsplug={'aggregation': {'weights': mode}})
    method = get_method_class('fedavg')(cfg)
    server = ServerProcedure(cfg, method, {'w': torch.zeros(2)},
                             ResultsLog(str(tmp_path / 'res'), {}))
    server.aggregate(0, [_update(1, 1, 10), _update(2, 2, 30), _update(3, 4, 60)])
    assert torch.allclose(server.state['global']['w'], torch.full((2,), expected))


def test_clients_report_their_training_set_size(tmp_path):
    cfg = _load(tmp_path, rounds=1, steps=1)
    method = get_method_class('fedavg')(cfg)
    records = build_federated_records(cfg)
    proc = ClientProcedure(1, cfg, method, build_model(cfg, method), records.clients[1])
    update = proc.run_round(0)
    assert update.dataset_size == len(records.clients[1]['train']) > update.num_samples


# ------------------------------------------------------------------ learning-rate schedule
def test_schedule_window():
    assert schedule_window('run', 3, 10, 5) == (50, 15)
    assert schedule_window('round', 3, 10, 5) == (5, 0)


def _cosine_lr(step, total, peak):
    return peak * (1 + math.cos(math.pi * step / total)) / 2


@pytest.mark.parametrize('scope', ['run', 'round'])
def test_lr_at_a_given_global_step(tmp_path, scope):
    """Round t, local step s: the run-level cosine is at step t·S + s of R·S (it continues
    across rounds), the per-round one restarts at its peak every round."""
    rounds, steps, peak = 4, 5, 0.01
    cfg = _load(tmp_path, rounds=rounds, steps=steps,
                train={'scheduler': {'type': 'CosineAnnealingLR'}},
                fsplug={'train': {'lr_schedule': scope}})
    method = get_method_class('fedavg')(cfg)
    records = build_federated_records(cfg)
    proc = ClientProcedure(1, cfg, method, build_model(cfg, method), records.clients[1])
    seen = []
    for round_idx in range(rounds):
        proc.round_idx = round_idx
        for _ in range(proc.begin_round()):
            seen.append(proc.optimizer.param_groups[0]['lr'])
            loss = proc.compute_loss(proc.next_batch())
            proc.optimise(loss)
        proc.end_round()
    if scope == 'run':
        expected = [_cosine_lr(i, rounds * steps, peak) for i in range(rounds * steps)]
    else:
        expected = [_cosine_lr(s, steps, peak) for _ in range(rounds) for s in range(steps)]
    assert seen == pytest.approx(expected, rel=1e-6)


def test_scheduler_fast_forward_equals_stepping():
    params = [torch.nn.Parameter(torch.zeros(1))]
    optimiser = torch.optim.SGD(params, lr=1.0)
    ahead = build_scheduler(optimiser, {'type': 'CosineAnnealingLR'}, 20, 7)
    assert optimiser.param_groups[0]['lr'] == pytest.approx(_cosine_lr(7, 20, 1.0))
    assert ahead.last_epoch == 7


# ------------------------------------------------------------------ train / val / test split
def test_80_10_10_split_sizes(tmp_path):
    cfg = _load(tmp_path, fsplug={'data': {'test_fraction': 0.1, 'val_fraction': 0.1}})
    records = build_federated_records(cfg)
    without_val = build_federated_records(_load(tmp_path, fsplug={'data': {'test_fraction': 0.1}}))
    for cid, splits in records.clients.items():
        n = sum(len(part) for part in splits.values())
        assert len(splits['test']) == max(round(0.1 * n), 1)
        assert len(splits['val']) == max(round(0.1 * n), 1)
        assert len(splits['train']) == n - len(splits['test']) - len(splits['val'])
        ids = [[r.get('id', id(r)) for r in part] for part in splits.values()]
        assert len({i for part in ids for i in part}) == n            # disjoint, complete
        # adding a validation split leaves the test split as it was
        assert splits['test'] == without_val.clients[cid]['test']
        assert 'val' not in without_val.clients[cid]


def test_validation_split_is_evaluated(tmp_path):
    cfg = _load(tmp_path, rounds=1, steps=1, fsplug={'data': {'val_fraction': 0.2}})
    method = get_method_class('fedavg')(cfg)
    records = build_federated_records(cfg)
    proc = ClientProcedure(1, cfg, method, build_model(cfg, method), records.clients[1])
    val = proc.evaluate('val')
    assert val['val_total'] == len(records.clients[1]['val']) > 0
    assert set(val) >= {'val_avg_loss', 'val_token_acc'}

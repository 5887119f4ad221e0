"""zero_shot (UniFLoW's '-' rows: "no training was conducted"): the model the YAML builds,
frozen, with no adapter, evaluated every round without a local step or a byte sent; its scores
are those of the global model before any training (a fresh LoRA has B = 0); with UniFLoW's
model the projections P_m are the ones every UniFLoW run starts from; saved models reload; the
audit passes; FederatedScope standalone and distributed give the embedded runner's numbers."""
import math

import pytest
import torch
from helpers import REPO, assert_reloaded_models_match, run_embedded_keeping_clients

from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.methods.zero_shot import ZeroShot
from fs_plugins.run.audit import audit
from fs_plugins.run.config import load_config
from fs_plugins.run.evaluation import token_metrics

TINY = f'{REPO}/yamls/zero_shot/tiny.yaml'
TINY_UNIFLOW = f'{REPO}/yamls/zero_shot/tiny_uniflow.yaml'


def load(path, tmp_path, *opts):
    return load_config(path, ['data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
                              'fsplug.results_dir', str(tmp_path / 'results'), *opts])


def rows_of(results, kind):
    return [r for r in results.rows if r['kind'] == kind]


def test_nothing_trains_and_nothing_is_sent(tmp_path):
    results, clients = run_embedded_keeping_clients(load(TINY, tmp_path, 'federate.total_round_num', '2'))
    train = rows_of(results, 'train')
    assert len(train) == 2 * len(clients)
    assert all((r['train_steps'], r['local_steps'], r['bytes_up'], r['bytes_down']) == (0, 0, 0, 0)
               for r in train)
    assert all(math.isnan(r['train_avg_loss']) for r in train)
    for proc in clients.values():
        assert proc.trainable_names == [] and proc.optimizer is None
        assert not any(p.requires_grad for p in proc.model.parameters())
        assert not any('lora_' in n for n, _ in proc.model.named_parameters())
    # every round scores the same model
    evals = rows_of(results, 'eval')
    by_round = {r['round']: {c['client']: c['test_avg_loss'] for c in evals if c['round'] == r['round']}
                for r in evals}
    assert by_round[0] == by_round[1]


def test_scores_equal_the_untrained_global_model_of_fedavg(tmp_path):
    """The zero-shot row is the model every trained row starts from: FedAvg's initial model
    (LoRA with B = 0) scores exactly what zero_shot reports."""
    results, clients = run_embedded_keeping_clients(load(TINY, tmp_path))
    fedavg_cfg = load(f'{REPO}/yamls/fedavg/tiny.yaml', tmp_path)
    initial = build_model(fedavg_cfg, get_method_class('fedavg')(fedavg_cfg), share_frozen=False)
    initial.model.eval()
    for row in rows_of(results, 'eval'):
        proc = clients[row['client']]
        expected = token_metrics(initial.model, proc.eval_data['test'], proc.collate, 8, 'test')
        assert row['test_avg_loss'] == pytest.approx(expected['test_avg_loss'], rel=1e-6)
        assert row['test_token_acc'] == pytest.approx(expected['test_token_acc'], rel=1e-6)


def test_uniflow_model_keeps_the_initial_projections_and_scores_each_modality(tmp_path):
    results, clients = run_embedded_keeping_clients(load(TINY_UNIFLOW, tmp_path))
    uniflow_cfg = load(f'{REPO}/yamls/uniflow/tiny.yaml', tmp_path)
    initial = build_model(uniflow_cfg, get_method_class('uniflow')(uniflow_cfg), share_frozen=False)
    start = {n.split('projectors.', 1)[1]: p for n, p in initial.model.named_parameters()
             if 'projectors.' in n}
    for proc in clients.values():
        projectors = {n.split('projectors.', 1)[1]: p for n, p in proc.model.named_parameters()
                      if 'projectors.' in n}
        assert projectors.keys() == start.keys() and projectors
        assert all(torch.equal(projectors[n], start[n]) for n in start)
        assert not any(p.requires_grad for p in proc.model.parameters())
    scored = {k for r in rows_of(results, 'eval') for k in r if k.endswith('_avg_loss')}
    assert {'test_image_avg_loss', 'test_audio_avg_loss', 'test_image+audio_avg_loss'} <= scored


@pytest.mark.parametrize('path', [TINY, TINY_UNIFLOW])
def test_saved_models_reload_exactly(tmp_path, path):
    results, clients = run_embedded_keeping_clients(load(path, tmp_path))
    assert_reloaded_models_match(results, clients)


def test_audit_sees_no_training_and_no_traffic(tmp_path):
    report = audit(load(TINY, tmp_path))
    assert report.problems == []
    assert report.totals['trainable_params'] == 0
    assert (report.totals['up_bytes'], report.totals['down_bytes'], report.totals['local_steps']) == (0, 0, 0)


def test_a_method_that_trains_still_refuses_a_model_with_nothing_trainable(tmp_path):
    cfg = load(TINY, tmp_path, 'fsplug.method', 'fedavg', 'fsplug.model.lora.target_modules', '[]')
    with pytest.raises(Exception, match='fsplug.model.lora.target_modules'):
        build_model(cfg, get_method_class('fedavg')(cfg), share_frozen=False)
    assert build_model(load(TINY, tmp_path), ZeroShot(load(TINY, tmp_path))).trainable_names == []


@pytest.mark.fs
def test_fs_distributed_matches_embedded(tmp_path):
    """Server + 2 clients over gRPC on 127.0.0.1: empty messages both ways, the embedded
    runner's numbers and saved models."""
    from helpers import tiny_config
    from test_fs_integration import assert_distributed_matches_embedded
    base = tiny_config(tmp_path, 'zero_shot', rounds=2, steps=3,
                       federate={'client_num': 2, 'sample_client_num': 2}, data={'splitter': 'iid'})
    rows = assert_distributed_matches_embedded(tmp_path, base, timeout=240)
    assert {(r['bytes_up'], r['bytes_down']) for r in rows if r['kind'] == 'train'} == {(0, 0)}

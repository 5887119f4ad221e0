"""Full fine-tuning, the `full_finetune` option of fedavg and standalone (Fed-MoLE Table 5,
'FedAvg + Full Fine-tune'): no LoRA, every weight trains in float32 (over a bfloat16 base too),
FedAvg uploads and averages every weight, standalone sends nothing; saved models reload
exactly; a quantised base and a model too large for its device are refused naming the key;
`fs-plugins estimate` counts weights, gradients and AdamW state in float32."""

import pytest
import torch
from helpers import REPO, assert_reloaded_models_match, run_embedded_keeping_clients

from fs_plugins.commands.estimate import estimate_client
from fs_plugins.core.errors import ConfigError
from fs_plugins.methods import fedavg as fedavg_module
from fs_plugins.methods.building import build_model
from fs_plugins.methods.fedavg import FedAvg, check_full_finetune_fits
from fs_plugins.methods.standalone import Standalone
from fs_plugins.run.config import load_config, to_plain

GIB = 1024 ** 3


def full_ft_yaml(method):
    return f'{REPO}/yamls/{method}/tiny_full_ft.yaml'


def run(tmp_path, method, dtype='float32', rounds=1):
    cfg = load_config(full_ft_yaml(method), [
        'federate.total_round_num', str(rounds), 'train.local_update_steps', '2',
        'data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
        'fsplug.results_dir', str(tmp_path / 'results'), 'fsplug.model.dtype', dtype])
    return run_embedded_keeping_clients(cfg)


def initial_weights(cfg, method_cls):
    built = build_model(cfg, method_cls(cfg), share_frozen=False)
    return {n: p.detach().clone() for n, p in built.model.named_parameters()}


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_fedavg_trains_uploads_and_averages_every_weight_in_float32(tmp_path, dtype):
    results, clients = run(tmp_path, 'fedavg', dtype)
    proc = clients[1]
    params = dict(proc.model.named_parameters())
    assert set(proc.trainable_names) == set(params)
    assert not any('lora_' in n for n in params)
    assert {p.dtype for p in params.values()} == {torch.float32}
    numel = sum(p.numel() for p in params.values())
    train = [r for r in results.rows if r['kind'] == 'train']
    assert len(train) == len(clients)
    assert {r['bytes_up'] for r in train} == {4 * numel}
    # every client evaluated the average: all hold the same weights, none the initial ones
    start = initial_weights(proc.cfg, FedAvg)
    for other in clients.values():
        for name, value in other.model.named_parameters():
            assert torch.equal(value, params[name]), name
    assert all(not torch.equal(params[n].detach(), start[n]) for n in params)


def test_fedavg_global_is_the_weighted_average_of_the_uploads(tmp_path):
    from fs_plugins.methods.base import ClientUpdate
    cfg = load_config(full_ft_yaml('fedavg'), ['data.root', str(tmp_path)])
    method = FedAvg(cfg)
    shared = {'w': torch.zeros(2, 3), 'e': torch.ones(4)}
    state = method.init_server_state(shared)
    updates = [ClientUpdate(1, 8, {'w': torch.full((2, 3), 1.0), 'e': torch.full((4,), 3.0)}, weight=1.0),
               ClientUpdate(2, 8, {'w': torch.full((2, 3), 4.0), 'e': torch.full((4,), 0.0)}, weight=3.0)]
    merged = method.aggregate(state, updates)['global']
    torch.testing.assert_close(merged['w'], torch.full((2, 3), 0.25 * 1 + 0.75 * 4))
    torch.testing.assert_close(merged['e'], torch.full((4,), 0.75))


def test_standalone_trains_every_weight_and_sends_nothing(tmp_path):
    results, clients = run(tmp_path, 'standalone', 'bfloat16')
    train = [r for r in results.rows if r['kind'] == 'train']
    assert {(r['bytes_up'], r['bytes_down']) for r in train} == {(0, 0)}
    first, second = clients[1], clients[2]
    assert set(first.trainable_names) == {n for n, _ in first.model.named_parameters()}
    assert {p.dtype for p in first.model.parameters()} == {torch.float32}
    # each client kept its own weights
    assert any(not torch.equal(p, second.params[n]) for n, p in first.model.named_parameters())


@pytest.mark.parametrize('method', ['fedavg', 'standalone'])
def test_saved_full_models_reload_exactly(tmp_path, method):
    results, clients = run(tmp_path, method)
    assert_reloaded_models_match(results, clients)


def test_off_by_default_keeps_lora(tmp_path):
    cfg = load_config(f'{REPO}/yamls/fedavg/tiny.yaml', ['data.root', str(tmp_path)])
    built = build_model(cfg, FedAvg(cfg), share_frozen=False)
    assert built.trainable_names and all('lora_' in n for n in built.trainable_names)


def test_quantised_base_is_refused_naming_the_key(tmp_path):
    cfg = to_plain(load_config(full_ft_yaml('fedavg'), ['data.root', str(tmp_path)]))
    cfg['fsplug']['model']['quantization'] = '4bit'
    problems = FedAvg.config_problems(FedAvg.options(cfg), cfg)
    assert len(problems) == 1
    assert 'fsplug.fedavg.full_finetune' in problems[0] and 'fsplug.model.quantization' in problems[0]


def test_option_of_another_method_is_refused(tmp_path):
    """UniFLoW runs fedavg as its aggregation: fsplug.fedavg.full_finetune does not apply there."""
    cfg = to_plain(load_config(full_ft_yaml('standalone'), ['data.root', str(tmp_path)]))
    cfg['fsplug']['method'] = 'uniflow'
    problems = Standalone.config_problems(Standalone.options(cfg), cfg)
    assert problems == ["fsplug.standalone.full_finetune = True applies to fsplug.method "
                        "'standalone' only, not 'uniflow'"]


def test_a_model_too_large_for_its_device_is_refused(tmp_path, monkeypatch):
    model = torch.nn.Linear(10, 10)   # 110 weights: 880 bytes of float32 weights + gradients
    monkeypatch.setattr(fedavg_module, 'device_memory_bytes', lambda device: 879)
    with pytest.raises(ConfigError, match=r'fsplug.fedavg.full_finetune = True: 110 float32 '
                                          r'weights and their gradients need'):
        check_full_finetune_fits(model, 'cpu', 'fsplug.fedavg.full_finetune')
    monkeypatch.setattr(fedavg_module, 'device_memory_bytes', lambda device: 880)
    check_full_finetune_fits(model, 'cpu', 'fsplug.fedavg.full_finetune')


def test_estimate_counts_every_weight_in_float32_with_adamw_state(tmp_path):
    cfg = load_config(full_ft_yaml('fedavg'), ['data.root', str(tmp_path)])
    estimate = estimate_client(cfg, 1, activations=False)
    built = build_model(cfg, FedAvg(cfg), share_frozen=False)
    numel = sum(p.numel() for p in built.model.parameters())
    assert (estimate.frozen_params, estimate.trainable_params, estimate.sent_params) == (0, numel, numel)
    assert estimate.weights_gib == 0
    assert estimate.adapters_gib == pytest.approx(4 * numel / GIB)     # float32 weights
    assert estimate.optimizer_gib == pytest.approx(8 * numel / GIB)    # AdamW's two moments
    assert estimate.mb_up == estimate.mb_down == pytest.approx(4 * numel / 1e6)
    assert 'full fine-tuning' in estimate.note


def test_table5_llava_upload_and_memory_at_the_paper_size():
    """Fed-MoLE Table 5 'FedAvg + Full Fine-tune' on LLaVA-1.5-7B (built on the meta device):
    five clients upload 141.3 GB per round (the paper: 141.5 GB, ten times its 14.15 GB model
    size); weights, gradients and AdamW state alone need 105 GiB per client (the paper: OOM)."""
    cfg = load_config(f'{REPO}/yamls/fedmole/fedvqa_llava15_7b.yaml',
                      ['fsplug.method', 'fedavg', 'fsplug.fedavg.full_finetune', 'True'])
    estimate = estimate_client(cfg, 1, activations=False)
    assert estimate.frozen_params == 0 and estimate.trainable_params == 7_063_427_072
    assert round(estimate.mb_up * cfg.federate.client_num / 1e3, 1) == 141.3
    static = 2 * estimate.adapters_gib + estimate.optimizer_gib
    assert round(static, 1) == 105.3


FULL_FT = {'fsplug': {'fedavg': {'full_finetune': True}}, 'train': {'optimizer': {'lr': 0.001}}}


def fs_config(tmp_path, **updates):
    from helpers import deep_update, tiny_config
    cfg = tiny_config(tmp_path, 'fedavg', rounds=2, steps=2, **updates)
    return deep_update(cfg, FULL_FT)


@pytest.mark.fs
def test_fs_standalone_matches_embedded(tmp_path):
    """Through FederatedScope standalone: the embedded runner's numbers (bytes: every weight in
    float32) and saved models."""
    from helpers import deep_update, write_yaml
    from test_fs_integration import (
        _embedded_rows,
        assert_same_artifacts,
        assert_same_numbers,
        read_rows,
        run_fs_in_process,
    )
    cfg = deep_update(fs_config(tmp_path), {'fsplug': {'results_dir': str(tmp_path / 'fs')}})
    proc = run_fs_in_process(['--cfg', write_yaml(tmp_path / 'fs.yaml', cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    fs_rows = read_rows(str(tmp_path / 'fs'))
    assert_same_numbers(fs_rows, _embedded_rows(tmp_path, cfg))
    assert_same_artifacts(str(tmp_path / 'fs'), str(tmp_path / 'embedded'))
    assert len({r['bytes_up'] for r in fs_rows if r['kind'] == 'train'}) == 1


@pytest.mark.fs
def test_fs_distributed_matches_embedded(tmp_path):
    """Server + 2 clients over gRPC on 127.0.0.1: every weight travels in the plugin's wire
    format, the same numbers and saved models as the embedded runner."""
    from test_fs_integration import assert_distributed_matches_embedded
    base = fs_config(tmp_path, federate={'client_num': 2, 'sample_client_num': 2},
                     data={'splitter': 'iid'})
    assert_distributed_matches_embedded(tmp_path, base, timeout=240)

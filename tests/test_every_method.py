"""Every registered method, found through the registry (a new method is covered without
editing a list): its tiny YAML runs in the embedded runner, in float32 (its shared reference
run) and over a bfloat16 base with float32 trainable tensors (one round)."""
import math

import pytest
import torch
import toy_methods  # noqa: F401  (registers the test-only toy_phased)
from helpers import method_params, run_embedded_keeping_clients, tiny_yaml_of

from fs_plugins.methods.registry import all_methods
from fs_plugins.run.config import load_config

METHODS = sorted(all_methods())


def test_the_registry_finds_the_package_methods():
    import pkgutil

    import fs_plugins.methods as package
    modules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    found = {cls.__module__.rsplit('.', 1)[-1] for cls in all_methods().values()}
    assert found - {'toy_methods'} <= modules
    assert {'fedavg', 'standalone', 'fedmole', 'flame', 'toy_phased'} <= set(METHODS)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16', 'bfloat16-autocast'])
@pytest.mark.parametrize('method', method_params(METHODS))
def test_tiny_yaml_runs(tmp_path, monkeypatch, reference_runs, method, dtype):
    """float32: the method's reference run (tests/shared_runs.py, its last round); bfloat16:
    one round of its own; bfloat16-autocast: that round with the forward under autocast, as
    on CUDA (bfloat16 activations meet the float32 adapters: what only a GPU run showed)."""
    if dtype == 'bfloat16-autocast':
        from fs_plugins.models import precision
        monkeypatch.setattr(precision, 'autocast_dtype', lambda device, wanted: (
            wanted if wanted in (torch.bfloat16, torch.float16) else None))
        dtype = 'bfloat16'
    if dtype == 'float32':
        reference = reference_runs.of(method)
        results, clients, cfg = reference.results, reference.clients, reference.server.cfg
        last = cfg.federate.total_round_num - 1
    else:
        cfg = load_config(tiny_yaml_of(method), [
            'federate.total_round_num', '1', 'train.local_update_steps', '2',
            'data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
            'fsplug.results_dir', str(tmp_path / 'results'), 'fsplug.model.dtype', dtype])
        results, clients = run_embedded_keeping_clients(cfg)
        last = 0
    assert cfg.fsplug.method == method
    train = [r for r in results.rows if r['kind'] == 'train' and r['round'] == last]
    evals = [r for r in results.rows if r['kind'] == 'eval' and r['round'] == last]
    assert len(train) == cfg.federate.sample_client_num and len(evals) == cfg.federate.client_num
    # one local pass of 2 steps per phase ('each' phases: Fed-MoLE's ADA runs two)
    steps = {cid: sum(p.steps for p in proc.method.phases(2, proc.cfg))
             for cid, proc in clients.items()}
    trains = next(iter(clients.values())).method.trains
    if trains:
        assert all(r['train_steps'] == steps[r['client']] >= 2 and math.isfinite(r['train_avg_loss'])
                   for r in train)
    else:   # zero_shot: no local step, nothing sent
        assert all((r['train_steps'], r['bytes_up'], r['bytes_down']) == (0, 0, 0) for r in train)
    assert all(math.isfinite(r['test_avg_loss']) for r in evals)
    for proc in clients.values():
        trainable = {n: proc.params[n].dtype for n in proc.trainable_names}
        assert set(trainable.values()) == ({torch.float32} if trains else set()), trainable
        # frozen adapters stay float32: FFA's lora_A, UniFLoW's modules of a modality the client lacks
        base = {p.dtype for n, p in proc.model.named_parameters()
                if n not in trainable and 'lora_' not in n and 'projectors.' not in n}
        assert base == {getattr(torch, dtype)}

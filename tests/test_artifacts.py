"""Fine-tuned models as artifacts (issue 18): every run writes adapters/global and
adapters/client_<id>; `load_trained` rebuilds each client's model exactly (every registered
method, via the registry); peft loads the plain LoRA folders; writes are atomic; bad input
gives one clear error naming the culprit."""
import json
import os

import pytest
import shared_runs
import torch
import toy_methods  # noqa: F401  (registers the test-only toy_phased)
from helpers import REPO, run_embedded_keeping_clients, tiny_yaml_of

from fs_plugins import load_trained
from fs_plugins.methods.registry import all_methods
from fs_plugins.run.artifacts import ARTIFACT_JSON, MODULES_FILE, PEFT_FILE, ArtifactError, client_dir
from fs_plugins.run.config import load_config, read_yaml

METHODS = sorted(all_methods())


def _run(tmp_path, method, rounds=1, opts=(), client_cfgs=None):
    cfg = load_config(tiny_yaml_of(method), [
        'federate.total_round_num', str(rounds), 'train.local_update_steps', '2',
        'data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
        'fsplug.results_dir', str(tmp_path / 'results'), *opts])
    results, clients = run_embedded_keeping_clients(cfg, client_cfgs)
    return results, clients


def _test_batch(proc, n=4):
    data = proc.eval_data['test']
    batch = proc.collate([data[i] for i in range(min(n, len(data)))])
    batch.pop('labels')
    return batch


def _logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(**batch).logits


def _assert_same_models(results, clients):
    last_eval = {r['client']: r for r in results.rows if r['kind'] == 'eval'}
    for cid, proc in clients.items():
        built = load_trained(results.out_dir, client=cid)
        batch = _test_batch(proc)
        torch.testing.assert_close(_logits(built.model, batch), _logits(proc.model, batch),
                                   rtol=0, atol=0)
        # the run's final evaluation, recomputed on the reloaded model (the run's put back:
        # a reference run is shared)
        run_model, proc.model = proc.model, built.model
        try:
            assert proc._token_metrics(proc.eval_data['test'], 'test')['test_avg_loss'] == \
                pytest.approx(last_eval[cid]['test_avg_loss'], rel=1e-6)
        finally:
            proc.model = run_model


@pytest.mark.slow
@pytest.mark.parametrize('method', METHODS)
def test_reloaded_client_models_equal_the_run(tmp_path, reference_runs, method):
    """On the method's reference run (tests/shared_runs.py), saved after its last round."""
    reference = reference_runs.of(method)
    results, clients = reference.results, reference.clients
    adapters = os.path.join(results.out_dir, 'adapters')
    assert sorted(os.listdir(adapters)) == sorted(['global'] + [f'client_{c}' for c in clients])
    for cid in clients:
        with open(os.path.join(client_dir(results.out_dir, cid), ARTIFACT_JSON)) as handle:
            meta = json.load(handle)
        assert meta['client'] == cid and meta['method'] == method
        assert meta['round'] == shared_runs.ROUNDS - 1
        assert all(f['bytes'] > 0 for f in meta['files'].values())
    _assert_same_models(results, clients)
    _assert_merged_export_or_refusal(results.out_dir, clients[1], tmp_path / 'merged')


def _load_exported(folder):
    import transformers
    config = transformers.AutoConfig.from_pretrained(folder)
    model_class = getattr(transformers, config.architectures[0])
    return model_class.from_pretrained(folder, dtype=torch.float32)


def _assert_merged_export_or_refusal(run_dir, proc, out):
    """Plain-LoRA methods export a merged HF model with the adapter model's logits; the
    others (Method.hf_export_refusal, or modules of their own) are refused with the reason."""
    from fs_plugins.run.trained import export, own_modules
    reason, custom = proc.method.hf_export_refusal, own_modules(proc.model)
    if reason or custom:
        with pytest.raises(ArtifactError, match='Cannot export client 1 of method'):
            export(run_dir, str(out), client=1, merge=True)
        return
    export(run_dir, str(out), client=1, merge=True)
    batch = _test_batch(proc)
    torch.testing.assert_close(_logits(_load_exported(str(out)), batch), _logits(proc.model, batch),
                               rtol=1e-4, atol=1e-4)


def test_reloaded_models_follow_the_client_configs(tmp_path):
    """Per-client ranks from --client_cfg are stored in run_info.json and rebuilt."""
    clients_yaml = os.path.join(REPO, 'yamls', 'hetlora', 'tiny_clients.yaml')
    results, clients = _run(tmp_path, 'hetlora', client_cfgs=read_yaml(clients_yaml))
    _assert_same_models(results, clients)
    assert load_trained(results.out_dir, client=4).model.peft_config['default'].r == 2


def test_global_state_and_periodic_saves(tmp_path):
    results, clients = _run(tmp_path, 'fedavg', rounds=2, opts=['fsplug.save.freq', '1'])
    with open(os.path.join(results.out_dir, 'adapters', 'global', ARTIFACT_JSON)) as handle:
        meta = json.load(handle)
    assert meta['round'] == 1 and meta['covers_trainable'] is True
    # FedAvg: every client holds the global state after the final evaluation
    built = load_trained(results.out_dir)
    batch = _test_batch(clients[1])
    torch.testing.assert_close(_logits(built.model, batch), _logits(clients[1].model, batch))


def test_peft_loads_a_plain_lora_client_folder(reference_runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fs_plugins.models.tiny import ensure_tiny_llama
    reference = reference_runs.of('fedavg')
    results, clients = reference.results, reference.clients
    folder = client_dir(results.out_dir, 2)
    assert not os.path.exists(os.path.join(folder, MODULES_FILE))   # nothing beyond LoRA
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(None), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder)
    batch = _test_batch(clients[2])
    torch.testing.assert_close(_logits(model, batch), _logits(clients[2].model, batch))


def test_a_crash_mid_save_keeps_the_previous_version(tmp_path, monkeypatch):
    import safetensors.torch
    results, clients = _run(tmp_path, 'flame')   # peft folder + method_modules.safetensors
    run_dir, proc = results.out_dir, clients[1]
    batch = _test_batch(proc)
    before = _logits(proc.model, batch)
    with torch.no_grad():   # a changed model whose save crashes half-way
        for name in proc.trainable_names:
            proc.params[name].add_(1.0)

    def crash(tensors, path, *args, **kwargs):
        with open(path, 'wb') as handle:
            handle.write(b'half')
        raise OSError('disk full (simulated)')
    monkeypatch.setattr(safetensors.torch, 'save_file', crash)
    with pytest.raises(OSError, match='simulated'):
        proc.save_model(run_dir, 5)
    monkeypatch.undo()
    assert sorted(os.listdir(os.path.join(run_dir, 'adapters'))) == \
        sorted(['global'] + [f'client_{c}' for c in clients])   # no temporary folder left
    torch.testing.assert_close(_logits(load_trained(run_dir, client=1).model, batch), before)
    # a crash between the two renames: the previous version is read from <folder>.old
    folder = client_dir(run_dir, 1)
    os.replace(folder, folder + '.old')
    torch.testing.assert_close(_logits(load_trained(run_dir, client=1).model, batch), before)


def test_bad_input_names_the_culprit(tmp_path):
    results, _ = _run(tmp_path, 'fedavg')
    run_dir = results.out_dir
    with pytest.raises(ArtifactError, match='Run directory not found: .*nowhere'):
        load_trained(str(tmp_path / 'nowhere'), client=1)
    with pytest.raises(ArtifactError, match=r'Client 9 is not a client of the run'):
        load_trained(run_dir, client=9)
    folder = client_dir(run_dir, 3)
    weights = os.path.join(folder, PEFT_FILE)
    with open(weights, 'r+b') as handle:
        handle.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(ArtifactError, match=f'{weights} has .* bytes.*truncated'):
        load_trained(run_dir, client=3)
    os.remove(weights)
    with pytest.raises(ArtifactError, match=f'missing: {weights}'):
        load_trained(run_dir, client=3)
    info_path = os.path.join(run_dir, 'run_info.json')
    with open(info_path) as handle:
        info = json.load(handle)
    info['config']['model']['type'] = 'smollm2@fsplug_llm'
    info['config']['fsplug']['model']['builder'] = 'smollm2'
    with open(info_path, 'w') as handle:
        json.dump(info, handle)
    with pytest.raises(ArtifactError, match=r'client_1 was saved from another base model.*'
                                            r"model: saved 'tiny-llama', run config 'smollm2'"):
        load_trained(run_dir, client=1)

"""Training at scale: gradient checkpointing and accumulation give the numbers of a plain run
(for every registered method), mixed precision keeps trainable tensors float32, and quantised
bases are refused clearly where they cannot work."""
import math

import pytest
import torch
import toy_methods  # noqa: F401  (registers the test-only toy_phased)
from helpers import method_params, run_embedded_keeping_clients, tiny_yaml_of

from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import all_methods, get_method_class
from fs_plugins.methods.specs import model_spec
from fs_plugins.models import precision
from fs_plugins.run.client import micro_batch_weights
from fs_plugins.run.config import load_config
from fs_plugins.run.results import is_time_column

METHODS = sorted(all_methods())


def tiny_run(tmp_path, method: str, *opts):
    cfg = load_config(tiny_yaml_of(method), [
        'federate.total_round_num', '1', 'train.local_update_steps', '2',
        'data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
        'fsplug.results_dir', str(tmp_path / 'results'), 'fsplug.model.lora.dropout', '0.0',
        *opts])
    results, clients = run_embedded_keeping_clients(cfg)
    return results.rows, clients


def numbers(rows, leave_out=()) -> list[dict]:
    """The train and eval rows' floats, times left out (they differ from run to run)."""
    return [{k: v for k, v in row.items() if isinstance(v, float) and not k.startswith('bytes')
             and not is_time_column(k) and k not in leave_out}
            for row in rows if row['kind'] in ('train', 'eval')]


def assert_same_numbers(rows_a, rows_b, rel=2e-4, leave_out=()):
    a, b = numbers(rows_a, leave_out), numbers(rows_b, leave_out)
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for row_a, row_b in zip(a, b):
        for key in row_a:
            if not (math.isnan(row_a[key]) and math.isnan(row_b[key])):
                assert row_a[key] == pytest.approx(row_b[key], rel=rel, abs=1e-6), key


@pytest.mark.parametrize('method', method_params(METHODS))
def test_gradient_checkpointing_gives_the_same_run(tmp_path, reference_runs, method):
    """The method's reference run (tests/shared_runs.py) again with gradient checkpointing."""
    import shared_runs
    plain = reference_runs.of(method)
    checkpointed, clients = run_embedded_keeping_clients(shared_runs.load(
        method, str(tmp_path / 'checkpointed'), plain.folder,
        'fsplug.train.gradient_checkpointing', 'True'))
    assert_same_numbers(plain.results.rows, checkpointed.rows)
    model = next(iter(clients.values())).model
    assert any(getattr(m, 'gradient_checkpointing', False) is True for m in model.modules())


def test_gradient_checkpointing_recomputes_and_keeps_the_gradients(tmp_path):
    """One step by hand on Fed-MoLE (routed experts): the layers run again in backward, and
    loss and every gradient equal those without checkpointing."""
    def one_step(checkpointing: bool):
        cfg = load_config(tiny_yaml_of('fedmole'), [
            'data.root', str(tmp_path / 'data'), 'fsplug.model.lora.dropout', '0.0',
            'fsplug.train.gradient_checkpointing', str(checkpointing)])
        method = get_method_class('fedmole')(cfg)
        built = build_model(cfg, method, share_frozen=False)
        model = built.model.train()
        calls = []
        layer = next(m for n, m in model.named_modules() if n.endswith('layers.0.mlp'))
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
        torch.manual_seed(0)
        ids = torch.randint(5, 100, (2, 12))
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, len(calls)

    loss, grads, calls = one_step(False)
    loss_gc, grads_gc, calls_gc = one_step(True)
    assert (calls, calls_gc) == (1, 2)           # the checkpointed layer ran again in backward
    torch.testing.assert_close(loss_gc, loss)
    assert grads.keys() == grads_gc.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads_gc[name], grads[name], msg=name)


def test_micro_batch_weights_make_the_mean_over_all_loss_terms():
    def units(batch):
        return batch['n']
    pairs = micro_batch_weights([{'n': 1}, {'n': 3}], units)
    assert [w for _, w in pairs] == [0.25, 0.75]
    assert [w for _, w in micro_batch_weights([{'n': 0}, {'n': 0}], units)] == [0.5, 0.5]


@pytest.mark.slow
@pytest.mark.parametrize('method', ['fedavg', 'fedmole', 'flame', 'fedmosaic', 'scaffold'])
def test_two_micro_batches_of_two_train_like_one_batch_of_four(tmp_path, method):
    """grad.grad_accum_count 2 × batch 2 = batch 4: same trained adapters and metrics, and the
    per-step counts (FLAME's activations, RELA's every-f steps, SCAFFOLD's K) count optimiser
    steps."""
    common = ['fsplug.eval.batch_size', '4', 'train.optimizer.type', 'SGD',
              'train.optimizer.lr', '0.05']
    whole, clients_whole = tiny_run(tmp_path / 'whole', method, 'dataloader.batch_size', '4',
                                    *common)
    split, clients_split = tiny_run(tmp_path / 'split', method, 'dataloader.batch_size', '2',
                                    'grad.grad_accum_count', '2', *common)
    # train_avg_loss averages the (micro-)batches' mean losses by examples, so it may differ
    assert_same_numbers(whole, split, leave_out=('train_avg_loss',))
    for cid, proc in clients_whole.items():
        other = clients_split[cid]
        for name in proc.trainable_names:
            torch.testing.assert_close(other.params[name], proc.params[name], rtol=1e-4,
                                       atol=1e-6, msg=name)
        if method == 'flame':
            assert proc.state['routing'].steps == other.state['routing'].steps == 0  # taken
        if method == 'fedmosaic':
            assert proc.state['rela'].steps == other.state['rela'].steps


def test_accumulation_counts_optimiser_steps_and_micro_batches(tmp_path):
    rows, clients = tiny_run(tmp_path, 'flame', 'grad.grad_accum_count', '3')
    proc = next(iter(clients.values()))
    assert proc.begin_round() == 2 * 3                       # micro-batches of the round
    train = [r for r in rows if r['kind'] == 'train']
    assert {r['train_steps'] for r in train} == {2}          # optimiser steps


# ------------------------------------------------------------------ mixed precision
def test_autocast_only_on_cuda_in_half_precision():
    cuda, cpu = torch.device('cuda'), torch.device('cpu')
    assert precision.autocast_dtype(cuda, torch.bfloat16) is torch.bfloat16
    assert precision.autocast_dtype(cuda, torch.float32) is None
    assert precision.autocast_dtype(cpu, torch.bfloat16) is None
    assert not precision.grad_scaler(cpu, torch.float16).is_enabled()


# ------------------------------------------------------------------ quantised bases
def quantization_cfg(tmp_path, method='fedavg', mode='4bit', *opts):
    return load_config(tiny_yaml_of(method), ['data.root', str(tmp_path / 'data'),
                                              'fsplug.model.quantization', mode, *opts])


def test_quantization_is_refused_by_methods_that_edit_frozen_weights(tmp_path):
    editing = [name for name, cls in all_methods().items()
               if cls(quantization_cfg(tmp_path, name)).modifies_frozen_weights]
    assert 'fedex' in editing
    for name in editing:
        cfg = quantization_cfg(tmp_path, name)
        with pytest.raises(ConfigError, match=f"method '{name}' edits the frozen base"):
            precision.check_quantization(model_spec(cfg), get_method_class(name)(cfg))


def test_quantization_needs_cuda_and_a_from_pretrained_builder(tmp_path):
    cfg = quantization_cfg(tmp_path)
    with pytest.raises(ConfigError, match='needs CUDA'):
        build_model(cfg, get_method_class('fedavg')(cfg))
    cfg = quantization_cfg(tmp_path, 'fedavg', '8bit', 'fsplug.model.builder', 'easyvqa_llava')
    with pytest.raises(ConfigError, match="builder 'easyvqa_llava' does not load"):
        precision.check_quantization(model_spec(cfg), get_method_class('fedavg')(cfg))


def test_quantization_needs_bitsandbytes(tmp_path, monkeypatch):
    cfg = quantization_cfg(tmp_path, 'fedavg', '4bit', 'use_gpu', 'True')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(precision.importlib.util, 'find_spec', lambda name: None)
    with pytest.raises(ConfigError, match='pip install bitsandbytes'):
        precision.check_quantization(model_spec(cfg), get_method_class('fedavg')(cfg))


def test_quantization_config_of_each_mode(tmp_path):
    assert precision.quantization_kwargs(model_spec(quantization_cfg(tmp_path, 'fedavg', 'none'))) == {}
    four = precision.quantization_kwargs(model_spec(quantization_cfg(
        tmp_path, 'fedavg', '4bit', 'fsplug.model.dtype', 'bfloat16', 'device', '1')))
    config = four['quantization_config']
    assert config.load_in_4bit and config.bnb_4bit_quant_type == 'nf4'
    assert config.bnb_4bit_use_double_quant and config.bnb_4bit_compute_dtype == torch.bfloat16
    assert four['device_map'] == {'': 1}
    assert precision.quantization_kwargs(
        model_spec(quantization_cfg(tmp_path, 'fedavg', '8bit')))['quantization_config'].load_in_8bit

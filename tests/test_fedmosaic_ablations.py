"""FedMosaic's appendix ablations as options: RELA from the training model (Table 30), a W_s
other than the pivot and a k-bit W_s (A.20, Table 31), A / B alignment switched off (Table 32).
The maths against naive references, then each variant built and run end to end on the tiny
heterogeneous federation (yamls/fedmosaic/tiny.yaml + tiny_clients.yaml)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO, run_embedded_keeping_clients

from fs_plugins.aggregation.mosaic import NF4_LEVELS, fake_quantise, shared_mask
from fs_plugins.methods.building import build_model
from fs_plugins.methods.fedmosaic import GRAD_KEY, FedMosaic, same_tokenizer, small_base
from fs_plugins.methods.specs import model_spec
from fs_plugins.models.builders import load_base
from fs_plugins.run.config import ConfigError, client_config, load_config, read_yaml
from fs_plugins.tuners.mosaic.rela import (
    last_block_pq_gradient,
    last_block_pq_layers,
    quantise_linear_weights,
    rela_gradient,
)

TINY = os.path.join(REPO, 'yamls', 'fedmosaic', 'tiny.yaml')
CLIENTS = os.path.join(REPO, 'yamls', 'fedmosaic', 'tiny_clients.yaml')
LARGE = 'tiny-llama-large@fsplug_llm'


def _cfg(tmp_path, *opts):
    return load_config(TINY, ['data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
                              'fsplug.results_dir', str(tmp_path / 'results'),
                              'fsplug.fedmosaic.alignment_dir', str(tmp_path / 'align'), *opts])


def _built(cfg, model_type=None):
    ccfg = client_config(cfg, {'model': {'type': model_type}} if model_type else None)
    method = FedMosaic(ccfg)
    return build_model(ccfg, method), method, ccfg


def _batch(codec):
    return codec.collate([codec.encode({'instruction': 'add 2 and 3', 'input': '', 'output': '5'}),
                          codec.encode({'instruction': 'name a colour', 'input': '',
                                        'output': 'red'})])


# ------------------------------------------------------------------ k-bit quantiser (maths)
def naive_int8_rows(weight):
    out = torch.empty_like(weight, dtype=torch.float64)
    for i, row in enumerate(weight.double()):
        scale = float(row.abs().max()) or 1.0
        out[i] = torch.tensor([round(float(v) / scale * 127) / 127 * scale for v in row])
    return out


def naive_nf4(weight):
    values = weight.double().flatten().tolist()
    out = []
    for start in range(0, len(values), 64):
        block = values[start:start + 64]
        scale = max(abs(v) for v in block) or 1.0
        out += [min(NF4_LEVELS, key=lambda level, v=v: abs(v / scale - level)) * scale
                for v in block]
    return torch.tensor(out, dtype=torch.float64).view(weight.shape)


@pytest.mark.parametrize('shape', [(3, 50), (5, 64), (2, 97)])
def test_fake_quantise_matches_naive_int8_and_nf4(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    weight[0].zero_()       # an all-zero row / block stays zero
    int8 = fake_quantise(weight, '8bit')
    torch.testing.assert_close(int8.double(), naive_int8_rows(weight), rtol=0, atol=1e-6)
    assert int8.dtype == weight.dtype and len({round(float(v / int8[1].abs().max() * 127), 4)
                                               for v in int8[1]}) <= 255
    nf4 = fake_quantise(weight, '4bit')
    torch.testing.assert_close(nf4.double(), naive_nf4(weight), rtol=0, atol=1e-6)
    assert fake_quantise(weight, 'none') is weight
    # quantising again changes nothing (the values already sit on the grid)
    torch.testing.assert_close(fake_quantise(int8, '8bit'), int8, rtol=0, atol=1e-6)
    torch.testing.assert_close(fake_quantise(nf4, '4bit'), nf4, rtol=0, atol=1e-6)
    # 4 bits err more than 8
    assert (nf4 - weight).abs().mean() > (int8 - weight).abs().mean()


def test_fake_quantise_refuses_bad_input():
    with pytest.raises(ValueError, match="mode must be one of"):
        fake_quantise(torch.ones(2, 2), '2bit')
    with pytest.raises(ValueError, match='weight must be a 2-D tensor'):
        fake_quantise(torch.ones(4), '8bit')


def test_quantise_linear_weights_leaves_the_output_layer_and_embeddings(tmp_path):
    spec = model_spec(_cfg(tmp_path))
    plain, quantised = load_base(spec).model, load_base(spec).model
    assert quantise_linear_weights(quantised, '4bit') > 0
    head = plain.get_output_embeddings()
    for (name, before), (_, after) in zip(plain.named_modules(), quantised.named_modules()):
        if isinstance(before, torch.nn.Linear) and before is not head:
            torch.testing.assert_close(after.weight, fake_quantise(before.weight, '4bit'),
                                       rtol=0, atol=0, msg=name)
            assert not torch.equal(after.weight, before.weight), name
    torch.testing.assert_close(quantised.get_output_embeddings().weight, head.weight, rtol=0, atol=0)
    torch.testing.assert_close(quantised.get_input_embeddings().weight,
                               plain.get_input_embeddings().weight, rtol=0, atol=0)


# ------------------------------------------------------------------ W_s other than the pivot
def test_a_k_bit_ws_other_than_the_pivot_gives_its_gradient_and_a_new_setup_id(tmp_path):
    cfg = _cfg(tmp_path, 'fsplug.fedmosaic.small_model_type', LARGE,
               'fsplug.fedmosaic.small_quantization', '8bit')
    assert cfg.fsplug.fedmosaic.small_builder == 'tiny_llama'
    built, method, ccfg = _built(cfg)
    state = method.init_client_state(built.model, ccfg)
    small = method.small_model(state, 'cpu')
    reference = load_base(model_spec(client_config(cfg, {'model': {'type': LARGE}}))).model
    down = reference.model.layers[-1].mlp.down_proj.weight
    torch.testing.assert_close(small.model.layers[-1].mlp.down_proj.weight,
                               fake_quantise(down, '8bit'), rtol=0, atol=0)
    # the pivot stays the run's model; the setup id names the other W_s
    assert method.is_pivot(ccfg)
    default = FedMosaic(_cfg(tmp_path))
    assert method._type_ids(ccfg)[1] != default._type_ids(default.cfg)[1]
    assert method._type_ids(ccfg)[0] == default._type_ids(default.cfg)[0]
    # RELA's upload has N_s of the large W_s's down_proj
    shapes = method.extra_payload_shapes(built.model, ccfg)
    assert shapes[GRAD_KEY] == (round(0.4 * down.numel()),)
    # the gradient is W_s's on the dequantised weights: close to, not equal to, the plain one
    batch = _batch(built.codec)
    quantised_grad = rela_gradient(small, batch, 'last_down_proj')
    plain_grad = rela_gradient(reference, batch, 'last_down_proj')
    assert not torch.equal(quantised_grad, plain_grad)
    assert torch.nn.functional.cosine_similarity(quantised_grad, plain_grad, dim=0) > 0.9


def test_a_ws_with_another_tokenizer_reads_its_own_batches(tmp_path):
    """No refusal any more: W_s re-encodes the batch's records (tests/test_fedmosaic_ablations2.py)."""
    cfg = _cfg(tmp_path)
    codec = small_base(cfg, FedMosaic(cfg).hparams).codec
    other = SimpleNamespace(tokenizer=SimpleNamespace(get_vocab=lambda: {'a': 0}))
    assert same_tokenizer(codec, codec) and not same_tokenizer(codec, other)


# ------------------------------------------------------------------ RELA from the training model
def test_training_model_gradient_is_the_last_blocks_p_q_gradient(tmp_path):
    """rela_model: training on the 4-layer model with N_B = 2: block 2 ends at layer 4."""
    cfg = _cfg(tmp_path, 'fsplug.fedmosaic.rela_model', 'training',
               'fsplug.fedmosaic.num_blocks', '2', 'fsplug.fedmosaic.gradient_every', '1',
               'fsplug.fedmosaic.ema_ratio', '1.0', 'fsplug.fedmosaic.noise_std', '0.0',
               'fsplug.fedmosaic.align_a', 'False', 'fsplug.fedmosaic.align_b', 'False',
               'fsplug.fedmosaic.sanitise_order', 'equations')   # the EMA at every gradient
    built, method, ccfg = _built(cfg, LARGE)
    model = built.model
    last = last_block_pq_layers(model.fedmosaic_pq)
    assert last and all('.layers.3.' in name for name in last)
    assert [model.fedmosaic_pq[n] for n in last] == sorted(model.fedmosaic_pq[n] for n in last)
    state = method.init_client_state(model, ccfg)
    for _ in range(2):      # two steps: ema_ratio 1 keeps the current batch's gradient only
        model.zero_grad(set_to_none=True)
        method.loss(model, _batch(built.codec), state).backward()
        method.before_optimizer_step(model, state)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.1)
        method.after_step(model, state)
    modules = dict(model.named_modules())
    naive = torch.cat([t.grad.flatten() for n in last
                       for t in (modules[n].mosaic.P, modules[n].mosaic.Q)])
    torch.testing.assert_close(last_block_pq_gradient(model, model.fedmosaic_pq), naive)
    sent = method.client_extra(model, state)[GRAD_KEY]
    mask = shared_mask(naive.numel(), 0.4, state['rela'].mask_seed)
    torch.testing.assert_close(sent, naive[mask])
    assert method.extra_payload_shapes(model, ccfg)[GRAD_KEY] == tuple(sent.shape)
    r = 8
    assert naive.numel() == len(last) * (r * r + r)


def test_training_model_gradients_need_pq_lora(tmp_path):
    with pytest.raises(ConfigError, match=r"rela_model = 'training'.*pq_lora"):
        _cfg(tmp_path, 'fsplug.fedmosaic.rela_model', 'training', 'fsplug.fedmosaic.pq_lora', 'False')


def test_k_bit_ws_refused_over_an_already_quantised_base(tmp_path):
    with pytest.raises(ConfigError, match='small_quantization'):
        _cfg(tmp_path, 'fsplug.fedmosaic.small_quantization', '4bit',
             'fsplug.model.quantization', '4bit')


# ------------------------------------------------------------------ alignment switched off
def _factors(built):
    modules = dict(built.model.named_modules())
    return {key: (modules[n].lora_A['default'].weight.detach().clone(),
                  modules[n].lora_B['default'].weight.detach().clone())
            for n, key in built.model.fedmosaic_pq.items()}


@pytest.mark.slow
def test_alignment_parts_switch_off_alone(tmp_path):
    """Table 32: 'Random' A or B is the random orthonormal start; the other part is aligned
    as in the default (A's fit does not depend on B; B's CCA uses whichever A)."""
    def factors(align_a, align_b):
        cfg = _cfg(tmp_path, 'fsplug.fedmosaic.alignment_schedule', 'full_batch',
                   'fsplug.fedmosaic.align_a', str(align_a), 'fsplug.fedmosaic.align_b', str(align_b))
        return _factors(_built(cfg, LARGE)[0])
    random = factors(False, False)
    assert not os.path.exists(tmp_path / 'align')          # nothing aligned, nothing cached
    both, a_only, b_only = factors(True, True), factors(True, False), factors(False, True)
    assert len(os.listdir(tmp_path / 'align')) == 3        # each variant its own cache entry
    for key, (a0, b0) in random.items():
        assert not torch.allclose(both[key][0], a0) and not torch.allclose(both[key][1], b0)
        torch.testing.assert_close(a_only[key][0], both[key][0], rtol=0, atol=0)
        torch.testing.assert_close(a_only[key][1], b0, rtol=0, atol=0)
        torch.testing.assert_close(b_only[key][0], a0, rtol=0, atol=0)
        assert not torch.allclose(b_only[key][1], b0) and not torch.allclose(b_only[key][1], both[key][1])


# ------------------------------------------------------------------ end to end
@pytest.mark.slow
@pytest.mark.parametrize('opts', [
    ('fsplug.fedmosaic.rela_model', 'training', 'fsplug.fedmosaic.ema_ratio', '1.0'),
    ('fsplug.fedmosaic.small_model_type', LARGE, 'fsplug.fedmosaic.small_quantization', '4bit',
     'fsplug.fedmosaic.align_b', 'False'),
], ids=['training_gradients', 'other_4bit_ws_no_b_cca'])
def test_ablation_runs_end_to_end_on_two_model_types(tmp_path, opts):
    cfg = _cfg(tmp_path, 'federate.total_round_num', '1', 'train.local_update_steps', '2',
               'fsplug.fedmosaic.gradient_every', '1', 'fsplug.fedmosaic.alignment_samples', '8',
               *opts)
    results, clients = run_embedded_keeping_clients(cfg, read_yaml(CLIENTS))
    evals = [r for r in results.rows if r['kind'] == 'eval']
    assert len(evals) == 4 and all(r['test_avg_loss'] == r['test_avg_loss'] for r in evals)
    sizes = {cid: c.method.client_extra(c.model, c.state)[GRAD_KEY].numel()
             for cid, c in clients.items()}
    assert len(set(sizes.values())) == 1       # both model types send comparable gradients
    for proc in clients.values():
        assert proc.state['rela'].steps == 2


# ------------------------------------------------------------------ SFT on FedMosaic's architecture
def test_local_only_layers_are_base_plus_the_local_module(tmp_path):
    """Table 29 'SFT (N_B)': h = W0 x + B(P A x + Q) on PQ layers, W0 x + s·B A x elsewhere;
    no gate, no global module."""
    built, method, _ = _built(_cfg(tmp_path, 'fsplug.fedmosaic.local_only', 'True'), LARGE)
    assert not os.path.exists(tmp_path / 'align')           # nothing shared: nothing aligned
    assert not any(n.endswith('beta') for n in built.trainable_names)
    assert not any('.global_' in n for n, _ in built.model.named_buffers())
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(0))
    checked = 0
    for name, module in built.model.named_modules():
        if not hasattr(module, 'mosaic') or module.base_layer.in_features != 96:
            continue
        state = module.mosaic
        with torch.no_grad():
            state.Q.add_(0.1) if state.pq else module.lora_B['default'].weight.add_(0.1)
            a, b = module.lora_A['default'].weight, module.lora_B['default'].weight
            naive = (x @ (b @ state.P @ a).T + b @ state.Q if state.pq
                     else module.scaling['default'] * x @ (b @ a).T)
            torch.testing.assert_close(module(x), module.base_layer(x) + naive, msg=name)
        checked += 1
    assert checked >= 4
    assert method.shared_tensors(built.model, built.trainable_names) == {}


@pytest.mark.slow
def test_local_only_run_sends_nothing_and_trains_p_q(tmp_path):
    cfg = _cfg(tmp_path, 'federate.total_round_num', '2', 'train.local_update_steps', '2',
               'fsplug.fedmosaic.local_only', 'True', 'fsplug.fedmosaic.num_blocks', '1')
    results, clients = run_embedded_keeping_clients(cfg, read_yaml(CLIENTS))
    train = [r for r in results.rows if r['kind'] == 'train']
    assert len(train) == 8 and all(r['bytes_down'] == 0 for r in train)
    for proc in clients.values():
        assert GRAD_KEY not in proc.method.client_extra(proc.model, proc.state)
        pq = [m.mosaic for m in proc.model.modules() if hasattr(m, 'mosaic') and m.mosaic.pq]
        assert pq and any(not torch.equal(s.P, torch.eye(s.P.shape[0])) for s in pq)

"""FedMosaic's layers (issue 11, deliverables 1-2; issue 38): PQ-LoRA's forward equals Eqs. 5
and 7 written with dense matrices (no alpha / r on PQ-LoRA by default); only P, Q and the gate
train in PQ layers (A, B frozen and orthonormal); conventional layers mix a trainable local
LoRA with a frozen global copy; one gate per decoder layer; PQ-LoRA sits at the block-end
layers of Eq. 6."""
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from fs_plugins.tuners.mosaic.layer import GATE_ATTR, MOSAIC_ATTR, MosaicLinear, dense_reference
from fs_plugins.tuners.mosaic.model import inject_mosaic, layer_position


def _model(layers=8, hidden=32, r=4, dtype=torch.float32):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=48,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(dtype)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=8, target_modules=['q_proj', 'v_proj']))


def _mosaic_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, MosaicLinear)}


@pytest.mark.parametrize('gate', ['per_layer', 'per_module'])
def test_pq_layers_sit_at_block_ends_and_only_p_q_gate_train(gate):
    model = _model(layers=8)
    pq = inject_mosaic(model, num_blocks=4, placement='equation', q_init_std=1e-3, seed=0,
                       gate=gate)
    assert sorted({layer_position(n)[0] for n in pq}) == [2, 4, 6, 8]
    assert sorted(set(pq.values())) == [f'block{k}.self_attn.{m}' for k in (1, 2, 3, 4)
                                        for m in ('q_proj', 'v_proj')]
    own_gate = {f'{MOSAIC_ATTR}.beta'} if gate == 'per_module' else set()
    for name, module in _mosaic_modules(model).items():
        state = getattr(module, MOSAIC_ATTR)
        a, b = module.lora_A['default'].weight, module.lora_B['default'].weight
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        if name in pq:
            assert trainable == {f'{MOSAIC_ATTR}.P', f'{MOSAIC_ATTR}.Q'} | own_gate
            torch.testing.assert_close(a @ a.T, torch.eye(a.shape[0]), atol=1e-5, rtol=0)
            torch.testing.assert_close(b.T @ b, torch.eye(b.shape[1]), atol=1e-5, rtol=0)
            torch.testing.assert_close(state.P.detach(), torch.eye(a.shape[0]))
        else:
            assert trainable == {'lora_A.default.weight', 'lora_B.default.weight'} | own_gate
        assert float(state.gate().detach()) == 0.5     # β = 0
    gates = [n for n, p in model.named_parameters() if n.endswith('.beta')]
    if gate == 'per_layer':
        # one β per decoder layer carrying LoRA (all 8 here), listed once, under the layer
        assert sorted(gates) == sorted(f'base_model.model.model.layers.{i}.{GATE_ATTR}.beta'
                                       for i in range(8))
    else:
        assert len(gates) == len(_mosaic_modules(model)) == 16


def test_per_layer_gate_gradient_sums_over_the_layers_modules():
    """One β per decoder layer: its gradient is the sum of what per-module βs (same values)
    would get from each of the layer's modules."""
    grads = {}
    for gate in ('per_layer', 'per_module'):
        model = _model(layers=4)
        inject_mosaic(model, 2, 'equation', 1e-2, seed=1, gate=gate)
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():    # local and global modules differ, so β has a gradient
            for name, tensor in sorted({**dict(model.named_parameters()),
                                        **dict(model.named_buffers())}.items()):
                if ('lora_B' in name or 'global_' in name or '.Q' in name) and tensor.dim():
                    tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.3)
        model(input_ids=torch.arange(12).view(2, 6)).logits.pow(2).mean().backward()
        grads[gate] = {n: p.grad for n, p in model.named_parameters() if n.endswith('.beta')}
    for layer in range(4):
        per_layer = grads['per_layer'][f'base_model.model.model.layers.{layer}.{GATE_ATTR}.beta']
        per_module = [g for n, g in grads['per_module'].items() if f'.layers.{layer}.' in n]
        assert len(per_module) == 2 and float(per_layer.abs()) > 0
        torch.testing.assert_close(per_layer, sum(per_module), rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize('pq', [True, False])
@pytest.mark.parametrize('pq_scale', ['none', 'alpha_over_r'])
def test_forward_equals_the_dense_formula(pq, pq_scale):
    model = _model()
    pq_layers = inject_mosaic(model, 4, 'equation', 1e-2, seed=1, pq_scale=pq_scale)
    name = next(n for n in _mosaic_modules(model) if (n in pq_layers) == pq)
    module = _mosaic_modules(model)[name]
    state = getattr(module, MOSAIC_ATTR)
    with torch.no_grad():   # local, global and gate all different from their start
        for tensor in [state.beta_parameter()] + [t for t in state.buffers()] + \
                [p for p in module.parameters() if p.requires_grad]:
            tensor.add_(torch.randn_like(tensor) * 0.3)
    x = torch.randn(3, 5, module.in_features)
    torch.testing.assert_close(module(x), dense_reference(module, x), atol=1e-5, rtol=1e-5)
    # written out: Eq. 5 has no alpha / r (here 8 / 4 = 2); conventional LoRA keeps peft's
    a, b, g = module.lora_A['default'].weight, module.lora_B['default'].weight, state.gate()
    s = 2.0 if (not pq or pq_scale == 'alpha_over_r') else 1.0
    assert module.scaling['default'] == 2.0
    if pq:
        local = x @ (b @ state.P @ a).T + b @ state.Q
        shared = x @ (b @ state.global_P @ a).T + b @ state.global_Q
    else:
        local, shared = x @ (b @ a).T, x @ (state.global_B @ state.global_A).T
    expected = module.base_layer(x) + s * ((1 - g) * local + g * shared)
    torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)
    # the gate at its extremes gives the local or the global module alone
    with torch.no_grad():
        state.beta_parameter().fill_(-50.0)
    local_only = module(x)
    with torch.no_grad():
        state.beta_parameter().fill_(50.0)
    assert not torch.allclose(local_only, module(x))


def test_without_pq_lora_every_layer_is_conventional():
    model = _model(layers=8)
    assert inject_mosaic(model, 4, 'equation', 1e-3, seed=0, pq_lora=False) == {}
    modules = _mosaic_modules(model)
    assert len(modules) == 16 and not any(m.mosaic.pq for m in modules.values())
    assert all(m.lora_A['default'].weight.requires_grad for m in modules.values())


def test_global_module_is_frozen_and_gradients_reach_only_local_parts():
    model = _model()
    inject_mosaic(model, 4, 'equation', 1e-3, seed=0)
    out = model(input_ids=torch.randint(0, 64, (2, 6))).logits.sum()
    out.backward()
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, name
    assert all(not b.requires_grad for n, b in model.named_buffers() if 'global_' in n)


def test_bf16_base_keeps_float32_adapters():
    model = _model(dtype=torch.bfloat16)
    inject_mosaic(model, 4, 'equation', 1e-3, seed=0)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {b.dtype for n, b in model.named_buffers() if 'global_' in n} == {torch.float32}
    logits = model(input_ids=torch.randint(0, 64, (2, 6))).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()

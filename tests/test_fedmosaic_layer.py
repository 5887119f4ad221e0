"""FedMosaic's layers (issue 11, deliverables 1-2): PQ-LoRA's forward equals Eqs. 5 and 7
written with dense matrices; only P, Q and the gate train in PQ layers (A, B frozen and
orthonormal); conventional layers mix a trainable local LoRA with a frozen global copy;
PQ-LoRA sits at the block-end layers of Eq. 6."""
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from fs_plugins.tuners.mosaic.layer import MOSAIC_ATTR, MosaicLinear, dense_reference
from fs_plugins.tuners.mosaic.model import inject_mosaic, layer_position


def _model(layers=8, hidden=32, r=4, dtype=torch.float32):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=48,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(dtype)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=8, target_modules=['q_proj', 'v_proj']))


def _mosaic_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, MosaicLinear)}


def test_pq_layers_sit_at_block_ends_and_only_p_q_gate_train():
    model = _model(layers=8)
    pq = inject_mosaic(model, num_blocks=4, placement='equation', q_init_std=1e-3, seed=0)
    assert sorted({layer_position(n)[0] for n in pq}) == [2, 4, 6, 8]
    assert sorted(set(pq.values())) == [f'block{k}.self_attn.{m}' for k in (1, 2, 3, 4)
                                        for m in ('q_proj', 'v_proj')]
    for name, module in _mosaic_modules(model).items():
        state = getattr(module, MOSAIC_ATTR)
        a, b = module.lora_A['default'].weight, module.lora_B['default'].weight
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        if name in pq:
            assert trainable == {f'{MOSAIC_ATTR}.P', f'{MOSAIC_ATTR}.Q', f'{MOSAIC_ATTR}.beta'}
            torch.testing.assert_close(a @ a.T, torch.eye(a.shape[0]), atol=1e-5, rtol=0)
            torch.testing.assert_close(b.T @ b, torch.eye(b.shape[1]), atol=1e-5, rtol=0)
            torch.testing.assert_close(state.P.detach(), torch.eye(a.shape[0]))
        else:
            assert trainable == {'lora_A.default.weight', 'lora_B.default.weight',
                                 f'{MOSAIC_ATTR}.beta'}
        assert float(state.gate()) == 0.5     # β = 0


@pytest.mark.parametrize('pq', [True, False])
def test_forward_equals_the_dense_formula(pq):
    model = _model()
    pq_layers = inject_mosaic(model, 4, 'equation', 1e-2, seed=1)
    name = next(n for n in _mosaic_modules(model) if (n in pq_layers) == pq)
    module = _mosaic_modules(model)[name]
    state = getattr(module, MOSAIC_ATTR)
    with torch.no_grad():   # local, global and gate all different from their start
        for tensor in [state.beta] + [t for t in state.buffers()] + \
                [p for p in module.parameters() if p.requires_grad]:
            tensor.add_(torch.randn_like(tensor) * 0.3)
    x = torch.randn(3, 5, module.in_features)
    torch.testing.assert_close(module(x), dense_reference(module, x), atol=1e-5, rtol=1e-5)
    # the gate at its extremes gives the local or the global module alone
    with torch.no_grad():
        state.beta.fill_(-50.0)
    local_only = module(x)
    with torch.no_grad():
        state.beta.fill_(50.0)
    assert not torch.allclose(local_only, module(x))


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

"""FLAME: per-client top-k with LoRA on fused experts, the rescaler variants, activation
counts, activation-aware aggregation, per-client k_i in evaluation, and the expert-wise
mixed-rank baselines. Small random OLMoE models built in memory."""
import pytest
import torch
import torch.nn.functional as F

from fs_plugins.aggregation import activation_aware_weights, weighted_average
from fs_plugins.aggregation.experts import fuse, merge_experts, split_experts, unfuse
from fs_plugins.config import ConfigError, client_config, load_config
from fs_plugins.methods.base import ClientUpdate
from fs_plugins.methods.expertwise import HetLoRAExperts
from fs_plugins.methods.flame import COUNTS_PREFIX, DEFAULT_TOP_K_KEY, STEPS_KEY, Flame
from fs_plugins.tuners.flame import moe_blocks
from fs_plugins.models.olmoe import EXPERT_LORA_PARAMETERS, random_olmoe
from helpers import deep_update, tiny_config, write_yaml

# hidden 24 != 2 x intermediate 16, so any slip in the factor orientation fails on shapes
DIMS = dict(vocab_size=50, hidden_size=24, intermediate_size=8, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, num_experts=6, num_experts_per_tok=4,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
R, ALPHA = 3, 6


def flame_cfg(tmp_path, **flame):
    tmp_path.mkdir(parents=True, exist_ok=True)
    lora = {'target_modules': ['q_proj', 'v_proj'], 'target_parameters': EXPERT_LORA_PARAMETERS}
    raw = tiny_config(tmp_path, 'flame', fsplug={'flame': flame, 'model': {
        'builder': 'tiny_olmoe', 'lora': lora}},
                      model={'type': 'tiny-olmoe@fsplug_llm'})
    return load_config(write_yaml(tmp_path / 'flame.yaml', raw))


def olmoe_with_lora(seed=0):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = get_peft_model(random_olmoe(seed=seed, **DIMS),
                           LoraConfig(r=R, lora_alpha=ALPHA, target_modules=['q_proj'],
                                      target_parameters=EXPERT_LORA_PARAMETERS))
    with torch.no_grad():  # peft starts B at zero; make every expert's LoRA visible
        for name, param in model.named_parameters():
            if 'lora_B' in name:
                param.normal_(0, 0.3)
    return model


def flame_model(tmp_path, seed=0, **flame):
    method = Flame(flame_cfg(tmp_path, **flame))
    return method, method.adapt_model(olmoe_with_lora(seed), method.cfg)


def expert_lora(block):
    """{parameter name: (per-expert A stack, per-expert B stack)} of a block's fused LoRA."""
    out, experts = {}, block.experts
    while hasattr(experts, 'parameter_name'):
        a = experts.lora_A['default'].weight
        b = experts.lora_B['default'].weight
        out[experts.parameter_name] = (split_experts('x.lora_A.w', a, 6),
                                       split_experts('x.lora_B.w', b, 6))
        experts = experts.base_layer
    return out, experts


def reference_moe(block, hidden, k):
    """Top-k MoE with W_e + (α/r)·B_e A_e on every expert, written out token by token."""
    lora, base = expert_lora(block)
    x = hidden.reshape(-1, hidden.shape[-1])
    probs = F.softmax(F.linear(x, block.gate.weight), dim=-1)
    top_p, top_i = torch.topk(probs, k, dim=-1)
    weights = {}
    for name in ('gate_up_proj', 'down_proj'):
        a, b = lora[name]
        weights[name] = getattr(base, name) + (ALPHA / R) * torch.einsum('eor,eri->eoi', b, a)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for p, e in zip(top_p[t], top_i[t]):
            gate, up = (weights['gate_up_proj'][e] @ x[t]).chunk(2)
            out[t] += p * (weights['down_proj'][e] @ (F.silu(gate) * up))
    return out.reshape(hidden.shape)


@pytest.mark.parametrize('k', [4, 2, 1])
def test_forward_with_client_top_k_equals_reference_moe(tmp_path, k):
    _, model = flame_model(tmp_path, top_k=k, rescale='none')
    hidden = torch.randn(2, 5, DIMS['hidden_size'])
    for _, block in moe_blocks(model):
        assert block.gate.top_k == k
        with torch.no_grad():
            torch.testing.assert_close(block(hidden), reference_moe(block, hidden, k),
                                       rtol=1e-4, atol=1e-5)


def test_router_gets_no_lora_and_every_expert_does(tmp_path):
    _, model = flame_model(tmp_path)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert not any('.gate.' in n for n in names)
    for layer in range(DIMS['num_hidden_layers']):
        expert_keys = [n for n in names if f'layers.{layer}.mlp.experts' in n and 'lora_' in n]
        assert len(expert_keys) == 4   # A and B for gate_up_proj and down_proj
        assert all(R * DIMS['num_experts'] in p.shape for n, p in model.named_parameters()
                   if n in expert_keys)


@pytest.mark.parametrize('rescale', ['none', 'static', 'learnable'])
def test_rescaler_variants(tmp_path, rescale):
    method, model = flame_model(tmp_path, top_k=2, rescale=rescale)
    hidden = torch.randn(1, 4, DIMS['hidden_size'])
    block = moe_blocks(model)[0][1]
    if rescale == 'learnable':
        with torch.no_grad():
            block.flame_rescale.fill_(1.7)
    expected = {'none': 1.0, 'static': 4 / 2, 'learnable': 1.7}[rescale]
    with torch.no_grad():
        torch.testing.assert_close(block(hidden), expected * reference_moe(block, hidden, 2),
                                   rtol=1e-4, atol=1e-5)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and 'flame_rescale' in n]
    assert len(trainable) == (DIMS['num_hidden_layers'] if rescale == 'learnable' else 0)
    # client-local: never uploaded
    assert not any(method.is_shared(n) for n in trainable)
    shared = method.shared_tensors(model, [n for n, p in model.named_parameters() if p.requires_grad])
    assert shared and not any('flame_rescale' in n for n in shared)


def test_learnable_rescaler_per_client_is_one_scalar_that_trains(tmp_path):
    method, model = flame_model(tmp_path, top_k=1, rescaler_per='client')
    rescalers = [n for n, p in model.named_parameters() if 'flame_rescale' in n]
    assert len(rescalers) == 1
    state = method.init_client_state(model, method.cfg)
    batch = {'input_ids': torch.randint(3, 50, (2, 6)), 'attention_mask': torch.ones(2, 6)}
    batch['labels'] = batch['input_ids']
    method.loss(model, batch, state).backward()
    assert dict(model.named_parameters())[rescalers[0]].grad.abs() > 0


def test_activation_counts_match_hand_computed_routing(tmp_path):
    method, model = flame_model(tmp_path, top_k=2)
    state = method.init_client_state(model, method.cfg)
    blocks = moe_blocks(model)
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, args, i=i: seen.append((i, args[0].detach())))
             for i, (_, b) in enumerate(blocks)]
    expected = torch.zeros(len(blocks), DIMS['num_experts'])
    torch.manual_seed(3)
    steps = 3
    for _ in range(steps):
        ids = torch.randint(3, 50, (2, 7))
        mask = torch.ones(2, 7)
        mask[1, 4:] = 0          # padding: must not count
        batch = {'input_ids': ids, 'attention_mask': mask, 'labels': ids}
        seen.clear()
        method.loss(model, batch, state)
        method.after_step(model, state)
        for layer, hidden in seen:
            tokens = hidden.reshape(-1, hidden.shape[-1])[mask.reshape(-1).bool()]
            gate = blocks[layer][1].gate.weight
            chosen = torch.topk(F.softmax(tokens @ gate.T, dim=-1), 2, dim=-1).indices.unique()
            expected[layer, chosen] += 1
    for hook in hooks:
        hook.remove()
    with torch.no_grad():       # evaluation forwards are not counted
        model.eval()
        model(input_ids=torch.randint(3, 50, (2, 7)))
        model.train()
    extra = method.client_extra(model, state)
    got = torch.stack([extra[COUNTS_PREFIX + name] for name, _ in blocks])
    assert torch.equal(got, expected)
    assert float(extra[STEPS_KEY]) == steps
    assert expected.min() < steps       # some expert was not selected in every step
    assert float(method.client_extra(model, state)[STEPS_KEY]) == 0   # reset per round


def test_activation_aware_weights_formula():
    counts = torch.tensor([[4., 1., 0., 0.], [2., 0., 3., 0.], [0., 4., 1., 0.]])
    steps, sizes = [4, 4, 5], [10., 20., 30.]
    w = activation_aware_weights(counts, steps, sizes, temperature=2)
    gamma = torch.zeros(3, 4, dtype=torch.float64)
    for i in range(3):
        for j in range(3):
            gamma[i, j] = (counts[i, j].item() / steps[i]) ** 2 * sizes[i]
    torch.testing.assert_close(w[:, :3], gamma[:, :3] / gamma[:, :3].sum(0))
    assert torch.equal(w[:, 3], torch.zeros(3, dtype=torch.float64))   # never activated
    w0 = activation_aware_weights(counts, steps, sizes, temperature=0)
    fedavg = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    torch.testing.assert_close(w0[:, :3], fedavg[:, None].expand(3, 3))
    assert torch.equal(w0[:, 3], torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match='client 0'):
        activation_aware_weights([[5., 0.]], [4], [1.], 2)


def test_split_merge_matches_peft_layout():
    a = torch.randn(6 * R, 5)
    b = torch.randn(7, 6 * R)
    assert torch.equal(merge_experts('m.lora_A.w', split_experts('m.lora_A.w', a, 6)), a)
    assert torch.equal(merge_experts('m.lora_B.w', split_experts('m.lora_B.w', b, 6)), b)
    assert torch.equal(split_experts('m.lora_A.w', a, 6)[2], a[2 * R:3 * R])
    assert torch.equal(split_experts('m.lora_B.w', b, 6)[2], b[:, 2::6])


def _updates(model, method, counts_by_client, sizes):
    """Client updates with perturbed copies of the model's shared tensors."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    base = method.shared_tensors(model, names)
    blocks = [name for name, _ in moe_blocks(model)]
    updates = []
    for cid, (counts, size) in enumerate(zip(counts_by_client, sizes), start=1):
        gen = torch.Generator().manual_seed(cid)
        shared = {k: v + torch.randn(v.shape, generator=gen) for k, v in base.items()}
        extra = {COUNTS_PREFIX + b: torch.tensor(counts, dtype=torch.float32) for b in blocks}
        extra[STEPS_KEY] = torch.tensor(4.)
        updates.append(ClientUpdate(cid, size, shared, extra))
    return base, updates


def test_temperature_zero_is_fedavg_and_unactivated_expert_keeps_global(tmp_path):
    counts = [[4, 1, 0, 2, 1, 0], [2, 0, 3, 1, 4, 0]]     # expert 5: nobody
    method, model = flame_model(tmp_path, temperature=0)
    base, updates = _updates(model, method, counts, [10, 30])
    state = method.aggregate(method.init_server_state(base), updates)['global']
    fedavg = weighted_average([u.shared for u in updates], [10, 30])
    for key, value in state.items():
        if '.experts.' not in key:
            torch.testing.assert_close(value, fedavg[key], rtol=0, atol=1e-6)
            continue
        got, avg, old = (split_experts(key, t, 6) for t in (value, fedavg[key], base[key]))
        torch.testing.assert_close(got[:5], avg[:5], rtol=0, atol=1e-6)
        assert torch.equal(got[5], old[5])

    method2, _ = flame_model(tmp_path / 't2', temperature=2)
    state2 = method2.aggregate(method2.init_server_state(base), updates)['global']
    weights = activation_aware_weights(counts, [4, 4], [10, 30], 2)
    key = next(k for k in state2 if '.experts.' in k and 'lora_B' in k)
    stacks = [split_experts(key, u.shared[key], 6) for u in updates]
    for e in range(5):
        expected = weights[0, e].float() * stacks[0][e] + weights[1, e].float() * stacks[1][e]
        torch.testing.assert_close(split_experts(key, state2[key], 6)[e], expected,
                                   rtol=1e-5, atol=1e-6)
    assert torch.equal(split_experts(key, state2[key], 6)[5], split_experts(key, base[key], 6)[5])


def test_server_assigns_budget_levels_and_client_cfg_overrides(tmp_path):
    method, _ = flame_model(tmp_path)
    levels = [int(method.content_for({'global': {}}, cid)[DEFAULT_TOP_K_KEY]) for cid in range(1, 7)]
    assert levels == [8, 4, 2, 1, 8, 4]
    method_a, model_a = flame_model(tmp_path / 'a', budget_levels=[4, 3, 2, 1])
    method_a.receive(model_a, {DEFAULT_TOP_K_KEY: torch.tensor(3)}, {})
    assert all(b.gate.top_k == 3 for _, b in moe_blocks(model_a))
    method_b, model_b = flame_model(tmp_path / 'b', top_k=1)    # per-client top_k wins
    method_b.receive(model_b, {DEFAULT_TOP_K_KEY: torch.tensor(3)}, {})
    assert all(b.gate.top_k == 1 for _, b in moe_blocks(model_b))
    with pytest.raises(ConfigError, match='num_experts_per_tok 4'):
        flame_model(tmp_path / 'c', top_k=5)
    with pytest.raises(ConfigError, match='fsplug.flame.rescale'):
        flame_model(tmp_path / 'd', rescale='sometimes')


def test_client_top_k_is_used_in_evaluation(tmp_path):
    from fs_plugins.client import ClientProcedure
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.models.builders import build_model
    cfg = flame_cfg(tmp_path)
    records = {'train': [{'instruction': 'Add.', 'input': '1 2', 'output': '3'}] * 4,
               'test': [{'instruction': 'Add the numbers.', 'input': '12 30', 'output': '42'}] * 3}
    results, used = {}, {}
    for k in (8, 1):
        ccfg = client_config(cfg, {'fsplug': {'flame': {'top_k': k}}})
        method = get_method_class('flame')(ccfg)
        proc = ClientProcedure(1, ccfg, method, build_model(ccfg, method), records)
        proc.receive(method.content_for({'global': {}}, client_id=1))   # server default: 8
        widths = set()
        for _, block in moe_blocks(proc.model):
            block.gate.register_forward_hook(lambda m, i, out: widths.add(out[2].shape[-1]))
        results[k] = proc.evaluate('test')
        used[k] = widths
    assert used == {8: {8}, 1: {1}}
    assert results[8]['test_avg_loss'] != pytest.approx(results[1]['test_avg_loss'], rel=1e-4)


def test_expertwise_baseline_fits_each_expert_to_its_rank(tmp_path):
    key_a = 'm.layers.0.mlp.experts.lora_A.default.weight'
    key_b = 'm.layers.0.mlp.experts.lora_B.default.weight'
    experts = {'m.layers.0.mlp': 6}
    fused = {key_a: torch.randn(6 * 4, 5), key_b: torch.randn(7, 6 * 4), 'q.lora_A.x': torch.ones(2)}
    split = unfuse(fused, experts)
    assert split['m.layers.0.mlp.experts.expert2.lora_A.default.weight'].shape == (4, 5)
    assert torch.equal(split['m.layers.0.mlp.experts.expert2.lora_B.default.weight'],
                       fused[key_b][:, 2::6])
    assert all(torch.equal(fuse(split)[k], v) for k, v in fused.items())
    # aggregation of ranks 4 and 2: per expert, zero padding to 4 (HetLoRA), not row blocks
    cfg = load_config(write_yaml(tmp_path / 'h.yaml', deep_update(
        tiny_config(tmp_path, 'hetlora_experts'), {'fsplug': {'hetlora_experts': {
            'sparsity_weighted': False}}})))
    method = HetLoRAExperts(cfg)
    small = {key_a: torch.randn(6 * 2, 5), key_b: torch.randn(7, 6 * 2)}
    extra = {COUNTS_PREFIX + 'm.layers.0.mlp': torch.ones(6), STEPS_KEY: torch.tensor(1.)}
    big = {k: v for k, v in fused.items() if k != 'q.lora_A.x'}
    state = method.aggregate({'global': dict(big)}, [ClientUpdate(1, 1, big, extra),
                                                     ClientUpdate(2, 1, small, extra)])['global']
    a_big, a_small = split_experts(key_a, big[key_a], 6), split_experts(key_a, small[key_a], 6)
    got = split_experts(key_a, state[key_a], 6)
    torch.testing.assert_close(got[:, :2], (a_big[:, :2] + a_small) / 2)
    torch.testing.assert_close(got[:, 2:], a_big[:, 2:] / 2)


def test_embedded_run_assigns_budgets_and_keeps_rescalers_local(tmp_path):
    from fs_plugins.sim import runner as runner_mod
    cfg = flame_cfg(tmp_path)
    cfg.federate.total_round_num, cfg.train.local_update_steps = 1, 2
    captured = {}
    original = runner_mod.build_clients
    runner_mod.build_clients = lambda *a, **kw: captured.update(original(*a, **kw)) or captured
    try:
        results = runner_mod.run_embedded(cfg)
    finally:
        runner_mod.build_clients = original
    assert [moe_blocks(captured[c].model)[0][1].gate.top_k for c in (1, 2, 3, 4)] == [8, 4, 2, 1]
    scales = [float(dict(captured[c].model.named_parameters())[
        next(n for n in captured[c].trainable_names if 'flame_rescale' in n)]) for c in (1, 2, 3, 4)]
    assert len(set(scales)) == 4 and all(s != 1.0 for s in scales)   # trained, never averaged
    train = [r for r in results.rows if r['kind'] == 'train']
    assert len(train) == 4 and all(r['train_steps'] == 2 for r in train)

"""FLAME: per-client top-k with LoRA on fused experts, the rescaler variants, activation
counts, activation-aware aggregation, per-client k_i in evaluation, and the expert-wise
mixed-rank baselines. Small random OLMoE models built in memory."""
import pytest
import torch
import torch.nn.functional as F
from helpers import deep_update, tiny_config, write_yaml

from fs_plugins.aggregation import activation_aware_weights, weighted_average
from fs_plugins.aggregation.activation import activation_frequency
from fs_plugins.aggregation.experts import fuse, merge_experts, split_experts, unfuse
from fs_plugins.methods.base import ClientUpdate
from fs_plugins.methods.expertwise import HetLoRAExperts
from fs_plugins.methods.flame import COUNTS_PREFIX, DEFAULT_TOP_K_KEY, STEPS_KEY, TOTALS_PREFIX, Flame
from fs_plugins.models.olmoe import (
    EXPERT_LORA_PARAMETERS,
    PAPER_ATTENTION_LORA_MODULES,
    PAPER_EXPERT_LORA_PARAMETERS,
    lora_parameter_counts,
    random_olmoe,
    split_expert_gate_up,
)
from fs_plugins.run.config import ConfigError, client_config, load_config
from fs_plugins.tuners.flame import RoutingTracker, moe_blocks

# hidden 24 != 2 x intermediate 16, so any slip in the factor orientation fails on shapes
DIMS = dict(vocab_size=50, hidden_size=24, intermediate_size=8, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, num_experts=6, num_experts_per_tok=4,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
R, ALPHA = 3, 6


def flame_cfg(tmp_path, paper=False, **flame):
    tmp_path.mkdir(parents=True, exist_ok=True)
    lora = ({'target_modules': PAPER_ATTENTION_LORA_MODULES,
             'target_parameters': PAPER_EXPERT_LORA_PARAMETERS} if paper else
            {'target_modules': ['q_proj', 'v_proj'], 'target_parameters': EXPERT_LORA_PARAMETERS})
    raw = tiny_config(tmp_path, 'flame', fsplug={'flame': flame, 'model': {
        'builder': 'tiny_olmoe', 'lora': lora}},
                      model={'type': 'tiny-olmoe@fsplug_llm'})
    return load_config(write_yaml(tmp_path / 'flame.yaml', raw))


def olmoe_with_lora(seed=0, paper=False):
    """Random OLMoE with LoRA on every expert: fused gate_up_proj + down_proj and q, or the
    paper's placement (separate gate, up, down per expert + q, k, v, o)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    base = random_olmoe(seed=seed, **DIMS)
    if paper:
        split_expert_gate_up(base)
    model = get_peft_model(base, LoraConfig(
        r=R, lora_alpha=ALPHA,
        target_modules=PAPER_ATTENTION_LORA_MODULES if paper else ['q_proj'],
        target_parameters=PAPER_EXPERT_LORA_PARAMETERS if paper else EXPERT_LORA_PARAMETERS))
    with torch.no_grad():  # peft starts B at zero; make every expert's LoRA visible
        for name, param in model.named_parameters():
            if 'lora_B' in name:
                param.normal_(0, 0.3)
    return model


def flame_model(tmp_path, seed=0, paper=False, **flame):
    method = Flame(flame_cfg(tmp_path, paper, **flame))
    return method, method.adapt_model(olmoe_with_lora(seed, paper), method.cfg)


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
    for name, (a, b) in lora.items():   # gate_up_proj, down_proj; or gate_proj, up_proj, down_proj
        weights[name] = base._parameters[name] + (ALPHA / R) * torch.einsum('eor,eri->eoi', b, a)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for p, e in zip(top_p[t], top_i[t]):
            if 'gate_up_proj' in weights:
                gate, up = (weights['gate_up_proj'][e] @ x[t]).chunk(2)
            else:
                gate, up = weights['gate_proj'][e] @ x[t], weights['up_proj'][e] @ x[t]
            out[t] += p * (weights['down_proj'][e] @ (F.silu(gate) * up))
    return out.reshape(hidden.shape)


@pytest.mark.parametrize('paper', [False, True], ids=['fused_gate_up', 'paper_placement'])
@pytest.mark.parametrize('k', [4, 2, 1])
def test_forward_with_client_top_k_equals_reference_moe(tmp_path, k, paper):
    _, model = flame_model(tmp_path, top_k=k, rescale='none', paper=paper)
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
    """Both readings on a real model: per step, the routed slots (token) and the selected
    experts (step) of a top-k over the captured router inputs, padding excluded."""
    methods = {kind: flame_model(tmp_path / kind, top_k=2, activation=kind)
               for kind in ('token', 'step')}
    method, model = methods['step']
    state = method.init_client_state(model, method.cfg)
    blocks = moe_blocks(model)
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, args, i=i: seen.append((i, args[0].detach())))
             for i, (_, b) in enumerate(blocks)]
    steps_expected = torch.zeros(len(blocks), DIMS['num_experts'], dtype=torch.float64)
    slots_expected = torch.zeros(len(blocks), DIMS['num_experts'], dtype=torch.float64)
    torch.manual_seed(3)
    steps, tokens = 3, 0
    for _ in range(steps):
        ids = torch.randint(3, 50, (2, 7))
        mask = torch.ones(2, 7)
        mask[1, 4:] = 0          # padding: must not count
        tokens += int(mask.sum())
        batch = {'input_ids': ids, 'attention_mask': mask, 'labels': ids}
        seen.clear()
        method.loss(model, batch, state)
        method.after_step(model, state)
        for layer, hidden in seen:
            hidden = hidden.reshape(-1, hidden.shape[-1])[mask.reshape(-1).bool()]
            gate = blocks[layer][1].gate.weight
            chosen = torch.topk(F.softmax(hidden @ gate.T, dim=-1), 2, dim=-1).indices
            steps_expected[layer, chosen.unique()] += 1
            slots_expected[layer] += torch.bincount(chosen.reshape(-1), minlength=DIMS['num_experts'])
    for hook in hooks:
        hook.remove()
    with torch.no_grad():       # evaluation forwards are not counted
        model.eval()
        model(input_ids=torch.randint(3, 50, (2, 7)))
        model.train()
    tracker = model.flame_routing
    snapshot = (tracker.token_counts.clone(), tracker.token_totals.clone(),
                tracker.step_counts.clone(), tracker.steps)
    extra = method.client_extra(model, state)            # step reading
    got = torch.stack([extra[COUNTS_PREFIX + name] for name, _ in blocks])
    assert torch.equal(got, steps_expected)
    assert all(float(extra[TOTALS_PREFIX + name]) == steps for name, _ in blocks)
    assert float(extra[STEPS_KEY]) == steps
    assert steps_expected.min() < steps       # some expert was not selected in every step
    assert float(method.client_extra(model, state)[STEPS_KEY]) == 0   # reset per round
    # the token reading of the same round
    (tracker.token_counts, tracker.token_totals, tracker.step_counts, tracker.steps) = snapshot
    token_method = methods['token'][0]
    extra = token_method.client_extra(model, state)
    got = torch.stack([extra[COUNTS_PREFIX + name] for name, _ in blocks])
    assert torch.equal(got, slots_expected)
    assert all(float(extra[TOTALS_PREFIX + name]) == tokens * 2 for name, _ in blocks)
    metrics = token_method.client_metrics(model, state)
    freq = slots_expected / (tokens * 2)
    assert metrics['flame_top_k'] == 2.0
    assert metrics['flame_freq_max'] == pytest.approx(freq.max(dim=1).values.mean().item())
    assert metrics['flame_freq_min'] == pytest.approx(freq.min(dim=1).values.mean().item())


class FixedRouter(torch.nn.Module):
    """A router whose selected experts are given (output as OlmoeTopKRouter's)."""
    def __init__(self, num_experts, top_k):
        super().__init__()
        self.num_experts, self.top_k, self.indices = num_experts, top_k, None

    def forward(self, hidden):
        return None, None, self.indices


class FixedMoE(torch.nn.Module):
    def __init__(self, num_experts=4, top_k=2):
        super().__init__()
        self.gate, self.experts = FixedRouter(num_experts, top_k), torch.nn.Identity()


def test_token_frequencies_from_fixed_routing_with_padding():
    blocks = [('l0', FixedMoE()), ('l1', FixedMoE())]
    tracker = RoutingTracker(blocks)
    routes = [  # step 1: 3 tokens (last one padding); step 2: 2 tokens
        (torch.tensor([1, 1, 0]), [torch.tensor([[0, 1], [0, 2], [3, 2]]),
                                   torch.tensor([[1, 2], [1, 2], [0, 0]])]),
        (torch.tensor([1, 1]), [torch.tensor([[0, 1], [0, 1]]), torch.tensor([[3, 1], [3, 2]])]),
    ]
    for mask, indices in routes:
        tracker.start_step(mask)
        for (_, block), idx in zip(blocks, indices):
            block.gate.indices = idx
            block.gate(torch.zeros(len(mask), 1))
        tracker.end_step()
    tracker.start_step(torch.ones(2))       # an uncommitted step (e.g. non-finite loss)
    blocks[0][1].gate.indices = torch.tensor([[3, 3], [3, 3]])
    blocks[0][1].gate(torch.zeros(2, 1))
    round_ = tracker.take_round()
    # by hand: l0 slots expert 0: 2 + 2, expert 1: 1 + 2, expert 2: 1, expert 3: 0 (padding)
    counts, totals = round_.reading('token')
    assert counts['l0'].tolist() == [4, 3, 1, 0] and float(totals['l0']) == 8
    assert counts['l1'].tolist() == [0, 3, 3, 2] and float(totals['l1']) == 8
    torch.testing.assert_close(activation_frequency(counts['l0'], totals['l0']),
                               torch.tensor([[0.5, 0.375, 0.125, 0.0]], dtype=torch.float64))
    counts, totals = round_.reading('step')         # as before: activated steps / S_i
    assert counts['l0'].tolist() == [2, 2, 1, 0] and float(totals['l0']) == 2 == round_.steps
    assert counts['l1'].tolist() == [0, 2, 2, 1]
    assert tracker.take_round().steps == 0


def test_activation_aware_weights_formula():
    counts = torch.tensor([[4., 1., 0., 0.], [2., 0., 3., 0.], [0., 4., 1., 0.]])
    totals, sizes = [4, 4, 5], [10., 20., 30.]
    freq = activation_frequency(counts, totals)
    torch.testing.assert_close(freq, counts.double() / torch.tensor(totals).double()[:, None])
    w = activation_aware_weights(freq, sizes, temperature=2)
    gamma = torch.zeros(3, 4, dtype=torch.float64)
    for i in range(3):
        for j in range(3):
            gamma[i, j] = (counts[i, j].item() / totals[i]) ** 2 * sizes[i]
    torch.testing.assert_close(w[:, :3], gamma[:, :3] / gamma[:, :3].sum(0))
    assert torch.equal(w[:, 3], torch.zeros(3, dtype=torch.float64))   # never activated
    w0 = activation_aware_weights(freq, sizes, temperature=0)
    fedavg = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    torch.testing.assert_close(w0[:, :3], fedavg[:, None].expand(3, 3))
    assert torch.equal(w0[:, 3], torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match='client 0'):
        activation_frequency([[5., 0.]], [4])
    with pytest.raises(ValueError, match=r'\[0, 1\]'):
        activation_aware_weights([[1.5, 0.]], [1.], 2)
    assert torch.equal(activation_frequency([[0., 0.]], [0]), torch.zeros(1, 2, dtype=torch.float64))


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
        extra = {COUNTS_PREFIX + b: torch.tensor(counts, dtype=torch.float64) for b in blocks}
        extra.update({TOTALS_PREFIX + b: torch.tensor(4., dtype=torch.float64) for b in blocks})
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
    weights = activation_aware_weights(activation_frequency(counts, [4, 4]), [10, 30], 2)
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
    from fs_plugins.methods.building import build_model
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.run.client import ClientProcedure
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
            block.gate.register_forward_hook(
                lambda m, i, out, widths=widths: widths.add(out[2].shape[-1]))
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


RECORDS = {'train': [{'instruction': f'Add {i} and {i + 1}.', 'input': '', 'output': str(2 * i + 1)}
                     for i in range(8)],
           'test': [{'instruction': 'Add the numbers.', 'input': '12 30', 'output': '42'}] * 2}


def client_of(cfg, cid=1, overrides=None):
    from fs_plugins.methods.building import build_model
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.run.client import ClientProcedure
    ccfg = client_config(cfg, overrides)
    method = get_method_class(ccfg.fsplug.method)(ccfg)
    return ClientProcedure(cid, ccfg, method, build_model(ccfg, method), RECORDS)


def test_learnable_rescaler_trains_in_float32_over_bfloat16_base(tmp_path):
    cfg = flame_cfg(tmp_path, paper=True)
    cfg.fsplug.model.dtype = 'bfloat16'
    cfg.train.local_update_steps = 3
    proc = client_of(cfg, overrides={'fsplug': {'flame': {'top_k': 2}}})
    scales = {n: p for n, p in proc.model.named_parameters() if 'flame_rescale' in n}
    assert len(scales) == 2 and all(p.dtype == torch.float32 and p.requires_grad
                                    for p in scales.values())
    assert {p.dtype for n, p in proc.model.named_parameters() if 'lora_' not in n
            and 'flame_rescale' not in n} == {torch.bfloat16}
    update = proc.run_round(0)
    assert update.metrics['train_steps'] == 3
    for name, param in scales.items():
        assert param.dtype == torch.float32
        assert abs(float(param.detach()) - 1.0) > 1e-3, name     # trained (AdamW lr 0.01, 3 steps)
    assert not any('flame_rescale' in n for n in update.shared)


def test_split_gate_up_keeps_the_forward_and_peft_wraps_each_projection(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    model = random_olmoe(seed=0, **DIMS)
    ids = torch.randint(3, 50, (2, 6))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        fused = model.model.layers[0].mlp.experts.gate_up_proj.clone()
    assert split_expert_gate_up(model) == DIMS['num_hidden_layers']
    experts = model.model.layers[0].mlp.experts
    assert 'gate_up_proj' not in dict(experts.named_parameters())
    assert torch.equal(experts.gate_up_proj, fused)                 # read-only concatenation
    assert experts.gate_proj.shape == experts.up_proj.shape == (6, 8, 24)
    with torch.no_grad():
        for impl in ('eager', 'batched_mm'):     # transformers' own expert forwards, unchanged
            model.set_experts_implementation(impl)
            torch.testing.assert_close(model(input_ids=ids).logits, before)
    model.set_experts_implementation('eager')
    config = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=PAPER_ATTENTION_LORA_MODULES,
                        target_parameters=PAPER_EXPERT_LORA_PARAMETERS)
    peft_model = get_peft_model(model, config)
    # nested ParamWrappers, outermost first (peft sorts the targets): up, gate, down
    wrapper, order = peft_model.base_model.model.model.layers[0].mlp.experts, []
    while hasattr(wrapper, 'parameter_name'):
        order.append(wrapper.parameter_name)
        wrapper = wrapper.base_layer
    assert order == ['up_proj', 'gate_proj', 'down_proj']
    names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    prefix = 'base_model.model.model.layers.0.mlp.experts.'
    assert {n[len(prefix):] for n in names if n.startswith(prefix)} == {
        f'{nest}lora_{f}.default.weight' for nest in ('', 'base_layer.', 'base_layer.base_layer.')
        for f in 'AB'}
    # adapter save / load onto a freshly split base gives the same outputs
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if 'lora_B' in name:
                param.normal_(0, 0.3)
        adapted = peft_model(input_ids=ids).logits
    peft_model.save_pretrained(tmp_path / 'adapter')
    fresh = random_olmoe(seed=0, **DIMS)
    split_expert_gate_up(fresh)
    fresh.set_experts_implementation('eager')
    loaded = PeftModel.from_pretrained(fresh, tmp_path / 'adapter')
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, adapted)
    assert not torch.allclose(adapted, before)


def paper_counts(dims, r, k):
    """Table 1's formula: per layer, r·(in + out) for gate, up, down of each of E experts (k
    active) and for q, k, v, o."""
    h, i, e = dims['hidden_size'], dims['intermediate_size'], dims['num_experts']
    kv = dims['num_key_value_heads'] * h // dims['num_attention_heads']
    expert = 3 * r * (h + i)
    attention = r * ((h + h) + 2 * (h + kv) + (h + h))
    layers = dims['num_hidden_layers']
    return layers * (e * expert + attention), layers * (k * expert + attention)


@pytest.mark.parametrize('kv_heads', [2, 1])
def test_paper_placement_parameter_counts_match_table1_formula(kv_heads):
    dims = {**DIMS, 'num_key_value_heads': kv_heads}
    with torch.device('meta'):
        model = random_olmoe(seed=0, **dims)
    from peft import LoraConfig, get_peft_model
    split_expert_gate_up(model)
    model = get_peft_model(model, LoraConfig(
        r=R, lora_alpha=ALPHA, target_modules=PAPER_ATTENTION_LORA_MODULES,
        target_parameters=PAPER_EXPERT_LORA_PARAMETERS))
    for k in (4, 2, 1):
        assert lora_parameter_counts(model, k) == paper_counts(dims, R, k)


@pytest.mark.slow
@pytest.mark.parametrize('method', ['flame', 'hetlora_experts', 'flexlora_experts'])
def test_paper_placement_runs_and_aggregates_per_expert(tmp_path, method):
    """One embedded round on the tiny OLMoE with separate gate / up / down expert LoRA: the
    builder splits, FLAME aggregates per expert, the expert-wise baselines fit each expert."""
    from helpers import run_embedded_keeping_clients
    cfg = flame_cfg(tmp_path, paper=True)
    cfg.fsplug.method = method
    cfg.federate.total_round_num, cfg.train.local_update_steps = 1, 2
    ranks = {f'client_{c}': {'fsplug': {'model': {'lora': {'r': r}}}}
             for c, r in zip((1, 2, 3, 4), (8, 5, 3, 2))} if method != 'flame' else None
    results, clients = run_embedded_keeping_clients(cfg, ranks)
    model = clients[4].model
    names = [n for n in clients[4].trainable_names if '.experts.' in n]
    assert len(names) == 6 * 2        # 3 projections x (A, B) x 2 layers
    experts = [m for n, m in model.named_modules() if n.endswith('mlp.experts')][0]
    while hasattr(experts, 'parameter_name'):
        experts = experts.base_layer
    assert {'gate_proj', 'up_proj', 'down_proj'} <= set(dict(experts.named_parameters()))
    if method != 'flame':             # client 4 holds rank 2 per expert: (E·2, in)
        a = dict(model.named_parameters())[next(n for n in names if 'lora_A' in n)]
        assert a.shape[0] == 16 * 2
    train = [r for r in results.rows if r['kind'] == 'train']
    assert len(train) == 4
    evals = [r for r in results.rows if r['kind'] == 'eval']
    assert len(evals) == 4 and all(torch.isfinite(torch.tensor(r['test_avg_loss'])) for r in evals)


def test_client_groups_by_budget_level_and_summary_rows(tmp_path):
    from fs_plugins.run.results import ResultsLog
    method, _ = flame_model(tmp_path)
    assert method.client_groups([1, 2, 3, 4, 5, 6]) == {
        'β1 (k=8)': [1, 5], 'β2 (k=4)': [2, 6], 'β3 (k=2)': [3], 'β4 (k=1)': [4]}
    log = ResultsLog(str(tmp_path / 'res'), {'client_names': {}})
    for cid, acc in zip(range(1, 7), (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)):
        log.log_train(0, cid, 4, 10, 10, {'train_avg_loss': 1.0})
        log.log_eval(0, cid, {'test_token_acc': acc})
    log.client_groups = method.client_groups
    _, table = log.final_rows()
    rows = {r['client']: r for r in table}
    assert rows['β1 (k=8): mean of clients 1, 5']['test_token_acc'] == pytest.approx(0.3)
    assert rows['β4 (k=1): mean of clients 4']['test_token_acc'] == pytest.approx(0.4)
    assert rows['average']['test_token_acc'] == pytest.approx(0.35)     # over clients only
    assert [r['client'] for r in table][-1] == 'average'
    summary = log.close()
    assert 'β2 (k=4): mean of clients 2, 6' in summary


def test_tiny_dense_olmo_builder_with_lora_on_every_linear_layer(tmp_path):
    from fs_plugins.methods.building import build_model
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.models.olmo import DENSE_LORA_MODULES
    raw = tiny_config(tmp_path, 'hetlora', fsplug={'model': {
        'builder': 'tiny_olmo', 'lora': {'r': 4, 'target_modules': DENSE_LORA_MODULES}}},
                      model={'type': 'tiny-olmo@fsplug_llm'})
    cfg = load_config(write_yaml(tmp_path / 'dense.yaml', raw))
    built = build_model(cfg, get_method_class('hetlora')(cfg))
    assert type(built.model.base_model.model).__name__ == 'OlmoForCausalLM'
    trainable = {n: p.numel() for n, p in built.model.named_parameters() if p.requires_grad}
    h, i, layers = 64, 256, 2
    assert sum(trainable.values()) == layers * 4 * (4 * (h + h) + 3 * (h + i))
    ids = torch.randint(3, 50, (1, 5))
    assert torch.isfinite(built.model(input_ids=ids, labels=ids).loss)


def test_router_with_lora_is_still_found_and_set(tmp_path):
    """LoRA on the router (target_parameters 'mlp.gate.weight') wraps it; FLAME still finds it,
    sets k_i on it and counts its selections."""
    from peft import LoraConfig, get_peft_model
    base = random_olmoe(seed=0, **DIMS)
    model = get_peft_model(base, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=['q_proj'],
                                            target_parameters=EXPERT_LORA_PARAMETERS + ['mlp.gate.weight']))
    assert any('mlp.gate.lora_A' in n for n, _ in model.named_parameters())
    method = Flame(flame_cfg(tmp_path, top_k=1, activation='token'))
    model = method.adapt_model(model, method.cfg)
    assert len(moe_blocks(model)) == DIMS['num_hidden_layers']
    state = method.init_client_state(model, method.cfg)
    ids = torch.randint(3, 50, (2, 5))
    method.loss(model, {'input_ids': ids, 'labels': ids}, state)
    method.after_step(model, state)
    extra = method.client_extra(model, state)
    totals = [float(v) for k, v in extra.items() if k.startswith(TOTALS_PREFIX)]
    assert totals == [10.0, 10.0]           # 10 tokens x k_i = 1
    assert lora_parameter_counts(model, 1)[0] > lora_parameter_counts(model, 1)[1]

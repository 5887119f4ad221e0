"""SmartFed (MoRE + EEQA) and the LoRA-reuse baselines: the rank-1 decomposition, sparse
dispatch, what trains, the federated EEQA flow, the baselines' formulas and bad adapters."""
import json
import shutil

import pytest
import torch
from helpers import run_embedded_keeping_clients, tiny_yaml_of

from fs_plugins.aggregation import eeqa_quota
from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.base import ClientUpdate
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.config import load_config
from fs_plugins.tuners.library import dense_rank_mixture, load_library, rank_one_mixture, stacked_factors
from fs_plugins.tuners.library.adapters import resolve_path

LIBRARY = ['builtin:tiny-a', 'builtin:tiny-b']


def config(tmp_path, method='smartfed', *overrides):
    return load_config(tiny_yaml_of(method), [
        'federate.total_round_num', '2', 'train.local_update_steps', '2',
        'data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
        'fsplug.results_dir', str(tmp_path / 'results'), *overrides])


def built(tmp_path, method='smartfed', *overrides):
    cfg = config(tmp_path, method, *overrides)
    method_obj = get_method_class(method)(cfg)
    return cfg, method_obj, build_model(cfg, method_obj, share_frozen=False)


def batch_of(size=2):
    torch.manual_seed(0)
    ids = torch.randint(4, 300, (size, 12))
    return {'input_ids': ids, 'attention_mask': torch.ones_like(ids), 'labels': ids}


# ------------------------------------------------------------------ MoRE maths
def test_rank_one_experts_with_weight_one_reproduce_the_full_loras():
    from transformers import AutoModelForCausalLM

    from fs_plugins.models.tiny import ensure_tiny_llama
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama())
    library = load_library(LIBRARY, base)
    name = 'model.layers.0.self_attn.q_proj'    # both adapters target it
    A, B, owner = stacked_factors(library, name)
    x = torch.randn(5, A.shape[1])
    full = sum(x @ (adapter.modules[name].B @ adapter.modules[name].A).t() for adapter in library)
    every = torch.arange(A.shape[0]).expand(5, -1)
    sparse = rank_one_mixture(x, torch.ones(5, A.shape[0]), every, A, B.t().contiguous())
    assert torch.allclose(sparse, full, atol=1e-6)
    assert torch.allclose(dense_rank_mixture(x, torch.ones(A.shape[0]), A, B.t()), full, atol=1e-6)
    # one adapter's experts alone give that adapter's LoRA
    first = torch.nonzero(owner == 0).flatten().expand(5, -1)
    alone = rank_one_mixture(x, torch.ones(first.shape), first, A, B.t().contiguous())
    lora = library[0].modules[name]
    assert torch.allclose(alone, x @ (lora.B @ lora.A).t(), atol=1e-6)


def test_library_factors_match_peft_loading_the_same_folders(tmp_path):
    """Every expert at weight 1 on every layer = peft with both library adapters active."""
    from peft import PeftModel
    cfg, method, model = built(tmp_path, 'smartfed', 'fsplug.smartfed.router_init_std', '0',
                               'fsplug.smartfed.budget', '4', 'fsplug.smartfed.quota_cap', '8')
    for layer in model.model.library_layers.values():   # zero router: uniform gates x q = 1 each
        layer.quota = layer.num_experts
    from transformers import AutoModelForCausalLM

    from fs_plugins.models.tiny import ensure_tiny_llama
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ensure_tiny_llama()),
                                          resolve_path(LIBRARY[0]), adapter_name='a')
    reference.load_adapter(resolve_path(LIBRARY[1]), adapter_name='b')
    reference.base_model.set_adapter(['a', 'b'])
    batch = batch_of()
    with torch.no_grad():
        ours = model.model(input_ids=batch['input_ids']).logits
        theirs = reference(input_ids=batch['input_ids']).logits
    assert torch.allclose(ours, theirs, atol=1e-4)


def test_sparse_dispatch_gradients_match_autograd_of_the_dense_formula():
    torch.manual_seed(0)
    T, E, d, o, q = 7, 6, 5, 4, 3
    x = torch.randn(T, d, dtype=torch.float64, requires_grad=True)
    A, B_t = torch.randn(E, d, dtype=torch.float64), torch.randn(E, o, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E)[:q] for _ in range(T)]).sort(dim=1).values
    w = torch.randn(T, q, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rank_one_mixture(x, w, idx, A, B_t), (x, w))
    dense_w = torch.zeros(T, E, dtype=torch.float64).scatter(1, idx, w.detach())
    assert torch.allclose(rank_one_mixture(x, w, idx, A, B_t), dense_rank_mixture(x, dense_w, A, B_t))


@pytest.mark.parametrize('router_input', ['hidden', 'experts'])
def test_only_the_routers_train_and_have_gradients(tmp_path, router_input):
    cfg, method, model = built(tmp_path, 'smartfed', 'fsplug.smartfed.router_input', router_input)
    assert model.trainable_names and all(n.endswith('.library.router') for n in model.trainable_names)
    loss = method.loss(model.model, batch_of(), method.init_client_state(model.model, cfg))
    loss.backward()
    with_grad = {n for n, p in model.model.named_parameters() if p.grad is not None}
    assert with_grad == set(model.trainable_names)
    assert not any('library.A' in n or 'library.B' in n for n, _ in model.model.named_parameters())
    layer = next(iter(model.model.library_layers.values()))
    width = layer.in_features if router_input == 'hidden' else layer.num_experts
    assert layer.router.shape == (layer.num_experts, width)


@pytest.mark.parametrize('router_input', ['experts', 'hidden'])
def test_the_top_q_selection_is_what_runs(tmp_path, router_input):
    """A layer's output equals the dense formula masked to its router's top-q experts; the
    'experts' router scores them from their own activations A x (W_router = W_r A)."""
    cfg, method, model = built(tmp_path, 'smartfed', 'fsplug.smartfed.budget', '3',
                               'fsplug.smartfed.router_input', router_input)
    layer = model.model.library_layers['model.layers.0.self_attn.q_proj']
    x = torch.randn(2, 3, layer.in_features)
    flat = x.reshape(-1, layer.in_features)
    scorer = layer.router @ layer.A if router_input == 'experts' else layer.router
    logits = flat @ scorer.t()
    top, idx = logits.topk(3, dim=-1)
    mask = torch.zeros_like(logits).scatter(1, idx, top.softmax(-1) * 3)
    expected = dense_rank_mixture(flat, mask, layer.A, layer.B_t)
    assert torch.allclose(layer(x).reshape(-1, layer.out_features), expected, atol=1e-5)
    layer.quota = 0
    assert not layer(x).any()


def test_the_default_router_is_the_lightweight_one(tmp_path):
    """router_input 'experts' by default: W_r is E_j × E_j (E_j² parameters per matrix)."""
    _, method, model = built(tmp_path, 'smartfed')
    assert method.hparams.router_input == 'experts'
    for layer in model.model.library_layers.values():
        assert layer.router.shape == (layer.num_experts, layer.num_experts)


# ----------------------------------------------------------------- EEQA flow
def test_server_allocates_eeqa_quotas_from_the_clients_importance(tmp_path):
    cfg, method, model = built(tmp_path, 'smartfed', 'fsplug.smartfed.budget', '2')
    shared = method.shared_tensors(model.model, model.trainable_names)
    state = method.init_server_state(shared)
    J = len(state['routers'])
    imp_1, imp_2 = torch.rand(J, dtype=torch.float64), torch.rand(J, dtype=torch.float64)
    updates = [ClientUpdate(1, 10, shared, {'smartfed.importance': imp_1}),
               ClientUpdate(2, 30, shared, {'smartfed.importance': imp_2})]
    state = method.aggregate(state, updates)
    assert state['caps'] == state['pools']          # M_j = each matrix's own pool by default
    expected = eeqa_quota(((10 * imp_1 + 30 * imp_2) / 40).tolist(), 2 * J, state['pools'])
    assert state['quota'].tolist() == expected
    content = method.content_for(state, 1)
    assert content['smartfed.quota'].tolist() == expected
    method.receive(model.model, content, {'quota_set': False})
    layers = [model.model.library_layers[r[:-len('.library.router')]] for r in state['routers']]
    assert [layer.quota for layer in layers] == expected


def test_a_federated_run_applies_eeqa_after_the_warm_up(tmp_path):
    cfg = config(tmp_path, 'smartfed', 'fsplug.smartfed.budget', '3')
    results, clients = run_embedded_keeping_clients(cfg)
    train = [r for r in results.rows if r['kind'] == 'train']
    assert {r['activated_rank'] for r in train if r['round'] == 0} == {3.0}
    for proc in clients.values():
        quotas = [layer.quota for layer in proc.model.library_layers.values()]
        assert sum(quotas) == 3 * len(quotas) and len(set(quotas)) > 1   # elastic, same budget
        assert proc.state['quota_set']
    assert len({tuple(layer.quota for layer in p.model.library_layers.values())
                for p in clients.values()}) == 1                        # one allocation for all


def test_without_eeqa_every_matrix_keeps_quota_k(tmp_path):
    cfg = config(tmp_path, 'smartfed', 'fsplug.smartfed.budget', '3', 'fsplug.smartfed.eeqa', 'False')
    _, clients = run_embedded_keeping_clients(cfg)
    assert {layer.quota for p in clients.values() for layer in p.model.library_layers.values()} == {3}


def test_smartfed_sends_routers_only_far_fewer_bytes_with_the_experts_router(tmp_path):
    _, method, model = built(tmp_path, 'smartfed', 'fsplug.smartfed.router_input', 'experts')
    sent = method.shared_tensors(model.model, model.trainable_names)
    assert all(n.endswith('.library.router') for n in sent)
    lora_bytes = sum(4 * f.A.numel() + 4 * f.B.numel()
                     for f in load_library(LIBRARY[:1], model.model).pop().modules.values())
    assert sum(4 * t.numel() for t in sent.values()) < lora_bytes


# ------------------------------------------------------- EEQA's cap M and budget K
def test_the_default_cap_leaves_eeqa_following_importance(tmp_path):
    """The tiny library's pools are 8 (q, v: both LoRAs) and 4 (up, down: one LoRA). The old
    default M = the smallest pool = 4 = K made every q_j = 4 whatever the importance; M_j =
    each matrix's pool lets important matrices take up to 8 and others fewer."""
    from fs_plugins.aggregation.eeqa import eeqa_is_forced
    cfg, method, model = built(tmp_path, 'smartfed')          # budget 4, quota_cap 0
    shared = method.shared_tensors(model.model, model.trainable_names)
    state = method.init_server_state(shared)
    J = len(state['routers'])
    assert sorted(set(state['caps'])) == [4, 8] and state['per_matrix'] == 4
    assert eeqa_is_forced(4 * J, 4, J) and not eeqa_is_forced(4 * J, state['caps'], J)
    importance = torch.linspace(1.0, 8.0, J, dtype=torch.float64)    # not uniform
    state = method.aggregate(state, [ClientUpdate(1, 10, shared, {'smartfed.importance': importance})])
    quota = state['quota'].tolist()
    assert sum(quota) == 4 * J and len(set(quota)) > 1 and max(quota) > 4
    assert all(q <= cap for q, cap in zip(quota, state['caps']))


def test_a_cap_that_makes_eeqa_uniform_is_refused_naming_both_keys(tmp_path):
    for cap in ('4', '2'):
        with pytest.raises(ConfigError) as info:
            config(tmp_path, 'smartfed', 'fsplug.smartfed.budget', '4', 'fsplug.smartfed.quota_cap', cap)
        message = str(info.value)
        assert 'fsplug.smartfed.quota_cap' in message and 'fsplug.smartfed.budget' in message
        assert 'uniform' in message
    config(tmp_path, 'smartfed', 'fsplug.smartfed.budget', '4', 'fsplug.smartfed.quota_cap', '5')
    config(tmp_path, 'smartfed', 'fsplug.smartfed.quota_cap', '4', 'fsplug.smartfed.eeqa', 'False')


def test_a_budget_that_fills_every_pool_is_warned_about(tmp_path, caplog):
    """K = 8 on pools of 8 and 4: B = 8·J is more than the pools hold: EEQA cannot differ."""
    _, method, model = built(tmp_path, 'smartfed', 'fsplug.smartfed.budget', '8')
    with caplog.at_level('WARNING', logger='fs_plugins.methods.smartfed'):
        method.init_server_state(method.shared_tensors(model.model, model.trainable_names))
    assert any('fsplug.smartfed.budget' in r.message and 'fsplug.smartfed.quota_cap' in r.message
               for r in caplog.records), caplog.text


# ------------------------------------------------------- router-only communication
def test_the_audit_sees_only_routers_leave_the_client(tmp_path):
    """fs_plugins.run.audit on the tiny federation: every uploaded tensor is a router, every
    router trains, the only extra payload is the warm-up importance, and the contract holds."""
    from fs_plugins.run.audit import audit, format_report
    report = audit(config(tmp_path, 'smartfed'))
    assert not report.problems, format_report(report)
    uploaded = [g for g in report.rows if g.up_tensors]
    assert uploaded and all(g.group.endswith('.library.router') for g in uploaded)
    assert all(g.grad_max and g.changed and g.server == {'averaged'} for g in uploaded)
    assert set(report.extra_bytes) == {'smartfed.importance'}
    assert report.totals['up_bytes'] < report.fedavg['up_bytes']


def test_a_non_router_upload_breaks_the_contract(tmp_path, monkeypatch):
    from fs_plugins.run.audit import audit
    smartfed = get_method_class('smartfed')
    original = smartfed.shared_tensors

    def leaky(self, model, names):
        return {**original(self, model, names),
                'model.norm.weight': dict(model.named_parameters())['model.norm.weight'].detach().clone()}
    monkeypatch.setattr(smartfed, 'shared_tensors', leaky)
    problems = audit(config(tmp_path, 'smartfed')).problems
    assert any('model.norm.weight' in p and 'declared local' in p for p in problems), problems


def test_training_anything_but_the_routers_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from fs_plugins.models.tiny import ensure_tiny_llama
    cfg = config(tmp_path, 'smartfed')
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama()).requires_grad_(False)
    base.model.norm.weight.requires_grad_(True)   # as a builder's train_projector would
    with pytest.raises(ConfigError, match='train_projector'):
        get_method_class('smartfed')(cfg).adapt_model(base, cfg)


def test_a_shape_only_library_sizes_but_never_trains(tmp_path):
    with pytest.raises(ConfigError, match='fs-plugins estimate'):
        built(tmp_path, 'smartfed', 'fsplug.model.library.adapters', "['shape:r4:q_proj,v_proj']")
    with pytest.raises(ConfigError, match="shape:r<rank>"):
        from fs_plugins.models.builders import architecture_only
        with architecture_only(device='meta'):
            built(tmp_path, 'smartfed', 'fsplug.model.library.adapters', "['shape:four:q_proj']")


# ------------------------------------------------------------ "w/o MoRE"
def test_without_more_whole_loras_are_the_experts(tmp_path):
    """expert_granularity module: the router scores the LoRAs on a matrix (2 rows on q, v; no
    router on up, down, which one LoRA targets: it always runs); K = 4 = one r = 4 LoRA, so
    each token runs its top-1 LoRA whole, at gate N · softmax over both LoRAs (1 when uniform),
    and the router learns."""
    cfg, method, model = built(tmp_path, 'smartfed', 'fsplug.smartfed.expert_granularity', 'module')
    layers = model.model.library_layers
    q_proj = layers['model.layers.0.self_attn.q_proj']
    assert q_proj.router.shape == (2, q_proj.num_experts) and q_proj.quota == 1
    assert layers['model.layers.0.mlp.up_proj'].router is None
    assert all(n.endswith('.library.router') and ('q_proj' in n or 'v_proj' in n)
               for n in model.trainable_names)
    assert method.activated_rank(model.model) == 4.0
    torch.nn.init.normal_(q_proj.router, std=1.0)
    factors = [a.modules['model.layers.0.self_attn.q_proj'] for a in load_library(LIBRARY, model.model)]
    x = torch.randn(6, q_proj.in_features)
    probs = 2 * (x @ (q_proj.router @ q_proj.A).t()).softmax(-1)
    choice = probs.argmax(-1)
    expected = torch.stack([probs[t, c] * x[t] @ (factors[int(c)].B @ factors[int(c)].A).t()
                            for t, c in enumerate(choice)])
    assert torch.allclose(q_proj(x), expected, atol=1e-5)
    up = layers['model.layers.0.mlp.up_proj']
    only = load_library(LIBRARY[:1], model.model)[0].modules['model.layers.0.mlp.up_proj']
    assert torch.allclose(up(x[:, :up.in_features]), x @ (only.B @ only.A).t(), atol=1e-5)
    loss = method.loss(model.model, batch_of(), method.init_client_state(model.model, cfg))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for n, p in model.model.named_parameters() if n in model.trainable_names)


def test_without_more_unequal_ranks_use_the_dense_masked_formula():
    from fs_plugins.tuners.library import RankWiseExperts
    torch.manual_seed(0)
    A, B = torch.randn(5, 6), torch.randn(4, 5)
    owner = torch.tensor([0, 0, 0, 1, 1])                   # ranks 3 and 2
    layer = RankWiseExperts(A, B, owner, quota=1, router_init_std=1.0, router_input='hidden',
                            granularity='module')
    x = torch.randn(7, 6)
    probs = 2 * (x @ layer.router.t()).softmax(-1)
    choice = probs.argmax(-1)
    parts = [(A[:3], B[:, :3]), (A[3:], B[:, 3:])]
    expected = torch.stack([probs[t, c] * x[t] @ (parts[int(c)][1] @ parts[int(c)][0]).t()
                            for t, c in enumerate(choice)])
    assert torch.allclose(layer(x), expected, atol=1e-5)
    assert layer.activated_rank == 2.5                      # one LoRA of mean rank 2.5


def test_without_more_eeqa_allocates_whole_loras(tmp_path):
    cfg = config(tmp_path, 'smartfed', 'fsplug.smartfed.expert_granularity', 'module')
    _, clients = run_embedded_keeping_clients(cfg)
    for proc in clients.values():
        routed = [layer for layer in proc.model.library_layers.values() if layer.router is not None]
        quotas = [layer.quota for layer in routed]
        assert sum(quotas) == len(routed) and set(quotas) <= {0, 1, 2}   # B = 1 LoRA per matrix
        assert proc.state['quota_set']


def test_without_more_needs_a_budget_of_whole_loras(tmp_path):
    with pytest.raises(ConfigError, match='divides fsplug.smartfed.budget = 3'):
        built(tmp_path, 'smartfed', 'fsplug.smartfed.expert_granularity', 'module',
              'fsplug.smartfed.budget', '3')


# ------------------------------------------------------------------ baselines
def test_merged_library_is_eq3_with_cross_terms(tmp_path):
    cfg, method, model = built(tmp_path, 'linear_arithmetic')
    name = 'model.layers.0.self_attn.q_proj'
    layer = model.model.library_layers[name]
    lam = torch.tensor([0.7, -0.4])
    model.model.library_weights.weight.data.copy_(lam)
    factors = [a.modules[name] for a in load_library(LIBRARY, model.model)]
    B = lam[0] * factors[0].B + lam[1] * factors[1].B
    A = lam[0] * factors[0].A + lam[1] * factors[1].A
    x = torch.randn(4, layer.in_features)
    assert torch.allclose(layer(x), x @ (B @ A).t(), atol=1e-6)
    # a layer only one adapter targets merges that adapter alone
    up = model.model.library_layers['model.layers.0.mlp.up_proj']
    only = [a.modules['model.layers.0.mlp.up_proj'] for a in load_library(LIBRARY[:1], model.model)][0]
    xu = torch.randn(4, up.in_features)
    assert torch.allclose(up(xu), xu @ ((lam[0] * only.B) @ (lam[0] * only.A)).t(), atol=1e-6)


def test_mole_gates_whole_loras_from_their_normalised_outputs(tmp_path):
    cfg, method, model = built(tmp_path, 'mole')
    name = 'model.layers.1.self_attn.v_proj'
    layer = model.model.library_layers[name]
    torch.nn.init.normal_(layer.gate, std=0.1)
    factors = [a.modules[name] for a in load_library(LIBRARY, model.model)]
    x = torch.randn(3, layer.in_features)
    outs = torch.stack([x @ (f.B @ f.A).t() for f in factors], dim=1)
    normed = torch.nn.functional.layer_norm(outs.reshape(3, -1), (outs[0].numel(),))
    gates = (normed @ layer.gate.t()).softmax(-1)
    assert torch.allclose(layer(x), (gates.unsqueeze(-1) * outs).sum(1), atol=1e-5)
    assert method.activated_rank(model.model) == 6.0   # q, v: 8 experts; up, down: 4


def test_lora_flow_weights_come_from_the_decoder_layer_input(tmp_path):
    cfg, method, model = built(tmp_path, 'lora_flow')
    decoder = model.model.get_submodule('model.layers.0')
    gate = decoder.lora_flow_gate
    torch.nn.init.normal_(gate.weight, std=0.3)
    seen = {}
    decoder.register_forward_pre_hook(lambda m, a, k: seen.update(h=k.get('hidden_states', a[0] if a else None)),
                                      with_kwargs=True)
    q_proj = model.model.get_submodule('model.layers.0.self_attn.q_proj')
    captured = {}
    q_proj.register_forward_hook(lambda m, a, o: captured.update(x=a[0], out=m.library(a[0])))
    with torch.no_grad():
        model.model(input_ids=batch_of()['input_ids'])
    hidden = seen['h'].reshape(-1, seen['h'].shape[-1])
    weights = (hidden @ gate.weight.t()).softmax(-1) + gate.bias
    name = 'model.layers.0.self_attn.q_proj'
    factors = [a.modules[name] for a in load_library(LIBRARY, model.model)]
    x = captured['x'].reshape(-1, captured['x'].shape[-1])
    expected = sum(weights[:, n:n + 1] * (x @ (f.B @ f.A).t()) for n, f in enumerate(factors))
    assert torch.allclose(captured['out'].reshape(expected.shape), expected, atol=1e-5)


def test_lorahub_clients_score_candidates_without_gradients_and_the_server_keeps_the_best(tmp_path):
    cfg = config(tmp_path, 'lorahub', 'fsplug.lorahub.population', '4', 'fsplug.lorahub.elite', '2')
    results, clients = run_embedded_keeping_clients(cfg)
    proc = clients[1]
    weights = proc.model.library_weights.weight
    assert weights.grad is None                     # no backward ever ran
    method = proc.method
    candidates = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, -1.0], [0.5, 0.5]], dtype=torch.float64)
    state = {**method.init_server_state({}), 'candidates': candidates}
    losses = torch.tensor([2.0, 1.0, 1.5, 1.04], dtype=torch.float64)
    update = ClientUpdate(1, 10, {}, {'lorahub.losses': losses})
    new = method.aggregate(state, [update])
    # scores: loss + 0.05·Σ|w| = 2.0, 1.05, 1.55, 1.09 -> best [1, 0], elite mean of [1,0],[.5,.5]
    assert new['best'].tolist() == [1.0, 0.0]
    assert torch.allclose(new['mean'], torch.tensor([0.75, 0.25], dtype=torch.float64))
    assert new['candidates'][0].tolist() == new['mean'].tolist()
    assert (new['candidates'].abs() <= method.hparams.bound).all()


def test_every_library_method_reports_its_activated_rank(tmp_path):
    expected = {'smartfed': 4.0, 'linear_arithmetic': 4.0, 'lorahub': 4.0, 'mole': 6.0,
                'lora_flow': 6.0}
    for name, rank in expected.items():
        _, method, model = built(tmp_path / name, name)
        assert method.client_metrics(model.model, {})['activated_rank'] == rank, name


# ----------------------------------------------------------------- bad input
def _copy_adapter(tmp_path, name='a'):
    target = tmp_path / name
    shutil.copytree(resolve_path(LIBRARY[0]), target)
    return target


def _expect_error(tmp_path, adapters, *fragments, check_base=True):
    from transformers import AutoModelForCausalLM

    from fs_plugins.models.tiny import ensure_tiny_llama
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama())
    with pytest.raises(ConfigError) as info:
        load_library(adapters, base, check_base)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_a_missing_adapter_folder_is_named(tmp_path):
    _expect_error(tmp_path, [str(tmp_path / 'nowhere')], str(tmp_path / 'nowhere'), 'does not exist')


def test_a_folder_without_adapter_config_is_named(tmp_path):
    (tmp_path / 'empty').mkdir()
    _expect_error(tmp_path, [str(tmp_path / 'empty')], 'empty', 'adapter_config.json')


def test_an_adapter_for_another_base_is_refused_naming_both(tmp_path):
    folder = _copy_adapter(tmp_path)
    path = folder / 'adapter_config.json'
    data = json.loads(path.read_text())
    data['base_model_name_or_path'] = 'meta-llama/Llama-2-7b-hf'
    path.write_text(json.dumps(data))
    _expect_error(tmp_path, [str(folder)], str(folder), 'Llama-2-7b-hf', 'tiny-llama')


def test_an_adapter_with_target_modules_the_model_lacks_is_refused(tmp_path):
    import safetensors.torch
    folder = _copy_adapter(tmp_path)
    weights = safetensors.torch.load_file(str(folder / 'adapter_model.safetensors'))
    renamed = {k.replace('q_proj', 'query_key_value'): v for k, v in weights.items()}
    safetensors.torch.save_file(renamed, str(folder / 'adapter_model.safetensors'))
    _expect_error(tmp_path, [str(folder)], str(folder), 'query_key_value')


def test_an_adapter_with_the_wrong_shapes_is_refused_naming_module_and_shapes(tmp_path):
    import safetensors.torch
    folder = _copy_adapter(tmp_path)
    weights = safetensors.torch.load_file(str(folder / 'adapter_model.safetensors'))
    key = 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'
    weights[key] = torch.zeros(4, 96)
    safetensors.torch.save_file(weights, str(folder / 'adapter_model.safetensors'))
    _expect_error(tmp_path, [str(folder)], str(folder), 'model.layers.0.self_attn.q_proj', '(4, 96)',
                  '(4, 64)')


def test_an_empty_library_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match='fsplug.model.library.adapters is empty'):
        config(tmp_path, 'smartfed', 'fsplug.model.library.adapters', '[]')


def test_merging_adapters_of_different_ranks_is_refused(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fs_plugins.models.tiny import ensure_tiny_llama
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(ensure_tiny_llama()),
                           LoraConfig(r=2, target_modules=['q_proj'], init_lora_weights=False))
    model.save_pretrained(str(tmp_path / 'r2'))
    with pytest.raises(ConfigError, match='different ranks'):
        built(tmp_path, 'linear_arithmetic', 'fsplug.model.library.adapters',
              f"['builtin:tiny-a', '{tmp_path / 'r2'}']")

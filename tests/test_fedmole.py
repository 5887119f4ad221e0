"""Fed-MoLE: the hybrid MoLE layer (sparse top-K dispatch), the ADA phases, what leaves the
client, client-local persistence of routed experts and routers, and the ablation switches."""
import pytest
import torch
from helpers import run_embedded_keeping_clients, tiny_config, write_yaml

from fs_plugins.methods.fedmole import AGGREGATED_KINDS, ROUTED, ROUTER, SHARED, parameter_kind
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.client import ClientProcedure
from fs_plugins.run.config import ConfigError, load_config
from fs_plugins.run.runtime import build_federated_records
from fs_plugins.sim import runner as runner_mod
from fs_plugins.tuners.mole import MoleConfig, RoutedLoraExperts, dense_reference

# tiny model: 2 layers, hidden 64, intermediate 128; LoRA r = 8 on q, v, up, down
LAYERS, HIDDEN, INTER, R = 2, 64, 128, 8
FEDAVG_NUMEL = LAYERS * sum(R * (d_in + d_out) for d_out, d_in in
                            [(HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)])


def routed_numel(n):     # routed experts on up_proj (128 <- 64)
    return LAYERS * n * R * (HIDDEN + INTER)


def router_numel(n):
    return LAYERS * n * HIDDEN


def layer_with_random_experts(n=6, k=2, d_in=12, d_out=10, seed=0):
    torch.manual_seed(seed)
    layer = RoutedLoraExperts(d_in, d_out, MoleConfig(num_experts=n, top_k=k, r=4, alpha=8))
    with torch.no_grad():
        layer.expert_B.normal_()        # B = 0 at init would make every output 0
        layer.router.normal_()
    return layer


# ------------------------------------------------------------------------------- layer
@pytest.mark.parametrize('n,k', [(6, 2), (8, 1), (4, 4), (64, 2)])
def test_sparse_dispatch_matches_dense_reference(n, k):
    layer = layer_with_random_experts(n, k)
    x = torch.randn(3, 7, 12, requires_grad=True)
    sparse = layer(x)
    torch.testing.assert_close(sparse, dense_reference(layer, x), atol=1e-5, rtol=1e-5)
    # same gradients for the input, the experts and the router (float32 sums of larger
    # terms: a looser tolerance)
    grads = torch.autograd.grad(sparse.square().sum(), [x, *layer.parameters()])
    ref_grads = torch.autograd.grad(dense_reference(layer, x).square().sum(),
                                    [x, *layer.parameters()])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_gates_are_the_softmax_of_the_top_k_logits():
    layer = layer_with_random_experts(n=6, k=2)
    x = torch.randn(5, 12)
    experts, gates = layer.route(x)
    logits = x @ layer.router.T
    assert torch.equal(experts, logits.topk(2, dim=-1).indices)
    torch.testing.assert_close(gates.sum(-1), torch.ones(5))
    full = logits.softmax(-1).gather(1, experts)
    torch.testing.assert_close(gates, full / full.sum(-1, keepdim=True))


def test_unselected_experts_are_never_computed():
    """Experts no token selects hold NaN: a dense compute-then-mask layer would output NaN."""
    layer = layer_with_random_experts(n=5, k=2)
    x = torch.rand(4, 6, 12) + 0.1                         # positive inputs
    with torch.no_grad():
        layer.router.copy_(torch.tensor([1.0, 0.5, -1.0, -1.0, -1.0]).unsqueeze(1).expand(5, 12))
        layer.expert_A[2:] = float('nan')
    out = layer(x)
    assert torch.isfinite(out).all()
    assert torch.isnan(dense_reference(layer, x)).any()
    # equals a layer holding only the two selected experts, both always chosen
    two = RoutedLoraExperts(12, 10, MoleConfig(num_experts=2, top_k=2, r=4, alpha=8))
    with torch.no_grad():
        for name in ('expert_A', 'expert_B', 'router'):
            getattr(two, name).copy_(getattr(layer, name)[:2])
    torch.testing.assert_close(out, two(x))


def test_router_and_expert_initialisation():
    layer = RoutedLoraExperts(64, 32, MoleConfig(num_experts=8, r=4, router_init_std=0.02))
    assert torch.count_nonzero(layer.expert_B) == 0
    assert torch.count_nonzero(layer.expert_A) == layer.expert_A.numel()
    assert layer.router.std().item() == pytest.approx(0.02, rel=0.2)
    zero = RoutedLoraExperts(64, 32, MoleConfig(num_experts=8, r=4, router_init_std=0.0))
    assert torch.count_nonzero(zero.router) == 0


# ----------------------------------------------------------------------------- helpers
def load(tmp_path, method='fedmole', rounds=2, steps=4, **fedmole):
    cfg = tiny_config(tmp_path, method, rounds=rounds, steps=steps,
                      fsplug={'fedmole': fedmole} if fedmole else {})
    return load_config(write_yaml(tmp_path / f'{method}.yaml', cfg))


def build_clients(cfg):
    records = build_federated_records(cfg)
    return runner_mod.build_clients(cfg, get_method_class(cfg.fsplug.method), records, {}, 'cpu')


def run(tmp_path, method='fedmole', rounds=2, steps=2, **fedmole):
    """Embedded run; returns (train rows, {client id: ClientProcedure})."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load(tmp_path, method, rounds, steps, **fedmole)
    results, clients = run_embedded_keeping_clients(cfg)
    return [r for r in results.rows if r['kind'] == 'train'], clients


def kinds_of(names):
    return {parameter_kind(n) for n in names}


def snapshot(proc):
    return {n: proc.params[n].detach().clone() for n in proc.trainable_names}


# ---------------------------------------------------------------------------- the model
def test_mole_sits_only_on_lora_wrapped_up_proj(tmp_path):
    proc = build_clients(load(tmp_path))[1]
    routed = [n for n in proc.trainable_names if parameter_kind(n) != SHARED]
    assert len(routed) == LAYERS * 3 and all('.mlp.up_proj.mole.' in n for n in routed)
    assert kinds_of(proc.trainable_names) == {SHARED, ROUTED, ROUTER}
    up = proc.model.get_submodule(routed[0].rsplit('.mole.', 1)[0])
    assert tuple(up.mole.expert_A.shape) == (8, R, HIDDEN)
    assert tuple(up.mole.expert_B.shape) == (8, INTER, R)
    assert tuple(up.mole.router.shape) == (8, HIDDEN)


@pytest.mark.parametrize('builder', ['tiny_llava', 'tiny_qwen2_vl'])
def test_mole_follows_lora_onto_the_language_model(tmp_path, builder):
    """Vision-language builders restrict LoRA to the language model; MoLE goes only where
    LoRA is. The trainable projector is shared and trains with the shared experts."""
    from test_multimodal import vl_config

    from fs_plugins.data.instruction import load_records
    from fs_plugins.methods.building import build_model
    cfg, data = vl_config(tmp_path, builder, fsplug={
        'method': 'fedmole',
        'model': {'lora': {'target_modules': ['q_proj', 'v_proj', 'up_proj']}}})
    method = get_method_class('fedmole')(cfg)
    built = build_model(cfg, method)
    local = [n for n in built.trainable_names if parameter_kind(n) != SHARED]
    assert local and all('language_model' in n and '.up_proj.mole.' in n for n in local)
    projector = [n for n in built.trainable_names if 'projector' in n or 'merger' in n]
    assert projector and all(method.is_shared(n) for n in projector)
    routed_phase, shared_phase = method.phases(4, cfg)
    assert not any(routed_phase.trainable(n) for n in projector)
    assert all(shared_phase.trainable(n) for n in projector)
    records = load_records(data)[:2]
    batch = built.codec.collate([built.codec.encode(r) for r in records])
    built.model(**batch).loss.backward()
    router = [n for n in local if n.endswith('.mole.router')]
    assert router and all(built.model.get_parameter(n).grad is not None for n in router)


def test_mole_target_must_be_a_lora_target(tmp_path):
    """Refused when the config is loaded, before any model is built."""
    with pytest.raises(ConfigError, match=r"fsplug.fedmole.target_modules = \['gate_proj'\]"):
        load(tmp_path, target_modules=['gate_proj'])


def test_bad_top_k_is_named(tmp_path):
    with pytest.raises(ConfigError, match='fsplug.fedmole.top_k = 5: must be <= fsplug.fedmole.num_experts = 4'):
        load(tmp_path, num_experts=4, top_k=5)


def test_routed_output_is_added_to_the_lora_layer(tmp_path):
    """The hooked up_proj gives base + shared LoRA + routed experts."""
    proc = build_clients(load(tmp_path))[1]
    router = next(n for n in proc.trainable_names if n.endswith('.mole.router'))
    up = proc.model.get_submodule(router.rsplit('.mole.', 1)[0])
    with torch.no_grad():
        up.mole.expert_B.normal_()
        up.lora_B['default'].weight.normal_()
    x = torch.randn(2, 3, HIDDEN)
    up.eval()
    shared = up.lora_B['default'](up.lora_A['default'](x)) * up.scaling['default']
    torch.testing.assert_close(up(x), up.base_layer(x) + shared + up.mole(x))


# ------------------------------------------------------------------------------- phases
@pytest.mark.parametrize('alternating', [True, False])
def test_each_phase_trains_exactly_its_parameters(tmp_path, alternating):
    """AdamW with weight decay: in each step exactly the phase's parameters get gradients
    and change; the routed experts' AdamW moments from phase 1 do not move them in phase 2."""
    cfg = load(tmp_path, steps=2 if alternating else 4, alternating=alternating)
    cfg.train.optimizer = {'type': 'AdamW', 'lr': 0.01, 'weight_decay': 0.1}
    proc = build_clients(cfg)[1]
    expected = ([{ROUTED, ROUTER}] * 2 + [{SHARED}] * 2 if alternating
                else [{SHARED, ROUTED, ROUTER}] * 4)
    assert proc.begin_round() == 4
    for step, kinds in enumerate(expected):
        before = snapshot(proc)
        proc.optimise(proc.compute_loss(proc.next_batch()))
        with_grad = {n for n in proc.trainable_names if proc.params[n].grad is not None}
        changed = {n for n in proc.trainable_names if not torch.equal(before[n], proc.params[n])}
        intended = {n for n in proc.trainable_names if parameter_kind(n) in kinds}
        assert with_grad == intended, step
        assert changed == intended, step
    proc.end_round()


# ------------------------------------------------------------------- upload / persistence
def test_upload_is_the_fedavg_lora_payload(tmp_path):
    """Same tensor names, shapes and dtypes as FedAvg-LoRA's upload (byte counts of a real
    run: test_aggregate_switch_moves_exactly_its_kinds['shared'])."""
    mole = build_clients(load(tmp_path))[1]
    avg = build_clients(load(tmp_path, 'fedavg'))[1]
    sent = mole.method.shared_tensors(mole.model, mole.trainable_names)
    reference = avg.method.shared_tensors(avg.model, avg.trainable_names)
    assert sent.keys() == reference.keys()
    assert all(sent[k].shape == reference[k].shape and sent[k].dtype == reference[k].dtype
               for k in sent)
    assert sum(t.numel() * t.element_size() for t in sent.values()) == 4 * FEDAVG_NUMEL


@pytest.mark.slow
def test_routed_experts_and_routers_stay_local_across_rounds(tmp_path, monkeypatch):
    """Receiving the global state leaves routed experts and routers as the client left them
    (and loads the shared experts); the next round starts from them."""
    log = []
    real_receive, real_begin, real_end = (ClientProcedure.receive, ClientProcedure.begin_round,
                                          ClientProcedure.end_round)

    def local_part(proc):
        return {n: proc.params[n].detach().clone() for n in proc.trainable_names
                if parameter_kind(n) != SHARED}

    def receive(self, content):
        before = local_part(self)
        real_receive(self, content)
        log.append(('receive', self.client_id, before, local_part(self)))
        for name, value in content.items():
            assert torch.equal(self.params[name], value)

    def begin_round(self):
        log.append(('begin', self.client_id, local_part(self)))
        return real_begin(self)

    def end_round(self):
        update = real_end(self)
        log.append(('end', self.client_id, local_part(self)))
        return update
    monkeypatch.setattr(ClientProcedure, 'receive', receive)
    monkeypatch.setattr(ClientProcedure, 'begin_round', begin_round)
    monkeypatch.setattr(ClientProcedure, 'end_round', end_round)
    _, clients = run(tmp_path, rounds=2)

    receives = [e for e in log if e[0] == 'receive']
    assert receives and all(e[3].keys() == e[2].keys() for e in receives)
    assert all(torch.equal(e[2][n], e[3][n]) for e in receives for n in e[2])
    for cid in clients:
        ends = [e[2] for e in log if e[0] == 'end' and e[1] == cid]
        begins = [e[2] for e in log if e[0] == 'begin' and e[1] == cid]
        assert len(begins) == 2
        for previous_end, begin in zip(ends, begins[1:]):   # carried into the next round
            assert all(torch.equal(previous_end[n], begin[n]) for n in begin)
    one, two = clients[1], clients[2]
    local = [n for n in one.trainable_names if parameter_kind(n) != SHARED]
    assert all(not torch.equal(one.params[n], two.params[n]) for n in local)
    shared = [n for n in one.trainable_names if parameter_kind(n) == SHARED]
    assert all(torch.equal(one.params[n], two.params[n]) for n in shared)


# ----------------------------------------------------------------------------- ablations
@pytest.mark.slow
@pytest.mark.parametrize('aggregate,uploaded', [
    ('shared', FEDAVG_NUMEL),                                           # paper
    ('all', FEDAVG_NUMEL + routed_numel(8) + router_numel(8)),          # M1
    ('none', 0),                                                        # M2
    ('shared_router', FEDAVG_NUMEL + router_numel(8)),                  # M3
])
def test_aggregate_switch_moves_exactly_its_kinds(tmp_path, aggregate, uploaded):
    # two routed steps: the first only moves B (A's gradient is 0 while B = 0)
    rows, clients = run(tmp_path, rounds=1, steps=4, aggregate=aggregate)
    assert {r['bytes_up'] for r in rows} == {4 * uploaded}
    one, two = clients[1], clients[2]
    for name in one.trainable_names:   # after the final broadcast: aggregated kinds agree
        same = torch.equal(one.params[name], two.params[name])
        assert same == (parameter_kind(name) in AGGREGATED_KINDS[aggregate]), name


def test_v1_trains_everything_in_one_phase(tmp_path):
    method = get_method_class('fedmole')(load(tmp_path, alternating=False))
    phases = method.phases(10, None)
    assert [(p.name, p.steps, p.trainable) for p in phases] == [('joint', 10, None)]


@pytest.mark.parametrize('fraction,split', [(0.5, (5, 5)), (0.3, (3, 7)), (1.0, (10, 0))])
def test_phase_split_is_configurable(tmp_path, fraction, split):
    method = get_method_class('fedmole')(load(tmp_path, phase_steps='split',
                                              routed_fraction=fraction))
    phases = method.phases(10, None)
    assert [p.name for p in phases] == ['routed', 'shared']
    assert tuple(p.steps for p in phases) == split


def test_each_phase_gets_a_full_local_pass(tmp_path):
    """Algorithm 1 loops over D_k once per phase: with the default `phase_steps: each` a round
    of train.local_update_steps = 3 runs 3 routed and then 3 shared optimiser steps."""
    cfg = load(tmp_path, rounds=1, steps=3)
    proc = build_clients(cfg)[1]
    before = snapshot(proc)
    steps = proc.begin_round()
    assert steps == 6
    assert [p.name for p in proc.step_phases] == ['routed'] * 3 + ['shared'] * 3
    for _ in range(steps):
        batch = proc.next_batch()
        loss = proc.compute_loss(batch)
        proc.optimise(loss)
        proc.record(loss.item(), batch['input_ids'].shape[0])
    update = proc.end_round()
    assert update.metrics['train_steps'] == 6
    after = snapshot(proc)
    moved = {parameter_kind(n) for n in before if not torch.equal(before[n], after[n])}
    assert moved == {SHARED, ROUTED, ROUTER}


@pytest.mark.parametrize('n,k', [(4, 1), (16, 4)])
def test_expert_count_and_top_k_sweep(tmp_path, n, k):
    rows, clients = run(tmp_path, rounds=1, num_experts=n, top_k=k)
    assert {r['bytes_up'] for r in rows} == {4 * FEDAVG_NUMEL}
    proc = clients[1]
    name = next(n_ for n_ in proc.trainable_names if n_.endswith('.mole.router'))
    mole = proc.model.get_submodule(name.rsplit('.', 1)[0])
    assert mole.num_experts == n and mole.top_k == k
    experts, gates = mole.route(torch.randn(5, HIDDEN))
    assert experts.shape == gates.shape == (5, k)


def test_paper_yaml_uploads_table5_bytes():
    """Table 5: FedAvg + LoRA and Fed-MoLE send 226.8 MB per round for five clients on
    LLaVA-1.5-7B. The paper YAML's LoRA (r = 8 on q, k, v, up of the language model and on q, k,
    v of the CLIP tower, float32 adapters) gives exactly that; built on the meta device."""
    from helpers import REPO
    from peft import LoraConfig, get_peft_model
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from fs_plugins.models.builders import scoped_targets
    cfg = load_config(f'{REPO}/yamls/fedmole/fedvqa_llava15_7b.yaml')
    model_cfg = cfg.fsplug.model
    # llava-hf/llava-1.5-7b-hf: CLIP ViT-L/14-336 + Vicuna-7B
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                       num_attention_heads=16, image_size=336, patch_size=14),
        text_config=LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, vocab_size=32064))
    with torch.device('meta'):
        model = LlavaForConditionalGeneration(config)
    targets = scoped_targets(model_cfg.lora.target_modules, 'language_model',
                             {'vision_tower': list(model_cfg.vision.tower_lora_targets)})
    model = get_peft_model(model, LoraConfig(r=model_cfg.lora.r, target_modules=targets))
    lora = sum(p.numel() for n, p in model.named_parameters() if 'lora_' in n)
    assert not model_cfg.vision.train_projector
    assert round(lora * 4 * cfg.federate.client_num / 1e6, 1) == 226.8

"""FedMosaic as a method (issues 11, 38): the tiny heterogeneous federation (2-layer pivot +
4-layer model), alignment (orthonormal, lower objective, the paper's one-epoch batch-4 cosine
schedule, cached by both models, r and the schedule), RELA (the last down_proj's and the
output layer's gradients equal autograd's; mask, noise, EMA in both orders; per-client G_i from
the formula), the ablations without RELA / PQ-LoRA, what leaves the client, and bad input that
fails before round 1 naming the culprit."""
import math
import os
from fnmatch import fnmatch

import pytest
import torch
from helpers import REPO, run_embedded_keeping_clients

from fs_plugins.aggregation.mosaic import cosine_learning_rate, ema_update, rela_weights, shared_mask
from fs_plugins.methods.base import ClientUpdate
from fs_plugins.methods.building import build_model
from fs_plugins.methods.fedmosaic import (
    ARCH_KEY,
    GATE_NAMES,
    GRAD_KEY,
    PIVOT_KEY,
    PQ_PREFIX,
    FedMosaic,
    model_type_id,
)
from fs_plugins.methods.specs import model_spec
from fs_plugins.models.builders import load_base
from fs_plugins.run.config import ConfigError, client_config, client_overrides, load_config, read_yaml
from fs_plugins.tuners.mosaic.rela import RelaGradients, last_down_proj, output_layer_gradient, rela_gradient

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


@pytest.fixture(scope='module')
def hetero_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp('fedmosaic')
    cfg = _cfg(tmp_path, 'federate.total_round_num', '2', 'train.local_update_steps', '6')
    results, clients = run_embedded_keeping_clients(cfg, read_yaml(CLIENTS))
    return cfg, results, clients


def test_pivot_and_ws_default_to_the_runs_model(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.fsplug.fedmosaic.pivot_model_type == 'tiny-llama@fsplug_llm'
    assert cfg.fsplug.fedmosaic.pivot_builder == 'tiny_llama'
    large = client_config(cfg, {'model': {'type': LARGE}})
    assert large.fsplug.fedmosaic.pivot_model_type == 'tiny-llama@fsplug_llm'
    assert not FedMosaic(large).is_pivot(large) and FedMosaic(cfg).is_pivot(cfg)


def test_only_p_q_gates_and_conventional_lora_train_and_what_is_sent(tmp_path):
    built, method, _ = _built(_cfg(tmp_path), LARGE)
    pq_modules = set(built.model.fedmosaic_pq)
    for name in built.trainable_names:
        module = name.split('.lora_')[0].split('.mosaic.')[0]
        if module in pq_modules:
            assert name.rsplit('.', 1)[-1] in ('P', 'Q'), name
    # one gate per decoder layer carrying LoRA (the 4-layer model: all 4)
    gates = [n for n in built.trainable_names if n.endswith(GATE_NAMES)]
    assert sorted(gates) == [f'base_model.model.model.layers.{i}.mosaic_gate.beta' for i in range(4)]
    shared = method.shared_tensors(built.model, built.trainable_names)
    assert not any(name.endswith('.beta') for name in shared)        # the gate stays local
    assert all(any(fnmatch(g, p) for p in method.contract.stays_local) for g in gates)
    pq = sorted(n for n in shared if n.startswith(PQ_PREFIX))
    assert pq == sorted(f'{PQ_PREFIX}block1.{m}/{leaf}' for m in
                        ('self_attn.q_proj', 'self_attn.v_proj', 'mlp.up_proj', 'mlp.down_proj')
                        for leaf in ('P', 'Q'))
    assert all(fnmatch(n, method.contract.uploads[0]) for n in pq)
    # layers 1-3 of the 4-layer model carry conventional LoRA under peft's names
    assert {n.split('.layers.')[1].split('.')[0] for n in shared if '.lora_' in n} == {'0', '1', '2'}


def test_alignment_is_orthonormal_lowers_the_objective_and_is_cached(tmp_path, caplog):
    cfg = _cfg(tmp_path, 'fsplug.fedmosaic.alignment_schedule', 'full_batch')
    caplog.set_level('INFO', logger='fs_plugins.tuners.mosaic.alignment')
    built, _, _ = _built(cfg, LARGE)
    files = os.listdir(tmp_path / 'align')
    assert len(files) == 1 and '_r8_' in files[0]
    line = next(r.message for r in caplog.records if 'mean A objective' in r.message)
    before, after = (float(v) for v in line.split('mean A objective ')[1].split(';')[0].split(' -> '))
    assert after < 0.5 * before
    modules = dict(built.model.named_modules())
    for name in built.model.fedmosaic_pq:
        a = modules[name].lora_A['default'].weight.detach()
        torch.testing.assert_close(a @ a.T, torch.eye(a.shape[0]), atol=1e-4, rtol=0)
        assert not modules[name].lora_A['default'].weight.requires_grad
        assert not modules[name].lora_B['default'].weight.requires_grad
    # the second build reads the file and gets the same factors
    caplog.clear()
    again, _, _ = _built(cfg, LARGE)
    assert any('from ' in r.message for r in caplog.records)
    for (_n1, p1), (_n2, p2) in zip(built.model.named_parameters(), again.model.named_parameters()):
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)
    # another r is another alignment
    _built(_cfg(tmp_path, 'fsplug.model.lora.r', '4', 'fsplug.fedmosaic.alignment_schedule',
                'full_batch'), LARGE)
    assert sorted(f.split('_r')[1][0] for f in os.listdir(tmp_path / 'align')) == ['4', '8']


def test_a_model_without_alignment_fails_when_required(tmp_path):
    cfg = _cfg(tmp_path, 'fsplug.fedmosaic.alignment', 'require')
    with pytest.raises(ConfigError, match=r"tiny-llama-large@fsplug_llm' has no alignment"):
        _built(cfg, LARGE)


def test_more_blocks_than_layers_fails_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"fsplug.fedmosaic.num_blocks = 3 does not fit "
                                          r"model.type 'tiny-llama@fsplug_llm'"):
        _built(_cfg(tmp_path, 'fsplug.fedmosaic.num_blocks', '3'))


def test_a_client_cannot_change_the_shared_rank(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.federate.client_num = 4
    with pytest.raises(ConfigError) as err:
        client_overrides({'client_3': {'model': {'type': LARGE},
                                       'fsplug': {'model': {'lora': {'r': 4}}}}}, cfg)
    assert any(p.startswith('--client_cfg client_3: fsplug.model.lora.r = 4 differs')
               for p in err.value.problems)


def test_output_layer_gradient_equals_autograd(tmp_path):
    cfg = _cfg(tmp_path)
    base = load_base(model_spec(cfg))
    records = [{'instruction': 'add 2 and 3', 'input': '', 'output': '5'},
               {'instruction': 'reverse abc', 'input': '', 'output': 'cba'}]
    batch = base.codec.collate([base.codec.encode(r) for r in records])
    head = base.model.get_output_embeddings().weight
    head.requires_grad_(True)
    expected, = torch.autograd.grad(base.model(**batch).loss, [head])
    head.requires_grad_(False)
    torch.testing.assert_close(output_layer_gradient(base.model, batch), expected.flatten(),
                               rtol=1e-4, atol=1e-6)


def test_down_proj_gradient_equals_autograd_and_leaves_ws_frozen(tmp_path):
    """RELA's default layer: the last decoder layer's MLP down projection of W_s, its gradient
    of the batch's mean CE by a backward pass; W_s keeps no grad and stays frozen."""
    cfg = _cfg(tmp_path)
    base = load_base(model_spec(cfg))
    records = [{'instruction': 'add 2 and 3', 'input': '', 'output': '5'},
               {'instruction': 'reverse abc', 'input': '', 'output': 'cba'}]
    batch = base.codec.collate([base.codec.encode(r) for r in records])
    model = base.model
    layers = model.model.layers
    assert last_down_proj(model) is layers[-1].mlp.down_proj
    weight = layers[-1].mlp.down_proj.weight
    assert not any(p.requires_grad for p in model.parameters())
    gradient = rela_gradient(model, batch, 'last_down_proj')
    assert gradient.numel() == weight.numel() == model.config.hidden_size * model.config.intermediate_size
    assert not any(p.requires_grad or p.grad is not None for p in model.parameters())
    weight.requires_grad_(True)
    model(**batch).loss.backward()
    expected = weight.grad.detach().clone()
    weight.grad = None
    weight.requires_grad_(False)
    assert gradient.view_as(weight).shape == tuple(weight.shape)
    torch.testing.assert_close(gradient.view_as(weight), expected, rtol=1e-5, atol=1e-7)
    assert float(gradient.abs().sum()) > 0
    # the output layer instead (gradient_layer: lm_head)
    torch.testing.assert_close(rela_gradient(model, batch, 'lm_head'),
                               output_layer_gradient(model, batch))
    # no labelled token: zeros of the layer's size
    empty = dict(batch, labels=torch.full_like(batch['labels'], -100))
    assert torch.equal(rela_gradient(model, empty, 'last_down_proj'), torch.zeros(weight.numel()))


def test_ws_shares_the_clients_own_frozen_base_and_gives_the_copys_gradient(tmp_path):
    """A client whose model is W_s takes RELA's gradient from its own base with the adapters
    off (no second copy: Table 15's memory), equal to the separate copy's; trained adapters
    (P, Q moved, B non-zero) do not reach it, nor does the training mode; another model type,
    or small_shares_base False, keeps the copy."""
    from fs_plugins.tuners.mosaic.rela import frozen_base_gradient
    cfg = _cfg(tmp_path)
    built, method, ccfg = _built(cfg)
    model = built.model
    state = method.init_client_state(model, ccfg)
    assert state['ws_own_base']
    with torch.no_grad():   # as after training: the adapters change the model's output
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn_like(param))
    base = load_base(model_spec(cfg))
    records = [{'instruction': 'add 2 and 3', 'input': '', 'output': '5'},
               {'instruction': 'reverse abc', 'input': '', 'output': 'cba'}]
    batch = base.codec.collate([base.codec.encode(r) for r in records])
    model.train()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    assert not all(flags.values())        # PQ-LoRA's A and B are frozen
    shared = frozen_base_gradient(model, batch, 'last_down_proj')
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert model.training and not any(p.grad is not None for p in model.parameters())
    torch.testing.assert_close(shared, rela_gradient(base.model, batch, 'last_down_proj'))
    with torch.no_grad():
        adapted = model(**batch).loss
        with model.disable_adapter():
            assert not torch.equal(adapted, model(**batch).loss)   # the adapters were on again
    other = _built(cfg, LARGE)
    assert not other[1].init_client_state(other[0].model, other[2])['ws_own_base']
    copy_cfg = _cfg(tmp_path, 'fsplug.fedmosaic.small_shares_base', 'False')
    built, method, ccfg = _built(copy_cfg)
    assert not method.init_client_state(built.model, ccfg)['ws_own_base']


def test_relas_decay_applies_per_round_by_default():
    """The paper's Eq. 2 (per gradient) and Algorithm 1 (per round) disagree: the default is
    the per-round reading, with which the authors tuned a = 0.5."""
    from fs_plugins.methods.fedmosaic import FedMosaicConfig
    assert FedMosaicConfig().sanitise_order == 'algorithm' and FedMosaicConfig().ema_ratio == 0.5


def test_rela_gradients_in_algorithm_order_mask_noise_then_ema():
    """sanitise_order: algorithm (Algorithm 1): each gradient masked (and noised), the round's
    mean folded into ĝ, ĝ sent."""
    grads = [torch.arange(10.0), torch.arange(10.0) * 3]
    exact = RelaGradients(every=2, keep_fraction=0.5, noise_std=0.0, ema_ratio=0.5,
                          mask_seed=7, noise_seed=1, order='algorithm')
    due = []
    for _ in range(5):
        due.append(exact.due())
        exact.end_step()
    assert due == [True, False, True, False, True]       # every f = 2 steps, from step 0
    for g in grads:          # one due step each
        exact.record(g)
        exact.end_step()
    mask = exact.mask
    assert int(mask.sum()) == 5
    first = exact.end_round()
    torch.testing.assert_close(first, 0.5 * (2 * torch.arange(10.0))[mask])
    exact.record(grads[0])
    torch.testing.assert_close(exact.end_round(), 0.5 * first + 0.5 * torch.arange(10.0)[mask])
    noisy = RelaGradients(2, 0.5, 1.0, 1.0, mask_seed=7, noise_seed=1, order='algorithm')
    noisy.record(grads[0])
    noisy.end_step()
    assert torch.equal(noisy.mask, mask)                       # the same mask on every client
    assert not torch.allclose(noisy.end_round(), grads[0][mask])


@pytest.mark.parametrize('order', ['equations', 'algorithm'])
def test_rela_orders_match_a_hand_written_reference(order):
    """Two rounds of three gradients, noise on: 'equations' (Eqs. 2-3) keeps ĝ of the raw
    gradients, one per gradient, and sends M ⊙ (ĝ + μ ε); 'algorithm' (Algorithm 1) sends the
    EMA of the rounds' means of M ⊙ (g + μ ε)."""
    a, mu, keep, dim = 0.5, 0.1, 0.4, 20
    rounds = [[torch.randn(dim, generator=torch.Generator().manual_seed(10 * r + k))
               for k in range(3)] for r in range(2)]
    rela = RelaGradients(every=1, keep_fraction=keep, noise_std=mu, ema_ratio=a,
                         mask_seed=3, noise_seed=4, order=order)
    sent = []
    for grads in rounds:
        for g in grads:
            rela.record(g)
            rela.end_step()
        sent.append(rela.end_round())
    mask = shared_mask(dim, keep, 3)
    noise = torch.Generator().manual_seed(4)      # the client's noise stream, drawn in order
    count = int(mask.sum())
    if order == 'equations':
        ema = torch.zeros(dim)
        expected = []
        for grads in rounds:
            for g in grads:
                ema = (1 - a) * ema + a * g                      # Eq. 2, per gradient
            expected.append(ema[mask] + mu * torch.randn(count, generator=noise))   # Eq. 3
    else:
        ema = torch.zeros(count)
        expected = []
        for grads in rounds:
            sanitised = [g[mask] + mu * torch.randn(count, generator=noise) for g in grads]
            ema = (1 - a) * ema + a * torch.stack(sanitised).mean(0)
            expected.append(ema)
    for got, want in zip(sent, expected):
        assert got.shape == (count,)
        torch.testing.assert_close(got, want)
    assert torch.equal(rela.mask, mask)


@pytest.mark.parametrize('order', ['equations', 'algorithm'])
def test_rela_gradient_of_an_accumulated_step_is_the_whole_batch_gradient(order):
    """Micro-batches of one step (grad.grad_accum_count) give one gradient, their token-weighted
    mean: the gradient of the step's whole batch."""
    rela = RelaGradients(every=1, keep_fraction=1.0, noise_std=0.0, ema_ratio=1.0,
                         mask_seed=7, noise_seed=1, order=order)
    rela.record(torch.full((4,), 1.0), tokens=1)
    rela.record(torch.full((4,), 4.0), tokens=3)
    rela.end_step()
    if order == 'algorithm':
        assert rela.round_count == 1
    else:
        torch.testing.assert_close(rela.ema, ema_update(None, torch.full((4,), 13.0 / 4), 1.0))
    torch.testing.assert_close(rela.end_round(), torch.full((4,), (1.0 + 12.0) / 4))


@pytest.mark.slow
def test_heterogeneous_run_trains_gates_and_fills_the_global_modules(hetero_run):
    cfg, results, clients = hetero_run
    evals = [r for r in results.rows if r['kind'] == 'eval']
    assert len(evals) == 8 and all(r['test_avg_loss'] == r['test_avg_loss'] for r in evals)
    archs = {cid: c.method._type_ids(c.cfg)[0] for cid, c in clients.items()}
    assert archs[1] == archs[2] == model_type_id('tiny_llama', 'tiny-llama@fsplug_llm') != archs[3]
    assert archs[3] == archs[4]
    for proc in clients.values():
        assert proc.state['rela'].ema is not None and proc.state['rela'].steps == 12
        layers = [m for m in proc.model.modules() if hasattr(m, 'mosaic')]
        assert any(float(m.mosaic.beta_parameter().detach()) != 0.0 for m in layers)   # gates learn
        pq = [m for m in layers if m.mosaic.pq]
        # the global P received from the server is no longer the initial identity
        assert any(not torch.allclose(m.mosaic.global_P, torch.eye(m.mosaic.global_P.shape[0]))
                   for m in pq)
    train = {r['client']: r for r in results.rows if r['kind'] == 'train' and r['round'] == 1}
    assert train[3]['bytes_up'] > train[1]['bytes_up']   # deeper, wider model: more LoRA
    assert all(0 < r['fedmosaic_gate'] < 1 for r in train.values())


def test_server_content_follows_rela_weights(hetero_run):
    cfg, results, clients = hetero_run
    method = FedMosaic(cfg)
    updates = []
    for cid in (1, 2, 3, 4):
        proc = clients[cid]
        shared = proc.method.shared_tensors(proc.model, proc.trainable_names)
        extra = {GRAD_KEY: torch.randn(8, generator=torch.Generator().manual_seed(cid)),
                 ARCH_KEY: torch.tensor(proc.method._type_ids(proc.cfg)[0]),
                 'fedmosaic.pivot': torch.tensor(proc.method._type_ids(proc.cfg)[1])}
        updates.append(ClientUpdate(cid, 10, shared, extra))
    state = method.aggregate(method.init_server_state({}), updates)
    weights = rela_weights(torch.stack([u.extra[GRAD_KEY] for u in updates]), 0.5, True)
    pq_name = f'{PQ_PREFIX}block1.self_attn.q_proj/P'
    expected = sum(weights[0, j] * updates[j].shared[pq_name] for j in range(4))
    torch.testing.assert_close(state['custom'][1][pq_name], expected, rtol=1e-5, atol=1e-6)
    lora = next(n for n in updates[2].shared if '.lora_A.' in n and '.layers.2.' in n)
    row = weights[2, 2:] / weights[2, 2:].sum()       # conventional LoRA: same model type only
    expected = row[0] * updates[2].shared[lora] + row[1] * updates[3].shared[lora]
    torch.testing.assert_close(state['custom'][3][lora], expected, rtol=1e-5, atol=1e-6)
    assert lora not in state['custom'][1]
    assert not torch.allclose(state['custom'][1][pq_name], state['custom'][2][pq_name])
    # what a client receives lands in its frozen global modules
    proc = clients[3]
    proc.receive(method.content_for(state, 3))
    module = dict(proc.model.named_modules())[lora.split('.lora_A.')[0]]
    torch.testing.assert_close(module.mosaic.global_A, state['custom'][3][lora])
    pq_module = dict(proc.model.named_modules())[next(
        n for n, k in proc.model.fedmosaic_pq.items() if k == 'block1.self_attn.q_proj')]
    torch.testing.assert_close(pq_module.mosaic.global_P, state['custom'][3][pq_name])


def test_baselines_aggregate_per_architecture(tmp_path):
    """FedIT on the heterogeneous pair (fsplug.aggregation.per_architecture): clients of one
    model average among themselves, and receive their group's average."""
    from fs_plugins.run.config import load_config as load
    cfg = load(TINY, ['data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
                      'fsplug.results_dir', str(tmp_path / 'results'), 'fsplug.method', 'fedavg',
                      'fsplug.aggregation.per_architecture', 'True',
                      'federate.total_round_num', '2', 'train.local_update_steps', '2'])
    _, clients = run_embedded_keeping_clients(cfg, read_yaml(CLIENTS))

    def lora(cid):
        proc = clients[cid]
        return {n: proc.params[n].detach() for n in proc.trainable_names}
    for a, b in ((1, 2), (3, 4)):
        assert lora(a).keys() == lora(b).keys()
        assert all(torch.equal(lora(a)[n], lora(b)[n]) for n in lora(a))
    assert any(lora(1)[n].shape != lora(3)[n].shape for n in lora(1) if n in lora(3))


@pytest.mark.parametrize('pq_lr', [0.0, 5e-5])
def test_pq_lora_has_its_own_learning_rate(tmp_path, pq_lr):
    from fs_plugins.run.client import ClientProcedure
    from fs_plugins.run.runtime import build_federated_records
    cfg = _cfg(tmp_path, 'train.optimizer.lr', '2e-5', 'fsplug.fedmosaic.pq_lr', str(pq_lr))
    built, method, ccfg = _built(cfg)
    proc = ClientProcedure(1, ccfg, method, built, build_federated_records(cfg).clients[1])
    proc.begin_round()
    lr_of = {id(p): g['lr'] for g in proc.optimizer.param_groups for p in g['params']}
    assert len(lr_of) == len(proc.trainable_names)
    pq_prefixes = [f'{path}.mosaic.' for path in built.model.fedmosaic_pq] + [
        f"{path.split('.self_attn.')[0].split('.mlp.')[0]}.mosaic_gate." for path in built.model.fedmosaic_pq]
    for name in proc.trainable_names:
        # P, Q and the per-layer gate of a block-end layer
        in_pq_layer = any(name.startswith(prefix) for prefix in pq_prefixes)
        assert lr_of[id(proc.params[name])] == (pq_lr if pq_lr and in_pq_layer else 2e-5), name
    assert any(n.endswith('.mosaic.P') for n in proc.trainable_names)


def test_the_pivot_is_built_once_per_process_for_every_client_of_another_type(tmp_path,
                                                                              monkeypatch):
    import fs_plugins.methods.fedmosaic as fedmosaic_module
    monkeypatch.setattr(fedmosaic_module, '_PIVOTS', {})
    built_types = []
    original = fedmosaic_module.build_model

    def counting(cfg, *args, **kwargs):
        built_types.append(str(cfg.model.type))
        return original(cfg, *args, **kwargs)
    monkeypatch.setattr(fedmosaic_module, 'build_model', counting)
    cfg = _cfg(tmp_path)
    for _ in range(2):                      # two clients of the larger type, one process
        _built(cfg, LARGE)
    assert built_types.count('tiny-llama@fsplug_llm') == 1
    assert all(p.built is None for p in fedmosaic_module._PIVOTS.values())   # model released


def test_the_paper_alignment_schedule_is_one_epoch_of_batch_4_on_a_cosine(tmp_path, monkeypatch):
    """alignment_schedule: paper (A.17): ⌈samples / 4⌉ Adam steps, the rate 5e-5 decaying on a
    cosine; the cache key holds the schedule and its settings."""
    import fs_plugins.tuners.mosaic.alignment as alignment_module
    fits = []

    class Recording(alignment_module.MiniBatchAlignment):
        def __post_init__(self):
            super().__post_init__()
            fits.append(self)
    monkeypatch.setattr(alignment_module, 'MiniBatchAlignment', Recording)
    cfg = _cfg(tmp_path, 'fsplug.fedmosaic.alignment_samples', '30')
    assert cfg.fsplug.fedmosaic.alignment_schedule == 'paper'
    built, _, _ = _built(cfg, LARGE)
    fit, = fits
    steps = math.ceil(30 / 4)
    assert fit.total_steps == steps and len(fit.learning_rates) == steps
    assert fit.learning_rates == pytest.approx([cosine_learning_rate(5e-5, t, steps)
                                                for t in range(steps)])
    modules = dict(built.model.named_modules())
    for name in built.model.fedmosaic_pq:
        a = modules[name].lora_A['default'].weight.detach()
        torch.testing.assert_close(a @ a.T, torch.eye(a.shape[0]), atol=1e-4, rtol=0)
    # another schedule or batch size is another alignment; the same settings read the file
    _built(_cfg(tmp_path, 'fsplug.fedmosaic.alignment_samples', '30',
                'fsplug.fedmosaic.alignment_schedule', 'full_batch'), LARGE)
    _built(_cfg(tmp_path, 'fsplug.fedmosaic.alignment_samples', '30',
                'fsplug.fedmosaic.alignment_batch_size', '2'), LARGE)
    assert len(os.listdir(tmp_path / 'align')) == 3 and len(fits) == 2
    _built(cfg, LARGE)
    assert len(os.listdir(tmp_path / 'align')) == 3 and len(fits) == 2


def test_without_rela_weights_are_equal_and_no_gradient_is_taken_or_sent(tmp_path, monkeypatch):
    """rela: False (Table 7 '(+) PQ-LoRA', Table 30 'Equal-weight aggregation')."""
    cfg = _cfg(tmp_path, 'fsplug.fedmosaic.rela', 'False')
    built, method, ccfg = _built(cfg)
    state = method.init_client_state(built.model, ccfg)
    monkeypatch.setattr(FedMosaic, 'small_model', lambda *a: pytest.fail('W_s was used'))
    base = load_base(model_spec(cfg))
    batch = base.codec.collate([base.codec.encode({'instruction': 'add 2 and 3', 'input': '',
                                                   'output': '5'})])
    method.loss(built.model, batch, state)
    extra = method.client_extra(built.model, state)
    assert set(extra) == {ARCH_KEY, PIVOT_KEY}
    shared = method.shared_tensors(built.model, built.trainable_names)
    updates = []
    for cid in (1, 2, 3):
        generator = torch.Generator().manual_seed(cid)
        updates.append(ClientUpdate(cid, 10, {n: torch.randn(t.shape, generator=generator)
                                              for n, t in shared.items()}, dict(extra)))
    custom = method.aggregate(method.init_server_state({}), updates)['custom']
    for name in shared:
        mean = sum(u.shared[name] for u in updates) / 3
        for cid in (1, 2, 3):
            torch.testing.assert_close(custom[cid][name], mean, rtol=1e-5, atol=1e-6)


def test_without_pq_lora_every_layer_is_conventional_and_nothing_is_aligned(tmp_path):
    """pq_lora: False (Table 7 'Vanilla' with rela: False): conventional LoRA everywhere,
    nothing under pq/, no alignment."""
    built, method, _ = _built(_cfg(tmp_path, 'fsplug.fedmosaic.pq_lora', 'False'), LARGE)
    assert built.model.fedmosaic_pq == {}
    assert not os.path.exists(tmp_path / 'align')
    shared = method.shared_tensors(built.model, built.trainable_names)
    assert shared and not any(n.startswith(PQ_PREFIX) for n in shared)
    assert {n.split('.layers.')[1].split('.')[0] for n in shared} == {'0', '1', '2', '3'}

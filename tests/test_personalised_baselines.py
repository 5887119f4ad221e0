"""FedMosaic's personalised baselines with a second LoRA adapter: DITTO (global then
personal, proximal pull to the received global) and FedSim (shared + personal trained
together), end to end on the tiny model through the embedded runner."""
import re

import pytest
import torch
from helpers import run_embedded_keeping_clients, tiny_config, write_yaml
from test_methods import A_NUMEL, B_NUMEL, run, train_rows

from fs_plugins.methods.base import activate_adapters
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.client import ClientProcedure
from fs_plugins.run.config import load_config
from fs_plugins.run.runtime import build_federated_records

SMALL_KD = {'kd_steps': 4, 'kd_batch_size': 4, 'public_samples': 8}   # PerAda's server distillation


def one_client(tmp_path, method, **updates) -> ClientProcedure:
    """Client 1 of the tiny federation, built but not trained."""
    cfg = load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, method, steps=2,
                                                                  **updates)))
    method_obj = get_method_class(method)(cfg)
    return ClientProcedure(1, cfg, method_obj, build_model(cfg, method_obj),
                           build_federated_records(cfg).clients[1])


def phases_of_one_round(proc) -> list[tuple[str, tuple[str, ...]]]:
    """Trains one local round (without ending it); per step, its phase and active adapters."""
    proc.begin_round()
    seen = []
    for _ in range(len(proc.step_phases)):
        batch = proc.next_batch()
        seen.append((proc.current_phase.name, tuple(proc.model.base_model.active_adapters)))
        proc.optimise(proc.compute_loss(batch))
        proc.record(0.0, 1)
    return seen


def adapter_params(proc, adapter):
    return {n: p for n, p in proc.params.items() if f'.{adapter}.' in n}


def test_ditto_personal_adapter_starts_as_the_global_one(tmp_path):
    proc = one_client(tmp_path, 'ditto')
    personal = adapter_params(proc, 'personal')
    assert personal and all(
        torch.equal(p, proc.params[n.replace('.personal.', '.default.')]) for n, p in personal.items())


@pytest.mark.slow
def test_ditto_trains_global_then_personal_and_evaluates_the_personal_model(tmp_path):
    results, clients = run(tmp_path, 'ditto')
    proc = clients[1]
    assert {r['bytes_up'] for r in train_rows(results)} == {4 * (A_NUMEL + B_NUMEL)}
    assert {r['train_steps'] for r in train_rows(results)} == {4}   # 2 global + 2 personal
    assert proc.model.base_model.active_adapters == ['personal']
    personal_b = next(n for n in proc.trainable_names if 'lora_B.personal' in n)
    global_b = personal_b.replace('.personal.', '.default.')
    assert torch.count_nonzero(proc.params[personal_b]) > 0
    assert not torch.equal(proc.params[personal_b], clients[2].params[personal_b])
    assert not torch.equal(proc.params[personal_b], proc.params[global_b])


def test_ditto_phases_run_one_adapter_at_a_time(tmp_path):
    proc = one_client(tmp_path, 'ditto')
    assert phases_of_one_round(proc) == [('global', ('default',))] * 2 + [('personal', ('personal',))] * 2
    proc.end_round()
    assert proc.model.base_model.active_adapters == ['personal']


def test_ditto_loss_adds_the_proximal_term_to_the_received_global(tmp_path):
    proc = one_client(tmp_path, 'ditto', fsplug={'ditto': {'lam': 0.3}})
    received = {n: p.detach() + 0.05 for n, p in adapter_params(proc, 'default').items()}
    proc.receive(received)
    batch = proc.stream.next()
    plain = proc.model(**batch).loss
    loss = proc.method.loss(proc.model, batch, proc.state)   # personal adapter active
    expected = sum(((proc.params[n.replace('.default.', '.personal.')] - t) ** 2).sum()
                   for n, t in received.items())
    assert torch.allclose(loss, plain + 0.5 * 0.3 * expected)
    activate_adapters(proc.model, ('default',))   # the global phase has no proximal term
    assert torch.equal(proc.method.loss(proc.model, batch, proc.state), proc.model(**batch).loss)


@pytest.mark.slow
def test_fedsim_trains_both_adapters_together_and_sends_the_shared_one(tmp_path):
    results, clients = run(tmp_path, 'fedsim')
    proc = clients[1]
    assert proc.model.base_model.active_adapters == ['default', 'local']
    assert {r['bytes_up'] for r in train_rows(results)} == {4 * (A_NUMEL + B_NUMEL)}
    assert {r['train_steps'] for r in train_rows(results)} == {2}   # one pass, both adapters
    for adapter in ('default', 'local'):
        b = next(n for n in proc.trainable_names if f'lora_B.{adapter}' in n)
        assert torch.count_nonzero(proc.params[b]) > 0
    local_b = next(n for n in proc.trainable_names if 'lora_B.local' in n)
    assert not torch.equal(proc.params[local_b], clients[2].params[local_b])


def test_feddat_distillation_loss_matches_the_naive_formula():
    from fs_plugins.methods.feddat import distillation_loss
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 7, generator=gen), torch.randn(2, 5, 7, generator=gen)
    labels = torch.tensor([[-100, -100, 3, 4, -100], [-100, 1, 2, -100, -100]])
    T, terms = 3.0, []
    for b in range(2):
        for t in range(4):
            if labels[b, t + 1] != -100:
                p = torch.softmax(teacher[b, t] / T, -1)
                q = torch.softmax(student[b, t] / T, -1)
                terms.append((p * (p.log() - q.log())).sum())
    expected = T ** 2 * sum(terms) / len(terms)
    assert torch.allclose(distillation_loss(student, teacher, labels, T), expected, atol=1e-6)


@pytest.mark.slow
def test_feddat_alternates_student_and_teacher_steps_and_sends_the_shared_adapter(tmp_path):
    results, clients = run(tmp_path, 'feddat')
    proc = clients[1]
    assert {r['bytes_up'] for r in train_rows(results)} == {4 * (A_NUMEL + B_NUMEL)}
    assert {r['train_steps'] for r in train_rows(results)} == {4}   # 2 shared + 2 DAT steps
    assert proc.model.base_model.active_adapters == ['dat_local', 'dat_global']
    layer = proc.model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling['dat_local'] == layer.scaling['dat_global'] == layer.scaling['default'] / 2
    assert 'dat_global' not in ' '.join(proc.trainable_names)
    for adapter in ('default', 'dat_local'):
        b = next(n for n in proc.trainable_names if f'lora_B.{adapter}' in n)
        assert torch.count_nonzero(proc.params[b]) > 0
    local_b = next(n for n in proc.trainable_names if 'lora_B.dat_local' in n)
    assert not torch.equal(proc.params[local_b], clients[2].params[local_b])


def test_feddat_receive_refreshes_the_frozen_global_copy_and_the_loss_distils(tmp_path):
    from fs_plugins.methods.feddat import distillation_loss
    proc = one_client(tmp_path, 'feddat')
    received = {n: p.detach() + 0.05 for n, p in adapter_params(proc, 'default').items()}
    proc.receive(received)
    assert all(torch.equal(proc.params[n.replace('.default.', '.dat_global.')], t)
               for n, t in received.items())
    batch = proc.stream.next()
    activate_adapters(proc.model, ('default',))            # the student step
    student = proc.model(**batch)
    with torch.no_grad():
        activate_adapters(proc.model, ('dat_local', 'dat_global'))
        teacher = proc.model(**batch).logits
        activate_adapters(proc.model, ('default',))
    expected = 0.5 * student.loss + 0.5 * distillation_loss(student.logits, teacher,
                                                             batch['labels'], 3.0)
    assert torch.allclose(proc.method.loss(proc.model, batch, proc.state), expected)
    assert proc.model.base_model.active_adapters == ['default']


@pytest.mark.slow
@pytest.mark.parametrize('method, personal_adapters', [
    ('ditto', ('personal',)), ('fedsim', ('local',)), ('feddpa', ('local',)),
    ('feddat', ('dat_local', 'dat_global')), ('perada', ('personal',))])
def test_a_trained_projector_goes_with_the_global_model(tmp_path, method, personal_adapters):
    """Trained tensors outside the adapters (LLaVA's projector) train and are shared with the
    global adapter; only the personal adapters stay local."""
    from test_multimodal import vl_config
    # the tiny VQA file is too small to hold a public set apart: PerAda reads the clients' own
    cfg, _ = vl_config(tmp_path, 'tiny_llava', fsplug={'method': method, 'perada': {
        **SMALL_KD, 'public_data': 'clients'}},
                       eval={'freq': 100}, **{'federate': {'total_round_num': 1}})
    results, clients = run_embedded_keeping_clients(cfg)
    proc = clients[1]
    projector = [n for n in proc.trainable_names if 'multi_modal_projector' in n]
    assert projector
    update = proc.method.shared_tensors(proc.model, proc.trainable_names)
    assert set(projector) <= set(update)
    assert not any(f'.{a}.' in n for n in update for a in personal_adapters)
    initial = build_model(cfg, get_method_class(method)(cfg)).model.state_dict()
    assert any(not torch.equal(proc.params[n].detach(), initial[n]) for n in projector)


def test_kd_maths_match_the_naive_formulas():
    from fs_plugins.aggregation import ensemble_logits, kd_divergence
    torch.manual_seed(0)
    clients = [torch.randn(3, 7) for _ in range(4)]
    teacher = ensemble_logits(clients)
    assert torch.allclose(teacher, sum(clients) / 4)
    student, temperature = torch.randn(3, 7), 2.0
    p = torch.softmax(teacher / temperature, -1)
    q = torch.softmax(student / temperature, -1)
    naive = (p * (p.log() - q.log())).sum(-1).mean()
    assert torch.allclose(kd_divergence(student, teacher, temperature), naive, atol=1e-6)
    assert float(kd_divergence(teacher, teacher)) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match='differ in shape'):
        ensemble_logits([torch.zeros(2, 3), torch.zeros(2, 4)])


def test_perada_trains_personal_then_global_with_an_unhalved_proximal_term(tmp_path):
    proc = one_client(tmp_path, 'perada', fsplug={'perada': {'lam': 0.3, **SMALL_KD}})
    received = {n: p.detach() + 0.05 for n, p in adapter_params(proc, 'default').items()}
    proc.receive(received)
    batch = proc.stream.next()
    activate_adapters(proc.model, ('personal',))
    expected = sum(((proc.params[n.replace('.default.', '.personal.')] - t) ** 2).sum()
                   for n, t in received.items())
    assert torch.allclose(proc.method.loss(proc.model, batch, proc.state),
                          proc.model(**batch).loss + 0.3 * expected)
    assert phases_of_one_round(proc) == [('personal', ('personal',))] * 2 + [('global', ('default',))] * 2
    update = proc.end_round()
    assert proc.model.base_model.active_adapters == ['personal']
    assert update.shared and not any('.personal.' in n for n in update.shared)


def test_perada_server_distils_the_average_towards_the_clients_ensemble(tmp_path):
    """The server's global adapter starts at the FedAvg of the clients' global adapters and
    ends closer (in KL on the public prompts) to their mean logits."""
    from fs_plugins.aggregation import ensemble_logits, kd_divergence, weighted_average
    from fs_plugins.methods.base import ClientUpdate, load_tensors, weights_of
    from fs_plugins.methods.perada import prompt_end_logits
    proc = one_client(tmp_path, 'perada', fsplug={'perada': {**SMALL_KD, 'kd_steps': 30}})
    method = get_method_class('perada')(proc.cfg)
    torch.manual_seed(0)
    base = proc.method.shared_tensors(proc.model, proc.trainable_names)
    updates = [ClientUpdate(cid, 10, {n: t + 0.05 * torch.randn_like(t) for n, t in base.items()})
               for cid in (1, 2, 3)]
    state = method.aggregate(method.init_server_state(base), updates)
    assert state['rounds'] == 1
    averaged = weighted_average([u.shared for u in updates], weights_of(updates))
    built, batches = method.server_model(updates)

    def kl_to_teacher(tensors):
        activate_adapters(built.model, ('default',))
        built.model.eval()
        with torch.no_grad():
            teacher = []
            for update in updates:
                load_tensors(built.model, update.shared)
                teacher.append([prompt_end_logits(built.model, b, 'cpu') for b in batches])
            load_tensors(built.model, tensors)
            return sum(float(kd_divergence(prompt_end_logits(built.model, b, 'cpu'),
                                           ensemble_logits([t[i] for t in teacher])))
                       for i, b in enumerate(batches))
    assert kl_to_teacher(state['global']) < 0.8 * kl_to_teacher(averaged)
    # kd_rounds: distillation only in the first rounds, then plain FedAvg
    plain = get_method_class('perada')(proc.cfg)
    plain.hparams.kd_rounds = 0
    state = plain.aggregate(plain.init_server_state(base), updates)
    assert all(torch.allclose(state['global'][n], averaged[n].float()) for n in averaged)


def test_perada_server_model_must_fit_the_updates(tmp_path):
    from fs_plugins.methods.base import ClientUpdate
    proc = one_client(tmp_path, 'perada', fsplug={'perada': SMALL_KD})
    method = get_method_class('perada')(proc.cfg)
    wrong = ClientUpdate(3, 10, {'x.lora_A.default.weight': torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="client 3's update does not fit"):
        method.aggregate(method.init_server_state({}), [wrong])


def test_perada_distils_each_architecture_with_its_clients_model(tmp_path, monkeypatch):
    """Clients on two model types, aggregated per architecture: the server builds one
    distillation model per type, from the configs of that type's clients."""
    from fs_plugins.methods.perada import PerAda
    built_for = []
    original = PerAda.server_model

    def spy(self, updates):
        built, batches = original(self, updates)
        built_for.append(({u.client_id for u in updates}, built.model.config.hidden_size))
        return built, batches
    monkeypatch.setattr(PerAda, 'server_model', spy)
    run(tmp_path, 'perada', rounds=1, client_cfgs={
        f'client_{i}': {'model': {'type': 'tiny-llama-large@fsplug_llm'}} for i in (3, 4)},
        fsplug={'perada': SMALL_KD, 'aggregation': {'per_architecture': True}})
    sizes = dict((frozenset(ids), size) for ids, size in built_for)
    assert set(sizes) == {frozenset({1, 2}), frozenset({3, 4})}
    assert sizes[frozenset({1, 2})] != sizes[frozenset({3, 4})]


@pytest.mark.parametrize('source, message', [
    ('/nowhere/public.jsonl', 'fsplug.perada.public_data: file not found: /nowhere/public.jsonl'),
    ('no_such_builtin', "fsplug.perada.public_data = 'no_such_builtin': give a .json/.jsonl"),
])
def test_perada_bad_public_data_names_the_key(tmp_path, source, message):
    from fs_plugins.core.errors import ConfigError
    from fs_plugins.methods.base import ClientUpdate
    proc = one_client(tmp_path, 'perada', fsplug={'perada': {**SMALL_KD, 'public_data': source}})
    method = get_method_class('perada')(proc.cfg)
    update = ClientUpdate(1, 10, proc.method.shared_tensors(proc.model, proc.trainable_names))
    with pytest.raises(ConfigError, match=re.escape(message)):
        method.aggregate(method.init_server_state(update.shared), [update])



@pytest.mark.parametrize('method', ['ditto', 'fedsim', 'feddat', 'perada'])
def test_twin_adapter_methods_refuse_vera_naming_the_key(tmp_path, method):
    from fs_plugins.core.errors import ConfigError
    with pytest.raises(ConfigError, match=rf"fsplug.model.adapter = 'vera': fsplug.method = "
                                          rf"'{method}'.*needs 'lora'"):
        load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(
            tmp_path, method, fsplug={'method': method, 'model': {'adapter': 'vera'}})))


# FedMosaic A.6: "Federated distillation baselines (i.e., TAKFL, PerAda, and FedMKT) share
# knowledge between heterogeneous models via logits"; Tables 4 and 19 run PerAda across model
# families. Clients 3-4 on the tiny OLMo (another family, the same offline tokenizer).
CROSS_FAMILY = {f'client_{i}': {'model': {'type': 'tiny-olmo@fsplug_llm'},
                                'fsplug': {'model': {'builder': 'tiny_olmo'}}} for i in (3, 4)}


@pytest.mark.slow
def test_perada_distils_across_model_families(tmp_path, monkeypatch):
    """One teacher from all four clients' logits (each on its own family's model); each family's
    averaged global adapter is distilled towards it; each client gets its family's adapter."""
    from fs_plugins.methods.perada import OWN, PerAda
    teachers, states = [], []
    original_teacher, original_across = PerAda.teacher_logits, PerAda.aggregate_across

    def spy_teacher(self, parts):
        teachers.append(sorted(u.client_id for _, _, updates in parts for u in updates))
        return original_teacher(self, parts)

    def spy_across(self, server_state, groups):
        states.append(original_across(self, server_state, groups))
        return states[-1]
    monkeypatch.setattr(PerAda, 'teacher_logits', spy_teacher)
    monkeypatch.setattr(PerAda, 'aggregate_across', spy_across)
    results, clients = run(tmp_path, 'perada', rounds=2, client_cfgs=CROSS_FAMILY,
                           fsplug={'perada': SMALL_KD})
    assert teachers == [[1, 2, 3, 4]] * 2
    state = states[-1]
    other = state['client_group']['3']
    assert state['client_group'] == {'1': OWN, '2': OWN, '3': other, '4': other} and other != OWN
    assert clients[3].model.config.model_type == 'olmo' != clients[1].model.config.model_type
    for cid, expected in ((1, state['global']), (3, state['globals'][other])):
        params = clients[cid].params   # what the client received for the final evaluation
        assert expected and all(torch.equal(params[n], t.to(params[n].dtype))
                                for n, t in expected.items())
    assert not any(torch.equal(state['global'][n], t) for n, t in state['globals'][other].items()
                   if n in state['global'] and state['global'][n].shape == t.shape)


def test_perada_shared_vocabulary():
    from fs_plugins.methods.base import ClientUpdate
    from fs_plugins.methods.perada import shared_vocabulary

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)
    same = shared_vocabulary({'a': Tok({'x': 0, 'y': 1}), 'b': Tok({'x': 0, 'y': 1})}, {})
    assert same == {'a': None, 'b': None}
    index = shared_vocabulary({'a': Tok({'x': 0, 'y': 1, 'z': 2}), 'b': Tok({'z': 0, 'w': 1, 'x': 2})}, {})
    assert index['a'].tolist() == [0, 2] and index['b'].tolist() == [2, 0]   # 'x', 'z'
    with pytest.raises(ValueError, match=r"share no token .*\{'a': \[1\], 'b': \[2\]\}"):
        shared_vocabulary({'a': Tok({'x': 0}), 'b': Tok({'y': 0})},
                          {'a': [ClientUpdate(1, 1, {})], 'b': [ClientUpdate(2, 1, {})]})

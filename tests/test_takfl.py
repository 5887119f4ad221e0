"""TAKFL: its maths (prototype grouping, the self-regularised distillation loss, task vectors,
their task-arithmetic merge, the heuristic's candidate coefficients) against naive loops, its
server on the tiny federation (one prototype, then clients on two model sizes), and the
heterogeneous federation through FederatedScope standalone and distributed."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import deep_update, tiny_config, write_yaml
from test_methods import direct_method, run, train_rows

from fs_plugins.aggregation.takfl import (
    candidate_coefficients,
    group_by_prototype,
    merge_task_vectors,
    takfl_distillation_loss,
    task_vectors,
)
from fs_plugins.core.errors import ConfigError
from fs_plugins.core.seeding import derive_seed
from fs_plugins.methods.base import ClientUpdate, load_tensors
from fs_plugins.methods.takfl import prototype_label

SMALL_KD = {'kd_batch_size': 4, 'public_samples': 8, 'search_candidates': 2}
# clients 3-4 on the larger tiny Llama; 1-2, without an entry, on the run's
TWO_PROTOTYPES = {f'client_{i}': {'model': {'type': 'tiny-llama-large@fsplug_llm'}} for i in (3, 4)}


def test_group_by_prototype_keeps_each_prototypes_clients_in_order():
    prototypes = {4: 'b', 1: 'a', 3: 'b', 2: 'a', 7: 'c'}
    naive = {}
    for client in prototypes:
        members = [c for c, p in prototypes.items() if p == prototypes[client]]
        naive[prototypes[client]] = members
    assert group_by_prototype(prototypes) == naive == {'b': [4, 3], 'a': [1, 2], 'c': [7]}


def test_distillation_loss_is_the_scaled_teacher_kl_plus_the_self_regulariser():
    torch.manual_seed(0)
    student = torch.randn(3, 5)
    teacher = torch.softmax(torch.randn(3, 5), -1)
    own = torch.softmax(torch.randn(3, 5) / 20, -1)
    temperature, self_temperature, gamma = 3.0, 20.0, 0.5
    naive = 0.0
    for row in range(3):
        log_t = F.log_softmax(student[row] / temperature, -1)
        log_s = F.log_softmax(student[row] / self_temperature, -1)
        naive += temperature ** 2 * sum(float(teacher[row, i] * (teacher[row, i].log() - log_t[i]))
                                        for i in range(5)) / 3
        naive += gamma * self_temperature ** 2 * sum(
            float(own[row, i] * (own[row, i].log() - log_s[i])) for i in range(5)) / 3
    loss = takfl_distillation_loss(student, teacher, own, temperature, self_temperature, gamma)
    assert float(loss) == pytest.approx(naive, rel=1e-5)
    without = takfl_distillation_loss(student, teacher, own, temperature, self_temperature, 0.0)
    assert float(without) < float(loss)


def test_task_vectors_and_their_merge_match_loops():
    gen = torch.Generator().manual_seed(1)
    base = {'a': torch.randn(2, 3, generator=gen), 'b': torch.randn(4, generator=gen)}
    distilled = [{k: v + torch.randn(v.shape, generator=gen) for k, v in base.items()}
                 for _ in range(3)]
    vectors = task_vectors(distilled, base)
    coefficients = [0.2, 0.3, 0.5]
    merged = merge_task_vectors(base, vectors, coefficients)
    for name in base:
        flat = base[name].flatten()
        for i in range(flat.numel()):
            naive = float(flat[i]) + sum(c * (float(d[name].flatten()[i]) - float(flat[i]))
                                         for c, d in zip(coefficients, distilled))
            assert float(merged[name].flatten()[i]) == pytest.approx(naive, abs=1e-5)
    assert all(torch.equal(merge_task_vectors(base, vectors, [0, 0, 0])[k], base[k]) for k in base)
    with pytest.raises(ValueError, match='3 task vectors but 2 coefficients'):
        merge_task_vectors(base, vectors, [0.5, 0.5])
    with pytest.raises(ValueError, match="lacks \\['b'\\]"):
        task_vectors([{'a': base['a']}], base)


def test_candidate_coefficients_are_the_uniform_then_sorted_normalised_beta_draws():
    candidates = candidate_coefficients(3, 4, np.random.default_rng(5))
    assert len(candidates) == 1 + 3 * 4
    assert candidates[0] == [1 / 3] * 3
    rng = np.random.default_rng(5)
    for index, exponent in enumerate(e for e in (1, 5, 10) for _ in range(4)):
        draws = sorted(float(x) ** exponent for x in rng.beta(1.0, 100.0, size=3))
        naive = [d / sum(draws) for d in draws]
        assert candidates[1 + index] == pytest.approx(naive)
        assert candidates[1 + index] == sorted(candidates[1 + index])
    assert candidate_coefficients(1, 2, np.random.default_rng(0)) == [[1.0]] * 7


def uploads(method, scale):
    """Two clients' uploads of the run's model: its initial LoRA moved by ±`scale` noise."""
    key = method.architecture(method.cfg)
    model = method._models[key][0].model
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    gen = torch.Generator().manual_seed(3)
    return initial, [ClientUpdate(cid, n, {k: v + scale * torch.randn(v.shape, generator=gen)
                                           for k, v in initial.items()})
                     for cid, n in ((1, 10), (2, 30))]


def test_zero_coefficients_give_the_prototype_average_and_every_client_receives_it(tmp_path):
    method = direct_method(tmp_path, 'takfl', fsplug={'takfl': {**SMALL_KD, 'coefficients': 'given',
                                                               'task_weights': [0.0]}})
    initial, updates = uploads(method, 0.01)
    state = method.aggregate(method.init_server_state(initial), updates)
    for name in initial:
        naive = (10 * updates[0].shared[name] + 30 * updates[1].shared[name]) / 40
        assert torch.allclose(state['global'][name], naive, atol=1e-6)
    assert state['rounds'] == 1 and set(state['prototypes']) == {prototype_label(method.cfg)}
    for cid in (1, 2, 3):   # 3 did not report: it shares the prototype, so it receives it too
        assert all(torch.equal(method.content_for(state, cid)[n], state['global'][n])
                   for n in initial)
    assert method.content_for(method.init_server_state(initial), 1) == {}


@pytest.mark.parametrize('metric', ['accuracy', 'loss'])
def test_distillation_moves_the_average_and_the_search_takes_the_best_candidate(tmp_path, metric):
    """λ = 1 gives the model distilled from the prototype's own clients (changed from the
    average); 'search' returns the candidate whose merge scores best on the public set: the
    highest answer-token accuracy (the default, the code's validation accuracy), or the lowest
    answer loss."""
    method = direct_method(tmp_path, 'takfl', fsplug={'takfl': {**SMALL_KD, 'coefficients': 'given',
                                                               'task_weights': [1.0]}})
    initial, updates = uploads(method, 0.05)
    distilled = method.aggregate(method.init_server_state(initial), updates)['global']
    method.hparams.task_weights = [0.0]
    averaged = method.aggregate(method.init_server_state(initial), updates)['global']
    assert any(not torch.allclose(distilled[n], averaged[n]) for n in initial)
    method.hparams.coefficients, method.hparams.search_metric = 'search', metric
    key = method.architecture(method.cfg)
    vectors = task_vectors([distilled, initial], averaged)   # two directions to weigh
    chosen = method.coefficients_for(key, averaged, vectors, 'p', 4)
    rng = np.random.default_rng(derive_seed(method.cfg.seed, 'takfl-search', 4, 'p'))
    scores = {}
    model = method._models[key][0]
    for candidate in candidate_coefficients(2, SMALL_KD['search_candidates'], rng):
        merged = merge_task_vectors(averaged, vectors, candidate)
        if metric == 'loss':
            score = -float(method.measure(key, merged)[0].mean())
        else:   # answer-token accuracy, counted by hand
            load_tensors(model.model, merged)
            correct = total = 0
            with torch.no_grad():
                for batch in method._models[key][1]:
                    logits = model.model(**{k: v for k, v in batch.items() if k != 'labels'}).logits
                    targets = batch['labels'][:, 1:]
                    kept = targets != -100
                    correct += int((logits[:, :-1].argmax(-1)[kept] == targets[kept]).sum())
                    total += int(kept.sum())
            score = correct / total
        scores.setdefault(score, candidate)
    assert chosen == scores[max(scores)]


def test_task_weights_must_match_the_teacher_prototypes(tmp_path):
    method = direct_method(tmp_path, 'takfl', fsplug={'takfl': {**SMALL_KD, 'coefficients': 'given',
                                                               'task_weights': [0.5, 0.5]}})
    initial, updates = uploads(method, 0.01)
    with pytest.raises(ConfigError, match=r'fsplug.takfl.task_weights: 2 value\(s\) for 1 teacher'):
        method.aggregate(method.init_server_state(initial), updates)


@pytest.mark.slow
def test_two_prototypes_each_receive_their_own_merged_model(tmp_path):
    """Clients 3-4 on the larger tiny Llama, 1-2 on the run's: both prototypes are merged from
    two teachers, and every client trains and receives content of its own shapes."""
    results, clients = run(tmp_path, 'takfl', client_cfgs=TWO_PROTOTYPES,
                           fsplug={'takfl': SMALL_KD})
    hidden = {cid: proc.model.config.hidden_size for cid, proc in clients.items()}
    assert hidden[1] == hidden[2] != hidden[3] == hidden[4]
    assert {r['client'] for r in train_rows(results)} == {1, 2, 3, 4}
    assert all(r['bytes_down'] > 0 for r in train_rows(results) if r['round'] == 1)


def test_bad_public_data_names_the_key(tmp_path):
    method = direct_method(tmp_path, 'takfl', fsplug={'takfl': {'public_data': '/nowhere/p.jsonl'}})
    with pytest.raises(ConfigError, match='fsplug.takfl.public_data: file not found'):
        method.architecture(method.cfg)


def fs_config(tmp_path, **updates):
    cfg = tiny_config(tmp_path, 'takfl', rounds=2, steps=3, **updates)
    deep_update(cfg, {'fsplug': {'takfl': SMALL_KD}})
    return cfg


@pytest.mark.fs
def test_fs_standalone_with_two_prototypes_matches_embedded(tmp_path):
    from test_fs_integration import (
        _embedded_rows,
        assert_same_artifacts,
        assert_same_numbers,
        read_rows,
        run_fs_in_process,
    )
    cfg = fs_config(tmp_path, fsplug={'results_dir': str(tmp_path / 'fs')})
    proc = run_fs_in_process(['--cfg', write_yaml(tmp_path / 'fs.yaml', cfg),
                   '--client_cfg', write_yaml(tmp_path / 'clients.yaml', TWO_PROTOTYPES)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_numbers(read_rows(str(tmp_path / 'fs')),
                        _embedded_rows(tmp_path, cfg, TWO_PROTOTYPES))
    assert_same_artifacts(str(tmp_path / 'fs'), str(tmp_path / 'embedded'))


@pytest.mark.fs
def test_fs_distributed_with_two_prototypes_matches_embedded(tmp_path):
    """Server + 2 client processes over gRPC, client 2 on the larger tiny Llama: the server
    distils between the two prototypes; same numbers and models as the embedded runner."""
    from test_fs_integration import assert_distributed_matches_embedded
    base = fs_config(tmp_path, federate={'client_num': 2, 'sample_client_num': 2},
                     data={'splitter': 'iid'})
    assert_distributed_matches_embedded(tmp_path, base, {'client_2': TWO_PROTOTYPES['client_3']})

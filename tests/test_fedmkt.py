"""FedMKT: its maths (MinED token alignment, the aligned teacher distribution, the selective
teachers and KD loss) against naive formulas, and its server's mutual distillation on the tiny
federation, homogeneous and with clients on two model sizes."""
import functools

import pytest
import torch
import torch.nn.functional as F
from test_methods import direct_method, run, train_rows

from fs_plugins.aggregation.fedmkt import (
    align_probabilities,
    answer_losses,
    edit_distance,
    min_edit_distance_alignment,
    prompt_end_rows,
    select_teachers,
    selective_kd_loss,
)
from fs_plugins.methods.base import ClientUpdate

SMALL_KD = {'kd_batch_size': 4, 'public_samples': 8}


def naive_edit_distance(a: str, b: str) -> int:
    @functools.cache
    def d(i, j):
        if not i or not j:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
    return d(len(a), len(b))


@pytest.mark.parametrize('a, b', [('', 'abc'), ('kitten', 'sitting'), ('flaw', 'lawn'),
                                  ('abc', 'abc'), ('Ġthe', 'the')])
def test_edit_distance_matches_the_recursive_definition(a, b):
    assert edit_distance(a, b) == naive_edit_distance(a, b)


def test_min_edit_distance_alignment_matches_the_brute_force_argmin():
    source = ['Ġthe', 'cat', 'sat', 'Ġon', 'mat', 'zzz', '<s>']
    target = ['<pad>', '▁the', 'ca', 'sit', '▁on', 'mat', 'cat', '<s>', 'mat']
    space = lambda t: t.replace('Ġ', ' ').replace('▁', ' ')   # noqa: E731
    naive = []
    for token in source:
        distances = [naive_edit_distance(space(token), space(t)) for t in target]
        naive.append(distances.index(min(distances)))   # ties: the lowest target id
    mapping = min_edit_distance_alignment(source, target)
    assert mapping.tolist() == naive
    assert mapping.tolist()[:2] == [1, 6] and mapping[4] == 5   # exact spellings, first 'mat'


def test_aligned_probabilities_sum_the_mass_mapped_onto_each_target_token():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(3, 5), -1)
    mapping = torch.tensor([2, 0, 2, 3, 0])
    aligned = align_probabilities(probs, mapping, 4)
    naive = torch.zeros(3, 4)
    for row in range(3):
        for i, j in enumerate(mapping.tolist()):
            naive[row, j] += probs[row, i]
    assert torch.allclose(aligned, naive)
    assert torch.allclose(aligned.sum(-1), torch.ones(3))
    with pytest.raises(ValueError, match='5 source tokens but a mapping of 4'):
        align_probabilities(probs, mapping[:4], 4)


def test_select_teachers_takes_the_lowest_loss_and_keeps_it_only_below_the_student():
    teacher_losses = torch.tensor([[1.0, 3.0, 0.5, 2.0], [2.0, 1.0, 0.7, 2.5]])
    student_losses = torch.tensor([1.5, 0.9, 1.0, 1.0])
    index, keep = select_teachers(teacher_losses, student_losses)
    naive_index, naive_keep = [], []
    for col in range(4):
        column = teacher_losses[:, col].tolist()
        naive_index.append(column.index(min(column)))
        naive_keep.append(min(column) < float(student_losses[col]))
    assert index.tolist() == naive_index == [0, 1, 0, 0]
    assert keep.tolist() == naive_keep == [True, False, True, False]


def test_selective_kd_loss_is_the_kept_rows_kl_over_all_rows():
    torch.manual_seed(1)
    student = torch.randn(4, 6)
    teacher = torch.softmax(torch.randn(4, 6) / 0.5, -1)
    keep = torch.tensor([True, False, True, False])
    for temperature in (1.0, 2.0):
        naive = sum(F.kl_div(F.log_softmax(student[r] / temperature, -1), teacher[r],
                             reduction='sum') for r in (0, 2)) / 4
        assert torch.allclose(selective_kd_loss(student, teacher, keep, temperature), naive,
                              atol=1e-6)
    assert float(selective_kd_loss(student, teacher, torch.zeros(4, dtype=torch.bool))) == 0.0


def test_answer_losses_and_prompt_end_rows_match_a_loop():
    torch.manual_seed(2)
    logits = torch.randn(2, 6, 7)
    labels = torch.tensor([[-100, -100, 3, 4, -100, -100], [-100, 1, 2, 5, 6, -100]])
    losses = answer_losses(logits, labels, -100)
    for row in range(2):
        answer = [t for t in range(1, 6) if labels[row, t] != -100]
        naive = sum(float(F.cross_entropy(logits[row, t - 1:t], labels[row, t:t + 1]))
                    for t in answer) / len(answer)
        assert abs(float(losses[row]) - naive) < 1e-5
        assert torch.equal(prompt_end_rows(logits, labels, -100)[row], logits[row, answer[0] - 1])
    with pytest.raises(ValueError, match='no answer token'):
        answer_losses(logits, torch.full((2, 6), -100), -100)


def test_selective_transfer_teaches_only_the_worse_side(tmp_path):
    """A server adapter trained on the public set (lower loss on every sample than the clients'
    untrained ones) is never taught by them: with λ = 1 it stays as it was. It teaches them:
    each client receives its own adapter, changed and now with a lower public loss."""
    method = direct_method(tmp_path, 'fedmkt', fsplug={'fedmkt': {**SMALL_KD, 'kd_weight': 1.0,
                                                                 'kd_epochs': 3, 'kd_lr': 0.01}})
    key = method.architecture(method.cfg)
    built, _ = method._models[key]
    initial = {n: p.detach().clone() for n, p in built.model.named_parameters() if p.requires_grad}
    method.hparams.kd_weight, method.hparams.kd_epochs = 0.0, 10   # CE only: a better server
    vocab = built.model.config.vocab_size
    trained = method.distil(key, initial, torch.zeros(8, vocab), torch.zeros(8, dtype=torch.bool),
                            ('test',))
    method.hparams.kd_weight, method.hparams.kd_epochs = 1.0, 3
    client_losses, _ = method.measure(key, initial)
    server_losses, _ = method.measure(key, trained)
    assert bool((server_losses < client_losses).all())
    updates = [ClientUpdate(cid, 10, dict(initial)) for cid in (1, 2)]
    state = method.aggregate(method.init_server_state(trained), updates)
    assert state['rounds'] == 1
    assert all(torch.equal(state['global'][n], trained[n]) for n in trained)
    for cid in (1, 2):
        received = method.content_for(state, cid)
        assert set(received) == set(initial)
        assert float(method.measure(key, received)[0].mean()) < float(client_losses.mean())
    assert method.content_for(state, 3) == {}   # not reported yet: keeps its own adapter


def test_the_public_loop_hands_each_batch_its_rows_and_restores_the_frozen_flags(tmp_path):
    """ServerModels.train_on_public: kd_epochs passes, each batch's loss given the slice of
    public samples it holds; the adapter trained, the model's requires_grad flags as before,
    and the same seed tags give the same adapter."""
    method = direct_method(tmp_path, 'fedmkt', fsplug={'fedmkt': {**SMALL_KD, 'kd_epochs': 2}})
    key = method.architecture(method.cfg)
    model = method._models[key][0].model
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    seen = []

    def loss(logits, labels, rows):
        seen.append((rows, labels.shape[0]))
        return answer_losses(logits, labels, -100).mean()
    trained = method.train_on_public(key, lora, loss, ('test',))
    assert seen == [(slice(0, 4), 4), (slice(4, 8), 4)] * 2
    assert set(trained) == set(lora) and any(not torch.equal(trained[n], lora[n]) for n in lora)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    again = method.train_on_public(key, lora, loss, ('test',))
    assert all(torch.equal(trained[n], again[n]) for n in lora)


@pytest.mark.slow
def test_heterogeneous_clients_learn_through_the_server_model(tmp_path):
    """Clients 3-4 on the larger tiny Llama, 1-2 (and the server) on the run's: every client
    trains, and each architecture's adapter goes back to its own clients."""
    results, clients = run(tmp_path, 'fedmkt', client_cfgs={
        f'client_{i}': {'model': {'type': 'tiny-llama-large@fsplug_llm'}} for i in (3, 4)},
        fsplug={'fedmkt': SMALL_KD})
    hidden = {cid: proc.model.config.hidden_size for cid, proc in clients.items()}
    assert hidden[1] == hidden[2] != hidden[3] == hidden[4]
    assert {r['client'] for r in train_rows(results)} == {1, 2, 3, 4}
    assert all(r['bytes_down'] > 0 for r in train_rows(results) if r['round'] == 1)


def test_bad_public_data_names_the_key(tmp_path):
    from fs_plugins.core.errors import ConfigError
    method = direct_method(tmp_path, 'fedmkt', fsplug={'fedmkt': {'public_data': '/nowhere/p.jsonl'}})
    with pytest.raises(ConfigError, match='fsplug.fedmkt.public_data: file not found'):
        method.architecture(method.cfg)


TWO_SIZES = {'client_3': {'model': {'type': 'tiny-llama-large@fsplug_llm'}},
             'client_4': {'model': {'type': 'tiny-llama-large@fsplug_llm'}}}


@pytest.mark.parametrize('server_model', ['largest', 'run'])
def test_the_server_model_is_the_largest_unless_told_the_runs(tmp_path, server_model):
    """FedMKT's server LLM is the largest (server_model 'largest'): with clients 3-4 on the
    larger tiny Llama, the server distils into that model's LoRA (kept as 'server'; the run's
    global stays its initial adapter); 'run' distils into the run's model, its global."""
    from fs_plugins.run.config import client_config
    method = direct_method(tmp_path, 'fedmkt', fsplug={'fedmkt': {**SMALL_KD,
                                                                 'server_model': server_model}})
    method.client_configs = {cid: client_config(method.cfg, TWO_SIZES.get(f'client_{cid}'))
                             for cid in (1, 2, 3, 4)}
    run_key = method.architecture(method.cfg)
    large_key = method.architecture(method.client_configs[3])
    assert method.model_size(large_key) > method.model_size(run_key)
    updates = []
    for cid in (1, 3):
        lora = method.initial_lora(method.architecture(method.client_configs[cid]))
        updates.append(ClientUpdate(cid, 10, {k: v + 0.01 for k, v in lora.items()}))
    initial = method.initial_lora(run_key)
    state = method.aggregate(method.init_server_state(initial), updates)
    if server_model == 'largest':
        large = method.initial_lora(large_key)
        assert {k: v.shape for k, v in state['server'].items()} == {k: v.shape for k, v in large.items()}
        assert all(torch.equal(state['global'][k], initial[k]) for k in initial)
    else:
        assert 'server' not in state and any(not torch.equal(state['global'][k], initial[k])
                                             for k in initial)
    assert set(state['clients']) == {'1', '3'}


@pytest.mark.parametrize('method_name', ['fedmkt', 'takfl'])
def test_distillation_trains_at_the_training_rate_by_default(tmp_path, monkeypatch, method_name):
    """kd_lr 0 (the default): Adam at train.optimizer.lr; a kd_lr given is used as it is."""
    rates = []
    real_adam = torch.optim.Adam
    monkeypatch.setattr(torch.optim, 'Adam', lambda params, lr: rates.append(lr) or real_adam(params, lr=lr))
    for kd_lr in (0.0, 0.02):
        method = direct_method(tmp_path / str(kd_lr), method_name,
                               fsplug={method_name: {**SMALL_KD, 'kd_lr': kd_lr}})
        key = method.architecture(method.cfg)
        method.train_on_public(key, method.initial_lora(key),
                               lambda logits, labels, rows: logits.float().mean(), ('t',))
    assert rates == [float(method.cfg.train.optimizer.lr), 0.02]

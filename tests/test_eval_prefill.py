"""fsplug.eval.shared_prefill: the generated records' token metrics come from their generation's
prompt pass (cache cropped back to the prompt, continued with the reference answer). The
numbers and answers must be the old two-pass path's, on the tiny text model and the tiny
vision-language models; models that cannot continue a cache keep the old path."""
import json
import logging
import os

import pytest
import torch
from helpers import REPO, tiny_config, write_yaml
from test_multimodal import vl_config

from fs_plugins.data.instruction import IGNORE_INDEX
from fs_plugins.methods.building import build_model
from fs_plugins.methods.fedavg import FedAvg
from fs_plugins.methods.registry import get_method_class
from fs_plugins.models.codecs import EncodedDataset
from fs_plugins.run import evaluation
from fs_plugins.run.config import load_config
from fs_plugins.run.runtime import build_clients, build_federated_records

QUESTIONS = ['what colour is it?', 'colour?', 'tell me which colour this picture shows, please?',
             'what is the colour of the square in the image?', 'hue?', 'which colour?']


def counting_plain_passes(monkeypatch) -> list[int]:
    """The indices `record_token_stats` (the plain forward over examples) is given, as it runs."""
    plain, original = [], evaluation.record_token_stats

    def spy(model, dataset, indices, *args, **kwargs):
        plain.extend(indices)
        return original(model, dataset, indices, *args, **kwargs)
    monkeypatch.setattr(evaluation, 'record_token_stats', spy)
    return plain


def both_paths(model, dataset, eval_cfg, tmp_path, groups, monkeypatch, batch_size=3):
    """{shared_prefill: (metrics, answers, indices scored by the plain forward)}."""
    outcome = {}
    plain = counting_plain_passes(monkeypatch)
    for shared in (False, True):
        eval_cfg.shared_prefill = shared
        path = str(tmp_path / f'predictions_{shared}.jsonl')
        plain.clear()
        with torch.no_grad():
            metrics = evaluation.evaluation_metrics(model, dataset, eval_cfg, batch_size, 'test',
                                                    predictions=(path, 1), groups=groups)
        with open(path) as handle:
            answers = [json.loads(line)['prediction'] for line in handle]
        outcome[shared] = metrics, answers, sorted(plain)
    return outcome


def assert_same_results(outcome, dataset, chosen):
    (old, old_answers, old_plain), (new, new_answers, new_plain) = outcome[False], outcome[True]
    assert old_plain == list(range(len(dataset)))
    # the generated records' metrics came from the shared pass, the others from the plain one
    assert new_plain == [i for i in range(len(dataset)) if i not in chosen]
    assert new_answers == old_answers
    assert any(old_answers), old_answers   # empty answers would make any two runs agree
    assert sorted(new) == sorted(old)
    for key, value in old.items():
        assert new[key] == pytest.approx(value, abs=1e-5, rel=1e-5), key


def text_client(tmp_path, **eval_options):
    cfg = load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, fsplug={'eval': {
        'generate': True, 'max_new_tokens': 4, 'gen_metrics': ['vqa_exact'], **eval_options}})))
    records = build_federated_records(cfg)
    return build_clients(cfg, get_method_class('fedavg'), records, {}, 'cpu', [1])[1]


@pytest.mark.parametrize('cap', [0, 2])
def test_text_model_gives_the_old_numbers_and_answers(tmp_path, monkeypatch, cap):
    client = text_client(tmp_path, max_gen_samples=cap)
    client.model.eval()
    dataset = client.eval_data['test']
    assert len(dataset) >= 5
    # two groups, as test modalities: the cap applies per group, results per group too
    groups = {'even': list(range(0, len(dataset), 2)), 'odd': list(range(1, len(dataset), 2))}
    outcome = both_paths(client.model, dataset, client.cfg.fsplug.eval, tmp_path, groups,
                         monkeypatch)
    chosen = evaluation.generated_indices(len(dataset), cap, groups)
    assert_same_results(outcome, dataset, chosen)
    assert {'test_even_avg_loss', 'test_odd_token_acc', 'test_even_vqa_exact'} <= set(outcome[True][0])


@pytest.mark.parametrize('builder', ['tiny_llava', 'tiny_qwen2_vl'])
def test_vision_language_models_give_the_old_numbers_and_answers(tmp_path, monkeypatch, builder):
    cfg, _ = vl_config(tmp_path, builder)
    cfg.fsplug.eval.max_new_tokens = 4
    built = build_model(cfg, FedAvg(cfg))
    built.model.eval()
    records = build_federated_records(cfg).clients[1]['test'] + \
        build_federated_records(cfg).clients[2]['test']
    # prompts of different lengths: left padding inside a batch, images of several colours
    records = [{**r, 'question': q} for r, q in zip(records, QUESTIONS)]
    dataset = EncodedDataset(records, built.codec, 'test')
    groups = {'first': [0, 1, 2, 3], 'second': [4, 5]}
    cfg.fsplug.eval.max_gen_samples = 3
    outcome = both_paths(built.model, dataset, cfg.fsplug.eval, tmp_path, groups, monkeypatch,
                         batch_size=4)
    assert_same_results(outcome, dataset, [0, 1, 2, 4, 5])


def test_a_prompt_the_example_does_not_begin_with_takes_the_plain_pass():
    """A text codec tokenises prompt + answer together: where that merges tokens across the
    boundary the example does not continue the generation prompt."""
    prompt = {'input_ids': torch.tensor([5, 6, 7]), 'attention_mask': torch.ones(3, dtype=torch.long)}
    example = {'input_ids': torch.tensor([5, 6, 7, 8, 2]), 'attention_mask': torch.ones(5, dtype=torch.long),
               'labels': torch.tensor([IGNORE_INDEX] * 3 + [8, 2])}
    answer = evaluation.answer_after(prompt, example)
    assert answer['input_ids'].tolist() == [8, 2] and answer['labels'].tolist() == [8, 2]
    merged = {**example, 'input_ids': torch.tensor([5, 6, 9, 8, 2])}
    assert evaluation.answer_after(prompt, merged) is None
    scored_prompt = {**example, 'labels': torch.tensor([IGNORE_INDEX, IGNORE_INDEX, 7, 8, 2])}
    assert evaluation.answer_after(prompt, scored_prompt) is None
    media = {**prompt, 'pixel_values': torch.zeros(1, 3)}
    assert evaluation.answer_after(media, {**example, 'pixel_values': torch.ones(1, 3)}) is None


def test_encoder_llm_cannot_continue_its_cache_and_keeps_the_old_path(tmp_path, caplog,
                                                                      monkeypatch):
    cfg = load_config(os.path.join(REPO, 'yamls', 'uniflow', 'tiny.yaml'), [
        'data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
        'fsplug.results_dir', str(tmp_path / 'results'), 'fsplug.eval.generate', 'True',
        'fsplug.eval.max_new_tokens', '2', 'fsplug.eval.max_gen_samples', '2',
        'fsplug.eval.gen_metrics', "['vqa_exact']", 'fsplug.data.test_records', 'all'])
    records = build_federated_records(cfg)
    client = build_clients(cfg, get_method_class(cfg.fsplug.method), records, {}, 'cpu', [3])[3]
    client.model.eval()
    dataset = client.eval_data['test']
    groups = evaluation.modality_groups(dataset)
    assert len(groups) > 1
    with caplog.at_level(logging.DEBUG, logger=evaluation.__name__):
        outcome = both_paths(client.model, dataset, client.cfg.fsplug.eval, tmp_path, groups,
                             monkeypatch)
    assert 'cannot continue its generation cache' in caplog.text
    assert outcome[True][2] == list(range(len(dataset)))   # every record: the plain pass
    assert outcome[True][:2] == outcome[False][:2]


def test_a_sequence_classifier_cannot_continue_a_cache(tmp_path):
    cfg = load_config(os.path.join(REPO, 'yamls', 'glue', 'tiny.yaml'), [
        'data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp')])
    built = build_model(cfg, get_method_class('fedavg')(cfg))
    assert not evaluation.continues_cache(built.model)


def test_client_evaluation_times_its_parts_and_resets(tmp_path):
    client = text_client(tmp_path, max_gen_samples=2)
    results = client.evaluate('test')
    assert 'test_vqa_exact' in results and 'test_avg_loss' in results
    times = client.take_eval_times()
    assert set(times) == {'eval_s', 'eval_prefill_s', 'eval_generate_s'}
    assert times['eval_prefill_s'] > 0 and times['eval_generate_s'] > 0
    assert times['eval_s'] >= times['eval_prefill_s'] + times['eval_generate_s']
    assert client.take_eval_times() == dict.fromkeys(times, 0.0)

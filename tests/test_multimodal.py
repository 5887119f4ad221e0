"""Vision-language builders (tiny LLaVA, tiny Qwen2-VL), multimodal records, answer-only
labels, batched generation and a multimodal embedded run."""
import json
import os

import pytest
import torch
from helpers import tiny_config, write_yaml
from PIL import Image

from fs_plugins.data.instruction import IGNORE_INDEX, load_records
from fs_plugins.methods.building import build_model
from fs_plugins.methods.fedavg import FedAvg
from fs_plugins.run.config import ConfigError, load_config
from fs_plugins.run.evaluation import generate_answers
from fs_plugins.sim.runner import run_embedded

COLOURS = {'red': (220, 30, 30), 'green': (30, 200, 30), 'blue': (30, 30, 220)}


def write_vqa_fixture(folder, per_colour=6) -> str:
    """Plain-colour images with 'what colour' questions, two sources, train/test marked."""
    os.makedirs(os.path.join(folder, 'images'), exist_ok=True)
    records = []
    for colour, rgb in COLOURS.items():
        for i in range(per_colour):
            name = f'images/{colour}_{i}.png'
            Image.new('RGB', (40, 40), rgb).save(os.path.join(folder, name))
            records.append({'id': f'{colour}-{i}', 'image': name, 'question': 'what colour is it?',
                            'answer': colour, 'task': 'vqa',
                            'source': 'left' if i % 2 else 'right',
                            'split': 'test' if i < 2 else 'train'})
    path = os.path.join(folder, 'vqa.jsonl')
    with open(path, 'w') as handle:
        handle.writelines(json.dumps(r) + '\n' for r in records)
    return path


def vl_config(tmp_path, builder, **updates):
    data = write_vqa_fixture(str(tmp_path / 'data'))
    cfg = tiny_config(tmp_path, 'fedavg', rounds=2, steps=2, **{
        'data': {'root': str(tmp_path / 'data'), 'type': 'vqa.jsonl@fsplug', 'splitter': 'by_source'},
        'llm': {'tok_len': 128},
        'federate': {'client_num': 2, 'sample_client_num': 2},
        'dataloader': {'batch_size': 4},
        'fsplug': {'model': {'builder': builder, 'lora': {'target_modules': ['q_proj', 'v_proj']}},
                   'data': {'split_field': 'source', 'split_from_records': True},
                   'eval': {'generate': True, 'max_new_tokens': 3, 'gen_metrics': ['vqa_acc']}}})
    cfg['model']['type'] = f'{builder}@fsplug_llm'
    from helpers import deep_update
    deep_update(cfg, updates)
    return load_config(write_yaml(tmp_path / f'{builder}.yaml', cfg)), data


@pytest.mark.parametrize('builder', ['tiny_llava', 'tiny_qwen2_vl'])
def test_vl_builder_lora_on_language_model_and_answer_labels(tmp_path, builder):
    cfg, data = vl_config(tmp_path, builder)
    built = build_model(cfg, FedAvg(cfg))
    lora = [n for n in built.trainable_names if 'lora_' in n]
    assert lora and all('language_model' in n for n in lora)
    projector = 'multi_modal_projector' if builder == 'tiny_llava' else 'visual.merger'
    assert any(projector in n for n in built.trainable_names)
    assert not any('vision_tower' in n or 'visual.blocks' in n for n in built.trainable_names)
    record = load_records(data)[0]
    example = built.codec.encode(record)
    answer_ids = example['input_ids'][example['labels'] != IGNORE_INDEX]
    assert built.codec.decode(answer_ids) == record['answer']
    batch = built.codec.collate([example, built.codec.encode(load_records(data)[3])])
    loss = built.model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    assert all(built.model.get_parameter(n).grad is not None for n in lora)


@pytest.mark.parametrize('builder', ['tiny_llava', 'tiny_qwen2_vl'])
def test_projector_switch_freezes_it(tmp_path, builder):
    cfg, _ = vl_config(tmp_path, builder, fsplug={'model': {'vision': {'train_projector': False}}})
    built = build_model(cfg, FedAvg(cfg))
    assert all('lora_' in n for n in built.trainable_names)


@pytest.mark.parametrize('builder,tower,targets', [
    ('tiny_llava', 'vision_tower', ['q_proj', 'k_proj', 'v_proj']),
    ('tiny_qwen2_vl', 'visual.blocks', ['qkv'])])
def test_tower_lora_targets_put_lora_in_the_vision_tower(tmp_path, builder, tower, targets):
    """Fed-MoLE's Table 5 bytes count LoRA on the CLIP tower's attention too."""
    cfg, data = vl_config(tmp_path, builder, fsplug={'model': {'vision': {
        'tower_lora_targets': targets, 'train_projector': False}}})
    built = build_model(cfg, FedAvg(cfg))
    lora = [n for n in built.trainable_names if 'lora_' in n]
    in_tower = [n for n in lora if tower in n]
    assert in_tower and {n.split('.lora_')[0].rsplit('.', 1)[-1] for n in in_tower} == set(targets)
    assert all(tower in n or 'language_model' in n for n in lora)
    assert all('lora_' in n for n in built.trainable_names)   # the rest of the tower stays frozen
    batch = built.codec.collate([built.codec.encode(r) for r in load_records(data)[:2]])
    built.model(**batch).loss.backward()
    assert all(built.model.get_parameter(n).grad is not None for n in in_tower)


def test_tower_lora_targets_need_a_vision_tower(tmp_path):
    cfg = load_config(write_yaml(tmp_path / 'text.yaml', tiny_config(
        tmp_path, 'fedavg', fsplug={'model': {'vision': {'tower_lora_targets': ['q_proj']}}})))
    with pytest.raises(ConfigError, match='tower_lora_targets.*no vision tower'):
        build_model(cfg, FedAvg(cfg))


@pytest.mark.parametrize('builder', ['tiny_llava', 'tiny_qwen2_vl'])
def test_batched_generation_equals_one_by_one(tmp_path, builder):
    cfg, data = vl_config(tmp_path, builder)
    built = build_model(cfg, FedAvg(cfg))
    built.model.eval()
    records = load_records(data)[:5]
    with torch.no_grad():
        batched = generate_answers(built.model, built.codec, records, 5, 4)
        single = [generate_answers(built.model, built.codec, [r], 1, 4)[0] for r in records]
    assert batched == single
    # the comparison means something only if there is text to compare: an answer that stops at
    # once (stop token first) decodes to '' and would make any two runs agree
    assert all(answer for answer in batched), batched
    # the five prompts above have the same length, so the batch needs no padding; prompts of
    # different lengths (left padding inside the batch), different images and answers
    questions = ['what colour is it?', 'colour?', 'tell me which colour this picture shows, please?',
                 'what is the colour of the square in the image?', 'hue?']
    everything = load_records(data)
    records = [{**everything[i], 'question': q} for i, q in zip((0, 6, 12, 1, 7), questions)]
    lengths = [len(built.codec.encode_prompt(r)['input_ids']) for r in records]
    assert len(set(lengths)) == len(lengths), lengths
    with torch.no_grad():
        batched = generate_answers(built.model, built.codec, records, 5, 4)
        single = [generate_answers(built.model, built.codec, [r], 1, 4)[0] for r in records]
    assert batched == single
    assert all(answer for answer in batched), batched
    assert len(set(batched)) > 1, batched     # a row mix-up in the batch would show


def test_missing_and_unreadable_images_are_named(tmp_path):
    path = write_vqa_fixture(str(tmp_path))
    os.remove(tmp_path / 'images' / 'red_3.png')
    with pytest.raises(FileNotFoundError, match=r'red_3\.png.*record red-3'):
        load_records(path)
    (tmp_path / 'images' / 'red_3.png').write_text('not an image')
    cfg, _ = vl_config(tmp_path / 'run', 'tiny_llava')
    built = build_model(cfg, FedAvg(cfg))
    record = [r for r in load_records(path) if r['id'] == 'red-3'][0]
    with pytest.raises(ValueError, match=r'red_3\.png of record red-3'):
        built.codec.encode(record)


def test_split_from_records_needs_the_field(tmp_path):
    cfg, data = vl_config(tmp_path, 'tiny_llava')
    with open(data) as handle:
        records = [json.loads(line) for line in handle]
    records[0].pop('split')
    with open(data, 'w') as handle:
        handle.writelines(json.dumps(r) + '\n' for r in records)
    with pytest.raises(ValueError, match="split_from_records.*red-0"):
        run_embedded(cfg)


def test_gen_metrics_are_checked(tmp_path):
    with pytest.raises(ConfigError, match='fsplug.eval.gen_metrics'):
        vl_config(tmp_path, 'tiny_llava', fsplug={'eval': {'gen_metrics': ['cider']}})


def test_multimodal_embedded_run_reports_vqa_accuracy_and_predictions(tmp_path):
    cfg, _ = vl_config(tmp_path, 'tiny_llava')
    results = run_embedded(cfg)
    evals = [r for r in results.rows if r['kind'] == 'eval']
    assert {r['client'] for r in evals} == {1, 2}
    for row in evals:
        assert 0.0 <= row['test_vqa_acc'] <= 1.0 and row['test_total'] == 3
    with open(os.path.join(results.out_dir, 'predictions', 'client_1.jsonl')) as handle:
        lines = handle.read().splitlines()
    first = json.loads(lines[0])
    assert len(lines) == 3 and set(first) == {'client', 'id', 'question', 'prediction', 'reference'}

"""The easyvqa default benchmark: its records, its client split and its vision-tower setup.
Needs the easy-vqa package (in the `test` extra); SmolLM2 itself is not needed here."""
import os
from collections import Counter

import pytest

easy_vqa = pytest.importorskip('easy_vqa', reason='the easyvqa tests need the easy-vqa package')

from fs_plugins.data.easyvqa import COLOURS, SHAPES, easyvqa_records  # noqa: E402
from fs_plugins.models.easyvqa_llava import image_labels  # noqa: E402
from fs_plugins.run.config import load_config  # noqa: E402
from fs_plugins.run.runtime import build_federated_records  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def records():
    return easyvqa_records()


def test_records_are_seeded_subsets_per_task(records):
    assert records == easyvqa_records()
    counts = Counter((record['split'], record['task']) for record in records)
    assert counts == {(split, task): size for split, size in (('train', 600), ('test', 30))
                      for task in ('colour', 'shape', 'yes_no')}
    assert len({r['id'] for r in records}) == len(records)
    assert easyvqa_records(seed=1) != records


def test_answers_match_their_task_and_images_exist(records):
    allowed = {'shape': SHAPES, 'colour': COLOURS, 'yes_no': {'yes', 'no'}}
    for record in records:
        assert record['answer'] in allowed[record['task']], record
    assert all(os.path.isfile(r['image']) for r in records[::97])
    train_images = {r['image'] for r in records if r['split'] == 'train'}
    assert not train_images & {r['image'] for r in records if r['split'] == 'test'}


def test_benchmark_yaml_gives_one_client_per_question_type():
    cfg = load_config(os.path.join(REPO, 'yamls', 'fedavg', 'easyvqa.yaml'))
    federated = build_federated_records(cfg)
    assert sorted(federated.client_names.values()) == ['colour', 'shape', 'yes_no']
    for cid, name in federated.client_names.items():
        split = federated.clients[cid]
        assert (len(split['train']), len(split['test'])) == (600, 30)
        assert {r['task'] for r in split['train'] + split['test']} == {name}


def test_image_labels_need_both_shape_and_colour():
    labels = image_labels(['What shape?', 'What colour?', 'What shape?', 'Is it red?'],
                          ['circle', 'teal', 'triangle', 'no'], [4, 4, 7, 7])
    assert labels == {4: {'shape': 'circle', 'colour': 'teal'}}


@pytest.mark.slow
def test_vision_tower_pretraining_learns_held_out_shapes_and_colours():
    """Two epochs lift joint shape+colour accuracy on the unseen test images well above
    chance (1/24); the full setup runs 30 epochs."""
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from fs_plugins.models.easyvqa_llava import VISION, easyvqa_image_processor, pretrain_vision_tower
    torch.manual_seed(0)
    tower = CLIPVisionModel(CLIPVisionConfig(**VISION))
    before = [p.detach().clone() for p in tower.parameters()]
    accuracy = pretrain_vision_tower(tower, easyvqa_image_processor(), epochs=2)
    assert accuracy > 0.15
    assert any(not torch.equal(a, b) for a, b in zip(before, tower.parameters()))

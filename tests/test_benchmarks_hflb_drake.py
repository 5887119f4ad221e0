"""HFLB (FedMosaic Table 13) and DRAKE (Table 34) preparation from tiny generated raw files:
the client -> dataset -> task tables, the keyword rules, the records' fields, the errors for
missing raw files, and the prepared files loading and splitting under the shipped YAMLs."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)   # benchmarks_ext is not an installed package

from fixtures_multimodal import write_image, write_json, write_lines  # noqa: E402

from benchmarks_ext.common import PrepareError  # noqa: E402
from benchmarks_ext.drake import prepare as drake  # noqa: E402
from benchmarks_ext.drake.table import TABLE_34  # noqa: E402
from benchmarks_ext.hflb import prepare as hflb  # noqa: E402
from benchmarks_ext.hflb import rules  # noqa: E402
from benchmarks_ext.hflb.table import TABLE_13  # noqa: E402
from fs_plugins.data import stream  # noqa: E402
from fs_plugins.data.instruction import load_records  # noqa: E402
from fs_plugins.run.config import client_overrides, load_config, read_yaml  # noqa: E402
from fs_plugins.run.runtime import build_federated_records  # noqa: E402

RECORD_KEYS = {'id', 'image', 'question', 'answer', 'task', 'pfl_task', 'task_label', 'source', 'split',
               'client'}
SPLITS = ('train', 'test')

# (question, answer, structural, semantic, detailed, client, task); the last one is in no task
GQA_QUESTIONS = [
    ('Is the sky blue?', 'yes', 'verify', 'attr', 'verifyAttr', 'c01_gqa_yes_no', 't1_attribute'),
    ('Is the cup on the table?', 'no', 'verify', 'rel', 'existRelS', 'c01_gqa_yes_no', 't2_relation'),
    ('Is there a dog?', 'yes', 'verify', 'obj', 'exist', 'c01_gqa_yes_no', 't3_object'),
    ('Is it indoors?', 'no', 'verify', 'global', 'verifyGlobal', 'c01_gqa_yes_no', 't4_global'),
    ('What color is the car?', 'red', 'query', 'attr', 'queryAttr', 'c02_gqa_four_choice', 't1_attribute'),
    ('What color is the bus?', 'white', 'query', 'attr', 'queryAttr', 'c02_gqa_four_choice', 't1_attribute'),
    ('What is on the table?', 'cup', 'query', 'rel', 'relS', 'c02_gqa_four_choice', 't2_relation'),
    ('What animal is it?', 'dog', 'query', 'cat', 'categoryRelS', 'c02_gqa_four_choice', 't3_category'),
    ('Which room is it?', 'kitchen', 'query', 'global', 'place', 'c02_gqa_four_choice', 't4_global'),
    ('Is the car red or blue?', 'red', 'choose', 'attr', 'chooseAttr', 'c03_gqa_two_choice', 't1_attribute'),
    ('Who is taller, the man or the boy?', 'man', 'compare', 'rel', 'compareRel', 'c03_gqa_two_choice',
     't2_relation'),
    ('Is it a cat or a dog?', 'dog', 'choose', 'cat', 'chooseCat', 'c03_gqa_two_choice', 't3_category'),
    ('Is it indoors or outdoors?', 'outdoors', 'choose', 'global', 'chooseGlobal', 'c03_gqa_two_choice',
     't4_global'),
    ('Is that a cat?', 'yes', 'verify', 'cat', 'verifyCat', None, None),
]
ABSTRACT_QUESTIONS = [('What color is the sofa?', 'brown', 'other', 't1_attribute'),
                      ('How many cats are there?', '2', 'number', 't2_number'),
                      ('Is the girl happy?', 'yes', 'yes/no', 't3_yes_no'),
                      ('What is the man holding?', 'bat', 'other', 't4_others')]
SNLI_HYPOTHESES = [('A man is running.', 'entailment', 't1_action'),
                   ('A dog sits on the beach.', 'neutral', 't2_scene_relations'),
                   ('There is a red car.', 'contradiction', 't3_object_centric'),
                   ('The girl is happy.', 'entailment', 't4_commonsense')]
COCOQA_QUESTIONS = [('what is on the table', 'cup', 0, 't1_object'), ('how many dogs are there', 'two', 1, 't2_number'),
                    ('what is the color of the bus', 'red', 2, 't3_color'),
                    ('where is the cat sitting', 'sofa', 3, 't4_location')]
NLVR2_SENTENCES = [('There are no dogs in the left image.', 'True', 't1_presupposition_negation_universal'),
                   ('The left image shows a cat above a box.', 'False', 't2_spatial_comparative'),
                   ('Each image shows exactly two birds.', 'True', 't3_cardinality_existential'),
                   ('One image contains a cat and a dog.', 'False', 't4_coordination_coreference')]
VIZWIZ_QUESTIONS = [('What kind of cereal is this?', 't1_food_brand_label'),
                    ('What color is this shirt?', 't2_color_type'),
                    ('What does this say?', 't3_ocr'), ('What is this?', 't4_general_object')]
AQUA_QUESTIONS = [('Who is standing next to the horse?', 't1_standing'),
                  ('Is the man standing or sitting?', 't1_standing'),      # first rule of the table wins
                  ('Where is the woman sitting?', 't2_sit'),
                  ('What is the man holding?', 't3_wear_hold_walk_talk'),
                  ('What is in the sky?', 't4_other')]


# ------------------------------------------------------------------------- raw HFLB layout
def build_gqa(root):
    files = {'train': 'train_balanced_questions.json', 'test': 'testdev_balanced_questions.json'}
    for split, name in files.items():
        questions = {}
        for i, (q, a, structural, semantic, detailed, _, _) in enumerate(GQA_QUESTIONS):
            questions[f'{split}{i}'] = {'imageId': f'n{split}{i}', 'question': q, 'answer': a, 'fullAnswer': a,
                                        'types': {'structural': structural, 'semantic': semantic,
                                                  'detailed': detailed}}
            write_image(os.path.join(root, 'images', f'n{split}{i}.jpg'), i)
        write_json(os.path.join(root, 'questions', name), questions)


def build_abstract(root):
    for tag in ('train2015', 'val2015'):
        questions, annotations = [], []
        for i, (q, a, answer_type, _) in enumerate(ABSTRACT_QUESTIONS):
            questions.append({'question_id': 100 + i, 'image_id': 7 + i, 'question': q})
            annotations.append({'question_id': 100 + i, 'image_id': 7 + i, 'multiple_choice_answer': a,
                                'answer_type': answer_type, 'question_type': 'what',
                                'answers': [{'answer': a, 'answer_id': k} for k in range(1, 11)]})
            write_image(os.path.join(root, f'scene_img_abstract_v002_{tag}',
                                     f'abstract_v002_{tag}_{7 + i:012d}.png'), i)
        write_json(os.path.join(root, f'OpenEnded_abstract_v002_{tag}_questions.json'), {'questions': questions})
        write_json(os.path.join(root, f'abstract_v002_{tag}_annotations.json'), {'annotations': annotations})


def build_snli_ve(root):
    for split in SPLITS:
        rows = [{'Flikr30kID': f'{split}{i}.jpg', 'sentence1': 'A caption.', 'sentence2': h, 'gold_label': label,
                 'pairID': f'{split}{i}'} for i, (h, label, _) in enumerate(SNLI_HYPOTHESES)]
        rows.append({'Flikr30kID': f'{split}0.jpg', 'sentence2': 'Unlabelled.', 'gold_label': '-',
                     'pairID': f'{split}x'})
        write_lines(os.path.join(root, f'snli_ve_{split}.jsonl'), [json.dumps(r) for r in rows])
        for i in range(len(SNLI_HYPOTHESES)):
            write_image(os.path.join(root, 'flickr30k_images', f'{split}{i}.jpg'), i)


def build_cocoqa(root):
    for split, coco in (('train', 'train2014'), ('test', 'val2014')):
        ids = [300 + i for i in range(len(COCOQA_QUESTIONS))]
        write_lines(os.path.join(root, split, 'img_ids.txt'), ids)
        for k, name in enumerate(('questions', 'answers', 'types')):
            write_lines(os.path.join(root, split, f'{name}.txt'), [row[k] for row in COCOQA_QUESTIONS])
        for i, image_id in enumerate(ids):
            write_image(os.path.join(root, 'images', coco, f'COCO_{coco}_{image_id:012d}.jpg'), i)


def build_nlvr2(root):
    for split, raw_split in (('train', 'train'), ('test', 'test1')):
        rows = []
        for i, (sentence, label, _) in enumerate(NLVR2_SENTENCES):
            row = {'identifier': f'{raw_split}-{i}-0-1', 'sentence': sentence, 'label': label}
            folder = os.path.join(root, 'images', raw_split)
            if split == 'train':
                row['directory'] = 3
                folder = os.path.join(folder, '3')
            rows.append(row)
            for k in (0, 1):
                write_image(os.path.join(folder, f'{raw_split}-{i}-0-img{k}.png'), i + k)
        write_lines(os.path.join(root, f'{raw_split}.json'), [json.dumps(r) for r in rows])


def build_vizwiz(root):
    for raw_split in ('train', 'val'):
        rows = []
        for i, (q, _) in enumerate(VIZWIZ_QUESTIONS):
            image = f'VizWiz_{raw_split}_{i:08d}.jpg'
            rows.append({'image': image, 'question': q,
                         'answers': [{'answer': 'thing', 'answer_confidence': 'yes'}] * 10})
            write_image(os.path.join(root, raw_split, image), i)
        write_json(os.path.join(root, 'Annotations', f'{raw_split}.json'), rows)


def build_aqua(root):
    for split in SPLITS:
        rows = [{'image': f'{split}_{i}.jpg', 'question': q, 'answer': 'someone', 'need_external_knowledge': False}
                for i, (q, _) in enumerate(AQUA_QUESTIONS)]
        write_json(os.path.join(root, f'{split}.json'), rows)
        for i, row in enumerate(rows):
            write_image(os.path.join(root, 'images', row['image']), i)


HFLB_BUILDERS = {'gqa': build_gqa, 'abstract': build_abstract, 'snli_ve': build_snli_ve, 'cocoqa': build_cocoqa,
                 'nlvr2': build_nlvr2, 'vizwiz': build_vizwiz, 'aqua': build_aqua}


# ------------------------------------------------------------------------ raw DRAKE layout
def build_drake(root):
    """Even-numbered tasks: train.json + test.json in LLaVA conversation form, two images each
    under the task folder. Odd-numbered: one data.jsonl pool of five flat records whose images
    are found under the dataset folder or RAW, three for the Bongard tasks."""
    index = 0
    for client in TABLE_34:
        for task in client.tasks:
            folder = os.path.join(root, task.folder)
            if index % 2 == 0:
                for split in SPLITS:
                    rows = []
                    for i in range(2):
                        images = [f'imgs/{split}{i}_{k}.png' for k in range(2)]
                        for k, image in enumerate(images):
                            write_image(os.path.join(folder, image), i + k)
                        rows.append({'id': f'{split}-{i}', 'image': images, 'conversations': [
                            {'from': 'human', 'value': f'<image>\n<image>\nAre these the same ({task.label})?'},
                            {'from': 'gpt', 'value': 'Yes'}]})
                    write_json(os.path.join(folder, f'{split}.json'), rows)
            else:
                count = 3 if task.dataset.startswith('Bongard') else 1
                rows = []
                for i in range(5):
                    images = [f'shared/{task.dataset}_{i}_{k}.png' for k in range(count)]
                    base = os.path.join(root, task.dataset) if i % 2 else root
                    for k, image in enumerate(images):
                        write_image(os.path.join(base, image), i + k)
                    rows.append({'images': images, 'question': f'Question {i} of {task.label}?', 'answer': f'a{i}'})
                write_lines(os.path.join(folder, 'data.jsonl'), [json.dumps(r) for r in rows])
            index += 1


def read_records(path):
    with open(path, encoding='utf-8') as handle:
        return [json.loads(line) for line in handle]


@pytest.fixture(scope='module')
def hflb_raw(tmp_path_factory):
    root = tmp_path_factory.mktemp('hflb_raw')
    for name, build in HFLB_BUILDERS.items():
        build(str(root / name))
    return str(root)


@pytest.fixture(scope='module')
def hflb_out(hflb_raw, tmp_path_factory):
    out = str(tmp_path_factory.mktemp('hflb_out') / 'hflb.jsonl')
    summary = hflb.prepare(hflb_raw, out, seed=0)
    return out, summary


@pytest.fixture(scope='module')
def drake_raw(tmp_path_factory):
    root = tmp_path_factory.mktemp('drake_raw')
    build_drake(str(root))
    return str(root)


@pytest.fixture(scope='module')
def drake_out(drake_raw, tmp_path_factory):
    out = str(tmp_path_factory.mktemp('drake_out') / 'drake.jsonl')
    return out, drake.prepare(drake_raw, out, seed=0)


def check_fields(records, out_file):
    folder = os.path.dirname(out_file)
    assert len({r['id'] for r in records}) == len(records)
    for r in records:
        assert set(r) >= RECORD_KEYS, r
        assert r['split'] in SPLITS and r['question'] and r['answer']
        for image in ([r['image']] if isinstance(r['image'], str) else r['image']):
            assert os.path.isfile(os.path.join(folder, image)), r


def tasks_by_client(records, split):
    out = {}
    for r in records:
        if r['split'] == split:
            out.setdefault(r['client'], set()).add(r['pfl_task'])
    return out


# --------------------------------------------------------------------------------- HFLB
def test_table_13_is_the_papers_table():
    assert [c.name for c in TABLE_13] == sorted(c.name for c in TABLE_13)   # by_source keeps this order
    assert [c.dataset for c in TABLE_13] == ['gqa', 'gqa', 'gqa', 'abstract', 'snli_ve', 'cocoqa', 'nlvr2',
                                             'vizwiz', 'aqua']
    assert [c.subset for c in TABLE_13[:3]] == ['Yes/No', 'Four-choice', 'Two-choice']
    assert all(len(c.tasks) == 4 for c in TABLE_13)
    labels = {c.name: [t.label for t in c.tasks] for c in TABLE_13}
    assert labels['c01_gqa_yes_no'] == ['Attribute', 'Relation', 'Object', 'Global']
    assert labels['c07_nlvr2'] == ['Presupposition Negation Universal', 'Spatial Comparative',
                                   'Cardinality Existential', 'Coordination Coreference']
    assert labels['c09_aqua'][2] == '"wear", "hold", "walk", "talk" keywords'
    assert all([t.key for t in c.tasks] == sorted(t.key for t in c.tasks) for c in TABLE_13)


@pytest.mark.parametrize('rule,text,task', [
    (rules.AQUA_RULE, 'Why is the man standing?', 'standing'),
    (rules.AQUA_RULE, 'Does the lady sit on a chair?', 'sit'),
    (rules.AQUA_RULE, 'What is the angel wearing?', 'wear_hold_walk_talk'),
    (rules.AQUA_RULE, 'Who is talking to the king?', 'wear_hold_walk_talk'),
    (rules.AQUA_RULE, 'What is the position of the boat?', 'other'),      # no "sit" inside words
    (rules.VIZWIZ_RULE, 'What brand is this?', 'food_brand_label'),
    (rules.VIZWIZ_RULE, 'What colour are these socks?', 'color_type'),
    (rules.VIZWIZ_RULE, 'Can you read the screen please?', 'ocr'),
    (rules.VIZWIZ_RULE, 'Which object is in front of me?', 'general_object'),
    (rules.SNLI_VE_RULE, 'Two friends are waiting for a bus.', 'commonsense'),
    (rules.SNLI_VE_RULE, 'People are walking down the street.', 'scene_relations'),
    (rules.SNLI_VE_RULE, 'A child is jumping.', 'action'),
    (rules.SNLI_VE_RULE, 'A woman has a hat.', 'object_centric'),
    (rules.nlvr2_task, "The right image doesn't show any people.", 'presupposition_negation_universal'),
    (rules.nlvr2_task, 'In the right image there are more dogs than cats.', 'spatial_comparative'),
    (rules.nlvr2_task, 'A dog is on the left of its owner.', 'spatial_comparative'),
    (rules.nlvr2_task, 'Two dogs are lying down in the left image.', 'cardinality_existential'),
    (rules.nlvr2_task, 'In one image a bird is eating, and it is on a branch.', 'coordination_coreference'),
])
def test_keyword_rules_put_examples_in_the_right_task(rule, text, task):
    assert rule(text) == task


def test_type_based_rules():
    assert rules.abstract_task({'answer': 'red', 'answer_type': 'other',
                                'question': 'What colour is it?'}) == 'attribute'
    assert rules.abstract_task({'answer': '3', 'question': 'How many?'}) == 'number'   # no answer_type
    assert rules.cocoqa_task({'cocoqa_type': 3}) == 'location'
    assert rules.gqa_form({'answer': 'Yes', 'gqa_types': {'structural': 'logical'}}) == 'yes_no'
    assert rules.gqa_form({'answer': 'left', 'gqa_types': {'structural': 'choose'}}) == 'two_choice'
    assert rules.gqa_form({'answer': 'table', 'gqa_types': {'structural': 'query'}}) == 'four_choice'


def test_hflb_clients_tasks_and_record_fields(hflb_out):
    out, summary = hflb_out
    records = read_records(out)
    check_fields(records, out)
    for split in SPLITS:
        assert tasks_by_client(records, split) == {c.name: {t.key for t in c.tasks} for c in TABLE_13}
    for client in TABLE_13:
        mine = [r for r in records if r['client'] == client.name]
        assert {r['source'] for r in mine} == {client.dataset}
        assert {r['task_label'] for r in mine} == {t.label for t in client.tasks}
        assert {r['task'] for r in mine} == {'vqa'}
    assert [r['client'] for r in records] == sorted(r['client'] for r in records)
    assert os.path.isfile(out.replace('.jsonl', '_summary.json'))
    assert summary['clients']['c09_aqua']['t1_standing']['train'] == {'available': 2, 'written': 2}


def expected_task_of(records, source, text_field, expected):
    for text, task in expected:
        found = [r for r in records if r['source'] == source and r[text_field].startswith(text)]
        assert found and {r['pfl_task'] for r in found} == {task}, (text, found)


def test_hflb_samples_land_in_their_task(hflb_out):
    records = read_records(hflb_out[0])
    for q, _, _, _, _, client, task in GQA_QUESTIONS:
        found = [(r['client'], r['pfl_task']) for r in records if r['question'].split('\n')[0] == q]
        assert found == ([(client, task)] * 2 if client else []), q
    expected_task_of(records, 'abstract', 'question', [(q, t) for q, _, _, t in ABSTRACT_QUESTIONS])
    expected_task_of(records, 'snli_ve', 'hypothesis', [(h, t) for h, _, t in SNLI_HYPOTHESES])
    expected_task_of(records, 'cocoqa', 'question', [(q, t) for q, _, _, t in COCOQA_QUESTIONS])
    expected_task_of(records, 'nlvr2', 'sentence', [(s, t) for s, _, t in NLVR2_SENTENCES])
    expected_task_of(records, 'vizwiz', 'question', VIZWIZ_QUESTIONS)
    expected_task_of(records, 'aqua', 'question', AQUA_QUESTIONS)
    assert not any(r.get('hypothesis') == 'Unlabelled.' for r in records)   # gold_label '-' skipped


def test_hflb_dataset_specific_records(hflb_out):
    records = read_records(hflb_out[0])
    four = [r for r in records if r['client'] == 'c02_gqa_four_choice']
    for r in four:
        assert len(r['choices']) == len(set(r['choices'])) == 4 and r['answer'] in r['choices']
        assert r['question'].endswith('Options: ' + '; '.join(r['choices']))
    assert not any('choices' in r for r in records if r['client'] != 'c02_gqa_four_choice')
    nlvr2 = [r for r in records if r['source'] == 'nlvr2']
    assert all(len(r['image']) == 2 and r['answer'] in ('true', 'false') for r in nlvr2)
    assert {r['answer'] for r in records if r['source'] == 'snli_ve'} <= {'entailment', 'neutral', 'contradiction'}
    assert all(isinstance(r['image'], str) for r in records if r['source'] != 'nlvr2')


def test_hflb_per_task_cap_is_seeded(hflb_raw, tmp_path):
    ids = {}
    for name, seed in (('a', 0), ('b', 0), ('c', 5)):
        out = str(tmp_path / name / 'hflb.jsonl')
        hflb.prepare(hflb_raw, out, seed=seed, per_task=1, test_per_task=1, images='absolute')
        records = read_records(out)
        assert len(records) == 9 * 4 * 2 and all(os.path.isabs(r['image'][0] if isinstance(r['image'], list)
                                                                else r['image']) for r in records)
        ids[name] = [r['id'] for r in records]
    assert ids['a'] == ids['b'] != ids['c']    # the GQA attribute and AQUA standing tasks have two


@pytest.mark.parametrize('rel', ['gqa/questions/testdev_balanced_questions.json',
                                 'abstract/abstract_v002_val2015_annotations.json',
                                 'snli_ve/snli_ve_test.jsonl', 'cocoqa/train/types.txt', 'nlvr2/test1.json',
                                 'vizwiz/Annotations/val.json', 'aqua/train.json',
                                 'nlvr2/images/train/3/train-0-0-img1.png'])
def test_hflb_missing_raw_file_names_it(hflb_raw, tmp_path, rel):
    path = os.path.join(hflb_raw, rel)
    os.rename(path, path + '.away')
    try:
        with pytest.raises(PrepareError, match=f'{rel.split("/")[0]}: missing raw file .*{os.path.basename(rel)}'):
            hflb.prepare(hflb_raw, str(tmp_path / 'hflb.jsonl'))
    finally:
        os.rename(path + '.away', path)


def test_hflb_cli(hflb_raw, tmp_path):
    out = str(tmp_path / 'cli' / 'hflb.jsonl')
    done = subprocess.run([sys.executable, '-m', 'benchmarks_ext.hflb.prepare', '--raw', hflb_raw, '--out', out,
                           '--per-task', '1', '--test-per-task', 'all', '--seed', '3'],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert done.returncode == 0, done.stderr
    assert 'c09_aqua t1_standing train=1/2 test=2/2' in done.stdout
    assert len([r for r in read_records(out) if r['split'] == 'train']) == 36
    with pytest.raises(SystemExit, match='^hflb: gqa: missing raw file .*train_balanced_questions.json'):
        hflb.main(['--raw', str(tmp_path / 'nowhere'), '--out', out])
    with pytest.raises(SystemExit, match="--out: '.*x.json' is not a .jsonl file path"):
        hflb.main(['--raw', hflb_raw, '--out', str(tmp_path / 'x.json')])
    with pytest.raises(SystemExit, match='--per-task: expected a positive integer'):
        hflb.main(['--raw', hflb_raw, '--out', out, '--per-task', '0'])


# -------------------------------------------------------------------------------- DRAKE
def test_table_34_is_the_papers_table():
    assert [c.name for c in TABLE_34] == sorted(c.name for c in TABLE_34)
    assert all(len(c.tasks) == 4 for c in TABLE_34)
    assert len({t for c in TABLE_34 for t in c.tasks}) == 40                  # 40 distinct tasks (A.24)
    assert len({t.dataset for c in TABLE_34 for t in c.tasks}) == 19         # from 19 datasets (§5)
    kinds = {i + 1: c.kind for i, c in enumerate(TABLE_34)}
    assert [i for i, k in kinds.items() if k == 'visual_relation'] == [1, 5, 6]
    assert [i for i, k in kinds.items() if k == 'multimodal_reasoning'] == [7, 8, 9]
    assert [i for i, k in kinds.items() if k == 'vqa'] == [2, 3, 4, 10]
    assert [t.label for t in TABLE_34[0].tasks] == ['Fashion200K: ClothCombination', 'FashionIQ', 'VISION: 2_Img',
                                                    'MagicBrush']
    assert [t.label for t in TABLE_34[8].tasks] == ['IRFL: PhraseSelection', 'Bongard-OpenWorld: ConceptQuery',
                                                    'Bongard-HOI: ConceptQuery', 'Bongard-HOI: ActionIncoherence']


def test_drake_clients_tasks_images_and_sizes(drake_out):
    out, summary = drake_out
    records = read_records(out)
    check_fields(records, out)
    for split in SPLITS:
        assert tasks_by_client(records, split) == {c.name: {s.key for s, _ in c.specs()} for c in TABLE_34}
    counts = {}
    for r in records:
        counts.setdefault((r['client'], r['pfl_task']), {}).setdefault(r['split'], 0)
        counts[(r['client'], r['pfl_task'])][r['split']] += 1
    for client in TABLE_34:
        for spec, task in client.specs():
            pooled = summary['raw_records'][f'{client.name}/{spec.key}'] == {'pool': 5}
            assert counts[(client.name, spec.key)] == ({'train': 4, 'test': 1} if pooled
                                                       else {'train': 2, 'test': 2})
            mine = [r for r in records if r['pfl_task'] == spec.key and r['client'] == client.name]
            assert ({(r['source'], r['task_label'], r['task']) for r in mine}
                    == {(task.dataset, task.label, client.kind)})
    bongard = [r for r in records if r['source'].startswith('Bongard') and isinstance(r['image'], list)]
    assert bongard and all(len(r['image']) in (2, 3) for r in bongard)
    conversations = [r for r in records if 'source_id' in r]
    assert conversations and all(r['question'].startswith('Are these the same') for r in conversations)
    assert all(r['answer'] == 'Yes' for r in conversations)


def test_drake_pool_sizes_follow_a24():
    parts = drake.split_pool(11_000, 10_000, 1_000, 0, ('t',))
    assert (len(parts['train']), len(parts['test'])) == (10_000, 1_000) and not set(parts['train']) & set(parts['test'])
    parts = drake.split_pool(10_000, 10_000, 1_000, 0, ('t',))          # not "large": 8:2 of all of it
    assert (len(parts['train']), len(parts['test'])) == (8_000, 2_000)
    assert drake.split_pool(10, None, None, 0, ('t',))['test'] == drake.split_pool(10, None, None, 0, ('t',))['test']


def test_drake_missing_task_file_or_image_names_it(drake_raw, tmp_path):
    out = str(tmp_path / 'drake.jsonl')
    folder = os.path.join(drake_raw, 'Fashion200K', 'ClothCombination')     # a train + test task
    os.rename(os.path.join(folder, 'test.json'), os.path.join(folder, 'test.away'))
    try:
        with pytest.raises(PrepareError, match='^Fashion200K: missing raw file .*ClothCombination/test.json'):
            drake.prepare(drake_raw, out)
    finally:
        os.rename(os.path.join(folder, 'test.away'), os.path.join(folder, 'test.json'))
    image = os.path.join(folder, 'imgs', 'train1_1.png')
    os.rename(image, image + '.away')
    try:
        with pytest.raises(PrepareError, match='^Fashion200K: missing raw file .*imgs/train1_1.png'):
            drake.prepare(drake_raw, out)
    finally:
        os.rename(image + '.away', image)
    with pytest.raises(SystemExit, match='^drake: Fashion200K: missing raw file .*ClothCombination/train.json'):
        drake.main(['--raw', str(tmp_path / 'nowhere'), '--out', out])


# ------------------------------------------------- the prepared files under the shipped YAMLs
@pytest.mark.parametrize('name,table,fixture', [('hflb', TABLE_13, 'hflb_out'), ('drake', TABLE_34, 'drake_out')])
def test_prepared_file_loads_and_splits_as_the_yaml_says(name, table, fixture, request, tmp_path):
    out, _ = request.getfixturevalue(fixture)
    assert len(load_records(out)) == len(read_records(out))
    cfg = load_config(os.path.join(REPO, 'yamls', 'fedmosaic', f'{name}_dynamic.yaml'),
                      ['data.root', os.path.dirname(out), 'data.type', f'{name}.jsonl@fsplug',
                       'outdir', str(tmp_path / 'exp'), 'fsplug.results_dir', str(tmp_path / 'results')])
    assert cfg.fsplug.data.task_field == 'pfl_task' and cfg.fsplug.data.dynamic is True
    federated = build_federated_records(cfg)
    assert federated.client_num == len(table) == cfg.federate.client_num
    assert [federated.client_names[cid] for cid in range(1, len(table) + 1)] == [c.name for c in table]
    for cid, splits in federated.clients.items():
        assert {'train', 'test', 'others'} <= set(splits)
        ranks = {r['pfl_task']: r[stream.TASK_RANK] for r in splits['train']}
        assert sorted(ranks, key=ranks.get) == sorted(ranks) and len(ranks) == 4   # the paper's task order
        assert {r['client'] for r in splits['others']} == {c.name for c in table} - {table[cid - 1].name}
    client_file = os.path.join(REPO, 'yamls', 'fedmosaic', f'{name}_dynamic_clients.yaml')
    models = {cid: o['model']['type'] for cid, o in client_overrides(read_yaml(client_file), cfg).items()}
    small = 3 if name == 'hflb' else 4          # Table 25 / Table 5: the first clients run the 1B model
    assert all(('1b' in models[cid]) == (cid <= small) for cid in models) and len(models) == len(table)

"""Fed-VQA / Fed-Med preparation from tiny generated raw layouts (tests/fixtures_multimodal.py)."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)   # benchmarks_ext is not an installed package

from fixtures_multimodal import build_fedmed_raw, build_fedvqa_raw  # noqa: E402

from benchmarks_ext.common import PrepareError, majority_answer, parse_sizes  # noqa: E402
from benchmarks_ext.fedmed import prepare as fedmed  # noqa: E402
from benchmarks_ext.fedvqa import prepare as fedvqa  # noqa: E402
from fs_plugins.metrics.detection import detection_iou  # noqa: E402

RECORD_KEYS = {'id', 'image', 'question', 'answer', 'task', 'source', 'split', 'client'}
VQA_TRAIN = {'aqua': 4, 'gqa': 5, 'vizwiz': 3, 'abstract': 5, 'cocoqa': 2}
VQA_TEST = {'aqua': 2, 'gqa': 3, 'vizwiz': 1, 'abstract': 2, 'cocoqa': 3}
MED_TRAIN = {'vqa': 9, 'report': 4, 'detection': 5}
MED_TEST = {'vqa': 5, 'report': 3, 'detection': 2}
ALL = {fedvqa: dict.fromkeys(VQA_TRAIN), fedmed: dict.fromkeys(MED_TRAIN)}   # None = every usable record


def read_records(path):
    with open(path, encoding='utf-8') as handle:
        return [json.loads(line) for line in handle]


def counts(records):
    out = {}
    for r in records:
        out.setdefault(r['split'], {}).setdefault(r['client'], 0)
        out[r['split']][r['client']] += 1
    return out


def check_records(records, out_dir):
    assert len({r['id'] for r in records}) == len(records)
    for r in records:
        assert set(r) >= RECORD_KEYS
        assert r['split'] in ('train', 'test')
        image = r['image'] if os.path.isabs(r['image']) else os.path.join(out_dir, r['image'])
        assert os.path.isfile(image), r


@pytest.fixture(scope='module')
def vqa_raw(tmp_path_factory):
    root = tmp_path_factory.mktemp('fedvqa_raw')
    return str(root), build_fedvqa_raw(str(root), n_train=5, n_test=3)


@pytest.fixture(scope='module')
def med_raw(tmp_path_factory):
    root = tmp_path_factory.mktemp('fedmed_raw')
    return str(root), build_fedmed_raw(str(root), n_train=5, n_test=3)


def test_default_sizes_are_table_6():
    assert fedvqa.TRAIN_SIZES == {'aqua': 2518, 'gqa': 2534, 'vizwiz': 2493, 'abstract': 2476, 'cocoqa': 2487}
    assert fedvqa.TEST_SIZES == {'aqua': 503, 'gqa': 533, 'vizwiz': 499, 'abstract': 508, 'cocoqa': 509}
    assert fedmed.TRAIN_SIZES == {'vqa': 2979, 'report': 6558, 'detection': 6000}
    assert fedmed.TEST_SIZES == {'vqa': 200, 'report': 200, 'detection': 200}


def test_fedvqa_sizes_fields_and_single_word_filter(vqa_raw, tmp_path):
    raw, usable = vqa_raw
    summary = fedvqa.prepare(raw, str(tmp_path), seed=3, train_sizes=VQA_TRAIN, test_sizes=VQA_TEST)
    records = read_records(tmp_path / 'fedvqa.jsonl')
    check_records(records, str(tmp_path))
    assert counts(records) == {'train': VQA_TRAIN, 'test': VQA_TEST}
    assert all(r['task'] == 'vqa' and r['source'] == r['client'] for r in records)
    assert all(r['answer'] != 'stop here now' for r in records)     # multi-word answers dropped
    assert summary['clients']['gqa']['train'] == {'raw': 6, 'usable': usable['gqa']['train'], 'written': 5,
                                                  'by_source': {'gqa': 5}}
    vizwiz = [r for r in records if r['source'] == 'vizwiz']
    # answer = the majority of the 10 annotators (6 × answer, 4 × 'other')
    assert all(r['answer'] != 'other' and r['annotator_answers'].count('other') == 4 for r in vizwiz)
    assert not any('answers' in r for r in records)   # no alternative answers: exact match on `answer`
    assert all(os.path.islink(tmp_path / r['image']) for r in records)


def test_fedvqa_subsampling_is_seeded(vqa_raw, tmp_path):
    raw, _ = vqa_raw
    ids = {}
    for name, seed in (('a', 0), ('b', 0), ('c', 1)):
        fedvqa.prepare(raw, str(tmp_path / name), seed=seed, train_sizes=VQA_TRAIN, test_sizes=VQA_TEST)
        ids[name] = [r['id'] for r in read_records(tmp_path / name / 'fedvqa.jsonl')]
    assert ids['a'] == ids['b'] != ids['c']


def test_fedvqa_keep_multiword_and_absolute_images(vqa_raw, tmp_path):
    raw, _ = vqa_raw
    fedvqa.prepare(raw, str(tmp_path), train_sizes=ALL[fedvqa], test_sizes=ALL[fedvqa], images='absolute',
                   keep_multiword=True)
    records = read_records(tmp_path / 'fedvqa.jsonl')
    assert counts(records)['train'] == {k: 6 for k in VQA_TRAIN}
    assert all(os.path.isabs(r['image']) for r in records)
    assert not os.path.exists(tmp_path / 'images')


def test_fedmed_tasks_sources_and_boxes(med_raw, tmp_path):
    raw, usable = med_raw
    summary = fedmed.prepare(raw, str(tmp_path), train_sizes=MED_TRAIN, test_sizes=MED_TEST, images='copy')
    records = read_records(tmp_path / 'fedmed.jsonl')
    check_records(records, str(tmp_path))
    assert counts(records) == {'train': MED_TRAIN, 'test': MED_TEST}
    tasks = {r['client']: r['task'] for r in records}
    assert tasks == {'vqa': 'vqa', 'report': 'report', 'detection': 'detection'}
    assert {r['source'] for r in records if r['client'] == 'vqa'} == {'slake', 'vqa_rad'}
    assert {r['source'] for r in records if r['client'] != 'vqa'} == {'mimic_cxr', 'radgenome'}
    assert summary['clients']['vqa']['train']['usable'] == usable['vqa']['train']   # no zh, no multi-word
    assert not any(os.path.islink(tmp_path / r['image']) for r in records)
    detection = [r for r in records if r['task'] == 'detection']
    # 200 × 100 pixel images: (20, 10, 100, 50) -> [100, 100, 500, 500] in 0..1000 units
    assert all(r['boxes'][0] == [100, 100, 500, 500] for r in detection)
    two_boxes = [r for r in read_records(tmp_path / 'fedmed.jsonl') if len(r.get('boxes', [])) == 2]
    for r in two_boxes:
        assert r['answer'] == '[100, 100, 500, 500]; [750, 600, 1000, 1000]'
    assert detection_iou([r['answer'] for r in detection], [r['boxes'] for r in detection]) == 1.0
    report = [r for r in records if r['task'] == 'report']
    assert all(r['answer'].startswith('the lungs are clear') for r in report)


def test_missing_raw_file_names_file_and_dataset(vqa_raw, med_raw, tmp_path):
    for module, (raw, _), dataset, rel in (
            (fedvqa, vqa_raw, 'cocoqa', 'cocoqa/test/answers.txt'),
            (fedvqa, vqa_raw, 'gqa', 'gqa/questions/testdev_balanced_questions.json'),
            (fedmed, med_raw, 'vqa_rad', 'vqa_rad/VQA_RAD Dataset Public.json'),
            (fedmed, med_raw, 'radgenome', 'radgenome/train_boxes.csv')):
        path = os.path.join(raw, rel)
        os.rename(path, path + '.away')
        try:
            with pytest.raises(PrepareError, match=f'^{dataset}: missing raw file .*{os.path.basename(rel)}'):
                module.prepare(raw, str(tmp_path / dataset), train_sizes=ALL[module], test_sizes=ALL[module])
        finally:
            os.rename(path + '.away', path)


def test_missing_image_names_file_and_dataset(vqa_raw, tmp_path):
    raw, _ = vqa_raw
    image = os.path.join(raw, 'abstract', 'scene_img_abstract_v002_val2015', 'abstract_v002_val2015_000000000021.png')
    os.rename(image, image + '.away')
    try:
        with pytest.raises(PrepareError, match='^abstract: missing raw file .*abstract_v002_val2015_000000000021.png'):
            fedvqa.prepare(raw, str(tmp_path), train_sizes=VQA_TRAIN, test_sizes=ALL[fedvqa])
    finally:
        os.rename(image + '.away', image)


def test_too_few_records_says_which_option(med_raw, tmp_path):
    raw, _ = med_raw
    with pytest.raises(PrepareError, match='report test: 3 usable records but 200 requested; '
                                           'lower it with --test-sizes'):
        fedmed.prepare(raw, str(tmp_path), train_sizes=MED_TRAIN, test_sizes={'vqa': 2})


def test_cli_runs_as_a_script_and_fails_cleanly(med_raw, tmp_path):
    raw, _ = med_raw
    script = os.path.join(REPO, 'benchmarks_ext', 'fedmed', 'prepare.py')
    ok = subprocess.run([sys.executable, script, '--raw', raw, '--out', str(tmp_path), '--seed', '2',
                         '--train-sizes', 'vqa=all,report=2,detection=1', '--test-sizes', 'vqa=1,report=1,detection=1'],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert counts(read_records(tmp_path / 'fedmed.jsonl'))['train'] == {'vqa': 11, 'report': 2, 'detection': 1}
    with pytest.raises(SystemExit, match='^fedmed: slake: missing raw file .*slake/train.json'):
        fedmed.main(['--raw', str(tmp_path / 'nowhere'), '--out', str(tmp_path)])


def test_parse_sizes_and_majority_answer():
    assert parse_sizes('a=3,b=all', {'a': 1, 'b': 2, 'c': 5}, '--x') == {'a': 3, 'b': None, 'c': 5}
    with pytest.raises(PrepareError, match='--x: bad item'):
        parse_sizes('zzz=3', {'a': 1}, '--x')
    assert majority_answer(['no', 'yes', 'yes', 'no', 'maybe']) == 'no'     # tie -> first seen
    assert majority_answer([' b', 'a', 'b']) == 'b'

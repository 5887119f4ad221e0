"""Fed-VQA (Fed-MoLE Table 1/6): five clients, one VQA dataset each -> <out>/fedvqa.jsonl.

    python benchmarks_ext/fedvqa/prepare.py --raw RAW --out OUT [--seed 0]
        [--train-sizes aqua=2518,...] [--test-sizes ...] [--images symlink|copy|absolute]
        [--keep-multiword]

RAW holds aqua/, gqa/, vizwiz/, abstract/, cocoqa/ laid out as benchmarks_ext/fedvqa/README.md
describes. Default sizes: Fed-MoLE Table 6.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ''):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks_ext.common import Benchmark, PrepareError, majority_answer, read_json, read_lines  # noqa: E402

README = 'benchmarks_ext/fedvqa/README.md'
BENCHMARK = 'fedvqa'
CLIENTS = ('aqua', 'gqa', 'vizwiz', 'abstract', 'cocoqa')
TRAIN_SIZES = {'aqua': 2518, 'gqa': 2534, 'vizwiz': 2493, 'abstract': 2476, 'cocoqa': 2487}
TEST_SIZES = {'aqua': 503, 'gqa': 533, 'vizwiz': 499, 'abstract': 508, 'cocoqa': 509}


def candidate(raw_id, image_root: str, image_rel: str, question: str, answer, annotator_answers=None) -> dict:
    """annotator_answers (datasets with several annotators): every raw answer, kept for reference as
    `annotator_answers`; not `answers`, which evaluation would treat as acceptable alternatives."""
    record = {'raw_id': raw_id, 'image_src': os.path.join(image_root, image_rel), 'image_rel': image_rel,
              'question': str(question).strip(), 'answer': str(answer).strip()}
    if annotator_answers is not None:
        record['annotator_answers'] = [str(a).strip() for a in annotator_answers]
    return record


def load_aqua(root: str, split: str) -> list[dict]:
    """AQUA train.json / test.json: [{image, question, answer, need_external_knowledge}]; images
    are SemArt's, in images/."""
    rows = read_json(os.path.join(root, f'{split}.json'), 'aqua', README)
    return [candidate(i, os.path.join(root, 'images'), row['image'], row['question'], row['answer'])
            for i, row in enumerate(rows)]


GQA_FILES = {'train': 'train_balanced_questions.json', 'test': 'testdev_balanced_questions.json'}


def load_gqa(root: str, split: str) -> list[dict]:
    """GQA balanced questions {qid: {imageId, question, answer, ...}}; images/<imageId>.jpg."""
    questions = read_json(os.path.join(root, 'questions', GQA_FILES[split]), 'gqa', README)
    return [candidate(qid, os.path.join(root, 'images'), f'{q["imageId"]}.jpg', q['question'], q['answer'])
            for qid, q in questions.items()]


VIZWIZ_SPLITS = {'train': 'train', 'test': 'val'}  # the test split's answers are not public


def load_vizwiz(root: str, split: str) -> list[dict]:
    """VizWiz Annotations/{train,val}.json: [{image, question, answers: [{answer, ...}]}];
    images in train/ and val/. answer = the annotators' majority answer."""
    raw_split = VIZWIZ_SPLITS[split]
    rows = read_json(os.path.join(root, 'Annotations', f'{raw_split}.json'), 'vizwiz', README)
    out = []
    for row in rows:
        answers = [a['answer'] for a in row['answers']]
        out.append(candidate(os.path.splitext(row['image'])[0], os.path.join(root, raw_split), row['image'],
                             row['question'], majority_answer(answers), answers))
    return out


ABSTRACT_SPLITS = {'train': 'train2015', 'test': 'val2015'}


def load_abstract(root: str, split: str) -> list[dict]:
    """VQA abstract scenes (v1): OpenEnded_abstract_v002_<s>_questions.json +
    abstract_v002_<s>_annotations.json, images scene_img_abstract_v002_<s>/abstract_v002_<s>_<id:012d>.png
    with <s> = train2015 (train) / val2015 (test). answer = multiple_choice_answer."""
    tag = ABSTRACT_SPLITS[split]
    questions = read_json(os.path.join(root, f'OpenEnded_abstract_v002_{tag}_questions.json'), 'abstract', README)
    annotations = read_json(os.path.join(root, f'abstract_v002_{tag}_annotations.json'), 'abstract', README)
    by_qid = {a['question_id']: a for a in annotations['annotations']}
    out = []
    for q in questions['questions']:
        ann = by_qid.get(q['question_id'])
        if ann is None:
            raise PrepareError(f'abstract: question {q["question_id"]} has no annotation in '
                               f'abstract_v002_{tag}_annotations.json')
        image = f'abstract_v002_{tag}_{int(q["image_id"]):012d}.png'
        out.append(candidate(q['question_id'], os.path.join(root, f'scene_img_abstract_v002_{tag}'), image,
                             q['question'], ann['multiple_choice_answer'], [a['answer'] for a in ann['answers']]))
    return out


COCO_SPLITS = {'train': 'train2014', 'test': 'val2014'}  # COCO-QA train/test come from these


def load_cocoqa(root: str, split: str) -> list[dict]:
    """COCO-QA <split>/{img_ids,questions,answers}.txt (one per line); COCO 2014 images in
    images/train2014/ (train) and images/val2014/ (test)."""
    columns = {name: read_lines(os.path.join(root, split, f'{name}.txt'), 'cocoqa', README)
               for name in ('img_ids', 'questions', 'answers')}
    if len({len(v) for v in columns.values()}) != 1:
        raise PrepareError(f'cocoqa: {os.path.join(root, split)}: img_ids/questions/answers.txt differ in '
                           f'length ({ {k: len(v) for k, v in columns.items()} })')
    coco = COCO_SPLITS[split]
    return [candidate(i, os.path.join(root, 'images', coco), f'COCO_{coco}_{int(image_id):012d}.jpg', q, a)
            for i, (image_id, q, a) in enumerate(zip(columns['img_ids'], columns['questions'], columns['answers']))]


LOADERS = {'aqua': load_aqua, 'gqa': load_gqa, 'vizwiz': load_vizwiz, 'abstract': load_abstract,
           'cocoqa': load_cocoqa}


FEDVQA = Benchmark(BENCHMARK, {name: ('vqa', [(name, LOADERS[name])]) for name in CLIENTS},
                   TRAIN_SIZES, TEST_SIZES, README)
prepare = FEDVQA.prepare


def main(argv=None) -> dict:
    return FEDVQA.main(argv, __doc__.split('\n')[0])


if __name__ == '__main__':
    main(sys.argv[1:])

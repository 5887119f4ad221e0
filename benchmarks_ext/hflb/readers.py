"""Readers of HFLB's seven source datasets in their public release formats (one folder each
under RAW; layout in benchmarks_ext/hflb/README.md). Each returns the candidates of one split
(`pfl_records` format) with the fields its task rule needs (`rules.py`).

AQUA and VizWiz are read by the Fed-VQA readers (same layout, so one RAW folder serves both
benchmarks); GQA, Abstract VQA and COCO-QA use the Fed-VQA layout too, plus the question-type
fields that Fed-VQA does not need.
"""
from __future__ import annotations

import os

from benchmarks_ext.common import PrepareError, read_json, read_jsonl, read_lines
from benchmarks_ext.fedvqa import prepare as fedvqa

README = 'benchmarks_ext/hflb/README.md'


def candidate(raw_id, source: str, images: list[tuple[str, str]], question: str, answer: str, **extra) -> dict:
    return {'raw_id': raw_id, 'source': source, 'images': images, 'question': str(question).strip(),
            'answer': str(answer).strip(), **extra}


def image_under(root: str, folder: str, rel: str, source: str) -> tuple[str, str]:
    """(absolute path of root/folder/rel, where it goes under the output's images/ folder)."""
    return os.path.join(root, folder, rel), f'{source}/{rel}'


def from_fedvqa(rows: list[dict], source: str) -> list[dict]:
    """Fed-VQA reader output (image_src / image_rel) as HFLB candidates."""
    out = []
    for row in rows:
        row = dict(row)
        src, rel = row.pop('image_src'), row.pop('image_rel')
        out.append({**row, 'source': source, 'images': [(src, f'{source}/{rel}')]})
    return out


# ------------------------------------------------------------------------------------- GQA
GQA_FILES = fedvqa.GQA_FILES   # train_balanced (train), testdev_balanced (test)


def load_gqa(root: str, split: str) -> list[dict]:
    """questions/<file>: {qid: {imageId, question, answer, types: {structural, semantic,
    detailed}, ...}}; images/<imageId>.jpg."""
    path = os.path.join(root, 'questions', GQA_FILES[split])
    out = []
    for qid, q in read_json(path, 'gqa', README).items():
        if not isinstance(q.get('types'), dict):
            raise PrepareError(f'gqa: {path}: question {qid} has no "types" (the GQA 1.2 question files '
                               f'carry them; they decide the client and the task)')
        out.append(candidate(qid, 'gqa', [image_under(root, 'images', f'{q["imageId"]}.jpg', 'gqa')],
                             q['question'], q['answer'], gqa_types=q['types']))
    return out


# --------------------------------------------------------------------------- Abstract VQA
def load_abstract(root: str, split: str) -> list[dict]:
    """VQA v1 abstract scenes, as Fed-VQA reads them, keeping answer_type / question_type of
    the annotations."""
    tag = fedvqa.ABSTRACT_SPLITS[split]
    questions = read_json(os.path.join(root, f'OpenEnded_abstract_v002_{tag}_questions.json'), 'abstract', README)
    annotations_path = os.path.join(root, f'abstract_v002_{tag}_annotations.json')
    by_qid = {a['question_id']: a for a in read_json(annotations_path, 'abstract', README)['annotations']}
    out = []
    for q in questions['questions']:
        ann = by_qid.get(q['question_id'])
        if ann is None:
            raise PrepareError(f'abstract: question {q["question_id"]} has no annotation in {annotations_path}')
        image = f'abstract_v002_{tag}_{int(q["image_id"]):012d}.png'
        out.append(candidate(q['question_id'], 'abstract',
                             [image_under(root, f'scene_img_abstract_v002_{tag}', image, 'abstract')],
                             q['question'], ann['multiple_choice_answer'],
                             answer_type=ann.get('answer_type'), question_type=ann.get('question_type'),
                             annotator_answers=[str(a['answer']).strip() for a in ann.get('answers', [])]))
    return out


# -------------------------------------------------------------------------------- SNLI-VE
SNLI_VE_FILES = {'train': 'snli_ve_train.jsonl', 'test': 'snli_ve_test.jsonl'}
SNLI_VE_LABELS = ('entailment', 'neutral', 'contradiction')
SNLI_VE_QUESTION = ('Does the image entail the statement "{hypothesis}"? '
                    'Answer entailment, neutral or contradiction.')


def load_snli_ve(root: str, split: str) -> list[dict]:
    """snli_ve_{train,test}.jsonl (one JSON object a line: Flikr30kID, sentence2 = hypothesis,
    gold_label, pairID, ...); images flickr30k_images/<Flikr30kID>. Rows whose gold_label is
    not one of the three labels are skipped."""
    out = []
    for row in read_jsonl(os.path.join(root, SNLI_VE_FILES[split]), 'snli_ve', README):
        if row.get('gold_label') not in SNLI_VE_LABELS:
            continue
        image = str(row['Flikr30kID'])
        image = image if os.path.splitext(image)[1] else f'{image}.jpg'
        hypothesis = str(row['sentence2']).strip()
        out.append(candidate(row['pairID'], 'snli_ve', [image_under(root, 'flickr30k_images', image, 'snli_ve')],
                             SNLI_VE_QUESTION.format(hypothesis=hypothesis), row['gold_label'],
                             hypothesis=hypothesis))
    return out


# -------------------------------------------------------------------------------- COCO-QA
def load_cocoqa(root: str, split: str) -> list[dict]:
    """Fed-VQA's COCO-QA layout plus <split>/types.txt (0 object, 1 number, 2 color,
    3 location; one per line, as in the COCO-QA release)."""
    folder = os.path.join(root, split)
    columns = {name: read_lines(os.path.join(folder, f'{name}.txt'), 'cocoqa', README)
               for name in ('img_ids', 'questions', 'answers', 'types')}
    if len({len(v) for v in columns.values()}) != 1:
        raise PrepareError(f'cocoqa: {folder}: img_ids/questions/answers/types.txt differ in length '
                           f'({ {k: len(v) for k, v in columns.items()} })')
    coco = fedvqa.COCO_SPLITS[split]
    return [candidate(i, 'cocoqa', [image_under(root, os.path.join('images', coco),
                                                f'COCO_{coco}_{int(image_id):012d}.jpg', 'cocoqa')],
                      q, a, cocoqa_type=int(t))
            for i, (image_id, q, a, t) in enumerate(zip(*columns.values()))]


# ---------------------------------------------------------------------------------- NLVR2
NLVR2_FILES = {'train': 'train', 'test': 'test1'}   # test1 = the public test split
NLVR2_QUESTION = ('The first image is the left one, the second the right one. '
                  'Is this statement true or false? "{sentence}"')


def load_nlvr2(root: str, split: str) -> list[dict]:
    """<train|test1>.json (JSON lines: identifier, sentence, label "True"/"False", directory
    for train); the pair's two images images/<train|test1>/[<directory>/]<pair>-img0.png and
    -img1.png, <pair> = identifier without its last "-<n>". Answer: "true" / "false"."""
    raw_split = NLVR2_FILES[split]
    out = []
    for row in read_jsonl(os.path.join(root, f'{raw_split}.json'), 'nlvr2', README):
        pair = row['identifier'].rsplit('-', 1)[0]
        folder = os.path.join(raw_split, str(row['directory'])) if 'directory' in row else raw_split
        images = [image_under(root, 'images', os.path.join(folder, f'{pair}-img{k}.png'), 'nlvr2') for k in (0, 1)]
        sentence = str(row['sentence']).strip()
        out.append(candidate(row['identifier'], 'nlvr2', images, NLVR2_QUESTION.format(sentence=sentence),
                             str(row['label']).strip().lower(), sentence=sentence))
    return out


# ------------------------------------------------------------------------- VizWiz, AQUA
def load_vizwiz(root: str, split: str) -> list[dict]:
    """Fed-VQA's VizWiz reader: answer = the annotators' majority answer."""
    return from_fedvqa(fedvqa.load_vizwiz(root, split), 'vizwiz')


def load_aqua(root: str, split: str) -> list[dict]:
    """Fed-VQA's AQUA reader: train.json / test.json, images in images/."""
    return from_fedvqa(fedvqa.load_aqua(root, split), 'aqua')


LOADERS = {'gqa': load_gqa, 'abstract': load_abstract, 'snli_ve': load_snli_ve, 'cocoqa': load_cocoqa,
           'nlvr2': load_nlvr2, 'vizwiz': load_vizwiz, 'aqua': load_aqua}


"""Tiny raw-layout copies of the Fed-VQA and Fed-Med datasets, built in a tmp folder: a few
records per dataset with small PIL-generated images, laid out as the benchmarks' READMEs describe.

Each builder returns the number of records the prepare script should find usable per client and
split (single-word VQA answers, English SLAKE questions, one record per image+label box group)."""
from __future__ import annotations

import csv
import json
import os

from PIL import Image


def write_image(path: str, index: int, size: tuple[int, int] = (16, 12)) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    colour = ((37 * index) % 256, (91 * index) % 256, (53 * index) % 256)
    Image.new('RGB', size, colour).save(path)


def write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as handle:
        json.dump(data, handle)


def write_lines(path: str, lines) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as handle:
        handle.writelines(f'{line}\n' for line in lines)


def qa_pairs(n: int, split: str) -> list[tuple[str, str]]:
    """n single-word answers, then one multi-word answer the default filter drops."""
    pairs = [(f'what colour is thing {i} in {split}?', ['red', 'blue', 'Two', 'yes'][i % 4]) for i in range(n)]
    return pairs + [(f'what is written on the sign in {split}?', 'stop here now')]


def build_aqua(root: str, n: dict) -> None:
    for split, count in n.items():
        rows = [{'image': f'{split}_{i}.jpg', 'question': q, 'answer': a, 'need_external_knowledge': False}
                for i, (q, a) in enumerate(qa_pairs(count, split))]
        write_json(os.path.join(root, f'{split}.json'), rows)
        for row_index, row in enumerate(rows):
            write_image(os.path.join(root, 'images', row['image']), row_index)


def build_gqa(root: str, n: dict) -> None:
    files = {'train': 'train_balanced_questions.json', 'test': 'testdev_balanced_questions.json'}
    for split, count in n.items():
        questions = {f'{split}{i}': {'imageId': f'n{split}{i}', 'question': q, 'answer': a, 'fullAnswer': a}
                     for i, (q, a) in enumerate(qa_pairs(count, split))}
        write_json(os.path.join(root, 'questions', files[split]), questions)
        for i, q in enumerate(questions.values()):
            write_image(os.path.join(root, 'images', f'{q["imageId"]}.jpg'), i)


def build_vizwiz(root: str, n: dict) -> None:
    for split, raw_split in (('train', 'train'), ('test', 'val')):
        rows = []
        for i, (q, a) in enumerate(qa_pairs(n[split], split)):
            image = f'VizWiz_{raw_split}_{i:08d}.jpg'
            answers = ([{'answer': a, 'answer_confidence': 'yes'}] * 6
                       + [{'answer': 'other', 'answer_confidence': 'maybe'}] * 4)
            rows.append({'image': image, 'question': q, 'answers': answers, 'answerable': 1})
            write_image(os.path.join(root, raw_split, image), i)
        write_json(os.path.join(root, 'Annotations', f'{raw_split}.json'), rows)


def build_abstract(root: str, n: dict) -> None:
    for split, tag in (('train', 'train2015'), ('test', 'val2015')):
        questions, annotations = [], []
        for i, (q, a) in enumerate(qa_pairs(n[split], split)):
            qid, image_id = 1000 + i, 20 + i
            questions.append({'question_id': qid, 'image_id': image_id, 'question': q})
            annotations.append({'question_id': qid, 'image_id': image_id, 'multiple_choice_answer': a,
                                'answers': [{'answer': a, 'answer_id': k + 1} for k in range(10)]})
            write_image(os.path.join(root, f'scene_img_abstract_v002_{tag}',
                                     f'abstract_v002_{tag}_{image_id:012d}.png'), i)
        write_json(os.path.join(root, f'OpenEnded_abstract_v002_{tag}_questions.json'), {'questions': questions})
        write_json(os.path.join(root, f'abstract_v002_{tag}_annotations.json'), {'annotations': annotations})


def build_cocoqa(root: str, n: dict) -> None:
    for split, coco in (('train', 'train2014'), ('test', 'val2014')):
        pairs = qa_pairs(n[split], split)
        image_ids = [500 + i for i in range(len(pairs))]
        write_lines(os.path.join(root, split, 'img_ids.txt'), image_ids)
        write_lines(os.path.join(root, split, 'questions.txt'), [q for q, _ in pairs])
        write_lines(os.path.join(root, split, 'answers.txt'), [a for _, a in pairs])
        for i, image_id in enumerate(image_ids):
            write_image(os.path.join(root, 'images', coco, f'COCO_{coco}_{image_id:012d}.jpg'), i)


FEDVQA_BUILDERS = {'aqua': build_aqua, 'gqa': build_gqa, 'vizwiz': build_vizwiz, 'abstract': build_abstract,
                   'cocoqa': build_cocoqa}


def build_fedvqa_raw(root: str, n_train: int = 5, n_test: int = 3) -> dict:
    """Raw Fed-VQA layout under root; returns {client: {split: usable records}}."""
    for name, build in FEDVQA_BUILDERS.items():
        build(os.path.join(root, name), {'train': n_train, 'test': n_test})
    return {name: {'train': n_train, 'test': n_test} for name in FEDVQA_BUILDERS}


def build_slake(root: str, n: dict) -> None:
    for split, count in n.items():
        rows = []
        for i, (q, a) in enumerate(qa_pairs(count, split)):
            img_name = f'xmlab{split}{i}/source.jpg'
            rows.append({'qid': i, 'img_name': img_name, 'question': q, 'answer': a, 'q_lang': 'en',
                         'answer_type': 'OPEN'})
            write_image(os.path.join(root, 'imgs', img_name), i)
        rows.append({'qid': 999, 'img_name': rows[0]['img_name'], 'question': '这是什么?', 'answer': '肝',
                     'q_lang': 'zh', 'answer_type': 'OPEN'})
        write_json(os.path.join(root, f'{split}.json'), rows)


def build_vqa_rad(root: str, n: dict) -> None:
    rows = []
    for split, count in n.items():
        phrase = 'test_freeform' if split == 'test' else 'freeform'
        for i, (q, a) in enumerate(qa_pairs(count, split)):
            image = f'synpic{split}{i}.jpg'
            rows.append({'qid': f'{split}{i}', 'image_name': image, 'question': q, 'answer': a,
                         'phrase_type': phrase, 'answer_type': 'OPEN'})
            write_image(os.path.join(root, 'VQA_RAD Image Folder', image), i)
    rows.append({'qid': 'count', 'image_name': rows[0]['image_name'], 'question': 'how many?', 'answer': 2,
                 'phrase_type': 'para', 'answer_type': 'CLOSED'})     # an int answer, a train record
    write_json(os.path.join(root, 'VQA_RAD Dataset Public.json'), rows)


def build_mimic_cxr(root: str, n: dict) -> None:
    annotation = {'val': []}
    for split, count in n.items():
        annotation[split] = []
        for i in range(count):
            image_path = f'p10/p1000{i}/s5{i}/{split}{i}.jpg'
            annotation[split].append({'id': f'{split}{i}', 'study_id': 500 + i, 'subject_id': 1000 + i,
                                      'report': f'the lungs are clear . heart size {i} is normal .',
                                      'image_path': [image_path], 'split': split})
            write_image(os.path.join(root, 'images', image_path), i, size=(20, 20))
        annotation[split].append({'id': 'empty', 'study_id': 1, 'report': '  ', 'image_path': ['none.jpg']})
    write_json(os.path.join(root, 'annotation.json'), annotation)


def build_radgenome(root: str, n: dict) -> None:
    """Images of 200 × 100 pixels; record 0 of each split has two boxes for one label."""
    for split, count in n.items():
        rows = []
        for i in range(count):
            image = f'{split}/case{i}_slice10.png'
            write_image(os.path.join(root, 'images', image), i, size=(200, 100))
            rows.append({'image': image, 'label': 'lung nodule', 'x1': 20, 'y1': 10, 'x2': 100, 'y2': 50})
            if i == 0:
                rows.append({'image': image, 'label': 'lung nodule', 'x1': 150, 'y1': 60, 'x2': 200, 'y2': 100})
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, f'{split}_boxes.csv'), 'w', newline='', encoding='utf-8') as handle:
            writer = csv.DictWriter(handle, fieldnames=['image', 'label', 'x1', 'y1', 'x2', 'y2'])
            writer.writeheader()
            writer.writerows(rows)


FEDMED_BUILDERS = {'slake': build_slake, 'vqa_rad': build_vqa_rad, 'mimic_cxr': build_mimic_cxr,
                   'radgenome': build_radgenome}


def build_fedmed_raw(root: str, n_train: int = 5, n_test: int = 3) -> dict:
    """Raw Fed-Med layout under root; returns {client: {split: usable records}}."""
    for name, build in FEDMED_BUILDERS.items():
        build(os.path.join(root, name), {'train': n_train, 'test': n_test})
    return {'vqa': {'train': 2 * n_train + 1, 'test': 2 * n_test},   # + VQA-RAD's int answer
            'report': {'train': n_train, 'test': n_test},
            'detection': {'train': n_train, 'test': n_test}}

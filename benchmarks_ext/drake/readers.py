"""Reading one DRAKE task folder, RAW/<dataset>[/<subset>]/ (benchmarks_ext/drake/README.md):

- train.json + test.json (the task's own split), or one data.json (a pool prepare.py splits);
  .jsonl instead of .json is read too;
- each file holds instruction records in one of two common forms:
    LLaVA conversations  {"id"?, "image": path | [paths], "conversations": [{"from": "human",
                          "value": question}, {"from": "gpt", "value": answer}, ...]}
    flat                 {"id"?, "image" | "images": path | [paths], "question" | "instruction",
                          "answer" | "output", "options" | "choices"?}
  (the first human -> gpt exchange of a conversation is the sample);
- relative image paths are looked up under the task folder, then the dataset folder, then RAW.

Image placeholders in the text (<image>, <image_1>, <img0>, {image#1}, <ImageHere>) are removed:
the model's codec puts one placeholder per image before the question itself.
"""
from __future__ import annotations

import os
import re

from benchmarks_ext.common import PrepareError, read_json, read_jsonl
from benchmarks_ext.drake.table import DrakeTask

README = 'benchmarks_ext/drake/README.md'
SPLIT_FILES = {'train': 'train', 'test': 'test'}
POOL_FILE = 'data'
EXTENSIONS = ('.json', '.jsonl')
QUESTION_KEYS, ANSWER_KEYS = ('question', 'instruction'), ('answer', 'output')
KEPT_FIELDS = ('options', 'choices')
HUMAN, ASSISTANT = ('human', 'user'), ('gpt', 'assistant')
IMAGE_TOKEN = re.compile(r'<\s*(?:image|img)[\s_#-]*\d*\s*>|\{\s*image\s*#?\s*\d*\s*\}|<imagehere>',
                         re.IGNORECASE)


def find_file(folder: str, stem: str) -> str | None:
    for ext in EXTENSIONS:
        path = os.path.join(folder, stem + ext)
        if os.path.isfile(path):
            return path
    return None


def read_rows(path: str, dataset: str) -> list[dict]:
    if path.endswith('.jsonl'):
        return read_jsonl(path, dataset, README)
    rows = read_json(path, dataset, README)
    if not isinstance(rows, list):
        raise PrepareError(f'{dataset}: {path} must hold a JSON list of records')
    return rows


def task_files(raw: str, task: DrakeTask) -> dict[str, str]:
    """{'train': path, 'test': path} or {'pool': path}; a missing file names what is expected."""
    folder = os.path.join(raw, task.folder)
    found = {split: find_file(folder, stem) for split, stem in SPLIT_FILES.items()}
    if all(found.values()):
        return found
    pool = find_file(folder, POOL_FILE)
    if pool and not any(found.values()):
        return {'pool': pool}
    missing = [s for s, path in found.items() if not path] if any(found.values()) else list(SPLIT_FILES)
    raise PrepareError(f'{task.dataset}: missing raw file {os.path.join(folder, SPLIT_FILES[missing[0]])}.json '
                       f'(task {task.label}: train.json + test.json, or one {POOL_FILE}.json to split; '
                       f'.jsonl also read; expected layout: {README})')


def question_and_answer(row: dict, where: str) -> tuple[str, str]:
    if 'conversations' in row:
        turns = row['conversations']
        for turn, reply in zip(turns, turns[1:]):
            if turn.get('from') in HUMAN and reply.get('from') in ASSISTANT:
                return turn['value'], reply['value']
        raise PrepareError(f'{where}: no human -> gpt exchange in "conversations"')
    question = next((row[k] for k in QUESTION_KEYS if k in row), None)
    answer = next((row[k] for k in ANSWER_KEYS if k in row), None)
    if question is None or answer is None:
        raise PrepareError(f'{where}: needs "conversations", or {" / ".join(QUESTION_KEYS)} and '
                           f'{" / ".join(ANSWER_KEYS)}')
    return question, answer


def clean_question(text: str) -> str:
    text = IMAGE_TOKEN.sub(' ', str(text))
    text = re.sub(r'[ \t]+', ' ', text)
    return '\n'.join(line.strip() for line in text.split('\n')).strip()


def resolve_image(path: str, raw: str, task: DrakeTask, where: str) -> tuple[str, str]:
    """(absolute path, path under the output's images/): RAW-relative, or external/<absolute>."""
    if os.path.isabs(path):
        tried = [path]
    else:
        bases = (os.path.join(raw, task.folder), os.path.join(raw, task.dataset), raw)
        tried = [os.path.normpath(os.path.join(base, path)) for base in dict.fromkeys(bases)]
    src = next((p for p in tried if os.path.isfile(p)), None)
    if src is None:
        raise PrepareError(f'{task.dataset}: missing raw file {tried[0]} ({where}; also looked for '
                           f'{", ".join(tried[1:]) or "nothing else"})')
    src = os.path.abspath(src)
    rel = os.path.relpath(src, os.path.abspath(raw))
    if rel.startswith('..'):
        rel = os.path.join('external', src.lstrip(os.sep))
    return src, rel.replace(os.sep, '/')


def to_candidate(row: dict, index: int, path: str, raw: str, task: DrakeTask) -> dict:
    where = f'{path} record {index}'
    if not isinstance(row, dict):
        raise PrepareError(f'{task.dataset}: {where} is not a JSON object')
    images = row.get('image', row.get('images'))
    images = [images] if isinstance(images, str) else list(images or [])
    if not images:
        raise PrepareError(f'{task.dataset}: {where} has no "image" / "images"')
    question, answer = question_and_answer(row, f'{task.dataset}: {where}')
    candidate = {'raw_id': index, 'source': task.dataset,
                 'images': [resolve_image(str(p), raw, task, where) for p in images],
                 'question': clean_question(question), 'answer': str(answer).strip()}
    if 'id' in row:
        candidate['source_id'] = row['id']
    candidate.update({k: row[k] for k in KEPT_FIELDS if k in row})
    return candidate

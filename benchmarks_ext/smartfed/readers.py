"""Readers of the raw files of SmartFed's three skill-composition tasks (Table 4), each returning
candidates: dicts with raw_id, instruction, input, output, group (the label of the non-IID
partition) and the fields the task's metric needs. Formats and download addresses:
benchmarks_ext/smartfed/README.md.
"""
from __future__ import annotations

import csv
import glob
import json
import os
import re

from benchmarks_ext.common import PrepareError
from fs_plugins.metrics.math_answers import parse_number

README = 'benchmarks_ext/smartfed/README.md'
SOURCES = {
    'math23k': 'Math23K (Wang et al., 2017), e.g. Math_23K.json as loaded by the GTS code '
               '(github.com/ShichaoSun/math_seq2tree, data/Math_23K.json), or its '
               'math23k_train.json / math23k_test.json split',
    'mgsm': 'MGSM (github.com/google-research/url-nlp, mgsm/mgsm_zh.tsv; also '
            'huggingface.co/datasets/juletxara/mgsm)',
    'doit': 'DoIT (git clone https://huggingface.co/datasets/ChiyuSONG/dynamics-of-instruction-tuning '
            'RAW/doit)',
    'doit_tests': 'not part of the DoIT release (its code test set is scored by perplexity over '
                  'three choices); write the unit tests yourself, one JSON line per test record',
    'mathcodeinstruct': 'MathCodeInstruct (huggingface.co/datasets/MathLLMs/MathCodeInstruct, '
                        'train_80k.jsonl)',
    'gsm_hard': 'GSM-Hard (huggingface.co/datasets/reasoning-machines/gsm-hard, gsmhardv2.jsonl)',
}

# The instruction every Chinese math record carries (the problem is the record's input): the
# training outputs end with "答案：<number>", the line mgsm_accuracy reads first.
MATH_INSTRUCTION = '请解答下面的数学应用题，最后一行以“答案：”给出最终的数值。'


def missing(path: str, dataset: str) -> PrepareError:
    return PrepareError(f'{dataset}: missing raw file {path} (get it from: {SOURCES[dataset]}; '
                        f'layout: {README})')


def require(path: str, dataset: str) -> str:
    if not os.path.isfile(path):
        raise missing(path, dataset)
    return path


def read_objects(path: str, dataset: str) -> list:
    """The JSON values of a file that is a JSON array, JSON lines, or JSON objects one after
    another (Math23K's Math_23K.json: one pretty-printed object per 7 lines); a top-level
    object with a list under "data" gives that list."""
    with open(require(path, dataset), encoding='utf-8-sig') as handle:
        text = handle.read()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    else:
        if isinstance(whole, list):
            return whole
        if isinstance(whole, dict) and isinstance(whole.get('data'), list):
            return whole['data']
        return [whole]
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in ' \t\r\n,':
            pos += 1
        if pos >= len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            line = text.count('\n', 0, pos) + 1
            raise PrepareError(f'{dataset}: {path} is neither JSON, JSON lines nor a stream of JSON '
                               f'objects (line {line}: {err.msg})') from err
        values.append(value)


def _objects(rows: list, path: str, dataset: str) -> list[dict]:
    bad = [i for i, row in enumerate(rows) if not isinstance(row, dict)]
    if bad:
        raise PrepareError(f'{dataset}: {path}: entry {bad[0]} is not a JSON object')
    return rows


# ---------------------------------------------------------------- Math23K and MGSM (zh)

def math23k_files(folder: str) -> list[str]:
    files = sorted(p for p in glob.glob(os.path.join(folder, '*.json*')) if p.endswith(('.json', '.jsonl')))
    if not files:
        raise missing(os.path.join(folder, 'Math_23K.json'), 'math23k')
    return files


def equation_operators(equation: str) -> int:
    return len(re.findall(r'[-+*/^]', equation.split('=', 1)[-1].replace('**', '^')))


def math23k_group(equation: str) -> str:
    """Non-IID label of a Math23K problem: how many arithmetic operators its equation has."""
    ops = equation_operators(equation)
    return f'ops_{min(max(ops, 1), 4)}{"+" if ops >= 4 else ""}'


def read_math23k(folder: str) -> tuple[list[dict], int]:
    """Math23K problems of every .json / .jsonl file in `folder` (ids deduplicated): fields id,
    original_text, equation ("x=..."), ans. Returns the candidates and the raw count."""
    seen, out, raw = set(), [], 0
    for path in math23k_files(folder):
        for row in _objects(read_objects(path, 'math23k'), path, 'math23k'):
            raw += 1
            text, answer = str(row.get('original_text') or '').strip(), str(row.get('ans') or '').strip()
            raw_id = str(row.get('id', f'{os.path.basename(path)}:{raw}'))
            if not text or not answer or raw_id in seen:
                continue
            seen.add(raw_id)
            equation = str(row.get('equation') or '').strip()
            expression = equation.split('=', 1)[1].strip() if equation.lower().startswith('x=') else equation
            steps = f'列式：{expression} = {answer}\n' if expression else ''
            out.append({'raw_id': raw_id, 'instruction': MATH_INSTRUCTION, 'input': text,
                        'output': f'{steps}答案：{answer}', 'group': math23k_group(equation),
                        'answer_number': parse_number(answer), 'answers': [answer]})
    return out, raw


def read_mgsm_zh(path: str) -> list[dict]:
    """MGSM's Chinese test set: mgsm_zh.tsv, one `question<TAB>answer` line per problem, no
    header (the layout of google-research/url-nlp)."""
    out = []
    with open(require(path, 'mgsm'), encoding='utf-8-sig', newline='') as handle:
        for number, row in enumerate(csv.reader(handle, delimiter='\t', quoting=csv.QUOTE_NONE), start=1):
            if not row or not ''.join(row).strip():
                continue
            if len(row) < 2:
                raise PrepareError(f'mgsm: {path} line {number}: expected question<TAB>answer')
            question, answer = row[0].strip(), row[-1].strip()
            value = parse_number(answer)
            if value is None:
                raise PrepareError(f'mgsm: {path} line {number}: answer {answer!r} is not a number')
            out.append({'raw_id': str(number), 'instruction': MATH_INSTRUCTION, 'input': question,
                        'output': f'答案：{answer}', 'group': 'mgsm', 'answer_number': value,
                        'answers': [answer]})
    return out


# ---------------------------------------------------------------- DoIT (code)

DOIT_TRAIN = os.path.join('curated', 'full', 'code_full.json')
DOIT_TEST = os.path.join('curated', 'test', 'code_test.json')
DOIT_TESTS = 'code_tests.jsonl'
TEST_FIELDS = ('test', 'test_list', 'entry_point', 'test_setup')


def _message_text(content) -> str:
    if isinstance(content, list):   # [{'type': 'text', 'content': ...}, ...]
        return '\n'.join(str(part.get('content', part.get('text', ''))) if isinstance(part, dict)
                         else str(part) for part in content)
    return str(content or '')


def doit_pair(row: dict) -> tuple[str, str]:
    """(instruction, answer) of a DoIT record: the last user message and the assistant reply
    after it; with `question_format` 1 (choose among `choices`, the first correct) the answer
    is choices[0]."""
    messages = row.get('messages') or []
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get('role') == 'user']
    if not users:
        return '', ''
    last = users[-1]
    instruction = _message_text(messages[last].get('content')).strip()
    replies = [m for m in messages[last + 1:] if isinstance(m, dict) and m.get('role') == 'assistant']
    answer = _message_text(replies[0].get('content')).strip() if replies else ''
    if str(row.get('question_format', '0')) == '1' and row.get('choices'):
        answer = str(row['choices'][0]).strip()
    return instruction, answer


def doit_group(answer: str) -> str:
    """Non-IID label of a DoIT code problem: the length of its reference solution."""
    lines = len([line for line in answer.splitlines() if line.strip()])
    return 'short' if lines < 10 else 'medium' if lines <= 25 else 'long'


def read_doit(folder: str, split: str) -> tuple[list[dict], int]:
    """DoIT's code records of one split (train: curated/full/code_full.json, test:
    curated/test/code_test.json; JSON lines or a JSON array of {"messages": [...], ...})."""
    path = os.path.join(folder, DOIT_TRAIN if split == 'train' else DOIT_TEST)
    rows = _objects(read_objects(path, 'doit'), path, 'doit')
    out = []
    for index, row in enumerate(rows):
        instruction, answer = doit_pair(row)
        if not instruction or not answer:
            continue
        candidate = {'raw_id': str(row.get('id', index)), 'index': index, 'instruction': instruction,
                     'input': '', 'output': answer, 'group': doit_group(answer)}
        candidate.update({k: row[k] for k in TEST_FIELDS if row.get(k)})
        out.append(candidate)
    return out, len(rows)


def read_doit_tests(path: str) -> dict[str, dict]:
    """The user's unit tests of DoIT's test records: JSON lines {"index": <0-based position in
    code_test.json> | "id": <the record's id>, "test": "...", "entry_point"?, "test_list"?,
    "test_setup"?}. Keys: 'index:<n>' / 'id:<id>'."""
    tests = {}
    for number, row in enumerate(read_objects(require(path, 'doit_tests'), 'doit_tests'), start=1):
        if not isinstance(row, dict) or not any(row.get(k) for k in ('test', 'test_list')):
            raise PrepareError(f'doit_tests: {path} entry {number}: expected an object with "test" '
                               f'or "test_list"')
        if 'id' in row:
            tests[f'id:{row["id"]}'] = row
        elif 'index' in row:
            tests[f'index:{int(row["index"])}'] = row
        else:
            raise PrepareError(f'doit_tests: {path} entry {number}: no "index" or "id"')
    return tests


def doit_test_spec(candidate: dict) -> dict:
    """The pass@1 reference (fs_plugins.metrics.execution) of a DoIT test candidate."""
    return {k: candidate[k] for k in TEST_FIELDS if candidate.get(k)}


# ---------------------------------------------------------------- MathCodeInstruct and GSM-Hard

def render_blocks(content) -> str:
    """An assistant message of MathCodeInstruct as text: its blocks in order, text as it is,
    code in ```python fences, execution results in ```output fences."""
    if not isinstance(content, list):
        return str(content or '').strip()
    parts = []
    for block in content:
        if not isinstance(block, dict):
            parts.append(str(block))
            continue
        kind, text = block.get('type', 'text'), str(block.get('content', '')).strip('\n')
        if kind == 'code':
            parts.append(f'```python\n{text}\n```')
        elif kind == 'execution':
            parts.append(f'```output\n{text}\n```')
        else:
            parts.append(text.strip())
    return '\n'.join(p for p in parts if p.strip())


def mathcode_group(content) -> str:
    """Non-IID label of a MathCodeInstruct solution: how many code blocks it has."""
    blocks = sum(1 for b in content if isinstance(b, dict) and b.get('type') == 'code') \
        if isinstance(content, list) else str(content).count('```python')
    return f'code_{min(blocks, 3)}{"+" if blocks >= 3 else ""}'


def mathcode_files(folder: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(folder, '*.jsonl')))
    if not files:
        raise missing(os.path.join(folder, 'train_80k.jsonl'), 'mathcodeinstruct')
    return files


def read_mathcodeinstruct(folder: str) -> tuple[list[dict], int]:
    """MathCodeInstruct solutions of every .jsonl file in `folder`: {"messages": [{"role":
    "system" | "user" | "assistant", "content": [{"type": "text" | "code" | "execution",
    "content": ...}]}]}; the first user message is the problem, the first assistant message
    after it the solution."""
    out, raw = [], 0
    for path in mathcode_files(folder):
        for index, row in enumerate(_objects(read_objects(path, 'mathcodeinstruct'), path, 'mathcodeinstruct')):
            raw += 1
            messages = [m for m in row.get('messages') or [] if isinstance(m, dict)]
            users = [i for i, m in enumerate(messages) if m.get('role') == 'user']
            if not users:
                continue
            question = _message_text(messages[users[0]].get('content')).strip()
            replies = [m for m in messages[users[0] + 1:] if m.get('role') == 'assistant']
            if not question or not replies:
                continue
            solution = render_blocks(replies[0].get('content'))
            if not solution:
                continue
            out.append({'raw_id': f'{os.path.splitext(os.path.basename(path))[0]}-{row.get("id", index)}',
                        'instruction': question, 'input': '', 'output': solution,
                        'group': mathcode_group(replies[0].get('content'))})
    return out, raw


def read_gsm_hard(path: str) -> list[dict]:
    """GSM-Hard: gsmhardv2.jsonl, {"input": question, "code": PAL program, "target": number}."""
    out = []
    for index, row in enumerate(_objects(read_objects(path, 'gsm_hard'), path, 'gsm_hard')):
        question, target = str(row.get('input') or '').strip(), parse_number(row.get('target'))
        if not question or target is None:
            raise PrepareError(f'gsm_hard: {path} entry {index}: expected "input" and a numeric "target"')
        code = str(row.get('code') or '').strip()
        out.append({'raw_id': str(index), 'instruction': question, 'input': '',
                    'output': f'```python\n{code}\n```' if code else '', 'group': 'gsm_hard',
                    'target': target, 'code': code, 'answers': [repr(target)]})
    return out

"""Small instruction datasets generated locally (no download), for tests and the demo."""
from __future__ import annotations

import inspect
import json
import os

import numpy as np

from fs_plugins.data.easyvqa import easyvqa_records
from fs_plugins.data.easyvqa_audio import easyvqa_image_audio_records
from fs_plugins.data.multimodal import write_jsonl
from fs_plugins.data.tiny_media import tiny_media_records

_WORDS = ['apple', 'river', 'stone', 'cloud', 'green', 'quick', 'music', 'paper', 'light', 'ocean',
          'tiger', 'window', 'silver', 'garden', 'planet', 'yellow', 'forest', 'candle', 'bridge', 'winter']


def _arith(rng):
    a, b = (int(x) for x in rng.integers(0, 50, size=2))
    return {'instruction': 'Add the two numbers.', 'input': f'{a} {b}', 'output': str(a + b)}


def _reverse(rng):
    words = [str(w) for w in rng.choice(_WORDS, size=3, replace=False)]
    return {'instruction': 'Reverse the order of the words.', 'input': ' '.join(words),
            'output': ' '.join(reversed(words))}


def _upper(rng):
    word = str(rng.choice(_WORDS))
    return {'instruction': f'Write the word {word} in capital letters.', 'input': '',
            'output': word.upper()}


def _count(rng):
    n = int(rng.integers(1, 6))
    words = [str(w) for w in rng.choice(_WORDS, size=n)]
    return {'instruction': 'How many words are in the input?', 'input': ' '.join(words),
            'output': str(n)}


TINY_TASKS = {'arith': _arith, 'reverse': _reverse, 'upper': _upper, 'count': _count}


def tiny_tasks_records(per_category: int = 60, seed: int = 0) -> list[dict]:
    """Four categories of toy instructions, a natural non-IID split by 'category'."""
    rng = np.random.default_rng(seed)
    records = []
    for category, make in TINY_TASKS.items():
        for _ in range(per_category):
            records.append({**make(rng), 'category': category})
    return records


def champ_math_records() -> list[dict]:
    """The 270 competition math problems of CHAMP (`pip install champ-dataset`, MIT), read
    offline from the package: instruction = problem, output = its final answer, category =
    one of Combinatorics, Inequality, Number-Theory, Polynomial, Sequence."""
    from importlib import resources
    try:
        source = resources.files('champ_dataset') / 'dataset_files' / 'v0.json'
    except ModuleNotFoundError:
        raise FileNotFoundError("data.type champ_math needs the champ-dataset package: "
                                "pip install champ-dataset") from None
    problems = json.loads(source.read_text(encoding='utf-8'))['problems']
    return [{'instruction': p['_text'], 'input': '', 'output': p['_answer'],
             'category': p['category'], 'id': p['identifier']} for p in problems.values()]


# name -> records function; a function with a `root` parameter writes media files under the
# data root (the JSONL's folder) and receives it
BUILTIN_DATASETS = {'tiny_tasks': tiny_tasks_records, 'champ_math': champ_math_records,
                    'easyvqa': easyvqa_records, 'tiny_media': tiny_media_records,
                    'easyvqa_image_audio': easyvqa_image_audio_records}


def builtin_records(name: str, root: str) -> list[dict]:
    make = BUILTIN_DATASETS[name]
    return make(root=root) if 'root' in inspect.signature(make).parameters else make()


def builtin_path(name: str, root: str) -> str:
    return os.path.join(root, f'{name}.jsonl')


def ensure_builtin(name: str, root: str) -> str | None:
    """Writes builtin dataset `name` as <root>/<name>.jsonl if missing; None if not builtin."""
    if name not in BUILTIN_DATASETS:
        return None
    path = builtin_path(name, root)
    if not os.path.isfile(path):
        write_jsonl(path, builtin_records(name, root))
    return path

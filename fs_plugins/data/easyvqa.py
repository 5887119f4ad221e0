"""The `easyvqa` builtin dataset: the easy-vqa package's 64×64 shape images and questions
(MIT), as normalised multimodal records with one task per question type — shape, colour,
yes/no — the natural non-IID split (one client per task, `split_field: task`).

Fixed, seeded subsets of easy-vqa's own train and test splits keep a CPU run short; the
records carry `split`, so use `fsplug.data.split_from_records: True`.
"""
from __future__ import annotations

import numpy as np

SHAPES = frozenset({'circle', 'rectangle', 'triangle'})
COLOURS = frozenset({'red', 'green', 'blue', 'black', 'gray', 'teal', 'brown', 'yellow'})
TRAIN_PER_TASK, TEST_PER_TASK, SUBSET_SEED = 600, 30, 0


def question_task(answer: str) -> str:
    if answer in SHAPES:
        return 'shape'
    if answer in COLOURS:
        return 'colour'
    return 'yes_no'


def _split_records(split: str, questions, answers, image_ids, image_paths, per_task, rng):
    by_task: dict[str, list[int]] = {}
    for index, answer in enumerate(answers):
        by_task.setdefault(question_task(answer), []).append(index)
    records = []
    for task in sorted(by_task):
        chosen = sorted(rng.choice(by_task[task], size=min(per_task, len(by_task[task])),
                                   replace=False).tolist())
        for index in chosen:
            records.append({'id': f'{split}-{index}', 'image': image_paths[int(image_ids[index])],
                            'question': questions[index], 'answer': answers[index],
                            'task': task, 'source': 'easy-vqa', 'split': split})
    return records


def easyvqa_records(train_per_task: int = TRAIN_PER_TASK, test_per_task: int = TEST_PER_TASK,
                    seed: int = SUBSET_SEED) -> list[dict]:
    try:
        import easy_vqa
    except ImportError as exc:
        raise ImportError("The easyvqa dataset needs the 'easy-vqa' package: "
                          "pip install easy-vqa") from exc
    rng = np.random.default_rng(seed)
    return (_split_records('train', *easy_vqa.get_train_questions(),
                           easy_vqa.get_train_image_paths(), train_per_task, rng)
            + _split_records('test', *easy_vqa.get_test_questions(),
                             easy_vqa.get_test_image_paths(), test_per_task, rng))

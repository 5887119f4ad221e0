"""The `easyvqa_image_audio` builtin dataset: the `easyvqa` records where a seeded half of every
(split, task) group asks its question in speech instead of text.

Spoken-question records: `audio` = a 16 kHz WAV of the question spoken by espeak-ng,
`question` = '' (the question is only in the audio; its text is kept in `spoken_question` for
checks), `modalities` ['image', 'audio']. The other records keep their text question,
`modalities` ['image']. Field `client_group` is 'image-1' / 'image-2' for text-question records
and 'spoken-1' / 'spoken-2' for spoken ones, alternating in a seeded order so every task is
balanced across the groups: `by_source` with `split_field: client_group` gives 4 clients.

The WAVs are written once (existing files are kept) under <root>/easyvqa_image_audio_audio/,
and referenced relative to `root` (the JSONL's folder).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fs_plugins.data.easyvqa import SUBSET_SEED, TEST_PER_TASK, TRAIN_PER_TASK, easyvqa_records
from fs_plugins.data.speech import espeak_binary, synthesize_speech

DATASET_NAME = 'easyvqa_image_audio'
AUDIO_FOLDER = f'{DATASET_NAME}_audio'
AUDIO_SAMPLE_RATE = 16000
SPOKEN_SEED = 0


def assign_client_groups(records: list[dict], seed: int = SPOKEN_SEED) -> list[str]:
    """One client group per record: in each (split, task) group a seeded half (rounded down)
    is spoken; spoken and image records each alternate between their two groups, the
    alternation running on across tasks so odd group sizes stay balanced."""
    rng = np.random.default_rng(seed)
    by_key: dict[tuple[str, str], list[int]] = {}
    for index, record in enumerate(records):
        by_key.setdefault((record.get('split', 'train'), record['task']), []).append(index)
    groups: list[str] = [''] * len(records)
    counters: dict[tuple[str, str], int] = {}
    for key in sorted(by_key):
        order = rng.permutation(by_key[key]).tolist()
        half = len(order) // 2
        for rank, index in enumerate(order):
            kind = 'spoken' if rank < half else 'image'
            count = counters.get((key[0], kind), 0)
            groups[index] = f'{kind}-{count % 2 + 1}'
            counters[(key[0], kind)] = count + 1
    return groups


def spoken_record(record: dict, group: str, audio_path: str) -> dict:
    """`record` with its question moved into the audio file `audio_path` (relative)."""
    return {**record, 'audio': audio_path, 'question': '', 'spoken_question': record['question'],
            'modalities': ['image', 'audio'], 'client_group': group}


def _synthesize_missing(jobs: list[tuple[str, str]], workers: int, voice: str,
                        words_per_minute: int) -> None:
    """Synthesises (text, wav path) jobs whose file does not exist yet, `workers` at a time."""
    missing = [(text, path) for text, path in jobs if not os.path.isfile(path)]
    if not missing:
        return
    espeak_binary()  # fail early, naming the program and its package

    def run(job):
        synthesize_speech(job[0], job[1], voice, words_per_minute, AUDIO_SAMPLE_RATE)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(run, missing))


def easyvqa_image_audio_records(root: str, train_per_task: int = TRAIN_PER_TASK,
                                test_per_task: int = TEST_PER_TASK, seed: int = SUBSET_SEED,
                                spoken_seed: int = SPOKEN_SEED, voice: str = 'en-us',
                                words_per_minute: int = 160,
                                workers: int | None = None) -> list[dict]:
    """The easyvqa records (same subset for the same counts and seed) with half of their
    questions spoken (see the module docstring); WAVs under <root>/easyvqa_image_audio_audio/."""
    records = easyvqa_records(train_per_task, test_per_task, seed)
    groups = assign_client_groups(records, spoken_seed)
    out, jobs = [], []
    for record, group in zip(records, groups):
        if group.startswith('spoken'):
            relative = f"{AUDIO_FOLDER}/{record['id']}.wav"
            jobs.append((record['question'], os.path.join(root, relative)))
            out.append(spoken_record(record, group, relative))
        else:
            out.append({**record, 'modalities': ['image'], 'client_group': group})
    _synthesize_missing(jobs, workers or os.cpu_count() or 1, voice, words_per_minute)
    return out

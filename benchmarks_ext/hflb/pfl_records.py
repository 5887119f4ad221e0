"""Writing a benchmark whose clients each learn a sequence of tasks (HFLB, DRAKE; FedMosaic's
PFL-Dynamic): per client, task and split a seeded draw of candidates, one normalised multimodal
record per drawn candidate (`fs_plugins.data.multimodal`), all in one JSONL file.

A candidate is a dict with
    raw_id    id unique within its (client, task, split) pool (a question id, a row index)
    images    [(absolute source path, path under the output's images/ folder), ...]
    question, answer, source (dataset name) and any extra fields, kept in the record.

Each record carries, besides id / image / question / answer:
    client     CLIENT_FIELD: one value per client (data.splitter: by_source,
               fsplug.data.split_field: client); names sort in the paper's client order
    pfl_task   TASK_FIELD: the task within the client (fsplug.data.task_field: pfl_task);
               't<k>_...' so that sorting gives the paper's task order
    task_label the paper's name of that task
    task       the kind of task ('vqa', 'visual_relation', ...), as in the other benchmarks
    split      'train' | 'test' (fsplug.data.split_from_records: True)
"""
from __future__ import annotations

import argparse
import json
import os
import random
from collections import Counter
from dataclasses import dataclass, field

from benchmarks_ext.common import IMAGE_MODES, SPLITS, ImagePlacer, PrepareError
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.multimodal import write_jsonl

CLIENT_FIELD = 'client'
TASK_FIELD = 'pfl_task'
CANDIDATE_KEYS = ('raw_id', 'images')


@dataclass(frozen=True)
class TaskSpec:
    key: str      # value of the record's pfl_task, e.g. 't1_attribute'
    label: str    # the paper's name of the task


@dataclass
class TaskPool:
    """The candidates of one client's task, per split."""
    client: str
    task: TaskSpec
    kind: str
    candidates: dict[str, list[dict]] = field(default_factory=lambda: {s: [] for s in SPLITS})


def parse_count(text: str | None, option: str) -> int | None:
    """'all' (or None) = no cap; else a positive int."""
    if text is None or str(text).strip() == 'all':
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise PrepareError(f'{option}: expected a positive integer or "all", got {text!r}')
    return value


def draw(candidates: list[dict], size: int | None, seed: int, tags: tuple) -> list[dict]:
    """min(size, available) candidates without replacement, by a generator seeded from
    (seed, *tags), kept in raw-file order; size None keeps them all."""
    if size is None or size >= len(candidates):
        return list(candidates)
    rng = random.Random(derive_seed(seed, *tags))
    return [candidates[i] for i in sorted(rng.sample(range(len(candidates)), size))]


def to_record(candidate: dict, pool: TaskPool, split: str, placer: ImagePlacer, readme: str) -> dict:
    images = [placer.place(src, '', rel, candidate['source'], readme) for src, rel in candidate['images']]
    record = {'id': f'{pool.client}-{pool.task.key}-{split}-{candidate["raw_id"]}',
              'image': images[0] if len(images) == 1 else images,
              'question': candidate['question'], 'answer': candidate['answer'],
              'task': pool.kind, TASK_FIELD: pool.task.key, 'task_label': pool.task.label,
              'source': candidate['source'], 'split': split, CLIENT_FIELD: pool.client}
    record.update({k: v for k, v in candidate.items() if k not in record and k not in CANDIDATE_KEYS})
    return record


def summary_path(out_file: str) -> str:
    stem = out_file[:-len('.jsonl')] if out_file.endswith('.jsonl') else out_file
    return f'{stem}_summary.json'


def write_benchmark(name: str, pools: list[TaskPool], out_file: str, seed: int,
                    sizes: dict[str, int | None], images: str, readme: str, notes: dict | None = None) -> dict:
    """Writes out_file (pools in order, train then test within each) and its _summary.json
    (with `notes` merged in); images go under <out_file's folder>/images/. `sizes`: per split,
    the most records drawn per task (None: all). A task left without records in a split is an
    error: PFL-Dynamic needs every task in training and in evaluation."""
    placer = ImagePlacer(os.path.dirname(os.path.abspath(out_file)), images)
    records = []
    summary = {'benchmark': name, 'seed': seed, 'per_task': sizes, **(notes or {}), 'clients': {}}
    for pool in pools:
        counts = summary['clients'].setdefault(pool.client, {}).setdefault(
            pool.task.key, {'label': pool.task.label})
        for split in SPLITS:
            available = pool.candidates[split]
            if not available:
                raise PrepareError(f'{pool.client} {pool.task.key} ({pool.task.label}) {split}: no records '
                                   f'in the raw data (see {readme})')
            chosen = draw(available, sizes[split], seed, (name, pool.client, pool.task.key, split))
            records += [to_record(c, pool, split, placer, readme) for c in chosen]
            counts[split] = {'available': len(available), 'written': len(chosen)}
    duplicates = sorted(k for k, n in Counter(r['id'] for r in records).items() if n > 1)
    if duplicates:
        raise PrepareError(f'{name}: duplicate record ids {duplicates[:5]} in the raw files')
    write_jsonl(out_file, records)
    with open(summary_path(out_file), 'w', encoding='utf-8') as handle:
        json.dump(summary, handle, indent=2)
    return summary


def print_summary(summary: dict, out_file: str) -> None:
    for client, tasks in summary['clients'].items():
        for key, counts in tasks.items():
            print(client, key, ' '.join(f'{s}={counts[s]["written"]}/{counts[s]["available"]}' for s in SPLITS),
                  f'({counts["label"]})')
    print('wrote', out_file)


def check_out_file(out_file: str) -> str:
    if not str(out_file).endswith('.jsonl'):
        raise PrepareError(f'--out: {out_file!r} is not a .jsonl file path')
    return out_file


def base_parser(description: str, per_task: int | None, test_per_task: int | None) -> argparse.ArgumentParser:
    def shown(value):
        return 'all' if value is None else value
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument('--raw', required=True, help='folder holding one sub-folder per raw dataset')
    parser.add_argument('--out', required=True, help='output .jsonl file (images go next to it, in images/)')
    parser.add_argument('--per-task', default=None,
                        help=f'training records drawn per client task: N or all (default {shown(per_task)})')
    parser.add_argument('--test-per-task', default=None,
                        help=f'test records drawn per client task: N or all (default {shown(test_per_task)})')
    parser.add_argument('--seed', type=int, default=0, help='subsampling seed (default 0)')
    parser.add_argument('--images', default='symlink', choices=IMAGE_MODES,
                        help='symlink (default) or copy the used images under images/ next to --out, or '
                             'reference the raw files by absolute path')
    return parser


def run_cli(name: str, parser: argparse.ArgumentParser, argv, prepare, per_task: int | None,
            test_per_task: int | None) -> dict:
    """Parses argv, calls prepare(raw, out, seed, per_task, test_per_task, images) and prints
    the per-task counts; a PrepareError ends the program with its message."""
    args = parser.parse_args(argv)
    try:
        per_task = per_task if args.per_task is None else parse_count(args.per_task, '--per-task')
        test_per_task = (test_per_task if args.test_per_task is None
                         else parse_count(args.test_per_task, '--test-per-task'))
        summary = prepare(args.raw, check_out_file(args.out), args.seed, per_task, test_per_task, args.images)
    except PrepareError as err:
        raise SystemExit(f'{name}: {err}') from err
    print_summary(summary, args.out)
    return summary

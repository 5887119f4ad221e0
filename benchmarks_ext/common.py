"""Shared steps of the benchmark preparation scripts.

Normalised multimodal record (one JSON object per line):
    {"id", "image" (path relative to the JSONL's folder, or absolute), "question", "answer",
     "task": "vqa" | "report" | "detection", "source": dataset name, "split": "train" | "test",
     "client": client name, ...extra fields ("annotator_answers", "boxes", "label", ...)}

A dataset loader returns candidates: dicts with raw_id, image_src (absolute path of the raw
image), image_rel (its path under the dataset's image folder), question, answer and any extra
fields; `finalise` turns a chosen candidate into a record and places its image.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
from collections import Counter

from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.multimodal import write_jsonl
from fs_plugins.metrics.vqa import normalize_answer

SPLITS = ('train', 'test')
IMAGE_MODES = ('symlink', 'copy', 'absolute')
CANDIDATE_KEYS = ('raw_id', 'image_src', 'image_rel')


class PrepareError(Exception):
    """Bad raw data or options; the message names the dataset and the file."""


def require_file(path: str, dataset: str, readme: str) -> str:
    if not os.path.isfile(path):
        raise PrepareError(f'{dataset}: missing raw file {path} (expected layout: {readme})')
    return path


def read_json(path: str, dataset: str, readme: str):
    with open(require_file(path, dataset, readme), encoding='utf-8') as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError as err:
            raise PrepareError(f'{dataset}: {path} is not valid JSON ({err})') from err


def read_lines(path: str, dataset: str, readme: str) -> list[str]:
    with open(require_file(path, dataset, readme), encoding='utf-8') as handle:
        return [line.rstrip('\n') for line in handle]


def read_jsonl(path: str, dataset: str, readme: str) -> list[dict]:
    """The objects of a JSON-lines file (blank lines skipped); a bad line is named."""
    rows = []
    for number, line in enumerate(read_lines(path, dataset, readme), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise PrepareError(f'{dataset}: {path} line {number} is not valid JSON ({err})') from err
    return rows


def read_csv(path: str, dataset: str, readme: str, columns: tuple[str, ...]) -> list[dict]:
    with open(require_file(path, dataset, readme), encoding='utf-8', newline='') as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise PrepareError(f'{dataset}: {path} lacks column(s) {missing}')
        return list(reader)


def majority_answer(answers: list[str]) -> str:
    """Most frequent answer (after stripping); ties go to the one seen first."""
    answers = [str(a).strip() for a in answers]
    counts = Counter(answers)
    return max(answers, key=lambda a: (counts[a], -answers.index(a)))


def is_single_word(answer: str) -> bool:
    return len(normalize_answer(answer).split()) == 1


def parse_sizes(text: str | None, defaults: dict[str, int], option: str) -> dict[str, int | None]:
    """'aqua=100,gqa=all' over the defaults; 'all' (None) keeps every usable record."""
    sizes = dict(defaults)
    for item in filter(None, (text or '').split(',')):
        name, _, value = item.partition('=')
        name = name.strip()
        if name not in defaults or not value:
            raise PrepareError(f'{option}: bad item {item!r}; expected NAME=N or NAME=all, '
                               f'NAME one of {sorted(defaults)}')
        sizes[name] = None if value.strip() == 'all' else int(value)
    return sizes


def subsample(candidates: list[dict], size: int | None, seed: int, tags: tuple, option: str) -> list[dict]:
    """`size` candidates drawn without replacement by a generator seeded from (seed, *tags),
    kept in file order; fails when fewer are available. tags = (benchmark, client, split)."""
    if size is None:
        return list(candidates)
    if size > len(candidates):
        raise PrepareError(f'{" ".join(map(str, tags[1:]))}: {len(candidates)} usable records but {size} '
                           f'requested; lower it with {option}')
    rng = random.Random(derive_seed(seed, *tags))
    return [candidates[i] for i in sorted(rng.sample(range(len(candidates)), size))]


class ImagePlacer:
    """Puts raw images where the JSONL points: symlinks or copies under <out>/images/<source>/,
    or the raw absolute path in place ('absolute')."""

    def __init__(self, out_dir: str, mode: str):
        if mode not in IMAGE_MODES:
            raise PrepareError(f'--images: {mode!r} is not one of {IMAGE_MODES}')
        self.out_dir, self.mode, self.placed = out_dir, mode, set()

    def place(self, src: str, source: str, rel: str, dataset: str, readme: str) -> str:
        require_file(src, dataset, readme)
        src = os.path.abspath(src)
        if self.mode == 'absolute':
            return src
        rel_out = os.path.join('images', source, rel).replace(os.sep, '/')
        dst = os.path.join(self.out_dir, rel_out)
        if dst not in self.placed:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if os.path.lexists(dst):
                os.remove(dst)
            if self.mode == 'symlink':
                os.symlink(src, dst)
            else:
                shutil.copyfile(src, dst)
            self.placed.add(dst)
        return rel_out


def finalise(candidate: dict, *, source: str, split: str, task: str, client: str,
             placer: ImagePlacer, readme: str) -> dict:
    record = {'id': f'{source}-{split}-{candidate["raw_id"]}',
              'image': placer.place(candidate['image_src'], source, candidate['image_rel'], source, readme),
              'question': candidate['question'], 'answer': candidate['answer'],
              'task': task, 'source': source, 'split': split, 'client': client}
    record.update({k: v for k, v in candidate.items() if k not in record and k not in CANDIDATE_KEYS})
    return record


def write_summary(path: str, summary: dict) -> None:
    with open(path, 'w', encoding='utf-8') as handle:
        json.dump(summary, handle, indent=2)


class Benchmark:
    """A benchmark's clients: client -> (task, [(source dataset, loader(dataset_root, split))]),
    default sizes per client and split, and the README that documents the raw layout."""

    def __init__(self, name: str, clients: dict, train_sizes: dict, test_sizes: dict, readme: str):
        self.name, self.clients, self.readme = name, clients, readme
        self.default_sizes = {'train': train_sizes, 'test': test_sizes}

    def prepare(self, raw: str, out: str, seed: int = 0, train_sizes: dict | None = None,
                test_sizes: dict | None = None, images: str = 'symlink', keep_multiword: bool = False) -> dict:
        """Writes <out>/<name>.jsonl (clients in order, train then test) and <out>/<name>_summary.json;
        VQA records keep single-word answers only unless keep_multiword."""
        sizes = {'train': {**self.default_sizes['train'], **(train_sizes or {})},
                 'test': {**self.default_sizes['test'], **(test_sizes or {})}}
        placer = ImagePlacer(out, images)
        records, summary = [], {'benchmark': self.name, 'seed': seed, 'keep_multiword': keep_multiword,
                                'clients': {}}
        for client, (task, sources) in self.clients.items():
            summary['clients'][client] = {}
            for split in SPLITS:
                pool = [dict(c, source=source) for source, load in sources
                        for c in load(os.path.join(raw, source), split)]
                usable = [c for c in pool if keep_multiword or task != 'vqa' or is_single_word(c['answer'])]
                chosen = subsample(usable, sizes[split][client], seed, (self.name, client, split),
                                   f'--{split}-sizes')
                records += [finalise(c, source=c['source'], split=split, task=task, client=client,
                                     placer=placer, readme=self.readme) for c in chosen]
                summary['clients'][client][split] = {
                    'raw': len(pool), 'usable': len(usable), 'written': len(chosen),
                    'by_source': {s: sum(c['source'] == s for c in chosen) for s, _ in sources}}
        duplicates = sorted(k for k, n in Counter(r['id'] for r in records).items() if n > 1)
        if duplicates:
            raise PrepareError(f'{self.name}: duplicate record ids {duplicates[:5]} in the raw files')
        write_jsonl(os.path.join(out, f'{self.name}.jsonl'), records)
        write_summary(os.path.join(out, f'{self.name}_summary.json'), summary)
        return summary

    def main(self, argv, description: str) -> dict:
        args = base_parser(description, *self.default_sizes.values()).parse_args(argv)
        try:
            summary = self.prepare(args.raw, args.out, args.seed,
                                   parse_sizes(args.train_sizes, self.default_sizes['train'], '--train-sizes'),
                                   parse_sizes(args.test_sizes, self.default_sizes['test'], '--test-sizes'),
                                   args.images, args.keep_multiword)
        except PrepareError as err:
            raise SystemExit(f'{self.name}: {err}') from err
        for client, splits in summary['clients'].items():
            print(client, ' '.join(f'{split}={v["written"]} (usable {v["usable"]}, raw {v["raw"]}, '
                                   f'by source {v["by_source"]})' for split, v in splits.items()))
        print('wrote', os.path.join(args.out, f'{self.name}.jsonl'))
        return summary


def base_parser(description: str, train_sizes: dict, test_sizes: dict) -> argparse.ArgumentParser:
    def listing(sizes):
        return ','.join(f'{k}={v}' for k, v in sizes.items())
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument('--raw', required=True, help='folder holding one sub-folder per raw dataset')
    parser.add_argument('--out', required=True, help='output folder')
    parser.add_argument('--seed', type=int, default=0, help='subsampling seed (default 0)')
    parser.add_argument('--train-sizes', help=f'NAME=N overrides; defaults {listing(train_sizes)}')
    parser.add_argument('--test-sizes', help=f'NAME=N overrides; defaults {listing(test_sizes)}')
    parser.add_argument('--images', default='symlink', choices=IMAGE_MODES,
                        help='symlink (default) or copy images into <out>/images/<source>/, or '
                             'reference the raw files by absolute path')
    parser.add_argument('--keep-multiword', action='store_true',
                        help='keep VQA records whose answer has several words (default: single-word '
                             'answers only, as in Fed-MoLE appendix A.2)')
    return parser

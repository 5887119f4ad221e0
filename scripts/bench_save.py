"""What saving the trained models adds to the last round, with peft's `save_pretrained` against
the plugin's `save_peft_adapters` (the same two files, without the model card), in one run.

Runs fedavg's tiny YAML for `--rounds` rounds (the last one saves every client's model and the
global state) with each way of writing a client's adapter, interleaved `--repeats` times, and
prints the last round's `other_s` (the time outside training, evaluation and aggregation, where
the save falls) and its round time, from `fs_plugins.run.results.time_split`.

    python scripts/bench_save.py [--rounds 3] [--repeats 2] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import fs_plugins.run.artifacts as artifacts
from fs_plugins.run.config import load_config
from fs_plugins.run.results import time_split
from fs_plugins.sim.runner import run_embedded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(REPO, 'yamls', 'fedavg', 'tiny.yaml')


def with_save_pretrained(model, folder: str) -> None:
    model.save_pretrained(folder)


WRITERS = {'save_pretrained': with_save_pretrained,
           'save_peft_adapters': artifacts.save_peft_adapters}


def last_round_split(writer, rounds: int, out_dir: str) -> dict:
    """time_split of the last round of a tiny fedavg run whose clients save with `writer`."""
    artifacts.save_peft_adapters = writer
    cfg = load_config(TINY_YAML, ['federate.total_round_num', str(rounds),
                                  'fsplug.results_dir', out_dir])
    run_embedded(cfg)
    with open(os.path.join(out_dir, 'results.jsonl'), encoding='utf-8') as handle:
        rows = [json.loads(line) for line in handle]
    return time_split([row for row in rows if row['round'] == rounds - 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--repeats', type=int, default=2)
    parser.add_argument('--quick', action='store_true', help='2 rounds, one repeat')
    args = parser.parse_args()
    rounds, repeats = (2, 1) if args.quick else (args.rounds, args.repeats)
    measured = {name: [] for name in WRITERS}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(repeats):
            for name, writer in WRITERS.items():
                measured[name].append(last_round_split(
                    writer, rounds, os.path.join(folder, f'{name}_{repeat}')))
    print(f'\nLast round of {rounds} (it saves the models), fedavg tiny, {repeats} repeat(s):')
    print('| adapter writer | other_s (median) | round s (median) | other % |')
    print('|---|---:|---:|---:|')
    for name, splits in measured.items():
        other = statistics.median(s['other_s'] for s in splits)
        total = statistics.median(s['total_s'] for s in splits)
        print(f'| {name} | {other:.3f} | {total:.3f} | {100 * other / total:.1f} |')


if __name__ == '__main__':
    main()

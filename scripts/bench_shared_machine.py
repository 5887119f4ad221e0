"""One small embedded job alone and beside CPU-bound neighbours, with torch's thread defaults
("before") and with the plugin's ("after"), slowdown ratios printed side by side in one run.

  job         yamls/standalone/tiny.yaml (random 2-layer Llama, 4 clients) for --rounds rounds
              through `python -m fs_plugins run --runner embedded`, one fresh process per run
  neighbour   a python process spinning on one core (`while True: pass`); --neighbours 1 2 runs
              the beside-case once per count. The neighbours start --warmup seconds before the
              job, so the 1-minute load average (which "after"'s automatic thread count reads)
              has seen them, as it has a test suite that has run for a while.
  before      fsplug.threads = every core the process may use (torch's default) and OpenMP's
              default waiting: GOMP_SPINCOUNT=300000 (libgomp's value when OMP_WAIT_POLICY is
              unset; setting it also keeps fs_plugins from choosing PASSIVE)
  after       fsplug.threads = 0 (auto: fs_plugins.core.threads) and OMP_WAIT_POLICY=PASSIVE
              (the plugin's default)

Per run: wall seconds of the whole process, seconds per round (log stamps of "Starting round
#k", first to last), the job's CPU seconds, the thread count it used and the load average when
it started. Each repeat runs before and after back to back in each case; medians are printed,
then per setting the slowdown beside k neighbours = its s/round there / its s/round alone
(target after <= 2.5 beside one neighbour on 2 cores, issue 42).

    python scripts/bench_shared_machine.py [--rounds 6] [--repeats 2] [--neighbours 1 2]
                                           [--warmup 60] [--quick]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from fs_plugins.core.threads import SPIN_COUNT_ENV, THREADS_ENV, WAIT_POLICY_ENV, usable_cores  # noqa: E402

JOB_YAML = os.path.join('yamls', 'standalone', 'tiny.yaml')
ROUND_START = re.compile(r'(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}).*?Starting round #(\d+)')
THREADS_USED = re.compile(r'torch uses (\d+) CPU thread')
LIBGOMP_DEFAULT_SPIN = '300000'
SETTINGS = {
    'before': ({SPIN_COUNT_ENV: LIBGOMP_DEFAULT_SPIN}, usable_cores()),
    'after': ({}, 0),
}


def job_env(setting: str) -> dict:
    """The job's environment: no thread or waiting choice inherited, then the setting's."""
    env = {k: v for k, v in os.environ.items()
           if k not in (THREADS_ENV, WAIT_POLICY_ENV, SPIN_COUNT_ENV)}
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO, env.get('PYTHONPATH')]))
    env.update(SETTINGS[setting][0])
    return env


def run_job(setting: str, rounds: int, steps: int, out_dir: str) -> dict:
    """One job's wall s, s/round, CPU s, threads and the load average at its start."""
    command = [sys.executable, '-m', 'fs_plugins', 'run', '--runner', 'embedded', '--cfg', JOB_YAML,
               'outdir', out_dir, 'fsplug.results_dir', out_dir, 'fsplug.overwrite', 'True',
               'federate.total_round_num', str(rounds), 'train.local_update_steps', str(steps),
               'fsplug.threads', str(SETTINGS[setting][1])]
    load = os.getloadavg()[0]
    cpu_before = _children_cpu()
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=job_env(setting), capture_output=True, text=True)
    wall = time.perf_counter() - start
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f'{" ".join(command)} failed (exit {done.returncode}):\n{output[-3000:]}')
    threads = THREADS_USED.search(output)
    return {'wall': wall, 'round': _seconds_per_round(output), 'cpu': _children_cpu() - cpu_before,
            'threads': int(threads.group(1)) if threads else 0, 'load': load}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _seconds_per_round(output: str) -> float:
    starts = {}
    for match in ROUND_START.finditer(output):
        stamp = datetime.datetime.strptime(match.group(1), '%Y-%m-%d %H:%M:%S,%f')
        starts.setdefault(int(match.group(2)), stamp)
    first, last = min(starts), max(starts)
    if last == first:
        return float('nan')
    return (starts[last] - starts[first]).total_seconds() / (last - first)


@contextlib.contextmanager
def neighbours(count: int, warmup: float):
    """`count` processes each spinning on a core, started `warmup` seconds before the body."""
    hogs = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(count)]
    try:
        time.sleep(warmup)
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def measure(args, workdir: str) -> dict:
    """{(case, setting): [run, ...]}; case 'alone' or 'beside k'."""
    runs = {}
    cases = [('alone', 0)] + [(f'beside {k}', k) for k in args.neighbours]
    for repeat in range(args.repeats):
        for case, count in cases:
            with neighbours(count, args.warmup if count else 0):
                for setting in SETTINGS:
                    out_dir = os.path.join(workdir, f'{case.replace(" ", "_")}_{setting}_{repeat}')
                    run = run_job(setting, args.rounds, args.steps, out_dir)
                    runs.setdefault((case, setting), []).append(run)
                    print(f'repeat {repeat + 1} {case:9s} {setting:6s} threads {run["threads"]}  '
                          f'load {run["load"]:.2f}  wall {run["wall"]:.1f} s  '
                          f'{run["round"]:.2f} s/round  CPU {run["cpu"]:.1f} s', flush=True)
    return runs


def report(runs: dict, args) -> None:
    median = {key: {field: statistics.median(r[field] for r in values)
                    for field in ('wall', 'round', 'cpu')} for key, values in runs.items()}
    print(f'\nMedians over {args.repeats} repeat(s), {args.rounds} rounds x {args.steps} steps, '
          f'{usable_cores()} usable core(s):')
    print('| case | setting | wall s | s/round | CPU s | slowdown (s/round vs alone) |')
    print('|---|---|---:|---:|---:|---:|')
    for (case, setting), m in median.items():
        alone = median[('alone', setting)]['round']
        print(f'| {case} | {setting} | {m["wall"]:.1f} | {m["round"]:.2f} | {m["cpu"]:.1f} | '
              f'{m["round"] / alone:.2f}x |')
    print('target: after, beside 1 neighbour on 2 cores, <= 2.5x')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--rounds', type=int, default=6)
    parser.add_argument('--steps', type=int, default=10, help='local steps per client and round')
    parser.add_argument('--repeats', type=int, default=2)
    parser.add_argument('--neighbours', type=int, nargs='+', default=[1])
    parser.add_argument('--warmup', type=float, default=60.0,
                        help='seconds the neighbours spin before each job starts')
    parser.add_argument('--quick', action='store_true',
                        help='a check that the script works: 2 rounds of 1 step, 1 repeat, '
                             '1 neighbour, 1 s warm-up')
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.repeats, args.neighbours, args.warmup = 2, 1, 1, [1], 1.0
    print(f'# {usable_cores()} usable core(s), load average {os.getloadavg()[0]:.2f}; job: '
          f'{JOB_YAML}', flush=True)
    with tempfile.TemporaryDirectory(prefix='fsplug-bench-shared-') as workdir:
        report(measure(args, workdir), args)
    return 0


if __name__ == '__main__':
    sys.exit(main())

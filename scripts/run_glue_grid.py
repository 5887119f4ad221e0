"""UniFLoW Table 4: GLUE accuracy of methods × adapters × tasks, mean ± std over seeds.

    python scripts/run_glue_grid.py run   [--tasks mnli rte sst2 qqp] [--adapters lora rslora vera]
                                          [--methods fedavg ffa feddpa fedsa fed_a2] [--seeds 1 2 3]
                                          [--yaml 'yamls/glue/{task}.yaml'] [--out exp/glue]
                                          [--runner auto|fs|embedded] [--force] [--dry-run]
                                          [-- KEY VALUE ...]
    python scripts/run_glue_grid.py table [--out exp/glue] [--metric test_acc]
    python scripts/run_glue_grid.py curves [--out exp/glue] [--metric test_acc]

`run` runs one `fs-plugins run` per cell, from one YAML per task (`{task}` in --yaml) with the
cell's settings as command-line overrides (seed, fsplug.method, the adapter's keys below, then
the KEY VALUE pairs after `--`, where `{task}` is replaced too), into
<out>/<task>/<adapter>/<method>/seed<seed>/ (its log beside it as seed<seed>.log). A cell
with a finished run (summary.md) is skipped unless --force; a failing cell is reported and the
grid goes on. `run` ends with the table; `table` prints it from what <out> holds.

A run's accuracy is its clients' last evaluation of --metric pooled over their test records
(Σ acc_k n_k / Σ n_k: the accuracy over the whole validation file); a cell is the mean ± the
sample standard deviation over seeds, in percent, and Avg. the mean over the tasks. `curves`
prints the same pooled accuracy at every evaluated round (mean over seeds), one column per
task × adapter × method, to see whether a method's curve flattens.

The classification head trains on every client and stays there (fsplug.model.head: local,
the default: UniFLoW Table 7 communicates the LoRA factors only; each client is evaluated
with its own head); `-- fsplug.model.head shared` uploads and averages it with every method.
FedA²'s λ: `-- fsplug.fed_a2.ridge_mode always fsplug.fed_a2.ridge 0.1` for Table 12's
reading (λ every round) instead of the YAMLs' Eq. 13 case split (λ = 1 only when A Aᵀ is
singular); use one --out per setting, since the cells are keyed by method.

Offline, on the tiny fixture:
    python scripts/run_glue_grid.py run --yaml yamls/glue/tiny.yaml --seeds 1 2 \\
        --out exp/glue_tiny -- data.type 'glue_tiny:{task}@fsplug'
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# adapter column of Table 4 -> its config overrides (fsplug.model.adapter must be registered)
ADAPTER_VARIANTS = {
    'lora': {'fsplug.model.adapter': 'lora', 'fsplug.model.lora.use_rslora': 'False'},
    'rslora': {'fsplug.model.adapter': 'lora', 'fsplug.model.lora.use_rslora': 'True'},
    'vera': {'fsplug.model.adapter': 'vera'},
}
ADAPTER_LABELS = {'lora': 'LoRA', 'rslora': 'rsLoRA', 'vera': 'VeRA'}
# Table 4's row names ({} = the adapter's label)
METHOD_LABELS = {'fedavg': '{}', 'ffa': 'FFA-{}', 'feddpa': 'FedDPA-{}', 'fedsa': 'FedSA-{}',
                 'fed_a2': 'FedA²-{}'}
PAPER_METHODS = tuple(METHOD_LABELS)
PAPER_TASKS = ('mnli', 'rte', 'sst2', 'qqp')
TASK_LABELS = {'mnli': 'MNLI', 'mnli_mm': 'MNLI-mm', 'rte': 'RTE', 'sst2': 'SST2', 'qqp': 'QQP'}
DONE_FILE = 'summary.md'


def cell_dir(out: str, task: str, adapter: str, method: str, seed: int) -> str:
    return os.path.join(out, task, adapter, method, f'seed{seed}')


def check_choices(args) -> None:
    """Tasks, methods and adapters against the package's registries."""
    from fs_plugins.data.glue import GLUE_TASKS
    from fs_plugins.methods.registry import all_methods
    from fs_plugins.models.builders import ADAPTERS
    unknown = ([f'task {t!r} (known: {sorted(GLUE_TASKS)})' for t in args.tasks if t not in GLUE_TASKS]
               + [f'method {m!r} (known: {sorted(all_methods())})' for m in args.methods
                  if m not in all_methods()]
               + [f'adapter {a!r} (known: {sorted(ADAPTER_VARIANTS)})' for a in args.adapters
                  if a not in ADAPTER_VARIANTS])
    unknown += [f"adapter variant {name!r} uses fsplug.model.adapter {v['fsplug.model.adapter']!r}, "
                f'not registered ({sorted(ADAPTERS)})' for name, v in ADAPTER_VARIANTS.items()
                if v['fsplug.model.adapter'] not in ADAPTERS]
    if unknown:
        raise SystemExit('run_glue_grid: unknown ' + '; '.join(unknown))


def cell_command(args, task: str, adapter: str, method: str, seed: int) -> list[str]:
    overrides = {'seed': str(seed), 'fsplug.method': method, **ADAPTER_VARIANTS[adapter],
                 'fsplug.results_dir': cell_dir(args.out, task, adapter, method, seed)}
    extra = [value.replace('{task}', task) for value in args.overrides]
    pairs = [item for key, value in overrides.items() for item in (key, value)]
    return [sys.executable, '-m', 'fs_plugins.commands.cli', 'run', '--runner', args.runner,
            '--cfg', args.yaml.format(task=task), *pairs, *extra]


def run_cell(command: list[str], directory: str) -> bool:
    """Runs one cell, its output into <directory>.log; False (and the log's tail) on failure."""
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    log = directory + '.log'
    with open(log, 'w', encoding='utf-8') as handle:
        code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT)
    if code != 0:
        with open(log, encoding='utf-8') as handle:
            tail = handle.readlines()[-8:]
        print(f'  FAILED (exit {code}), {log}:\n    ' + '    '.join(tail), file=sys.stderr)
    return code == 0


def run_grid(args) -> int:
    if len(args.overrides) % 2:
        raise SystemExit(f'run_glue_grid: overrides after -- come in KEY VALUE pairs: {args.overrides}')
    check_choices(args)
    failed = []
    for task in args.tasks:
        for adapter in args.adapters:
            for method in args.methods:
                for seed in args.seeds:
                    directory = cell_dir(args.out, task, adapter, method, seed)
                    command = cell_command(args, task, adapter, method, seed)
                    if args.dry_run:
                        print(' '.join(command))
                        continue
                    if not args.force and os.path.isfile(os.path.join(directory, DONE_FILE)):
                        print(f'{directory}: done, skipped')
                        continue
                    print(f'{directory} ...', flush=True)
                    if not run_cell(command, directory):
                        failed.append(directory)
    if not args.dry_run:
        print_table(args.out, args.metric)
    if failed:
        print(f'{len(failed)} cell(s) failed: ' + ', '.join(failed), file=sys.stderr)
    return 1 if failed else 0


# ---------------------------------------------------------------------- table
def run_accuracy(run_dir: str, metric: str) -> float | None:
    """Last evaluation of `metric` per client, pooled over their test records (None if the
    run logged none)."""
    path = os.path.join(run_dir, 'results.jsonl')
    if not os.path.isfile(path):
        return None
    last = {}
    with open(path, encoding='utf-8') as handle:
        for line in handle:
            row = json.loads(line)
            if row['kind'] == 'eval' and metric in row:   # in time order: the last one wins
                last[row['client']] = (row[metric], row.get(metric.split('_', 1)[0] + '_total', 1))
    total = sum(n for _, n in last.values())
    return sum(v * n for v, n in last.values()) / total if total else None


def run_curve(run_dir: str, metric: str) -> dict[int, float]:
    """{round: `metric` pooled over the clients evaluated at that round} of one run."""
    path = os.path.join(run_dir, 'results.jsonl')
    rounds: dict[int, list[tuple[float, float]]] = {}
    if os.path.isfile(path):
        with open(path, encoding='utf-8') as handle:
            for line in handle:
                row = json.loads(line)
                if row['kind'] == 'eval' and metric in row:
                    total = row.get(metric.split('_', 1)[0] + '_total', 1)
                    rounds.setdefault(int(row['round']), []).append((row[metric], total))
    return {r: sum(v * n for v, n in vals) / sum(n for _, n in vals)
            for r, vals in sorted(rounds.items()) if sum(n for _, n in vals)}


def curves(out: str, metric: str) -> str:
    """Per-round pooled `metric` (%), mean over seeds, one column per task × adapter × method."""
    columns: dict[str, dict[int, list[float]]] = {}
    for task in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        for adapter in _subdirs(os.path.join(out, task)):
            for method in _subdirs(os.path.join(out, task, adapter)):
                name = f'{task}/{adapter}/{method}'
                for seed in _subdirs(os.path.join(out, task, adapter, method)):
                    curve = run_curve(os.path.join(out, task, adapter, method, seed), metric)
                    for r, value in curve.items():
                        columns.setdefault(name, {}).setdefault(r, []).append(value)
    if not columns:
        return f'{out}: no finished runs with {metric}'
    names = sorted(columns)
    rounds = sorted({r for c in columns.values() for r in c})
    lines = [f'{metric} per round (%, pooled over clients; mean over seeds, n in brackets)', '',
             '| round | ' + ' | '.join(names) + ' |', '|---|' + '---|' * len(names)]
    for r in rounds:
        cells = [columns[n].get(r) for n in names]
        lines.append(f'| {r + 1} | ' + ' | '.join(
            f'{100 * statistics.mean(v):.2f} (n={len(v)})' if v else '–' for v in cells) + ' |')
    return '\n'.join(lines)


def collect(out: str, metric: str) -> dict[tuple[str, str, str], list[float]]:
    """{(task, adapter, method): accuracy of each seed's run} under `out`."""
    cells: dict[tuple[str, str, str], list[float]] = {}
    for task in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        for adapter in _subdirs(os.path.join(out, task)):
            for method in _subdirs(os.path.join(out, task, adapter)):
                for seed in _subdirs(os.path.join(out, task, adapter, method)):
                    value = run_accuracy(os.path.join(out, task, adapter, method, seed), metric)
                    if value is not None:
                        cells.setdefault((task, adapter, method), []).append(value)
    return cells


def _subdirs(path: str) -> list[str]:
    return sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d))) \
        if os.path.isdir(path) else []


def _ordered(found, preferred) -> list[str]:
    return [x for x in preferred if x in found] + sorted(set(found) - set(preferred))


def format_cell(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f'{100 * statistics.mean(values):.2f} ± {100 * std:.2f} (n={len(values)})'


def table(cells: dict, metric: str) -> str:
    """Table 4's layout: one row per adapter × method, one column per task, then Avg."""
    tasks = _ordered({k[0] for k in cells}, PAPER_TASKS)
    adapters = _ordered({k[1] for k in cells}, tuple(ADAPTER_VARIANTS))
    methods = _ordered({k[2] for k in cells}, PAPER_METHODS)
    lines = [f'{metric} (%, last evaluation pooled over clients; mean ± std over seeds)', '',
             '| adapter | method | ' + ' | '.join(TASK_LABELS.get(t, t) for t in tasks) + ' | Avg. |',
             '|---|---|' + '---|' * (len(tasks) + 1)]
    for adapter in adapters:
        label = ADAPTER_LABELS.get(adapter, adapter)
        for method in methods:
            row = [cells.get((t, adapter, method)) for t in tasks]
            if not any(row):
                continue
            means = [statistics.mean(v) for v in row if v]
            avg = f'{100 * statistics.mean(means):.2f}' if all(row) else '–'
            name = METHOD_LABELS.get(method, method + '-{}').format(label)
            lines.append(f'| {label} | {name} | ' + ' | '.join(format_cell(v) if v else '–' for v in row)
                         + f' | {avg} |')
    return '\n'.join(lines)


def print_table(out: str, metric: str) -> None:
    cells = collect(out, metric)
    print(table(cells, metric) if cells else f'{out}: no finished runs with {metric}')


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index('--') + 1:] if '--' in argv else []
    argv = argv[:argv.index('--')] if '--' in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = parser.add_subparsers(dest='command', required=True)
    run = sub.add_parser('run', help='run the grid (then print the table)')
    run.add_argument('--tasks', nargs='+', default=list(PAPER_TASKS))
    run.add_argument('--adapters', nargs='+', default=list(ADAPTER_VARIANTS))
    run.add_argument('--methods', nargs='+', default=list(PAPER_METHODS))
    run.add_argument('--seeds', nargs='+', type=int, default=[1, 2, 3])
    run.add_argument('--yaml', default='yamls/glue/{task}.yaml', help='YAML per task ({task})')
    run.add_argument('--runner', choices=['auto', 'fs', 'embedded'], default='auto')
    run.add_argument('--force', action='store_true', help='rerun finished cells')
    run.add_argument('--dry-run', action='store_true', help='print the commands only')
    show = sub.add_parser('table', help='print the table of the finished runs')
    per_round = sub.add_parser('curves', help='print the per-round curves of the finished runs')
    for parser_ in (run, show, per_round):
        parser_.add_argument('--out', default='exp/glue', help='root of the results directories')
        parser_.add_argument('--metric', default='test_acc')
    args = parser.parse_args(argv)
    if args.command == 'table':
        print_table(args.out, args.metric)
        return 0
    if args.command == 'curves':
        print(curves(args.out, args.metric))
        return 0
    args.overrides = overrides
    return run_grid(args)


if __name__ == '__main__':
    sys.exit(main())

"""Per-client comparison table of several runs, like the papers' tables.

    python scripts/compare.py RUN_DIR [RUN_DIR ...] [--metric test_token_acc] [--baseline standalone]
                              [--auc] [--csv out.csv] [--plot out.png]

Each RUN_DIR is a results directory (results.jsonl + run_info.json). Rows: runs labelled by
their directory name; columns: each client's last evaluation of --metric, the average over
clients, and Δ of the average vs the --baseline row. Directories with the same name (e.g.
seed1/fedavg, seed2/fedavg) form one row: cells are means over them, and a column gives the
standard deviation of the average across those runs. --plot draws --metric per round, one
panel per client and one line per row (the mean over its runs).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys


def last_eval(run_dir: str, metric: str) -> dict[int, float]:
    values = {}
    with open(os.path.join(run_dir, 'results.jsonl')) as handle:
        for line in handle:
            row = json.loads(line)
            if row['kind'] == 'eval' and metric in row:
                values[row['client']] = row[metric]     # rows are in time order: last wins
    if not values:
        raise SystemExit(f'{run_dir}: no eval rows with {metric}')
    return values


def eval_curve(run_dir: str, metric: str) -> dict[int, dict[int, float]]:
    """client -> {round: value} over every evaluation of `metric`."""
    curves: dict[int, dict[int, float]] = {}
    with open(os.path.join(run_dir, 'results.jsonl')) as handle:
        for line in handle:
            row = json.loads(line)
            if row['kind'] == 'eval' and metric in row:
                curves.setdefault(row['client'], {})[row['round']] = row[metric]
    return curves


def plot(runs: list[dict], metric: str, path: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    clients = sorted({c for run in runs for c in run['values']})
    names = runs[0]['names']
    fig, axes = plt.subplots(1, len(clients), figsize=(4 * len(clients), 3.2), squeeze=False)
    for label, members in group(runs).items():
        curves = [eval_curve(r['dir'], metric) for r in members]
        for ax, client in zip(axes[0], clients):
            rounds = sorted({k for c in curves for k in c.get(client, {})})
            values = [_mean(c[client][k] for c in curves if k in c.get(client, {})) for k in rounds]
            ax.plot([k + 1 for k in rounds], values, marker='o', markersize=3, label=label)
    for ax, client in zip(axes[0], clients):
        ax.set_title(f"client {client} ({names.get(str(client), '')})")
        ax.set_xlabel('round')
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(metric)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f'plot: {path}')


def per_round(runs: list[dict], metric: str) -> tuple[list[str], list[list[str]]]:
    """Rows: rounds; columns: each row label's average over clients (mean over its runs), to
    see whether the curves have flattened."""
    groups = group(runs)
    averages = {}
    for label, members in groups.items():
        by_round: dict[int, list[float]] = {}
        for run in members:
            for k, value in _client_average_by_round(eval_curve(run['dir'], metric)).items():
                by_round.setdefault(k, []).append(value)
        averages[label] = {k: _mean(v) for k, v in by_round.items()}
    rounds = sorted({k for a in averages.values() for k in a})
    header = ['round'] + list(groups)
    rows = [[str(k + 1)] + [f"{averages[label].get(k, float('nan')):.4f}" for label in groups]
            for k in rounds]
    return header, rows


def _client_average_by_round(curves: dict[int, dict[int, float]]) -> dict[int, float]:
    rounds = sorted({k for c in curves.values() for k in c})
    return {k: _mean(c[k] for c in curves.values() if k in c) for k in rounds}


def _print_table(header, rows) -> None:
    print('| ' + ' | '.join(header) + ' |')
    print('|' + '---|' * len(header))
    for row in rows:
        print('| ' + ' | '.join(row) + ' |')


def load(run_dir: str, metric: str, auc: bool = False) -> dict:
    """A run's per-client values: the last evaluation of `metric` (A_last), or with auc the
    mean over all its evaluations (A_AUC, fs_plugins.data.stream.last_and_auc)."""
    with open(os.path.join(run_dir, 'run_info.json')) as handle:
        info = json.load(handle)
    if auc:
        values = {c: _mean(curve.values()) for c, curve in eval_curve(run_dir, metric).items()}
    else:
        values = last_eval(run_dir, metric)
    return {'dir': run_dir, 'method': info['method'], 'names': info.get('client_names', {}),
            'values': values, 'avg': sum(values.values()) / len(values)}


def group(runs: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(os.path.basename(run['dir'].rstrip('/')), []).append(run)
    return groups


def _mean(values):
    values = list(values)
    return sum(values) / len(values) if values else float('nan')


def table(runs: list[dict], metric: str, baseline: str) -> tuple[list[str], list[list[str]]]:
    clients = sorted({c for run in runs for c in run['values']})
    names = runs[0]['names']
    groups = group(runs)
    header = (['method'] + [f"{c} ({names[str(c)]})" if names.get(str(c)) else str(c)
                            for c in clients] + ['average', f'Δ vs {baseline}'])
    if any(len(g) > 1 for g in groups.values()):
        header += ['std of average', 'runs']
    base = groups.get(baseline)
    base_avg = _mean(r['avg'] for r in base) if base else None
    rows = []
    for label, members in groups.items():
        avg = _mean(r['avg'] for r in members)
        row = ([label] + [f"{_mean(r['values'][c] for r in members if c in r['values']):.4f}"
                          for c in clients]
               + [f'{avg:.4f}', f'{avg - base_avg:+.4f}' if base else 'n/a'])
        if len(header) > len(clients) + 3:
            spread = statistics.stdev([r['avg'] for r in members]) if len(members) > 1 else 0.0
            row += [f'{spread:.4f}', str(len(members))]
        rows.append(row)
    return header, rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('runs', nargs='+')
    parser.add_argument('--metric', default='test_token_acc')
    parser.add_argument('--baseline', default='standalone')
    parser.add_argument('--auc', action='store_true',
                        help='the mean of --metric over all evaluations (A_AUC) instead of the last')
    parser.add_argument('--csv', default=None)
    parser.add_argument('--plot', default=None, help='PNG of --metric per round and client')
    parser.add_argument('--per-round', action='store_true',
                        help='also print the average over clients at every evaluated round')
    args = parser.parse_args(argv)
    runs = [load(d, args.metric, args.auc) for d in args.runs]
    header, rows = table(runs, args.metric, args.baseline)
    print(f"{args.metric} ({'A_AUC: mean over evaluations' if args.auc else 'A_last: last evaluation'}"
          f' per client)\n')
    _print_table(header, rows)
    if args.per_round:
        print(f'\n{args.metric} per round (average over clients, mean over runs)\n')
        _print_table(*per_round(runs, args.metric))
    if args.csv:
        with open(args.csv, 'w', newline='') as handle:
            csv.writer(handle).writerows([header] + rows)
    if args.plot:
        plot(runs, args.metric, args.plot)


if __name__ == '__main__':
    sys.exit(main())

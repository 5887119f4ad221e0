"""`fs-plugins reproduce <paper> <table>`: a results table of docs/paper_tables.yaml as a command.

Each row's run is `fs-plugins run --cfg <yaml> fsplug.method <method> [the row's keys] seed k
fsplug.results_dir OUT/<paper>/<table>/<position>_<row>/seed<k>`; a row whose folder already
holds a finished run (run_info.json: completed) is not run again. Then the table is printed with the paper's
rows and columns: per column the paper's number, ours (mean ± std over seeds) and the difference.

`--scale paper` runs each row's own YAML (the paper's data, model and budget). `--scale tiny`
(the default without CUDA) runs a stand-in instead: the table's `tiny_yaml` (a row's own
`tiny_yaml` first, else yamls/<method>/tiny.yaml), with the row's method and its keys except
those that set the paper's data, model and budget (TINY_DROPPED_KEYS). docs/reproduce.md
describes the data format and the rules.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAPER_TABLES = os.path.join(REPO, 'docs', 'paper_tables.yaml')
# row options that are not config keys: the YAML, FS's per-client file, the setting in words
FILE_OPTIONS = ('yaml', 'client_cfg', 'setting')
# keys that set the paper's data, model and budget: a tiny stand-in keeps its own
TINY_DROPPED_KEYS = frozenset({
    'model.type', 'federate.client_num', 'federate.sample_client_num',
    'federate.sample_client_rate', 'federate.total_round_num', 'train.local_update_steps',
    'data.splitter', 'fsplug.data.select', 'fsplug.model.adapter', 'fsplug.eval.gen_metrics',
    'fsplug.smartfed.budget'})   # SmartFed's quota counts the paper's library ranks (r 32)
PLACEHOLDER = '/path/to/'   # a file or model the GPU user supplies: not there at tiny scale
AVERAGE = 'average'


class ReproduceError(ValueError):
    """An unknown paper, table or row, said in one line."""


# ------------------------------------------------------------------ the tables
def load_tables(path: str = PAPER_TABLES) -> list[dict]:
    # libyaml's loader when built in: the pure-Python one takes seconds on this file
    loader = getattr(yaml, 'CSafeLoader', yaml.SafeLoader)
    with open(path, encoding='utf-8') as handle:
        return yaml.load(handle, Loader=loader)


def find_table(tables: list[dict], paper: str, table: str) -> dict:
    """`table` as printed ('Table 1') or its number ('1')."""
    wanted = table if table.lower().startswith('table') else f'Table {table}'
    for entry in tables:
        if entry['paper'] == paper and entry['table'].lower() == wanted.lower():
            return entry
    known = sorted({t['paper'] for t in tables})
    if paper not in known:
        raise ReproduceError(f"unknown paper '{paper}' (docs/paper_tables.yaml has {known})")
    names = [t['table'] for t in tables if t['paper'] == paper]
    raise ReproduceError(f"{paper} has no '{wanted}' in docs/paper_tables.yaml (it has {names})")


def numbers_problems(table: dict) -> list[str]:
    """What keeps `table` from being complete: its columns, and every row's number for each
    column (or the row's `numbers_reason`). A table not yet transcribed says so in
    `numbers_pending` instead of `columns`."""
    where = f"{table['paper']} {table['table']}"
    if 'columns' not in table:
        return [] if str(table.get('numbers_pending', '')).strip() else \
            [f'{where}: no columns and no numbers_pending reason']
    names = [column.get('name') for column in table['columns']]
    problems = [f'{where}: column {i} has no name' for i, name in enumerate(names) if not name]
    problems += [f"{where}: column '{c['name']}' has neither a metric nor the table a column_note"
                 for c in table['columns'] if 'metric' not in c and not table.get('column_note')]
    for row in table['rows']:
        numbers = row.get('paper_numbers')
        if numbers is None:
            if not str(row.get('numbers_reason', '')).strip():
                problems.append(f"{where}, row '{row['row']}': no paper_numbers and no numbers_reason")
            continue
        missing = [n for n in names if n not in numbers]
        extra = [n for n in numbers if n not in names]
        bad = [n for n, v in numbers.items() if not isinstance(v, (int, float, str))]
        for label, which in (('missing', missing), ('not a column', extra), ('not a value', bad)):
            if which:
                problems.append(f"{where}, row '{row['row']}': {label}: {which}")
    return problems


def select_rows(table: dict, wanted: list[str] | None) -> list[dict]:
    """The rows named in `wanted` (a name picks every row of that name: panels repeat them) or
    given by their 1-based position; all rows without `wanted`."""
    if not wanted:
        return table['rows']
    picked = []
    for item in wanted:
        if item.isdigit() and 1 <= int(item) <= len(table['rows']):
            matches = [table['rows'][int(item) - 1]]
        else:
            matches = [row for row in table['rows'] if row['row'] == item]
        if not matches:
            raise ReproduceError(f"{table['paper']} {table['table']} has no row '{item}' (rows: "
                                 f"{[row['row'] for row in table['rows']]}, or 1..{len(table['rows'])})")
        picked += [row for row in matches if all(row is not p for p in picked)]
    return picked


# ------------------------------------------------------------------ the runs
def slug(text: str) -> str:
    return re.sub(r'[^A-Za-z0-9.+-]+', '_', text).strip('_')


def row_dir(out: str, table: dict, row: dict, seed: int) -> str:
    """OUT/<paper>/<table>/<position>_<row>/seed<k>: the position keeps apart the rows that
    panels repeat (FLAME's 'trivial' of the dense and the MoE model)."""
    position = next(i for i, r in enumerate(table['rows'], 1) if r is row)
    return os.path.join(out, table['paper'], slug(table['table']), f"{position:02d}_{slug(row['row'])}",
                        f'seed{seed}')


class RowRun:
    """What runs a row at a scale: the YAML, FS's per-client file and the key value overrides,
    or `why_not` (not empty) when nothing runs it at that scale."""

    def __init__(self, table: dict, row: dict, scale: str):
        self.yaml, self.client_cfg, self.opts, self.why_not = None, None, [], ''
        method = row.get('method')
        if method is None:
            self.why_not = f"not implemented: {row.get('reason') or 'no method'}"
            return
        options = dict(row.get('options') or {})
        keys = {k: v for k, v in options.items() if k not in FILE_OPTIONS}
        if scale == 'tiny':
            self.yaml = row.get('tiny_yaml') or table.get('tiny_yaml') or f'yamls/{method}/tiny.yaml'
            self.client_cfg = row.get('tiny_client_cfg') or table.get('tiny_client_cfg')
            keys = {k: v for k, v in keys.items() if k not in TINY_DROPPED_KEYS
                    and not str(v).startswith(PLACEHOLDER)}
        else:
            self.yaml, self.client_cfg = options.get('yaml'), options.get('client_cfg')
            if not self.yaml:
                self.why_not = f"no YAML sets the paper's setting ({options.get('setting', '')})"
            elif '{' in self.yaml:
                self.why_not = f'one YAML per dataset ({self.yaml}): run each with fs-plugins run'
        self.opts = ['fsplug.method', method]
        for key, value in keys.items():
            self.opts += [key, json.dumps(value) if isinstance(value, (list, dict)) else str(value)]


def run_command(yaml_path: str, client_cfg: str | None, opts: list[str], seed: int,
                results_dir: str, overwrite: bool) -> list[str]:
    return (['fs-plugins', 'run', '--cfg', yaml_path]
            + (['--client_cfg', client_cfg] if client_cfg else [])
            + (['--overwrite'] if overwrite else [])
            + opts + ['seed', str(seed), 'fsplug.results_dir', results_dir])


def finished(results_dir: str) -> bool:
    """Whether the run in `results_dir` went to its end (a run stopped by an error also
    writes its summary, but records completed: false in run_info.json)."""
    try:
        with open(os.path.join(results_dir, 'run_info.json'), encoding='utf-8') as handle:
            return json.load(handle).get('completed') is True
    except (OSError, ValueError):
        return False


def run_row(command: list[str], log_path: str) -> int:
    """`command` (fs-plugins run ...) through this Python, its output to `log_path`."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, 'w', encoding='utf-8') as log:
        return subprocess.call([sys.executable, '-m', 'fs_plugins'] + command[1:], cwd=REPO,
                               stdout=log, stderr=subprocess.STDOUT)


# ------------------------------------------------------------------ our numbers
def evaluations(results_dir: str) -> tuple[dict[int, list[dict]], dict[str, str]]:
    """Each client's evaluation rows of results.jsonl in time order, and the client names."""
    rows: dict[int, list[dict]] = {}
    with open(os.path.join(results_dir, 'results.jsonl'), encoding='utf-8') as handle:
        for line in handle:
            row = json.loads(line)
            if row.get('kind') == 'eval':
                rows.setdefault(row['client'], []).append(row)
    with open(os.path.join(results_dir, 'run_info.json'), encoding='utf-8') as handle:
        names = json.load(handle).get('client_names') or {}
    return rows, {str(k): v for k, v in names.items()}


def client_value(rows: list[dict], metric: str) -> float | None:
    """A client's last evaluation of `metric`; `<metric>_auc`: the mean over all its evaluations
    (A_AUC beside A_last, as the run's summary computes it)."""
    base = metric[:-len('_auc')] if metric.endswith('_auc') else None
    if base is not None:
        values = [row[base] for row in rows if base in row]
        return sum(values) / len(values) if values else None
    values = [row[metric] for row in rows if metric in row]
    return values[-1] if values else None


def column_clients(column: dict, clients: list[int], names: dict[str, str], levels: int) -> list[int]:
    """The clients a column reads: all ('average'), the one with that id (a number), those at
    budget level k ('βk': FLAME's round-robin assignment, client id - 1 modulo the number of
    levels), or the one so named."""
    client = column.get('client', AVERAGE)
    if isinstance(client, int):
        return [client] if client in clients else []
    client = str(client)
    if client == AVERAGE:
        return clients
    if client.startswith('β') and client[1:].isdigit():
        return [cid for cid in clients if (cid - 1) % levels == int(client[1:]) - 1]
    return [cid for cid in clients if names.get(str(cid)) == client]


def compared_metric(table: dict, row: dict, column: dict, scale: str) -> str | None:
    """The metric a column is compared on at `scale`, or None: a column of another panel
    (dataset) than the run's, or one that no run metric matches."""
    panel = column.get('panel')
    run_panel = table.get('tiny_panel') if scale == 'tiny' else row.get('panel', table.get('panel'))
    if panel is not None and panel != run_panel:
        return None
    return column.get('tiny_metric', column.get('metric')) if scale == 'tiny' else column.get('metric')


def column_value(results_dir: str, column: dict, metric: str | None, levels: int = 4) -> float | None:
    """Our number for a paper's column in one finished run: the mean of `metric` over the
    column's clients, ×100 where the paper prints percent; None when the run lacks it."""
    if not metric or not finished(results_dir):
        return None
    rows, names = evaluations(results_dir)
    values = [v for cid in column_clients(column, sorted(rows), names, levels)
              if (v := client_value(rows[cid], metric)) is not None and not math.isnan(v)]
    if not values:
        return None
    value = sum(values) / len(values)
    return value * 100 if column.get('percent', False) else value


# ------------------------------------------------------------------ the printed table
def cell(values: list[float]) -> str:
    if not values:
        return 'n/a'
    if len(values) == 1:
        return f'{values[0]:.2f}'
    return f'{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}'


def paper_cell(value, std=None) -> str:
    if value is None:
        return ''
    text = f'{value:g}' if isinstance(value, (int, float)) else str(value)
    return f'{text} ± {std:g}' if std is not None else text


def difference(ours: list[float], paper) -> str:
    if not ours or not isinstance(paper, (int, float)) or isinstance(paper, bool):
        return 'n/a'
    return f'{statistics.mean(ours) - paper:+.2f}'


def format_table(table: dict, rows: list[dict], out: str, seeds: list[int], scale: str,
                 statuses: dict[int, str]) -> str:
    """Markdown: per row and paper column, the paper's number, ours and ours - paper."""
    columns = table.get('columns') or []
    levels = table.get('budget_levels', 4)
    header = ['row'] + [f"{c['name']} {part}" for c in columns for part in ('paper', 'ours', 'Δ')]
    lines = ['| ' + ' | '.join(header + ['status']) + ' |', '|' + '---|' * (len(header) + 1)]
    for row in rows:
        numbers, spread = row.get('paper_numbers') or {}, row.get('paper_std') or {}
        cells = [row['row']]
        for column in columns:
            metric = compared_metric(table, row, column, scale)
            ours = [v for seed in seeds if (v := column_value(
                row_dir(out, table, row, seed), column, metric, levels)) is not None]
            paper = numbers.get(column['name'])
            cells += [paper_cell(paper, spread.get(column['name'])), cell(ours),
                      difference(ours, paper)]
        lines.append('| ' + ' | '.join(cells + [statuses.get(id(row), '')]) + ' |')
    return '\n'.join(lines)


def header_lines(table: dict, scale: str, seeds: list[int]) -> list[str]:
    where = ('tiny stand-in, not the paper\'s setting: each row runs its tiny YAML '
             '(see docs/reproduce.md), so the paper\'s numbers are for orientation only'
             if scale == 'tiny' else "the paper's setting (each row's own YAML)")
    lines = [f"{table['paper']} {table['table']}: {table['caption']}",
             f"Scale: {where}. Seeds: {', '.join(map(str, seeds))}."]
    if table.get('column_note'):
        lines.append(f"Columns: {table['column_note']}")
    if 'columns' not in table:
        lines.append(f"The paper's numbers are not recorded for this table: "
                     f"{table.get('numbers_pending', '')}")
    mapped = [c['name'] for c in table.get('columns', []) if compared_metric(table, {}, c, scale)]
    if table.get('columns'):
        lines.append('Ours: the mean over clients (or the named client) of the last evaluation, '
                     f"mean ± std over seeds. Compared columns: {', '.join(mapped) or 'none'}")
    return lines


# ------------------------------------------------------------------ the command
def default_scale() -> str:
    import torch  # lazy: only to see whether CUDA is there
    return 'paper' if torch.cuda.is_available() else 'tiny'


def reproduce(args) -> int:
    table = find_table(load_tables(), args.paper, args.table)
    rows = select_rows(table, args.rows)
    scale = args.scale or default_scale()
    out = os.path.abspath(args.out)
    overrides = [part for pair in args.overrides for part in pair]
    print('\n'.join(header_lines(table, scale, args.seeds)) + '\n', flush=True)
    same_runs: dict = {}
    statuses = {id(row): run_row_seeds(table, row, scale, out, args.seeds, overrides, args.dry_run,
                                       same_runs)
                for row in rows}
    if not args.dry_run:
        print('\n' + format_table(table, rows, out, args.seeds, scale, statuses))
    return 1 if any(status.startswith('failed') for status in statuses.values()) else 0


def run_row_seeds(table: dict, row: dict, scale: str, out: str, seeds: list[int],
                  overrides: list[str], dry_run: bool, same_runs: dict) -> str:
    """Runs (or with dry_run prints) a row's command per seed, skipping finished runs; returns
    the row's status for the table. A row whose command an earlier row of this call already
    ran (panels that differ only in a setting the tiny stand-in drops, e.g. the LLM) links to
    that run's folder instead of running it again (`same_runs`: {command: folder})."""
    plan = RowRun(table, row, scale)
    if plan.why_not:
        print(f"# {row['row']}: {plan.why_not}")
        return plan.why_not
    outcome = []
    for seed in seeds:
        results_dir = row_dir(out, table, row, seed)
        same = (plan.yaml, plan.client_cfg, tuple(plan.opts + overrides), seed)
        if same in same_runs and same_runs[same] != results_dir:
            print(f"# {row['row']} seed {seed}: the same run as {same_runs[same]}")
            if not dry_run:
                link_run(same_runs[same], results_dir)
            outcome.append('same run as an earlier row')
            continue
        same_runs[same] = results_dir
        if finished(results_dir):
            print(f"# {row['row']} seed {seed}: finished earlier ({results_dir}), not run again")
            outcome.append('done earlier')
            continue
        # an unfinished run's folder is started again from scratch
        started = os.path.isfile(os.path.join(results_dir, 'results.jsonl'))
        command = run_command(plan.yaml, plan.client_cfg, plan.opts + overrides, seed,
                              results_dir, overwrite=started)
        if dry_run:
            print(' '.join(_quoted(command)))
            outcome.append('dry run')
            continue
        print(f"# {row['row']} seed {seed}: {' '.join(_quoted(command))}", flush=True)
        code = run_row(command, results_dir + '.log')
        outcome.append('ran' if code == 0 else f'failed (exit {code}, see {results_dir}.log)')
    return ', '.join(dict.fromkeys(outcome))


def link_run(first: str, results_dir: str) -> None:
    """`results_dir` becomes a link to the earlier row's folder `first` (replacing an
    unfinished run's folder)."""
    if os.path.islink(results_dir) or os.path.isfile(results_dir):
        os.remove(results_dir)
    elif os.path.isdir(results_dir):
        shutil.rmtree(results_dir)
    os.makedirs(os.path.dirname(results_dir), exist_ok=True)
    os.symlink(first, results_dir)


def _quoted(command: list[str]) -> list[str]:
    return [f"'{part}'" if re.search(r'[^\w@%+=:,./-]', part) else part for part in command]


def add_parser(sub) -> None:
    parser = sub.add_parser('reproduce', help="run a paper's results table (docs/paper_tables.yaml) "
                                              "and print it beside the paper's numbers")
    parser.add_argument('paper', help='fedmole, fedmosaic, uniflow, flame or smartfed')
    parser.add_argument('table', help="'Table 1' or 1")
    parser.add_argument('--rows', nargs='+', default=None, help="only these rows (names as printed)")
    parser.add_argument('--seeds', nargs='+', type=int, default=[1], help='default: 1')
    parser.add_argument('--dry-run', action='store_true', help='print the commands, run nothing')
    parser.add_argument('--out', default='exp/reproduce',
                        help='runs go to OUT/<paper>/<table>/<row>/seed<k> (default exp/reproduce)')
    parser.add_argument('--scale', choices=['tiny', 'paper'], default=None,
                        help="tiny: each row's tiny stand-in; paper: the row's own YAML "
                             '(default: paper with CUDA, else tiny)')
    parser.add_argument('--set', dest='overrides', nargs=2, action='append', default=[],
                        metavar=('KEY', 'VALUE'),
                        help='a key value override for every row, after the row\'s own keys '
                             '(repeatable; e.g. --set federate.total_round_num 1)')


def main(args) -> int:
    try:
        return reproduce(args)
    except ReproduceError as exc:
        print(f'fs-plugins reproduce: {exc}', file=sys.stderr)
        return 2

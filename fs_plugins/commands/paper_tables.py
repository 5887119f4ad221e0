"""docs/paper_tables.yaml read as data: the tables, their panels and seeds, our numbers for a
paper's column from finished runs, difference rows and derived columns, and the printed table
(markdown and CSV). `fs_plugins.commands.reproduce` runs the rows; this module only reads.

Where a row's runs are: OUT/<paper>/<Table_N>/<tag>/<position>_<row>[/<panel>]/seed<k>, the
tag naming the scale (`tiny`, `paper`, `paper-smoke`, `paper-smoke-tiny`) so that runs of
different scales never stand in for each other.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAPER_TABLES = os.path.join(REPO, 'docs', 'paper_tables.yaml')
AVERAGE = 'average'
PAPER_SEEDS = 3   # where a paper prints mean ± std, it averaged three seeds (all five papers that do)


class ReproduceError(ValueError):
    """An unknown paper, table or row, or a table entry that cannot be read, said in one line."""


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


def default_seeds(table: dict) -> list[int]:
    """The paper's seeds: the table's `seeds` (a count) where given, else three where the paper
    prints a std beside its numbers, else one."""
    count = table.get('seeds') or (PAPER_SEEDS if any(row.get('paper_std') for row in table['rows'])
                                   else 1)
    return list(range(1, int(count) + 1))


def panels(table: dict) -> list[dict]:
    """The table's panels ({name, vars, keys}): one run per row and panel, each filling the
    columns of its panel. A table without panels: one unnamed panel."""
    return table.get('panels') or [{'name': None}]


def row_panels(table: dict, row: dict) -> list[dict]:
    """The panels a row runs: all of the table's, or those its `panels` names."""
    wanted = row.get('panels')
    return [p for p in panels(table) if wanted is None or p['name'] in wanted]


def difference_rows(table: dict, row: dict) -> tuple[dict, dict] | None:
    """A difference row's (minuend, subtrahend): the nearest rows above it of the names its
    `difference` gives (Table 9's scenarios repeat SFT and FedMosaic); None for another row."""
    names = row.get('difference')
    if not names:
        return None
    position = next(i for i, r in enumerate(table['rows']) if r is row)

    def nearest(name: str) -> dict:
        above = [r for r in table['rows'][:position] if r['row'] == name]
        if not above:
            raise ReproduceError(f"{table['paper']} {table['table']}, row '{row['row']}': no row "
                                 f"'{name}' above it to take the difference of")
        return above[-1]
    return nearest(names[0]), nearest(names[1])


def numbers_problems(table: dict) -> list[str]:
    """What keeps `table` from being complete: its columns, and every row's number for each
    column (or the row's `numbers_reason`), its panels, difference rows and derived columns.
    A table not yet transcribed says so in `numbers_pending` instead of `columns`."""
    where = f"{table['paper']} {table['table']}"
    if 'columns' not in table:
        return [] if str(table.get('numbers_pending', '')).strip() else \
            [f'{where}: no columns and no numbers_pending reason']
    names = [column.get('name') for column in table['columns']]
    problems = [f'{where}: column {i} has no name' for i, name in enumerate(names) if not name]
    problems += [f"{where}: column '{c['name']}' has neither a metric nor the table a column_note"
                 for c in table['columns'] if 'metric' not in c and 'mean_of' not in c
                 and not table.get('column_note')]
    problems += structure_problems(table, names)
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


def structure_problems(table: dict, names: list[str]) -> list[str]:
    """Panels every panelled column names, rows that name known panels, derived columns of
    known columns, difference rows of rows above them."""
    where = f"{table['paper']} {table['table']}"
    known = [p['name'] for p in table.get('panels') or []]
    problems = [f"{where}: column '{c['name']}' is of panel '{c['panel']}', not one of the "
                f"table's panels {known}" for c in table['columns']
                if c.get('panel') is not None and c['panel'] not in known]
    problems += [f"{where}: column '{c['name']}' is the mean of unknown columns "
                 f"{[n for n in c['mean_of'] if n not in names]}"
                 for c in table['columns'] if any(n not in names for n in c.get('mean_of') or [])]
    for row in table['rows']:
        unknown = [p for p in row.get('panels') or [] if p not in known]
        if unknown:
            problems.append(f"{where}, row '{row['row']}': unknown panels {unknown}")
        try:
            difference_rows(table, row)
        except ReproduceError as exc:
            problems.append(str(exc))
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


# ------------------------------------------------------------------ where the runs are
def slug(text: str) -> str:
    return re.sub(r'[^A-Za-z0-9.+-]+', '_', text).strip('_')


def table_dir(out: str, table: dict, tag: str) -> str:
    return os.path.join(out, table['paper'], slug(table['table']), tag)


def row_dir(out: str, table: dict, row: dict, seed: int, tag: str = 'tiny',
            panel: str | None = None) -> str:
    """OUT/<paper>/<Table_N>/<tag>/<position>_<row>[/<panel>]/seed<k>: the position keeps
    apart the rows that panels repeat (FLAME's 'trivial' of the dense and the MoE model)."""
    position = next(i for i, r in enumerate(table['rows'], 1) if r is row)
    parts = [table_dir(out, table, tag), f"{position:02d}_{slug(row['row'])}"]
    return os.path.join(*parts, *([slug(panel)] if panel else []), f'seed{seed}')


def finished(results_dir: str) -> bool:
    """Whether the run in `results_dir` went to its end (a run stopped by an error also
    writes its summary, but records completed: false in run_info.json)."""
    info = run_info(results_dir)
    return bool(info) and info.get('completed') is True


def run_info(results_dir: str) -> dict:
    try:
        with open(os.path.join(results_dir, 'run_info.json'), encoding='utf-8') as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------ our numbers
def evaluations(results_dir: str, kind: str = 'eval') -> tuple[dict[int, list[dict]], dict[str, str]]:
    """Each client's rows of one kind of results.jsonl ('eval', or 'train': what a client logs
    with its update, e.g. SmartFed's activated_rank) in time order, and the client names."""
    rows: dict[int, list[dict]] = {}
    with open(os.path.join(results_dir, 'results.jsonl'), encoding='utf-8') as handle:
        for line in handle:
            row = json.loads(line)
            if row.get('kind') == kind:
                rows.setdefault(row['client'], []).append(row)
    names = run_info(results_dir).get('client_names') or {}
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


def compared_metric(column: dict, scale: str) -> str | None:
    """The metric a column is compared on at `scale` ('tiny': its tiny_metric where given)."""
    return column.get('tiny_metric', column.get('metric')) if scale == 'tiny' else column.get('metric')


def column_value(results_dir: str, column: dict, metric: str | None, levels: int = 4) -> float | None:
    """Our number for a paper's column in one finished run: the mean of `metric` over the
    column's clients (from their evaluation rows, or their train rows where the column says
    `rows: train`), ×100 where the paper prints percent; None when the run lacks it."""
    if not metric or not finished(results_dir):
        return None
    rows, names = evaluations(results_dir, column.get('rows', 'eval'))
    values = [v for cid in column_clients(column, sorted(rows), names, levels)
              if (v := client_value(rows[cid], metric)) is not None and not math.isnan(v)]
    if not values:
        return None
    value = sum(values) / len(values)
    return value * 100 if column.get('percent', False) else value


@dataclass
class Reading:
    """Where a table's runs are and how they are compared: the output folder, the scale tag
    of the folders, the scale whose metrics are read ('tiny' reads tiny_metric) and the seeds."""
    out: str
    tag: str
    metric_scale: str
    seeds: list[int]
    _cache: dict = field(default_factory=dict)

    def row_values(self, table: dict, row: dict, column: dict) -> dict[int, float]:
        """{seed: our value} of a row's column: read from the run of the column's panel
        (a table without panels: the row's one run), the mean of the columns a derived column
        names, or a difference row's minuend minus subtrahend, seed by seed."""
        key = (id(row), column['name'])
        if key not in self._cache:
            self._cache[key] = self._values(table, row, column)
        return self._cache[key]

    def _values(self, table: dict, row: dict, column: dict) -> dict[int, float]:
        pair = difference_rows(table, row)
        if pair is not None:
            first, second = (self.row_values(table, r, column) for r in pair)
            return {s: first[s] - second[s] for s in self.seeds if s in first and s in second}
        if column.get('mean_of'):
            by_column = [self.row_values(table, row, c) for c in table['columns']
                         if c['name'] in column['mean_of']]
            return {s: statistics.mean(values[s] for values in by_column) for s in self.seeds
                    if by_column and all(s in values for values in by_column)}
        if row.get('method') is None:
            return {}
        names = [p['name'] for p in row_panels(table, row)]
        panel = column.get('panel') if column.get('panel') in names else None
        if column.get('panel') is not None and panel is None:
            return {}
        if panel is None and names != [None]:
            return {}   # a table with panels: a column of none is not read from one of them
        metric = compared_metric(column, self.metric_scale)
        levels = table.get('budget_levels', 4)
        found = {seed: column_value(row_dir(self.out, table, row, seed, self.tag, panel), column,
                                    metric, levels) for seed in self.seeds}
        return {seed: value for seed, value in found.items() if value is not None}


# ------------------------------------------------------------------ the printed table
def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def cell(values: list[float]) -> str:
    mean, std = mean_std(values)
    if mean is None:
        return 'n/a'
    return f'{mean:.2f}' if std is None else f'{mean:.2f} ± {std:.2f}'


def paper_cell(value, std=None) -> str:
    if value is None:
        return ''
    text = f'{value:g}' if isinstance(value, (int, float)) else str(value)
    return f'{text} ± {std:g}' if std is not None else text


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def within_noise(ours: list[float], paper, paper_std) -> bool | None:
    """Whether ours - paper is smaller than the two stds combined (√(σ_paper² + σ_ours²));
    None where neither side has a std (one seed, and the paper prints none)."""
    mean, std = mean_std(ours)
    if mean is None or not is_number(paper):
        return None
    spread = [s for s in (std, paper_std if is_number(paper_std) else None) if s is not None]
    if not spread:
        return None
    return abs(mean - paper) < math.sqrt(sum(s * s for s in spread))


def difference(ours: list[float], paper, paper_std=None) -> str:
    mean, _ = mean_std(ours)
    if mean is None or not is_number(paper):
        return 'n/a'
    mark = ' (< σ)' if within_noise(ours, paper, paper_std) else ''
    return f'{mean - paper:+.2f}{mark}'


@dataclass
class TableReport:
    """One table's rows beside the paper's: per row and column the paper's number and std,
    ours per seed, and per row its status and cost (seconds, peak memory)."""
    table: dict
    rows: list[dict]
    reading: Reading
    statuses: dict[int, str]
    costs: dict[int, dict] = field(default_factory=dict)
    compare: bool = True   # False (a smoke check): ours is not compared with the paper's

    def delta(self, ours: list[float], paper, std) -> str:
        return difference(ours, paper, std) if self.compare else '—'

    def cells(self, row: dict, column: dict) -> tuple:
        numbers, spread = row.get('paper_numbers') or {}, row.get('paper_std') or {}
        ours = list(self.reading.row_values(self.table, row, column).values())
        return numbers.get(column['name']), spread.get(column['name']), ours

    def markdown(self) -> str:
        columns = self.table.get('columns') or []
        header = ['row'] + [f"{c['name']} {part}" for c in columns for part in ('paper', 'ours', 'Δ')]
        header += ['status', 'time', 'peak memory']
        lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
        for row in self.rows:
            out = [row['row']]
            for column in columns:
                paper, std, ours = self.cells(row, column)
                out += [paper_cell(paper, std), cell(ours), self.delta(ours, paper, std)]
            cost = self.costs.get(id(row), {})
            out += [self.statuses.get(id(row), ''), _seconds(cost.get('seconds')),
                    _bytes(cost.get('peak_bytes'))]
            lines.append('| ' + ' | '.join(out) + ' |')
        return '\n'.join(lines)

    def csv(self) -> str:
        handle = io.StringIO()
        writer = csv.writer(handle, lineterminator='\n')
        writer.writerow(['row', 'column', 'paper', 'paper_std', 'ours_mean', 'ours_std', 'seeds',
                         'difference', 'within_noise', 'status', 'seconds', 'peak_bytes'])
        for row in self.rows:
            cost = self.costs.get(id(row), {})
            for column in self.table.get('columns') or []:
                paper, std, ours = self.cells(row, column)
                mean, ours_std = mean_std(ours)
                writer.writerow([row['row'], column['name'], paper, std, _round(mean), _round(ours_std),
                                 len(ours), _round(mean - paper) if self.compare and mean is not None
                                 and is_number(paper) else None,
                                 within_noise(ours, paper, std) if self.compare else None,
                                 self.statuses.get(id(row), ''), _round(cost.get('seconds')),
                                 cost.get('peak_bytes')])
        return handle.getvalue()


def _round(value):
    return None if value is None else round(value, 4)


def _seconds(value) -> str:
    return '' if value is None else f'{value:.0f} s'


def _bytes(value) -> str:
    return '' if not value else f'{value / 2 ** 30:.2f} GiB'

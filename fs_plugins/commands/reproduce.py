"""`fs-plugins reproduce <paper> <table>`: a results table of docs/paper_tables.yaml as a command.

Each row runs once per panel of the table (a dataset, a Dirichlet α, a task: the table's
`panels`) and per seed: `fs-plugins run --cfg <yaml> fsplug.method <method> [the row's and the
panel's keys] seed k fsplug.results_dir <folder>` (folders: `paper_tables.row_dir`); a folder
that already holds a finished run (run_info.json: completed) is not run again. Then the table
is printed, and written as table.md and table.csv beside the runs, with the paper's rows and
columns: per column the paper's number, ours (mean ± std over seeds) and the difference.

`--scale paper` runs each row's own YAML (the paper's data, model and budget), a `{var}` in its
paths and values filled from the panel's `vars`. `--scale tiny` (the default without CUDA)
runs a stand-in instead: the table's `tiny_yaml` (a row's own `tiny_yaml` first, else
yamls/<method>/tiny.yaml), with the row's method and its keys except those that set the
paper's data, model and budget (TINY_DROPPED_KEYS), plus the row's `tiny_options`. A table's
`options` (its protocol: FedMosaic's evaluation point and matched compute) go to every row
at every scale, before the row's own. `--smoke`
runs every row for one round of two local steps (the whole pipeline at the paper's sizes, in minutes on a GPU); `--smoke
--tiny` swaps the paper's models for tiny ones of the same family (the audit's swap), so the
smoke runs on a CPU. docs/reproduce.md describes the data format and the rules.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import yaml

from fs_plugins.commands.paper_tables import (  # noqa: F401  (the names the tests and docs use)
    REPO,
    Reading,
    ReproduceError,
    TableReport,
    column_value,
    compared_metric,
    default_seeds,
    difference_rows,
    find_table,
    finished,
    load_tables,
    numbers_problems,
    row_dir,
    row_panels,
    run_info,
    select_rows,
    table_dir,
)
from fs_plugins.schema import method_index
from fs_plugins.schema.fs_llm import assign
from fs_plugins.schema.loading import read_yaml
from fs_plugins.schema.placeholders import is_placeholder

# row options that are not config keys: the YAML, FS's per-client file, the setting in words
FILE_OPTIONS = ('yaml', 'client_cfg', 'setting')
# keys that set the paper's data, model and budget: a tiny stand-in keeps its own
TINY_DROPPED_KEYS = frozenset({
    'model.type', 'federate.client_num', 'federate.sample_client_num',
    'federate.sample_client_rate', 'federate.total_round_num', 'train.local_update_steps',
    'data.splitter', 'fsplug.data.select', 'fsplug.model.adapter', 'fsplug.eval.gen_metrics',
    'fsplug.smartfed.budget', 'fsplug.model.library.adapters',
    'fsplug.dofit.domains'})   # one label per client of the paper's data
# one round of two local steps, evaluated at its end, a few generated answers per client
SMOKE_ROUNDS = 1
SMOKE_KEYS = {'federate.total_round_num': SMOKE_ROUNDS, 'train.local_update_steps': 2,
              'train.batch_or_epoch': 'batch', 'eval.freq': 1, 'fsplug.eval.max_gen_samples': 4}


@dataclass(frozen=True)
class Mode:
    """How a table runs: its scale, whether as a smoke check, and whether with the tiny swap."""
    scale: str
    smoke: bool = False
    tiny_swap: bool = False

    @property
    def tag(self) -> str:
        """The folder of this mode's runs: different modes never stand in for each other."""
        return self.scale + ('-smoke' if self.smoke else '') + ('-tiny' if self.tiny_swap else '')

    @property
    def metric_scale(self) -> str:
        """Tiny models are compared on the columns' tiny metrics."""
        return 'tiny' if self.scale == 'tiny' or self.tiny_swap else 'paper'


# ------------------------------------------------------------------ what runs a row
@dataclass
class RunPlan:
    """One run of a row: its panel, the YAML, FS's per-client file and the config keys, or
    `why_not` (not empty) when nothing runs it."""
    panel: str | None = None
    yaml: str | None = None
    client_cfg: str | None = None
    keys: dict = field(default_factory=dict)
    why_not: str = ''

    def opts(self) -> list[str]:
        out = []
        for key, value in self.keys.items():
            out += [key, json.dumps(value) if isinstance(value, (list, dict)) else str(value)]
        return out


def filled(value, variables: dict, where: str):
    """`value` with every `{name}` replaced by the panel's variable (strings inside lists too)."""
    if isinstance(value, list):
        return [filled(item, variables, where) for item in value]
    if not isinstance(value, str) or '{' not in value:
        return value
    try:
        return value.format_map(variables)
    except (KeyError, IndexError, ValueError) as exc:
        raise ReproduceError(f"{where}: '{value}' names {exc}, which the panel's vars "
                             f'{sorted(variables)} do not set') from None


def plan_runs(table: dict, row: dict, mode: Mode) -> list[RunPlan]:
    """The runs of a row at `mode`: one per panel it runs."""
    method = row.get('method')
    if method is None:
        pair = difference_rows(table, row)
        if pair is not None:
            return [RunPlan(why_not=f"difference row: '{pair[0]['row']}' minus '{pair[1]['row']}', "
                                    'seed by seed, from their runs')]
        return [RunPlan(why_not=f"not run: {row.get('reason') or 'no method'}")]
    return [plan_panel(table, row, panel, method, mode) for panel in row_panels(table, row)]


def plan_panel(table: dict, row: dict, panel: dict, method: str, mode: Mode) -> RunPlan:
    where = f"{table['paper']} {table['table']}, row '{row['row']}'"
    options = dict(row.get('options') or {})
    variables = dict(panel.get('vars') or {})
    keys = {'fsplug.method': method,
            **(table.get('options') or {}),   # the table's protocol, every row's
            **{k: v for k, v in options.items() if k not in FILE_OPTIONS},
            **(panel.get('keys') or {})}
    keys = {k: filled(v, variables, where) for k, v in keys.items()}
    plan = RunPlan(panel=panel.get('name'))
    if mode.scale == 'tiny':
        plan.yaml = row.get('tiny_yaml') or table.get('tiny_yaml') or f'yamls/{method}/tiny.yaml'
        plan.client_cfg = row.get('tiny_client_cfg') or table.get('tiny_client_cfg')
        plan.keys = {**{k: v for k, v in keys.items()
                        if k not in TINY_DROPPED_KEYS and not is_placeholder(v)},
                     **(row.get('tiny_options') or {})}
    else:
        plan.yaml = filled(options.get('yaml'), variables, where)
        plan.client_cfg = filled(options.get('client_cfg') or panel.get('client_cfg'), variables, where)
        plan.keys = keys
        if not plan.yaml:
            plan.why_not = f"no YAML sets the paper's setting ({options.get('setting', '')})"
    if mode.smoke and not plan.why_not:
        plan.keys = {**plan.keys, **smoke_round_caps(plan, method), **SMOKE_KEYS}
    return plan


def smoke_round_caps(plan: RunPlan, method: str) -> dict:
    """The method's options that count rounds (`*_rounds`: a warm-up, FedA²'s FedAvg stage,
    FedAdapter's trials) capped at the smoke's rounds, so that its config still loads (e.g.
    FedLEASE's warm-up must fit in the run)."""
    node = ((read_yaml(os.path.join(REPO, plan.yaml)).get('fsplug') or {}).get(method) or {})
    caps = {}
    for name, entry in (method_index.METHODS.get(method) or {}).items():
        if isinstance(entry, tuple) and name.endswith('_rounds') and entry[0] == 'int':
            key = f'fsplug.{method}.{name}'
            if int(plan.keys.get(key, node.get(name, entry[1]))) > SMOKE_ROUNDS:
                caps[key] = SMOKE_ROUNDS
    return caps


# ------------------------------------------------------------------ the runs
def run_command(yaml_path: str, client_cfg: str | None, opts: list[str], seed: int,
                results_dir: str, overwrite: bool) -> list[str]:
    return (['fs-plugins', 'run', '--cfg', yaml_path]
            + (['--client_cfg', client_cfg] if client_cfg else [])
            + (['--overwrite'] if overwrite else [])
            + opts + ['seed', str(seed), 'fsplug.results_dir', results_dir])


def run_row(command: list[str], log_path: str) -> int:
    """`command` (fs-plugins run ...) through this Python, its output to `log_path`; its wall
    time and the process's peak resident memory to `<log_path without .log>.cost.json`."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    started = time.monotonic()
    with open(log_path, 'w', encoding='utf-8') as log:
        process = subprocess.Popen([sys.executable, '-m', 'fs_plugins'] + command[1:], cwd=REPO,
                                   stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    write_cost(log_path[:-len('.log')], time.monotonic() - started, usage.ru_maxrss * 1024)
    return process.returncode


def write_cost(results_dir: str, seconds: float, rss_bytes: int) -> None:
    with open(results_dir + '.cost.json', 'w', encoding='utf-8') as handle:
        json.dump({'seconds': seconds, 'peak_rss_bytes': rss_bytes}, handle)


def run_cost(results_dir: str) -> dict:
    """{seconds, peak_bytes} of a run: its wall time and the GPU's peak memory the run
    recorded (run_info.json), else the process's peak resident memory."""
    try:
        with open(results_dir + '.cost.json', encoding='utf-8') as handle:
            cost = json.load(handle)
    except (OSError, ValueError):
        return {}
    return {'seconds': cost.get('seconds'),
            'peak_bytes': run_info(results_dir).get('peak_cuda_memory_bytes') or cost.get('peak_rss_bytes')}


def tiny_swapped(plan: RunPlan) -> tuple[dict, dict | None]:
    """The plan's YAML with its keys applied, swapped for tiny models of the same families
    (`fs_plugins.run.audit.tiny_config`), and its --client_cfg entries swapped alike."""
    from fs_plugins.run.audit import tiny_config  # lazy: imports torch (the method registry)
    plain = read_yaml(os.path.join(REPO, plan.yaml))
    for key, value in plan.keys.items():
        if key not in SMOKE_KEYS:
            assign(plain, key, value)
    clients = read_yaml(os.path.join(REPO, plan.client_cfg)) if plan.client_cfg else None
    return tiny_config(plain, clients)


def swapped_paths(results_dir: str, swapped: tuple[dict, dict | None]) -> tuple[str, str | None]:
    """Where `--smoke --tiny` writes a run's swapped config and client entries, and runs them:
    <seed>.config.yaml and <seed>.clients.yaml beside the run's folder."""
    return results_dir + '.config.yaml', (results_dir + '.clients.yaml' if swapped[1] else None)


def write_swapped(swapped: tuple[dict, dict | None], results_dir: str) -> None:
    os.makedirs(os.path.dirname(results_dir), exist_ok=True)
    for path, content in zip(swapped_paths(results_dir, swapped), swapped):
        if path:
            with open(path, 'w', encoding='utf-8') as handle:
                yaml.safe_dump(content, handle, sort_keys=False, allow_unicode=True)


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


@dataclass
class Runner:
    """Runs (or with dry_run prints) the rows of one table at one mode."""
    table: dict
    mode: Mode
    out: str
    seeds: list[int]
    overrides: list[str]
    dry_run: bool = False
    same_runs: dict = field(default_factory=dict)   # {command: the folder that ran it}
    plans: dict = field(default_factory=dict)       # {id(row): its RunPlans}

    def row(self, row: dict) -> str:
        """Runs a row's command per panel and seed, skipping finished runs; its status."""
        outcome = []
        self.plans[id(row)] = plans = plan_runs(self.table, row, self.mode)
        for plan in plans:
            if plan.why_not:
                print(f"# {row['row']}: {plan.why_not}")
                return plan.why_not
            swapped = tiny_swapped(plan) if self.mode.tiny_swap else None   # once for its seeds
            for seed in self.seeds:
                outcome.append(self.run(row, plan, seed, swapped))
        return ', '.join(dict.fromkeys(outcome))

    def run(self, row: dict, plan: RunPlan, seed: int, swapped: tuple | None = None) -> str:
        """One run (`swapped`: its config and client entries after the tiny swap). A run whose
        command an earlier row of this call already ran (panels that differ only in a setting
        the tiny stand-in drops, e.g. the LLM or the dataset) links to that run's folder
        instead of running again."""
        results_dir = row_dir(self.out, self.table, row, seed, self.mode.tag, plan.panel)
        name = f"{row['row']}" + (f' [{plan.panel}]' if plan.panel else '') + f' seed {seed}'
        # with the tiny swap, rows whose swapped configs are equal (e.g. differing in the LLM
        # only) are the same run
        what = json.dumps(swapped, sort_keys=True, default=str) if swapped else \
            (plan.yaml, plan.client_cfg, tuple(plan.opts()))
        same = (what, tuple(self.overrides), seed)
        if same in self.same_runs and self.same_runs[same] != results_dir:
            print(f'# {name}: the same run as {self.same_runs[same]}')
            if not self.dry_run:
                link_run(self.same_runs[same], results_dir)
            return 'same run as an earlier row'
        self.same_runs[same] = results_dir
        if finished(results_dir):
            print(f'# {name}: finished earlier ({results_dir}), not run again')
            return 'done earlier'
        # an unfinished run's folder is started again from scratch
        started = os.path.isfile(os.path.join(results_dir, 'results.jsonl'))
        yaml_path, client_cfg, opts = plan.yaml, plan.client_cfg, plan.opts()
        if swapped:
            opts = [part for key, value in SMOKE_KEYS.items() for part in (key, str(value))]
            yaml_path, client_cfg = swapped_paths(results_dir, swapped)
            if not self.dry_run:
                write_swapped(swapped, results_dir)
        command = run_command(yaml_path, client_cfg, opts + self.overrides, seed, results_dir,
                              overwrite=started)
        if self.dry_run:
            swap = f'  # the tiny swap of {plan.yaml}' if swapped else ''
            print(' '.join(_quoted(command)) + swap)
            return 'dry run'
        print(f"# {name}: {' '.join(_quoted(command))}", flush=True)
        code = run_row(command, results_dir + '.log')
        return 'ran' if code == 0 else f'failed (exit {code}, see {results_dir}.log)'

    def cost(self, row: dict) -> dict:
        """A row's seconds (summed over its runs) and peak memory (the largest)."""
        costs = [run_cost(row_dir(self.out, self.table, row, seed, self.mode.tag, plan.panel))
                 for plan in self.plans.get(id(row), []) if not plan.why_not
                 for seed in self.seeds]
        costs = [c for c in costs if c]
        if not costs:
            return {}
        return {'seconds': sum(c['seconds'] or 0 for c in costs),
                'peak_bytes': max((c['peak_bytes'] or 0 for c in costs), default=0) or None}


# ------------------------------------------------------------------ the command
def default_scale() -> str:
    import torch  # lazy: only to see whether CUDA is there
    return 'paper' if torch.cuda.is_available() else 'tiny'


def header_lines(table: dict, mode: Mode, seeds: list[int]) -> list[str]:
    if mode.scale == 'tiny':
        where = ("tiny stand-in, not the paper's setting: each row runs its tiny YAML "
                 "(see docs/reproduce.md), so the paper's numbers are for orientation only")
    else:
        where = "the paper's setting (each row's own YAML)"
        if mode.smoke:
            where += (', as a smoke check (one round of two local steps: the pipeline, not the '
                      "paper's numbers)")
        if mode.tiny_swap:
            where += ', each model swapped for a tiny one of its family'
    lines = [f"{table['paper']} {table['table']}: {table['caption']}",
             f"Scale: {where}. Seeds: {', '.join(map(str, seeds))}."]
    if table.get('panels'):
        lines.append(f"Panels (one run per row and panel): {', '.join(p['name'] for p in table['panels'])}")
    if table.get('column_note'):
        lines.append(f"Columns: {table['column_note']}")
    if 'columns' not in table:
        lines.append(f"The paper's numbers are not recorded for this table: "
                     f"{table.get('numbers_pending', '')}")
    if table.get('columns'):
        compared = [c['name'] for c in table['columns']
                    if compared_metric(c, mode.metric_scale) or c.get('mean_of')]
        lines.append('Ours: the mean over clients (or the named client) of the last evaluation, '
                     'mean ± std over seeds; Δ = ours − paper, "(< σ)" where it is smaller than '
                     "the paper's and our stds combined. Compared columns: "
                     f"{', '.join(compared) or 'none'}")
    return lines


def reproduce(args) -> int:
    table = find_table(load_tables(), args.paper, args.table)
    rows = select_rows(table, args.rows)
    scale = args.scale or default_scale()
    if args.tiny and not args.smoke:
        raise ReproduceError('--tiny swaps the paper\'s models for tiny ones: a smoke check only, '
                             'give --smoke too')
    if args.tiny and scale != 'paper':
        raise ReproduceError('--tiny swaps the models of the paper-scale YAMLs: give --scale paper')
    mode = Mode(scale, args.smoke, args.tiny)
    seeds = args.seeds or (default_seeds(table)[:1] if args.smoke else default_seeds(table))
    out = os.path.abspath(args.out)
    runner = Runner(table, mode, out, seeds, [p for pair in args.overrides for p in pair],
                    args.dry_run)
    header = header_lines(table, mode, seeds)
    print('\n'.join(header) + '\n', flush=True)
    statuses = {id(row): runner.row(row) for row in rows}
    if args.dry_run:
        return 0
    report = TableReport(table, rows, Reading(out, mode.tag, mode.metric_scale, seeds), statuses,
                         {id(row): runner.cost(row) for row in rows}, compare=not mode.smoke)
    markdown = report.markdown()
    print('\n' + markdown)
    folder = table_dir(out, table, mode.tag)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, 'table.md'), 'w', encoding='utf-8') as handle:
        handle.write('\n\n'.join(['\n'.join(header), markdown]) + '\n')
    with open(os.path.join(folder, 'table.csv'), 'w', encoding='utf-8') as handle:
        handle.write(report.csv())
    print(f'\nWritten: {os.path.join(folder, "table.md")} and table.csv')
    return 1 if any(status.startswith('failed') for status in statuses.values()) else 0


def add_parser(sub) -> None:
    parser = sub.add_parser('reproduce', help="run a paper's results table (docs/paper_tables.yaml) "
                                              "and print it beside the paper's numbers")
    parser.add_argument('paper', help='fedmole, fedmosaic, uniflow, flame or smartfed')
    parser.add_argument('table', help="'Table 1' or 1")
    parser.add_argument('--rows', nargs='+', default=None, help="only these rows (names as printed)")
    parser.add_argument('--seeds', nargs='+', type=int, default=None,
                        help="default: the paper's (1 2 3 where it prints mean ± std, else 1; "
                             'with --smoke the first)')
    parser.add_argument('--dry-run', action='store_true', help='print the commands, run nothing')
    parser.add_argument('--out', default='exp/reproduce',
                        help='runs go to OUT/<paper>/<table>/<scale>/<row>[/<panel>]/seed<k> '
                             '(default exp/reproduce), the table to table.md and table.csv there')
    parser.add_argument('--scale', choices=['tiny', 'paper'], default=None,
                        help="tiny: each row's tiny stand-in; paper: the row's own YAML "
                             '(default: paper with CUDA, else tiny)')
    parser.add_argument('--smoke', action='store_true',
                        help='one round of two local steps per row (a few generated answers): the '
                             "whole pipeline at the paper's sizes, in minutes on a GPU")
    parser.add_argument('--tiny', action='store_true',
                        help="with --smoke --scale paper: each model swapped for a tiny one of its "
                             "family (the audit's swap), so the smoke runs on a CPU")
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

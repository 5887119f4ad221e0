"""The README's paper coverage (docs/paper_tables.yaml): every row names a registered method
with a YAML that exists and keys the schema accepts, or the reason nothing runs it."""
import os
import sys

import pytest
from helpers import REPO

from fs_plugins.commands.reproduce import Mode, numbers_problems, plan_runs
from fs_plugins.methods.registry import all_methods
from fs_plugins.run.config import ConfigError, load_config

sys.path.insert(0, os.path.join(REPO, 'scripts'))
import gen_reference  # noqa: E402

TABLES = gen_reference.paper_tables()


@pytest.mark.parametrize('table', TABLES, ids=[f"{t['paper']}-{t['table']}" for t in TABLES])
def test_every_row_runs_or_says_why(table):
    """At the paper's scale every method row has a command for each of its panels: its YAML
    and --client_cfg exist and the config loads with the row's and the panel's keys."""
    assert table['paper'] in gen_reference.PAPERS and table['rows']
    problems = []
    for row in table['rows']:
        method = row.get('method')
        if method is None:
            if not str(row.get('reason', '')).strip():
                problems.append(f"{row['row']}: no method and no reason")
            continue
        if method not in all_methods():
            problems.append(f"{row['row']}: '{method}' is not a registered method")
            continue
        for plan in plan_runs(table, row, Mode('paper')):
            where = f"{row['row']} [{plan.panel}]" if plan.panel else row['row']
            if plan.why_not:
                problems.append(f'{where}: {plan.why_not}')
                continue
            missing = [p for p in (plan.yaml, plan.client_cfg)
                       if p and not os.path.isfile(os.path.join(REPO, p))]
            if missing:
                problems.append(f'{where}: missing {missing}')
                continue
            try:
                load_config(os.path.join(REPO, plan.yaml), plan.opts())
            except ConfigError as exc:
                problems.append(f'{where}: {exc.problems}')
    assert not problems, '\n'.join(problems)


def test_no_row_waits_for_a_planned_method():
    """Every row that names no method says why it is out of scope, not that it is planned."""
    waiting = [row['row'] for t in TABLES for row in t['rows']
               if row.get('method') is None and 'planned' in row['reason']]
    assert not waiting, waiting


def test_only_difference_rows_and_labels_name_no_method():
    """Every row that is a method names a runnable one: a row without a method is a difference
    of two other rows or a label (its reason says 'not a method')."""
    unrunnable = [f"{t['paper']} {t['table']}: {row['row']}" for t in TABLES for row in t['rows']
                  if row.get('method') is None and 'not a method' not in row['reason']]
    assert not unrunnable, unrunnable


@pytest.mark.parametrize('table', TABLES, ids=[f"{t['paper']}-{t['table']}" for t in TABLES])
def test_every_row_has_the_papers_numbers_or_says_why(table):
    """Each table lists the paper's columns and every row its number for each (or the reason
    why none, e.g. a number the text extraction lost), or says why it is not transcribed yet."""
    assert not numbers_problems(table), '\n'.join(numbers_problems(table))


def test_every_paper_has_a_table_with_its_numbers():
    complete = {t['paper'] for t in TABLES if 'columns' in t and not numbers_problems(t)}
    assert complete == set(gen_reference.PAPERS), set(gen_reference.PAPERS) - complete

"""The README's paper coverage (docs/paper_tables.yaml): every row names a registered method
with a YAML that exists and keys the schema accepts, or the reason nothing runs it."""
import os
import re
import sys

import pytest
from helpers import REPO, tiny_yaml_of

from fs_plugins.commands.reproduce import numbers_problems
from fs_plugins.methods.registry import all_methods
from fs_plugins.run.config import ConfigError, load_config

sys.path.insert(0, os.path.join(REPO, 'scripts'))
import gen_reference  # noqa: E402

TABLES = gen_reference.paper_tables()


def expanded(path: str) -> list[str]:
    """'yamls/x/{a,b}.yaml' -> both paths (the data's shell-brace notation)."""
    match = re.search(r'\{([^}]*)\}', path)
    if not match:
        return [path]
    return [p for choice in match.group(1).split(',')
            for p in expanded(path[:match.start()] + choice + path[match.end():])]


def _opts(options: dict, method: str) -> list[str]:
    opts = ['fsplug.method', method]
    for key, value in options.items():
        if key not in ('yaml', 'client_cfg', 'setting'):
            opts += [key, str(value)]
    return opts


@pytest.mark.parametrize('table', TABLES, ids=[f"{t['paper']}-{t['table']}" for t in TABLES])
def test_every_row_runs_or_says_why(table):
    assert table['paper'] in gen_reference.PAPERS and table['rows']
    problems = []
    for row in table['rows']:
        method, options = row.get('method'), dict(row.get('options') or {})
        if method is None:
            if not str(row.get('reason', '')).strip():
                problems.append(f"{row['row']}: no method and no reason")
            continue
        if method not in all_methods():
            problems.append(f"{row['row']}: '{method}' is not a registered method")
            continue
        paths = [p for key in ('yaml', 'client_cfg') if key in options
                 for p in expanded(options[key])]
        missing = [p for p in paths if not os.path.isfile(os.path.join(REPO, p))]
        if missing:
            problems.append(f"{row['row']}: missing {missing}")
            continue
        base = os.path.join(REPO, expanded(options['yaml'])[0]) if 'yaml' in options \
            else tiny_yaml_of(method)
        try:
            load_config(base, _opts(options, method))
        except ConfigError as exc:
            problems.append(f"{row['row']}: {exc.problems}")
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

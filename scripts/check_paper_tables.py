"""Checks the paper's numbers in docs/paper_tables.yaml and says which tables are complete.

    python scripts/check_paper_tables.py [--quiet]

A table is complete when it has `columns` (the paper's, in its order, each with the metric of
ours it corresponds to, or the table's `column_note` saying why none) and every row has
`paper_numbers` for every column, or a `numbers_reason`. A table not transcribed yet says why
in `numbers_pending`. Prints one line per table (complete / pending / problems) and exits 1
when any table is malformed (fs_plugins.commands.reproduce.numbers_problems).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fs_plugins.commands.reproduce import load_tables, numbers_problems  # noqa: E402


def table_status(table: dict) -> str:
    problems = numbers_problems(table)
    if problems:
        return 'PROBLEMS: ' + '; '.join(problems)
    if 'columns' not in table:
        return f"pending: {table['numbers_pending']}"
    rows = table['rows']
    numbered = sum('paper_numbers' in row for row in rows)
    return (f"complete: {len(table['columns'])} columns, {numbered}/{len(rows)} rows with numbers"
            + (f", {len(rows) - numbered} with a reason" if numbered < len(rows) else ''))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--quiet', action='store_true', help='print only the problems')
    args = parser.parse_args(argv)
    tables = load_tables()
    bad = 0
    for table in tables:
        status = table_status(table)
        bad += status.startswith('PROBLEMS')
        if not args.quiet or status.startswith('PROBLEMS'):
            print(f"{table['paper']:<10} {table['table']:<9} {status}")
    complete = sum('columns' in t and not numbers_problems(t) for t in tables)
    print(f'{complete}/{len(tables)} tables complete, {bad} malformed')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())

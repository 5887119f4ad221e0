"""Config fuzzing report: broken variants of every shipped YAML (fs_plugins.commands.fuzz), run
through `fs-plugins run --runner embedded`; counts per kind of variants tried and of those that
ended in a clean error naming the culprit (exit code 2, no traceback). The test
tests/test_config_fuzz.py asserts the same for every variant.

    python scripts/fuzz_configs.py [--show-failures]
"""
from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import tempfile

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'tests'))

from test_config_fuzz import shipped_yamls  # noqa: E402

from fs_plugins.commands.fuzz import mutations, run_mutation  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--show-failures', action='store_true')
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)
    tried, clean = collections.Counter(), collections.Counter()
    failures = []
    paths = shipped_yamls()
    with tempfile.TemporaryDirectory() as workdir:
        os.chdir(workdir)
        for path in paths:
            with open(os.path.join(REPO, path), encoding='utf-8') as handle:
                plain = yaml.safe_load(handle) or {}
            for index, mutation in enumerate(mutations(plain, path)):
                ok, printed = run_mutation(plain, mutation, os.path.join(workdir, f'v{index}.yaml'))
                tried[mutation.kind] += 1
                clean[mutation.kind] += ok
                if not ok:
                    failures.append((path, mutation, printed[-800:]))
    print(f'{len(paths)} shipped YAMLs, {sum(tried.values())} broken variants')
    print('| kind | variants tried | clean error naming the culprit |')
    print('|---|---|---|')
    for kind in sorted(tried):
        print(f'| {kind} | {tried[kind]} | {clean[kind]} |')
    print(f'| all | {sum(tried.values())} | {sum(clean.values())} |')
    if args.show_failures:
        for path, mutation, printed in failures:
            print(f'\n{path}: {mutation}\n{printed}')


if __name__ == '__main__':
    main()

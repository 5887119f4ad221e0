"""Writes tests/data/fs_config_keys.txt: every key of FederatedScope's config tree (its leaves,
without the plugin's `fsplug` node), one dotted key per line, sorted. tests/test_fs_llm_keys.py
checks that each is classified (fs_plugins.schema.fs_llm.FS_KEYS) from this list where FS is not
installed, and that the list is FS's own tree where it is. `--check` exits 1 when it is stale.

Run with the Python that has FederatedScope: /opt/fsvenv/bin/python scripts/record_fs_keys.py
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDED = os.path.join(REPO, 'tests', 'data', 'fs_config_keys.txt')


def fs_config_keys() -> list[str]:
    """The dotted leaf keys of FS's global config, sorted."""
    from federatedscope.core.configs.config import global_cfg

    from fs_plugins.fs.config import fs_known_keys
    from fs_plugins.schema.fs_llm import leaves
    return sorted(key for key, _ in leaves(fs_known_keys(global_cfg)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--check', action='store_true', help='exit 1 if the recorded list is stale')
    args = parser.parse_args(argv)
    text = '\n'.join(fs_config_keys()) + '\n'
    if args.check:
        with open(RECORDED, encoding='utf-8') as handle:
            stale = handle.read() != text
        if stale:
            print(f'{os.path.relpath(RECORDED, REPO)} is stale: run scripts/record_fs_keys.py', file=sys.stderr)
        return int(stale)
    os.makedirs(os.path.dirname(RECORDED), exist_ok=True)
    with open(RECORDED, 'w', encoding='utf-8') as handle:
        handle.write(text)
    return 0


if __name__ == '__main__':
    sys.exit(main())

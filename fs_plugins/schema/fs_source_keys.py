"""FederatedScope's own config keys, read from the installed FS's config modules with `ast`
(never imported: importing FS's config costs seconds and imports torch).

The pre-check uses this tree under FederatedScope, so that a misspelt FS key (say
`federate.total_round_nm`) is reported before the heavy imports, with the same words as the
embedded runner. FS builds its tree in `federatedscope/core/configs/*.py` (and the modules of
`federatedscope/contrib/configs/`) by statements `cfg.<node>.<key> = <default>`, a node being
`CN()` or `CN(new_allowed=True)` (a node that takes keys FS does not declare). Anything these
statements cannot express makes the tree unknown (None), and the pre-check then leaves FS's keys
to FS, as before."""
from __future__ import annotations

import ast
import functools
import glob
import importlib.util
import os

from fs_plugins.schema.options import OPEN_NODE

__all__ = ['fs_source_key_tree', 'key_tree_of_sources']

CONFIG_DIRS = (os.path.join('core', 'configs'), os.path.join('contrib', 'configs'))


@functools.cache
def fs_source_key_tree() -> dict | None:
    """The key tree (nested dicts, leaves None, open nodes marked OPEN_NODE) of the installed
    FederatedScope, or None when FS is not installed or its config modules cannot be read."""
    try:
        spec = importlib.util.find_spec('federatedscope')   # locates, does not execute
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    paths = sorted(path for root in locations for folder in CONFIG_DIRS
                   for path in glob.glob(os.path.join(root, folder, '*.py')))
    return key_tree_of_sources(paths) if paths else None


def key_tree_of_sources(paths: list[str]) -> dict | None:
    """The key tree the `cfg.a.b = value` statements of these modules build (None when one of
    them cannot be read or parsed)."""
    tree: dict = {}
    try:
        for path in paths:
            with open(path, encoding='utf-8') as handle:
                module = ast.parse(handle.read(), path)
            for node in ast.walk(module):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        _add(tree, _cfg_key(target), node.value)
    except (OSError, SyntaxError, ValueError):
        return None
    return tree


def _cfg_key(target: ast.expr) -> list[str] | None:
    """['a', 'b'] for the target `cfg.a.b`; None for any other target."""
    parts = []
    while isinstance(target, ast.Attribute):
        parts.append(target.attr)
        target = target.value
    if isinstance(target, ast.Name) and target.id == 'cfg' and parts:
        return parts[::-1]
    return None


def _is_node(value: ast.expr) -> tuple[bool, bool]:
    """(is a CN(...) node, takes new keys) of an assigned value."""
    if isinstance(value, ast.Call) and getattr(value.func, 'id', getattr(value.func, 'attr', '')) == 'CN':
        open_node = any(k.arg == 'new_allowed' and isinstance(k.value, ast.Constant) and k.value.value
                        for k in value.keywords)
        return True, open_node
    return False, False


def _child(node: dict, part: str) -> dict:
    """node[part] as a node (a leaf of that name becomes one)."""
    if not isinstance(node.get(part), dict):
        node[part] = {}
    return node[part]


def _add(tree: dict, key: list[str] | None, value: ast.expr) -> None:
    if not key:
        return
    node = tree
    for part in key[:-1]:
        node = _child(node, part)
    is_node, open_node = _is_node(value)
    if is_node:
        child = _child(node, key[-1])
        if open_node:
            child[OPEN_NODE] = True
    elif not isinstance(node.get(key[-1]), dict):
        node[key[-1]] = None

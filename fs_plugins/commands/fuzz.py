"""Broken variants of a YAML, generated from the schema, each with the text its error must name.

Used by `tests/test_config_fuzz.py` and `scripts/fuzz_configs.py`: every variant must end in a
clean error (exit code 2, no traceback) that names the culprit. Kinds:
- 'unknown key': a misspelt key of a section the YAML uses, and an invented key in the
  method's own node;
- 'wrong type': an option given a value of another type (a word for a number or a flag, a
  number for a word, a mapping for a list);
- 'out of range': an option given a value outside its bounds or choices;
- 'missing file': the data file, the checkpoint to resume from, a module to import.
Options are drawn from the general `fsplug` keys, the YAML's method node and the FS keys the
plugin reads, with a generator seeded by the YAML's path (the same variants every time).
`checks_before_and_after_imports` compares, for one variant, what the pre-check before the
heavy imports reports (`fs_plugins.schema.precheck`) with what the full load reports.
"""
from __future__ import annotations

import copy
import random
import typing
from dataclasses import dataclass, fields

from fs_plugins.commands.cli import main
from fs_plugins.core.errors import ConfigError
from fs_plugins.schema.fs_keys import FSKeys
from fs_plugins.schema.options import _hints, _is_section, _list_item, _optional_inner, _resolve_choices, walk_options
from fs_plugins.schema.placeholders import with_placeholders_filled
from fs_plugins.schema.plugin import PluginOptions
from fs_plugins.schema.precheck import precheck

MISSING_ROOT = '/nonexistent/fsplug-fuzz'
SUPPLIED = MISSING_ROOT + '/supplied'   # where the fuzz puts what a paper YAML's user supplies


@dataclass
class Mutation:
    kind: str
    key: str          # dotted key that is set
    value: object
    culprit: str      # text the error message must contain
    # the culprit is a value outside choices a registry owns: only the full check (after the
    # imports that fill the registry) finds it
    registry: bool = False

    def apply(self, plain: dict) -> dict:
        out = copy.deepcopy(plain)
        node = out
        *parents, leaf = self.key.split('.')
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = copy.deepcopy(self.value)
        return out


def option_rows(cls, path: str) -> list[tuple[str, object, dict]]:
    """(dotted key, annotation, option metadata) of every option under `cls`, recursively."""
    return [(key, tp, dict(fld.metadata)) for key, tp, fld in walk_options(cls, path)]


def candidate_options(plain: dict) -> list[tuple[str, object, dict]]:
    from fs_plugins.methods.registry import all_methods  # lazy: imports torch (the methods)
    rows = option_rows(PluginOptions, 'fsplug')
    method = (plain.get('fsplug') or {}).get('method')
    if method in all_methods():
        rows += option_rows(all_methods()[method].config_class, f'fsplug.{method}')
    for fld in fields(FSKeys):
        tp = _hints(FSKeys)[fld.name]
        if _is_section(tp):
            rows += option_rows(tp, fld.name)
    # import_modules and the checkpoint keys get their own 'missing file' variants
    return [r for r in rows if not r[0].startswith(('fsplug.import_modules', 'fsplug.checkpoint'))]


def wrong_type_value(tp):
    inner = _optional_inner(tp)
    if inner is not None:
        return wrong_type_value(inner)
    if _list_item(tp) is not None:
        return {'not': 'a list'}
    if tp is bool:
        return 'perhaps'
    if tp in (int, float):
        return 'not-a-number'
    if tp is str:
        return 12345
    return None


def out_of_range_value(tp, meta: dict):
    """A value just outside the option's choices or bounds (None when it has neither)."""
    inner = _optional_inner(tp) or tp
    choices = _resolve_choices(meta.get('choices'))
    item = _list_item(inner)
    if choices is not None:
        bad = '__no_such_choice__'
        return [bad] if item is not None else bad
    base = item if item is not None else inner
    special = set(meta.get('special') or ())
    for bound, shift in (('ge', -1), ('gt', 0), ('le', 1), ('lt', 0)):
        limit = meta.get(bound)
        if limit is None or base not in (int, float):
            continue
        value = limit + shift
        value = int(value) if base is int else float(value)
        if value in special:
            continue
        return [value] if item is not None else value
    return None


def _used_section(plain: dict, rng: random.Random) -> str | None:
    sections = [f'fsplug.{k}' for k, v in (plain.get('fsplug') or {}).items() if isinstance(v, dict)]
    sections += [k for k, v in plain.items() if isinstance(v, dict) and k != 'fsplug']
    return rng.choice(sorted(sections)) if sections else None


def mutations(plain: dict, seed_text: str, per_kind: int = 3) -> list[Mutation]:
    """Broken variants of one YAML (`plain`: its content)."""
    rng = random.Random(seed_text)
    out = []
    section = _used_section(plain, rng)
    if section:
        node = _get(plain, section)
        if node:
            existing = rng.choice(sorted(node))
            typo = existing[:-1] + ('x' if existing[-1] != 'x' else 'y')
            out.append(Mutation('unknown key', f'{section}.{typo}', 1, f'{section}.{typo}'))
    method = (plain.get('fsplug') or {}).get('method') or 'fedavg'
    out.append(Mutation('unknown key', f'fsplug.{method}.no_such_option', 1,
                        f'fsplug.{method}.no_such_option'))
    rows = candidate_options(plain)
    typed = [r for r in rows if wrong_type_value(r[1]) is not None]
    for key, tp, _ in rng.sample(typed, min(per_kind, len(typed))):
        out.append(Mutation('wrong type', key, wrong_type_value(tp), key))
    bounded = [(k, tp, m) for k, tp, m in rows if out_of_range_value(tp, m) is not None]
    for key, tp, meta in rng.sample(bounded, min(per_kind, len(bounded))):
        out.append(Mutation('out of range', key, out_of_range_value(tp, meta), key,
                            registry=callable(meta.get('choices'))))
    missing_data = f'{MISSING_ROOT}/records.jsonl'
    out.append(Mutation('missing file', 'data.type', f'{missing_data}@fsplug', missing_data))
    out.append(Mutation('missing file', 'fsplug.checkpoint.resume_from', f'{MISSING_ROOT}/run',
                        f'{MISSING_ROOT}/run'))
    out.append(Mutation('missing file', 'fsplug.import_modules', ['fsplug_fuzz_missing_module'],
                        'fsplug_fuzz_missing_module'))
    return out


def _get(plain: dict, dotted: str):
    node: typing.Any = plain
    for part in dotted.split('.'):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def is_client_config(plain: dict) -> bool:
    """A `--client_cfg` file (client_<id>: overrides), not a run's YAML."""
    return bool(plain) and all(str(k).startswith('client_') for k in plain)


def run_mutation(plain: dict, mutation: Mutation, path: str) -> tuple[bool, str]:
    """Writes the mutated YAML (its `/path/to/` placeholders filled with paths under SUPPLIED,
    which do not exist) to `path` and runs `fs-plugins run --runner embedded` on it in this
    process; returns (a clean error naming the culprit, what the command printed)."""
    import contextlib
    import io

    import yaml

    with open(path, 'w', encoding='utf-8') as handle:   # its placeholders filled, as a user has it
        yaml.safe_dump(mutation.apply(with_placeholders_filled(plain, SUPPLIED)), handle)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed):
            code = main(['run', '--runner', 'embedded', '--cfg', path])
    except BaseException as exc:   # noqa: BLE001 -- an escaping exception is what is looked for
        import traceback
        return False, printed.getvalue() + traceback.format_exc() + f'\n(escaped: {exc!r})'
    text = printed.getvalue()
    return code == 2 and mutation.culprit in text and 'Traceback' not in text, text


def checks_before_and_after_imports(plain: dict, mutation: Mutation, path: str) -> tuple[list[str], list[str]]:
    """Writes the mutated YAML (placeholders filled, as `run_mutation`) to `path`; (the problems
    the pre-check reports, those the full load reports), [] where a check passes it."""
    import yaml

    from fs_plugins.run.config import load_config  # lazy: importing it imports torch

    with open(path, 'w', encoding='utf-8') as handle:
        yaml.safe_dump(mutation.apply(with_placeholders_filled(plain, SUPPLIED)), handle)
    found = []
    for check in (precheck, load_config):
        try:
            check(path)
            found.append([])
        except ConfigError as exc:
            found.append(exc.problems)
    return found[0], found[1]

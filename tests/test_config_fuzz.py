"""Config fuzzing (issue 14): broken variants of every shipped YAML, generated from the schema
(fs_plugins.commands.fuzz), each end in a clean error — exit code 2, no traceback — whose message
names the culprit key, value or path."""
import os

import pytest
import yaml
from helpers import REPO, shipped_yamls

from fs_plugins.commands.fuzz import checks_before_and_after_imports, is_client_config, mutations, run_mutation
from fs_plugins.core.registry import METHODS


def fuzzed_yamls() -> list[str]:
    """Not yamls/*/distributed/: those are derived from the fuzzed sources (and load-tested
    in test_config)."""
    return [p for p in shipped_yamls() if not is_client_config(_read(os.path.join(REPO, p)))
            and f'{os.sep}distributed{os.sep}' not in p]


def _read(path):
    with open(path, encoding='utf-8') as handle:
        return yaml.safe_load(handle) or {}


@pytest.mark.slow
@pytest.mark.parametrize('yaml_path', fuzzed_yamls())
def test_every_broken_variant_of_a_shipped_yaml_ends_in_a_clean_error(tmp_path, yaml_path,
                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)   # relative data roots and outdirs land in the test's folder
    plain = _read(os.path.join(REPO, yaml_path))
    cases = mutations(plain, yaml_path)
    assert {m.kind for m in cases} >= {'unknown key', 'wrong type', 'missing file'}
    failures = []
    for index, mutation in enumerate(cases):
        clean, printed = run_mutation(plain, mutation, str(tmp_path / f'variant_{index}.yaml'))
        if not clean:
            failures.append(f'{mutation.kind} {mutation.key} = {mutation.value!r} '
                            f'(must name {mutation.culprit!r}):\n{printed[-1500:]}')
    assert not failures, '\n\n'.join(failures)


def in_order_within(part: list[str], whole: list[str]) -> bool:
    """Every line of `part` is a line of `whole`, in the same order."""
    lines = iter(whole)
    return all(any(line == other for other in lines) for line in part)


@pytest.mark.slow
@pytest.mark.parametrize('yaml_path', [p for p in fuzzed_yamls() if p.endswith(os.sep + 'tiny.yaml')])
def test_the_precheck_reports_each_mistake_it_can_as_the_full_check_does(tmp_path, yaml_path,
                                                                         monkeypatch):
    """Before torch is imported (fs_plugins.schema.precheck): every problem it reports is one
    the full load reports, in the same words and order (never a config the full load accepts);
    it finds every unknown key, wrong type and value outside fixed choices or bounds; only
    choices a registry owns, the methods' rules between keys and missing files wait for the
    full check."""
    monkeypatch.chdir(tmp_path)
    # the full check runs in this process, where other test modules registered test-only
    # methods (toy_methods) the pre-check's generated index rightly does not list
    METHODS.names()
    monkeypatch.setattr(METHODS, '_entries', {name: cls for name, cls in METHODS._entries.items()
                                              if cls.__module__.startswith('fs_plugins.')})
    plain = _read(os.path.join(REPO, yaml_path))
    failures = []
    for index, mutation in enumerate(mutations(plain, yaml_path)):
        before, after = checks_before_and_after_imports(plain, mutation,
                                                        str(tmp_path / f'variant_{index}.yaml'))
        if not in_order_within(before, after):
            failures.append(f'{mutation.key} = {mutation.value!r}: the pre-check says {before}, '
                            f'the full check {after}')
        elif not before and mutation.kind != 'missing file' and not mutation.registry:
            failures.append(f'{mutation.key} = {mutation.value!r}: only the full check finds '
                            f'{after}')
    assert not failures, '\n'.join(failures)

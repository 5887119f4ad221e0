"""The test tiers as CI runs them: .ci/run runs every tier that tests/conftest.py declares,
each test is in one tier, and scripts/slowest_tests.py reads pytest's JUnit reports."""
import os
import re
import subprocess
import sys

import pytest
from conftest import TIER_MARKERS, TIERS
from helpers import REPO


def test_ci_runs_the_fast_tier_then_every_other():
    with open(os.path.join(REPO, '.ci', 'run'), encoding='utf-8') as handle:
        script = handle.read()
    others = re.search(r'^for tier in ([\w ]+); do$', script, re.MULTILINE).group(1).split()
    assert sorted(others) == sorted(set(TIERS) - {'fast', 'all'})
    assert 'run_tier fast python -m pytest' in script and 'scripts/install_fs.sh' in script


def test_the_tiers_are_the_markers_and_the_unmarked_tests():
    assert set(TIERS) == {'fast', 'all', *TIER_MARKERS}
    assert TIERS['fast'] == ' and '.join(f'not {m}' for m in TIER_MARKERS)


def test_a_test_in_two_tiers_is_refused(tmp_path):
    test_file = tmp_path / 'test_two.py'
    test_file.write_text('import pytest\n\n\n@pytest.mark.slow\n@pytest.mark.bench\n'
                         'def test_x():\n    pass\n')
    done = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                           '--rootdir', str(tmp_path), '-c', os.path.join(REPO, 'pytest.ini'),
                           '--confcutdir', str(tmp_path), '-p', 'conftest', str(test_file)],
                          cwd=os.path.join(REPO, 'tests'), capture_output=True, text=True)
    assert done.returncode != 0
    assert "is marked ['slow', 'bench']: a test is in one tier" in done.stdout + done.stderr


@pytest.mark.parametrize('count', [1, 3])
def test_slowest_tests_reads_junit_reports(tmp_path, count):
    for tier, cases in (('fast', [('tests.test_a', 'test_one', 0.5)]),
                        ('slow', [('tests.test_b', 'test_two[x]', 9.0),
                                  ('tests.test_b', 'test_three', 2.0)])):
        body = ''.join(f'<testcase classname="{c}" name="{n}" time="{t}"/>' for c, n, t in cases)
        (tmp_path / f'{tier}.xml').write_text(f'<testsuites><testsuite>{body}</testsuite></testsuites>')
    done = subprocess.run([sys.executable, os.path.join(REPO, 'scripts', 'slowest_tests.py'), str(count),
                           str(tmp_path / 'fast.xml'), str(tmp_path / 'slow.xml')],
                          capture_output=True, text=True)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and lines[0] == f'The {count} slowest of 3 tests:'
    assert 'slow   tests/test_b.py::test_two[x]' in lines[1] and len(lines) == count + 1

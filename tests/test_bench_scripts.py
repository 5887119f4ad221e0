"""Every scripts/bench_*.py runs with --quick (tiny models, a step or two, results in temporary
folders) and exits 0 having printed a measured number, so a change that breaks a benchmark
fails here and not when someone next needs its numbers. A new bench is covered by its name
alone. A script that sets `NEEDS_FEDERATEDSCOPE = True` is skipped where FederatedScope is not
importable. No timing is asserted."""
import ast
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.bench   # the bench tier
BENCHES = sorted(glob.glob(os.path.join(REPO, 'scripts', 'bench_*.py')))
MEASURED_NUMBER = re.compile(r'\d\.\d')
QUICK_TIMEOUT_S = 600   # a stuck run fails instead of hanging the suite; quick runs take seconds


def needs_federatedscope(path: str) -> bool:
    """The script's module-level `NEEDS_FEDERATEDSCOPE` (False when it sets none)."""
    with open(path, encoding='utf-8') as handle:
        tree = ast.parse(handle.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == 'NEEDS_FEDERATEDSCOPE'
                for target in node.targets):
            return bool(ast.literal_eval(node.value))
    return False


def test_benches_are_found():
    assert len(BENCHES) >= 10, BENCHES


@pytest.mark.parametrize('path', BENCHES, ids=os.path.basename)
def test_bench_runs_in_quick_mode(path):
    if needs_federatedscope(path) and importlib.util.find_spec('federatedscope') is None:
        pytest.skip(f'{os.path.basename(path)} needs FederatedScope, which is not importable here')
    env = dict(os.environ, OMP_NUM_THREADS='1', TQDM_DISABLE='1',
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get('PYTHONPATH')])))
    done = subprocess.run([sys.executable, path, '--quick'], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=QUICK_TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f'{os.path.basename(path)} --quick exited {done.returncode}:\n' \
                                 f'{output[-4000:]}'
    assert MEASURED_NUMBER.search(done.stdout), f'no measured number printed:\n{output[-4000:]}'

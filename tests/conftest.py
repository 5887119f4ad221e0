import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # toy_methods, helpers
from helpers import HAVE_FS, NO_FS_REASON  # noqa: E402

# fsplug.threads' auto count follows the machine's load, and a float sum's order follows the
# thread count: the tests fix it (subprocesses inherit it), so comparisons of runs stay exact
os.environ.setdefault('OMP_NUM_THREADS', '1')

# `-m quick`: a few fast tests through torch, transformers, peft (target_parameters on fused
# MoE experts, a tiny embedded round) and datasets, run under the declared minimum versions by
# scripts/check_min_versions.sh. Tests in tests/test_method_defaults.py carry the marker
# themselves; these of other files get it here.
QUICK_TESTS = (
    'test_flame.py::test_router_gets_no_lora_and_every_expert_does',
    'test_flame.py::test_split_gate_up_keeps_the_forward_and_peft_wraps_each_projection',
    'test_glue.py::test_parquet_and_saved_dataset_dict',
    'test_every_method.py::test_tiny_yaml_runs[fedavg-bfloat16]',
    'test_artifacts.py::test_peft_loads_a_plain_lora_client_folder',
    'test_fed_a2_vera.py::test_tiny_vera_run_of_ffa',
)


# The tiers (pytest.ini declares the markers; docs/development.md their budgets): each test is in
# exactly one, by its marker; `fast` holds the unmarked tests.
TIER_MARKERS = ('slow', 'fs', 'bench')
TIERS = {'fast': 'not slow and not fs and not bench', 'slow': 'slow', 'fs': 'fs', 'bench': 'bench',
         'all': ''}


def pytest_addoption(parser):
    parser.addoption('--tier', choices=sorted(TIERS), default=None,
                     help='the test tier to run (default: fast, unless -m or a test id selects)')


def pytest_configure(config):
    """The tier becomes pytest's own marker expression (-m): `--tier`, else the fast tier
    unless -m or a test id (file.py::name) already selects."""
    tier = config.getoption('tier')
    chosen = config.getoption('markexpr') or any('::' in arg for arg in config.args)
    if tier or not chosen:
        config.option.markexpr = TIERS[tier or 'fast']


def pytest_collection_modifyitems(config, items):
    for item in items:
        if f'{item.path.name}::{item.name}' in QUICK_TESTS:
            item.add_marker(pytest.mark.quick)
        tiers = [m for m in TIER_MARKERS if item.get_closest_marker(m)]
        if len(tiers) > 1:
            raise pytest.UsageError(f'{item.nodeid} is marked {tiers}: a test is in one tier')
        if tiers == ['fs'] and not HAVE_FS:
            item.add_marker(pytest.mark.skip(reason=NO_FS_REASON))


@pytest.fixture(scope='session', autouse=True)
def asset_cache(tmp_path_factory):
    """Tiny model + tokenizer built offline once per session into a private cache."""
    cache = os.environ.get('FSPLUG_TEST_CACHE') or str(tmp_path_factory.mktemp('fsplug_cache'))
    os.environ['FSPLUG_CACHE'] = cache
    from fs_plugins.models.tiny import ensure_tiny_llama
    ensure_tiny_llama()
    return cache


@pytest.fixture(scope='session')
def reference_runs(tmp_path_factory, asset_cache):
    """Each method's reference run, shared by the suites that check a finished run
    (tests/shared_runs.py)."""
    from shared_runs import ReferenceRuns
    return ReferenceRuns(str(tmp_path_factory.mktemp('reference_runs')))


@pytest.fixture(autouse=True)
def plugin_logger_as_it_was():
    """A run through FS in the test's process routes the 'fs_plugins' logger to FS's handlers
    and stops its propagation (fs_plugins.fs.logs); put it back, so that later tests' caplog
    (a root handler) still sees the plugin's lines."""
    logger = logging.getLogger('fs_plugins')
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


def frozen_base_fingerprints() -> dict:
    """A sample of every frozen base tensor this process shares between models
    (fs_plugins.models.builders' cache): 64 evenly spaced values of each."""
    from fs_plugins.models.builders import _FROZEN_CACHE
    prints = {}
    for key, tensors in _FROZEN_CACHE.items():
        for name, tensor in tensors.items():
            flat = tensor.detach().reshape(-1)
            prints[(key, name)] = flat[::max(1, flat.numel() // 64)].double().sum().item()
    return prints


@pytest.fixture(autouse=True)
def shared_frozen_base_unchanged(request):
    """No test may change the frozen base tensors that every later model of the process shares:
    a change would silently alter the numbers of every later run in the process."""
    before = frozen_base_fingerprints()
    yield
    after = frozen_base_fingerprints()
    changed = sorted(f'{key[1] or key[0]}: {name}' for (key, name), value in before.items()
                     if after.get((key, name), value) != value)
    assert not changed, f'{request.node.nodeid} changed shared frozen base tensors: {changed[:5]}'

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # toy_methods, helpers
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
    'test_every_method.py::test_tiny_yaml_runs_one_round[fedavg-bfloat16]',
    'test_artifacts.py::test_peft_loads_a_plain_lora_client_folder',
    'test_fed_a2_vera.py::test_tiny_vera_run_of_ffa',
)


def pytest_configure(config):
    config.addinivalue_line('markers', 'quick: a few fast tests for scripts/check_min_versions.sh')


def pytest_collection_modifyitems(config, items):
    for item in items:
        if f'{item.path.name}::{item.name}' in QUICK_TESTS:
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope='session', autouse=True)
def asset_cache(tmp_path_factory):
    """Tiny model + tokenizer built offline once per session into a private cache."""
    cache = os.environ.get('FSPLUG_TEST_CACHE') or str(tmp_path_factory.mktemp('fsplug_cache'))
    os.environ['FSPLUG_CACHE'] = cache
    from fs_plugins.models.tiny import ensure_tiny_llama
    ensure_tiny_llama()
    return cache

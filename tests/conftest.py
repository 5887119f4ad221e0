import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # toy_methods, helpers


@pytest.fixture(scope='session', autouse=True)
def asset_cache(tmp_path_factory):
    """Tiny model + tokenizer built offline once per session into a private cache."""
    cache = os.environ.get('FSPLUG_TEST_CACHE') or str(tmp_path_factory.mktemp('fsplug_cache'))
    os.environ['FSPLUG_CACHE'] = cache
    from fs_plugins.models.tiny import ensure_tiny_llama
    ensure_tiny_llama()
    return cache

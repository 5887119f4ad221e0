"""One naming rule for methods and their YAML folders (docs/adding_a_method.md):

- a method id is lower snake_case (`[a-z][a-z0-9_]*`), the paper's name without punctuation;
- `yamls/<id>/` is that method's folder: it holds `tiny.yaml`, which runs the method
  (`fsplug.method: <id>`), and the method's paper experiments (which may run its baselines);
- any other folder of `yamls/` is a benchmark harness named for its data: every YAML in it
  reads `data.type: <folder>…`, and the method comes from the command line or the YAML;
- `yamls/fs_llm/` holds FS-LLM's own baseline YAMLs plus `fsplug.method`
  (`<FS-LLM dataset>_<method id>.yaml`, docs/fs_llm.md)."""
import os
import re

import pytest
import yaml
from helpers import FS_ONLY_YAMLS, REPO

from fs_plugins.methods.registry import all_methods

YAMLS = os.path.join(REPO, 'yamls')
METHOD_ID = re.compile(r'[a-z][a-z0-9_]*')


def _read(path):
    with open(path, encoding='utf-8') as handle:
        return yaml.safe_load(handle) or {}


def _package_methods():
    """The shipped methods (test-only methods registered by other test modules left out)."""
    return sorted(name for name, cls in all_methods().items() if cls.__module__.startswith('fs_plugins.'))


@pytest.mark.parametrize('name', _package_methods())
def test_method_id_and_its_folder(name):
    assert METHOD_ID.fullmatch(name), f"method id '{name}' is not lower snake_case"
    tiny = os.path.join(YAMLS, name, 'tiny.yaml')
    assert os.path.isfile(tiny), f'method {name} has no yamls/{name}/tiny.yaml'
    assert (_read(tiny).get('fsplug') or {}).get('method') == name, f'{tiny} runs another method'


@pytest.mark.parametrize('folder', sorted(d for d in os.listdir(YAMLS) if os.path.isdir(os.path.join(YAMLS, d))))
def test_every_yaml_folder_is_a_method_or_a_benchmark(folder):
    if folder in all_methods() or os.path.join('yamls', folder) == FS_ONLY_YAMLS:
        return
    files = [f for f in sorted(os.listdir(os.path.join(YAMLS, folder))) if f.endswith('.yaml')]
    assert files, f'yamls/{folder}/ is neither a method id nor a benchmark harness with YAMLs'
    for name in files:
        data_type = str((_read(os.path.join(YAMLS, folder, name)).get('data') or {}).get('type', ''))
        assert data_type.startswith(folder), (
            f"yamls/{folder}/{name}: a folder that is not a method id is a benchmark harness named "
            f"for its data, but data.type is '{data_type}'")


@pytest.mark.parametrize('name', sorted(os.listdir(os.path.join(REPO, FS_ONLY_YAMLS))))
def test_fs_llm_yamls_name_their_method(name):
    method = _read(os.path.join(REPO, FS_ONLY_YAMLS, name))['fsplug']['method']
    assert name.endswith(f'_{method}.yaml') and method in _package_methods(), name

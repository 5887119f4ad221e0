"""OLMoE (sparse mixture-of-experts) models: a tiny random one built offline for tests and the
demo, random ones of any size for benchmarks, and a check for real checkpoints.

In transformers 5 an OLMoE MoE block (`mlp`) is a router `mlp.gate` (OlmoeTopKRouter, plain
`weight` parameter, `top_k` attribute read at every forward) and fused experts `mlp.experts`
with 3-D parameters `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]. LoRA reaches every
expert through peft's `target_parameters` (see EXPERT_LORA_PARAMETERS)."""
from __future__ import annotations

import os
import shutil
import tempfile

import torch

from fs_plugins.models.cache import cache_dir
from fs_plugins.models.tiny import build_tokenizer

# fsplug.model.lora.target_parameters for LoRA on every expert of every MoE layer
EXPERT_LORA_PARAMETERS = ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']

# top-8 of 16 experts, so FLAME's budget levels k_i = 8, 4, 2, 1 all apply
TINY_OLMOE_CONFIG = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, num_experts=16,
                         num_experts_per_tok=8, max_position_embeddings=512,
                         # as the tiny Llama: a wider init so the frozen random head can be confident
                         initializer_range=0.2)
TINY_OLMOE_DIR_NAME = 'tiny-olmoe-v1'

# OLMoE-1B-7B's dimensions (allenai/OLMoE-1B-7B-0924 config.json)
OLMOE_1B_7B_DIMS = dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=1024,
                        num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                        num_experts_per_tok=8, vocab_size=50304)


def random_olmoe(seed: int = 1234, **dims):
    """An OlmoeForCausalLM with random weights and the given config fields."""
    from transformers import OlmoeConfig, OlmoeForCausalLM
    config = OlmoeConfig(**dims)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return OlmoeForCausalLM(config)


def build_tiny_olmoe_dir(path: str, seed: int = 1234) -> None:
    tokenizer = build_tokenizer()
    model = random_olmoe(seed, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False, **TINY_OLMOE_CONFIG)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def ensure_tiny_olmoe(path: str | None = None) -> str:
    """Directory of the tiny OLMoE, built there first if needed (atomically)."""
    path = path or os.path.join(cache_dir(), TINY_OLMOE_DIR_NAME)
    if os.path.isfile(os.path.join(path, 'config.json')):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix='.tiny-olmoe-')
    try:
        build_tiny_olmoe_dir(tmp)
        try:
            os.rename(tmp, path)  # another process may have won the race
        except OSError:
            if not os.path.isfile(os.path.join(path, 'config.json')):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def check_olmoe(model, path: str) -> None:
    if getattr(model.config, 'model_type', None) != 'olmoe':
        raise ValueError(f"fsplug.model.builder = 'olmoe' needs an OLMoE checkpoint; '{path}' "
                         f"(model.type) is a '{getattr(model.config, 'model_type', '?')}' model")

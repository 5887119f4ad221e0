"""A tiny random Llama and a tokenizer trained locally: offline assets for tests and the demo.

Built once into a cache directory, deterministically (fixed seed), so every process and both
runners load identical weights."""
from __future__ import annotations

import torch

from fs_plugins.core.cache import ensure_cached_dir
from fs_plugins.data.builtin import tiny_tasks_records
from fs_plugins.data.instruction import ALPACA_NO_INPUT, ALPACA_WITH_INPUT

TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                   # larger than Llama's 0.02 so the frozen random head can express confident
                   # predictions; with 0.02 the logits stay nearly flat whatever LoRA learns
                   initializer_range=0.2)
# bump when TINY_CONFIG or the tokenizer corpus changes, so stale caches are not reused
TINY_DIR_NAME = 'tiny-llama-v2'
# a second tiny architecture with the same tokenizer but a different width and depth, for
# federations of heterogeneous models (FedMosaic); `tiny_llama` builder path 'tiny-llama-large'
TINY_LARGE_CONFIG = {**TINY_CONFIG, 'hidden_size': 96, 'intermediate_size': 192,
                     'num_hidden_layers': 4}
TINY_LARGE_DIR_NAME = 'tiny-llama-large-v1'
SPECIAL_TOKENS = {'bos_token': '<s>', 'eos_token': '</s>', 'pad_token': '<pad>', 'unk_token': '<unk>'}


def _corpus() -> list[str]:
    texts = [ALPACA_WITH_INPUT, ALPACA_NO_INPUT]
    for rec in tiny_tasks_records(per_category=200, seed=1):
        texts.append(' '.join([rec['instruction'], rec['input'], rec['output']]))
    return texts


def train_byte_bpe(corpus, vocab_size: int, special_tokens: dict, add_prefix_space: bool):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus` (texts), with
    `special_tokens` (name -> token, including 'unk_token') first in its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token=special_tokens['unk_token']))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def build_tokenizer(vocab_size: int = 400):
    from transformers import PreTrainedTokenizerFast
    tok = train_byte_bpe(_corpus(), vocab_size, SPECIAL_TOKENS, add_prefix_space=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


def build_tiny_llama_dir(path: str, seed: int = 1234, dims: dict = TINY_CONFIG) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False, **dims)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def ensure_tiny_llama(path: str | None = None) -> str:
    """Returns the directory of the tiny model, building it there first if needed."""
    return ensure_cached_dir(path, build_tiny_llama_dir, TINY_DIR_NAME)


def ensure_tiny_llama_large(path: str | None = None) -> str:
    """The directory of the wider, deeper tiny Llama (TINY_LARGE_CONFIG), built there if needed."""
    return ensure_cached_dir(path, lambda folder: build_tiny_llama_dir(folder, 1235, TINY_LARGE_CONFIG),
                             TINY_LARGE_DIR_NAME)

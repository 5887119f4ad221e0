"""Library adapters made here, for tests and the tiny demo: two seeded random LoRA adapters
(`tiny-a`: r = 4 on q, v, up; `tiny-b`: r = 4 on q, v, down) for the tiny Llama, saved by peft
as ordinary adapter folders. Different target sets on purpose: a matrix's expert pool holds
the adapters that target it."""
from __future__ import annotations

import torch

from fs_plugins.core.cache import ensure_cached_dir
from fs_plugins.models.tiny import ensure_tiny_llama

TINY_LIBRARY = {'tiny-a': (11, ['q_proj', 'v_proj', 'up_proj']),
                'tiny-b': (12, ['q_proj', 'v_proj', 'down_proj'])}
TINY_RANK, TINY_ALPHA = 4, 8
LIBRARY_VERSION = 'v1'   # bump when the builtin adapters change


def build_tiny_adapter(folder: str, seed: int, targets: list[str]) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama())
    config = LoraConfig(r=TINY_RANK, lora_alpha=TINY_ALPHA, target_modules=targets,
                        init_lora_weights=False, task_type='CAUSAL_LM')
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(base, config)
        with torch.no_grad():   # peft's non-init draws are large for a random base; tame them
            for name, param in model.named_parameters():
                if 'lora_' in name:
                    param.mul_(0.5)
    model.save_pretrained(folder)


def _tiny(name: str):
    seed, targets = TINY_LIBRARY[name]
    return lambda: ensure_cached_dir(None, lambda f: build_tiny_adapter(f, seed, targets),
                                     f'library-{name}-{LIBRARY_VERSION}', marker='adapter_config.json')


BUILTIN_ADAPTERS = {name: _tiny(name) for name in TINY_LIBRARY}

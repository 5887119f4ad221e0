"""OLMoE (sparse mixture-of-experts) models: a tiny random one built offline for tests and the
demo, random ones of any size for benchmarks, and a check for real checkpoints.

In transformers 5 an OLMoE MoE block (`mlp`) is a router `mlp.gate` (OlmoeTopKRouter, plain
`weight` parameter, `top_k` attribute read at every forward) and fused experts `mlp.experts`
with 3-D parameters `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]. LoRA reaches every
expert through peft's `target_parameters` (see EXPERT_LORA_PARAMETERS).

FLAME's placement (paper Table 1: separate LoRA on the gate, up and down projection of every
expert, PAPER_EXPERT_LORA_PARAMETERS) needs the fused `gate_up_proj` split: one LoRA on the
fused [E, 2I, H] tensor shares lora_A between gate and up, which is not two LoRAs.
`split_expert_gate_up` turns every OLMoE experts module into one with separate `gate_proj`
and `up_proj` parameters [E, I, H] and a read-only `gate_up_proj` (their concatenation along
dim 1), so transformers' forwards (eager, batched, grouped) run unchanged and peft wraps each
projection on its own. The OLMoE builders split when the LoRA targets name gate or up
(`split_wanted`)."""
from __future__ import annotations

import torch

from fs_plugins.core.cache import ensure_cached_dir
from fs_plugins.models.tiny import build_tokenizer

# fsplug.model.lora.target_parameters for LoRA on every expert of every MoE layer (fused gate/up)
EXPERT_LORA_PARAMETERS = ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']
# the paper's placement (Table 1 / A1.2): gate, up and down of every expert, each its own LoRA,
# plus attention (target_modules)
PAPER_EXPERT_LORA_PARAMETERS = ['mlp.experts.gate_proj', 'mlp.experts.up_proj',
                                'mlp.experts.down_proj']
PAPER_ATTENTION_LORA_MODULES = ['q_proj', 'k_proj', 'v_proj', 'o_proj']
SPLIT_NAMES = ('gate_proj', 'up_proj')

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


def random_causal_lm(config_name: str, model_name: str, seed: int = 1234, **dims):
    """transformers' `model_name` with random weights from `config_name`(**dims), seeded."""
    import transformers
    config = getattr(transformers, config_name)(**dims)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return getattr(transformers, model_name)(config)


def random_olmoe(seed: int = 1234, **dims):
    """An OlmoeForCausalLM with random weights and the given config fields."""
    return random_causal_lm('OlmoeConfig', 'OlmoeForCausalLM', seed, **dims)


def build_tiny_dir(path: str, random_model, dims: dict, seed: int = 1234) -> None:
    """A tiny random model (`random_model(seed, **config)`) with the offline tokenizer, saved."""
    tokenizer = build_tokenizer()
    model = random_model(seed, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False, **dims)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def build_tiny_olmoe_dir(path: str, seed: int = 1234) -> None:
    build_tiny_dir(path, random_olmoe, TINY_OLMOE_CONFIG, seed)


def ensure_tiny_olmoe(path: str | None = None) -> str:
    """Directory of the tiny OLMoE, built there first if needed (atomically)."""
    return ensure_cached_dir(path, build_tiny_olmoe_dir, TINY_OLMOE_DIR_NAME)


def check_olmoe(model, path: str) -> None:
    if getattr(model.config, 'model_type', None) != 'olmoe':
        raise ValueError(f"fsplug.model.builder = 'olmoe' needs an OLMoE checkpoint; '{path}' "
                         f"(model.type) is a '{getattr(model.config, 'model_type', '?')}' model")


# ------------------------------------------------------------ separate gate / up expert tensors
def split_wanted(target_parameters) -> bool:
    """Whether LoRA targets (fsplug.model.lora.target_parameters) name the experts' separate
    gate or up projection ('mlp.experts.gate_proj', '….experts.up_proj')."""
    return any(str(t).rsplit('.', 2)[-2:] in (['experts', n] for n in SPLIT_NAMES)
               for t in target_parameters)


def _gate_up_proj(self) -> torch.Tensor:
    # [E, 2I, H]: what transformers' expert forwards read; built from the (possibly
    # peft-parametrised) separate tensors at every access
    return torch.cat((self.gate_proj, self.up_proj), dim=1)


_SPLIT_CLASSES: dict[type, type] = {}


def _split_class(cls: type) -> type:
    if cls not in _SPLIT_CLASSES:
        _SPLIT_CLASSES[cls] = type(f'SplitGateUp{cls.__name__}', (cls,),
                                   {'gate_up_proj': property(_gate_up_proj),
                                    'fsplug_merge_restores': True,   # fuse_expert_gate_up
                                    '__module__': __name__})
    return _SPLIT_CLASSES[cls]


def split_expert_gate_up(model: torch.nn.Module) -> int:
    """Replaces every fused experts module's `gate_up_proj` [E, 2I, H] by separate
    `gate_proj` and `up_proj` parameters [E, I, H] (same values, same dtype and device) and a
    read-only `gate_up_proj` property; returns how many modules were split. Call before peft."""
    count = 0
    for module in list(model.modules()):
        fused = module._parameters.get('gate_up_proj')
        if fused is None or fused.dim() != 3 or getattr(module, 'is_transposed', False):
            continue
        if not getattr(module, 'is_concatenated', True) or fused.shape[1] % 2:
            raise ValueError(f'{type(module).__name__}: gate_up_proj {tuple(fused.shape)} is not '
                             f'a concatenated [gate; up] layout')
        width = fused.shape[1] // 2
        gate = torch.nn.Parameter(fused.data[:, :width].clone(), requires_grad=fused.requires_grad)
        up = torch.nn.Parameter(fused.data[:, width:].clone(), requires_grad=fused.requires_grad)
        del module._parameters['gate_up_proj']
        module.__class__ = _split_class(type(module))
        module.register_parameter('gate_proj', gate)
        module.register_parameter('up_proj', up)
        count += 1
    return count


def fuse_expert_gate_up(model: torch.nn.Module) -> int:
    """The inverse of `split_expert_gate_up` (for a model without LoRA on the split tensors,
    e.g. after merge_and_unload): transformers' own class and fused `gate_up_proj` back, so
    the model saves in the layout transformers loads. Returns how many modules were fused."""
    originals = {split: cls for cls, split in _SPLIT_CLASSES.items()}
    count = 0
    for module in list(model.modules()):
        original = originals.get(type(module))
        if original is None:
            continue
        gate, up = module._parameters.pop('gate_proj'), module._parameters.pop('up_proj')
        module.__class__ = original
        module.register_parameter('gate_up_proj', torch.nn.Parameter(
            torch.cat((gate.data, up.data), dim=1), requires_grad=gate.requires_grad))
        count += 1
    return count


def prepare_olmoe(model: torch.nn.Module, target_parameters) -> torch.nn.Module:
    """What the OLMoE builders do after loading: split gate/up when the LoRA targets ask."""
    if split_wanted(target_parameters) and not split_expert_gate_up(model):
        raise ValueError('fsplug.model.lora.target_parameters names experts.gate_proj / '
                         'up_proj but the model has no fused gate_up_proj to split')
    return model


def router_of(block) -> torch.nn.Module:
    """The router of an MoE block, under any peft wrappers (LoRA on `mlp.gate.weight`)."""
    router = getattr(block, 'gate', None)
    while router is not None and not hasattr(router, 'top_k') and hasattr(router, 'base_layer'):
        router = router.base_layer
    return router


def moe_blocks(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every sparse MoE block: a `gate` router with `top_k` and `experts`."""
    return [(name, module) for name, module in model.named_modules()
            if hasattr(module, 'experts') and hasattr(router_of(module), 'top_k')]


def _total_and_active(model: torch.nn.Module, top_k: int, selected) -> tuple[int, int]:
    experts = {name: int(router_of(m).num_experts) for name, m in moe_blocks(model)}
    total = active = 0
    for name, param in model.named_parameters():
        if not selected(name, param):
            continue
        total += param.numel()
        block = name.split('.experts.')[0] if '.experts.' in name else None
        if block in experts:    # E experts stacked: k of them run per token
            active += param.numel() * min(top_k, experts[block]) // experts[block]
        else:
            active += param.numel()
    return total, active


def lora_parameter_counts(model: torch.nn.Module, top_k: int) -> tuple[int, int]:
    """(total, active) trainable LoRA parameters of a peft model (paper Table 1's P̂ and P̂_a):
    a fused expert factor (E experts' factors stacked, peft target_parameters) counts k/E of
    its elements as active — k experts are selected per token; every other LoRA factor is
    always active. Works on a model built on the meta device."""
    return _total_and_active(model, top_k, lambda n, p: p.requires_grad and 'lora_' in n)


def base_parameter_counts(model: torch.nn.Module, top_k: int) -> tuple[int, int]:
    """(total, active) frozen base parameters (Table 1's P and P_a), experts counted as above."""
    return _total_and_active(model, top_k, lambda n, p: 'lora_' not in n)

"""Vision-language builders: LLaVA (LlavaForConditionalGeneration) and Qwen2-VL
(Qwen2VLForConditionalGeneration) from a local path or hub id, and tiny random versions of both
built offline for tests. LoRA goes on the language model only (`lora_scope`); the projector
trains unless fsplug.model.vision.train_projector is off, the vision tower only with train_tower.
"""
from __future__ import annotations

import logging

import torch

from fs_plugins.core.cache import ensure_cached_dir
from fs_plugins.models.builders import LoadedBase, from_pretrained, load_weights, register_builder
from fs_plugins.models.codecs import LLAVA15_PROMPT, LLAVA_IMAGE, QWEN2VL_IMAGE, QWEN2VL_PROMPT, MultimodalCodec
from fs_plugins.models.tiny import build_tokenizer
from fs_plugins.schema.specs import ModelSpec

logger = logging.getLogger(__name__)

LANGUAGE_MODEL = 'language_model'
LLAVA_SWITCHES = {'train_projector': 'multi_modal_projector', 'train_tower': 'vision_tower'}
QWEN2VL_SWITCHES = {'train_projector': 'visual.merger', 'train_tower': 'visual.'}
QWEN2VL_SPECIAL = ['<|im_start|>', '<|im_end|>', '<|vision_start|>', '<|image_pad|>',
                   '<|vision_end|>', '<|video_pad|>']


class Qwen2VLImageTextProcessor:
    """Qwen2-VL's image + text processing without its video processor (transformers builds
    that only with torchvision): each <|image_pad|> becomes grid_t·grid_h·grid_w / merge²
    image tokens, and mm_token_type_ids marks them."""

    def __init__(self, image_processor, tokenizer):
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.image_token = '<|image_pad|>'
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)

    def __call__(self, images, text, return_tensors='pt'):
        pixels = self.image_processor(images=images, return_tensors='pt')
        counts = (pixels['image_grid_thw'].prod(-1) // self.image_processor.merge_size ** 2).tolist()
        expanded, start = [], 0
        for prompt in text:
            pieces = prompt.split(self.image_token)
            out = pieces[0]
            for piece, count in zip(pieces[1:], counts[start:]):
                out += self.image_token * int(count) + piece
            start += len(pieces) - 1
            expanded.append(out)
        ids = self.tokenizer(expanded, return_tensors='pt')['input_ids']
        return {'input_ids': ids, 'attention_mask': torch.ones_like(ids),
                'mm_token_type_ids': (ids == self.image_token_id).long(),
                'pixel_values': pixels['pixel_values'], 'image_grid_thw': pixels['image_grid_thw']}


def llava_codec(spec: ModelSpec, processor) -> MultimodalCodec:
    return MultimodalCodec(processor, LLAVA15_PROMPT, LLAVA_IMAGE, processor.tokenizer.eos_token,
                           int(spec.max_tokens))


def qwen2vl_codec(spec: ModelSpec, processor) -> MultimodalCodec:
    return MultimodalCodec(processor, QWEN2VL_PROMPT, QWEN2VL_IMAGE, '<|im_end|>',
                           int(spec.max_tokens), answer_prefix='')


def _with_pad_token(processor):
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


@register_builder('llava')
def load_llava(spec: ModelSpec, path: str) -> LoadedBase:
    """LlavaForConditionalGeneration + its processor (e.g. llava-hf/llava-1.5-7b-hf)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    processor = _with_pad_token(from_pretrained(AutoProcessor, path, spec))
    model = load_weights(LlavaForConditionalGeneration, path, spec)
    return LoadedBase(model, llava_codec(spec, processor), LANGUAGE_MODEL, LLAVA_SWITCHES)


def _qwen2vl_processor(path: str, spec: ModelSpec):
    from transformers import AutoProcessor, AutoTokenizer
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil
    try:
        return from_pretrained(AutoProcessor, path, spec)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0]
        logger.warning(f"Qwen2-VL's own processor is unavailable ({reason}); using the image "
                       f"+ text processor of fs_plugins (images only, no video)")
        return Qwen2VLImageTextProcessor(from_pretrained(Qwen2VLImageProcessorPil, path, spec),
                                         from_pretrained(AutoTokenizer, path, spec))


@register_builder('qwen2_vl')
def load_qwen2_vl(spec: ModelSpec, path: str) -> LoadedBase:
    """Qwen2VLForConditionalGeneration + its processor (e.g. Qwen/Qwen2-VL-7B-Instruct)."""
    from transformers import Qwen2VLForConditionalGeneration
    processor = _with_pad_token(_qwen2vl_processor(path, spec))
    model = load_weights(Qwen2VLForConditionalGeneration, path, spec)
    return LoadedBase(model, qwen2vl_codec(spec, processor), LANGUAGE_MODEL, QWEN2VL_SWITCHES)


# ------------------------------------------------------------------ tiny random versions
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                 initializer_range=0.2)


def build_tiny_llava_dir(path: str, seed: int = 1234) -> None:
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({'additional_special_tokens': ['<image>']})
    text = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       tie_word_embeddings=False, **TINY_TEXT)
    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=2)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_id=tokenizer.convert_tokens_to_ids('<image>'),
                         vision_feature_select_strategy='default', vision_feature_layer=-1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    image_processor = CLIPImageProcessor(size={'shortest_edge': 32},
                                         crop_size={'height': 32, 'width': 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy='default',
                               num_additional_image_tokens=1, image_token='<image>')
    model.save_pretrained(path)
    processor.save_pretrained(path)


def build_tiny_qwen2vl_dir(path: str, seed: int = 1234) -> None:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({'additional_special_tokens': QWEN2VL_SPECIAL})
    token_id = tokenizer.convert_tokens_to_ids
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, initializer_range=0.2,
                rope_scaling={'type': 'mrope', 'mrope_section': [2, 2, 4]},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, in_chans=3, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision,
                           image_token_id=token_id('<|image_pad|>'),
                           video_token_id=token_id('<|video_pad|>'),
                           vision_start_token_id=token_id('<|vision_start|>'),
                           vision_end_token_id=token_id('<|vision_end|>'))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56).save_pretrained(path)


def _tiny_dir(path: str, builder: str, cache_name: str, build) -> str:
    """model.type '' or the builder's name: the cache folder; anything else: that folder."""
    if path in ('', builder, builder.replace('_', '-')):
        return ensure_cached_dir(None, build, cache_name)
    return ensure_cached_dir(path, build)


@register_builder('tiny_llava')
def load_tiny_llava(spec: ModelSpec, path: str) -> LoadedBase:
    return load_llava(spec, _tiny_dir(path, 'tiny_llava', 'tiny-llava-v1', build_tiny_llava_dir))


@register_builder('tiny_qwen2_vl')
def load_tiny_qwen2_vl(spec: ModelSpec, path: str) -> LoadedBase:
    return load_qwen2_vl(spec, _tiny_dir(path, 'tiny_qwen2_vl', 'tiny-qwen2-vl-v1',
                                        build_tiny_qwen2vl_dir))

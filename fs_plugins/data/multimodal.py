"""Normalised multimodal records: one JSON object per line,

    {"id": str, "image": path | [path, ...], "audio": path, "question": str, "answer": str,
     "task": "vqa" | "report" | "detection" | ..., "source": str, "split": "train" | "test"}

A record carries at least one media field (MEDIA_FIELDS: "image" for every multimodal builder,
"audio" for encoder + LLM models such as `imagebind_vicuna`); "question" may be '' when the
question is in the audio. Media paths are relative to the JSONL file's folder or absolute; extra
fields are kept (e.g. "answers", a list of acceptable VQA answers). `benchmarks_ext/*/prepare.py`
write this format.
"""
from __future__ import annotations

import json
import os

from fs_plugins.data.record_files import FileRecords, is_json_lines, short

REQUIRED_FIELDS = ('question', 'answer')
# record fields holding media file paths, and the word used for them in errors
MEDIA_FIELDS = {'image': 'Image', 'audio': 'Audio'}


def is_multimodal(record: dict) -> bool:
    return (isinstance(record, dict) and 'question' in record
            and any(f in record for f in MEDIA_FIELDS))


def media_paths(record: dict, media: str) -> list[str]:
    """The record's file paths in media field `media` ([] when it has none)."""
    paths = record.get(media) or []
    return [paths] if isinstance(paths, str) else list(paths)


def image_paths(record: dict) -> list[str]:
    return media_paths(record, 'image')


def _record_name(records: FileRecords, index: int) -> str:
    record_id = records[index].get('id', index)
    return f'record {record_id!s} ({records.position(index)} of {records.path})'


def check_multimodal_record(records: FileRecords, index: int) -> None:
    """Its question and answer are strings, its media fields paths (a string or a list)."""
    record = records[index]
    missing = [k for k in REQUIRED_FIELDS if k not in record]
    if not any(record.get(f) for f in MEDIA_FIELDS):
        missing.append(' or '.join(MEDIA_FIELDS))
    if missing:
        raise records.error(index, f'lacks field(s) {missing}',
                            "a media record needs 'question', 'answer' and 'image' or 'audio'")
    for name in REQUIRED_FIELDS:
        if not isinstance(record[name], str):
            raise records.error(index, f"has '{name}' = {short(record[name])}",
                                f"write it in quotes ('{name}' must be a string)")
    for media in MEDIA_FIELDS:
        paths = record.get(media) or []
        if isinstance(paths, str) or (isinstance(paths, list)
                                      and all(isinstance(p, str) for p in paths)):
            continue
        raise records.error(index, f"has '{media}' = {short(paths)}",
                            f"'{media}' must be a file path or a list of file paths")


def resolve_images(records: list[dict], path: str | None = None) -> list[dict]:
    """Checks the required fields and makes image paths absolute; a missing image file
    raises naming the file and the record. `records`: a FileRecords, or a file's records (one
    per line of a .jsonl `path`) as a list."""
    if not isinstance(records, FileRecords):
        lines = list(range(1, len(records) + 1)) if is_json_lines(path) else None
        records = FileRecords(records, path, lines)
    folder = os.path.dirname(os.path.abspath(records.path))
    resolved = []
    for index, record in enumerate(records):
        check_multimodal_record(records, index)
        record = with_absolute_images(record, folder, _record_name(records, index))
        resolved.append({**record, 'id': str(record.get('id', index))})
    return resolved


def with_absolute_images(record: dict, folder: str, where: str) -> dict:
    """The record with its media paths (image, audio) made absolute (relative ones are under
    `folder`); a missing file raises naming it and `where` (the record)."""
    record = dict(record)
    for media, word in MEDIA_FIELDS.items():
        if not record.get(media):
            continue
        paths = [p if os.path.isabs(p) else os.path.join(folder, p)
                 for p in media_paths(record, media)]
        for path in paths:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{word} file not found: {path} ({where})")
        record[media] = paths[0] if isinstance(record[media], str) else paths
    return record


def open_images(record: dict) -> list:
    """The record's images as RGB PIL images; an unreadable file raises naming it."""
    from PIL import Image, UnidentifiedImageError
    opened = []
    for path in image_paths(record):
        try:
            with Image.open(path) as image:
                opened.append(image.convert('RGB'))
        except (OSError, UnidentifiedImageError) as exc:
            raise ValueError(f"Cannot read image {path} of record {record.get('id')}: "
                             f"{exc}") from exc
    return opened


class ChoiceReference(str):
    """A reference answer (the str itself) with its record's answer options, for a metric that
    scores the chosen option (fs_plugins.metrics.choice_tokens); every other metric reads it
    as the plain answer."""
    choices: tuple[str, ...]

    def __new__(cls, answer: str, choices=()):
        made = super().__new__(cls, answer)
        made.choices = tuple(str(c) for c in choices or ())
        return made


def reference_answer(record: dict):
    """What generation-based metrics compare with: the list of acceptable answers when the
    record has one, else its answer (multimodal) or output (instruction records), with the
    record's `choices` / `options` when it lists them (a ChoiceReference)."""
    if record.get('answers'):
        return list(record['answers'])
    answer = record['answer'] if 'answer' in record else record.get('output', '')
    choices = record.get('choices') or record.get('options')
    return ChoiceReference(answer, choices) if isinstance(choices, (list, tuple)) and choices else answer


def write_jsonl(path: str, records) -> None:
    """Writes records one JSON object per line, atomically (a staging file, then a rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + '.tmp'
    with open(tmp, 'w', encoding='utf-8') as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + '\n')
    os.replace(tmp, path)

"""Instruction records in FS-LLM's JSON / JSONL format, prompts and tokenisation."""
from __future__ import annotations

import json
import os

import torch

from fs_plugins.data.multimodal import is_multimodal, resolve_images

IGNORE_INDEX = -100
# prompt templates of instruction records (fsplug.data.prompt)

# The Alpaca template (with and without input), as FS-LLM and the papers use it.
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def read_record_file(path: str) -> list:
    """The records of a .jsonl (one object per line) or .json (a list) file, unchecked."""
    with open(path, encoding='utf-8') as handle:
        try:
            if path.endswith('.jsonl'):
                records = [json.loads(line) for line in handle if line.strip()]
            elif path.endswith('.json'):
                records = json.load(handle)
            else:
                raise ValueError(f"Data file {path} must end in .json or .jsonl")
        except json.JSONDecodeError as exc:
            raise ValueError(f'Data file {path} is not valid JSON / JSON lines: {exc}') from None
    if not isinstance(records, list):
        raise ValueError(f"Data file {path} must hold a list of records")
    return records


def load_records(path: str) -> list[dict]:
    """Reads a .json (list of objects) or .jsonl file of instruction records (at least
    `instruction` and `output`; `input`, `category` and any other fields are kept) or of
    multimodal records (`fs_plugins.data.multimodal`, image paths made absolute)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Data file not found: {path}")
    records = read_record_file(path)
    if records and is_multimodal(records[0]):
        return resolve_images(records, path)
    for i, rec in enumerate(records):
        missing = [k for k in ('instruction', 'output') if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise ValueError(f"Record {i} of {path} lacks field(s) {missing}")
    return records


def format_prompt(record: dict, template: str) -> str:
    if template == 'plain':
        text = record['instruction']
        return f"{text}\n{record['input']}\n" if record.get('input') else f"{text}\n"
    if record.get('input'):
        return ALPACA_WITH_INPUT.format(instruction=record['instruction'], input=record['input'])
    return ALPACA_NO_INPUT.format(instruction=record['instruction'])


def tokenize_record(record: dict, tokenizer, template: str, max_len: int) -> dict | None:
    """input_ids / labels for one record; loss only on the answer (and EOS).

    Returns None when truncation to `max_len` leaves no answer token."""
    prompt = format_prompt(record, template)
    prompt_ids = tokenizer(prompt, add_special_tokens=True)['input_ids']
    full_ids = tokenizer(prompt + str(record['output']), add_special_tokens=True)['input_ids']
    full_ids = full_ids + [tokenizer.eos_token_id]
    full_ids = full_ids[:max_len]
    labels = list(full_ids)
    n_prompt = min(len(prompt_ids), len(full_ids))
    labels[:n_prompt] = [IGNORE_INDEX] * n_prompt
    if all(t == IGNORE_INDEX for t in labels):
        return None
    return {'input_ids': torch.tensor(full_ids, dtype=torch.long),
            'labels': torch.tensor(labels, dtype=torch.long)}

"""Instruction records in FS-LLM's JSON / JSONL format, prompts and tokenisation."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100

# The Alpaca template (with and without input), as FS-LLM and the papers use it.
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def load_records(path: str) -> list[dict]:
    """Reads a .json (list of objects) or .jsonl file of records with at least
    `instruction` and `output`; `input`, `category` and any other fields are kept."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Data file not found: {path}")
    with open(path, 'r', encoding='utf-8') as handle:
        if path.endswith('.jsonl'):
            records = [json.loads(line) for line in handle if line.strip()]
        elif path.endswith('.json'):
            records = json.load(handle)
        else:
            raise ValueError(f"Data file {path} must end in .json or .jsonl")
    if not isinstance(records, list):
        raise ValueError(f"Data file {path} must hold a list of records")
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


class TokenizedDataset(torch.utils.data.Dataset):
    def __init__(self, examples: list[dict], records: list[dict]):
        self.examples = examples
        self.records = records

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, idx):
        return self.examples[idx]


def tokenize_records(records: list[dict], tokenizer, template: str, max_len: int,
                     where: str) -> TokenizedDataset:
    kept_ex, kept_rec = [], []
    for rec in records:
        example = tokenize_record(rec, tokenizer, template, max_len)
        if example is not None:
            kept_ex.append(example)
            kept_rec.append(rec)
    dropped = len(records) - len(kept_ex)
    if dropped:
        logger.warning(f"{where}: dropped {dropped} record(s) whose answer does not fit in "
                       f"llm.tok_len = {max_len} tokens")
    return TokenizedDataset(kept_ex, kept_rec)


@dataclass
class PadCollator:
    """Right-pads input_ids with the pad id and labels with IGNORE_INDEX."""
    pad_token_id: int

    def __call__(self, examples: list[dict]) -> dict:
        input_ids = torch.nn.utils.rnn.pad_sequence(
            [e['input_ids'] for e in examples], batch_first=True, padding_value=self.pad_token_id)
        labels = torch.nn.utils.rnn.pad_sequence(
            [e['labels'] for e in examples], batch_first=True, padding_value=IGNORE_INDEX)
        lengths = torch.tensor([len(e['input_ids']) for e in examples])
        mask = torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]
        return {'input_ids': input_ids, 'labels': labels, 'attention_mask': mask.long()}

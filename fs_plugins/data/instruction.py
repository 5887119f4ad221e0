"""Instruction records in FS-LLM's JSON / JSONL format, prompts and tokenisation."""
from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import torch

from fs_plugins.core.errors import ConfigError
from fs_plugins.data.multimodal import is_multimodal, resolve_images
from fs_plugins.data.record_files import FileRecords, check_text_fields, read_record_file
from fs_plugins.schema.plugin import RECORD_FIELDS

IGNORE_INDEX = -100
INSTRUCTION_FIELDS = ('instruction', 'output')   # every instruction record has them, as strings
# prompt templates of instruction records (fsplug.data.prompt)

# The Alpaca template (with and without input), as FS-LLM and the papers use it.
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")

# FS-LLM's template (PROMPT_DICT of federatedscope.llm.dataset.llm_dataset): the Alpaca text
# with no newline after "### Response:" (the answer follows it directly).
FS_LLM_WITH_INPUT = ALPACA_WITH_INPUT[:-1]
FS_LLM_NO_INPUT = ALPACA_NO_INPUT[:-1]


@functools.lru_cache(maxsize=1)
def fs_llm_templates() -> tuple[str, str]:
    """(with input, without input) of FS-LLM: its own PROMPT_DICT where FederatedScope is
    installed, else the same text from here."""
    try:
        from federatedscope.llm.dataset.llm_dataset import PROMPT_DICT
    except ImportError:
        return FS_LLM_WITH_INPUT, FS_LLM_NO_INPUT
    return PROMPT_DICT['prompt_input'], PROMPT_DICT['prompt_no_input']


def mapped_value(records: FileRecords, index: int, own_field: str, file_field: str):
    """The value of record `index`'s `file_field`, read as its `own_field` (fsplug.data.fields)."""
    if file_field not in records[index]:
        raise records.error(index, f"lacks field '{file_field}'",
                            f"fsplug.data.fields reads it as '{own_field}': add it to the "
                            'record, or change that entry of fsplug.data.fields')
    return records[index][file_field]


def check_field_names(fields: Mapping[str, str]) -> None:
    unknown = sorted(set(fields) - set(RECORD_FIELDS))
    if unknown:
        raise ConfigError(f"fsplug.data.fields: unknown record field(s) {unknown}; its keys are "
                          f"the plugin's fields ({', '.join(RECORD_FIELDS)}), its values the "
                          "file's names for them")


def rename_fields(records: FileRecords, fields: Mapping[str, str]) -> FileRecords:
    """fsplug.data.fields: each record with `own: record[file]` added for every entry (all
    read before any is written, so fields may swap); its other fields are kept."""
    if not fields:
        return records
    check_field_names(fields)
    renamed = []
    for i, rec in enumerate(records):
        values = {own: mapped_value(records, i, own, theirs) for own, theirs in fields.items()}
        renamed.append({**rec, **values})
    return records.with_records(renamed)


def load_records(path: str, fields: Mapping[str, str] | None = None) -> list[dict]:
    """Reads a .json (list of objects) or .jsonl file of instruction records (at least
    `instruction` and `output`, strings, under the names `fields` maps them from; `input`, a
    string or null, `category` and any other fields are kept) or of multimodal records
    (`fs_plugins.data.multimodal`, image paths made absolute). A problem with the file is a
    DataFileError naming it, the line or record and what to change."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Data file not found: {path}")
    records = rename_fields(read_record_file(path), fields or {})
    if is_multimodal(records[0]):
        return records.with_records(resolve_images(records))
    check_text_fields(records, INSTRUCTION_FIELDS, ('input',))
    return records


def fs_llm_prompt(record: dict) -> str:
    """The source text FS-LLM's LLMDataset builds for `record`."""
    with_input, no_input = fs_llm_templates()
    # LLMDataset's own test: a null input (load_jsonl's missing field) takes the with-input
    # template and shows as 'None', as FS-LLM trains on it
    template = with_input if record.get('input', '') != '' else no_input
    return template.format_map(record)


def format_prompt(record: dict, template: str) -> str:
    if template == 'plain':
        text = record['instruction']
        return f"{text}\n{record['input']}\n" if record.get('input') else f"{text}\n"
    if template == 'fs_llm':
        return fs_llm_prompt(record)
    if record.get('input'):
        return ALPACA_WITH_INPUT.format(instruction=record['instruction'], input=record['input'])
    return ALPACA_NO_INPUT.format(instruction=record['instruction'])


def tokenize_record(record: dict, tokenizer, template: str, max_len: int) -> dict | None:
    """input_ids / labels for one record; loss only on the answer (and EOS), as FS-LLM's
    LLMDataset: the prompt's own tokens are masked in the tokens of prompt + answer + EOS.

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

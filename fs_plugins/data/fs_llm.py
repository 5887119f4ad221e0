"""FS-LLM's data types, read as FS-LLM reads them: `data.type: '<name>@llm'`.

FS-LLM (`federatedscope.llm.dataloader.load_llm_dataset`) knows a few named datasets, each a
file under data.root that it downloads from a pinned commit when missing, with its own field
mapping, and reads any other `<file>.json@llm` (a list of objects) or `<file>.jsonl@llm` (one
object per line). Every record it makes has exactly the fields instruction, input, output and
category; a field the file lacks is None (FS-LLM's prompt then shows it as 'None').

This module gives the plugin the same records (prompted with the `fs_llm` template of
`fs_plugins.data.instruction`). Where FederatedScope is installed its own readers (`load_json`,
`load_jsonl`) and downloader (`download_url`) do the work; otherwise the equivalents here.
"""
from __future__ import annotations

import http.client
import importlib
import logging
import os
import random
import socket
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from fs_plugins.core.errors import ConfigError, DataFileError
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.instruction import INSTRUCTION_FIELDS, check_field_names, mapped_value
from fs_plugins.data.record_files import FileRecords, check_text_fields, empty_file_error, is_json_lines
from fs_plugins.data.record_files import read_record_file as read_objects
from fs_plugins.schema.plugin import RECORD_FIELDS
from fs_plugins.schema.specs import DataSource

logger = logging.getLogger(__name__)

DOWNLOAD_TIMEOUT_S = 20     # per connection attempt and read: an offline machine fails fast
RECORD_FILE_ENDINGS = ('.json', '.jsonl')


# ------------------------------------------------------------------------- named datasets
def one_client_per_category(splitter: str, split_field: str) -> bool:
    """FS-LLM's `meta` splitter, or the plugin's by_source on the category it maps it to
    (fs_plugins.schema.fs_llm)."""
    return splitter == 'meta' or (splitter == 'by_source' and split_field == 'category')


def _unchanged(records: list[dict], per_category: bool) -> list[dict]:
    return records


def _gsm8k_answers(records: list[dict], per_category: bool) -> list[dict]:
    for record in records:
        if isinstance(record['output'], str):
            record['output'] = record['output'].replace('####', 'The answer is')
    return records


def _rosetta_without_x86(records: list[dict], per_category: bool) -> list[dict]:
    # FS-LLM drops this category under its `meta` splitter (one client per category): too few
    # records for a client of its own
    if not per_category:
        return records
    return [r for r in records if r['category'] != 'X86-64 Assembly']


@dataclass(frozen=True)
class NamedDataset:
    """One of FS-LLM's named datasets."""
    file: str                                      # its file under data.root
    url: str                                       # FS-LLM's download, at a pinned commit
    renamed: Mapping[str, str] = field(default_factory=dict)   # record field -> file field
    adjust: Callable[[list, bool], list] = _unchanged   # (records, one client per category)

    @property
    def fields(self) -> dict[str, str]:
        return fs_llm_fields(self.renamed)


NAMED_DATASETS = {
    'alpaca': NamedDataset(
        'alpaca_data.json',
        'https://raw.githubusercontent.com/tatsu-lab/stanford_alpaca/'
        '761dc5bfbdeeffa89b8bff5d038781a4055f796a/alpaca_data.json'),
    'alpaca_cleaned': NamedDataset(
        'alpaca_data_cleaned.json',
        'https://raw.githubusercontent.com/gururise/AlpacaDataCleaned/'
        'a7d629079a95c2e4b7ec7dfe55087fbd18d9eba8/alpaca_data_cleaned.json'),
    'dolly-15k': NamedDataset(
        'databricks-dolly-15k.jsonl',
        'https://raw.githubusercontent.com/databrickslabs/dolly/'
        'd000e3030970379aabbf6d291f50ffdd3b715b64/data/databricks-dolly-15k.jsonl',
        {'input': 'context', 'output': 'response'}),
    'gsm8k': NamedDataset(
        'gsm8k_train.jsonl',
        'https://raw.githubusercontent.com/openai/grade-school-math/'
        '3101c7d5072418e28b9008a6636bde82a006892c/grade_school_math/data/train.jsonl',
        {'instruction': 'question', 'output': 'answer'}, _gsm8k_answers),
    'rosetta_alpaca': NamedDataset(
        'rosetta_alpaca.json',
        'https://raw.githubusercontent.com/sahil280114/codealpaca/'
        'd269da106a579a623a654529b3cb91b5dfa9c72f/data/rosetta_alpaca.json',
        {'category': 'input'}, _rosetta_without_x86),
}

# code_search_net: FS-LLM reads the train files of each language's zip, unzipped into
# data.root, and keeps a data.subsample share of each language (it does not download them)
CSN_TRAIN_FILES = {'python': 14, 'javascript': 5, 'java': 16, 'ruby': 2, 'php': 18, 'go': 11}
CSN_URL = 'https://huggingface.co/datasets/code_search_net/resolve/main/data/{language}.zip'
CSN_FIELDS = {'instruction': 'docstring', 'input': 'language', 'output': 'code',
              'category': 'language'}
CODE_SEARCH_NET = 'code_search_net'


def fs_llm_fields(renamed: Mapping[str, str]) -> dict[str, str]:
    """Record field -> file field for every record field: FS-LLM reads each under its own
    name unless `renamed` says otherwise."""
    return {own: renamed.get(own, own) for own in RECORD_FIELDS}


def data_type_names() -> list[str]:
    return sorted([*NAMED_DATASETS, CODE_SEARCH_NET])


# ------------------------------------------------------------------------------ reading
def fs_function(module: str, name: str):
    """FederatedScope's own `name` from `module` where FS is installed, else None."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def fs_llm_record(item: Mapping, fields: Mapping[str, str]) -> dict:
    return {own: item.get(theirs) for own, theirs in fields.items()}


def file_items(path: str) -> FileRecords:
    """The objects of a .json file (a list) or of a .jsonl(.gz) file (one per line, no blank
    line: FS-LLM's reading)."""
    return read_objects(path, blank_lines_ok=False)


def read_fs_llm_file(path: str, fields: Mapping[str, str]) -> FileRecords:
    """FS-LLM's `load_json` / `load_jsonl` of `path`, each record read through `fields`."""
    items = file_items(path)
    return items.with_records(fs_llm_record(item, fields) for item in items)


def fs_llm_read(path: str, fields: Mapping[str, str], is_gzip: bool = False) -> FileRecords:
    """The same, by FS-LLM's own reader where FederatedScope is installed."""
    reader = 'load_json' if path.endswith('.json') else 'load_jsonl'
    fs_reader = fs_function('federatedscope.llm.dataloader.dataloader', reader)
    if fs_reader is None:
        return read_fs_llm_file(path, fields)
    try:
        records = fs_reader(path, **fields, **({'is_gzip': True} if is_gzip else {}))
    except Exception as exc:   # any fault of the file: the plugin's reader names its line
        file_items(path)
        raise DataFileError(f"Data file {path}: FS-LLM's {reader} cannot read it "
                            f'({type(exc).__name__}: {exc})') from None
    if not records:
        raise empty_file_error(path)
    # FS-LLM's reading has no blank lines: record i is on line i + 1
    return FileRecords(records, path, list(range(1, len(records) + 1))
                       if is_json_lines(path) else None)


def read_record_file(path: str, renamed: Mapping[str, str]) -> FileRecords:
    """'<file>.json@llm' / '<file>.jsonl@llm': FS-LLM's reading, with fsplug.data.fields;
    every record needs an instruction and an output (strings), which FS-LLM would otherwise
    train on as the text 'None'."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f'Data file not found: {path}')
    if not renamed:
        records = fs_llm_read(path, fs_llm_fields({}))
    else:
        check_field_names(renamed)
        # FS-LLM's readers turn a missing field into None; a field the user mapped must be there
        items = file_items(path)
        for i in range(len(items)):
            for own, theirs in renamed.items():
                mapped_value(items, i, own, theirs)
        records = items.with_records(fs_llm_record(item, fs_llm_fields(renamed)) for item in items)
    check_text_fields(records, INSTRUCTION_FIELDS, ('input',))
    return records


# ---------------------------------------------------------------------------- download
def urllib_download(url: str, folder: str) -> str:
    """`url` saved as folder/<its file name> unless that exists (FS's download_url contract)."""
    path = os.path.join(folder, url.rpartition('/')[2])
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
        content = response.read()
    partial = path + '.part'
    with open(partial, 'wb') as handle:
        handle.write(content)
    os.replace(partial, path)
    return path


def download(url: str, folder: str) -> str:
    """folder/<the url's file name>, downloaded by FS's own downloader where FS is installed,
    else urllib; a failed download leaves no partial file behind."""
    target = os.path.join(folder, url.rpartition('/')[2])
    existed = os.path.exists(target)
    fetch = fs_function('federatedscope.core.data.utils', 'download_url') or urllib_download
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)   # FS's downloader sets none
    try:
        return fetch(url, folder)
    except BaseException:
        if not existed and os.path.exists(target):
            os.remove(target)
        raise
    finally:
        socket.setdefaulttimeout(previous)


def named_file(name: str, dataset: NamedDataset, root: str) -> str:
    """The dataset's file under data.root, downloaded there when missing."""
    path = os.path.join(root, dataset.file)
    if os.path.isfile(path):
        return path
    logger.info(f"FS-LLM's {name}: downloading {dataset.url} into {root}")
    try:
        fetched = download(dataset.url, root)
        if os.path.abspath(fetched) != os.path.abspath(path):
            os.replace(fetched, path)   # gsm8k: FS-LLM renames train.jsonl
    except (OSError, http.client.HTTPException, ValueError) as exc:
        reason = ' '.join(str(exc).split())
        raise FileNotFoundError(
            f"FS-LLM's '{name}' data: {path} is missing and the download failed ({reason}); "
            f'get it from {dataset.url} and save it as {path}') from None
    return path


# ------------------------------------------------------------------------------- loading
def load_code_search_net(source: DataSource, seed: int) -> list[dict]:
    """FS-LLM's code_search_net: each language's train files, data.subsample of them (a
    seeded draw per language), the instruction prefixed by the language."""
    if not 0 < source.subsample <= 1:
        raise ConfigError(f'data.subsample = {source.subsample}: the share of each language '
                          "that FS-LLM's code_search_net keeps must be in (0, 1]")
    records = []
    for language, count in CSN_TRAIN_FILES.items():
        folder = os.path.join(source.root, language, 'final', 'jsonl', 'train')
        files = [os.path.join(folder, f'{language}_train_{i}.jsonl.gz') for i in range(count)]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(
                f"FS-LLM's 'code_search_net' data: {missing[0]} is missing; get "
                f'{CSN_URL.format(language=language)} and unzip it into {source.root}')
        language_records = [r for f in files for r in fs_llm_read(f, CSN_FIELDS, is_gzip=True)]
        rng = random.Random(derive_seed(seed, CODE_SEARCH_NET, language))
        records += rng.sample(language_records, int(len(language_records) * source.subsample))
    for record in records:
        record['instruction'] = f"{record['category']} {record['instruction']}"
    return records


def source_path(source: DataSource) -> str:
    """The file FS-LLM reads a source's records from (code_search_net: its folder), for errors."""
    key = source.name.lower()
    if key == CODE_SEARCH_NET:
        return source.root
    if key in NAMED_DATASETS:
        return os.path.join(source.root, NAMED_DATASETS[key].file)
    return os.path.join(source.root, source.name)


def load_fs_llm_records(source: DataSource, fields: Mapping[str, str] | None = None,
                        splitter: str = '', seed: int = 0,
                        split_field: str = 'category') -> list[dict]:
    """The records FS-LLM makes of `source` ('<name>@llm'): instruction, input, output,
    category each (None where the file lacks it). `fields` (fsplug.data.fields) maps record
    files' fields; `splitter` and `split_field` (data.splitter, fsplug.data.split_field) say
    whether clients are categories (rosetta_alpaca); `seed` draws code_search_net's
    data.subsample."""
    fields = dict(fields or {})
    if source.name.endswith(RECORD_FILE_ENDINGS):
        return read_record_file(os.path.join(source.root, source.name), fields)
    key = source.name.lower()
    if key not in NAMED_DATASETS and key != CODE_SEARCH_NET:
        raise ConfigError(f"data.type = '{source.type_value}': not one of FS-LLM's data types "
                          f"({', '.join(data_type_names())}, '<file>.json@llm', "
                          "'<file>.jsonl@llm')")
    if fields:
        raise ConfigError(f"fsplug.data.fields = {fields}: FS-LLM's '{source.name}' has its own "
                          "field mapping; fields apply to '<file>.json@llm' / "
                          "'<file>.jsonl@llm' and '@fsplug' files")
    if key == CODE_SEARCH_NET:
        return load_code_search_net(source, seed)
    dataset = NAMED_DATASETS[key]
    records = fs_llm_read(named_file(key, dataset, source.root), dataset.fields)
    return dataset.adjust(records, one_client_per_category(splitter, split_field))

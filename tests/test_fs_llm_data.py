"""FS-LLM's data types ('<name>@llm', fs_plugins.data.fs_llm): each named dataset's file and
field mapping, FS-LLM's reading of record files, the byte-identical `fs_llm` prompt, the
labels of its tokenisation, fsplug.data.fields, and the error when a download fails. Where
FederatedScope is installed (/opt/fsvenv), FS's own readers and prompt give the same."""
import gzip
import json
import urllib.error

import pytest
from helpers import tiny_config, write_yaml

from fs_plugins.core.errors import ConfigError
from fs_plugins.data import fs_llm
from fs_plugins.data.federated import split_records
from fs_plugins.data.instruction import (
    IGNORE_INDEX,
    format_prompt,
    fs_llm_templates,
    load_records,
    tokenize_record,
)
from fs_plugins.methods.specs import model_spec
from fs_plugins.run.config import Cfg, load_config
from fs_plugins.schema.plugin import DataOptions, reads_data_type
from fs_plugins.schema.specs import DataSource, SplitSpec

WITH_INPUT = ('Below is an instruction that describes a task, paired with an input that '
              'provides further context. Write a response that appropriately completes the '
              'request.\n\n### Instruction:\nAdd.\n\n### Input:\n1 2\n\n### Response:')
NO_INPUT = ('Below is an instruction that describes a task. Write a response that '
            'appropriately completes the request.\n\n### Instruction:\nAdd.\n\n### Response:')

ALPACA = [{'instruction': 'Add.', 'input': '1 2', 'output': '3'},
          {'instruction': 'Name a colour.', 'input': '', 'output': 'Red'}]
DOLLY = [{'instruction': 'Who wrote it?', 'context': 'A book by Ann.', 'response': 'Ann',
          'category': 'closed_qa'},
         {'instruction': 'Say hi.', 'context': '', 'response': 'Hi', 'category': 'open_qa'}]
GSM8K = [{'question': 'What is 40 + 2?', 'answer': '40 + 2 = 42\n#### 42'},
         {'question': 'What is 2 * 3?', 'answer': '2 * 3 = 6\n#### 6'}]
ROSETTA = [{'instruction': 'Sort a list.', 'input': 'Python', 'output': 'sorted(x)'},
           {'instruction': 'Add two numbers.', 'input': 'X86-64 Assembly', 'output': 'add rax, rbx'},
           {'instruction': 'Print.', 'input': 'Go', 'output': 'fmt.Println()'}]


def write_json(path, items):
    path.write_text(json.dumps(items), encoding='utf-8')
    return path


def write_jsonl(path, items):
    path.write_text(''.join(json.dumps(i) + '\n' for i in items), encoding='utf-8')
    return path


def source(name, root):
    return DataSource(name, str(root), f'{name}@llm')


def load(name, root, **kwargs):
    return fs_llm.load_fs_llm_records(source(name, root), **kwargs)


@pytest.fixture
def without_fs(monkeypatch):
    """The plugin's own readers, downloader and prompt, as without FederatedScope."""
    monkeypatch.setattr(fs_llm, 'fs_function', lambda module, name: None)


@pytest.fixture
def data_root(tmp_path):
    write_json(tmp_path / 'alpaca_data.json', ALPACA)
    write_json(tmp_path / 'alpaca_data_cleaned.json', ALPACA[:1])
    write_jsonl(tmp_path / 'databricks-dolly-15k.jsonl', DOLLY)
    write_jsonl(tmp_path / 'gsm8k_train.jsonl', GSM8K)
    write_json(tmp_path / 'rosetta_alpaca.json', ROSETTA)
    return tmp_path


# ------------------------------------------------------------------------- named datasets
def test_named_datasets_are_fs_llms_files_and_pinned_urls():
    files = {name: d.file for name, d in fs_llm.NAMED_DATASETS.items()}
    assert files == {'alpaca': 'alpaca_data.json', 'alpaca_cleaned': 'alpaca_data_cleaned.json',
                     'dolly-15k': 'databricks-dolly-15k.jsonl', 'gsm8k': 'gsm8k_train.jsonl',
                     'rosetta_alpaca': 'rosetta_alpaca.json'}
    assert fs_llm.NAMED_DATASETS['gsm8k'].url == (
        'https://raw.githubusercontent.com/openai/grade-school-math/'
        '3101c7d5072418e28b9008a6636bde82a006892c/grade_school_math/data/train.jsonl')
    assert all('githubusercontent.com' in d.url for d in fs_llm.NAMED_DATASETS.values())
    assert fs_llm.data_type_names() == ['alpaca', 'alpaca_cleaned', 'code_search_net',
                                        'dolly-15k', 'gsm8k', 'rosetta_alpaca']


def test_alpaca_keeps_its_fields_and_a_missing_category_is_none(data_root):
    assert load('alpaca', data_root) == [{**r, 'category': None} for r in ALPACA]
    assert load('ALPACA', data_root) == load('alpaca', data_root)      # FS-LLM lower-cases
    assert load('alpaca_cleaned', data_root) == [{**ALPACA[0], 'category': None}]


def test_dolly_reads_context_as_input_and_response_as_output(data_root):
    assert load('dolly-15k', data_root) == [
        {'instruction': 'Who wrote it?', 'input': 'A book by Ann.', 'output': 'Ann',
         'category': 'closed_qa'},
        {'instruction': 'Say hi.', 'input': '', 'output': 'Hi', 'category': 'open_qa'}]


def test_gsm8k_question_answer_and_the_answer_marker(data_root):
    records = load('gsm8k', data_root)
    assert records[0] == {'instruction': 'What is 40 + 2?', 'input': None,
                          'output': '40 + 2 = 42\nThe answer is 42', 'category': None}
    assert records[1]['output'].endswith('The answer is 6')


def test_rosetta_category_is_the_language_and_meta_drops_x86(data_root):
    records = load('rosetta_alpaca', data_root)
    assert [r['category'] for r in records] == ['Python', 'X86-64 Assembly', 'Go']
    assert [r['input'] for r in records] == ['Python', 'X86-64 Assembly', 'Go']
    meta = load('rosetta_alpaca', data_root, splitter='meta')
    assert [r['category'] for r in meta] == ['Python', 'Go']
    # 'meta' as the config mapping gives it to the plugin: by_source on the category
    assert load('rosetta_alpaca', data_root, splitter='by_source') == meta
    assert len(load('rosetta_alpaca', data_root, splitter='by_source', split_field='input')) == 3
    assert len(load('rosetta_alpaca', data_root, splitter='iid')) == 3


def test_code_search_net_reads_the_gz_files_prefixes_the_language_and_subsamples(tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setattr(fs_llm, 'CSN_TRAIN_FILES', {'python': 2, 'go': 1})
    for language, count in fs_llm.CSN_TRAIN_FILES.items():
        folder = tmp_path / language / 'final' / 'jsonl' / 'train'
        folder.mkdir(parents=True)
        for i in range(count):
            lines = [json.dumps({'docstring': f'doc {i}.{k}', 'code': f'code {k}',
                                 'language': language}) for k in range(4)]
            with gzip.open(folder / f'{language}_train_{i}.jsonl.gz', 'wt') as handle:
                handle.write('\n'.join(lines) + '\n')
    everything = load('code_search_net', tmp_path)
    assert len(everything) == 12
    assert {'instruction': 'go doc 0.1', 'input': 'go', 'output': 'code 1',
            'category': 'go'} in everything
    half = fs_llm.load_fs_llm_records(DataSource('code_search_net', str(tmp_path),
                                                 'code_search_net@llm', subsample=0.5), seed=3)
    assert [r['category'] for r in half].count('python') == 4 and len(half) == 6
    again = fs_llm.load_fs_llm_records(DataSource('code_search_net', str(tmp_path),
                                                  'code_search_net@llm', subsample=0.5), seed=3)
    assert half == again                                                # seeded draw
    (tmp_path / 'go' / 'final' / 'jsonl' / 'train' / 'go_train_0.jsonl.gz').unlink()
    with pytest.raises(FileNotFoundError, match=r'go_train_0\.jsonl\.gz.*go\.zip'):
        load('code_search_net', tmp_path)


def test_unknown_name_lists_fs_llms_data_types(tmp_path):
    with pytest.raises(ConfigError, match="'tiny_tasks@llm'.*dolly-15k.*<file>.json@llm"):
        load('tiny_tasks', tmp_path)


# ------------------------------------------------------------------------- record files
def test_record_files_are_read_as_fs_llm_reads_them(tmp_path):
    items = [{'instruction': 'i', 'output': 'o', 'extra': 1}, {'instruction': 'j', 'input': 'x',
                                                              'output': 'p', 'category': 'c'}]
    expected = [{'instruction': 'i', 'input': None, 'output': 'o', 'category': None},
                {'instruction': 'j', 'input': 'x', 'output': 'p', 'category': 'c'}]
    write_json(tmp_path / 'mine.json', items)
    write_jsonl(tmp_path / 'mine.jsonl', items)
    assert load('mine.json', tmp_path) == load('mine.jsonl', tmp_path) == expected
    with pytest.raises(FileNotFoundError, match='other.json'):
        load('other.json', tmp_path)


def test_fields_map_a_record_files_names(tmp_path):
    items = [{'question': 'q', 'answer': 'a', 'context': 'c', 'topic': 't', 'output': 'x'}]
    write_jsonl(tmp_path / 'qa.jsonl', items)
    fields = {'instruction': 'question', 'output': 'answer', 'input': 'context', 'category': 'topic'}
    assert load('qa.jsonl', tmp_path, fields=fields) == [
        {'instruction': 'q', 'input': 'c', 'output': 'a', 'category': 't'}]
    # the '@fsplug' reading keeps the record's other fields
    assert load_records(str(tmp_path / 'qa.jsonl'), fields) == [
        {**items[0], 'instruction': 'q', 'output': 'a', 'input': 'c', 'category': 't'}]
    swapped = load_records(str(tmp_path / 'qa.jsonl'),
                           {'instruction': 'question', 'output': 'context', 'input': 'answer'})
    assert (swapped[0]['output'], swapped[0]['input']) == ('c', 'a')


def test_fields_errors_name_the_file_record_and_field(tmp_path):
    write_jsonl(tmp_path / 'qa.jsonl', [{'question': 'q', 'answer': 'a'}, {'question': 'r'}])
    fields = {'instruction': 'question', 'output': 'answer'}
    for read in (lambda: load('qa.jsonl', tmp_path, fields=fields),
                 lambda: load_records(str(tmp_path / 'qa.jsonl'), fields)):
        with pytest.raises(ValueError, match=r"Record 1 of .*qa\.jsonl lacks field 'answer'"):
            read()
    with pytest.raises(ConfigError, match=r"unknown record field\(s\) \['question'\]"):
        load_records(str(tmp_path / 'qa.jsonl'), {'question': 'instruction'})
    write_json(tmp_path / 'alpaca_data.json', ALPACA)
    with pytest.raises(ConfigError, match="'alpaca' has its own field mapping"):
        load('alpaca', tmp_path, fields=fields)


def test_fields_option_is_checked_with_the_config(tmp_path):
    def loaded(**data):
        return load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, fsplug={'data': data})))

    assert loaded(fields={'instruction': 'question'}).fsplug.data.fields == {'instruction': 'question'}
    with pytest.raises(ConfigError, match=r"Unknown config key 'fsplug\.data\.fields\.question'"):
        loaded(fields={'question': 'instruction'})
    with pytest.raises(ConfigError, match=r'fsplug\.data\.fields\.output = 3: expected str'):
        loaded(fields={'output': 3})
    with pytest.raises(ConfigError, match='fsplug.data.fields = .*expected a mapping'):
        loaded(fields=['instruction'])
    assert DataOptions().fields == {} and DataOptions().prompt == ''


# --------------------------------------------------------------------------------- prompt
def test_fs_llm_prompt_is_fs_llms_text():
    record = {'instruction': 'Add.', 'input': '1 2', 'output': '3'}
    assert format_prompt(record, 'fs_llm') == WITH_INPUT
    assert format_prompt({**record, 'input': ''}, 'fs_llm') == NO_INPUT
    assert format_prompt({'instruction': 'Add.', 'output': '3'}, 'fs_llm') == NO_INPUT
    assert format_prompt(record, 'alpaca') == WITH_INPUT + '\n'


def test_a_null_input_takes_the_with_input_template_as_in_fs_llm():
    record = {'instruction': 'Add.', 'input': None, 'output': '3', 'category': None}
    assert format_prompt(record, 'fs_llm') == WITH_INPUT.replace('1 2', 'None')
    assert format_prompt(record, 'alpaca') == NO_INPUT + '\n'


@pytest.mark.fs
def test_prompt_bytes_match_fs_llms_prompt_dict():
    from federatedscope.llm.dataset.llm_dataset import PROMPT_DICT

    from fs_plugins.data.instruction import FS_LLM_NO_INPUT, FS_LLM_WITH_INPUT
    fs_templates = (PROMPT_DICT['prompt_input'], PROMPT_DICT['prompt_no_input'])
    assert fs_templates == (FS_LLM_WITH_INPUT, FS_LLM_NO_INPUT) == fs_llm_templates()
    for record in ({'instruction': 'Add.', 'input': '1 2', 'output': '3'},
                   {'instruction': 'Add.', 'input': None, 'output': '3'},
                   {'instruction': 'Add.', 'input': '', 'output': '3'}):
        fs_source = (PROMPT_DICT['prompt_input'].format_map(record)
                     if record.get('input', '') != '' else
                     PROMPT_DICT['prompt_no_input'].format_map(record))
        assert format_prompt(record, 'fs_llm').encode() == fs_source.encode()


def test_prompt_default_is_the_data_sources_own(tmp_path):
    def spec(data_type, prompt=''):
        return model_spec(Cfg.wrap({
            'model': {'type': 'tiny-llama@fsplug_llm'}, 'seed': 0, 'llm': {'tok_len': 64},
            'data': {'type': data_type, 'root': str(tmp_path)}, 'use_gpu': False, 'device': -1,
            'fsplug': {'model': {}, 'data': {'prompt': prompt},
                       'train': {'gradient_checkpointing': False}}}))

    assert spec('gsm8k@llm').prompt == 'fs_llm'
    assert spec('mine.json@llm').prompt == 'fs_llm'
    assert spec('tiny_tasks@fsplug').prompt == 'alpaca'
    assert spec('gsm8k@llm', 'alpaca').prompt == 'alpaca'
    assert spec('tiny_tasks@fsplug', 'plain').prompt == 'plain'


def test_the_plugin_reads_llm_data_only_for_its_methods():
    def cfg(data_type, method):
        return Cfg.wrap({'data': {'type': data_type}, 'fsplug': {'method': method}})

    assert reads_data_type(cfg('gsm8k@llm', 'fedavg'))
    assert not reads_data_type(cfg('gsm8k@llm', ''))        # FS-LLM's own loader reads it
    assert reads_data_type(cfg('tiny_tasks@fsplug', ''))
    assert not reads_data_type(Cfg.wrap({'data': {'type': 'gsm8k@llm'}}))
    assert not reads_data_type(cfg('cora', 'fedavg'))


# ----------------------------------------------------------------------------- tokenising
def test_labels_cover_exactly_the_answer_and_eos():
    from transformers import AutoTokenizer

    from fs_plugins.models.tiny import ensure_tiny_llama
    tok = AutoTokenizer.from_pretrained(ensure_tiny_llama())
    for record in ({'instruction': 'What is 40 + 2?', 'input': None,
                    'output': '40 + 2 = 42\nThe answer is 42', 'category': None},
                   {'instruction': 'Say hi.', 'input': '', 'output': 'Hi', 'category': 'x'}):
        example = tokenize_record(record, tok, 'fs_llm', 256)
        source_text = format_prompt(record, 'fs_llm')
        # FS-LLM's LLMDataset: source + output + eos_token, the source's tokens masked
        fs_ids = tok(source_text + record['output'] + tok.eos_token)['input_ids']
        n_source = len(tok(source_text)['input_ids'])
        assert example['input_ids'].tolist() == fs_ids
        assert example['labels'].tolist() == [IGNORE_INDEX] * n_source + fs_ids[n_source:]
        answer = example['labels'][example['labels'] != IGNORE_INDEX].tolist()
        assert answer[-1] == tok.eos_token_id
        assert tok.decode(answer[:-1]) == record['output']


def test_split_records_of_an_llm_source(data_root):
    spec = SplitSpec(source('dolly-15k', data_root), 'by_source', 2, 1, 0,
                     DataOptions(test_fraction=0.0))
    federated = split_records(spec)
    assert federated.client_names == {1: 'closed_qa', 2: 'open_qa'}
    assert federated.clients[1]['train'][0]['input'] == 'A book by Ann.'


# ------------------------------------------------------------------------------ download
def test_a_failed_download_is_one_line_naming_the_path_and_url(tmp_path, monkeypatch):
    def offline(url, folder):
        raise urllib.error.URLError('no network')

    monkeypatch.setattr(fs_llm, 'download', offline)
    with pytest.raises(FileNotFoundError) as err:
        load('dolly-15k', tmp_path)
    message = str(err.value)
    assert '\n' not in message
    assert str(tmp_path / 'databricks-dolly-15k.jsonl') in message
    assert fs_llm.NAMED_DATASETS['dolly-15k'].url in message


def test_urllib_download_fails_fast_and_leaves_nothing(tmp_path, monkeypatch, without_fs):
    def unreachable(url, timeout=None, **_):
        assert timeout == fs_llm.DOWNLOAD_TIMEOUT_S
        raise urllib.error.URLError('unreachable')

    monkeypatch.setattr(fs_llm.urllib.request, 'urlopen', unreachable)
    with pytest.raises(FileNotFoundError, match='gsm8k_train.jsonl.*grade-school-math'):
        load('gsm8k', tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_gsm8k_download_is_renamed_as_fs_llm_does(tmp_path, monkeypatch):
    def fake_download(url, folder):
        return str(write_jsonl(tmp_path / url.rpartition('/')[2], GSM8K))

    monkeypatch.setattr(fs_llm, 'download', fake_download)
    assert load('gsm8k', tmp_path)[0]['instruction'] == 'What is 40 + 2?'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['gsm8k_train.jsonl']


# ------------------------------------------------------------------ FS's own loaders agree
@pytest.mark.parametrize('name', ['alpaca', 'alpaca_cleaned', 'dolly-15k', 'gsm8k',
                                  'rosetta_alpaca', 'mine.json', 'mine.jsonl'])
@pytest.mark.fs
def test_fs_readers_and_the_plugins_give_the_same_records(data_root, monkeypatch, name):
    items = [{'instruction': 'i', 'output': 'o'}, {'instruction': 'j', 'input': 'x', 'output': 'p'}]
    write_json(data_root / 'mine.json', items)
    write_jsonl(data_root / 'mine.jsonl', items)
    with_fs = load(name, data_root, splitter='meta')
    monkeypatch.setattr(fs_llm, 'fs_function', lambda module, attr: None)
    assert load(name, data_root, splitter='meta') == with_fs


@pytest.mark.fs
def test_fs_downloader_is_used_with_a_timeout(tmp_path, monkeypatch):
    import socket

    import federatedscope.core.data.utils as fs_utils
    seen = []

    def unreachable(url, *args, **kwargs):
        seen.append((url, socket.getdefaulttimeout()))
        raise urllib.error.URLError('unreachable')

    monkeypatch.setattr(fs_utils.urllib.request, 'urlopen', unreachable)
    before = socket.getdefaulttimeout()
    with pytest.raises(FileNotFoundError, match='alpaca_data.json.*stanford_alpaca'):
        load('alpaca', tmp_path)
    assert seen == [(fs_llm.NAMED_DATASETS['alpaca'].url, fs_llm.DOWNLOAD_TIMEOUT_S)]
    assert socket.getdefaulttimeout() == before


def test_code_search_net_subsample_must_be_a_share(tmp_path):
    with pytest.raises(ConfigError, match=r'data.subsample = 1.5'):
        fs_llm.load_fs_llm_records(DataSource('code_search_net', str(tmp_path),
                                              'code_search_net@llm', subsample=1.5))

"""Every problem with a user's data file is a DataFileError (a ConfigError: printed without a
traceback, non-zero exit) whose one message names the file, the line or record and what to
change (issue 41, point 6)."""
import gzip
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, tiny_config, write_yaml

from fs_plugins.core.errors import ConfigError, DataFileError
from fs_plugins.data import fs_llm, glue
from fs_plugins.data.federated import nothing_fits_error, split_records
from fs_plugins.data.instruction import load_records
from fs_plugins.data.public import public_records
from fs_plugins.schema.plugin import DataOptions
from fs_plugins.schema.specs import DataSource, SplitSpec

GOOD = {'instruction': 'Add.', 'input': '1 2', 'output': '3', 'category': 'a'}
GOOD_LINE = json.dumps(GOOD)


def write(path, content) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding='utf-8')
    return str(path)


def message_of(read, path) -> str:
    with pytest.raises(DataFileError) as caught:
        read(path)
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    assert path in message, message
    return message


def assert_names(message: str, *fragments) -> None:
    for fragment in fragments:
        assert fragment in message, message


# ------------------------------------------------------------- instruction record files
INSTRUCTION_CASES = {
    'malformed_line': ('d.jsonl', f'{GOOD_LINE}\n\n{{"instruction": "x", oops}}\n',
                       ['line 3', 'not valid JSON', 'at column 22']),
    'malformed_json': ('d.json', f'[{GOOD_LINE},\n {{"output": }}]',
                       ['line 2 column 13', 'not valid JSON']),
    'json_list_in_jsonl': ('d.jsonl', f'[{GOOD_LINE},\n{GOOD_LINE}]\n',
                           ['line 1', 'a JSON list belongs in a .json file']),
    'empty_jsonl': ('d.jsonl', '\n  \n', ['holds no records']),
    'empty_json': ('d.json', '', ['holds no records']),
    'empty_list': ('d.json', '[]', ['holds no records']),
    'not_a_list': ('d.json', GOOD_LINE, ['holds a JSON object, not a list of records']),
    'record_not_an_object': ('d.jsonl', f'{GOOD_LINE}\n\n["x", "y"]\n',
                             ['Record 1 of', 'line 3', 'is a JSON list, not an object']),
    'missing_field': ('d.jsonl', f'{GOOD_LINE}\n{{"instruction": "x"}}\n',
                      ['Record 1 of', 'line 2', "lacks field(s) ['output']", 'fsplug.data.fields']),
    'null_field': ('d.json', json.dumps([GOOD, {**GOOD, 'instruction': None}]),
                   ['Record 1 of', 'list index 1', "lacks field(s) ['instruction']"]),
    'output_not_a_string': ('d.jsonl', f'{GOOD_LINE}\n{json.dumps({**GOOD, "output": 7})}\n',
                            ['Record 1 of', 'line 2', "'output' = 7", "'output' must be a string"]),
    'input_not_a_string': ('d.jsonl', json.dumps({**GOOD, 'input': ['a']}),
                           ['Record 0 of', 'line 1', "'input' = [\"a\"]", "'input' must be"]),
    'wrong_extension': ('d.txt', GOOD_LINE, ['must end in .json', '.jsonl']),
    'nested_too_deeply': ('d.jsonl', f'{GOOD_LINE}\n' + '[' * 100_000 + ']' * 100_000,
                          ['line 2', 'nested too deeply']),
}


@pytest.mark.parametrize('case', sorted(INSTRUCTION_CASES))
def test_instruction_file_problems_name_file_line_and_fix(tmp_path, case):
    name, content, fragments = INSTRUCTION_CASES[case]
    assert_names(message_of(load_records, write(tmp_path / name, content)), *fragments)


def test_non_utf8_bytes_name_their_line_and_offset(tmp_path):
    path = write(tmp_path / 'latin.jsonl',
                 (GOOD_LINE + '\n').encode() + b'{"instruction": "caf\xe9", "output": "x"}\n')
    offset = len(GOOD_LINE) + 1 + len('{"instruction": "caf')
    assert_names(message_of(load_records, path), 'line 2', f'byte offset {offset}',
                 'not UTF-8', 'save the file as UTF-8')


def test_a_byte_order_mark_is_accepted(tmp_path):
    path = write(tmp_path / 'bom.jsonl', ('\ufeff' + GOOD_LINE + '\n').encode())
    assert load_records(path) == [GOOD]


def test_a_mapped_field_missing_names_its_line_and_the_key(tmp_path):
    path = write(tmp_path / 'qa.jsonl', '{"q": "x", "a": "y"}\n\n{"q": "z"}\n')
    message = message_of(lambda p: load_records(p, {'instruction': 'q', 'output': 'a'}), path)
    assert_names(message, 'Record 1 of', "lacks field 'a'", 'line 3', 'fsplug.data.fields')


def test_multimodal_record_problems_are_named(tmp_path):
    image = write(tmp_path / 'a.png', b'png')
    record = {'id': 'r0', 'image': image, 'question': 'What?', 'answer': 'red'}
    cases = [({**record, 'answer': 3}, ["'answer' = 3", "'answer' must be a string"]),
             ({**record, 'image': 5, 'audio': image}, ["'image' = 5", 'a file path or a list']),
             ({k: v for k, v in record.items() if k != 'answer'}, ["lacks field(s) ['answer']"])]
    for bad, fragments in cases:
        path = write(tmp_path / 'mm.jsonl', f'{json.dumps(record)}\n{json.dumps(bad)}\n')
        assert_names(message_of(load_records, path), 'Record 1 of', 'line 2', *fragments)


# ----------------------------------------------------------------- FS-LLM's '@llm' files
def load_llm(path, fields=None):
    folder, name = os.path.split(path)
    return fs_llm.load_fs_llm_records(DataSource(name, folder, f'{name}@llm'), fields)


def test_llm_files_name_the_line(tmp_path, monkeypatch):
    monkeypatch.setattr(fs_llm, 'fs_function', lambda module, name: None)   # the plugin's reader
    cases = [(f'{GOOD_LINE}\n\n{GOOD_LINE}\n', ['line 2', 'blank line', 'remove it']),
             (f'{GOOD_LINE}\n{{"instruction": "x"}}\n', ['Record 1 of', 'line 2', "['output']"]),
             (f'{GOOD_LINE}\n{{"instruction": 1, "output": "x"}}\n', ["'instruction' = 1"]),
             (f'{GOOD_LINE}\n{{bad\n', ['line 2', 'not valid JSON']),
             ('', ['holds no records'])]
    for content, fragments in cases:
        assert_names(message_of(load_llm, write(tmp_path / 'mine.jsonl', content)), *fragments)


def test_llm_file_errors_through_fs_llms_own_reader(tmp_path, monkeypatch):
    def fs_reader(path, **fields):   # as FS-LLM's load_jsonl: json.loads of every line
        with open(path) as handle:
            return [{own: json.loads(line).get(theirs) for own, theirs in fields.items()}
                    for line in handle]
    monkeypatch.setattr(fs_llm, 'fs_function', lambda module, name: fs_reader)
    path = write(tmp_path / 'mine.jsonl', f'{GOOD_LINE}\n{GOOD_LINE}\n{{"x": \n')
    assert_names(message_of(load_llm, path), 'line 3', 'not valid JSON')
    path = write(tmp_path / 'mine.jsonl', f'{GOOD_LINE}\n{{"instruction": "x"}}\n')
    assert_names(message_of(load_llm, path), 'Record 1 of', 'line 2', "['output']")


def test_a_corrupt_gzip_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(fs_llm, 'fs_function', lambda module, name: None)
    path = write(tmp_path / 'x.jsonl.gz', b'not gzip')
    assert_names(message_of(lambda p: fs_llm.fs_llm_read(p, fs_llm.CSN_FIELDS, True), path),
                 'not a readable gzip file')
    path = write(tmp_path / 'y.jsonl.gz', gzip.compress(b'{"code": 1}\n[\n'))
    assert_names(message_of(lambda p: fs_llm.fs_llm_read(p, fs_llm.CSN_FIELDS, True), path),
                 'line 2', 'not valid JSON')


# ---------------------------------------------------------------------------------- GLUE
def load_sst2(folder):
    return glue.load_glue(glue.parse_data_type(f'glue:sst2:{folder}', '/'))


@pytest.mark.parametrize('train, fragments', [
    (b'sentence\tlabel\ngood\t1\nbad \xff film\t0\n', ['train.tsv, line 3', 'not UTF-8']),
    (b'', ['train.tsv is empty', 'header line']),
    (b'sentence\tlabel\n', ['train.tsv: no records']),
    (b'text\tlabel\ngood\t1\n', ["train.tsv: no column 'sentence'", 'rename the column']),
    (b'sentence\tlabel\ngood\t9\n', ["train.tsv, record 0: label '9'"]),
])
def test_glue_tsv_problems_are_named(tmp_path, train, fragments):
    write(tmp_path / 'dev.tsv', 'sentence\tlabel\ngood\t1\n')
    train_path = write(tmp_path / 'train.tsv', train)
    with pytest.raises(DataFileError) as caught:
        load_sst2(str(tmp_path))
    assert_names(str(caught.value), train_path, *fragments)


def test_glue_json_lines_problems_are_named(tmp_path):
    write(tmp_path / 'dev.tsv', 'sentence\tlabel\ngood\t1\n')
    write(tmp_path / 'train.jsonl', '{"sentence": "a", "label": 1}\n{"sentence": "b"}\n')
    with pytest.raises(DataFileError, match=r"train\.jsonl, record 1: no field 'label'"):
        load_sst2(str(tmp_path))
    write(tmp_path / 'train.jsonl', '{"sentence": "a", "label": 1}\n{"sentence": \n')
    with pytest.raises(DataFileError, match=r'train\.jsonl, line 2: not valid JSON'):
        load_sst2(str(tmp_path))


# ------------------------------------------------------------------ splitting into clients
def spec_for(path, client_num: int, splitter: str = 'iid', **options) -> SplitSpec:
    folder, name = os.path.split(path)
    return SplitSpec(DataSource(name, folder, f'{name}@fsplug'), splitter, client_num, 2, 0,
                     DataOptions(**options))


def write_records(path, count: int) -> str:
    return write(path, ''.join(json.dumps({**GOOD, 'output': str(i)}) + '\n'
                               for i in range(count)))


def test_fewer_records_than_clients_names_the_file_and_client_num(tmp_path):
    path = write_records(tmp_path / 'few.jsonl', 3)
    with pytest.raises(DataFileError) as caught:
        split_records(spec_for(path, 4))
    assert_names(str(caught.value), path, '3 record(s)', 'federate.client_num = 4',
                 'at most 3')
    with pytest.raises(DataFileError, match='after fsplug.data.select / fsplug.data.max_records'):
        split_records(spec_for(write_records(tmp_path / 'more.jsonl', 9), 4, max_records=2))


def test_split_from_records_problems_name_the_file(tmp_path):
    path = write(tmp_path / 's.jsonl', ''.join(json.dumps({**GOOD, 'id': f'r{i}', 'split': s}) + '\n'
                                             for i, s in enumerate(['train', 'test', 'dev'])))
    with pytest.raises(DataFileError) as caught:
        split_records(spec_for(path, 1, split_from_records=True))
    assert_names(str(caught.value), 'record r2', path, "split = 'dev'")
    write(tmp_path / 's.jsonl', json.dumps({**GOOD, 'split': 'test'}) + '\n')
    with pytest.raises(DataFileError) as caught:
        split_records(spec_for(path, 1, split_from_records=True))
    assert_names(str(caught.value), path, "no split = 'train'")


def test_a_client_whose_records_do_not_fit_tok_len_is_named(tmp_path):
    """The records stay with their file and line, so the client's error names them."""
    path = write(tmp_path / 'long.jsonl', '\n' + GOOD_LINE + '\n' + GOOD_LINE + '\n')
    train = split_records(spec_for(path, 1, test_fraction=0.0)).clients[1]['train']
    message = str(nothing_fits_error(1, train, 16))
    assert_names(message, 'Client 1', f'line 2 of {path}', 'llm.tok_len = 16',
                 'raise llm.tok_len')


def test_public_data_errors_also_name_the_key(tmp_path):
    path = write(tmp_path / 'public.jsonl', f'{GOOD_LINE}\n{{"instruction": "x"}}\n')
    with pytest.raises(DataFileError) as caught:
        public_records(path, DataSource('x.jsonl', str(tmp_path)), 2, 0, 'fsplug.x.public_data')
    assert_names(str(caught.value), 'fsplug.x.public_data: Record 1 of', path, 'line 2')


# ------------------------------------------------------------------------------- printing
def test_a_data_file_error_is_a_config_error_with_its_own_heading():
    error = DataFileError('Data file d.jsonl, line 2: not valid JSON')
    assert isinstance(error, ConfigError) and isinstance(error, ValueError)
    assert error.report() == 'fs-plugins: data file error:\n  Data file d.jsonl, line 2: not valid JSON'
    assert ConfigError('x').report() == 'fs-plugins: config error:\n  x'


@pytest.mark.fs
def test_federatedscopes_error_report_prints_it_without_a_traceback():
    code = ('from fs_plugins.fs.config import install_error_report\n'
            'from fs_plugins.core.errors import DataFileError\n'
            'install_error_report()\n'
            "raise DataFileError('Data file d.jsonl, line 2: not valid JSON')\n")
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=120)
    assert done.returncode != 0 and 'Traceback' not in done.stderr
    assert 'data file error:\n  Data file d.jsonl, line 2: not valid JSON' in done.stderr


def run_cli(tmp_path, capsys, data_lines: str, **updates) -> str:
    """`fs-plugins run --runner embedded` on a config reading `data_lines` (the CLI's `main`,
    in this process); returns what it printed to stderr, checked to be the one-line report."""
    from fs_plugins.commands.cli import main
    data = write(tmp_path / 'data' / 'qa.jsonl', data_lines)
    cfg = tiny_config(tmp_path, data={'type': 'qa.jsonl@fsplug', 'splitter': 'iid'}, **updates)
    cfg_path = write_yaml(tmp_path / 'run.yaml', cfg)
    capsys.readouterr()
    code = main(['run', '--runner', 'embedded', '--cfg', cfg_path])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert 'Traceback' not in stderr, stderr
    assert 'fs-plugins: data file error:' in stderr and data in stderr, stderr
    return stderr


def test_cli_run_refuses_a_malformed_line(tmp_path, capsys):
    stderr = run_cli(tmp_path, capsys, f'{GOOD_LINE}\n{GOOD_LINE}\n{{"instruction": "x",\n')
    assert 'line 3: not valid JSON' in stderr, stderr


def test_cli_run_refuses_fewer_records_than_clients(tmp_path, capsys):
    stderr = run_cli(tmp_path, capsys, f'{GOOD_LINE}\n{GOOD_LINE}\n', federate={'client_num': 4})
    assert 'federate.client_num = 4' in stderr, stderr

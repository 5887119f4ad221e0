"""SmartFed's skill-composition tasks (paper Table 4): preparation from tiny raw files of each
format (benchmarks_ext/smartfed), the three metrics (mgsm_accuracy, pass_at_1,
execution_accuracy), the sandbox they run code in, and the prepared files under the shipped
paper YAMLs (yamls/smartfed/paper_*.yaml)."""
import json
import math
import os
import shutil
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)   # benchmarks_ext is not an installed package

from benchmarks_ext.common import PrepareError  # noqa: E402
from benchmarks_ext.smartfed import prepare as smartfed  # noqa: E402
from benchmarks_ext.smartfed import readers  # noqa: E402
from fs_plugins.data.instruction import load_records  # noqa: E402
from fs_plugins.data.multimodal import reference_answer  # noqa: E402
from fs_plugins.metrics import sandbox  # noqa: E402
from fs_plugins.metrics.execution import code_blocks, execution_accuracy, pass_at_1  # noqa: E402
from fs_plugins.metrics.generation_metrics import GENERATION_METRICS  # noqa: E402
from fs_plugins.metrics.math_answers import final_number, mgsm_accuracy, parse_number  # noqa: E402
from fs_plugins.run.config import load_config  # noqa: E402
from fs_plugins.run.runtime import build_federated_records  # noqa: E402

N_TRAIN = 12          # training records of each raw fixture
CLIENTS = 3
FAST = sandbox.SandboxLimits(timeout_s=3.0, memory_mb=1024)


# ------------------------------------------------------------------ raw fixtures (each format)
def _write_lines(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + '\n')


def build_raw(root) -> str:
    raw = os.path.join(str(root), 'raw')
    # Math23K: the original stream of pretty-printed objects (not a JSON array)
    os.makedirs(os.path.join(raw, 'math23k'))
    with open(os.path.join(raw, 'math23k', 'Math_23K.json'), 'w', encoding='utf-8') as handle:
        for i in range(N_TRAIN):
            ops = '+'.join(['1'] * (i % 4 + 2))
            text = f'小明有{i}个苹果，又买了{i + 1}个，一共有多少个？'
            handle.write(json.dumps({'id': str(1000 + i), 'original_text': text,
                                     'segmented_text': '小明 有 ...', 'equation': f'x={ops}',
                                     'ans': str(i % 4 + 2)}, ensure_ascii=False, indent=1) + '\n')
        handle.write(json.dumps({'id': '1000', 'original_text': 'duplicate id', 'equation': 'x=1', 'ans': '1'}) + '\n')
    # MGSM zh: question<TAB>answer, no header
    os.makedirs(os.path.join(raw, 'mgsm'))
    with open(os.path.join(raw, 'mgsm', 'mgsm_zh.tsv'), 'w', encoding='utf-8') as handle:
        for i in range(7):
            handle.write(f'珍妮特的鸭子每天下{i + 10}个蛋，问题{i}？\t{(i + 10) * 2}\n')
    # DoIT: JSON lines of messages; the test file with question_format 1 (choices, first correct)
    doit = os.path.join(raw, 'doit', 'curated')
    _write_lines(os.path.join(doit, 'full', 'code_full.json'), [
        {'messages': [{'role': 'user', 'content': f'请用Python写一个函数 add{i}(a, b)，返回 a + b。'},
                      {'role': 'assistant', 'content': f'```python\ndef add{i}(a, b):\n    return a + b\n```'}]}
        for i in range(N_TRAIN)])
    _write_lines(os.path.join(doit, 'test', 'code_test.json'), [
        {'messages': [{'role': 'user', 'content': '写一个函数 twice(x)，返回 2 * x。'},
                      {'role': 'assistant', 'content': 'B'}],
         'type': 'code', 'question_format': 1,
         'choices': ['def twice(x):\n    return 2 * x', 'def twice(x):\n    return x', 'pass']},
        {'messages': [{'role': 'user', 'content': '写一个函数 neg(x)，返回 -x。'},
                      {'role': 'assistant', 'content': '```python\ndef neg(x):\n    return -x\n```'}],
         'type': 'code', 'question_format': 0, 'test': 'assert neg(3) == -3'},
        {'messages': [{'role': 'user', 'content': '没有测试的题目。'},
                      {'role': 'assistant', 'content': 'def f():\n    return 1'}],
         'type': 'code', 'question_format': 0},
        {'messages': [{'role': 'user', 'content': '写一个类 Solution，方法 sq(x) 返回 x * x。'},
                      {'role': 'assistant', 'content': 'class Solution:\n    def sq(self, x):\n        return x * x'}],
         'type': 'code', 'question_format': 0},
    ])
    _write_lines(os.path.join(raw, 'doit', 'code_tests.jsonl'), [
        {'index': 0, 'test': 'def check(candidate):\n    assert candidate(4) == 8\n', 'entry_point': 'twice'},
        {'index': 3, 'test_list': ['assert Solution().sq(3) == 9', 'assert Solution().sq(0) == 0']},
    ])
    # MathCodeInstruct: messages whose contents are lists of typed blocks
    _write_lines(os.path.join(raw, 'mathcodeinstruct', 'train_80k.jsonl'), [
        {'messages': [{'role': 'system', 'content': [{'type': 'text', 'content': ''}]},
                      {'role': 'user', 'content': [{'type': 'text', 'content': f'What is {i} times 3?'}]},
                      {'role': 'assistant', 'content': [
                          {'type': 'text', 'content': 'Let us compute it.'},
                          {'type': 'code', 'content': f'x = {i} * 3\nprint(x)'},
                          {'type': 'execution', 'content': str(i * 3)},
                          *([{'type': 'code', 'content': 'x + 0'}] * (i % 3)),
                          {'type': 'text', 'content': f'The answer is \\boxed{{{i * 3}}}.'}]}]}
        for i in range(N_TRAIN)])
    # GSM-Hard: input / code / target
    _write_lines(os.path.join(raw, 'gsm_hard', 'gsmhardv2.jsonl'), [
        {'input': f'Janet has {1234567 + i} ducks and sells 3. How many are left?',
         'code': f'def solution():\n    ducks = {1234567 + i}\n    result = ducks - 3\n    return result',
         'target': float(1234567 + i - 3)} for i in range(5)])
    return raw


@pytest.fixture(scope='module')
def raw(tmp_path_factory):
    return build_raw(tmp_path_factory.mktemp('smartfed_raw'))


@pytest.fixture(scope='module')
def prepared(raw, tmp_path_factory):
    out = str(tmp_path_factory.mktemp('smartfed_out'))
    summaries = smartfed.prepare(raw, out, clients=CLIENTS, seed=0)
    return out, summaries


def read_records(path):
    with open(path, encoding='utf-8') as handle:
        return [json.loads(line) for line in handle]


@pytest.fixture(autouse=True)
def fast_sandbox(monkeypatch):
    monkeypatch.setenv('FSPLUG_SANDBOX_TIMEOUT', '5')
    monkeypatch.setenv('FSPLUG_SANDBOX_WORKERS', '2')
    sandbox.set_execution_enabled(None)
    yield
    sandbox.set_execution_enabled(None)


# ------------------------------------------------------------------ preparation
def test_every_task_is_written_with_its_metric_fields(prepared):
    out, summaries = prepared
    assert set(summaries) == {'mgsm', 'doit', 'gsmhard'}
    names = smartfed.client_names(CLIENTS)
    for name, summary in summaries.items():
        records = read_records(os.path.join(out, f'smartfed_{name}.jsonl'))
        assert len({r['id'] for r in records}) == len(records)
        assert {r['client'] for r in records} == set(names)
        for r in records:
            assert {'id', 'instruction', 'input', 'output', 'split', 'client', 'task', 'source', 'group'} <= set(r)
            assert r['task'] == name and r['split'] in ('train', 'test')
        train = [r for r in records if r['split'] == 'train']
        test = [r for r in records if r['split'] == 'test']
        assert summary['written'] == {'train': len(train), 'test': len(test)}
        assert sum(v['test'] for v in summary['per_client'].values()) == len(test)
        assert all(r.get('answers') for r in test)
        assert os.path.isfile(os.path.join(out, f'smartfed_{name}_summary.json'))
    mgsm = read_records(os.path.join(out, 'smartfed_mgsm.jsonl'))
    train = [r for r in mgsm if r['split'] == 'train']
    assert len(train) == N_TRAIN and summaries['mgsm']['raw_records']['train'] == N_TRAIN + 1   # id 1000 twice
    assert train[0]['instruction'] == readers.MATH_INSTRUCTION
    assert train[0]['output'].endswith('答案：' + train[0]['answers'][0])
    assert {r['source'] for r in mgsm} == {'math23k', 'mgsm_zh'}
    assert {r['group'] for r in train} == {'ops_1', 'ops_2', 'ops_3', 'ops_4+'}
    test = [r for r in mgsm if r['split'] == 'test']
    assert len(test) == 7 and all(r['answer_number'] == float(r['answers'][0]) for r in test)
    doit = {r['instruction']: r for r in read_records(os.path.join(out, 'smartfed_doit.jsonl')) if r['split'] == 'test'}
    assert len(doit) == 3 and summaries['doit']['raw_records']['test_without_tests'] == 1
    twice = next(r for k, r in doit.items() if 'twice' in k)
    assert twice['output'] == 'def twice(x):\n    return 2 * x'          # question_format 1: choices[0]
    check = 'def check(candidate):\n    assert candidate(4) == 8\n'
    assert twice['answers'] == [{'test': check, 'entry_point': 'twice'}]
    assert next(r for k, r in doit.items() if 'Solution' in k)['test_list'][0] == 'assert Solution().sq(3) == 9'
    gsm = read_records(os.path.join(out, 'smartfed_gsmhard.jsonl'))
    solution = next(r for r in gsm if r['split'] == 'train')['output']
    assert '```python\nx = ' in solution and '```output\n' in solution and solution.startswith('Let us compute it.')
    hard = [r for r in gsm if r['split'] == 'test']
    assert len(hard) == 5 and all(float(r['answers'][0]) == r['target'] for r in hard)
    assert all(r['output'].startswith('```python\ndef solution():') for r in hard)


def test_the_prepared_references_score_full_marks(prepared):
    """Each test record's own output, scored by its task's metric against reference_answer(record)
    (what the evaluation passes), is right; another record's output is not."""
    out, summaries = prepared
    for name, summary in summaries.items():
        test = [r for r in read_records(os.path.join(out, f'smartfed_{name}.jsonl')) if r['split'] == 'test']
        metric = GENERATION_METRICS[summary['metric']]
        references = [reference_answer(r) for r in test]
        assert metric([r['output'] for r in test], references) == 1.0, name
        shifted = [r['output'] for r in test[1:] + test[:1]]
        assert metric(shifted, references) < 1.0, name


def test_preparation_is_seeded(raw, tmp_path):
    def clients_of(out, seed, **kw):
        smartfed.prepare(raw, str(out), ['mgsm'], clients=CLIENTS, seed=seed, **kw)
        return [(r['id'], r['client']) for r in read_records(os.path.join(str(out), 'smartfed_mgsm.jsonl'))]
    first = clients_of(tmp_path / 'a', 0)
    assert clients_of(tmp_path / 'b', 0) == first
    assert sorted(clients_of(tmp_path / 'c', 5)) != sorted(first)


def test_dirichlet_partition_sizes_and_copied_test_sets(raw, tmp_path):
    out = str(tmp_path / 'out')
    summary = smartfed.prepare(raw, out, ['gsmhard'], clients=CLIENTS, partition_mode='dirichlet', alpha=0.3,
                               seed=1, train_sizes={'gsmhard': 9}, test_split='copy')['gsmhard']
    records = read_records(os.path.join(out, 'smartfed_gsmhard.jsonl'))
    assert summary['partition'] == 'dirichlet' and sum(summary['groups'].values()) == 9
    assert set(summary['groups']) <= {'code_1', 'code_2', 'code_3+'}
    assert sum(r['split'] == 'train' for r in records) == 9
    assert all(v['train'] >= 1 and v['test'] == 5 for v in summary['per_client'].values())
    assert len({r['id'] for r in records}) == len(records)
    with pytest.raises(PrepareError, match='22 requested'):
        smartfed.prepare(raw, out, ['gsmhard'], clients=CLIENTS, train_sizes={'gsmhard': 22})
    with pytest.raises(PrepareError, match='lower --clients'):
        smartfed.prepare(raw, out, ['gsmhard'], clients=50)


def test_missing_raw_files_stop_with_one_line_naming_file_and_source(raw, tmp_path):
    with pytest.raises(SystemExit, match=r'^smartfed: math23k: missing raw file .*Math_23K\.json '
                                         r'\(get it from: Math23K'):
        smartfed.main(['--raw', str(tmp_path), '--out', str(tmp_path / 'o'), '--tasks', 'mgsm'])
    shutil.copytree(os.path.join(raw, 'math23k'), str(tmp_path / 'math23k'))
    with pytest.raises(SystemExit, match=r'^smartfed: mgsm: missing raw file .*mgsm_zh\.tsv '
                                         r'\(get it from: MGSM \(github\.com/google-research/url-nlp'):
        smartfed.main(['--raw', str(tmp_path), '--out', str(tmp_path / 'o'), '--tasks', 'mgsm'])
    with pytest.raises(SystemExit, match=r'doit: missing raw file .*code_full\.json .*ChiyuSONG'):
        smartfed.main(['--raw', str(tmp_path), '--out', str(tmp_path / 'o'), '--tasks', 'doit'])
    with pytest.raises(SystemExit, match=r'missing raw file .*train_80k\.jsonl .*MathCodeInstruct'):
        smartfed.main(['--raw', str(tmp_path), '--out', str(tmp_path / 'o'), '--tasks', 'gsmhard'])
    # DoIT test records without any unit tests: names the tests file and says it is not in the release
    with pytest.raises(PrepareError, match=r'doit_tests: missing raw file .*nowhere\.jsonl .*not part of the DoIT'):
        smartfed.attach_doit_tests([{'raw_id': '0', 'index': 0}], str(tmp_path / 'nowhere.jsonl'))
    with pytest.raises(PrepareError, match='matches no record'):
        smartfed.attach_doit_tests([{'raw_id': '0', 'index': 7}], os.path.join(raw, 'doit', 'code_tests.jsonl'))


def test_cli_prints_each_task(raw, tmp_path, capsys):
    smartfed.main(['--raw', raw, '--out', str(tmp_path / 'o'), '--tasks', 'mgsm', '--clients', '2',
                   '--test-sizes', 'mgsm=4'])
    printed = capsys.readouterr().out
    assert 'mgsm: train 12 (usable 12), test 4 (usable 7) over 2 clients' in printed


def test_read_objects_accepts_array_lines_and_streams(tmp_path):
    rows = [{'a': 1}, {'a': 2}]
    for name, text in (('array.json', json.dumps(rows)), ('lines.jsonl', '\n'.join(map(json.dumps, rows))),
                       ('stream.json', '\n'.join(json.dumps(r, indent=2) for r in rows)),
                       ('wrapped.json', json.dumps({'data': rows}))):
        path = tmp_path / name
        path.write_text(text)
        assert readers.read_objects(str(path), 'math23k') == rows
    (tmp_path / 'bad.json').write_text('{"a": 1}\n{"a": ')
    with pytest.raises(PrepareError, match='line 2'):
        readers.read_objects(str(tmp_path / 'bad.json'), 'math23k')


# ------------------------------------------------------------------ the prepared files under the YAMLs
@pytest.mark.parametrize('task', ['mgsm', 'doit', 'gsmhard'])
@pytest.mark.parametrize('fedit', [False, True])
def test_prepared_file_loads_through_the_paper_yaml(prepared, task, fedit, tmp_path):
    out, summaries = prepared
    path = os.path.join(REPO, 'yamls', 'smartfed', f'paper_{task}{"_fedit" if fedit else ""}.yaml')
    cfg = load_config(path, ['data.root', out, 'federate.client_num', str(CLIENTS),
                             'federate.sample_client_num', str(CLIENTS), 'outdir', str(tmp_path / 'exp'),
                             'fsplug.results_dir', str(tmp_path / 'results')])
    assert cfg.fsplug.method == ('fedavg' if fedit else 'smartfed')
    assert list(cfg.fsplug.eval.gen_metrics) == [summaries[task]['metric']]
    assert cfg.model.type.startswith('meta-llama/Llama-2-7b-hf') and cfg.use_gpu
    if not fedit:
        assert cfg.fsplug.smartfed.budget == 32 and len(cfg.fsplug.model.library.adapters) == 2
    assert len(load_records(os.path.join(out, f'smartfed_{task}.jsonl'))) == sum(summaries[task]['written'].values())
    federated = build_federated_records(cfg)
    assert federated.client_num == CLIENTS
    assert [federated.client_names[c] for c in range(1, CLIENTS + 1)] == smartfed.client_names(CLIENTS)
    for cid, splits in federated.clients.items():
        assert splits['train'] and all(r['split'] == 'train' for r in splits['train'])
        assert all(r['split'] == 'test' and r['client'] == federated.client_names[cid] for r in splits['test'])
    total_test = sum(len(s['test']) for s in federated.clients.values())
    assert total_test == summaries[task]['written']['test']


# ------------------------------------------------------------------ mgsm_accuracy
@pytest.mark.parametrize('text, number', [
    ('答案：18元。\n问题：小明有3个苹果', 18.0),         # the line after the marker, not what follows
    ('一共是 1,234.5 元', 1234.5), ('结果是１８', 18.0), ('x=-5', -5.0), ('10-3=7', 7.0),
    ('The answer is 18 + 2 = 20', 20.0), (r'so \boxed{\frac{3}{4}}, not 7', 0.75), ('#### 72', 72.0),
    ('$1,000,000', 1e6), ('50%', 50.0), ('没有数字', None), ('', None)])
def test_final_number(text, number):
    assert final_number(text) == number


def test_mgsm_accuracy_correct_wrong_and_malformed():
    references = [['18'], '18', ['1,234'], [18], ['n/a']]
    assert mgsm_accuracy(['答案：18', '答案：18.000', '答案：1234', '答案：18.00001', '答案：5'], references) == 0.8
    assert mgsm_accuracy(['答案：17', '', 'no number at all', '答案：19', '答案：5'], references) == 0.0
    assert math.isnan(mgsm_accuracy([], []))
    with pytest.raises(ValueError, match='2 predictions but 1 references'):
        mgsm_accuracy(['1', '2'], ['1'])
    assert parse_number(3) == 3.0 and parse_number(True) is None and parse_number('3/0') is None


# ------------------------------------------------------------------ pass_at_1 and execution_accuracy
def test_code_blocks():
    text = ('解法：\n```python\ndef f():\n    return 1\n```\n说明\n```\nprint(2)\n```\n'
            '```java\nint x;\n```\n```py\nunterminated')
    assert code_blocks(text) == ['def f():\n    return 1\n', 'print(2)\n', 'unterminated']
    assert code_blocks('x = 1') == ['x = 1'] and code_blocks('  ') == []


def test_pass_at_1_correct_wrong_and_malformed():
    spec = [{'test': 'def check(candidate):\n    assert candidate(1, 2) == 3\n', 'entry_point': 'add'}]
    good = '```python\ndef add(a, b):\n    return a + b\n```'
    assert pass_at_1([good, 'def add(a, b):\n    return a + b'], [spec, json.dumps(spec[0])]) == 1.0
    wrong = ['def add(a, b):\n    return a - b',                          # fails the test
             'def add(a, b) return',                                      # syntax error
             'import sys\ndef add(a, b):\n    return 0\nsys.exit(0)',     # exits before the tests
             'import os\nos._exit(0)',                                    # leaves without a report
             '说明文字，没有代码']                                            # no code at all
    assert pass_at_1(wrong, [spec] * len(wrong)) == 0.0
    assert pass_at_1([good], [{}]) == 0.0                                 # a reference without tests
    assert pass_at_1(['x = 1'], [{'test_list': ['assert x == 1'], 'test_setup': 'import math'}]) == 1.0
    assert math.isnan(pass_at_1([], []))


def test_execution_accuracy_correct_wrong_and_malformed(monkeypatch):
    monkeypatch.setenv('FSPLUG_SANDBOX_TIMEOUT', '2.5')   # for the endless loop below
    predictions = [
        '```python\ndef solution():\n    return 1234564\n```',                         # PAL style
        'Step 1\n```python\nx = 1234567\n```\n```output\n1234567\n```\n```python\nx - 3\n```',   # notebook cells
        '```python\nprint(1/0)\n```\n```python\nprint(1234564.0)\n```',               # an error ends its cell only
        '```python\nprint(1234565)\n```',                                             # wrong number
        'The answer is 1234564',                                                       # no code: not executed
        '```python\nwhile True:\n    pass\n```']                                       # times out
    references = [['1234564.0']] * len(predictions)
    assert execution_accuracy(predictions, references) == pytest.approx(3 / 6)
    assert execution_accuracy(['```python\nprint("no number")\n```'], [['1']]) == 0.0
    assert math.isnan(execution_accuracy([], []))


def test_execution_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(sandbox.ENV_SWITCH, '0')
    assert not sandbox.execution_enabled()
    assert math.isnan(pass_at_1(['x = 1'], [{'test': 'assert x == 1'}]))
    assert math.isnan(execution_accuracy(['```python\nprint(1)\n```'], [['1']]))
    assert sandbox.run_python('print(1)').status == 'disabled'
    monkeypatch.setenv(sandbox.ENV_SWITCH, '1')
    sandbox.set_execution_enabled(False)
    assert not sandbox.execution_enabled()


# ------------------------------------------------------------------ the sandbox
def test_timeout_kills_an_infinite_loop():
    start = time.monotonic()
    result = sandbox.run_python('while True:\n    pass', limits=sandbox.SandboxLimits(timeout_s=1.5))
    assert result.status in ('timeout', 'killed') and not result.ok
    assert time.monotonic() - start < 10


def test_cpu_limit_ends_a_busy_program_before_the_wall_clock():
    result = sandbox.run_python('while True:\n    pass', limits=sandbox.SandboxLimits(timeout_s=20, cpu_s=1))
    assert result.status == 'killed'


def test_memory_limit():
    result = sandbox.run_python('block = bytearray(3 * 1024 ** 3)', limits=FAST)
    assert result.status == 'error' and 'MemoryError' in result.stderr


def test_file_size_limit():
    result = sandbox.run_python("open('big', 'wb').write(b'x' * (4 << 20))",
                                limits=sandbox.SandboxLimits(timeout_s=5, file_mb=1))
    assert not result.ok


def test_writes_stay_in_the_working_directory(tmp_path):
    target = tmp_path / 'escaped.txt'
    for code in (f"open({str(target)!r}, 'w').write('x')",
                 f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                 f"import shutil\nshutil.copyfile('/dev/null', {str(target)!r})",
                 f"import os\nos.remove({str(tmp_path)!r})",
                 "open('../escaped.txt', 'w').write('x')"):
        result = sandbox.run_python(code, limits=FAST)
        assert result.status == 'error' and 'PermissionError: sandbox' in result.stderr, code
    assert not target.exists() and tmp_path.exists()
    inside = sandbox.run_python("open('note.txt', 'w').write('hi')\nassert open('note.txt').read() == 'hi'",
                                limits=FAST)
    assert inside.ok


def test_secrets_are_out_of_sight(tmp_path, monkeypatch):
    monkeypatch.setenv('FSPLUG_TEST_SECRET', 'hunter2-token')
    secret_file = tmp_path / 'secret.txt'
    secret_file.write_text('hunter2-file')
    env = sandbox.run_python('import os\nprint(sorted(os.environ.items()))', limits=FAST)
    assert env.ok and 'hunter2' not in env.stdout and 'FSPLUG_TEST_SECRET' not in env.stdout
    assert {name for name, _ in eval(env.stdout)} <= set(sandbox.child_environment('x')) | {'LC_CTYPE'}
    for code in (f'print(open({str(secret_file)!r}).read())',
                 f'import os\nprint(os.listdir({str(tmp_path)!r}))',
                 f"print(open('/proc/{os.getpid()}/environ', 'rb').read())"):
        result = sandbox.run_python(code, limits=FAST)
        assert result.status == 'error' and 'hunter2' not in result.stdout + result.stderr, code


def test_processes_sockets_and_ctypes_loading_are_refused():
    for code in ("import subprocess\nsubprocess.run(['true'])", "import os\nos.system('true')",
                 'import os\nos.fork()', 'import socket\nsocket.socket()',
                 "import ctypes\nctypes.CDLL('libc.so.6')", 'import ctypes\nctypes.memmove(0, 0, 1)',
                 f'import os\nos.kill({os.getpid()}, 0)'):
        result = sandbox.run_python(code, limits=FAST)
        assert result.status == 'error' and 'PermissionError' in result.stderr, code


def test_libraries_the_programs_use_still_import():
    result = sandbox.run_python(['import math, fractions\nmath.comb(5, 2)',
                                 'import numpy as np\nint(np.arange(4).sum())',
                                 'def solution():\n    return fractions.Fraction(7, 2)'],
                                mode='notebook', limits=sandbox.SandboxLimits(timeout_s=20))
    assert result.ok and result.value == 3.5 and result.stdout.split() == ['10', '6']


def test_a_long_output_keeps_its_report():
    result = sandbox.run_python('for i in range(100000):\n    print(i)', tests='assert True', limits=FAST)
    assert result.ok and result.stdout.startswith('0\n1\n') and result.stdout.rstrip().endswith('99999')
    assert len(result.stdout) < 2 * sandbox.SandboxLimits().max_output_chars


def test_run_many_keeps_the_order():
    results = sandbox.run_many([{'code': f'print({i})'} for i in range(5)], limits=FAST, workers=2)
    assert [r.stdout.strip() for r in results] == [str(i) for i in range(5)]


def test_a_run_reports_the_metric_through_the_evaluation(prepared, tmp_path):
    """One round of the tiny Llama on the prepared DoIT file: the clients generate, the
    evaluation hands reference_answer(record) (the test spec) to pass_at_1, which runs the
    generated code in the sandbox and reports test_pass_at_1."""
    from fs_plugins.sim.runner import run_embedded
    out, _ = prepared
    cfg = load_config(os.path.join(REPO, 'yamls', 'fedavg', 'tiny.yaml'), [
        'data.root', out, 'data.type', 'smartfed_doit.jsonl@fsplug', 'federate.client_num', str(CLIENTS),
        'federate.sample_client_num', str(CLIENTS), 'federate.total_round_num', '1',
        'train.local_update_steps', '1', 'llm.tok_len', '512', 'fsplug.data.split_field', 'client',
        'fsplug.data.split_from_records', 'True', 'fsplug.data.prompt', 'alpaca', 'fsplug.eval.generate', 'True',
        'fsplug.eval.max_new_tokens', '4', 'fsplug.eval.gen_metrics', "['pass_at_1']",
        'outdir', str(tmp_path / 'exp'), 'fsplug.results_dir', str(tmp_path / 'results')])
    run_embedded(cfg)
    rows = [r for r in read_records(str(tmp_path / 'results' / 'results.jsonl')) if r['kind'] == 'eval']
    assert len(rows) == CLIENTS and all(r['test_pass_at_1'] == 0.0 for r in rows)   # random weights: no pass

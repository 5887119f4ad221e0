"""FS-LLM's own baseline YAMLs plus `fsplug.method` run the plugin's methods through real
FederatedScope (`python federatedscope/main.py --cfg`), with local copies of FS-LLM's data
files in their own layouts and the tiny model instead of LLaMA-7B (docs/fs_llm.md).

The shipped yamls/fs_llm/ files are FS-LLM's YAMLs unchanged plus the docs page's one-line
addition, checked against the FS installed here. Skipped, with the reason, without FS."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import FS_ONLY_YAMLS, REPO, env_with_tests

pytestmark = pytest.mark.fs   # the fs tier: skipped, with the reason, without FederatedScope

DOCS_PAGE = os.path.join(REPO, 'docs', 'fs_llm.md')
SHIPPED = sorted(os.listdir(os.path.join(REPO, FS_ONLY_YAMLS)))
RECORDS_PER_FILE = 3000   # FS-LLM's splits [0.998, 0.001, 0.001] leave 1 validation record per client


def fs_root() -> str:
    import federatedscope
    return os.path.dirname(os.path.dirname(federatedscope.__file__))


def _read_yaml(path):
    with open(path, encoding='utf-8') as handle:
        return yaml.safe_load(handle)


def fs_llm_source(shipped: str) -> str:
    """The FS-LLM baseline YAML a shipped file names in its first line."""
    with open(os.path.join(REPO, FS_ONLY_YAMLS, shipped), encoding='utf-8') as handle:
        first = handle.readline()
    return re.search(r'(federatedscope/llm/baseline/\S+\.yaml)', first).group(1)


def docs_addition() -> dict:
    """The lines the docs page's YAML diff adds to an FS-LLM YAML, parsed."""
    with open(DOCS_PAGE, encoding='utf-8') as handle:
        block = re.search(r'```diff\n(.*?)```', handle.read(), re.S).group(1)
    added = [line[1:] for line in block.splitlines() if line.startswith('+')]
    return yaml.safe_load('\n'.join(added))


@pytest.mark.parametrize('shipped', SHIPPED)
def test_shipped_yaml_is_fs_llms_plus_the_documented_line(shipped):
    ours = _read_yaml(os.path.join(REPO, FS_ONLY_YAMLS, shipped))
    theirs = _read_yaml(os.path.join(fs_root(), fs_llm_source(shipped)))
    addition = docs_addition()
    assert set(addition) == {'fsplug'} and set(addition['fsplug']) == {'method'}
    method = ours.pop('fsplug')
    assert method == {'method': method['method']}
    assert ours == theirs


def _instruction_records(n):
    ops = [('Add', lambda a, b: a + b), ('Multiply', lambda a, b: a * b)]
    for i in range(n):
        name, op = ops[i % 2]
        a, b = i % 7 + 1, i % 5 + 2
        yield name, f'{a} and {b}', str(op(a, b)), ['math', 'open_qa', 'brainstorming'][i % 3]


def write_fs_llm_files(root) -> None:
    """FS-LLM's files for alpaca, dolly-15k and gsm8k, in their own field layouts."""
    os.makedirs(root, exist_ok=True)
    records = list(_instruction_records(RECORDS_PER_FILE))
    with open(os.path.join(root, 'alpaca_data.json'), 'w') as handle:
        json.dump([{'instruction': f'{n} the numbers.', 'input': x, 'output': y}
                   for n, x, y, _ in records], handle)
    with open(os.path.join(root, 'databricks-dolly-15k.jsonl'), 'w') as handle:
        for n, x, y, c in records:
            handle.write(json.dumps({'instruction': f'{n} the numbers.', 'context': x,
                                     'response': y, 'category': c}) + '\n')
    with open(os.path.join(root, 'gsm8k_train.jsonl'), 'w') as handle:
        for n, x, y, _ in records:
            handle.write(json.dumps({'question': f'{n} {x}.',
                                     'answer': f'{n} {x} gives {y}.\n#### {y}'}) + '\n')


def run_fs_llm_yaml(shipped, tmp_path):
    """The shipped YAML through FS's main, overriding only the model (the tiny Llama), the data
    folder (local copies), the run's length and where its files go."""
    data_root = tmp_path / 'data'
    write_fs_llm_files(data_root)
    opts = ['model.type', 'tiny-llama@huggingface_llm', 'fsplug.model.builder', 'tiny_llama',
            'data.root', str(data_root), 'federate.total_round_num', '1',
            'train.local_update_steps', '2', 'llm.tok_len', '256',
            'outdir', str(tmp_path / 'exp'), 'fsplug.results_dir', str(tmp_path / 'results'),
            'federate.save_to', str(tmp_path / 'global.ckpt')]
    proc = subprocess.run([sys.executable, 'federatedscope/main.py', '--cfg',
                           os.path.join(REPO, FS_ONLY_YAMLS, shipped)] + opts,
                          cwd=fs_root(), env=env_with_tests(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp_path / 'results'


@pytest.mark.parametrize('shipped', SHIPPED)
def test_fs_llm_yaml_runs_the_method_through_federatedscope(shipped, tmp_path):
    results = run_fs_llm_yaml(shipped, tmp_path)
    with open(results / 'results.jsonl') as handle:
        rows = [json.loads(line) for line in handle]
    with open(results / 'run_info.json') as handle:
        config = json.load(handle)['config']
    lora = config['fsplug']['model']['lora']
    # llm.adapter.args of the FS-LLM YAML, train.is_enable_half and data.splits, as mapped
    assert (lora['r'], lora['alpha'], lora['dropout']) == (8, 16, 0.05)
    assert config['fsplug']['model']['dtype'] == 'float16'
    assert config['trainer']['type'] == 'fsplug' and config['federate']['method'] == 'fsplug'
    train = [r for r in rows if r['kind'] == 'train']
    evaluated = [r for r in rows if r['kind'] == 'eval']
    assert len(train) == 3 and evaluated
    assert all('val_avg_loss' in r and 'test_avg_loss' in r for r in evaluated)
    saved = torch.load(tmp_path / 'global.ckpt', map_location='cpu')
    assert saved['model'] and all(t.dtype == torch.float32 for t in saved['model'].values())

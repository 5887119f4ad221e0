"""docs/adding_a_method.md stays true: its tables name every hook and attribute of the `Method`
contract (and nothing else), its code block is docs/examples/damped_fedsa.py, and that
example method runs end to end in the embedded runner and under FederatedScope standalone
(the same numbers), registered from outside the package through fsplug.import_modules."""
import ast
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import REPO, env_with_tests, tiny_config, write_yaml

from fs_plugins.methods import base

GUIDE = os.path.join(REPO, 'docs', 'adding_a_method.md')
EXAMPLES = os.path.join(REPO, 'docs', 'examples')
EXAMPLE_MODULE = 'damped_fedsa'
EXAMPLE = {'fsplug': {'import_modules': [EXAMPLE_MODULE], 'damped_fedsa': {'server_lr': 0.5}}}
CONTRACT_HEADING = '## 2. The `Method` contract'
# the guide's code block that must equal a file: a comment naming the file, then the block
EMBEDDED_FILE = re.compile(r'^<!-- (docs/examples/[\w./-]+) .*?-->\n```python\n(.*?)^```$',
                           re.MULTILINE | re.DOTALL)


def _guide() -> str:
    with open(GUIDE, encoding='utf-8') as handle:
        return handle.read()


# ------------------------------------------------------------------ the guide itself
def contract_members() -> set[str]:
    """The public hooks and class attributes of base.Method (also one only annotated), and
    the instance attributes its __init__ sets."""
    members = {n for n in [*dir(base.Method), *vars(base.Method).get('__annotations__', {})]
               if not n.startswith('_')}
    init = ast.parse(textwrap.dedent(inspect.getsource(base.Method.__init__)))
    for node in ast.walk(init):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        members.update(t.attr for t in targets
                       if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                       and t.value.id == 'self' and not t.attr.startswith('_'))
    return members


def documented_members() -> set[str]:
    """The names the guide's contract section lists: the code span opening the first cell of
    each table row ('| `aggregate(server_state, updates)` | ...' -> 'aggregate')."""
    text = _guide()
    assert CONTRACT_HEADING in text, f"{GUIDE}: no section '{CONTRACT_HEADING}'"
    section = text.split(CONTRACT_HEADING, 1)[1].split('\n## ', 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith('| `'):
            names.update(re.findall(r'`([A-Za-z_]\w*)', line.split('|')[1]))
    return names


def test_the_guide_lists_every_hook_and_attribute_of_the_method_contract():
    members, documented = contract_members(), documented_members()
    assert {'aggregate', 'is_shared', 'gradient_free', 'config_class', 'hparams'} <= members
    missing, stale = sorted(members - documented), sorted(documented - members)
    assert not missing, (f'base.Method has {missing}, which docs/adding_a_method.md does not '
                         f"list: add a row each to its section '{CONTRACT_HEADING}'")
    assert not stale, (f"docs/adding_a_method.md lists {stale} in '{CONTRACT_HEADING}', which "
                       f'base.Method does not have: remove or rename the rows')


def test_the_guides_code_block_is_the_example_file():
    blocks = EMBEDDED_FILE.findall(_guide())
    assert any(path.endswith(f'/{EXAMPLE_MODULE}.py') for path, _ in blocks), \
        f'docs/adding_a_method.md embeds no docs/examples/{EXAMPLE_MODULE}.py'
    for path, block in blocks:
        with open(os.path.join(REPO, path), encoding='utf-8') as handle:
            assert block == handle.read(), \
                f"docs/adding_a_method.md: the code block after '<!-- {path}' differs from {path}"


def test_the_guide_names_the_generators_and_the_suites_that_pick_a_method_up():
    text = _guide()
    for needed in ('scripts/gen_reference.py', 'scripts/gen_distributed.py'):
        assert f'python {needed}' in text, needed
    suites = set(re.findall(r'`(tests/test_\w+\.py)`', text))
    for suite in suites:
        assert os.path.isfile(os.path.join(REPO, suite)), f'the guide names a missing {suite}'
    # every suite that reads the registry or walks yamls/ for its cases is named
    automatic = set()
    for name in os.listdir(os.path.join(REPO, 'tests')):
        if name.startswith('test_') and name.endswith('.py') and name != os.path.basename(__file__):
            with open(os.path.join(REPO, 'tests', name), encoding='utf-8') as handle:
                source = handle.read()
            if re.search(r"sorted\(all_methods\(\)|os\.path\.join\(REPO, 'yamls', '\*\*'|"
                         r"gen_reference\.py|gen_distributed\.py", source):
                automatic.add(f'tests/{name}')
    assert automatic and not automatic - suites, \
        f'docs/adding_a_method.md does not name {sorted(automatic - suites)}'


# ------------------------------------------------------------------ the example, run
# In subprocesses, as a contributor runs it: registering the example in this process would
# show it to the suites that list every registered method (they would look for its tiny YAML).
def example_env(**extra) -> dict:
    """docs/examples importable (fsplug.import_modules names the module); tests/ too."""
    env = env_with_tests(**extra)
    env['PYTHONPATH'] = os.pathsep.join([EXAMPLES, env['PYTHONPATH']])
    return env


def example_cfg(folder, results: str, **options) -> dict:
    cfg = tiny_config(folder, 'damped_fedsa', rounds=2, steps=2, **EXAMPLE)
    cfg['fsplug']['damped_fedsa'].update(options)
    cfg['fsplug']['results_dir'] = str(folder / results)
    return cfg


def run_cli(*args, **env):
    return subprocess.run([sys.executable, '-m', 'fs_plugins.commands.cli', *args],
                          env=example_env(**env), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope='module')
def embedded_run(tmp_path_factory):
    """The example's tiny run (2 rounds, 2 steps, 4 clients) through `fs-plugins run --runner
    embedded`, on one thread as FS standalone runs (the same float summation order)."""
    folder = tmp_path_factory.mktemp('damped_fedsa')
    cfg = example_cfg(folder, 'embedded')
    proc = run_cli('run', '--runner', 'embedded', '--cfg', write_yaml(folder / 'c.yaml', cfg),
                   OMP_NUM_THREADS='1')
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cfg, str(folder / 'embedded')


def read_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, 'results.jsonl'), encoding='utf-8') as handle:
        return [json.loads(line) for line in handle]


def saved_adapter(run_dir: str, folder: str) -> dict[str, torch.Tensor]:
    import safetensors.torch
    return safetensors.torch.load_file(
        os.path.join(run_dir, 'adapters', folder, 'adapter_model.safetensors'))


_CHECKS = r"""
import sys

import torch

from fs_plugins.core.errors import ConfigError
from fs_plugins.methods import ClientUpdate, get_method_class
from fs_plugins.run.config import load_config

good, bad = sys.argv[1:]
cfg = load_config(good)
assert type(cfg.fsplug.damped_fedsa.server_lr) is float and cfg.fsplug.damped_fedsa.server_lr == 0.5
try:
    load_config(bad)
    raise AssertionError('a config with server_lr = 0 and the key server_rl loaded')
except ConfigError as exc:
    print('\n'.join(exc.problems))
# aggregate against the formula on tiny tensors: g + lr * (sum n_k x_k / sum n_k - g)
method = get_method_class('damped_fedsa')(cfg)
state = method.init_server_state({'a': torch.tensor([1.0, -2.0]), 'other': torch.ones(1)})
updates = [ClientUpdate(1, 1, {'a': torch.tensor([3.0, 2.0])}),
           ClientUpdate(2, 3, {'a': torch.tensor([-1.0, 6.0])})]
merged = method.aggregate(state, updates)['global']
average = (1 * updates[0].shared['a'] + 3 * updates[1].shared['a']) / 4
torch.testing.assert_close(merged['a'], state['global']['a'] + 0.5 * (average - state['global']['a']))
assert torch.equal(merged['other'], torch.ones(1))   # not sent this round: kept
"""


@pytest.mark.slow
def test_the_example_checks_its_option_and_aggregates_a_damped_average(tmp_path):
    """fsplug.damped_fedsa.server_lr is a typed, range-checked key (a misspelt key is named);
    `aggregate` is the damped weighted average on tiny tensors."""
    good = write_yaml(tmp_path / 'good.yaml', example_cfg(tmp_path, 'r'))
    bad = write_yaml(tmp_path / 'bad.yaml', example_cfg(tmp_path, 'r', server_lr=0, server_rl=1))
    proc = subprocess.run([sys.executable, '-c', _CHECKS, good, bad], env=example_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert 'fsplug.damped_fedsa.server_lr = 0: must be > 0' in proc.stdout
    assert 'fsplug.damped_fedsa.server_rl' in proc.stdout


@pytest.mark.slow
def test_the_example_runs_in_the_embedded_runner(embedded_run):
    """Only lora_A travels; every client ends on the global lora_A and keeps its own lora_B;
    client_metrics' lora_B_norm is in every train row."""
    cfg, run_dir = embedded_run
    rows = read_rows(run_dir)
    train = [r for r in rows if r['kind'] == 'train']
    assert sorted((r['round'], r['client']) for r in train) == [(t, c) for t in (0, 1) for c in (1, 2, 3, 4)]
    assert all(r['lora_B_norm'] > 0 for r in train)
    clients = {c: saved_adapter(run_dir, f'client_{c}') for c in (1, 2, 3, 4)}
    a_names = sorted(n for n in clients[1] if 'lora_A' in n)
    b_names = sorted(n for n in clients[1] if 'lora_B' in n)
    assert a_names and len(a_names) == len(b_names)
    a_bytes = sum(clients[1][n].numel() * 4 for n in a_names)     # float32
    assert all(r['bytes_up'] == a_bytes and r['bytes_down'] == a_bytes for r in train)
    for cid, tensors in clients.items():
        assert all(torch.equal(tensors[n], clients[1][n]) for n in a_names), cid
        if cid != 1:
            assert not any(torch.equal(tensors[n], clients[1][n]) for n in b_names), cid


@pytest.mark.fs
def test_the_example_under_fs_standalone_gives_the_embedded_numbers(tmp_path, embedded_run):
    """`fs-plugins run --runner fs` (FS standalone): the embedded run's rows, number for number."""
    cfg, embedded_dir = embedded_run
    cfg = json.loads(json.dumps(cfg))
    cfg['fsplug']['results_dir'] = str(tmp_path / 'fs')
    proc = run_cli('run', '--runner', 'fs', '--cfg', write_yaml(tmp_path / 'fs.yaml', cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'running through FederatedScope' in proc.stdout + proc.stderr
    fs_rows = read_rows(str(tmp_path / 'fs'))
    assert any('lora_B_norm' in r for r in fs_rows)
    from test_fs_integration import assert_same_numbers
    assert_same_numbers(fs_rows, read_rows(embedded_dir))

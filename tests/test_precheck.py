"""The config pre-check before torch / transformers are imported (fs_plugins.schema.precheck):
a mistake in a YAML or on the command line ends in the full check's own error within about a
second, without importing torch; the method index it reads is generated from the registry.

`python scripts/gen_reference.py` regenerates fs_plugins/schema/method_index.py (with docs/reference.md)."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml
from helpers import REPO, env_with_tests, shipped_yamls, tiny_config, write_yaml

from fs_plugins.commands.cli import main
from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.registry import all_methods
from fs_plugins.run.config import load_config
from fs_plugins.schema import method_index
from fs_plugins.schema import precheck as pre
from fs_plugins.schema.fs_llm import leaves
from fs_plugins.schema.options import describe
from fs_plugins.schema.placeholders import is_placeholder
from fs_plugins.schema.validate import fs_defaults

REGENERATE = 'python scripts/gen_reference.py'


def problems_of(check, *args, **kwargs) -> list[str]:
    try:
        check(*args, **kwargs)
    except ConfigError as exc:
        return exc.problems
    return []


def typo_yaml(tmp_path) -> str:
    """A tiny YAML with a misspelt FS key and a misspelt method name."""
    cfg = tiny_config(tmp_path)
    cfg['federate']['total_round_nm'] = cfg['federate'].pop('total_round_num')
    cfg['fsplug']['method'] = 'fedmol'
    return write_yaml(tmp_path / 'typo.yaml', cfg)


# ------------------------------------------------------------------ the index

def shipped_methods() -> dict:
    """The package's methods (test-only methods that other test modules register left out)."""
    return {name: cls for name, cls in all_methods().items() if cls.__module__.startswith('fs_plugins.')}


def full_check_problems(*args) -> list[str]:
    """The full check's problems as a fresh process sees them: without the test-only methods
    that other test modules registered in this one (the pre-check reads the shipped index)."""
    test_only = sorted(set(all_methods()) - set(shipped_methods()))
    lines = problems_of(load_config, *args)
    for name in test_only:
        lines = [line.replace(f', {name},', ',').replace(f', {name}.', '.') for line in lines]
    return lines


def test_the_method_index_is_generated_from_the_registry():
    with open(pre.INDEX_PATH, encoding='utf-8') as handle:
        assert handle.read() == pre.render_index(shipped_methods()), \
            f'fs_plugins/schema/method_index.py is stale: run `{REGENERATE}`'


def test_the_index_describes_every_method_as_its_config_class_does():
    rebuilt = pre.index_methods()
    assert sorted(rebuilt) == sorted(shipped_methods())
    for name, cls in shipped_methods().items():
        columns = ('key', 'type', 'default', 'allowed')
        expected = [tuple(row[c] for c in columns) for row in describe(cls.config_class, name)]
        assert [tuple(row[c] for c in columns) for row in describe(rebuilt[name], name)] == expected


def test_the_source_of_the_methods_declares_what_the_index_holds():
    """The staleness test the pre-check runs before refusing a config (ast, no import)."""
    assert pre.index_matches_sources()
    without_method = {k: v for k, v in method_index.METHODS.items() if k != 'fedmole'}
    assert not pre.index_matches_sources(without_method)
    without_option = dict(method_index.METHODS,
                          fedmole={k: v for k, v in method_index.METHODS['fedmole'].items()
                                   if k != 'top_k'})
    assert not pre.index_matches_sources(without_option)


def test_a_stale_index_leaves_the_decision_to_the_full_check(tmp_path, monkeypatch):
    path = typo_yaml(tmp_path)
    assert problems_of(pre.precheck, path)
    monkeypatch.setattr(pre, 'index_matches_sources', lambda *a, **k: False)
    assert problems_of(pre.precheck, path) == []


# ------------------------------------------------------------------ what it checks

@pytest.mark.parametrize('path', shipped_yamls())
def test_every_shipped_yaml_passes(path):
    with open(os.path.join(REPO, path), encoding='utf-8') as handle:
        plain = yaml.safe_load(handle) or {}
    if all(str(k).startswith('client_') for k in plain):
        return   # a --client_cfg file
    pre.precheck(os.path.join(REPO, path), placeholders=False)
    method = (plain.get('fsplug') or {}).get('method')
    # a placeholder under another method's node (a baseline's public set) is not read by the run
    placeholders = [key for key, value in leaves(plain) if is_placeholder(value)
                    and not (key.startswith('fsplug.') and key.split('.')[1] in method_index.METHODS
                             and key.split('.')[1] != method)]
    if placeholders:   # the paper-scale YAMLs: refused until the user fills them in
        assert [p.split(':')[0] for p in problems_of(pre.precheck, os.path.join(REPO, path))] \
            == placeholders


def test_a_placeholder_left_is_refused_naming_the_key_and_where_it_was_set(tmp_path, capsys):
    """Before anything loads: the YAML's, the command line's and the --client_cfg file's."""
    path = write_yaml(tmp_path / 'c.yaml', tiny_config(
        tmp_path, 'fedmosaic', fsplug={'fedmosaic': {'alignment_data': '/path/to/public.jsonl'}}))
    problems = problems_of(pre.precheck, path, ['data.root', '/path/to/my_data'])
    # another method reads no fsplug.fedmosaic key: its placeholder does not stop that run
    assert problems_of(pre.precheck, path, ['fsplug.method', 'fedavg']) == []
    assert sorted(problems) == [
        "data.root: '/path/to/my_data' is a placeholder for a file or model you supply: replace it "
        "on the command line",
        f"fsplug.fedmosaic.alignment_data: '/path/to/public.jsonl' is a placeholder for a file or "
        f"model you supply: replace it in {path} or give 'fsplug.fedmosaic.alignment_data <value>' "
        f"on the command line"]
    # a value given on the command line replaces the YAML's placeholder
    assert problems_of(pre.precheck, path, ['fsplug.fedmosaic.alignment_data', 'public.jsonl']) == []
    clients = write_yaml(tmp_path / 'clients.yaml', {'client_2': {'model': {'type': '/path/to/big@fsplug_llm'}}})
    assert main(['run', '--cfg', path, '--client_cfg', clients, '--runner', 'embedded',
                 'fsplug.fedmosaic.alignment_data', 'public.jsonl']) == 2
    assert capsys.readouterr().err.splitlines()[1:] == [
        f"  client_2.model.type: '/path/to/big@fsplug_llm' is a placeholder for a file or model "
        f"you supply: replace it in {clients}"]


def test_a_placeholder_does_not_hide_another_mistake():
    drake = os.path.join(REPO, 'yamls', 'fedmosaic', 'drake_dynamic.yaml')
    problems = problems_of(pre.precheck, drake, ['federate.total_round_nmu', '2'])
    assert 'federate.total_round_nmu' in problems[0] and len(problems) == 3   # + the two placeholders


def test_the_tiny_audit_of_a_paper_yaml_passes_its_placeholders():
    """`audit --tiny` swaps the model and data for tiny ones: the placeholders do not matter."""
    drake = os.path.join(REPO, 'yamls', 'fedmosaic', 'drake_dynamic.yaml')
    assert problems_of(pre.precheck, drake, placeholders=False) == []
    assert len(problems_of(pre.precheck, drake)) == 2


def test_a_misspelt_method_and_key_fail_with_the_full_checks_words(tmp_path):
    path = typo_yaml(tmp_path)
    before = problems_of(pre.precheck, path)
    assert before == full_check_problems(path)
    assert "Did you mean 'federate.total_round_num'?" in before[0]
    assert before[1].startswith(f"{path}: fsplug.method = 'fedmol': not one of: , ")
    assert ', ditto, ' in before[1] and ', fedmole, ' in before[1]
    assert before[1].endswith(". Did you mean 'fedmole'?")


# test_config's mistakes: those of a registry's choices wait for the full check
from test_config import MUTATIONS  # noqa: E402

REGISTRY_KEYS = ('fsplug.model.adapter', 'fsplug.eval.gen_metrics', 'data.splitter')


@pytest.mark.parametrize('opts,expected', MUTATIONS, ids=[m[0][0] + '=' + m[0][1] for m in MUTATIONS])
def test_the_mistakes_of_test_config(opts, expected):
    base = os.path.join(REPO, 'yamls', 'fedavg', 'tiny.yaml')
    before, after = problems_of(pre.precheck, base, opts), full_check_problems(base, opts)
    if opts[0] in REGISTRY_KEYS:
        assert before == []
    else:
        assert before == after and expected in before[0]


def test_keys_a_module_to_import_may_register_pass(tmp_path):
    cfg = tiny_config(tmp_path, method='toy_phased')
    cfg['fsplug'].update(import_modules=['toy_methods'], toy_phased={'first_phase_steps': 2})
    path = write_yaml(tmp_path / 'toy.yaml', cfg)
    assert problems_of(pre.precheck, path) == []
    assert problems_of(pre.precheck, path, ['fsplug.model.lora.r', '0']) == \
        ['command line: fsplug.model.lora.r = 0: must be >= 1']


def test_under_federatedscope_its_own_keys_come_from_its_sources(tmp_path, monkeypatch):
    """Under FS the pre-check knows FS's keys from FS's config modules, read with `ast` (a
    misspelt FS key fails before the imports, as with the embedded runner); where those cannot
    be read, FS's keys are left to FS. FS's merges name no source."""
    fs_key = write_yaml(tmp_path / 'fs_key.yaml', tiny_config(tmp_path, federate={'master_port': 5}))
    typo = write_yaml(tmp_path / 'typo.yaml', tiny_config(tmp_path, federate={'master_prot': 5}))
    def tree_of(values):
        return {k: tree_of(v) if isinstance(v, dict) else None for k, v in values.items()}
    tree = tree_of(fs_defaults())
    tree['federate']['master_port'] = None
    monkeypatch.setattr(pre, 'fs_source_key_tree', lambda: tree)
    assert problems_of(pre.precheck, fs_key, fs=True) == []
    assert problems_of(pre.precheck, typo, fs=True) == [
        "Unknown config key 'federate.master_prot'. Did you mean 'federate.master_port'? "
        f"Allowed keys under 'federate': {', '.join(sorted(tree['federate']))}"]
    monkeypatch.setattr(pre, 'fs_source_key_tree', lambda: None)
    assert problems_of(pre.precheck, typo, fs=True) == []


def test_fs_key_tree_of_config_sources(tmp_path):
    """`cfg.a.b = value` statements build the tree; CN(new_allowed=True) marks an open node."""
    from fs_plugins.schema.fs_source_keys import key_tree_of_sources
    source = tmp_path / 'cfg_x.py'
    source.write_text('def extend(cfg):\n    cfg.train = CN()\n    cfg.train.lr = 0.1\n'
                      '    cfg.train.optimizer = CN(new_allowed=True)\n    cfg.outdir = "exp"\n'
                      '    other.thing = 1\n')
    assert key_tree_of_sources([str(source)]) == \
        {'train': {'lr': None, 'optimizer': {'__open__': True}}, 'outdir': None}
    assert key_tree_of_sources([str(tmp_path / 'missing.py')]) is None
    redefined = tmp_path / 'cfg_y.py'   # a leaf that a later module makes a node
    redefined.write_text('def extend(cfg):\n    cfg.outdir = CN()\n    cfg.outdir.sub = 1\n')
    assert key_tree_of_sources([str(source), str(redefined)])['outdir'] == {'sub': None}


def test_without_a_readable_federatedscope_the_fs_key_tree_is_unknown(monkeypatch):
    import importlib.util

    from fs_plugins.schema import fs_source_keys

    def broken(name):
        raise ValueError(f'{name}.__spec__ is None')
    monkeypatch.setattr(importlib.util, 'find_spec', broken)
    fs_source_keys.fs_source_key_tree.cache_clear()
    try:
        assert fs_source_keys.fs_source_key_tree() is None
    finally:
        fs_source_keys.fs_source_key_tree.cache_clear()


@pytest.mark.fs
def test_the_installed_fs_key_tree_is_fs_own():
    """The tree read from FS's sources is the one FS builds when imported."""
    from federatedscope.core.configs.config import global_cfg

    from fs_plugins.fs.config import fs_known_keys
    from fs_plugins.schema.fs_source_keys import fs_source_key_tree
    from fs_plugins.schema.options import FS_AUX_KEYS

    def without_aux(tree):
        return {k: without_aux(v) if isinstance(v, dict) else v for k, v in tree.items()
                if k not in FS_AUX_KEYS}
    assert fs_source_key_tree() == without_aux(fs_known_keys(global_cfg))


def test_under_federatedscope_only_the_plugins_keys_are_checked(tmp_path):
    """FS's merges name no source; an FS key the plugin does not read passes."""
    path = write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, federate={'master_port': 1}))
    assert problems_of(pre.precheck, path, fs=True) == []
    assert problems_of(pre.precheck, path, ['fsplug.model.lora.alpah', '4'], fs=True) == \
        ["Unknown config key 'fsplug.model.lora.alpah'. Did you mean 'fsplug.model.lora.alpha'? "
         "Allowed keys under 'fsplug.model.lora': alpha, dropout, r, target_modules, "
         'target_parameters, use_rslora']
    off = write_yaml(tmp_path / 'off.yaml', tiny_config(tmp_path, fsplug={'method': ''},
                                                          federate={'total_round_num': 0}))
    assert problems_of(pre.precheck, off, fs=True) == []      # the plugin is off: FS checks
    assert problems_of(pre.precheck, str(tmp_path / 'none.yaml'), fs=True) == []  # FS says so
    assert problems_of(pre.precheck, str(tmp_path / 'none.yaml')) == \
        [f"Config file not found: {tmp_path / 'none.yaml'}"]


# ------------------------------------------------------------------ without torch, timed

IMPORTED = re.compile(r'^import time:.*\|\s+(torch|transformers)(\.|$)', re.MULTILINE)


def test_the_precheck_imports_neither_torch_nor_transformers(tmp_path):
    script = (f'import json, sys\n'
              f'from fs_plugins.core.errors import ConfigError\n'
              f'from fs_plugins.schema.precheck import precheck\n'
              f'precheck({os.path.join(REPO, "yamls", "fedmole", "tiny.yaml")!r})\n'
              f'try:\n    precheck({typo_yaml(tmp_path)!r})\n    problems = []\n'
              f'except ConfigError as exc:\n    problems = exc.problems\n'
              f'print(json.dumps([problems, sorted(m for m in sys.modules if m.split(".")[0] in '
              f'("torch", "transformers", "federatedscope"))]))\n')
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    problems, heavy = json.loads(done.stdout)
    assert len(problems) == 2 and heavy == []


@pytest.mark.parametrize('command', [['run'], ['run', '--runner', 'embedded'], ['estimate']])
def test_the_cli_reports_a_typo_before_importing_torch(tmp_path, command):
    path = typo_yaml(tmp_path)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, '-X', 'importtime', '-m', 'fs_plugins', *command,
                           '--cfg', path, 'fsplug.model.lora.r', '8'],
                          capture_output=True, text=True, cwd=tmp_path, env=env_with_tests())
    seconds = time.perf_counter() - start
    print(f"\n`fs-plugins {' '.join(command)}` on a misspelt YAML: exit {done.returncode} after "
          f'{seconds:.2f} s wall, torch imported: {bool(IMPORTED.search(done.stderr))}')
    assert done.returncode == 2
    assert not IMPORTED.search(done.stderr), IMPORTED.findall(done.stderr)
    errors = [line for line in done.stderr.splitlines() if not line.startswith('import time:')]
    assert errors[0] == 'fs-plugins: config error:'
    assert "Did you mean 'federate.total_round_num'?" in errors[1]
    assert errors[2].endswith(". Did you mean 'fedmole'?") and len(errors) == 3


@pytest.mark.parametrize('argv', [['run'], ['run', '--runner', 'fs'], ['launch']])
def test_with_federatedscope_installed_too(tmp_path, argv):
    """`run` through FS and `launch` (both need FS, absent here: cli.fs_available is patched)
    check before importing torch, as FS's merge (unprefixed) and launch's load (prefixed) do."""
    path = write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, fsplug={'method': 'fedmol'}))
    script = (f'import json, sys\n'
              f'from fs_plugins.commands import cli\n'
              f'cli.fs_available = lambda: True\n'
              f'code = cli.main({argv + ["--cfg", path]!r})\n'
              f'print(json.dumps([code, "torch" in sys.modules]))\n')
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, cwd=tmp_path)
    code, torch_imported = json.loads(done.stdout.splitlines()[-1])
    assert code == 2 and not torch_imported, done.stderr
    prefix = f'{path}: ' if argv == ['launch'] else ''
    assert f"\n  {prefix}fsplug.method = 'fedmol': not one of: " in done.stderr
    assert "Did you mean 'fedmole'?" in done.stderr

"""Files a run reads or writes that may come from, or be seen by, someone else (issue 41,
point 5): a saved run folder never makes predict/eval/export import its modules, `export`
writes through a fresh temporary folder, `fs-plugins credentials` writes owner-only files
without following links, a local launch keeps its CA key and tokens out of the results
folder (and warns when unauthenticated), crafted checkpoint files give a CheckpointError
naming the file."""
import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from helpers import run_embedded_keeping_clients, tiny_config, write_yaml

from fs_plugins import load_trained
from fs_plugins.commands.cli import launch_security, main
from fs_plugins.core.errors import ConfigError
from fs_plugins.run import checkpoint
from fs_plugins.run.artifacts import ARTIFACT_JSON, global_dir
from fs_plugins.run.checkpoint import CheckpointError
from fs_plugins.run.config import load_config

# ------------------------------------------------------------------ saved configs never import
EVIL = "open({marker!r}, 'w').write('ran')\n"


def _crafted_run(folder, marker, modules=('evil_mod',), shadows=('peft',)):
    """A run folder whose saved configs name `modules`, each beside it writing `marker`
    when imported; `shadows` too (libraries imported after the command starts)."""
    config = {'fsplug': {'method': 'evil_method', 'import_modules': list(modules)}}
    os.makedirs(global_dir(str(folder)))
    with open(folder / 'run_info.json', 'w') as handle:
        json.dump({'config': config}, handle)
    with open(os.path.join(global_dir(str(folder)), ARTIFACT_JSON), 'w') as handle:
        json.dump({'format': 1, 'files': {}, 'config': config}, handle)
    for name in (*modules, *shadows):
        (folder / f'{name}.py').write_text(EVIL.format(marker=str(marker)))
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize('command', [['export'], ['predict', '--input', 'q.jsonl'],
                                     ['eval', '--data', 'q.jsonl']])
def test_a_crafted_run_folder_runs_no_code_from_the_command_line(tmp_path, command):
    marker = tmp_path / 'marker'
    run = _crafted_run(tmp_path / 'run', marker)
    (tmp_path / 'run' / 'q.jsonl').write_text('{"instruction": "hi", "output": "x"}\n')
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONSAFEPATH'}
    proc = subprocess.run([sys.executable, '-m', 'fs_plugins', *command, '--run', '.'],
                          cwd=run, env=env, capture_output=True, text=True, timeout=300)
    assert not marker.exists(), proc.stderr
    assert proc.returncode == 2 and 'Traceback' not in proc.stderr, proc.stderr
    assert "run_info.json names fsplug.import_modules ['evil_mod']; pass --import-module " \
           "evil_mod to trust it" in proc.stderr


def test_load_trained_imports_only_the_modules_it_is_given(tmp_path, monkeypatch):
    marker = tmp_path / 'marker'
    run = _crafted_run(tmp_path / 'run', marker, modules=('evil_mod_api',), shadows=())
    monkeypatch.syspath_prepend(run)   # importable: only trust decides
    with pytest.raises(ConfigError, match=r'pass --import-module evil_mod_api to trust it'):
        load_trained(run)
    assert not marker.exists() and 'evil_mod_api' not in sys.modules
    with pytest.raises(ConfigError):   # trusted: imported (it registers no method here)
        load_trained(run, import_modules=['evil_mod_api'])
    assert marker.exists()
    sys.modules.pop('evil_mod_api', None)


# ------------------------------------------------------------------ export's temporary folder
@pytest.fixture(scope='module')
def trained_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp('trained')
    cfg = tiny_config(tmp_path, 'fedavg', rounds=1, steps=1)
    results, _ = run_embedded_keeping_clients(load_config(write_yaml(tmp_path / 'run.yaml', cfg)))
    return results.out_dir


def test_export_uses_a_fresh_temporary_folder(tmp_path, trained_run):
    out = tmp_path / 'out'
    stale = tmp_path / 'out.tmp'
    os.makedirs(stale)
    (stale / 'keep').write_text('not the exporter\'s')
    assert main(['export', '--run', trained_run, '--out', str(out)]) == 0
    assert (stale / 'keep').read_text() == 'not the exporter\'s'
    assert os.path.isfile(out / 'adapter_model.safetensors')
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~_umask()
    assert sorted(os.listdir(tmp_path)) == ['out', 'out.tmp']   # no temporary folder left


def test_a_failed_export_leaves_nothing_behind(tmp_path, trained_run, monkeypatch):
    from fs_plugins.run import trained

    def fails(*args):
        raise OSError('disk full')
    monkeypatch.setattr(trained, '_write_export', fails)
    with pytest.raises(OSError, match='disk full'):
        trained.export(trained_run, str(tmp_path / 'out'))
    assert os.listdir(tmp_path) == []


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------ credentials
def _mode(path):
    return os.lstat(path).st_mode & 0o777


def test_credentials_are_owner_only_files_in_an_owner_only_folder(tmp_path):
    pytest.importorskip('cryptography')
    from fs_plugins.commands.credentials import make_credentials
    folder = make_credentials(str(tmp_path / 'creds'), [1, 2])
    assert _mode(folder) == 0o700
    names = sorted(os.listdir(folder))
    assert 'ca.key' in names and 'client_2.token' in names
    assert {name: _mode(os.path.join(folder, name)) for name in names} == \
        {name: 0o600 for name in names}
    make_credentials(folder, [1, 2])   # its own folder: written again, still owner-only
    assert {_mode(os.path.join(folder, name)) for name in os.listdir(folder)} == {0o600}


def test_credentials_refuse_symlinks_naming_them(tmp_path, capsys):
    pytest.importorskip('cryptography')
    from fs_plugins.commands.credentials import CredentialsError, make_credentials
    folder = tmp_path / 'creds'
    os.mkdir(folder, 0o700)
    target = tmp_path / 'elsewhere'
    target.write_text('untouched')
    os.symlink(target, folder / 'server.key')
    with pytest.raises(CredentialsError, match=r'server\.key is a symbolic link'):
        make_credentials(str(folder), [1])
    assert target.read_text() == 'untouched'
    os.symlink(folder, tmp_path / 'linked')
    assert main(['credentials', '--out', str(tmp_path / 'linked'), '--clients', '1']) == 2
    assert 'linked is a symbolic link' in capsys.readouterr().err


def test_credentials_refuse_loose_modes_naming_the_file(tmp_path, capsys):
    pytest.importorskip('cryptography')
    from fs_plugins.commands.credentials import CredentialsError, make_credentials
    loose_folder = tmp_path / 'shared'
    os.mkdir(loose_folder)
    os.chmod(loose_folder, 0o755)
    assert main(['credentials', '--out', str(loose_folder), '--clients', '1']) == 2
    err = capsys.readouterr().err
    assert 'shared has mode 0755' in err and 'Traceback' not in err
    folder = tmp_path / 'creds'
    os.mkdir(folder, 0o700)
    (folder / 'client_1.token').write_text('old')
    os.chmod(folder / 'client_1.token', 0o644)
    with pytest.raises(CredentialsError, match=r'client_1\.token has mode 0644'):
        make_credentials(str(folder), [1])


def test_a_local_launch_keeps_its_ca_key_and_tokens_out_of_the_results_folder(tmp_path):
    pytest.importorskip('cryptography')
    from fs_plugins.commands.launch import LocalFederation
    cfg = tiny_config(tmp_path, 'fedavg', federate={'client_num': 2, 'sample_client_num': 2},
                      data={'splitter': 'iid'})
    federation = LocalFederation(write_yaml(tmp_path / 'c.yaml', cfg), secure='token')
    folder = os.path.realpath(federation.security.folder)
    assert not folder.startswith(os.path.realpath(federation.run_dir) + os.sep)
    assert _mode(folder) == 0o700
    files = os.listdir(folder)
    assert 'ca.key' not in files and {'client_tokens.yaml', 'client_1.token'} <= set(files)
    assert {_mode(os.path.join(folder, name)) for name in files} == {0o600}
    in_results = [name for _, _, names in os.walk(federation.run_dir) for name in names]
    assert not [n for n in in_results if n.endswith(('.key', '.token', 'client_tokens.yaml'))]


def test_a_local_launch_defaults_to_token_auth_and_warns_without_it(tmp_path):
    assert launch_security(None, 'local') == 'token'
    assert launch_security('none', 'local') is None
    assert launch_security(None, 'server') is None and launch_security('certificate', 'client')
    from fs_plugins.commands.launch import LocalFederation
    cfg = tiny_config(tmp_path, 'fedavg', federate={'client_num': 2, 'sample_client_num': 2},
                      data={'splitter': 'iid'})
    out = tmp_path / 'out.txt'
    with open(out, 'w') as handle:
        federation = LocalFederation(write_yaml(tmp_path / 'c.yaml', cfg), out=handle)
        federation.start = federation.wait_listening = federation.follow = lambda *a, **k: None
        assert federation.run() == 0
    assert 'warning: no TLS and no client authentication' in out.read_text()


# ------------------------------------------------------------------ crafted checkpoints
def _valid(path, payload=None, info=None):
    payload = payload if payload is not None else {'state': {'w': torch.ones(2)},
                                                   'rng': checkpoint.rng_state()}
    checkpoint.write_party(str(path), payload, info if info is not None else {'round': 0, 'rows': 1})
    return str(path)


def _with_metadata(path, **metadata):
    """A copy of checkpoint `path` (same tensors) with some metadata entries replaced."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(path, framework='pt') as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
        kept = handle.metadata()
    crafted = path.replace('.safetensors', '.crafted.safetensors')
    save_file(tensors, crafted, metadata={**kept, **metadata})
    return crafted


def _skeleton(body):
    return json.dumps({'format': checkpoint.FORMAT, 'skeleton': body})


TARGET = {'state': {'w': torch.zeros(2)}}
DEEP = '[' * 50000 + ']' * 50000


@pytest.mark.parametrize('meta', [
    DEEP,                                                       # nested past the parser
    '[' * 500 + ']' * 500,                                      # parses, deeper than any run
    json.dumps({'format': checkpoint.FORMAT}),                  # no skeleton
    _skeleton({'__dict__': {'state': {'__tensor__': 'absent#9'}}}),     # missing tensor
    _skeleton({'__dict__': {'state': {'__dict__': [1, 2]}}}),   # wrong type
    _skeleton({'__dict__': {'state': [1, 2]}}),                 # a list where a mapping is
    _skeleton({'__dict__': {'state': {'__dict__': {'w': 3}}}}),     # a number where a tensor is
    _skeleton({'__dict__': {'other': 1}}),                      # the state missing
    _skeleton({'__dict__': {'state': {'a': 1, 'b': 2}}}),       # two entries in one node
    _skeleton({'__dict__': {'state': {'__items__': [[{'__dict__': {}}, 2]]}}}),  # unhashable key
    _skeleton({'__dict__': {'state': {'__dict__': {}}, 'rng': {'__dict__': {'torch': 5}}}}),
])
def test_a_crafted_party_file_is_a_checkpoint_error_naming_it(tmp_path, meta):
    crafted = _with_metadata(_valid(tmp_path / 'server.round0.safetensors'),
                             fsplug_checkpoint=meta)
    with pytest.raises(CheckpointError, match=crafted.replace('.', r'\.')):
        checkpoint.read_party(crafted, dict(TARGET))


@pytest.mark.parametrize('info', [DEEP, '[1, 2]', '{"round": "x"}', '{"round": 1, "rows": -1}',
                                  '{"round": 1, "rows": 2, "config": [1]}',
                                  '{"round": 1}'])   # the server's rows missing
def test_a_crafted_info_is_a_checkpoint_error_naming_it(tmp_path, info):
    run_dir = tmp_path / 'run'
    path = checkpoint.party_path(str(run_dir), 'server', 0)
    os.makedirs(os.path.dirname(path))
    os.replace(_with_metadata(_valid(tmp_path / 'a.safetensors'), fsplug_info=info), path)
    cfg = load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path)))
    with pytest.raises(CheckpointError, match=path.replace('.', r'\.')):
        checkpoint.server_checkpoint_info(cfg, str(run_dir))


def test_a_crafted_safetensors_header_is_a_checkpoint_error_naming_it(tmp_path):
    header = ('{"__metadata__": {"fsplug_checkpoint": ' + '[' * 5000 + ']' * 5000 + '}}').encode()
    path = tmp_path / 'client_1.round0.safetensors'
    path.write_bytes(struct.pack('<Q', len(header)) + header)
    for read in (checkpoint.read_info, lambda p: checkpoint.read_party(p, {})):
        with pytest.raises(CheckpointError, match='client_1.round0.safetensors'):
            read(str(path))


def test_a_crafted_client_file_fails_the_resume_naming_it(tmp_path):
    """Through resume_federation: a client's payload of the wrong kinds."""
    class Client:
        client_id, round_idx, trainable_names, stream = 1, 0, ['w'], None
        params, state = {'w': torch.zeros(2)}, {}

        class method:   # noqa: N801 (stands for the method instance)
            @staticmethod
            def artifact_extra(model, state):
                return {}
        model = None
    run_dir = str(tmp_path / 'run')
    path = checkpoint.party_path(run_dir, 'client_1', 0)
    os.makedirs(os.path.dirname(path))
    checkpoint.write_party(path, {'client_id': 1, 'round': 'zero', 'params': {'w': torch.ones(2)},
                                  'artifact_extra': {}, 'state': {}, 'stream': None})
    with pytest.raises(CheckpointError, match=path.replace('.', r'\.') + ".*round 'zero'"):
        checkpoint.resume_federation(run_dir, 0, None, [Client()])
    checkpoint.write_party(path, {'client_id': 1, 'round': 0, 'params': [],
                                  'artifact_extra': {}, 'state': {}, 'stream': None})
    with pytest.raises(CheckpointError, match=r"'payload/params' is a list"):
        checkpoint.resume_federation(run_dir, 0, None, [Client()])


def test_valid_files_still_read(tmp_path):
    path = _valid(tmp_path / 'server.round0.safetensors')
    back = checkpoint.read_party(path, {'state': {'w': torch.zeros(2)}})
    assert torch.equal(back['state']['w'], torch.ones(2))
    assert checkpoint.read_info(path) == {'round': 0, 'rows': 1}

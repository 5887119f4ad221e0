"""`fs-plugins launch`'s derived per-party configs (no processes started; runs without FS).
The launched federations themselves are in tests/test_fs_distributed.py."""
import os
import subprocess
import sys

import pytest
import yaml
from helpers import REPO, tiny_config, tiny_yaml_of, write_yaml

from fs_plugins.commands.launch import LocalFederation, client_count
from fs_plugins.core.errors import ConfigError
from fs_plugins.fs.secure import read_credentials
from fs_plugins.run.config import load_config


def _derived(party):
    with open(party.cfg_path) as handle:
        return yaml.safe_load(handle)


def test_every_party_gets_its_role_data_index_and_own_address(tmp_path):
    cfg = tiny_config(tmp_path, 'fedavg', federate={'client_num': 3, 'sample_client_num': 3},
                      data={'splitter': 'iid'})
    clients = write_yaml(tmp_path / 'clients.yaml', {'client_2': {'fsplug': {'model': {'lora': {'r': 4}}}}})
    federation = LocalFederation(write_yaml(tmp_path / 'c.yaml', cfg), clients, ['seed', '7'])
    names = [p.name for p in federation.parties]
    assert names == ['server', 'client_1', 'client_2', 'client_3']
    ports = {p.address.port for p in federation.parties}
    assert len(ports) == 4
    server_port = federation.parties[0].address.port
    for party in federation.parties:
        derived = _derived(party)
        assert derived['federate']['mode'] == 'distributed' and derived['seed'] == 7
        assert derived['distribute']['role'] == party.role
        assert derived['distribute']['data_idx'] == party.data_idx
        assert derived['distribute']['server_port'] == server_port
        assert derived['distribute']['client_port'] == party.address.port
        assert derived['fsplug']['results_dir'] == federation.run_dir
        assert load_config(party.cfg_path).distribute.role == party.role   # passes the schema
    # client 2's --client_cfg entry goes into its own YAML only
    assert [_derived(p)['fsplug']['model'].get('lora', {}).get('r') for p in federation.parties] == \
        [8, 8, 4, 8]


def test_one_client_per_source_with_a_by_source_split(tmp_path):
    cfg = load_config(tiny_yaml_of('feddat'))
    expected = client_count(cfg)
    federation = LocalFederation(tiny_yaml_of('feddat'), opts=['fsplug.results_dir', str(tmp_path / 'r')])
    assert len(federation.parties) == 1 + expected


def test_a_client_entry_for_no_client_is_named(tmp_path):
    cfg = tiny_config(tmp_path, 'fedavg', federate={'client_num': 2, 'sample_client_num': 2},
                      data={'splitter': 'iid'})
    clients = write_yaml(tmp_path / 'clients.yaml', {'client_5': {'train': {'local_update_steps': 1}}})
    with pytest.raises(ConfigError, match='client_5 is not a client of this run'):
        LocalFederation(write_yaml(tmp_path / 'c.yaml', cfg), clients)


def test_one_party_of_a_multi_host_federation(tmp_path, monkeypatch):
    import fs_plugins.commands.launch as launch
    started = []
    monkeypatch.setattr(launch.subprocess, 'call', lambda command: started.append(command) or 0)
    cfg = tiny_config(tmp_path, 'fedavg', federate={'client_num': 2, 'sample_client_num': 2},
                      data={'splitter': 'iid'})
    clients = write_yaml(tmp_path / 'clients.yaml', {'client_2': {'fsplug': {'model': {'lora': {'r': 4}}}}})
    code = launch.launch_one(write_yaml(tmp_path / 'c.yaml', cfg), 'client', 2,
                             launch.Address('10.0.0.1', 6000), launch.Address('10.0.0.9', 6002),
                             clients, [], ['--overwrite'])
    assert code == 0 and started[0][-1] == '--overwrite'
    with open(started[0][started[0].index('--cfg') + 1]) as handle:
        derived = yaml.safe_load(handle)
    assert derived['distribute'] == {'use': True, 'role': 'client', 'data_idx': 2,
                                     'server_host': '10.0.0.1', 'server_port': 6000,
                                     'client_host': '10.0.0.9', 'client_port': 6002}
    assert derived['fsplug']['model']['lora']['r'] == 4


@pytest.mark.parametrize('auth', ['token', 'certificate'])
def test_a_secure_launch_gives_each_party_its_own_credentials(tmp_path, auth):
    pytest.importorskip('cryptography')
    cfg = tiny_config(tmp_path, 'fedavg', federate={'client_num': 2, 'sample_client_num': 2},
                      data={'splitter': 'iid'})
    federation = LocalFederation(write_yaml(tmp_path / 'c.yaml', cfg), secure=auth)
    # made for this launch outside the (shareable) results directory, owner-only
    assert not os.path.abspath(federation.security.folder).startswith(federation.run_dir + os.sep)
    assert os.stat(federation.security.folder).st_mode & 0o777 == 0o700
    for party in federation.parties:
        distribute = _derived(party)['fsplug']['distribute']
        named = {os.path.basename(v) for k, v in distribute.items() if k != 'auth'}
        expected = {'ca.pem', party.name + '.pem', party.name + '.key'}
        if auth == 'token':
            expected.add('client_tokens.yaml' if party.role == 'server' else party.name + '.token')
        assert named == expected, party.name
        credentials = read_credentials(load_config(party.cfg_path))
        assert credentials.auth == auth and credentials.role == party.role
        if auth == 'token' and party.role == 'server':
            assert set(credentials.client_tokens) == {1, 2}


# scripts/gen_distributed.py --check with every way of building a dataset refused: the
# generator reads the client counts from the YAMLs, so it needs no data and no system package
# (easyvqa_image_audio's data synthesises speech with espeak-ng)
_GENERATOR_WITHOUT_DATA = """
import importlib, runpy, sys

def refuse(*args, **kwargs):
    raise AssertionError('gen_distributed.py built a dataset; it must not need one')

for module, name in [('fs_plugins.data.builtin', 'ensure_builtin'),
                     ('fs_plugins.data.federated', 'ensure_builtin'),
                     ('fs_plugins.data.federated', 'load_data_records'),
                     ('fs_plugins.data.federated', 'split_records'),
                     ('fs_plugins.data.federated', 'build_federated_records'),
                     ('fs_plugins.run.runtime', 'build_federated_records'),
                     ('fs_plugins.commands.launch', 'build_federated_records')]:
    module = importlib.import_module(module)
    if hasattr(module, name):
        setattr(module, name, refuse)
sys.argv = sys.argv[1:]   # the script, then its arguments
runpy.run_path(sys.argv[0], run_name='__main__')
"""


@pytest.mark.slow
def test_shipped_distributed_configs_are_current():
    """yamls/<method>/distributed/ holds every registered method's tiny federation and every
    easyvqa one, generated (each file also loads in test_config), without building any data."""
    result = subprocess.run([sys.executable, '-c', _GENERATOR_WITHOUT_DATA,
                             os.path.join(REPO, 'scripts', 'gen_distributed.py'), '--check'],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'shipped distributed configs are current' in result.stdout


def _gen_distributed():
    sys.path.insert(0, os.path.join(REPO, 'scripts'))
    try:
        import gen_distributed
    finally:
        sys.path.pop(0)
    return gen_distributed


@pytest.mark.slow
def test_shipped_client_counts_are_the_splits(tmp_path, monkeypatch):
    """The client count the generator reads from each source's keys is the one its data split
    gives: each source's data is built (in tmp_path) and split, the speech of
    easyvqa_image_audio replaced by empty WAV files (the split reads no audio, so this needs
    no espeak-ng)."""
    import fs_plugins.data.easyvqa_audio as easyvqa_audio
    from fs_plugins.commands.launch import load_run

    def placeholder_wav(text, path, *args, **kwargs):
        open(path, 'wb').close()
    monkeypatch.setattr(easyvqa_audio, 'espeak_binary', lambda: 'espeak-ng')
    monkeypatch.setattr(easyvqa_audio, 'synthesize_speech', placeholder_wav)
    (tmp_path / easyvqa_audio.AUDIO_FOLDER).mkdir()
    gen = _gen_distributed()
    for source in gen.sources():
        _, cfg, _ = load_run(source, ['data.root', str(tmp_path)])
        assert gen.declared_client_count(cfg) == client_count(cfg), source

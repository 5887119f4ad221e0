"""A method's public set is never drawn from the clients' training data unless the config says
so ('clients'): 'held_out' (the default) holds training records of the run's data apart from
every client before the split; '' is refused naming the choices; the run says where its public
set came from."""
from collections import Counter

import pytest
from helpers import tiny_config, write_yaml

from fs_plugins.core.errors import ConfigError
from fs_plugins.data.federated import load_data_records, split_records
from fs_plugins.data.public import public_records
from fs_plugins.methods.specs import data_source, split_spec
from fs_plugins.run.config import load_config
from fs_plugins.run.runtime import run_info


def _cfg(tmp_path, method='perada', **fsplug):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return load_config(write_yaml(tmp_path / 'cfg.yaml', tiny_config(tmp_path, method, fsplug=fsplug)))


def _key(record):
    return (record.get('instruction'), record.get('input'), record.get('output'))


@pytest.mark.parametrize('holdout', [0, 12])
def test_held_out_records_are_no_clients_and_are_the_public_set(tmp_path, holdout):
    """'held_out': public_samples records (or fsplug.data.public_holdout when set) leave the
    clients' data; the public set is drawn from them alone."""
    cfg = _cfg(tmp_path, perada={'public_samples': 8}, data={'public_holdout': holdout})
    spec = split_spec(cfg)
    assert spec.public_holdout == (holdout or 8)
    clients = split_records(spec)
    held = load_data_records(spec).public
    public = public_records('held_out', data_source(cfg), 8, 1, 'fsplug.perada.public_data', spec)
    assert len(held) == spec.public_holdout and len(public) == 8
    assert not Counter(map(_key, public)) - Counter(map(_key, held))   # drawn from the held apart
    everything = Counter(map(_key, load_data_records(split_spec(_cfg(tmp_path / 'all', 'fedavg'))).records))
    in_clients = Counter(_key(r) for c in clients.clients.values() for part in c.values() for r in part)
    assert in_clients + Counter(map(_key, held)) == everything         # no client has them

def test_the_clients_data_only_when_asked_and_an_empty_source_is_refused(tmp_path):
    cfg = _cfg(tmp_path, perada={'public_samples': 8, 'public_data': 'clients'})
    assert split_spec(cfg).public_holdout == 0         # nothing held apart
    assert len(public_records('clients', data_source(cfg), 8, 1, 'k')) == 8
    with pytest.raises(ConfigError, match=r"fsplug.perada.public_data = '': name the public set.*"
                                          r"'held_out'.*'clients'"):
        public_records('', data_source(cfg), 8, 1, 'fsplug.perada.public_data')


def test_the_run_says_where_its_public_set_came_from(tmp_path):
    info = run_info(_cfg(tmp_path, perada={'public_samples': 8}), 'embedded', {})
    assert info['public_data'].startswith('fsplug.perada.public_data: 8 training records')
    assert 'held apart from every client' in info['public_data']
    assert run_info(_cfg(tmp_path / 'f', 'fedavg'), 'embedded', {})['public_data'] == ''

"""A --client_cfg file under FederatedScope: a client it leaves out, or sets to null, runs the
run's config (as FS's FedRunner treats it); an entry that is not a mapping is refused, naming
the file and the client."""

import pytest
from helpers import tiny_config, write_yaml

from fs_plugins.schema.loading import client_entry_problems


@pytest.mark.fs
def test_a_client_without_an_entry_keeps_the_run_config(tmp_path):
    """FS's runner merges client_cfgs.get('client_<id>'), None for a client left out."""
    from federatedscope.core.configs.config import global_cfg

    from fs_plugins.fs.config import plain_config
    cfg = global_cfg.clone()
    cfg.merge_from_file(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path)))
    client = cfg.clone()
    client.merge_from_other_cfg(None)
    assert plain_config(client) == plain_config(cfg)


def test_an_entry_that_is_not_a_mapping_names_the_file_and_the_client():
    entries = {'client_1': {'seed': 2}, 'client_2': 5, 'client_3': None, 'client_4': ['a']}
    assert client_entry_problems(entries, 'clients.yaml') == [
        "clients.yaml: client_2 = 5: expected a mapping of config keys, or nothing (the run's "
        "config)",
        "clients.yaml: client_4 = ['a']: expected a mapping of config keys, or nothing (the "
        "run's config)"]


@pytest.mark.fs
def test_fs_run_with_entries_for_some_clients_gives_the_embedded_numbers(tmp_path):
    """Client 1 alone has an entry (client 2's is null, 3 and 4 have none): FS standalone runs
    and gives the numbers of the embedded runner, which leaves the others on the run's config."""
    from test_fs_integration import _embedded_rows, assert_same_numbers, read_rows, run_fs_in_process
    cfg = tiny_config(tmp_path, rounds=1, steps=2, fsplug={'results_dir': str(tmp_path / 'fs')})
    client_cfgs = {'client_1': {'train': {'local_update_steps': 1}}, 'client_2': None}
    proc = run_fs_in_process(['--cfg', write_yaml(tmp_path / 'fs.yaml', cfg),
                   '--client_cfg', write_yaml(tmp_path / 'clients.yaml', client_cfgs)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_rows(str(tmp_path / 'fs'))
    assert {r['client'] for r in rows if r['kind'] == 'train'} == {1, 2, 3, 4}
    assert_same_numbers(rows, _embedded_rows(tmp_path, cfg, client_cfgs))


def test_client_overrides_refuses_an_entry_that_is_not_a_mapping(tmp_path):
    """Both runners check the --client_cfg entries through client_overrides: a bad entry is a
    config error naming the client, not an AttributeError deep in the merge."""
    from fs_plugins.core.errors import ConfigError
    from fs_plugins.run.config import client_overrides, load_config
    cfg = load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path)))
    with pytest.raises(ConfigError, match=r"--client_cfg: client_2 = 5: expected a mapping"):
        client_overrides({'client_1': None, 'client_2': 5}, cfg)
    assert client_overrides({'client_1': None}, cfg) == {1: {}}

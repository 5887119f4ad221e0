import pytest

from fs_plugins.config import ConfigError, client_overrides, load_config
from helpers import tiny_config, write_yaml


def _load(tmp_path, **updates):
    return load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, **updates)))


def test_tiny_yaml_loads_with_defaults(tmp_path):
    cfg = _load(tmp_path)
    assert cfg.fsplug.method == 'fedavg'
    assert cfg.fsplug.model.lora.r == 8
    assert cfg.fsplug.data.dirichlet_alpha == 0.5          # default filled in
    assert cfg.federate.sample_client_num == 4


def test_unknown_fsplug_key_names_key_and_allowed(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, fsplug={'model': {'lora': {'rank': 4}}})
    msg = str(err.value)
    assert "'fsplug.model.lora.rank'" in msg and 'alpha, dropout, r, target_modules' in msg


def test_unknown_method_lists_allowed(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, fsplug={'method': 'fedavgg'})
    assert "'fedavgg'" in str(err.value) and 'fedavg' in str(err.value) and 'standalone' in str(err.value)


def test_unknown_splitter_names_key(tmp_path):
    with pytest.raises(ConfigError, match='data.splitter'):
        _load(tmp_path, data={'splitter': 'random'})


def test_override_list_must_pair(tmp_path):
    path = write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path))
    with pytest.raises(ConfigError, match='pairs'):
        load_config(path, ['seed'])


def test_command_line_override_typed(tmp_path):
    path = write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path))
    cfg = load_config(path, ['fsplug.model.lora.r', '4', 'seed', '7'])
    assert cfg.fsplug.model.lora.r == 4 and cfg.seed == 7


def test_share_local_model_rejected(tmp_path):
    with pytest.raises(ConfigError, match='share_local_model'):
        _load(tmp_path, federate={'share_local_model': True})


def test_missing_config_file_named(tmp_path):
    with pytest.raises(ConfigError, match='nope.yaml'):
        load_config(str(tmp_path / 'nope.yaml'))


def test_client_cfg_unknown_client_named():
    with pytest.raises(ConfigError, match='client_9'):
        client_overrides({'client_1': {}, 'client_9': {}}, client_num=4)
    with pytest.raises(ConfigError, match="'clinet_1'"):
        client_overrides({'clinet_1': {}}, client_num=4)
    with pytest.raises(ConfigError, match='fsplug.model.lora.rk'):
        client_overrides({'client_1': {'fsplug': {'model': {'lora': {'rk': 2}}}}}, client_num=4)
    assert client_overrides({'client_2': {'seed': 3}}, client_num=4) == {2: {'seed': 3}}

"""Config loading and strict validation: every shipped YAML loads, and the mistakes a user
makes end in one clear line per problem naming the key, before anything is built."""
import os

import pytest
from helpers import REPO, shipped_yamls, tiny_config, write_yaml

from fs_plugins.methods.registry import all_methods
from fs_plugins.run.config import ConfigError, client_overrides, load_config, read_yaml
from fs_plugins.schema import PluginOptions, describe
from fs_plugins.schema.fs_keys import FSKeys

SHIPPED = shipped_yamls()
CLIENT_FILES = [p for p in SHIPPED  # --client_cfg files: every top-level key is client_<id>
                if all(str(k).startswith('client_') for k in read_yaml(os.path.join(REPO, p)))]


def _load(tmp_path, **updates):
    return load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, **updates)))


def _problems(tmp_path, opts, base='yamls/fedavg/tiny.yaml'):
    with pytest.raises(ConfigError) as err:
        load_config(os.path.join(REPO, base), opts)
    return err.value.problems


def client_file_base(path: str) -> tuple[str, list[str]]:
    """The base YAML (and overrides) named by a client file's '# base:' line."""
    with open(os.path.join(REPO, path), encoding='utf-8') as handle:
        lines = handle.readlines()
    for line in lines:
        if line.startswith('# base:'):
            words = line[len('# base:'):].split('(')[0].split()
            return words[0], words[1:]
    raise AssertionError(f"{path}: per-client file without a '# base: <yaml>' line")


@pytest.mark.parametrize('path', [p for p in SHIPPED if p not in CLIENT_FILES])
def test_every_shipped_yaml_validates(path):
    cfg = load_config(os.path.join(REPO, path))
    assert cfg.fsplug.method in all_methods()


@pytest.mark.slow
@pytest.mark.parametrize('path', CLIENT_FILES)
def test_every_shipped_client_file_validates_against_its_base(path):
    base, opts = client_file_base(path)
    cfg = load_config(os.path.join(REPO, base), opts)
    overrides = client_overrides(read_yaml(os.path.join(REPO, path)), cfg)
    assert sorted(overrides) == list(range(1, len(overrides) + 1))


def test_tiny_yaml_loads_with_typed_defaults(tmp_path):
    cfg = _load(tmp_path)
    assert cfg.fsplug.method == 'fedavg'
    assert cfg.fsplug.model.lora.r == 8
    assert cfg.fsplug.model.lora.alpha == 16.0 and isinstance(cfg.fsplug.model.lora.alpha, float)
    assert cfg.fsplug.data.dirichlet_alpha == 0.5          # default filled in
    assert cfg.federate.sample_client_num == 4


# the mutated YAMLs of the issue, and what each must say
MUTATIONS = [
    (['federate.total_round_nm', '3'],
     "Unknown config key 'federate.total_round_nm'. Did you mean 'federate.total_round_num'?"),
    (['federate.client_num', '0'], 'federate.client_num = 0: must be >= 1'),
    (['federate.total_round_num', '-1'], 'federate.total_round_num = -1: must be >= 1'),
    (['fsplug.model.lora.r', 'eight'], "fsplug.model.lora.r = 'eight': expected int"),
    (['fsplug.model.lora.r', '-2'], 'fsplug.model.lora.r = -2: must be >= 1'),
    (['fsplug.model.lora.r', '8.5'], 'fsplug.model.lora.r = 8.5: expected int'),
    (['train.optimizer.lr', '-0.001'], 'train.optimizer.lr = -0.001: must be > 0'),
    (['federate.sample_client_rate', '1.5'], 'federate.sample_client_rate = 1.5: must be <= 1'),
    (['dataloader.batch_size', '0'], 'dataloader.batch_size = 0: must be >= 1'),
    (['train.local_update_steps', '0'], 'train.local_update_steps = 0: must be >= 1'),
    (['eval.freq', '0'], 'eval.freq = 0: must be >= 1'),
    (['llm.tok_len', '0'], 'llm.tok_len = 0: must be >= 1'),
    (['fsplug.data.test_fraction', '1.0'], 'fsplug.data.test_fraction = 1.0: must be < 1'),
    (['fsplug.model.adapter', 'lorax'], "fsplug.model.adapter = 'lorax': not one of: lora, vera"),
    (['fsplug.eval.gen_metrics', "['cider']", 'fsplug.eval.generate', 'True'],
     "fsplug.eval.gen_metrics[0] = 'cider': not one of"),
    (['data.splitter', 'random'], "data.splitter = 'random': not one of"),
    (['data.type', 'tiny_tasks@hub'],
     "data.type = 'tiny_tasks@hub': must be '<file.json|file.jsonl|builtin name>@fsplug'"),
    (['federate.share_local_model', 'sometimes'], "federate.share_local_model = 'sometimes': expected bool"),
    (['fsplug.method', 'fedavgg'], "fsplug.method = 'fedavgg': not one of"),
    (['fsplug.fedprox.mu', '-1'], 'fsplug.fedprox.mu = -1: must be >= 0'),
    (['fsplug.flame.rescale', 'sometimes'], "fsplug.flame.rescale = 'sometimes': not one of: learnable, static, none"),
    (['fsplug.feddpa.global_fraction', '2'], 'fsplug.feddpa.global_fraction = 2: must be <= 1'),
    (['fsplug.fedmole.aggregat', 'all'], "Did you mean 'fsplug.fedmole.aggregate'?"),
    (['fsplug.fedavgg.x', '1'], "Unknown config key 'fsplug.fedavgg'. Did you mean 'fsplug.fedavg'?"),
    (['fedprox.use', 'True'], "Unknown config key 'fedprox'"),
]


@pytest.mark.parametrize('opts,expected', MUTATIONS, ids=[m[0][0] + '=' + m[0][1] for m in MUTATIONS])
def test_a_mistake_is_one_line_naming_the_key(tmp_path, opts, expected):
    problems = _problems(tmp_path, opts)
    assert len(problems) == 1, problems
    assert expected in problems[0], problems[0]
    assert problems[0].startswith('command line: ')


def test_every_problem_of_a_config_is_reported_together(tmp_path):
    chosen = [MUTATIONS[i] for i in (0, 1, 3, 6, 7, 8, 13, 16)]   # eight different keys
    problems = _problems(tmp_path, [o for mutation, _ in chosen for o in mutation])
    assert len(problems) == len(chosen)
    for _, expected in chosen:
        assert any(expected in p for p in problems), expected


def test_method_rules_between_keys(tmp_path):
    problems = _problems(tmp_path, ['fsplug.fedmole.top_k', '9', 'fsplug.fedmole.target_modules',
                                    "['o_proj']"], base='yamls/fedmole/tiny.yaml')
    assert any('fsplug.fedmole.top_k = 9: must be <= fsplug.fedmole.num_experts = 8' in p for p in problems)
    assert any("fsplug.fedmole.target_modules = ['o_proj']" in p for p in problems)


def test_yaml_file_problems_name_the_file(tmp_path):
    raw = tiny_config(tmp_path, federate={'total_round_num': 0})
    path = write_yaml(tmp_path / 'bad.yaml', raw)
    with pytest.raises(ConfigError, match=r'bad\.yaml: federate\.total_round_num = 0'):
        load_config(path)


def test_unknown_fsplug_key_lists_allowed(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, fsplug={'model': {'lora': {'rank': 4}}})
    msg = str(err.value)
    assert "'fsplug.model.lora.rank'" in msg and 'alpha, dropout, r, target_modules' in msg


def test_unknown_method_lists_allowed(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, fsplug={'method': 'fedavgg'})
    assert "'fedavgg'" in str(err.value) and 'fedavg' in str(err.value) and 'standalone' in str(err.value)


def test_a_misspelt_method_gets_the_closest_name(tmp_path):
    """As a misspelt key does: fsplug.method's allowed values come from the registry."""
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, fsplug={'method': 'fedmol'})
    problem = [p for p in err.value.problems if 'fsplug.method' in p]
    assert len(problem) == 1 and "fsplug.method = 'fedmol': not one of: , " in problem[0]
    assert ', ditto, ' in problem[0] and ', fedmole, ' in problem[0]
    assert problem[0].endswith(". Did you mean 'fedmole'?")
    problems = _problems(tmp_path, ['fsplug.model.dtype', 'bfloat'])
    assert problems == ["command line: fsplug.model.dtype = 'bfloat': not one of: float32, bfloat16, "
                        "float16. Did you mean 'bfloat16'?"]


def test_override_list_must_pair(tmp_path):
    path = write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path))
    with pytest.raises(ConfigError, match='pairs'):
        load_config(path, ['seed'])


def test_command_line_values_decode_as_in_federatedscope(tmp_path):
    path = write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path))
    cfg = load_config(path, ['fsplug.model.lora.r', '4', 'seed', '7', 'train.optimizer.lr', '1e-3',
                             'fsplug.model.lora.target_modules', "['q_proj']"])
    assert cfg.fsplug.model.lora.r == 4 and cfg.seed == 7 and cfg.train.optimizer.lr == 0.001
    assert cfg.fsplug.model.lora.target_modules == ['q_proj']
    # yacs keeps what is not a Python literal a string: a YAML-style list is refused, as in FS
    with pytest.raises(ConfigError, match='expected a list of str'):
        load_config(path, ['fsplug.model.lora.target_modules', '[q_proj]'])


def test_optimizer_node_accepts_optimizer_arguments(tmp_path):
    cfg = _load(tmp_path, train={'optimizer': {'type': 'AdamW', 'lr': 0.01, 'weight_decay': 0.1}})
    assert cfg.train.optimizer.weight_decay == 0.1


def test_missing_config_file_named(tmp_path):
    with pytest.raises(ConfigError, match='nope.yaml'):
        load_config(str(tmp_path / 'nope.yaml'))


def test_client_cfg_problems_name_the_client(tmp_path):
    cfg = _load(tmp_path)
    with pytest.raises(ConfigError) as err:
        client_overrides({'client_1': {}, 'client_9': {}, 'clinet_2': {},
                          'client_3': {'fsplug': {'model': {'lora': {'rk': 2, 'r': 0}}}}}, cfg)
    problems = err.value.problems
    assert any("'client_9'" in p and 'client_1 .. client_4' in p for p in problems)
    assert any("'clinet_2'" in p for p in problems)
    assert any(p.startswith('--client_cfg client_3:') and 'fsplug.model.lora.rk' in p for p in problems)
    assert any(p.startswith('--client_cfg client_3:') and 'fsplug.model.lora.r = 0' in p for p in problems)
    assert client_overrides({'client_2': {'seed': 3}}, cfg) == {2: {'seed': 3}}


@pytest.mark.parametrize('section,path', [(PluginOptions, 'fsplug'), (FSKeys, '')]
                         + [(cls.config_class, f'fsplug.{name}') for name, cls in sorted(all_methods().items())])
def test_every_key_is_documented(section, path):
    rows = describe(section, path)
    assert all(row['help'] for row in rows), [row['key'] for row in rows if not row['help']]

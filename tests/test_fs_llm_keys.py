"""FS-LLM's config names and every FederatedScope key under the plugin (issue 40, points 1-2):
each FS key is classified honoured / mapped / inert / refused (a key in none fails here); FS-LLM's
names map onto the plugin's options, a conflict naming both keys; refused keys name the plugin's
alternative; FS-LLM's baseline YAMLs pass FS's merges with only fsplug.method added."""
import copy
import importlib.util
import os
import tempfile

import pytest
from helpers import REPO, deep_update

from fs_plugins.run.config import ConfigError, client_config, client_overrides, load_config
from fs_plugins.schema.fs_keys import FSKeys
from fs_plugins.schema.fs_llm import (
    FS_KEYS,
    HONOURED,
    INERT,
    MAPPED,
    REFUSED,
    classify,
    layer_problems,
    leaves,
    map_fs_llm_names,
    refused_key_problems,
    unreported_metric_problems,
)
from fs_plugins.schema.options import defaults_of
from fs_plugins.schema.plugin import PluginOptions
from fs_plugins.schema.validate import fs_defaults

HAVE_FS = importlib.util.find_spec('federatedscope') is not None
RECORDED = os.path.join(REPO, 'tests', 'data', 'fs_config_keys.txt')
TINY_YAML = os.path.join(REPO, 'yamls', 'fedavg', 'tiny.yaml')
LORA_ARGS = {'adapter_package': 'peft', 'adapter_method': 'lora', 'r': 8, 'lora_alpha': 16,
             'lora_dropout': 0.05}


# ------------------------------------------------------------------ (a) every key classified

def recorded_keys() -> list[str]:
    with open(RECORDED, encoding='utf-8') as handle:
        return [line.strip() for line in handle if line.strip()]


def fs_tree_keys() -> list[str]:
    from federatedscope.core.configs.config import global_cfg

    from fs_plugins.fs.config import fs_known_keys
    return sorted(key for key, _ in leaves(fs_known_keys(global_cfg)))


def fs_config_keys() -> list[str]:
    """FS's keys: from FS's own config tree when FS is importable, else the recorded list."""
    return fs_tree_keys() if HAVE_FS else recorded_keys()


def test_every_fs_key_is_classified():
    keys = fs_config_keys()
    assert len(keys) > 300
    unclassified = [key for key in keys if classify(key) is None]
    assert not unclassified, f'FS keys in no class of fs_plugins.schema.fs_llm.FS_KEYS: {unclassified}'


@pytest.mark.fs
def test_recorded_keys_are_fs_own_tree():
    assert recorded_keys() == fs_tree_keys(), 'stale: run scripts/record_fs_keys.py with FS\'s Python'


def test_every_entry_has_a_kind_and_a_reason_and_matches_an_fs_key():
    keys = fs_config_keys()
    for pattern, rule in FS_KEYS.items():
        assert rule.kind in (HONOURED, MAPPED, INERT, REFUSED) and rule.reason, pattern
        named = [key for key in keys if key.startswith(pattern)] if pattern.endswith('.') else \
            [key for key in keys if key == pattern]
        assert named, f'{pattern} names no FS key'


@pytest.mark.parametrize('key,kind,words', [
    ('llm.offsite_tuning.use', REFUSED, 'no plugin equivalent'),
    ('llm.deepspeed.use', REFUSED, 'fsplug.model.dtype, fsplug.model.quantization'),
    ('fedopt.use', REFUSED, 'fedadam / fedyogi / fedadagrad'),
    ('federate.use_ss', REFUSED, 'secret sharing'),
    ('quantization.method', REFUSED, 'fsplug.model.quantization'),
    ('asyn.use', REFUSED, 'synchronous'),
    ('regularizer.type', REFUSED, 'fedprox'),
    ('fedprox.use', REFUSED, 'fsplug.method: fedprox'),
    ('personalization.local_param', REFUSED, 'personalised methods'),
    ('nbafl.mu', REFUSED, 'fedprox'),
    ('nbafl.use', HONOURED, 'NbAFL'), ('nbafl.epsilon', HONOURED, 'NbAFL'),
    ('early_stop.patience', HONOURED, 'stops'), ('federate.save_to', HONOURED, 'saves'),
    ('wandb.use', HONOURED, 'Weights'), ('hpo.scheduler', INERT, 'hpo.py'),
    ('llm.chat.max_len', INERT, 'chat'),
    ('train.is_enable_half', MAPPED, 'float16'), ('llm.adapter.args', MAPPED, 'lora'),
    ('data.splits', MAPPED, 'val_fraction'), ('data.splitter_args', MAPPED, 'dirichlet_alpha'),
    ('federate.share_local_model', MAPPED, 'own models'), ('trainer.type', MAPPED, 'llmtrainer'),
    ('federate.method', MAPPED, 'FedAvg'), ('model.type', MAPPED, 'huggingface_llm'),
    ('data.type', MAPPED, '@llm'), ('criterion.type', REFUSED, 'language-model loss'),
    ('model.hidden', REFUSED, 'non-LLM'), ('data.args', REFUSED, 'data layer'),
])
def test_key_class_and_pointer(key, kind, words):
    rule = classify(key)
    assert rule.kind == kind and words in rule.reason, (key, rule)


def test_every_fs_key_the_embedded_runner_accepts_is_classified():
    keys = [key for key, _ in leaves(defaults_of(FSKeys))]
    assert [key for key in keys if classify(key) is None] == []
    assert {key for key in keys if classify(key).kind == INERT} == set()


# ------------------------------------------------------------------ (b) mapping

def plain_config(**updates) -> dict:
    """FS's defaults (those of FSKeys) and the plugin's, with `updates` merged on top."""
    base = {**copy.deepcopy(fs_defaults()), 'fsplug': defaults_of(PluginOptions)}
    base['fsplug']['method'] = 'fedavg'
    return deep_update(base, updates)


def mapped(**updates) -> tuple[dict, list[str]]:
    return map_fs_llm_names(plain_config(**updates), fs_defaults())


def test_worker_and_model_names():
    cfg, problems = mapped(trainer={'type': 'llmtrainer'}, federate={'method': 'FedAvg'},
                           model={'type': 'gpt2@huggingface_llm'}, data={'type': 'alpaca@llm'})
    assert problems == []
    assert (cfg['trainer']['type'], cfg['federate']['method']) == ('fsplug', 'fsplug')
    assert cfg['model']['type'] == 'gpt2@fsplug_llm' and cfg['data']['type'] == 'alpaca@llm'


def test_adapter_args_map_onto_lora_and_are_consumed():
    cfg, problems = mapped(llm={'adapter': {'use': True, 'args': [
        dict(LORA_ARGS, target_modules=['q_proj', 'k_proj'], use_rslora=True, bias='none')]}})
    assert problems == []
    assert cfg['fsplug']['model']['lora'] == dict(
        cfg['fsplug']['model']['lora'], r=8, alpha=16, dropout=0.05, target_modules=['q_proj', 'k_proj'],
        use_rslora=True)
    assert cfg['llm']['adapter']['args'] == [{}]     # moved: a later layer overrides the fsplug keys


def test_adapter_args_left_out_take_peft_defaults_unless_fsplug_sets_them():
    cfg, _ = mapped(llm={'adapter': {'use': True, 'args': [{'adapter_method': 'lora', 'r': 4}]}})
    assert (cfg['fsplug']['model']['lora']['r'], cfg['fsplug']['model']['lora']['alpha']) == (4, 8)
    cfg, _ = mapped(llm={'adapter': {'use': True, 'args': [{'r': 4}]}},
                    fsplug={'model': {'lora': {'alpha': 32.0}}})
    assert cfg['fsplug']['model']['lora']['alpha'] == 32.0


def test_adapter_conflict_names_both_keys():
    _, problems = mapped(llm={'adapter': {'use': True, 'args': [LORA_ARGS]}},
                         fsplug={'model': {'lora': {'r': 4}}})
    assert len(problems) == 1
    assert 'llm.adapter.args[0].r = 8' in problems[0] and 'fsplug.model.lora.r = 4' in problems[0]


def test_an_fsplug_value_equal_to_its_default_counts_as_unset():
    cfg, problems = mapped(llm={'adapter': {'use': True, 'args': [{'r': 16}]}},
                           fsplug={'model': {'lora': {'r': 8}}})
    assert problems == [] and cfg['fsplug']['model']['lora']['r'] == 16


@pytest.mark.parametrize('adapter,expected', [
    ({'use': False, 'args': [LORA_ARGS]}, 'llm.adapter.use = False with llm.adapter.args set'),
    ({'use': True, 'args': [dict(LORA_ARGS, modules_to_save=['lm_head'])]},
     "llm.adapter.args[0].modules_to_save = ['lm_head']: no fsplug equivalent"),
    ({'use': True, 'args': [{'adapter_method': 'prefix'}]},
     "llm.adapter.args[0].adapter_method = 'prefix': fsplug methods train 'lora' or 'vera'"),
    ({'use': True, 'args': [{'adapter_package': 'adapterhub'}]}, "adapter_package = 'adapterhub'"),
    ({'use': True, 'args': [LORA_ARGS, LORA_ARGS]}, 'FS-LLM reads only the first'),
])
def test_adapter_refusals(adapter, expected):
    _, problems = mapped(llm={'adapter': adapter})
    assert len(problems) == 1 and expected in problems[0], problems


def test_vera_args_map_onto_the_vera_adapter():
    cfg, problems = mapped(llm={'adapter': {'use': True, 'args': [
        {'adapter_method': 'vera', 'r': 128, 'd_initial': 0.2, 'vera_dropout': 0.1}]}})
    model = cfg['fsplug']['model']
    assert problems == [] and model['adapter'] == 'vera'
    assert (model['vera']['r'], model['vera']['d_initial'], model['lora']['dropout']) == (128, 0.2, 0.1)


def test_half_precision_is_a_float16_base():
    cfg, problems = mapped(train={'is_enable_half': True})
    assert problems == [] and cfg['fsplug']['model']['dtype'] == 'float16'
    assert cfg['train']['is_enable_half'] is False     # FS-LLM's trainer would halve the trainables
    _, problems = mapped(train={'is_enable_half': True}, fsplug={'model': {'dtype': 'float16'}})
    assert problems == []
    _, problems = mapped(train={'is_enable_half': True}, fsplug={'model': {'dtype': 'bfloat16'}})
    assert len(problems) == 1
    assert 'train.is_enable_half = True' in problems[0] and "fsplug.model.dtype = 'bfloat16'" in problems[0]


def test_splits_become_per_client_fractions():
    cfg, problems = mapped(data={'splits': [0.998, 0.001, 0.001]})
    assert problems == []
    assert (cfg['fsplug']['data']['val_fraction'], cfg['fsplug']['data']['test_fraction']) == (0.001, 0.001)
    assert cfg['data']['splits'] == [0.8, 0.1, 0.1]


@pytest.mark.parametrize('updates,expected', [
    ({'data': {'splits': [0.5, 0.1, 0.1]}}, 'fractions summing to 1'),
    ({'data': {'splits': [0.8, 0.2]}}, 'expected [train, val, test]'),
    ({'data': {'splits': [0.6, 0.2, 0.2]}, 'fsplug': {'data': {'val_fraction': 0.3}}},
     'data.splits = [0.6, 0.2, 0.2] means fsplug.data.val_fraction = 0.2, but fsplug.data.val_fraction = 0.3'),
    ({'data': {'splits': [0.6, 0.2, 0.2]}, 'fsplug': {'data': {'split_from_records': True}}},
     'fsplug.data.split_from_records = True'),
])
def test_split_problems(updates, expected):
    _, problems = mapped(**updates)
    assert len(problems) == 1 and expected in problems[0], problems


def test_splitters_and_their_arguments():
    cfg, problems = mapped(data={'splitter': 'meta'})
    assert problems == [] and cfg['data']['splitter'] == 'by_source'
    assert cfg['fsplug']['data']['split_field'] == 'category'
    _, problems = mapped(data={'splitter': 'meta'}, fsplug={'data': {'split_field': 'task'}})
    assert len(problems) == 1 and "data.splitter = 'meta'" in problems[0] and 'fsplug.data.split_field' in problems[0]
    cfg, problems = mapped(data={'splitter': 'lda', 'splitter_args': [{'alpha': 0.1}]})
    assert problems == [] and cfg['fsplug']['data']['dirichlet_alpha'] == 0.1
    assert cfg['data']['splitter_args'] == []
    _, problems = mapped(data={'splitter': 'lda', 'splitter_args': [{'alpha': 0.1, 'min_size': 3}]})
    assert problems == ['data.splitter_args[0].min_size = 3: no fsplug equivalent (alpha -> '
                        'fsplug.data.dirichlet_alpha)']
    _, problems = mapped(data={'splitter_args': [{'alpha': 0.1}]}, fsplug={'data': {'dirichlet_alpha': 2.0}})
    assert len(problems) == 1 and 'data.splitter_args[0].alpha' in problems[0] \
        and 'fsplug.data.dirichlet_alpha = 2.0' in problems[0]


def test_loss_keys_mean_the_average_loss():
    cfg, _ = mapped(eval={'best_res_update_round_wise_key': 'val_loss'})
    assert cfg['eval']['best_res_update_round_wise_key'] == 'val_avg_loss'


def test_eval_metrics_name_what_clients_report():
    reported = ['acc', 'token_acc', 'rougeL']
    assert unreported_metric_problems(plain_config(eval={'metrics': ['loss', 'token_acc', 'image+audio_acc']}),
                                      reported) == []
    problems = unreported_metric_problems(plain_config(eval={'metrics': ['loss', 'f1']}), reported)
    assert len(problems) == 1 and "'f1' not reported by fsplug clients" in problems[0]
    assert 'token_acc' in problems[0] and 'avg_loss' in problems[0]


# ------------------------------------------------------------------ (c) refusals

OFF = {'llm': {'offsite_tuning': {'use': False}, 'deepspeed': {'use': False}},
       'fedopt': {'use': False, 'optimizer': {'lr': 0.01, '__open__': True}},
       'nbafl': {'use': False, 'mu': 0.0}, 'criterion': {'type': 'MSELoss'},
       'federate': {'process_num': 1}, 'train': {'local_update_steps': 1, 'optimizer': {'lr': 0.1}},
       'personalization': {'local_update_steps': -1, 'lr': 0.0}}


@pytest.mark.parametrize('updates,expected', [
    ({'llm': {'offsite_tuning': {'use': True}}}, 'llm.offsite_tuning.use is not supported'),
    ({'llm': {'deepspeed': {'use': True}}}, 'fsplug.model.dtype'),
    ({'fedopt': {'use': True}}, 'fedadam / fedyogi / fedadagrad'),
    ({'fedopt': {'optimizer': {'momentum': 0.9}}}, 'fedopt.optimizer.momentum'),   # an open node's key
    ({'nbafl': {'mu': 0.1}}, "nbafl.mu is not supported with fsplug methods (set to 0.1, FS's default: 0.0)"),
    ({'criterion': {'type': 'L1Loss'}}, 'language-model loss'),
])
def test_refused_keys_name_the_alternative(updates, expected):
    problems = refused_key_problems(deep_update(copy.deepcopy(OFF), updates), OFF)
    assert len(problems) == 1 and expected in problems[0], problems


def test_defaults_derived_values_and_accepted_values_are_not_refused():
    cfg = deep_update(copy.deepcopy(OFF), {
        'criterion': {'type': 'CrossEntropyLoss'}, 'federate': {'process_num': 0},   # FS's GPU count
        'train': {'local_update_steps': 30, 'optimizer': {'lr': 3e-4}},
        'personalization': {'local_update_steps': 30, 'lr': 3e-4},    # FS's check copies these
        'nbafl': {'use': True}, 'llm': {'chat': {'max_len': 1000}}})
    assert refused_key_problems(cfg, OFF) == []


def test_a_derived_key_is_refused_only_where_a_layer_sets_it():
    merged = deep_update(copy.deepcopy(OFF), {'train': {'local_update_steps': 2},
                                               'personalization': {'local_update_steps': 30}})
    assert refused_key_problems(merged, OFF) == []     # FS derived 30 from an earlier layer
    assert layer_problems({'train': {'local_update_steps': 2}}, merged, merged, OFF) == []
    assert layer_problems(merged, merged, merged, OFF) == []    # a whole config merged back
    adapter_off = layer_problems({'llm': {'adapter': {'use': 'False'}}}, merged,
                                 deep_update(copy.deepcopy(merged), {'llm': {'adapter': {'use': False}}}), OFF)
    assert len(adapter_off) == 1 and 'llm.adapter.use = False' in adapter_off[0]
    five = deep_update(copy.deepcopy(merged), {'personalization': {'local_update_steps': 5}})
    problems = layer_problems({'personalization': {'local_update_steps': 5}}, merged, five, OFF)
    assert len(problems) == 1 and 'personalization.local_update_steps' in problems[0]


def test_the_embedded_runner_refuses_and_maps_too():
    with pytest.raises(ConfigError, match='nbafl.mu is not supported'):
        load_config(TINY_YAML, ['nbafl.mu', '0.1'])
    with pytest.raises(ConfigError, match="Unknown config key 'early_stop'"):
        load_config(TINY_YAML, ['early_stop.patience', '3'])   # FS keys outside FSKeys stay errors
    with pytest.raises(ConfigError, match="eval.metrics = \\['f1'\\]: 'f1' not reported"):
        load_config(TINY_YAML, ['eval.metrics', "['f1']"])


def test_an_fs_llm_named_config_loads_in_the_embedded_runner(tmp_path):
    cfg = load_config(TINY_YAML, overrides={
        'trainer': {'type': 'llmtrainer'}, 'federate': {'method': 'FedAvg', 'share_local_model': True},
        'model': {'type': 'tiny-llama@huggingface_llm'}, 'train': {'is_enable_half': True},
        'llm': {'adapter': {'use': True, 'args': [LORA_ARGS]}},
        'data': {'splits': [0.8, 0.1, 0.1 + 1e-9]},
        'eval': {'metrics': ['loss'], 'best_res_update_round_wise_key': 'val_loss'}})
    assert (cfg.trainer.type, cfg.federate.method, cfg.model.type) == ('fsplug', 'fsplug', 'tiny-llama@fsplug_llm')
    assert (cfg.fsplug.model.lora.r, cfg.fsplug.model.lora.alpha, cfg.fsplug.model.lora.dropout) == (8, 16, 0.05)
    assert cfg.fsplug.model.dtype == 'float16' and cfg.federate.share_local_model is True
    assert cfg.fsplug.data.val_fraction == 0.1
    assert cfg.eval.best_res_update_round_wise_key == 'val_avg_loss'


def test_a_later_layer_overrides_a_mapped_value():
    cfg = load_config(TINY_YAML, ['fsplug.model.lora.r', '4'], overrides={
        'llm': {'adapter': {'use': True, 'args': [LORA_ARGS]}}})
    assert (cfg.fsplug.model.lora.r, cfg.fsplug.model.lora.dropout) == (4, 0.05)


def test_a_client_entry_with_fs_llm_keys_carries_the_plugin_keys():
    cfg = load_config(TINY_YAML)
    entry = {'llm': {'adapter': {'use': True, 'args': [{'r': 4, 'lora_alpha': 8}]}}}
    override = client_overrides({'client_2': entry}, cfg)[2]
    assert override['fsplug']['model']['lora'] == {'r': 4, 'alpha': 8}   # what FS's server side merges
    assert client_config(cfg, override).fsplug.model.lora.r == 4


def test_a_val_best_result_key_needs_a_validation_split():
    with pytest.raises(ConfigError) as err:
        load_config(TINY_YAML, ['eval.best_res_update_round_wise_key', 'val_loss'])
    assert "eval.best_res_update_round_wise_key = 'val_avg_loss' needs a validation split" in str(err.value)
    cfg = load_config(TINY_YAML, ['eval.best_res_update_round_wise_key', 'val_token_acc',
                                  'fsplug.data.val_fraction', '0.1'])
    assert cfg.eval.best_res_update_round_wise_key == 'val_token_acc'


# ------------------------------------------------------------------ (d) FS-LLM's YAMLs under FS

FS_LLM_BASELINES = {'exp_yaml/alpaca/alpaca_federate.yaml': 0.001,
                    'exp_yaml/dolly_lda/dolly_federate.yaml': 0.001,
                    'exp_yaml/gsm/gsm_federate.yaml': 0.001, 'testcase.yaml': 0.01}
TINY_MODEL = ['model.type', 'tiny-llama@huggingface_llm', 'fsplug.model.builder', 'tiny_llama']


def fs_llm_config(name: str, *opts):
    """An FS-LLM baseline YAML merged as FS's main.py merges it, plus fsplug.method and a tiny
    model; frozen (FS's ready_for_run)."""
    import federatedscope
    from federatedscope.core.configs.config import global_cfg
    cfg = global_cfg.clone()
    cfg.merge_from_file(os.path.join(os.path.dirname(federatedscope.__file__), 'llm', 'baseline', name))
    cfg.merge_from_list(['fsplug.method', 'fedavg', 'outdir', tempfile.mkdtemp(), *TINY_MODEL, *opts])
    cfg.freeze(inform=False, save=False)
    return cfg


@pytest.mark.fs
@pytest.mark.parametrize('name', sorted(FS_LLM_BASELINES))
def test_fs_llm_baseline_yaml_passes_with_only_the_method_added(name):
    cfg = fs_llm_config(name)
    assert (cfg.trainer.type, cfg.federate.method, cfg.model.type) == ('fsplug', 'fsplug', 'tiny-llama@fsplug_llm')
    fraction = FS_LLM_BASELINES[name]
    assert (cfg.fsplug.data.val_fraction, cfg.fsplug.data.test_fraction) == (fraction, fraction)
    assert cfg.eval.best_res_update_round_wise_key == 'val_avg_loss'
    assert cfg.train.is_enable_half is False     # else FS-LLM's trainer halves the trainables too
    lora = cfg.fsplug.model.lora
    if name != 'testcase.yaml':   # the three federated baselines: LoRA r 8, half precision
        assert (lora.r, lora.alpha, lora.dropout, cfg.fsplug.model.dtype) == (8, 16, 0.05, 'float16')


@pytest.mark.fs
def test_fs_refuses_and_later_merges_override_mapped_values():
    with pytest.raises(ConfigError, match='llm.offsite_tuning.use is not supported'):
        fs_llm_config('exp_yaml/alpaca/alpaca_federate.yaml', 'llm.offsite_tuning.use', 'True')
    with pytest.raises(ConfigError, match='fsplug.model.lora.r = 4'):   # YAML and command line disagree
        fs_llm_config('exp_yaml/alpaca/alpaca_federate.yaml', 'fsplug.model.lora.r', '4')
    cfg = fs_llm_config('exp_yaml/alpaca/alpaca_federate.yaml')
    client = cfg.clone()                      # a --client_cfg entry, as FS's runner merges it
    client.defrost()
    client.merge_from_list(['fsplug.model.lora.r', '4'])
    client.freeze(inform=False, save=False)
    assert (client.fsplug.model.lora.r, client.fsplug.model.lora.dropout) == (4, 0.05)
    assert client.federate.share_local_model is True


@pytest.mark.fs
def test_an_fs_llm_named_fs_run_with_shared_local_model_gives_the_embedded_numbers(tmp_path):
    """Through FS's main.py: FS-LLM's names and federate.share_local_model: True (FS's runner
    then hands every client the server's model object, which fsplug clients do not use: each
    builds its own) give the numbers of the embedded runner."""
    from helpers import tiny_config, write_yaml
    from test_fs_integration import _embedded_rows, assert_same_numbers, read_rows, run_fs_in_process
    cfg = tiny_config(tmp_path, 'fedavg', rounds=2, steps=2, trainer={'type': 'llmtrainer'},
                      federate={'method': 'FedAvg', 'share_local_model': True},
                      model={'type': 'tiny-llama@huggingface_llm'},
                      # no LoRA dropout: the embedded runner leaves torch's global generator,
                      # which dropout draws from, unseeded
                      llm={'adapter': {'use': True, 'args': [dict(LORA_ARGS, lora_dropout=0.0)]}},
                      data={'splits': [0.7, 0.1, 0.2]},
                      eval={'metrics': ['loss'], 'best_res_update_round_wise_key': 'val_loss'})
    fs_cfg = deep_update(copy.deepcopy(cfg), {'criterion': {'type': 'CrossEntropyLoss'},
                                              'early_stop': {'patience': 0},
                                              'fsplug': {'results_dir': str(tmp_path / 'fs')}})
    proc = run_fs_in_process(['--cfg', write_yaml(tmp_path / 'fs.yaml', fs_cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_rows(str(tmp_path / 'fs'))
    assert any('val_avg_loss' in row for row in rows)
    assert_same_numbers(rows, _embedded_rows(tmp_path, cfg))


@pytest.mark.fs
def test_fs_early_stopping_stops_the_plugins_server(tmp_path):
    """early_stop.* is honoured: FS's server stops the federation when the best-result key has
    not improved (here: by more than delta) for `patience` evaluations."""
    from helpers import tiny_config, write_yaml
    from test_fs_integration import read_rows, run_fs
    cfg = tiny_config(tmp_path, 'fedavg', rounds=6, steps=1, early_stop={'patience': 1, 'delta': 100.0})
    deep_update(cfg, {'fsplug': {'results_dir': str(tmp_path / 'fs')}})
    proc = run_fs(['--cfg', write_yaml(tmp_path / 'fs.yaml', cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {row['round'] for row in read_rows(str(tmp_path / 'fs')) if row['kind'] in ('train', 'eval')} == {0, 1}

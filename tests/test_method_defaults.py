"""A method switched on over an FS-LLM config composes with its own defaults: Fed-MoLE's default
MoLE targets join the LoRA targets (logged), an explicit conflicting setting is refused naming
both keys, FLAME on a dense model names the MoE model to use, and every registered method on the
shipped tiny config either builds its model or refuses with a message naming a config key."""
import logging
import math
import re

import pytest
import toy_methods  # noqa: F401  (registers the test-only methods, so the registry is the same in every order)
from helpers import TINY_YAML, run_embedded_keeping_clients, tiny_config, write_yaml

from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import all_methods
from fs_plugins.run.config import load_config
from fs_plugins.run.runtime import resolved_client_config
from fs_plugins.schema.validate import fs_defaults, fsplug_defaults

PLUGIN_LORA_TARGETS = "['q_proj', 'v_proj']"   # fsplug.model.lora.target_modules' default
FEDMOLE_LOG = 'fs_plugins.methods.fedmole'


def switched(tmp_path, method, *opts):
    """yamls/fedavg/tiny.yaml with `fsplug.method <method>` on the command line, as
    `fs-plugins run --cfg yamls/fedavg/tiny.yaml fsplug.method <method>` loads it."""
    return load_config(TINY_YAML, ['fsplug.method', method, 'data.root', str(tmp_path / 'data'),
                                   'outdir', str(tmp_path / 'exp'),
                                   'fsplug.results_dir', str(tmp_path / 'results'), *opts])


def built(cfg):
    method = all_methods()[cfg.fsplug.method](cfg)
    return build_model(cfg, method)


# ------------------------------------------------------------------ Fed-MoLE's default targets
@pytest.mark.quick
def test_fedmole_default_targets_join_the_lora_targets_and_a_round_runs(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=FEDMOLE_LOG):
        cfg = switched(tmp_path, 'fedmole', 'fsplug.model.lora.target_modules', PLUGIN_LORA_TARGETS,
                       'federate.total_round_num', '1', 'train.local_update_steps', '1')
    assert list(cfg.fsplug.model.lora.target_modules) == ['q_proj', 'v_proj', 'up_proj']
    assert list(cfg.fsplug.fedmole.target_modules) == ['up_proj']
    logged = [r.getMessage() for r in caplog.records if r.name == FEDMOLE_LOG]
    assert len(logged) == 1 and all(key in logged[0] for key in (
        'fsplug.fedmole.target_modules', 'fsplug.model.lora.target_modules', "['up_proj']"))
    results, clients = run_embedded_keeping_clients(cfg)
    train = [r for r in results.rows if r['kind'] == 'train']
    assert len(train) == 4 and all(math.isfinite(r['train_avg_loss']) for r in train)
    for proc in clients.values():
        names = [n for n, _ in proc.model.named_parameters()]
        assert any('up_proj.mole.router' in n for n in names)
        assert any('up_proj.lora_A' in n for n in names)   # the shared expert
        assert not any('q_proj.mole' in n for n in names)


def test_targets_already_among_the_lora_targets_change_nothing(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=FEDMOLE_LOG):
        cfg = switched(tmp_path, 'fedmole')   # the shipped tiny YAML targets up_proj itself
    assert list(cfg.fsplug.model.lora.target_modules) == ['q_proj', 'v_proj', 'up_proj', 'down_proj']
    assert not [r for r in caplog.records if r.name == FEDMOLE_LOG]


@pytest.mark.quick
def test_explicit_fedmole_targets_outside_the_lora_targets_name_both_keys(tmp_path):
    with pytest.raises(ConfigError) as caught:
        switched(tmp_path, 'fedmole', 'fsplug.model.lora.target_modules', PLUGIN_LORA_TARGETS,
                 'fsplug.fedmole.target_modules', "['gate_proj']")
    [problem] = [p for p in caught.value.problems if 'fedmole' in p]
    assert "fsplug.fedmole.target_modules = ['gate_proj']" in problem
    assert "fsplug.model.lora.target_modules = ['q_proj', 'v_proj']" in problem


def test_explicit_fedmole_targets_among_the_lora_targets_are_kept(tmp_path):
    cfg = switched(tmp_path, 'fedmole', 'fsplug.fedmole.target_modules', "['down_proj']")
    assert list(cfg.fsplug.model.lora.target_modules) == ['q_proj', 'v_proj', 'up_proj', 'down_proj']
    assert list(cfg.fsplug.fedmole.target_modules) == ['down_proj']


def test_a_client_config_with_its_own_lora_targets_gets_the_default_targets_too(tmp_path):
    cfg = switched(tmp_path, 'fedmole')
    ccfg = resolved_client_config(cfg, {'fsplug': {'model': {'lora': {'target_modules': ['q_proj']}}}},
                                  all_methods()['fedmole'], {})
    assert list(ccfg.fsplug.model.lora.target_modules) == ['q_proj', 'up_proj']
    assert list(cfg.fsplug.model.lora.target_modules) == ['q_proj', 'v_proj', 'up_proj', 'down_proj']


# ------------------------------------------------------------------ FLAME needs an MoE model
@pytest.mark.quick
def test_flame_on_a_dense_model_names_the_moe_model_and_builder(tmp_path):
    cfg = switched(tmp_path, 'flame')
    with pytest.raises(ConfigError) as caught:
        built(cfg)
    [message] = caught.value.problems
    for needed in ("model.type = 'tiny-llama@fsplug_llm'", 'fsplug.model.builder: tiny_llama',
                   'model.type: allenai/OLMoE-1B-7B-0924@fsplug_llm with fsplug.model.builder: olmoe',
                   'model.type: tiny-olmoe@fsplug_llm with fsplug.model.builder: tiny_olmoe',
                   'fsplug.model.lora.target_parameters'):
        assert needed in message, (needed, message)


@pytest.mark.quick
def test_flame_on_the_moe_model_the_message_names_builds(tmp_path):
    """The model the refusal above points to builds, LoRA on every expert (peft target_parameters)."""
    raw = tiny_config(tmp_path, 'flame', model={'type': 'tiny-olmoe@fsplug_llm'}, fsplug={'model': {
        'builder': 'tiny_olmoe', 'lora': {'target_modules': ['q_proj', 'v_proj'],
                                          'target_parameters': ['mlp.experts.gate_up_proj',
                                                                'mlp.experts.down_proj']}}})
    model = built(load_config(write_yaml(tmp_path / 'flame.yaml', raw))).model
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any('experts' in n and 'lora_A' in n for n in names)


# ------------------------------------------------------------------ every registered method
def config_keys() -> dict:
    return {**fs_defaults(), 'fsplug': fsplug_defaults()}


def names_a_key(text: str, tree: dict) -> bool:
    """Whether `text` names a key of the config tree (dotted, e.g. fsplug.model.builder)."""
    for candidate in re.findall(r'(?<![\w/.])[a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+', text):
        node = tree
        for part in candidate.split('.'):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            return True
    return False


@pytest.mark.parametrize('lora', ['shipped', 'plugin_default'])
@pytest.mark.parametrize('method', sorted(all_methods()))
def test_every_method_on_the_tiny_config_builds_or_names_a_key(tmp_path, method, lora):
    """yamls/fedavg/tiny.yaml plus `fsplug.method <name>` (with its LoRA targets, or the
    plugin's default ones): the config loads and the model builds, or a ConfigError says which
    key to change (library methods: fsplug.model.library.adapters; UniFLoW: its builder; FLAME
    and the expert-wise baselines: an MoE model.type)."""
    opts = ['fsplug.model.lora.target_modules', PLUGIN_LORA_TARGETS] if lora == 'plugin_default' else []
    try:
        cfg = switched(tmp_path, method, *opts)
        built(cfg)
    except ConfigError as exc:
        tree = config_keys()
        unnamed = [p for p in exc.problems if not names_a_key(p, tree)]
        assert not unnamed, unnamed

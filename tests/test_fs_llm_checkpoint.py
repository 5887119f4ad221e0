"""federate.save_to files that FS-LLM's own loading path reads (fs_plugins.fs.fs_llm_checkpoint):
a FedAvg run's file loads through FS-LLM's `get_llm` + `load_state_dict` with every LoRA tensor
(no missing, no unexpected key) equal to the plugin's saved global adapter; a Fed-MoLE run's file
says it is not plain LoRA; federate.restore_from restores the plugin's files and FS-LLM's."""
import os
import subprocess
import sys

import pytest
import torch
from helpers import deep_update, env_with_tests, tiny_config, write_yaml

pytest.importorskip('federatedscope')
pytestmark = pytest.mark.fs   # the fs tier

from fs_plugins.fs import fs_llm_checkpoint as ckpt_mod  # noqa: E402

LORA = {'r': 8, 'lora_alpha': 16, 'target_modules': ['q_proj', 'v_proj', 'up_proj', 'down_proj']}
# what the file records as FS-LLM's llm.adapter.args[0] for the tiny YAML's LoRA
FS_LLM_ARGS = {'adapter_package': 'peft', 'adapter_method': 'lora', 'lora_dropout': 0.0,
               **LORA, 'target_modules': sorted(LORA['target_modules'])}


def run_fs(tmp_path, name, cfg):
    import federatedscope
    root = os.path.dirname(os.path.dirname(federatedscope.__file__))
    proc = subprocess.run([sys.executable, 'federatedscope/main.py', '--cfg',
                           write_yaml(tmp_path / f'{name}.yaml', cfg)], cwd=root,
                          env=env_with_tests(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def fs_llm_model(tmp_path, args=None):
    """FS-LLM's own model for the tiny Llama with LoRA `args` (FS-LLM's llm.adapter.args[0])."""
    from federatedscope.core.configs.config import global_cfg
    from federatedscope.llm.model.model_builder import get_llm

    from fs_plugins.models.tiny import ensure_tiny_llama
    cfg = global_cfg.clone()
    cfg.model.type = f'{ensure_tiny_llama()}@huggingface_llm'
    cfg.data.root = str(tmp_path / 'fs_llm_data')
    cfg.llm.adapter.use = True
    cfg.llm.adapter.args = [{'adapter_package': 'peft', 'adapter_method': 'lora',
                             **(args or LORA)}]
    return get_llm(cfg)


def load_as_fs_llm_does(model, path):
    """What FS-LLM's FSChatBot does with federate.save_to (federatedscope/llm/misc/fschat.py):
    torch.load (weights only, torch's default) and AdapterModel.load_state_dict (strict=False)."""
    ckpt = torch.load(path, map_location='cpu')
    assert 'cur_round' in ckpt
    return ckpt, model.load_state_dict(ckpt['model'])


@pytest.fixture(scope='module')
def fedavg_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('fedavg')
    cfg = tiny_config(tmp, 'fedavg', rounds=2, steps=2,
                      federate={'save_to': str(tmp / 'global.pt'), 'save_freq': 1})
    deep_update(cfg, {'fsplug': {'results_dir': str(tmp / 'fs')}})
    return tmp, cfg, run_fs(tmp, 'fedavg', cfg)


# ------------------------------------------------------------------ key mapping
def test_key_mapping_is_the_peft_name_with_adapter_default():
    name = 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight'
    assert ckpt_mod.fs_llm_key(name) == name
    assert ckpt_mod.fs_llm_key(name.replace('.default.', '.global.')) == name
    assert ckpt_mod.fs_llm_key('base_model.model.lm_head.weight') == 'base_model.model.lm_head.weight'
    known = {name: torch.zeros(8, 64)}
    assert ckpt_mod.plugin_names([name, 'model.' + name, 'other'], known) == {
        name: name, 'model.' + name: name}


def test_restore_maps_drops_and_checks():
    name = 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight'
    known = {name: torch.zeros(8, 64)}
    whole = {name: torch.ones(8, 64, dtype=torch.float16),
             'base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight': torch.ones(64, 64)}
    restored, unknown, mismatched = ckpt_mod.restored_state(whole, known)
    assert set(restored) == {name} and restored[name].dtype == torch.float32
    assert unknown == ['base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight']
    assert not mismatched
    with pytest.raises(ValueError, match='another shape'):
        ckpt_mod.restore({name: torch.ones(16, 64)}, known)
    with pytest.raises(ValueError, match='none of'):
        ckpt_mod.restore({'x': torch.ones(1)}, known)


@pytest.mark.parametrize('method, plain, advice', [
    ('fedavg', True, None), ('fedprox', True, None),
    ('ffa', False, 'fs-plugins export --run'),          # the global state lacks the frozen A
    ('fedsa', False, 'fs-plugins export --run'),        # ... the local B
    ('fedmole', False, 'fs_plugins.load_trained')])      # export refuses its routed experts
def test_which_methods_save_plain_lora(tmp_path, method, plain, advice):
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.run.config import load_config
    from fs_plugins.run.runtime import initial_global
    cfg = load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(tmp_path, method)))
    method_obj = get_method_class(method)(cfg)
    shared, layout = initial_global(cfg, method_obj)
    form = ckpt_mod.checkpoint_form(cfg, method_obj, layout, shared, 'RUN')
    meta = ckpt_mod.checkpoint(form, shared, 0)[ckpt_mod.META_KEY]
    assert meta['plain_lora'] is plain and meta['method'] == method
    if plain:
        assert meta['fs_llm']['llm.adapter.args'] == [FS_LLM_ARGS]
    else:
        assert "not loadable by FS-LLM's get_llm" in meta['note'] and advice in meta['note']
        assert meta['reason']


# ------------------------------------------------------------ through FS and FS-LLM
def test_fedavg_save_to_loads_through_fs_llm(fedavg_run, tmp_path):
    """FS-LLM's get_llm for the same tiny model and LoRA loads every tensor of the file FS's
    server wrote (final, best and save_freq's), each equal to the global adapter the plugin
    saved under adapters/global."""
    import safetensors.torch
    from peft import get_peft_model_state_dict
    run_tmp, _, _ = fedavg_run
    saved = safetensors.torch.load_file(
        str(run_tmp / 'fs' / 'adapters' / 'global' / 'adapter_model.safetensors'))
    for name in ('final_global.pt', 'global.pt', '1_global.pt'):
        model = fs_llm_model(tmp_path)
        expected = model.state_dict()   # FS-LLM's AdapterModel: its trainable (LoRA) tensors
        ckpt, result = load_as_fs_llm_does(model, run_tmp / name)
        meta = ckpt['fsplug']
        assert meta['plain_lora'] is True and meta['method'] == 'fedavg', name
        assert meta['fs_llm']['llm.adapter.args'] == [FS_LLM_ARGS]
        from fs_plugins.models.tiny import ensure_tiny_llama
        assert meta['base_model_path'] == ensure_tiny_llama()
        assert result.unexpected_keys == []
        assert [k for k in result.missing_keys if 'lora_' in k] == []
        assert set(ckpt['model']) == set(expected)
        for key, value in ckpt['model'].items():
            assert value.dtype == expected[key].dtype and value.shape == expected[key].shape
        loaded = model.state_dict()
        for key, value in ckpt['model'].items():
            assert torch.equal(loaded[key], value), (name, key)
        if name == 'final_global.pt':   # the final global state, as the plugin saved it
            assert ckpt['cur_round'] == 2
            peft_state = get_peft_model_state_dict(model.model)
            assert set(peft_state) == set(saved)
            for key, value in saved.items():
                torch.testing.assert_close(peft_state[key], value, rtol=0, atol=0)
        if name == '1_global.pt':
            assert ckpt['cur_round'] == 1


def _lr_zero_run(tmp, name, restore_from):
    """One round from `restore_from` with a learning rate too small to move any weight: the
    final file holds the restored global state."""
    cfg = tiny_config(tmp, 'fedavg', rounds=1, steps=1,
                      federate={'save_to': str(tmp / f'{name}.pt'), 'restore_from': str(restore_from)},
                      train={'optimizer': {'lr': 1e-30}})
    deep_update(cfg, {'fsplug': {'results_dir': str(tmp / name)}})
    log = run_fs(tmp, name, cfg)
    assert f'Restored the model from {restore_from}' in log
    return torch.load(tmp / f'final_{name}.pt', map_location='cpu'), log


def test_restore_from_round_trip(fedavg_run, tmp_path):
    run_tmp, _, _ = fedavg_run
    before = torch.load(run_tmp / 'final_global.pt', map_location='cpu')
    after, log = _lr_zero_run(tmp_path, 'again', run_tmp / 'final_global.pt')
    assert 'restored 16 global tensor(s)' in log
    assert set(after['model']) == set(before['model'])
    for key, value in before['model'].items():
        torch.testing.assert_close(after['model'][key], value, rtol=1e-6, atol=1e-8)


def test_restore_from_a_file_fs_llm_wrote(tmp_path):
    """FS-LLM's AdapterModel.save_model writes the whole peft model (base weights included):
    the plugin's FedAvg restores its LoRA tensors and skips the rest."""
    model = fs_llm_model(tmp_path)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if 'lora_' in name:
                param.copy_(0.01 * torch.randn(param.shape, generator=generator))
    path = tmp_path / 'fs_llm.ckpt'
    model.save_model(str(path), state=3)
    lora = model.state_dict()
    assert any('base_layer' in k for k in torch.load(path)['model'])
    after, log = _lr_zero_run(tmp_path, 'from_fs_llm', path)
    assert 'restored 16 global tensor(s)' in log and 'skipped' in log
    assert set(after['model']) == set(lora)
    for key, value in lora.items():
        torch.testing.assert_close(after['model'][key], value, rtol=1e-6, atol=1e-8)


def test_fedmole_save_to_says_it_is_not_plain_lora(tmp_path):
    cfg = tiny_config(tmp_path, 'fedmole', rounds=1, steps=1,
                      federate={'save_to': str(tmp_path / 'mole.pt')})
    deep_update(cfg, {'fsplug': {'results_dir': str(tmp_path / 'fs')}})
    log = run_fs(tmp_path, 'fedmole', cfg)
    ckpt = torch.load(tmp_path / 'final_mole.pt', map_location='cpu')
    meta = ckpt['fsplug']
    assert meta['plain_lora'] is False and meta['method'] == 'fedmole'
    assert "not loadable by FS-LLM's get_llm" in meta['note']
    assert str(tmp_path / 'fs') in meta['note'] and meta['reason']
    assert "is not loadable by FS-LLM's get_llm" in log   # the warning at the first save
    # restore_from of it: FS's own aggregator loads it into the server's global state
    from federatedscope.core.aggregators import ClientsAvgAggregator

    from fs_plugins.fs.workers import GlobalState
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.run.config import load_config
    from fs_plugins.run.runtime import initial_global
    plugin_cfg = load_config(write_yaml(tmp_path / 'embedded.yaml', tiny_config(tmp_path, 'fedmole')))
    shared, _ = initial_global(plugin_cfg, get_method_class('fedmole')(plugin_cfg))
    state = GlobalState(shared)
    ClientsAvgAggregator(model=state, device='cpu').load_model(str(tmp_path / 'final_mole.pt'))
    assert ckpt['model'] and set(state.tensors) == set(ckpt['model']) == set(shared)
    for name, value in ckpt['model'].items():
        assert torch.equal(state.tensors[name], value), name

"""train.is_enable_half through FS: FS-LLM's trainer would `ctx.model.half()` the whole model;
the plugin's trainer leaves the precision to the builder, so the frozen base is float16
(fsplug.model.dtype) while every trainable tensor and every upload stays float32."""
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_config, write_yaml
from test_nbafl import run_fs_probed

from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.config import load_config

pytestmark = pytest.mark.fs   # the fs tier: skipped, with the reason, without FederatedScope


def test_half_keeps_trainables_and_uploads_float32_over_a_float16_base(tmp_path):
    cfg = tiny_config(tmp_path, 'fedavg', rounds=2, steps=1, train={'is_enable_half': True},
                      fsplug={'model': {'dtype': 'float16'}})
    _, recorded = run_fs_probed(tmp_path, cfg)
    clients = {name: r for name, r in recorded.items() if name.startswith('client_')}
    received = {name: r for name, r in recorded.items() if name.startswith('received_')}
    assert len(clients) == len(received) == 2 * 4
    for record in clients.values():
        assert {t.dtype for t in record['trainable'].values()} == {torch.float32}
        assert {t.dtype for t in record['shared'].values()} == {torch.float32}
        assert {t.dtype for t in record['frozen'].values()} == {torch.float16}
        # the model FS's trainer holds is the same mixed-precision one
        assert record['ctx_model_dtypes'] == ['torch.float16', 'torch.float32']
    for upload in received.values():
        assert upload and {t.dtype for t in upload.values()} == {torch.float32}


def test_the_trainer_never_halves_the_model(tmp_path):
    """The hook FS runs at every fit start with train.is_enable_half still True (the config
    mapping resets it; a trainer must not depend on that): FS-LLM's halves every parameter,
    the plugin's leaves the builder's precision."""
    from federatedscope.llm.trainer.trainer import LLMTrainer

    from fs_plugins.fs.trainer import PluginTrainer
    cfg = load_config(write_yaml(tmp_path / 'c.yaml', tiny_config(
        tmp_path, 'fedavg', fsplug={'model': {'dtype': 'float16'}})))
    half = SimpleNamespace(train=SimpleNamespace(is_enable_half=True),
                           llm=SimpleNamespace(deepspeed=SimpleNamespace(use=False)))

    def dtypes_after(hook):
        built = build_model(cfg, get_method_class('fedavg')(cfg), share_frozen=False)
        ctx = SimpleNamespace(model=built.model, cfg=half)
        hook(SimpleNamespace(cfg=half), ctx)
        trainable = set(built.trainable_names)
        params = dict(ctx.model.named_parameters())
        return ({params[n].dtype for n in trainable},
                {p.dtype for n, p in params.items() if n not in trainable})

    assert dtypes_after(LLMTrainer._hook_on_fit_start_numerical_precision) == (
        {torch.float16}, {torch.float16})
    assert dtypes_after(PluginTrainer._hook_on_fit_start_numerical_precision) == (
        {torch.float32}, {torch.float16})

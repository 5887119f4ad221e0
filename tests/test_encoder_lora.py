"""Encoder LoRA that trains (UniFLoW Table 6, ImageBind): ImageBind's trunk attention is a
torch.nn.MultiheadAttention, whose forward never calls `out_proj`; the imagebind backend swaps it
for an attention on the same parameters that does (fs_plugins.models.imagebind_layout), and the
model build refuses LoRA targets that could never receive a gradient
(fs_plugins.models.target_check). On the random tiny model of ImageBind's layout (backend
`imagebind`, path `tiny-imagebind`) and yamls/uniflow/tiny.yaml; sizes at ImageBind-huge's
widths on the meta device."""
import pytest
import torch
import yaml
from helpers import REPO

from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.methods.specs import model_spec
from fs_plugins.models.builders import LoadedBase, inject_adapter
from fs_plugins.models.imagebind_layout import (
    IMAGEBIND_HUGE_TRUNKS,
    ImageBindLayout,
    ImageBindStyleAttention,
    SelfAttention,
    Trunk,
    TrunkSize,
    expose_attention,
    tiny_imagebind,
    trunk_lora_parameters,
)
from fs_plugins.run.client import ClientProcedure
from fs_plugins.run.config import load_config
from fs_plugins.run.runtime import build_federated_records

TINY = f'{REPO}/yamls/uniflow/tiny.yaml'
PAPER_YAMLS = {'pandagpt_image': ('vision',), 'heysquad_audio': ('audio',),
               'heysquad_pandagpt': ('vision', 'audio')}
TRAINED_TARGETS = ['out_proj', 'fc1', 'fc2']


def tiny_imagebind_cfg(tmp_path, targets=TRAINED_TARGETS, *overrides):
    pairs = []
    for modality in ('image', 'audio'):
        pairs += [f'fsplug.model.multimodal.{modality}.backend', 'imagebind',
                  f'fsplug.model.multimodal.{modality}.path', 'tiny-imagebind',
                  f'fsplug.model.multimodal.{modality}.pool_tokens', '1',
                  f'fsplug.model.multimodal.{modality}.lora_targets', str(list(targets))]
    return load_config(TINY, ['data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
                              'fsplug.results_dir', str(tmp_path / 'results'), *pairs, *overrides])


# ------------------------------------------------------------------ the attention swap
@pytest.mark.parametrize('add_bias_kv, add_zero_attn, batch_first', [
    (False, False, False), (True, False, False), (True, True, False), (False, False, True)])
@pytest.mark.parametrize('mask', ['none', 'bool', 'float', 'per_head'])
def test_self_attention_computes_multihead_attention(add_bias_kv, add_zero_attn, batch_first, mask):
    torch.manual_seed(0)
    width, heads, length, batch = 16, 4, 5, 3
    attention = ImageBindStyleAttention(width, heads, add_bias_kv=add_bias_kv,
                                        add_zero_attn=add_zero_attn, batch_first=batch_first)
    x = torch.randn((batch, length, width) if batch_first else (length, batch, width))
    attn_mask = {'none': None,
                 'bool': torch.ones(length, length, dtype=torch.bool).triu(1),
                 'float': torch.randn(length, length),
                 'per_head': torch.randn(batch * heads, length, length)}[mask]
    swapped = SelfAttention(attention)
    assert dict(swapped.named_parameters()) == dict(attention.named_parameters())   # same objects, names
    torch.testing.assert_close(swapped(x, attn_mask), attention(x, attn_mask), rtol=1e-5, atol=1e-6)


def test_swapped_trunk_gives_the_same_embedding_and_keeps_plain_attention():
    model = tiny_imagebind(audio_frames=100)
    images, clips = torch.randn(2, 3, 32, 32), torch.randn(2, 1, 80, 100)
    before = {key: model.modality_trunks[key](**model.modality_preprocessors[key](**{key: x})['trunk'])
              for key, x in (('vision', images), ('audio', clips))}
    names = dict(model.state_dict())
    swapped = expose_attention(model)
    assert swapped == [f'modality_trunks.{k}.blocks.{i}.attn' for k in ('vision', 'audio') for i in (0, 1)]
    assert dict(model.state_dict()).keys() == names.keys()
    for key, x in (('vision', images), ('audio', clips)):
        after = model.modality_trunks[key](**model.modality_preprocessors[key](**{key: x})['trunk'])
        torch.testing.assert_close(after, before[key], rtol=1e-5, atol=1e-6)
    # a plain MultiheadAttention is called with (query, key, value): not swapped
    plain = torch.nn.Sequential(torch.nn.MultiheadAttention(8, 2))
    assert expose_attention(plain) == [] and isinstance(plain[0], torch.nn.MultiheadAttention)


# ------------------------------------------------------------------ (a) the build-time check
class Encoders(torch.nn.Module):
    """An encoder + LLM model's encoder side: a trunk laid out as ImageBind's, not swapped."""

    def __init__(self):
        super().__init__()
        self.encoders = torch.nn.ModuleDict({'image': Trunk(16, 2, 2, 32, True, False)})

    def forward(self, tokens):
        return self.encoders['image'](tokens)


def inject(tmp_path, targets, llm_targets=None):
    overrides = ['fsplug.model.lora.target_modules', str(llm_targets)] if llm_targets else []
    options = model_spec(tiny_imagebind_cfg(tmp_path, ['fc1'], *overrides)).model
    base = LoadedBase(Encoders(), codec=None, peft_task_type=None,
                      encoder_lora_targets={'encoders.image.': targets},
                      lora_target_keys={'encoders.image.': 'fsplug.model.multimodal.image.lora_targets'})
    return inject_adapter(base.model, options, 1, base)


def test_lora_on_multihead_attention_out_proj_fails_at_build(tmp_path):
    with pytest.raises(ConfigError) as raised:
        inject(tmp_path, ['out_proj', 'fc1'])
    message = str(raised.value)
    assert "fsplug.model.multimodal.image.lora_targets = ['out_proj', 'fc1']" in message
    assert 'encoders.image.blocks.0.attn.out_proj, encoders.image.blocks.1.attn.out_proj' in message
    assert 'F.multi_head_attention_forward' in message
    # the LLM side's key is named for its own targets (any builder: the check is in inject_adapter)
    with pytest.raises(ConfigError, match=r"fsplug.model.lora.target_modules = \['out_proj'\] "
                                          r"targets 2 module\(s\) \(encoders.image.blocks.0.attn.out_proj"):
        inject(tmp_path, ['fc1'], llm_targets=['out_proj'])
    # ImageBind's attention subclass (forward(x, attn_mask) -> output) as a whole: peft's
    # MultiheadAttention LoRA would read its output as (output, weights)
    with pytest.raises(ConfigError, match=r'encoders.image.blocks.0.attn, encoders.image.blocks.1.attn'):
        inject(tmp_path, ['attn'])
    model = inject(tmp_path, ['fc1', 'fc2'])
    assert sum('lora_A' in n for n, _ in model.named_parameters()) == 4


def test_out_proj_lora_gets_no_gradient_inside_multihead_attention():
    """What the check prevents: peft wraps out_proj, MultiheadAttention never calls it."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    model = get_peft_model(Encoders(), LoraConfig(r=4, target_modules=['out_proj', 'fc1'],
                                                  init_lora_weights=False))
    model(torch.randn(2, 5, 16)).pow(2).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if 'lora_' in n}
    assert all(g is None for n, g in grads.items() if 'out_proj' in n)
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if 'fc1' in n)


# ------------------------------------------------------------------ (b) the new targets train
def test_imagebind_encoder_lora_gets_gradients_and_changes(tmp_path):
    cfg = tiny_imagebind_cfg(tmp_path, TRAINED_TARGETS, 'fsplug.uniflow.schedule', 'simultaneous')
    method = get_method_class('uniflow')(cfg)
    records = build_federated_records(cfg)
    both = 2   # by_source clients in sorted group order: audio, both, image
    proc = ClientProcedure(both, cfg, method, build_model(cfg, method), records.clients[both])
    encoder_lora = {n: p for n, p in proc.model.named_parameters()
                    if '.encoders.' in n and 'lora_' in n}
    per_target = {(m, t) for n in encoder_lora for m in ('image', 'audio') for t in TRAINED_TARGETS
                  if f'.encoders.{m}.' in n and f'.{t}.' in n}
    assert per_target == {(m, t) for m in ('image', 'audio') for t in TRAINED_TARGETS}
    assert all(p.requires_grad for p in encoder_lora.values())
    before = {n: p.detach().clone() for n, p in encoder_lora.items()}
    proc.begin_round()
    for step in range(2):   # step 1: B gets its gradient (B = 0 at first); step 2: A too
        proc.optimise(proc.compute_loss(proc.next_batch()))
        proc.record(0.0, 1)
        for name, param in encoder_lora.items():
            if 'lora_B' in name or step == 1:
                assert param.grad is not None and param.grad.abs().sum() > 0, name
    proc.end_round()
    assert all(not torch.equal(p.detach(), before[n]) for n, p in encoder_lora.items())


# ------------------------------------------------------------------ (c) Table 6's encoder LoRA
def test_table6_encoder_lora_size_at_imagebind_huge():
    """Table 6: encoder LoRA ~6M on ImageBind-huge (one cell for its Image and Audio rows; the
    LLM's 33M is Vicuna-7B's q/v at r = 64, 33.55M). The table gives one significant digit, so
    the count must round to 6M: [5.5M, 6.5M)."""
    from peft import LoraConfig, get_peft_model
    for name, trunks in PAPER_YAMLS.items():
        with open(f'{REPO}/yamls/uniflow/{name}.yaml', encoding='utf-8') as handle:
            model = yaml.safe_load(handle)['fsplug']['model']
        r = model['lora']['r']
        for modality, key in (('image', 'vision'), ('audio', 'audio')):
            targets = model['multimodal'].get(modality, {}).get('lora_targets')
            assert (targets is not None) == (key in trunks), name
            if targets is not None:
                assert targets == ['out_proj'] and r == 64, name
    counts = trunk_lora_parameters(['out_proj'], 64)
    assert counts == {'vision': 32 * 64 * (1280 + 1280), 'audio': 12 * 64 * (768 + 768)}
    assert counts == {'vision': 5_242_880, 'audio': 1_179_648}
    assert 5_500_000 <= sum(counts.values()) < 6_500_000
    # any other target set at r = 64 is far from it: fc1 alone on the vision trunk is 13.1M
    assert trunk_lora_parameters(['fc1'], 64)['vision'] == 13_107_200
    # the same count from the module tree at ImageBind-huge's widths (meta device: no memory)
    sizes = {k: TrunkSize(v['width'], v['blocks'], v['heads'], v['mlp'])
             for k, v in IMAGEBIND_HUGE_TRUNKS.items()}
    with torch.device('meta'):
        huge = ImageBindLayout(sizes, 1024, audio_frames=204, image_size=224, mel_bins=128)
    expose_attention(huge)
    peft_model = get_peft_model(huge, LoraConfig(r=64, target_modules=['out_proj']))
    for key, count in counts.items():
        assert sum(p.numel() for n, p in peft_model.named_parameters()
                   if 'lora_' in n and f'modality_trunks.{key}.' in n) == count

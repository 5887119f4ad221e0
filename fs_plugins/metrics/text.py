"""Text-overlap metrics of generated answers: ROUGE-L, BLEU and METEOR, each in 0..1 (nan
without any sample). A reference may be a list of acceptable texts.

ROUGE-L (rouge-score): F-measure of the longest common subsequence, rouge-score's default
tokenizer (lower case, tokens = runs of a-z0-9, so text in other scripts scores 0) without
stemming, as in Hugging Face `evaluate`'s default; the best-scoring reference counts.

BLEU (sacrebleu): corpus BLEU / 100 with sacrebleu's defaults (BLEU-4, tokenizer '13a', case
sensitive, 'exp' smoothing, no effective order), every acceptable text of a reference being one
of its references (sacrebleu's variable number of references per segment).

METEOR (nltk `meteor_score`, its defaults alpha 0.9, beta 3, gamma 0.5, lower case, Porter
stems and WordNet synonyms): per sample the best score over its references, averaged over
samples. Texts are tokenised by `meteor_tokens`: runs of word characters and single
punctuation marks (close to nltk's word_tokenize, which needs the punkt data). WordNet comes
from fs_plugins.metrics.wordnet."""
from __future__ import annotations

import re
from functools import lru_cache

from fs_plugins.metrics.vqa import check_lengths, reference_answers
from fs_plugins.metrics.wordnet import load_wordnet

_METEOR_TOKEN = re.compile(r'\w+|[^\w\s]')


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


def bleu(predictions: list[str], references: list) -> float:
    """sacrebleu corpus BLEU / 100 in 0..1 (nan without any sample); see the module docstring."""
    check_lengths(predictions, references)
    if not predictions:
        return float('nan')
    try:
        import sacrebleu
    except ImportError as err:
        raise ImportError('bleu needs sacrebleu: pip install -c constraints.txt sacrebleu') from err
    answers = [reference_answers(r) for r in references]
    width = max(len(a) for a in answers)
    # reference stream i holds each sample's i-th answer, None where a sample has fewer
    streams = [[a[i] if i < len(a) else None for a in answers] for i in range(width)]
    score = sacrebleu.corpus_bleu([str(p) for p in predictions], streams).score
    return min(1.0, score / 100)      # 100.0000000000000x for identical texts


def meteor_tokens(text: str) -> list[str]:
    """METEOR's tokens: runs of word characters and single punctuation marks."""
    return _METEOR_TOKEN.findall(str(text))


def meteor(predictions: list[str], references: list) -> float:
    """Mean nltk METEOR in 0..1 (nan without any sample); see the module docstring."""
    check_lengths(predictions, references)
    if not predictions:
        return float('nan')
    wordnet = load_wordnet()        # first: it says how to install nltk or WordNet
    from nltk.translate.meteor_score import meteor_score
    scores = [meteor_score([meteor_tokens(a) for a in reference_answers(ref)], meteor_tokens(pred),
                           wordnet=wordnet)
              for pred, ref in zip(predictions, references)]
    return sum(scores) / len(scores)

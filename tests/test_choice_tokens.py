"""FedMosaic's accuracy (A.6): the chosen option of a multi-choice question, the share of the
gold answer's words for an open one, as the authors' evaluation scores them."""
import math

import pytest

from fs_plugins.data.multimodal import ChoiceReference, reference_answer
from fs_plugins.metrics.choice_tokens import choice_token_accuracy as accuracy
from fs_plugins.metrics.generation_metrics import GENERATION_METRICS
from fs_plugins.metrics.vqa import vqa_exact_accuracy

COLOURS = ['red', 'blue', 'green']


@pytest.mark.parametrize('prediction,reference', [
    ('Yes.', 'yes'),                       # case and punctuation
    ('(A) red', 'A'),                      # the option letter in the authors' "(A)" form
    ('two', '2'),                          # number words
    ('A', 'A'),
    ('Answer: B.', ChoiceReference('blue', COLOURS)),     # the letter of the gold option's text
    ('I think it is the green one', ChoiceReference('green', COLOURS)),   # the option's text
    ('blue', ChoiceReference('B', COLOURS)),
    ('a cat on the mat', 'cat'),           # every gold word is there
])
def test_the_answers_the_paper_counts_as_correct_score_1(prediction, reference):
    assert accuracy([prediction], [reference]) == 1.0


@pytest.mark.parametrize('prediction,reference', [
    ('(B) blue', 'A'),                     # another option
    ('A or B', 'A'),                       # two letters named: no choice inferred
    ('A cat sat on a mat', 'A'),           # a lone 'A' among more than three words is the article
    ('red or blue', ChoiceReference('red', COLOURS)),     # two options' texts: no choice
    ('no', 'yes'),
])
def test_wrong_or_undecided_answers_score_0(prediction, reference):
    assert accuracy([prediction], [reference]) == 0.0


def test_open_answers_score_the_share_of_the_gold_words_and_the_mean_over_answers():
    assert accuracy(['a red bus'], ['red double decker bus']) == pytest.approx(2 / 4)
    assert accuracy(['yes', 'a red bus', '(A)'], ['yes', 'red double decker bus', 'B']) \
        == pytest.approx((1 + 0.5 + 0) / 3)
    assert math.isnan(accuracy([], []))
    assert GENERATION_METRICS['choice_token_acc'] is accuracy


def test_a_record_with_choices_gives_a_reference_the_other_metrics_read_as_its_answer():
    reference = reference_answer({'answer': 'blue', 'options': COLOURS})
    assert isinstance(reference, ChoiceReference) and reference.choices == tuple(COLOURS)
    assert vqa_exact_accuracy(['blue'], [reference]) == 1.0
    assert reference_answer({'answer': 'blue'}) == 'blue'
    assert type(reference_answer({'answer': 'blue'})) is str

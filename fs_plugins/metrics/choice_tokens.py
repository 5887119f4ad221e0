"""FedMosaic's accuracy (A.6, Metrics): "the correct choice for multi-choice questions and the
correct tokens compared to the ground-truth answer for the open-ended questions", as the
authors' evaluation computes it (github.com/snumprlab/fedmosaic, eval_scripts/eval_VLM_CL.py,
read, not copied):

- a multi-choice question (the record lists its `choices` / `options`, or the answer is an
  option letter A-H): the option the generated answer names — its letter standing alone
  ("A", "(A) red", "Answer: B.") when exactly one option letter does, else the one option whose
  text it contains — compared with the gold option, case aside: 1 or 0;
- an open question: the share of the gold answer's distinct words that the generated answer
  contains. The authors count distinct tokenizer ids; here words after `normalize_answer`
  (lower case, punctuation and articles dropped, "two" -> "2"), so that 'Yes.' vs 'yes' and
  'two' vs '2' score 1 as the paper's "correct tokens" intends (choice: a tokenizer's ids split
  'Yes' and 'yes' apart).
The metric is the mean over the answers (the authors sum matched and gold tokens over a
dataset; a client's test set here mixes multi-choice and open tasks, so every answer weighs
the same). A reference carries its record's choices as `fs_plugins.data.multimodal.ChoiceReference`
(a str), which every other metric reads as the plain answer.
"""
from __future__ import annotations

import re
import string

from fs_plugins.metrics.vqa import check_lengths, normalize_answer, reference_answers

OPTION_LETTERS = string.ascii_uppercase[:8]          # A-H: the DRAKE / HFLB option letters
_SEPARATORS = re.compile(r'[.()\[\],:;!*#{}"\'?]')   # around an option letter: "(A)", "A.", "A:"


def option_letters(choices: tuple[str, ...]) -> str:
    return OPTION_LETTERS[:len(choices)] if choices else OPTION_LETTERS


def named_letter(answer: str, letters: str) -> str | None:
    """The option letter the answer names standing alone, when exactly one does; a lone 'A'
    among more than three words is the article, not an option."""
    words = _SEPARATORS.sub(' ', answer).split()
    named = [letter for letter in letters if letter in words]
    if len(named) != 1 or (named == ['A'] and len(words) > 3):
        return None
    return named[0]


def named_choice(answer: str, choices: tuple[str, ...]) -> str | None:
    """The letter of the one option whose (normalised) text the answer contains."""
    text = f' {normalize_answer(answer)} '
    hits = [OPTION_LETTERS[i] for i, choice in enumerate(choices)
            if normalize_answer(choice) and f' {normalize_answer(choice)} ' in text]
    return hits[0] if len(hits) == 1 else None


def gold_letter(gold: str, choices: tuple[str, ...]) -> str | None:
    if gold.strip().upper() in option_letters(choices) and len(gold.strip()) == 1:
        return gold.strip().upper()
    texts = [normalize_answer(c) for c in choices]
    return OPTION_LETTERS[texts.index(normalize_answer(gold))] if normalize_answer(gold) in texts \
        else None


def is_multi_choice(gold: str, choices: tuple[str, ...]) -> bool:
    return bool(choices) or (len(gold.strip()) == 1 and gold.strip() in OPTION_LETTERS)


def choice_score(prediction: str, gold: str, choices: tuple[str, ...]) -> float:
    """1 when the option the prediction names is the gold option, else 0."""
    picked = named_letter(prediction, option_letters(choices)) or \
        (named_choice(prediction, choices) if choices else None)
    return float(picked is not None and picked == gold_letter(gold, choices))


def token_score(prediction: str, gold: str) -> float:
    """The share of the gold answer's distinct normalised words found in the prediction."""
    gold_words = set(normalize_answer(gold).split())
    if not gold_words:
        return float(normalize_answer(prediction) == normalize_answer(gold))
    return len(gold_words & set(normalize_answer(prediction).split())) / len(gold_words)


def answer_score(prediction: str, reference) -> float:
    """The best score over a reference's acceptable answers."""
    choices = getattr(reference, 'choices', ())
    scores = []
    for gold in reference_answers(reference):
        gold = str(gold)
        scores.append(choice_score(prediction, gold, choices) if is_multi_choice(gold, choices)
                      else token_score(prediction, gold))
    return max(scores)


def choice_token_accuracy(predictions: list[str], references: list) -> float:
    """FedMosaic's accuracy: the mean answer score (nan without any sample)."""
    check_lengths(predictions, references)
    if not predictions:
        return float('nan')
    return sum(answer_score(str(p), r) for p, r in zip(predictions, references)) / len(predictions)

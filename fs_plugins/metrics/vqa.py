"""VQA accuracy: the strict exact match of Fed-MoLE (appendix A.2: "counting a prediction as
correct only when it exactly matches the ground-truth answer"), `vqa_exact_accuracy`, and the
normalised match `vqa_accuracy`.

`vqa_exact_accuracy` compares the texts as they are, only surrounding white space removed (the
generated answer's leading space / trailing newline are tokenizer artefacts): case, articles and
punctuation count. `vqa_accuracy` normalises both sides first (`normalize_answer`), in the
spirit of the official VQA evaluation:
1. lower case, surrounding white space removed;
2. thousands separators inside numbers dropped ("1,000" -> "1000"); a period is kept only between
   digits ("2.5"), otherwise removed;
3. apostrophes removed ("man's" -> "mans"); every other punctuation character becomes a space;
4. number words zero..ten become digits ("two" -> "2");
5. the articles a / an / the are dropped; runs of white space collapse to one space.
"""
from __future__ import annotations

import re
import string

NUMBER_WORDS = {'zero': '0', 'one': '1', 'two': '2', 'three': '3', 'four': '4', 'five': '5',
                'six': '6', 'seven': '7', 'eight': '8', 'nine': '9', 'ten': '10'}
ARTICLES = {'a', 'an', 'the'}
_DIGIT_COMMA = re.compile(r'(?<=\d),(?=\d{3}\b)')
_NON_DECIMAL_PERIOD = re.compile(r'(?<!\d)\.|\.(?!\d)')
_OTHER_PUNCT = re.compile('[' + re.escape(''.join(c for c in string.punctuation if c not in ".'")) + ']')


def normalize_answer(text: str) -> str:
    text = str(text).lower().strip()
    text = _DIGIT_COMMA.sub('', text)
    text = _NON_DECIMAL_PERIOD.sub('', text)
    text = text.replace("'", '').replace('\u2019', '')
    text = _OTHER_PUNCT.sub(' ', text)
    words = [NUMBER_WORDS.get(word, word) for word in text.split()]
    return ' '.join(word for word in words if word not in ARTICLES)


def check_lengths(predictions: list, references: list) -> None:
    if len(predictions) != len(references):
        raise ValueError(f'{len(predictions)} predictions but {len(references)} references')


def reference_answers(reference) -> list[str]:
    """The answers one reference accepts: a str or a list of acceptable answers."""
    answers = [reference] if isinstance(reference, str) else list(reference)
    if not answers:
        raise ValueError('a reference holds no acceptable answer')
    return answers


def acceptable_answers(reference) -> set[str]:
    """Normalised answers accepted for one reference."""
    return {normalize_answer(answer) for answer in reference_answers(reference)}


def vqa_accuracy(predictions: list[str], references: list) -> float:
    """Share of predictions whose normalised text equals a normalised acceptable answer
    (nan without any sample)."""
    check_lengths(predictions, references)
    if not predictions:
        return float('nan')
    correct = sum(normalize_answer(pred) in acceptable_answers(ref)
                  for pred, ref in zip(predictions, references))
    return correct / len(predictions)


def vqa_exact_accuracy(predictions: list[str], references: list) -> float:
    """Share of predictions equal to an acceptable answer, surrounding white space aside
    (nan without any sample)."""
    check_lengths(predictions, references)
    if not predictions:
        return float('nan')
    correct = sum(str(pred).strip() in {str(a).strip() for a in reference_answers(ref)}
                  for pred, ref in zip(predictions, references))
    return correct / len(predictions)

"""Numeric answers of math word problems: reading the final number of a generated solution and
comparing it with the reference, for `mgsm_accuracy` (SmartFed's Chinese mathematical reasoning:
MGSM's Chinese subset, "accuracy" = the final numeric answer matches).

Reading a number (`parse_number`): the text is NFKC-normalised first (full-width digits, comma
and period become ASCII); a number is an optional sign, digits with optional thousands
separators ("1,234" -> 1234; "1,2" is two numbers), an optional decimal part and an optional
"/denominator" (a fraction, "3/4" -> 0.75); a trailing "%" is dropped without scaling
("50%" -> 50, as MGSM writes percentages). A "-" counts as a sign only when it does not follow a
digit, letter or closing bracket ("10-3" is 10 and 3). Units, currency signs and words around
the number are ignored.

The final answer of a generation (`final_number`), first rule that applies:
1. the last `\\boxed{...}`: the last number inside it (`\\frac{a}{b}` read as a/b);
2. the last answer marker ("答案", "answer", "####", "the answer is"): the last number on the
   first line after it that holds one (so "答案：18元。\\n问题：……3……" gives 18);
3. otherwise the last number of the whole text.

Comparison: equal within `math.isclose(rel_tol=1e-6, abs_tol=1e-4)`; a reference may be a
number, a text holding one, or a list of acceptable ones.
"""
from __future__ import annotations

import math
import re
import unicodedata

from fs_plugins.metrics.vqa import check_lengths

REL_TOL, ABS_TOL = 1e-6, 1e-4
_NUMBER = re.compile(r'(-?)((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:\s*/\s*(\d+(?:\.\d+)?))?')
_SIGN_BLOCKERS = re.compile(r'[\w)\]}]')
_BOXED = re.compile(r'\\boxed\s*\{')
_MARKERS = re.compile(r'(答案|answer is|answer|####)', re.IGNORECASE)
_FRAC = re.compile(r'\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}')


def normalise(text) -> str:
    text = _FRAC.sub(r'\1/\2', unicodedata.normalize('NFKC', str(text)))
    return text.replace('−', '-').replace('–', '-').replace('。', '. ')


def numbers_in(text) -> list[float]:
    """Every number of `text`, in order (rules in the module docstring)."""
    text = normalise(text)
    found = []
    for match in _NUMBER.finditer(text):
        sign, body, denominator = match.groups()
        if sign and match.start() > 0 and _SIGN_BLOCKERS.match(text[match.start() - 1]):
            sign = ''
        if match.start(2) > 0 and text[match.start(2) - 1].isdigit():
            continue   # the tail of a longer digit run the pattern split (e.g. "1234,567")
        try:
            value = float(body.replace(',', ''))
            if denominator is not None:
                den = float(denominator)
                if den == 0:
                    continue
                value /= den
        except ValueError:
            continue
        found.append(-value if sign else value)
    return found


def parse_number(text) -> float | None:
    """The number a reference or a short answer holds (its last one); None when it has none."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int | float):
        return float(text) if math.isfinite(text) else None
    values = numbers_in(text)
    return values[-1] if values else None


def _boxed_contents(text: str) -> list[str]:
    contents = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {'{': 1, '}': -1}.get(text[i], 0)
            if depth == 0:
                contents.append(text[start:i])
                break
        else:
            contents.append(text[start:])
    return contents


def final_number(generation) -> float | None:
    """The final numeric answer of a generated solution (rules in the module docstring)."""
    text = normalise(generation)
    for content in reversed(_boxed_contents(text)):
        values = numbers_in(content)
        if values:
            return values[-1]
    markers = list(_MARKERS.finditer(text))
    if markers:
        for line in text[markers[-1].end():].splitlines():
            values = numbers_in(line)
            if values:
                return values[-1]
    values = numbers_in(text)
    return values[-1] if values else None


def reference_numbers(reference) -> list[float]:
    """The numbers a reference accepts: a number, a text, or a list of either."""
    items = reference if isinstance(reference, list | tuple) else [reference]
    values = [parse_number(item) for item in items if not isinstance(item, dict)]
    return [v for v in values if v is not None]


def numbers_match(value: float | None, accepted: list[float]) -> bool:
    return value is not None and any(math.isclose(value, ref, rel_tol=REL_TOL, abs_tol=ABS_TOL)
                                     for ref in accepted)


def mgsm_accuracy(predictions: list[str], references: list) -> float:
    """Share of generations whose final number (`final_number`) equals a reference number
    (nan without any sample; a reference without a number counts as wrong)."""
    check_lengths(predictions, references)
    if not predictions:
        return float('nan')
    correct = sum(numbers_match(final_number(pred), reference_numbers(ref))
                  for pred, ref in zip(predictions, references))
    return correct / len(predictions)

"""Execution-based metrics over generated code, both run through the one sandbox of
`fs_plugins.metrics.sandbox` (process isolation with limits, not a security boundary; see there,
and FSPLUG_CODE_EXECUTION=0 to switch execution off: the metrics are then nan).

- `pass_at_1` (SmartFed's Chinese code generation on DoIT, "Pass@1"): the generated code and the
  record's tests run together; a sample passes when all of it runs to the end (greedy decoding:
  one sample per problem, so pass@1 is the share of problems passed). The reference is the test
  spec the preparation wrote (`benchmarks_ext/smartfed`): a dict {"test": Python source (asserts,
  or a HumanEval-style `def check(candidate)`), "entry_point": the function `check` is given
  (optional), "test_list": [assert lines] (optional, MBPP style)}, or a list holding one, or its
  JSON text. A reference without any test counts as failed.
- `execution_accuracy` (SmartFed's hard math-word problems on GSM-Hard): the Python code of the
  generation runs as notebook cells (MathCoder's interleaved solutions are several blocks that
  share state; PAL's are one `def solution()`); the result is `solution()`'s return value when
  the code defines it, else the last number printed by the last cell that printed anything and
  ran without error;
  correct when it equals the reference number (`math.isclose(rel_tol=1e-9, abs_tol=1e-3)`,
  PAL's 1e-3). No code, an error, a timeout or no number count as wrong.

The code of a generation (`code_blocks`): its fenced blocks labelled python / py / python3 or
unlabelled (an unterminated last fence runs to the end of the text); without any fence, the
whole text.
"""
from __future__ import annotations

import json
import logging
import math
import re

from fs_plugins.metrics import sandbox
from fs_plugins.metrics.math_answers import numbers_in, reference_numbers
from fs_plugins.metrics.vqa import check_lengths

logger = logging.getLogger(__name__)

EXEC_REL_TOL, EXEC_ABS_TOL = 1e-9, 1e-3
PYTHON_LABELS = ('', 'python', 'py', 'python3')
_FENCE = re.compile(r'```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)', re.S)
_warned: set[str] = set()


def code_blocks(generation: str) -> list[str]:
    """The Python blocks of a generation (rules in the module docstring)."""
    text = str(generation)
    if '```' not in text:
        return [text] if text.strip() else []
    blocks = [body for label, body in _FENCE.findall(text) if label.lower() in PYTHON_LABELS]
    return [b for b in blocks if b.strip()]


def parse_test_spec(reference) -> dict:
    """The test spec of a pass@1 reference: a dict, a list holding one, or its JSON text."""
    if isinstance(reference, list | tuple):
        for item in reference:
            spec = parse_test_spec(item)
            if spec:
                return spec
        return {}
    if isinstance(reference, str):
        try:
            reference = json.loads(reference)
        except json.JSONDecodeError:
            return {}
    return reference if isinstance(reference, dict) else {}


def spec_source(spec: dict) -> str:
    parts = [str(spec.get('test_setup') or ''), str(spec.get('test') or '')]
    parts += [str(line) for line in spec.get('test_list') or []]
    return '\n'.join(p for p in parts if p.strip())


def _disabled(name: str) -> float:
    if name not in _warned:
        _warned.add(name)
        logger.warning('%s: code execution is off (%s=0 or no POSIX resource module): reported as nan',
                       name, sandbox.ENV_SWITCH)
    return float('nan')


def pass_at_1(predictions: list[str], references: list) -> float:
    """Share of generations whose code passes the record's tests (nan without samples, or with
    execution off)."""
    check_lengths(predictions, references)
    if not predictions:
        return float('nan')
    if not sandbox.execution_enabled():
        return _disabled('pass_at_1')
    jobs = []
    for pred, ref in zip(predictions, references):
        spec, blocks = parse_test_spec(ref), code_blocks(pred)
        tests = spec_source(spec)
        if tests and blocks:
            jobs.append({'code': '\n\n'.join(blocks), 'tests': tests,
                         'entry_point': str(spec.get('entry_point') or ''), 'mode': 'tests'})
    results = sandbox.run_many(jobs)
    return sum(r.ok for r in results) / len(predictions)


def execution_value(result: sandbox.SandboxResult) -> float | None:
    """The number a notebook-mode run produced: solution()'s value, else the last number of the
    last cell output."""
    if not result.ok:
        return None
    value = result.value
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        numbers = numbers_in(value)
        if numbers:
            return numbers[-1]
    numbers = numbers_in(result.last_output)
    return numbers[-1] if numbers else None


def execution_accuracy(predictions: list[str], references: list) -> float:
    """Share of generations whose executed code gives the reference number (nan without
    samples, or with execution off)."""
    check_lengths(predictions, references)
    if not predictions:
        return float('nan')
    if not sandbox.execution_enabled():
        return _disabled('execution_accuracy')
    jobs, targets = [], []
    for pred, ref in zip(predictions, references):
        blocks, accepted = code_blocks(pred), reference_numbers(ref)
        if blocks and accepted:
            jobs.append({'code': blocks, 'mode': 'notebook'})
            targets.append(accepted)
    results = sandbox.run_many(jobs)
    correct = 0
    for result, accepted in zip(results, targets):
        value = execution_value(result)
        correct += value is not None and any(
            math.isclose(value, t, rel_tol=EXEC_REL_TOL, abs_tol=EXEC_ABS_TOL) for t in accepted)
    return correct / len(predictions)

"""LLM-as-judge for report generation (Fed-MoLE appendix A.2).

A local causal LM (any path AutoModelForCausalLM / AutoTokenizer load with local_files_only; the
paper uses Qwen3-8B) reads the rubric in templates/report_judge.txt filled with one generated and
one reference report, and answers "Score: <1..5>". Decoding is greedy and batched (left padding).
When the tokenizer has a chat template the prompt is sent as one user message (thinking turned off
for templates that support it); otherwise as plain text.

Reported value, as in the paper's Table 2 ("Score (%)", 100 = poor .. 500 = excellent): the mean
judge score over the parsed outputs times 100. Outputs without a parseable score in 1..5 are counted
as missing: left out of the mean and reported as a count.
"""
from __future__ import annotations

import math
import os
import re

from fs_plugins.metrics.vqa import check_lengths

TEMPLATE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'templates', 'report_judge.txt')
SCORE_SCALE = 100
_THINK_BLOCK = re.compile(r'<think>.*?(</think>|$)', re.S)
_NUMBER = r'(\d+(?:\.\d+)?)'
_SCORE_AFTER_KEYWORD = re.compile(r'score\s*(?:\([^)\n]*\))?[^\d\n]{0,12}?' + _NUMBER, re.I)
_BARE_SCORE = re.compile(r'^\s*\**\s*' + _NUMBER + r'\s*(?:/\s*5)?\s*\**\s*(?:\n|$)')


def load_template(path: str | None = None) -> str:
    path = path or TEMPLATE_PATH
    with open(path, encoding='utf-8') as handle:
        template = handle.read()
    for field in ('{prediction}', '{reference}'):
        if field not in template:
            raise ValueError(f'judge template {path} lacks the field {field}')
    return template


def build_prompt(template: str, prediction: str, reference: str) -> str:
    # str.replace, not str.format: reports may contain braces
    return template.replace('{prediction}', str(prediction).strip()).replace('{reference}', str(reference).strip())


def parse_score(text: str) -> float | None:
    """The judge's score in 1..5 from its output, or None when there is none.

    Takes the first number after the word "score" ("Score: 4", "**Score:** 4", "Score (1-5): 4", "score of 4/5"),
    else an output that is only a number ("4", "4/5"); think blocks are ignored."""
    text = _THINK_BLOCK.sub('', str(text))
    match = _SCORE_AFTER_KEYWORD.search(text) or _BARE_SCORE.match(text)
    if match is None:
        return None
    value = float(match.group(1))
    return value if 1 <= value <= 5 else None


def summarise_scores(scores: list[float | None]) -> dict:
    """{'score': mean × 100 (nan if none parsed), 'mean', 'n', 'n_scored', 'n_missing'}."""
    parsed = [s for s in scores if s is not None]
    mean = sum(parsed) / len(parsed) if parsed else float('nan')
    return {'score': mean * SCORE_SCALE if parsed else float('nan'), 'mean': mean,
            'n': len(scores), 'n_scored': len(parsed), 'n_missing': len(scores) - len(parsed)}


class ReportJudge:
    """judge(predictions, references) -> mean score × 100 (a metric function);
    `judge.outputs(...)` gives the raw judge texts, `judge.scores(...)` the parsed scores."""

    def __init__(self, model_path: str, template_path: str | None = None, batch_size: int = 8,
                 max_new_tokens: int = 160, device: str | None = None, dtype: str = 'auto'):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        if not os.path.isdir(model_path):
            raise FileNotFoundError(f'judge model folder not found: {model_path}')
        self.template = load_template(template_path)
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens
        self.device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True, padding_side='left')
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        torch_dtype = getattr(torch, dtype) if dtype != 'auto' else 'auto'
        self.model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch_dtype)
        self.model.to(self.device).eval()

    def _model_input(self, prompt: str) -> str:
        if not getattr(self.tokenizer, 'chat_template', None):
            return prompt
        return self.tokenizer.apply_chat_template([{'role': 'user', 'content': prompt}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=False)

    def outputs(self, predictions: list[str], references: list[str]) -> list[str]:
        import torch
        check_lengths(predictions, references)
        texts = [self._model_input(build_prompt(self.template, p, r)) for p, r in zip(predictions, references)]
        results = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors='pt', padding=True,
                                   add_special_tokens=not getattr(self.tokenizer, 'chat_template', None))
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with torch.no_grad():
                generated = self.model.generate(**batch, do_sample=False, max_new_tokens=self.max_new_tokens,
                                                pad_token_id=self.tokenizer.pad_token_id)
            new_tokens = generated[:, batch['input_ids'].shape[1]:]
            results.extend(self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
        return results

    def scores(self, predictions: list[str], references: list[str]) -> list[float | None]:
        return [parse_score(text) for text in self.outputs(predictions, references)]

    def __call__(self, predictions: list[str], references: list[str]) -> float:
        if not predictions:
            return math.nan
        return summarise_scores(self.scores(predictions, references))['score']

"""Metrics over generated text: name -> function(predictions: list[str], references: list) -> float.

All return a value in 0..1 (nan for no samples); a reference is a text or a list of acceptable
texts. The report-generation LLM judge is not here: it needs a judge model and runs offline over
saved predictions (scripts/judge_reports.py). Metrics with settings in fsplug.eval (the BERTScore
backbone) read them from `configure_generation_metrics`, which the evaluation calls first."""
from __future__ import annotations

from fs_plugins.core import registry
from fs_plugins.metrics import bertscore
from fs_plugins.metrics.choice_tokens import choice_token_accuracy
from fs_plugins.metrics.detection import detection_iou
from fs_plugins.metrics.execution import execution_accuracy, pass_at_1
from fs_plugins.metrics.math_answers import mgsm_accuracy
from fs_plugins.metrics.text import bleu, meteor, rouge_l
from fs_plugins.metrics.vqa import vqa_accuracy, vqa_exact_accuracy

GENERATION_METRICS = {
    'vqa_acc': vqa_accuracy,
    'vqa_exact': vqa_exact_accuracy,
    'choice_token_acc': choice_token_accuracy,  # FedMosaic A.6: the chosen option / the gold's words
    'iou': detection_iou,
    'rougeL': rouge_l,
    'bleu': bleu,
    'meteor': meteor,
    'bertscore_p': bertscore.bertscore_p,
    'bertscore_r': bertscore.bertscore_r,
    'bertscore_f1': bertscore.bertscore_f1,
    'mgsm_accuracy': mgsm_accuracy,            # SmartFed: final-number match (math_answers)
    'pass_at_1': pass_at_1,                    # SmartFed: generated code + tests, sandboxed (execution)
    'execution_accuracy': execution_accuracy,  # SmartFed: executed code's number vs target (execution)
}
for _name, _metric in GENERATION_METRICS.items():
    registry.GENERATION_METRICS.add(_name, _metric)


def generation_metric(name: str):
    if name not in GENERATION_METRICS:
        raise KeyError(f'unknown generation metric {name!r}; known: {sorted(GENERATION_METRICS)}')
    return GENERATION_METRICS[name]


def configure_generation_metrics(eval_options) -> None:
    """Passes fsplug.eval's metric settings (bertscore_model, bertscore_layers) to the metrics;
    a config without them (a run saved before they existed) gets the defaults."""
    bertscore.configure(getattr(eval_options, 'bertscore_model', '') or '',
                        int(getattr(eval_options, 'bertscore_layers', 0) or 0))

"""Metrics over generated text: name -> function(predictions: list[str], references: list) -> float.

All return a value in 0..1 (nan for no samples). The report-generation LLM judge is not here: it
needs a judge model and runs offline over saved predictions (scripts/judge_reports.py)."""
from __future__ import annotations

from fs_plugins.metrics.detection import detection_iou
from fs_plugins.metrics.text import rouge_l
from fs_plugins.metrics.vqa import vqa_accuracy, vqa_exact_accuracy

GENERATION_METRICS = {
    'vqa_acc': vqa_accuracy,
    'vqa_exact': vqa_exact_accuracy,
    'iou': detection_iou,
    'rougeL': rouge_l,
}


def generation_metric(name: str):
    if name not in GENERATION_METRICS:
        raise KeyError(f'unknown generation metric {name!r}; known: {sorted(GENERATION_METRICS)}')
    return GENERATION_METRICS[name]

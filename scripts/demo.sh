#!/usr/bin/env bash
# The embedded default job: Standalone and FedAvg-LoRA on easyvqa (one client per question
# type: colour / shape / yes-no) with the LLaVA-style SmolLM2-135M model, then the per-client
# VQA-accuracy table (average, Δ vs Standalone) and the accuracy-per-round plot.
# The first run builds the model once into ~/.cache/fs_plugins (61 s measured on 2 CPU cores).
# TINY=1 runs the 20-second tiny-Llama demo instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bench=easyvqa; metric=test_vqa_acc
if [ "${TINY:-0}" = 1 ]; then bench=tiny; metric=test_token_acc; fi
for method in standalone fedavg; do
  fs-plugins run --runner "${RUNNER:-embedded}" --cfg "yamls/$method/$bench.yaml" \
    fsplug.results_dir "exp/demo/$bench/$method"
done
echo
python scripts/compare.py "exp/demo/$bench/standalone" "exp/demo/$bench/fedavg" --metric "$metric" \
  --csv "exp/demo/$bench/compare.csv" --plot "exp/demo/$bench/$metric.png"

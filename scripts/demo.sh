#!/usr/bin/env bash
# The embedded default job: Standalone and FedAvg-LoRA on the tiny demo (a random tiny Llama
# and four toy instruction tasks, one client per task), then the per-client comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
for method in standalone fedavg; do
  fs-plugins run --runner "${RUNNER:-embedded}" --cfg "yamls/$method/tiny.yaml" \
    fsplug.results_dir "exp/demo/$method"
done
echo
python scripts/compare.py exp/demo/standalone exp/demo/fedavg --metric test_token_acc
echo
python scripts/compare.py exp/demo/standalone exp/demo/fedavg --metric test_avg_loss

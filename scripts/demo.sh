#!/usr/bin/env bash
# The embedded default job: Standalone and FedAvg-LoRA on the tiny demo (a random tiny Llama
# and four toy instruction tasks, one client per task), then both per-client tables.
set -euo pipefail
cd "$(dirname "$0")/.."
for method in standalone fedavg; do
  fs-plugins run --runner "${RUNNER:-embedded}" --cfg "yamls/$method/tiny.yaml" \
    fsplug.results_dir "exp/demo/$method"
done
for method in standalone fedavg; do
  echo; echo "== $method (exp/demo/$method/summary.md)"; cat "exp/demo/$method/summary.md"
done

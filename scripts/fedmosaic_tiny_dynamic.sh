#!/usr/bin/env bash
# FedMosaic vs SFT (standalone) vs FedIT (fedavg, aggregated per architecture as the paper's
# baselines are) on the tiny heterogeneous federation (clients 1-2: 2-layer tiny Llama, 3-4:
# 4-layer; yamls/fedmosaic/tiny_clients.yaml) in PFL-Dynamic: each client's four toy tasks
# arrive one after another (rotated order), batches from the episodic memory, Self (test_*)
# and Others (others_*) after every round. Tables: A_last and A_AUC of Self and Others.
# Usage: bash scripts/fedmosaic_tiny_dynamic.sh [seed ...]   (default: 1 2 3)
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=("${@:-1 2 3}")
read -r -a seeds <<< "${seeds[*]}"
runs=()
for seed in "${seeds[@]}"; do
  out=exp/fedmosaic_tiny_dynamic/seed$seed
  mkdir -p "$out"
  for method in fedmosaic standalone fedavg; do
    fs-plugins run --runner embedded --cfg yamls/fedmosaic/tiny.yaml \
      --client_cfg yamls/fedmosaic/tiny_clients.yaml seed "$seed" fsplug.method "$method" \
      data.splitter iid federate.total_round_num 12 \
      fsplug.data.task_field category fsplug.data.dynamic True fsplug.data.task_order rotated \
      fsplug.data.evaluate_others True \
      fsplug.aggregation.per_architecture "$([ "$method" = fedavg ] && echo True || echo False)" \
      fsplug.results_dir "$out/$method" > "$out/$method.log" 2>&1 || { tail -30 "$out/$method.log"; exit 1; }
    runs+=("$out/$method")
  done
done
for metric in test_token_acc others_token_acc; do
  python scripts/compare.py "${runs[@]}" --metric "$metric" --per-round
  echo
  python scripts/compare.py "${runs[@]}" --metric "$metric" --auc
  echo
done

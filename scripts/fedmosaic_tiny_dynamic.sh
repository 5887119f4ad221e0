#!/usr/bin/env bash
# FedMosaic vs SFT (standalone), FedIT (fedavg), DITTO (ditto) and FedDPA-LoRA (feddpa), the
# parameter-averaging baselines aggregated per architecture as the paper's baselines are
# (A.6, "combined with Fed-ET": fsplug.aggregation.per_architecture True), on the tiny
# heterogeneous federation (clients 1-2: 2-layer tiny Llama, 3-4: 4-layer; yamls/fedmosaic/tiny_clients.yaml) in PFL-Dynamic: each client's four toy tasks
# arrive one after another (rotated order), batches from the episodic memory, Self (test_*)
# and Others (others_*) after every round. Tables: A_last and A_AUC of Self and Others.
# Every method at SFT's compute per round (FedMosaic A.6; fsplug.train.local_compute matched,
# docs/baselines.md); LOCAL_COMPUTE=equal_steps gives every phase train.local_update_steps.
# Usage: [LOCAL_COMPUTE=matched] [METHODS="fedmosaic standalone fedavg ditto feddpa"] \
#          [OUT=exp/fedmosaic_tiny_dynamic] bash scripts/fedmosaic_tiny_dynamic.sh [seed ...]
# (default seeds: 1 2 3). Finished runs (summary.md present) are kept and skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=("${@:-1 2 3}")
read -r -a seeds <<< "${seeds[*]}"
runs=()
for seed in "${seeds[@]}"; do
  out=${OUT:-exp/fedmosaic_tiny_dynamic}/seed$seed
  mkdir -p "$out"
  for method in ${METHODS:-fedmosaic standalone fedavg ditto feddpa}; do
    runs+=("$out/$method")
    [ -f "$out/$method/summary.md" ] && { echo "$out/$method: done already, kept"; continue; }
    per_arch=$([ "$method" = fedmosaic ] || [ "$method" = standalone ] && echo False || echo True)
    fs-plugins run --runner embedded --cfg yamls/fedmosaic/tiny.yaml \
      --client_cfg yamls/fedmosaic/tiny_clients.yaml seed "$seed" fsplug.method "$method" \
      data.splitter iid federate.total_round_num 12 \
      fsplug.data.task_field category fsplug.data.dynamic True fsplug.data.task_order rotated \
      fsplug.data.evaluate_others True fsplug.train.local_compute "${LOCAL_COMPUTE:-matched}" \
      fsplug.aggregation.per_architecture "$per_arch" \
      fsplug.results_dir "$out/$method" > "$out/$method.log" 2>&1 || { tail -30 "$out/$method.log"; exit 1; }
  done
done
for metric in test_token_acc others_token_acc; do
  python scripts/compare.py "${runs[@]}" --metric "$metric" --per-round
  echo
  python scripts/compare.py "${runs[@]}" --metric "$metric" --auc
  echo
done

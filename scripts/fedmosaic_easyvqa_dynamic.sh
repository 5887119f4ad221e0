#!/usr/bin/env bash
# FedMosaic's offline experiment (issue 11): PFL-Dynamic on easy-vqa across two model types
# (yamls/fedmosaic/easyvqa_dynamic.yaml: clients 1-2 on easyvqa_llava_small, the pivot and W_s;
# clients 3-4 on easyvqa_llava), FedMosaic against SFT (standalone), FedIT (fedavg) and the
# personalised baselines (ditto, feddpa, ...). As in the paper (A.9, "combined with Fed-ET"), the
# baselines aggregate within each model type (fsplug.aggregation.per_architecture), except
# PerAda, which distils across model types through logits (A.6). Every method runs at SFT's
# compute per round (A.6: "we adjust the local training step for each baseline and FedMosaic to
# use the same computational cost as SFT"; fsplug.train.local_compute matched, ratios of Table
# 15, docs/baselines.md); LOCAL_COMPUTE=equal_steps gives every phase train.local_update_steps.
# Self = test_* (the client's own tasks so far), Others = others_*; A_last and A_AUC tables.
#   SEEDS="1 2 3" METHODS="fedmosaic standalone fedavg ditto feddpa" LOCAL_COMPUTE=matched \
#     bash scripts/fedmosaic_easyvqa_dynamic.sh
# (defaults shown; OUT=exp/fedmosaic_easyvqa_dynamic). Finished runs are kept and skipped.
# EXTRA="key value ..." appends config overrides to every run, e.g. a shorter run on 2 CPU cores:
#   OUT=exp/fedmosaic_easyvqa_r6s5 SEEDS=1 METHODS="fedmosaic fedavg ditto feddpa standalone" \
#     EXTRA="federate.total_round_num 6 train.local_update_steps 5" bash scripts/fedmosaic_easyvqa_dynamic.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-exp/fedmosaic_easyvqa_dynamic}
runs=()
for seed in ${SEEDS:-1 2 3}; do
  for method in ${METHODS:-fedmosaic standalone fedavg ditto feddpa}; do
    dir=$out/seed$seed/$method
    runs+=("$dir")
    [ -f "$dir/summary.md" ] && { echo "$dir: done already, kept"; continue; }
    mkdir -p "$out/seed$seed"
    per_arch=$([ "$method" = fedmosaic ] || [ "$method" = standalone ] || [ "$method" = perada ] \
      && echo False || echo True)
    fs-plugins run --runner embedded --cfg yamls/fedmosaic/easyvqa_dynamic.yaml \
      --client_cfg yamls/fedmosaic/easyvqa_dynamic_clients.yaml seed "$seed" \
      fsplug.method "$method" fsplug.aggregation.per_architecture "$per_arch" \
      fsplug.train.local_compute "${LOCAL_COMPUTE:-matched}" ${EXTRA:-} \
      fsplug.results_dir "$dir" > "$out/seed$seed/$method.log" 2>&1 \
      || { tail -30 "$out/seed$seed/$method.log"; exit 1; }
  done
done
for metric in test_token_acc others_token_acc; do
  python scripts/compare.py "${runs[@]}" --metric "$metric" --per-round \
    --csv "$out/compare_$metric.csv" --plot "$out/$metric.png"
  echo
  python scripts/compare.py "${runs[@]}" --metric "$metric" --auc
  echo
done

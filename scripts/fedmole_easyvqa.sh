#!/usr/bin/env bash
# Fed-MoLE's easyvqa experiment (issue 4): Standalone, FedAvg, Fed-MoLE and the ablations
# V1 (no ADA), M1 (aggregate shared + routed + routers), M2 (aggregate nothing) and
# M3 (aggregate shared + routers), with the same seed and budget (6 rounds x 10 local steps,
# batch 4). Standalone and FedAvg put plain LoRA on the same targets as Fed-MoLE
# (q_proj, v_proj, up_proj), so only the up_proj adapter's form and what is shared differ.
# Fed-MoLE's ADA phases each take a full pass of 10 steps (fsplug.fedmole.phase_steps: each).
# Table 1's FRLoRA and FedLEASE baselines run the FedAvg YAML with their method and the same
# targets; FedLEASE warms up for 1 of the 6 rounds (its code: 5 of 25).
#   SEEDS="1 2 3" bash scripts/fedmole_easyvqa.sh      (default: SEEDS=1; OUT=exp/fedmole_easyvqa)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-exp/fedmole_easyvqa}
same_targets=(fsplug.model.lora.target_modules "['q_proj', 'v_proj', 'up_proj']")
dirs=()
for seed in ${SEEDS:-1}; do
  for run in ${RUNS:-standalone fedavg fedmole fedmole_v1 fedmole_m1 fedmole_m2 fedmole_m3 frlora fedlease}; do
    case $run in
      standalone|fedavg) cfg=yamls/$run/easyvqa.yaml; extra=("${same_targets[@]}") ;;
      frlora) cfg=yamls/fedavg/easyvqa.yaml; extra=(fsplug.method frlora "${same_targets[@]}") ;;
      fedlease) cfg=yamls/fedavg/easyvqa.yaml
        extra=(fsplug.method fedlease fsplug.fedlease.warmup_rounds 1 "${same_targets[@]}") ;;
      fedmole) cfg=yamls/fedmole/easyvqa.yaml; extra=() ;;
      *) cfg=yamls/fedmole/easyvqa_${run#fedmole_}.yaml; extra=() ;;
    esac
    dir=$out/seed$seed/$run
    dirs+=("$dir")
    [ -f "$dir/summary.md" ] && { echo "$dir: done already, kept"; continue; }
    fs-plugins run --cfg "$cfg" seed "$seed" fsplug.results_dir "$dir" "${extra[@]}"
  done
done
for metric in test_vqa_exact test_vqa_acc; do
  python scripts/compare.py "${dirs[@]}" --metric $metric --per-round \
    --csv "$out/compare_$metric.csv" --plot "$out/$metric.png"
done

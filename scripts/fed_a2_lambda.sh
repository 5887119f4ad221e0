#!/usr/bin/env bash
# FedA²-LoRA's Tikhonov λ (UniFLoW Alg. 1 line 17, §3 "λ = 1", Table 12 "λ = 0 w/o Tik." vs
# "λ = 0.1") against FedAvg-LoRA on the tiny benchmark (yamls/{fedavg,fed_a2}/tiny.yaml:
# 4 clients by task, 10 rounds x 10 steps, r = 8), seeds 1 2 3; then the comparison tables
# (scripts/compare.py, mean over seeds of each client's last evaluation) and the per-round
# curves (compare.py --per-round: mean over clients and seeds) to show whether they flattened.
# Usage: bash scripts/fed_a2_lambda.sh [ROUNDS]   (default 10, the tiny grid's setting;
#        with another value the results go to exp/fed_a2_lambda/rounds<ROUNDS>/)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
rounds=${1:-10}
seeds=${SEEDS:-1 2 3}
lambdas=${LAMBDAS:-0 0.1 1}
root=exp/fed_a2_lambda
[ "$rounds" = 10 ] || root=$root/rounds$rounds
runs=()

run() {  # run SEED NAME YAML [OVERRIDES...]
  local seed=$1 name=$2 yaml=$3; shift 3
  local out=$root/seed$seed
  mkdir -p "$out"
  fs-plugins run --cfg "$yaml" seed "$seed" federate.total_round_num "$rounds" "$@" \
    fsplug.results_dir "$out/$name" > "$out/$name.log" 2>&1 || { cat "$out/$name.log"; exit 1; }
  runs+=("$out/$name")
}

for seed in $seeds; do
  run "$seed" fedavg yamls/fedavg/tiny.yaml
  for lam in $lambdas; do
    run "$seed" "fed_a2_lam$lam" yamls/fed_a2/tiny.yaml fsplug.fed_a2.ridge "$lam"
  done
done

for metric in test_token_acc test_avg_loss; do
  python scripts/compare.py "${runs[@]}" --metric "$metric" --baseline fedavg --per-round
  echo
done

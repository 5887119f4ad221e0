#!/usr/bin/env bash
# Every method on the tiny benchmark with the same seed and budget (10 rounds x 10 steps x
# batch 8, 4 clients by task), then the comparison tables. Usage: bash scripts/run_tiny_grid.sh [seed]
set -euo pipefail
cd "$(dirname "$0")/.."
seed=${1:-1}
out=exp/tiny_grid/seed$seed
runs=()
for method in standalone fedavg fedprox fedadagrad fedadam fedyogi scaffold fedsa ffa feddpa fedex fed_a2 hetlora flexlora; do
  fs-plugins run --runner "${RUNNER:-embedded}" --cfg "yamls/$method/tiny.yaml" seed "$seed" \
    fsplug.results_dir "$out/$method" > "$out.$method.log" 2>&1 || { mkdir -p "$out"; cat "$out.$method.log"; exit 1; }
  runs+=("$out/$method")
done
for variant in sgd rslora vera; do
  fs-plugins run --runner "${RUNNER:-embedded}" --cfg "yamls/fedavg/tiny_$variant.yaml" seed "$seed" \
    fsplug.results_dir "$out/fedavg_$variant" > "$out.fedavg_$variant.log" 2>&1
  runs+=("$out/fedavg_$variant")
done
for method in hetlora flexlora; do   # heterogeneous ranks 16/8/4/2
  fs-plugins run --runner "${RUNNER:-embedded}" --cfg "yamls/$method/tiny.yaml" \
    --client_cfg "yamls/$method/tiny_clients.yaml" seed "$seed" \
    fsplug.results_dir "$out/${method}_ranks" > "$out.${method}_ranks.log" 2>&1
  runs+=("$out/${method}_ranks")
done
python scripts/compare.py "${runs[@]}" --metric test_token_acc
echo
python scripts/compare.py "${runs[@]}" --metric test_avg_loss

#!/usr/bin/env bash
# Every registered method on the tiny benchmark with the same seed (each method's
# yamls/<method>/tiny*.yaml: 4 clients by task, 10 rounds x 10 steps), plus each
# yamls/<method>/tiny_clients.yaml as a mixed-rank / per-client run (<method>_ranks), then the
# comparison tables. The method list comes from the registry (`fs-plugins methods`), or from
# METHODS (space-separated names) to run some of them.
# Usage: [METHODS="fedavg flora"] [OUT=exp/tiny_grid] bash scripts/run_tiny_grid.sh [seed]
set -euo pipefail
cd "$(dirname "$0")/.."
seed=${1:-1}
out=${OUT:-exp/tiny_grid}/seed$seed
mkdir -p "$out"
runs=()

run() {  # run NAME YAML [--client_cfg FILE]
  local name=$1 yaml=$2; shift 2
  fs-plugins run --runner "${RUNNER:-embedded}" --cfg "$yaml" "$@" seed "$seed" \
    fsplug.results_dir "$out/$name" > "$out.$name.log" 2>&1 || { cat "$out.$name.log"; exit 1; }
  runs+=("$out/$name")
}

for method in ${METHODS:-$(fs-plugins methods)}; do
  for yaml in yamls/"$method"/tiny*.yaml; do
    variant=$(basename "$yaml" .yaml)
    variant=${variant#tiny}
    [ "$variant" = _clients ] && continue
    run "$method$variant" "$yaml"
  done
  if [ -f "yamls/$method/tiny_clients.yaml" ]; then
    run "${method}_ranks" "yamls/$method/tiny.yaml" --client_cfg "yamls/$method/tiny_clients.yaml"
  fi
done
python scripts/compare.py "${runs[@]}" --metric test_token_acc
echo
python scripts/compare.py "${runs[@]}" --metric test_avg_loss

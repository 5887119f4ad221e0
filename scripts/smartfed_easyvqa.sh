#!/usr/bin/env bash
# SmartFed vs the LoRA-reuse baselines and FedIT on easy-vqa yes/no questions, composing a
# library of a colour LoRA and a shape LoRA trained here. Resumable: a finished run (its
# summary.md exists) is skipped.
#   SEEDS="1 2" bash scripts/smartfed_easyvqa.sh            # results under $OUT (exp/smartfed_easyvqa)
#   EXTRA="federate.total_round_num 4" bash scripts/smartfed_easyvqa.sh
set -euo pipefail
OUT=${OUT:-exp/smartfed_easyvqa}
SEEDS=${SEEDS:-1}
EXTRA=${EXTRA:-}
LIB=$OUT/library
if [ ! -f "$LIB/summary.md" ]; then
  python -m fs_plugins.cli run --cfg yamls/smartfed/easyvqa_library.yaml \
    fsplug.results_dir "$LIB" outdir "$OUT/fs"
fi
ADAPTERS="['$LIB/adapters/client_1', '$LIB/adapters/client_2']"   # colour, shape
# name | overrides (FedIT: FedAvg-LoRA from scratch at the benchmark's LoRA learning rate)
RUNS=(
  "fedit|fsplug.method fedavg train.optimizer.lr 0.001"
  "smartfed|fsplug.method smartfed"
  "smartfed_no_eeqa|fsplug.method smartfed fsplug.smartfed.eeqa False"
  "smartfed_experts_router|fsplug.method smartfed fsplug.smartfed.router_input experts"
  "linear_arithmetic|fsplug.method linear_arithmetic"
  "lorahub|fsplug.method lorahub"
  "mole|fsplug.method mole"
  "lora_flow|fsplug.method lora_flow"
)
for seed in $SEEDS; do
  for entry in "${RUNS[@]}"; do
    name=${entry%%|*}; overrides=${entry#*|}
    dir=$OUT/$name/seed$seed
    [ -f "$dir/summary.md" ] && continue
    mkdir -p "$(dirname "$dir")"
    # shellcheck disable=SC2086
    python -m fs_plugins.cli run --cfg yamls/smartfed/easyvqa.yaml seed "$seed" \
      fsplug.model.library.adapters "$ADAPTERS" $overrides $EXTRA \
      fsplug.results_dir "$dir" outdir "$OUT/fs" > "$dir.log" 2>&1 || { echo "failed: $name seed $seed (see $dir.log)"; exit 1; }
  done
done

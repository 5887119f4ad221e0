#!/usr/bin/env bash
# SmartFed vs the LoRA-reuse baselines and FedIT on easy-vqa yes/no questions, composing a
# library of a colour LoRA and a shape LoRA trained here. Resumable: a finished run (its
# summary.md exists) is skipped.
#   SEEDS="1 2" bash scripts/smartfed_easyvqa.sh   # results: $OUT/seed<k>/<run> (exp/smartfed_easyvqa)
#   EXTRA="federate.total_round_num 4" bash scripts/smartfed_easyvqa.sh
#   ONLY="fedit smartfed" bash scripts/smartfed_easyvqa.sh   # only these runs (names below)
set -euo pipefail
OUT=${OUT:-exp/smartfed_easyvqa}
SEEDS=${SEEDS:-1}
EXTRA=${EXTRA:-}
ONLY=${ONLY:-}
LIB=$OUT/library
if [ ! -f "$LIB/summary.md" ]; then
  python -m fs_plugins.commands.cli run --cfg yamls/smartfed/easyvqa_library.yaml \
    fsplug.results_dir "$LIB" outdir "$OUT/fs"
fi
ADAPTERS="['$LIB/adapters/client_1', '$LIB/adapters/client_2']"   # colour, shape
# name | YAML under yamls/smartfed/ | overrides (FedIT: FedAvg-LoRA from scratch at the
# benchmark's LoRA learning rate; Table 3's ablations from their own YAMLs)
RUNS=(
  "fedit|easyvqa|fsplug.method fedavg train.optimizer.lr 0.001"
  "smartfed|easyvqa|"
  "smartfed_no_eeqa|easyvqa_wo_eeqa|"
  "smartfed_no_more|easyvqa_wo_more|"
  "smartfed_hidden_router|easyvqa|fsplug.smartfed.router_input hidden"
  "linear_arithmetic|easyvqa|fsplug.method linear_arithmetic"
  "lorahub|easyvqa|fsplug.method lorahub"
  "mole|easyvqa|fsplug.method mole"
  "lora_flow|easyvqa|fsplug.method lora_flow"
)
for seed in $SEEDS; do
  for entry in "${RUNS[@]}"; do
    IFS='|' read -r name yaml overrides <<< "$entry"
    [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]] && continue
    dir=$OUT/seed$seed/$name
    [ -f "$dir/summary.md" ] && continue
    mkdir -p "$(dirname "$dir")"
    # shellcheck disable=SC2086
    python -m fs_plugins.commands.cli run --cfg "yamls/smartfed/$yaml.yaml" seed "$seed" \
      fsplug.model.library.adapters "$ADAPTERS" $overrides $EXTRA \
      fsplug.results_dir "$dir" outdir "$OUT/fs" > "$dir.log" 2>&1 || { echo "failed: $name seed $seed (see $dir.log)"; exit 1; }
  done
done
# accuracy (last round, per client and mean over seeds), its curve per round (the plot and a
# table of the client mean per round), activated rank and bytes
python - "$OUT" <<'PY'
import glob, json, os, statistics, sys
runs = sorted({os.path.basename(d) for d in glob.glob(os.path.join(sys.argv[1], 'seed*', '*'))
               if os.path.isdir(d)})
for run in runs:
    rows = [json.loads(line) for d in glob.glob(os.path.join(sys.argv[1], 'seed*', run))
            for line in open(os.path.join(d, 'results.jsonl'))]
    evals = [r for r in rows if r['kind'] == 'eval']
    curve = [statistics.mean(r['test_token_acc'] for r in evals if r['round'] == k)
             for k in sorted({r['round'] for r in evals})]
    print(f"{run:<24} token acc per round: {' '.join(f'{v:.3f}' for v in curve)}")
PY
python scripts/compare.py "$OUT"/seed*/*/ --metric test_vqa_acc --baseline fedit --plot "$OUT/vqa_acc.png"
python scripts/compare.py "$OUT"/seed*/*/ --metric test_token_acc --baseline fedit
# activated rank and bytes per client per round (train rows of the last round)
python - "$OUT" <<'PY'
import glob, json, os, statistics, sys
print(f"{'run':<24} {'activated rank':>15} {'bytes up / round':>17}")
for run in sorted({os.path.basename(d) for d in glob.glob(os.path.join(sys.argv[1], 'seed*', '*'))
                   if os.path.isdir(d)}):
    rows = [json.loads(line) for d in glob.glob(os.path.join(sys.argv[1], 'seed*', run))
            for line in open(os.path.join(d, 'results.jsonl'))]
    last = max(r['round'] for r in rows)
    train = [r for r in rows if r['kind'] == 'train' and r['round'] == last]
    if 'activated_rank' in train[0]:
        rank = statistics.mean(r['activated_rank'] for r in train)
    else:   # FedIT: its own LoRA, every rank active
        info = json.load(open(os.path.join(glob.glob(os.path.join(sys.argv[1], 'seed*', run))[0],
                                           'run_info.json')))
        rank = info['config']['fsplug']['model']['lora']['r']
    print(f"{run:<24} {rank:>15.1f} {statistics.mean(r['bytes_up'] for r in train):>17,.0f}")
PY

#!/usr/bin/env bash
# FLAME's ablations on the tiny CHAMP experiment (yamls/flame/champ_tiny.yaml: tiny OLMoE, 4
# clients at k = 8, 4, 2, 1): temperature t ∈ {0, 1, 2, 4} × activation reading {token, step}
# (paper §5 Figure 3; t = 0 is FedAvg), and the rescaler none / static k/k_i / learnable at the
# YAML's t and reading (paper §5 Table 5; 'learnable' is the run t2_token). Then the tables:
# last evaluation per client of test token accuracy, ROUGE-L and loss (scripts/compare.py;
# several seeds: mean, and the std of the average), and the spread of the activation frequency
# a/S (min / median / max over the experts of each layer, last round, mean over layers, per
# client) from each run's results.jsonl.
# Usage: SEEDS="1 2 3" bash scripts/flame_champ_grid.sh        (default SEEDS=1; ~13 s a run)
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=${SEEDS:-1}
out=${OUT:-exp/flame17}
yaml=yamls/flame/champ_tiny.yaml
runs=()

run() {  # run SEED NAME [key value ...]
  local seed=$1 name=$2; shift 2
  local dir="$out/seed$seed/$name"
  mkdir -p "$dir"
  OMP_NUM_THREADS=1 fs-plugins run --runner "${RUNNER:-embedded}" --cfg "$yaml" seed "$seed" \
    fsplug.results_dir "$dir" "$@" > "$dir.log" 2>&1 || { tail -30 "$dir.log"; exit 1; }
  runs+=("$dir")
}

for seed in $seeds; do
  for activation in token step; do
    for t in 0 1 2 4; do
      run "$seed" "t${t}_$activation" fsplug.flame.temperature "$t" fsplug.flame.activation "$activation"
    done
  done
  for rescale in none static; do
    run "$seed" "rescale_$rescale" fsplug.flame.rescale "$rescale"
  done
done

for metric in test_token_acc test_rougeL test_avg_loss; do
  python scripts/compare.py "${runs[@]}" --metric "$metric" --baseline t0_token
  echo
done

python - "${runs[@]}" <<'EOF'
"""a/S spread per run: each client's last train row (flame_freq_min/median/max: over the
experts of each MoE layer, mean over the layers) and the run's reading, from results.jsonl."""
import json
import os
import statistics
import sys

rows = {}
for run in sys.argv[1:]:
    last = {}
    with open(os.path.join(run, 'results.jsonl'), encoding='utf-8') as handle:
        for line in handle:
            row = json.loads(line)
            if row['kind'] == 'train' and 'flame_freq_median' in row:   # later rounds win
                last[row['client']] = tuple(row[f'flame_freq_{s}'] for s in ('min', 'median', 'max'))
    with open(os.path.join(run, 'run_info.json'), encoding='utf-8') as handle:
        reading = json.load(handle)['config']['fsplug']['flame']['activation']
    rows.setdefault(os.path.basename(run), []).append((reading, last))
print('activation frequency a/S, last round: min / median / max over experts, mean over layers '
      '(and seeds); per client\n')
clients = sorted({c for runs in rows.values() for _, last in runs for c in last})
print('| run | reading | ' + ' | '.join(f'client {c}' for c in clients) + ' |')
print('|' + '---|' * (len(clients) + 2))
for name, runs in rows.items():
    cells = ['/'.join(f'{statistics.mean(last[c][i] for _, last in runs if c in last):.3f}'
                      for i in range(3)) for c in clients]
    print(f'| {name} | {runs[0][0]} | ' + ' | '.join(cells) + ' |')
EOF

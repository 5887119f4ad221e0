#!/usr/bin/env bash
# FLAME's ablations on the tiny CHAMP experiment (yamls/flame/champ_tiny.yaml: tiny OLMoE, 4
# clients at k = 8, 4, 2, 1): temperature t ∈ {0, 1, 2, 4} × activation reading {token, step}
# (paper §5 Figure 3; t = 0 is FedAvg), and the rescaler none / static k/k_i / learnable at the
# YAML's t and reading (paper §5 Table 5; 'learnable' is the run t2_token). Then the tables:
# last evaluation per client of test token accuracy, ROUGE-L and loss (scripts/compare.py;
# several seeds: mean, and the std of the average), and the spread of the activation frequency
# a/S (min / median / max over the experts of each layer, last round, mean over layers and
# clients) from each run's log.
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
"""a/S spread per run: the last round's 'FLAME client c: activation frequency ...' log lines."""
import os
import re
import statistics
import sys

line = re.compile(r'FLAME client (\d+): activation frequency a/S \((\w+)\).*?: (.*)$')
rows = {}
for run in sys.argv[1:]:
    last = {}
    for text in open(run + '.log', encoding='utf-8'):
        match = line.search(text)
        if match:   # later rounds overwrite earlier ones
            layers = [tuple(map(float, part.split(': ')[1].split('/')))
                      for part in match.group(3).split(', ')]
            last[int(match.group(1))] = (match.group(2), layers)
    name = os.path.basename(run)
    rows.setdefault(name, []).append(last)
print('activation frequency a/S, last round: min / median / max over experts, mean over layers '
      '(and seeds); per client\n')
clients = sorted({c for runs in rows.values() for last in runs for c in last})
print('| run | reading | ' + ' | '.join(f'client {c}' for c in clients) + ' |')
print('|' + '---|' * (len(clients) + 2))
for name, runs in rows.items():
    cells = []
    for c in clients:
        stats = [tuple(statistics.mean(layer[i] for layer in last[c][1]) for i in range(3))
                 for last in runs if c in last]
        cells.append('/'.join(f'{statistics.mean(s[i] for s in stats):.3f}' for i in range(3)))
    reading = runs[0][clients[0]][0] if clients[0] in runs[0] else '?'
    print(f'| {name} | {reading} | ' + ' | '.join(cells) + ' |')
EOF

#!/usr/bin/env bash
# UniFLoW's offline experiment (issue 12): image clients and spoken-question clients on easy-vqa
# (yamls/uniflow/easyvqa_image_audio.yaml: SmolLM2-135M + the easy-vqa CLIP tower + whisper-
# tiny.en's encoder, LoRA on all three, II-stage local training), with the server aggregation of
# fsplug.uniflow.aggregation: FedA²-LoRA against FedAvg-LoRA, FFA, FedSA and FedEx.
# Per-client token accuracy (teacher-forced answer tokens) and the generation metrics of the
# last evaluation, and the per-round averages (to see whether the curves flattened).
#   SEEDS="1" AGGREGATIONS="fed_a2 fedavg ffa fedsa fedex" bash scripts/uniflow_easyvqa.sh
# (defaults shown; OUT=exp/uniflow_easyvqa; extra `key value` overrides in EXTRA). Finished runs
# are kept and skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-exp/uniflow_easyvqa}
runs=()
for seed in ${SEEDS:-1}; do
  for aggregation in ${AGGREGATIONS:-fed_a2 fedavg ffa fedsa fedex}; do
    dir=$out/seed$seed/$aggregation
    runs+=("$dir")
    [ -f "$dir/summary.md" ] && { echo "$dir: done already, kept"; continue; }
    mkdir -p "$out/seed$seed"
    # shellcheck disable=SC2086
    fs-plugins run --runner embedded --cfg yamls/uniflow/easyvqa_image_audio.yaml seed "$seed" \
      fsplug.uniflow.aggregation "$aggregation" fsplug.results_dir "$dir" ${EXTRA:-} \
      > "$out/seed$seed/$aggregation.log" 2>&1 \
      || { tail -30 "$out/seed$seed/$aggregation.log"; exit 1; }
  done
done
python scripts/compare.py "${runs[@]}" --metric test_token_acc --baseline fedavg --per-round \
  --csv "$out/compare_test_token_acc.csv" --plot "$out/test_token_acc.png"
for metric in test_vqa_exact test_bertscore_f1 test_bleu test_rougeL test_meteor; do
  echo
  python scripts/compare.py "${runs[@]}" --metric "$metric" --baseline fedavg
done

#!/usr/bin/env bash
# FedMosaic's ablations (paper Table 7, Tables 29-32, Figs. 16-17) as one grid of runs on
# the heterogeneous PFL-Dynamic federations, one run per cell and seed, each the YAML with
# overrides (fsplug.fedmosaic.*, or another method for 'vanilla'; docs/fedmosaic.md#ablations):
#   full        FedMosaic as configured (RELA + PQ-LoRA, the paper's defaults)
#   vanilla     FedIT: fsplug.method fedavg, per_architecture True, weights uniform   Table 7
#               'Vanilla' (same-type clients' LoRA averaged with equal weights; = Table 2's FedIT)
#   no_pq_rela  rela False, pq_lora False   FedMosaic's gated local + global LoRA without RELA or
#               PQ-LoRA (not a row of Table 7: it keeps FedMosaic's gates)
#   no_rela     rela False                  Table 7 '(+) PQ-LoRA' = Table 30 'Equal-weight aggregation'
#   no_pq       pq_lora False               RELA over conventional LoRA only (not in Table 7)
#   nb<N>       num_blocks N                Table 29 (N_B); tiny: 1 2 (2-layer pivot), easyvqa: 2 4 8
#   ema<a>      ema_ratio a                 Fig. 17 (0.1, 0.9; 1.0 ~ Table 30 'Frozen model gradients')
#   keep<N_s>   gradient_keep N_s           Fig. 16 (gradient sampling ratio: 0.1, 1.0)
#   sft_nb<N>   local_only True, num_blocks N   Table 29 'SFT (N_B)' (FedMosaic's layers, no sharing)
#   train_grad  rela_model training, ema_ratio 1.0  Table 30 'Training model gradients'
#   ws8, ws4    small_quantization 8bit / 4bit   Table 31 (k-bit W_s, simulated; the pivot's model)
#   ws_large    small_model_type tiny-llama-large  (tiny only) a W_s other than the pivot (Table 31's
#               smaller W_s has no smaller tiny model here: this checks the option, not the claim)
#   static_*    fsplug.data.dynamic False       Table 32 (PFL-Static): static_full (both aligned),
#               static_rand_a (align_a False), static_rand_b (align_b False), static_rand_ab (both)
# Usage: bash scripts/fedmosaic_ablations.sh [tiny|easyvqa] [seed ...]   (default: tiny 1)
#   CELLS="full no_rela" bash scripts/fedmosaic_ablations.sh tiny 1    runs only those cells
#   DRY=1 bash scripts/fedmosaic_ablations.sh easyvqa 1 2 3            prints the commands
#   EXTRA="federate.total_round_num 2" ...                             more overrides for every run
# Results: exp/fedmosaic_ablations/<setup>/seed<s>/<cell>/ (results.jsonl), then A_last and
# A_AUC of Self (test_token_acc) and Others (others_token_acc) per cell via scripts/compare.py.
set -euo pipefail
cd "$(dirname "$0")/.."
setup=${1:-tiny}
shift || true
seeds=("${@:-1}")
read -r -a seeds <<< "${seeds[*]}"
case "$setup" in
  tiny)
    base=(--cfg yamls/fedmosaic/tiny.yaml --client_cfg yamls/fedmosaic/tiny_clients.yaml
          data.splitter iid federate.total_round_num 12 fsplug.data.task_field category
          fsplug.data.dynamic True fsplug.data.task_order rotated fsplug.data.evaluate_others True)
    blocks=(1 2)
    other_ws='tiny-llama-large@fsplug_llm' ;;
  easyvqa)
    base=(--cfg yamls/fedmosaic/easyvqa_dynamic.yaml
          --client_cfg yamls/fedmosaic/easyvqa_dynamic_clients.yaml)
    blocks=(2 4 8)
    other_ws='' ;;
  *) echo "usage: $0 [tiny|easyvqa] [seed ...]" >&2; exit 2 ;;
esac
declare -A overrides=(
  [full]=''
  [vanilla]='fsplug.method fedavg fsplug.aggregation.per_architecture True fsplug.aggregation.weights uniform'
  [no_pq_rela]='fsplug.fedmosaic.rela False fsplug.fedmosaic.pq_lora False'
  [no_rela]='fsplug.fedmosaic.rela False'
  [no_pq]='fsplug.fedmosaic.pq_lora False'
  [ema0.1]='fsplug.fedmosaic.ema_ratio 0.1'
  [ema0.9]='fsplug.fedmosaic.ema_ratio 0.9'
  [ema1]='fsplug.fedmosaic.ema_ratio 1.0'
  [keep0.1]='fsplug.fedmosaic.gradient_keep 0.1'
  [keep1]='fsplug.fedmosaic.gradient_keep 1.0'
  [train_grad]='fsplug.fedmosaic.rela_model training fsplug.fedmosaic.ema_ratio 1.0'
  [ws8]='fsplug.fedmosaic.small_quantization 8bit'
  [ws4]='fsplug.fedmosaic.small_quantization 4bit'
  [nbs]='fsplug.fedmosaic.aggregation nbs'
  [static_full]='fsplug.data.dynamic False'
  [static_rand_a]='fsplug.data.dynamic False fsplug.fedmosaic.align_a False'
  [static_rand_b]='fsplug.data.dynamic False fsplug.fedmosaic.align_b False'
  [static_rand_ab]='fsplug.data.dynamic False fsplug.fedmosaic.align_a False fsplug.fedmosaic.align_b False'
)
order=(full vanilla no_rela no_pq no_pq_rela)
for n in "${blocks[@]}"; do
  overrides[nb$n]="fsplug.fedmosaic.num_blocks $n"
  overrides[sft_nb$n]="fsplug.fedmosaic.local_only True fsplug.fedmosaic.num_blocks $n"
  order+=("nb$n" "sft_nb$n")
done
order+=(ema0.1 ema0.9 ema1 keep0.1 keep1 train_grad ws8 ws4 nbs)
if [ -n "$other_ws" ]; then
  overrides[ws_large]="fsplug.fedmosaic.small_model_type $other_ws"
  order+=(ws_large)
fi
order+=(static_full static_rand_a static_rand_b static_rand_ab)
read -r -a cells <<< "${CELLS:-${order[*]}}"
read -r -a extra <<< "${EXTRA:-}"
runs=()
for seed in "${seeds[@]}"; do
  for cell in "${cells[@]}"; do
    [ -n "${overrides[$cell]+set}" ] || { echo "unknown cell $cell (cells: ${order[*]})" >&2; exit 2; }
    read -r -a cell_opts <<< "${overrides[$cell]}"
    out=exp/fedmosaic_ablations/$setup/seed$seed/$cell
    cmd=(fs-plugins run --runner embedded "${base[@]}" seed "$seed" fsplug.method fedmosaic
         "${cell_opts[@]}" "${extra[@]}" fsplug.results_dir "$out")
    if [ -n "${DRY:-}" ]; then echo "${cmd[*]}"; continue; fi
    mkdir -p "$out"
    "${cmd[@]}" > "$out.log" 2>&1 || { tail -30 "$out.log"; exit 1; }
    runs+=("$out")
  done
done
[ -n "${DRY:-}" ] && exit 0
for metric in test_token_acc others_token_acc; do
  python scripts/compare.py "${runs[@]}" --metric "$metric" --auc
  echo
done

#!/usr/bin/env bash
# Peak CUDA memory at the papers' model sizes (random weights from their configs), the GPU half
# of docs/scale.md's memory tables: FedMosaic vs SFT on LLaVA-Llama3.2-1B and -3B (Table 15;
# the 3B client's W_s is the 1B), Fed-MoLE vs FedAvg-LoRA on LLaVA-1.5-7B (Table 5). Run from
# the repository root on a GPU machine; OUT (default ./device-out) receives the tables.
#     bash scripts/device_paper_memory.sh
set -o pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
CONFIGS=/tmp/paper_configs
python3 scripts/paper_estimates.py --out "$CONFIGS" --configs-only > /dev/null || exit 1
MOSAIC=yamls/fedmosaic/drake_dynamic.yaml
{
python3 scripts/gpu_paper_memory.py --cfg $MOSAIC --model-dir $CONFIGS/llava-llama3.2-1b --seq-len 128
python3 scripts/gpu_paper_memory.py --cfg $MOSAIC --model-dir $CONFIGS/llava-llama3.2-3b --seq-len 128 \
    fsplug.fedmosaic.pivot_model_type $CONFIGS/llava-llama3.2-1b@fsplug_llm fsplug.fedmosaic.pivot_builder llava
python3 scripts/gpu_paper_memory.py --cfg yamls/fedmole/fedvqa_llava15_7b.yaml \
    --model-dir $CONFIGS/llava-1.5-7b --methods fedavg fedmole --seq-len 64
} 2>&1 | tee "$OUT/paper_memory_gpu.md"

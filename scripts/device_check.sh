#!/usr/bin/env bash
# The checks only a GPU can make, as one command for a GPU machine (the results for docs/scale.md):
# every yamls/*/tiny.yaml on cuda:0 over a bfloat16 base (trainable tensors float32), with each
# run's time and peak CUDA memory. Run from the repository root with fs_plugins importable
# (pip install -e . or PYTHONPATH=.); OUT (default ./device-out) receives the table.
#     bash scripts/device_check.sh [JOBS]
set -o pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
JOBS=${1:-8}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import sys, torch, transformers, peft
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/device.txt"
python3 scripts/bench_tiny_yamls.py --gpu-bf16 --jobs "$JOBS" --timeout 400 --keep /tmp/tiny-bf16 \
    2>&1 | tee "$OUT/tiny_bf16_gpu.md"

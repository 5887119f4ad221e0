"""`fs-plugins estimate` against the measured peak memory of the same training on the CPU.

For each model and configuration (bench_fedmole's: LoRA r=8 on q,k,v,up, AdamW; Fed-MoLE N=8
top-2 on up), with and without gradient checkpointing, a fresh subprocess builds the model,
resets the kernel's peak-RSS counter and runs optimiser steps on one random batch (all tokens
labelled, as the estimate's probe); measured peak = VmHWM minus the RSS of the imported runtime
(bench_fedmole.measure_memory), and training overhead = VmHWM minus the RSS once the model is
built (activations, gradients, optimiser state: what exists only while training). The estimate
is computed in this process for the same config, batch and sequence, without reading the
model's weights. Linux only.

    python scripts/check_estimate.py [--models mid smollm2] [--batch 4] [--seq-len 256]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, 'scripts'))

import bench_fedmole  # noqa: E402

# 'mid': a random Llama between the tiny one and SmolLM2 (the tiny tokenizer), built once
MID_CONFIG = {'hidden_size': 512, 'intermediate_size': 1376, 'num_hidden_layers': 4,
              'num_attention_heads': 8, 'num_key_value_heads': 8}


def ensure_mid_llama() -> str:
    from fs_plugins.models.tiny import TINY_CONFIG, build_tiny_llama_dir, ensure_cached_dir
    return ensure_cached_dir(None, lambda folder: build_tiny_llama_dir(
        folder, 1236, {**TINY_CONFIG, **MID_CONFIG}), 'mid-llama-estimate')


bench_fedmole.MODELS['mid'] = (f'{ensure_mid_llama()}@fsplug_llm', 'causal_lm')


def overrides(checkpointing: bool) -> dict:
    return {'fsplug': {'train': {'gradient_checkpointing': checkpointing}}}


def measured_mib(args, model: str, config: str, checkpointing: bool) -> float:
    cmd = [sys.executable, os.path.abspath(__file__), '--measure', model, config,
           str(int(checkpointing)), '--batch', str(args.batch), '--seq-len', str(args.seq_len),
           '--steps', str(args.steps)]
    # glibc keeps freed heap memory mapped (its mmap threshold grows up to 32 MB as large
    # blocks are freed), so RSS would count freed activations; a fixed 64 KiB threshold
    # makes every large tensor its own mapping, returned when freed
    env = {**os.environ, 'MALLOC_MMAP_THRESHOLD_': '65536'}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f'measurement {model} {config} failed:\n{proc.stderr[-3000:]}')
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(args) -> None:
    """Inside the subprocess: bench_fedmole's measurement with the checkpointing switch."""
    model, config, checkpointing = args.measure
    args.model, args.config, args.round_steps = model, config, args.steps
    with tempfile.TemporaryDirectory() as workdir:
        memory = bench_fedmole.measure_memory(args, workdir, overrides(bool(int(checkpointing))))
        print(json.dumps(memory))


def estimated_mib(args, model: str, config: str, checkpointing: bool, workdir: str) -> dict:
    from fs_plugins.commands.estimate import estimate_client
    _, _, _, cfg = bench_fedmole.build(model, config, workdir)
    cfg.dataloader.batch_size = args.batch
    e = estimate_client(cfg, 1, args.seq_len)
    peak = e.peak_checkpointed_gib if checkpointing else e.peak_gib
    return {'peak_mb': peak * 1024,
            'overhead_mb': (peak - e.weights_gib - e.adapters_gib) * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', nargs='+', default=['mid', 'smollm2'],
                        choices=list(bench_fedmole.MODELS))
    parser.add_argument('--configs', nargs='+', default=['fedavg', 'fedmole_n8'],
                        choices=list(bench_fedmole.CONFIGS))
    parser.add_argument('--batch', type=int, default=4)
    parser.add_argument('--seq-len', type=int, default=256)
    parser.add_argument('--steps', type=int, default=2)
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--measure', nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.measure:
        measure(args)
        return
    print(f'Peak training memory, CPU, batch {args.batch} × {args.seq_len} tokens, AdamW '
          f'(estimate vs measured, MiB):')
    print('| model | config | checkpointing | peak: estimate | measured | ratio | '
          'training overhead: estimate | measured | ratio |')
    print('|---|---|---|---|---|---|---|---|---|')
    with tempfile.TemporaryDirectory() as workdir:
        for model in args.models:
            for config in args.configs:
                for checkpointing in (False, True):
                    guess = estimated_mib(args, model, config, checkpointing, workdir)
                    real = measured_mib(args, model, config, checkpointing)
                    cells = [f'{guess[k]:.0f} | {real[k]:.0f} | {guess[k] / real[k]:.2f}'
                             for k in ('peak_mb', 'overhead_mb')]
                    print(f'| {model} | {config} | {"on" if checkpointing else "off"} | '
                          f'{" | ".join(cells)} |', flush=True)


if __name__ == '__main__':
    main()

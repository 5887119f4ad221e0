"""Peak CUDA memory of a client's training steps at a paper's model size, per method, with
random weights built from the model's config (no checkpoint: `architecture_only` on cuda), for
setting beside `fs-plugins estimate` and the paper's memory ratios (FedMosaic's Table 15).

Each method runs in a fresh process: the model (bfloat16 base where the YAML says so, float32
adapters) is built on cuda:0, then `--steps` optimiser steps of the method's own loss on one
random batch of the YAML's batch size (`--seq-len` text tokens, all labelled, after one image's
tokens for a LLaVA model), under the runner's autocast, with the method's step hooks (FedMosaic:
RELA's W_s gradient on the first step, as every f-th step). Reported: peak allocated GiB over the
whole process (weights, W_s, adapters, gradients, AdamW's state, activations) and the weights
alone after the build. Needs a GPU; `--device cpu` runs the same steps without the memory
figures (a check that the script works).

    python scripts/gpu_paper_memory.py --cfg YAML --model-dir DIR [--builder llava]
        [--methods standalone fedmosaic] [--steps 3] [--seq-len 128] [--checkpointing]
        [--device cuda|cpu] [KEY VALUE ...]

DIR: a folder with the model's config.json (scripts/paper_estimates.py writes the papers').
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
GIB = 1024 ** 3


def measure(args) -> dict:
    """In the method's own process: build on cuda, train, read the CUDA allocator's peak."""
    import torch

    from fs_plugins.commands.estimate import probe_batch
    from fs_plugins.methods.building import build_model
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.models.builders import architecture_only
    from fs_plugins.models.precision import DTYPES, forward_context
    from fs_plugins.run.config import load_config
    cfg = load_config(args.cfg, ['model.type', f'{os.path.abspath(args.model_dir)}@fsplug_llm',
                                 'fsplug.model.builder', args.builder, 'fsplug.model.local_files_only',
                                 'True', 'fsplug.method', args.measure,
                                 'fsplug.train.gradient_checkpointing', str(args.checkpointing),
                                 *args.opts])
    cuda = args.device == 'cuda'
    device = torch.device('cuda', 0) if cuda else torch.device('cpu')
    method = get_method_class(args.measure)(cfg)
    method.client_id = 1
    with architecture_only(device=device.type):
        built = build_model(cfg, method, share_frozen=False)
        model = built.model.to(device)
        method.client_codec = built.codec
        weights = torch.cuda.memory_allocated(device) if cuda else 0
        state = method.init_client_state(model, cfg)
        params = [p for n, p in model.named_parameters() if n in set(built.trainable_names)]
        optimizer = torch.optim.AdamW(params, lr=1e-5)
        one = probe_batch(model, args.seq_len, torch.Generator().manual_seed(0))
        batch = {k: torch.cat([v] * int(cfg.dataloader.batch_size)).to(device) for k, v in one.items()}
        model.train()
        dtype = DTYPES[cfg.fsplug.model.dtype]
        for _ in range(args.steps):
            with forward_context(device, dtype):
                loss = method.loss(model, batch, state)
            loss.backward()
            method.before_optimizer_step(model, state)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            method.after_step(model, state)
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    return {'method': args.measure, 'peak_gib': peak / GIB,
            'weights_gib': weights / GIB, 'trainable': sum(p.numel() for p in params),
            'loss': float(loss)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--cfg', required=True)
    parser.add_argument('--model-dir', required=True)
    parser.add_argument('--builder', default='llava')
    parser.add_argument('--methods', nargs='+', default=['standalone', 'fedmosaic'])
    parser.add_argument('--steps', type=int, default=3)
    parser.add_argument('--seq-len', type=int, default=128)
    parser.add_argument('--checkpointing', action='store_true')
    parser.add_argument('--device', default='cuda', choices=('cuda', 'cpu'))
    parser.add_argument('--measure', default=None, help=argparse.SUPPRESS)
    parser.add_argument('opts', nargs='*', help='further KEY VALUE overrides')
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args)))
        return 0
    rows = []
    for method in args.methods:
        cmd = [sys.executable, os.path.abspath(__file__), '--measure', method, '--cfg', args.cfg,
               '--model-dir', args.model_dir, '--builder', args.builder, '--steps', str(args.steps),
               '--seq-len', str(args.seq_len), '--device', args.device,
               *(['--checkpointing'] if args.checkpointing else []),
               *args.opts]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
        if proc.returncode != 0:
            print(f'{method}: FAILED\n{proc.stderr[-3000:]}', flush=True)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    import torch
    print(f'# {os.path.basename(os.path.normpath(args.model_dir))}, {args.cfg}, {args.steps} steps, '
          f'{args.seq_len} text tokens per sample, checkpointing {"on" if args.checkpointing else "off"}, '
          f'{torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"}')
    print('| method | trainable | weights GiB | peak GiB | peak / first method\'s |')
    print('|---|---:|---:|---:|---:|')
    for row in rows:
        ratio = row['peak_gib'] / rows[0]['peak_gib'] if rows[0]['peak_gib'] else float('nan')
        print(f"| {row['method']} | {row['trainable']:,} | {row['weights_gib']:.2f} | "
              f"{row['peak_gib']:.2f} | {ratio:.3f} |", flush=True)
    return 0 if len(rows) == len(args.methods) else 1


if __name__ == '__main__':
    sys.exit(main())

"""Step time and peak memory of UniFLoW's II-stage local training vs simultaneous training
(encoder and LLM LoRA both trainable every step), on the same client, batches and model, in
one run with the two printed side by side (this machine is noisy: compare the ratio).
Memory: the tensors autograd saves for backward in a step (activations; parameters left out),
the peak over the timed steps, plus the gradients and Adam moments of the parameters that
train in the step (float32); on CUDA also torch's peak allocation.

Each schedule runs in its own subprocess (a fresh peak-memory counter): it builds one client of
the YAML (default: the offline easyvqa image + spoken-question federation, a spoken client),
trains one warm-up round, then times `--repeats` local rounds of `--steps` steps. Peak
memory is the process's peak resident set (CPU) or torch's peak allocation (CUDA).

    python scripts/bench_uniflow.py [--cfg yamls/uniflow/easyvqa_image_audio.yaml]
        [--client 3] [--steps 8] [--repeats 2] [--quick]

--quick: a check that the script works: yamls/uniflow/tiny.yaml (random tiny encoders and LLM),
2 steps (one per stage), 1 timed round.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

SCHEDULES = ('two_stage', 'simultaneous')
DEFAULT_CFG = 'yamls/uniflow/easyvqa_image_audio.yaml'
QUICK_CFG = 'yamls/uniflow/tiny.yaml'   # client 3 has images and tones


def peak_bytes(device) -> int:
    import torch
    if device.type == 'cuda':
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class SavedActivations:
    """Counts the bytes autograd saves for backward (parameters excluded) in one step."""

    def __init__(self, model):
        import torch
        self.params = {p.data_ptr() for p in model.parameters()}
        self.bytes = self.peak = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, tensor):
        if tensor.data_ptr() not in self.params:
            self.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def step(self, compute_loss):
        def wrapped(batch):
            self.bytes = 0
            with self.hooks:
                loss = compute_loss(batch)
            self.peak = max(self.peak, self.bytes)
            return loss
        return wrapped


def trained_state_bytes(proc) -> int:
    """Largest over the round's phases: gradient + two Adam moments of its trained tensors."""
    sizes = []
    for phase in {p.name: p for p in proc.step_phases}.values():
        names = [n for n in proc.trainable_names if phase.trainable is None or phase.trainable(n)]
        sizes.append(sum(3 * proc.params[n].numel() * 4 for n in names))
    return max(sizes)


def measure(args) -> dict:
    """One schedule in this process: seconds per step and peak memory of the training."""
    import torch

    from fs_plugins.methods.building import build_model
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.run.client import ClientProcedure
    from fs_plugins.run.config import load_config
    from fs_plugins.run.runtime import build_federated_records
    cfg = load_config(args.cfg, ['fsplug.uniflow.schedule', args.schedule,
                                 'train.local_update_steps', str(args.steps),
                                 'use_gpu', str(torch.cuda.is_available())])
    method = get_method_class('uniflow')(cfg)
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    proc = ClientProcedure(args.client, cfg, method, build_model(cfg, method),
                           build_federated_records(cfg).clients[args.client], device=device)
    proc.run_round(0)                              # warm-up: one round, not timed
    saved = SavedActivations(proc.model)
    proc.compute_loss = saved.step(proc.compute_loss)
    if device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for round_idx in range(1, args.repeats + 1):
        proc.run_round(round_idx)
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / (args.repeats * args.steps)
    return {'schedule': args.schedule, 'seconds_per_step': seconds,
            'activation_bytes': saved.peak, 'trained_state_bytes': trained_state_bytes(proc),
            'peak_bytes': peak_bytes(device), 'device': str(device)}


def run_schedule(args, schedule: str) -> dict:
    command = [sys.executable, __file__, '--worker', '--schedule', schedule, '--cfg', args.cfg,
               '--client', str(args.client), '--steps', str(args.steps),
               '--repeats', str(args.repeats)]
    out = subprocess.run(command, check=True, capture_output=True, text=True,
                         env={**os.environ, 'TQDM_DISABLE': '1'})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--cfg', default=DEFAULT_CFG)
    parser.add_argument('--client', type=int, default=3)
    parser.add_argument('--steps', type=int, default=8)
    parser.add_argument('--repeats', type=int, default=2)
    parser.add_argument('--schedule', default='two_stage')
    parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--quick', action='store_true', help='a check that the script works')
    args = parser.parse_args()
    if args.quick:
        args.cfg, args.steps, args.repeats = QUICK_CFG, 2, 1
    if args.worker:
        print(json.dumps(measure(args)))
        return
    results = {s: run_schedule(args, s) for s in SCHEDULES}
    two, both = results['two_stage'], results['simultaneous']
    print(f"device: {two['device']}; client {args.client} of {args.cfg}; "
          f"{args.repeats} rounds x {args.steps} steps timed after one warm-up round")
    print(f"{'schedule':<14}{'s/step':>8}{'saved activations MB':>22}{'grads+Adam MB':>15}"
          f"{'peak process MB':>17}")
    for name, row in results.items():
        print(f"{name:<14}{row['seconds_per_step']:>8.3f}{row['activation_bytes'] / 2**20:>22.1f}"
              f"{row['trained_state_bytes'] / 2**20:>15.2f}{row['peak_bytes'] / 2**20:>17.1f}")

    def ratio(key):
        return two[key] / both[key] if both[key] else float('nan')
    print(f"two_stage / simultaneous: step time {ratio('seconds_per_step'):.2f}x, saved "
          f"activations {ratio('activation_bytes'):.2f}x, grads+Adam "
          f"{ratio('trained_state_bytes'):.2f}x, peak process memory {ratio('peak_bytes'):.2f}x")


if __name__ == '__main__':
    main()

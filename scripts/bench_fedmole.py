"""Training-step cost of Fed-MoLE vs FedAvg-LoRA on the same base and batch, ratios in one run.

Configurations (LoRA r=8, alpha=16 on q,k,v,up_proj; Fed-MoLE's routed experts on up_proj):
  fedavg        FedAvg-LoRA: one LoRA per target, all adapters train every step
  fedmole_n8    Fed-MoLE, N = 8 routed experts, top K = 2
  fedmole_n64   Fed-MoLE, N = 64, K = 2 (cost should track K, not N)
  *_loop        the same Fed-MoLE model with the previous dispatch, a Python loop over the
                experts (`per_expert_loop`), step time only: before vs after in one run

Step time: one optimiser step (forward, backward, AdamW) on a fixed random batch, timed the way
a client trains: Fed-MoLE runs its two ADA phases in turn (steps with routed experts + routers
trainable, then as many with the shared experts + plain LoRA trainable; per step, so the phase
budget does not change the figure), FedAvg-LoRA trains all adapters. The configurations are
built in one process and timed in interleaved blocks (one local round of each in turn,
repeated), so load drift on a shared machine hits all of them alike; reported: the median over
blocks of the round's mean step time.

Peak memory (torch's CPU allocations are invisible to tracemalloc): each configuration runs in
a fresh subprocess. Once the model is built (and its lazily mapped weights faulted in), the
kernel's peak-RSS counter is reset (`echo 5 > /proc/self/clear_refs`, so loading peaks do not
count), one local round runs, and VmHWM is read from /proc/self/status.
  peak MB            that peak minus the RSS of the runtime (python, torch, transformers, peft
                     and the plugin imported, no model yet): weights, adapters, activations,
                     gradients and optimiser state, the analogue of the paper's peak GPU memory;
  train overhead MB  that peak minus the RSS right after building: what exists only while
                     training (activations, gradients, optimiser state).
Linux only.

    python scripts/bench_fedmole.py [--models tiny smollm2] [--batch 4] [--seq-len 128]
    python scripts/bench_fedmole.py --quick     # tiny model, 2 steps, no memory runs: seconds
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

CONFIGS = {'fedavg': ('fedavg', {}),
           'fedmole_n8': ('fedmole', {'num_experts': 8, 'top_k': 2}),
           'fedmole_n64': ('fedmole', {'num_experts': 64, 'top_k': 2})}
# the previous per-expert-loop dispatch on the configuration it names, timed only
LOOP_CONFIGS = {'fedmole_n8_loop': 'fedmole_n8', 'fedmole_n64_loop': 'fedmole_n64'}
MODELS = {'tiny': ('tiny-llama@fsplug_llm', 'tiny_llama'),
          'smollm2': ('smollm2@fsplug_llm', 'smollm2')}


def build(model: str, config: str, workdir: str, extra: dict | None = None):
    """(model, trainable names, method, cfg) for one configuration, through the plugin's
    builder (`extra`: further config overrides, merged on top)."""
    from fs_plugins.methods.building import build_model
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.run.config import load_config, merge
    model_type, builder = MODELS[model]
    method_name, hparams = CONFIGS[config]
    cfg = load_config(overrides=merge({
        'seed': 1, 'outdir': workdir,
        'federate': {'client_num': 1, 'method': 'fsplug'}, 'trainer': {'type': 'fsplug'},
        'data': {'type': 'tiny_tasks@fsplug', 'splitter': 'iid', 'root': workdir},
        'model': {'type': model_type},
        'train': {'optimizer': {'type': 'AdamW', 'lr': 1e-4}},
        'fsplug': {'method': method_name, method_name: hparams, 'model': {
            'builder': builder, 'lora': {'r': 8, 'alpha': 16, 'dropout': 0.05,
                                         'target_modules': ['q_proj', 'k_proj', 'v_proj',
                                                            'up_proj']}}}}, extra or {}))
    method = get_method_class(method_name)(cfg)
    built = build_model(cfg, method)
    return built.model, built.trainable_names, method, cfg


class Trainer:
    """Optimiser steps on one fixed batch, switching trainable parameters per ADA phase the
    way the client procedure does (frozen parameters keep grad None)."""

    def __init__(self, model, trainable_names, method, cfg, batch: dict, steps_per_round: int):
        self.model, self.batch = model, batch
        self.params = dict(model.named_parameters())
        self.names = list(trainable_names)
        self.phases = [p for p in method.phases(steps_per_round, cfg) for _ in range(p.steps)]
        self.optimizer = torch.optim.AdamW([self.params[n] for n in self.names], lr=1e-4)
        model.train()

    def step(self, index: int) -> None:
        phase = self.phases[index % len(self.phases)]
        for name in self.names:
            self.params[name].requires_grad_(phase.trainable is None or phase.trainable(name))
        self.optimizer.zero_grad(set_to_none=True)
        self.model(**self.batch).loss.backward()
        self.optimizer.step()


def random_batch(vocab: int, batch: int, seq_len: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    return {'input_ids': ids, 'attention_mask': torch.ones_like(ids), 'labels': ids.clone()}


def use_per_expert_loop(model) -> None:
    """Switches every routed-expert layer of `model` to the previous dispatch (per instance,
    so the other configurations in the process keep the grouped one)."""
    from fs_plugins.tuners.mole import RoutedLoraExperts
    from fs_plugins.tuners.mole.layer import per_expert_loop
    layers = [m for m in model.modules() if isinstance(m, RoutedLoraExperts)]
    if not layers:
        raise ValueError('use_per_expert_loop: the model has no routed-expert layers')
    for layer in layers:
        layer.forward = functools.partial(per_expert_loop, layer)


def make_trainer(model_name, config, workdir, batch_size, seq_len, steps_per_round,
                 extra: dict | None = None):
    model, names, method, cfg = build(model_name, LOOP_CONFIGS.get(config, config), workdir,
                                      extra)
    if config in LOOP_CONFIGS:
        use_per_expert_loop(model)
    batch = random_batch(model.config.vocab_size, batch_size, seq_len)
    return Trainer(model, names, method, cfg, batch, steps_per_round)


def time_steps(args, workdir) -> dict[str, list[float]]:
    trainers = {c: make_trainer(args.model, c, workdir, args.batch, args.seq_len, args.round_steps)
                for c in [*CONFIGS, *LOOP_CONFIGS]}
    for trainer in trainers.values():      # warm-up: one ADA round each
        for i in range(args.round_steps):
            trainer.step(i)
    times = {c: [] for c in trainers}
    for _ in range(args.blocks):
        for config, trainer in trainers.items():
            start = time.perf_counter()
            for i in range(args.round_steps):   # a whole round: both phases equally often
                trainer.step(i)
            times[config].append((time.perf_counter() - start) / args.round_steps)
    return times


def _status_kb(field: str) -> int:
    with open('/proc/self/status') as handle:
        for line in handle:
            if line.startswith(field + ':'):
                return int(line.split()[1])
    raise RuntimeError(f'{field} not in /proc/self/status')


def measure_memory(args, workdir, extra: dict | None = None) -> dict:
    """Runs inside the per-configuration subprocess (`extra`: config overrides for build)."""
    import peft  # noqa: F401  (the runtime the model build imports, loaded before the baseline)
    from transformers import LlamaForCausalLM  # noqa: F401

    from fs_plugins.methods.registry import all_methods
    all_methods()
    runtime = _status_kb('VmRSS')
    trainer = make_trainer(args.model, args.config, workdir, args.batch, args.seq_len,
                           args.round_steps, extra)
    with torch.no_grad():   # fault in lazily mapped weights: they belong to 'built'
        for param in trainer.model.parameters():
            param.sum()
    built = _status_kb('VmRSS')
    with open('/proc/self/clear_refs', 'w') as handle:
        handle.write('5')                   # resets VmHWM to the current RSS: loading peaks go
    for i in range(args.round_steps):
        trainer.step(i)
    peak = _status_kb('VmHWM')
    return {'peak_mb': (peak - runtime) / 1024, 'overhead_mb': (peak - built) / 1024}


def memory_in_subprocess(args, config: str, script: str = __file__, extra=None) -> dict:
    """`script --memory-of config` in a fresh process (`extra`: its own further options;
    default this script's --models); returns the JSON line it prints last."""
    extra = ['--models', args.model] if extra is None else list(extra)
    cmd = [sys.executable, os.path.abspath(script), '--memory-of', config, *extra,
           '--batch', str(args.batch), '--seq-len', str(args.seq_len),
           '--round-steps', str(args.round_steps), '--threads', str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f'memory run for {config} failed:\n{proc.stderr[-3000:]}')
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(model_name: str, args, times: dict, memory: dict) -> None:
    """One row per configuration; memory columns only where `memory` has the configuration
    (the loop configurations and --quick have none)."""
    base_t = statistics.median(times['fedavg'])
    print(f"\n== {model_name}: batch {args.batch} x {args.seq_len} tokens, {args.blocks} blocks "
          f"x {args.round_steps} steps per config, {torch.get_num_threads()} threads ==")
    print(f"{'config':<17} {'step ms':>8} {'ratio':>6} {'peak MB':>12} {'ratio':>6} "
          f"{'train overhead MB':>18} {'ratio':>6}")
    for config, samples in times.items():
        t = statistics.median(samples)
        row = f"{config:<17} {1000 * t:>8.1f} {t / base_t:>6.3f}"
        if config in memory and 'fedavg' in memory:
            m, base_m = memory[config], memory['fedavg']
            row += (f" {m['peak_mb']:>12.1f} {m['peak_mb'] / base_m['peak_mb']:>6.3f} "
                    f"{m['overhead_mb']:>18.1f} "
                    f"{m['overhead_mb'] / max(base_m['overhead_mb'], 1e-9):>6.3f}")
        print(row)
    for loop_config, config in LOOP_CONFIGS.items():
        print(f"{config}: grouped dispatch step / per-expert loop step "
              f"{statistics.median(times[config]) / statistics.median(times[loop_config]):.3f}")
    print("targets: fedmole_n8 step ratio <= 1.25 and peak ratio <= 1.2; fedmole_n64 step "
          "ratio <= 1.4 (tiny) and <= 1.25 (smollm2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', nargs='+', default=['tiny', 'smollm2'], choices=list(MODELS))
    parser.add_argument('--batch', type=int, default=4)
    parser.add_argument('--seq-len', type=int, default=128)
    parser.add_argument('--round-steps', type=int, default=4,
                        help='steps per local round (Fed-MoLE: half per ADA phase)')
    parser.add_argument('--blocks', type=int, default=5, help='interleaved timing blocks')
    # 1 by default: on a shared machine OpenMP threads waiting on a busy core distort timings
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--quick', action='store_true',
                        help='tiny model, batch 1 x 16 tokens, 1 block of 2 steps, no memory '
                             'runs: seconds (a smoke run, not a measurement)')
    parser.add_argument('--memory-of', default='', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.models, args.batch, args.seq_len, args.round_steps, args.blocks = (
            ['tiny'], 1, 16, 2, 1)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as workdir:
        if args.memory_of:
            args.model, args.config = args.models[0], args.memory_of
            print(json.dumps(measure_memory(args, workdir)))
            return
        for model_name in args.models:
            args.model = model_name
            memory = {} if args.quick else {c: memory_in_subprocess(args, c) for c in CONFIGS}
            report(model_name, args, time_steps(args, workdir), memory)


if __name__ == '__main__':
    main()

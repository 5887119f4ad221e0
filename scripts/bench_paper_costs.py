"""Each paper's cost claim measured beside its number, ratios in one run (issue 42, point 5).

  fedmosaic  FedMosaic vs SFT (`standalone`: plain LoRA, one forward and backward per step), the
             paper's A.8 / Table 15 (compute 1.098x, memory 1.053x). One local round of each
             client (bench_fedmosaic's clients: LoRA r 16, N_B PQ-LoRA blocks, RELA's W_s gradient
             on its last decoder layer's down_proj every 10 steps) on the same base and data:
             FLOPs per optimiser step (torch.utils.flop_counter over the whole round, W_s's
             gradient included, divided by the round's steps), step time (rounds interleaved,
             median) and peak memory (a fresh process per client, bench_fedmole's VmHWM reading
             after a warm-up round that loads W_s).
  table15    every Table 15 method's relative compute to SFT: the paper's, ours measured with
             the FLOP counter (FedMosaic over RELA's interval) and the one local_compute: matched
             uses (the paper's where our implementation costs what the paper costed).
  smartfed   SmartFed vs FedIT (FedAvg-LoRA from scratch): step time, peak memory and bytes per
             round, bench_smartfed's section 1 (smollm2 only).
  fedmole    Fed-MoLE (N = 8, K = 2) vs FedAvg-LoRA peak memory (Table 5), bench_fedmole's
             measurement.
  flame      FLAME's forward FLOPs of 128 tokens per budget k on OLMoE-1B-7B's dimensions
             (Table 1), bench_flame's analytic count (checked there against the flop counter).

The last table lists paper figure, ours and the command that measures it.

    python scripts/bench_paper_costs.py [--model tiny|smollm2] [--only fedmosaic ...] [--quick]

--quick: tiny model, few steps, no smartfed (its library is built on smollm2): seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(SCRIPTS))
sys.path.insert(0, SCRIPTS)
import bench_fedmole  # noqa: E402
import bench_fedmosaic  # noqa: E402
import bench_flame  # noqa: E402
import bench_smartfed  # noqa: E402

SECTIONS = ('fedmosaic', 'table15', 'smartfed', 'fedmole', 'flame')
MOSAIC_CLIENTS = ('standalone', 'fedmosaic')
# the papers' figures, quoted with where they stand in ../shared/seeds/
PAPER = {
    'fedmosaic_compute': (1.098, 'FedMosaic A.8, Table 15: relative C to SFT (FLOPs per iteration)'),
    'fedmosaic_memory': (1.053, 'FedMosaic A.8, Table 15: relative M to SFT (Bytes)'),
    'fedmole_memory': (16.75 / 14.38, 'Fed-MoLE §4.4, Table 5: peak memory 16.75 GB vs '
                                      'FedAvg + LoRA 14.38 GB (LLaVA-1.5-7B, N = 8)'),
    'flame_flops': ({8: 342.8e9, 4: 237.2e9, 2: 184.4e9, 1: 158.0e9},
                    'FLAME §3.1, Table 1: FLOPs of 128 input tokens, OLMoE-1.3B/6.9B, r = 20'),
    'smartfed': (None, "SmartFed (poster), Figure 7 'Overhead analysis ... LLaMA2-7B, "
                       "Chinese+Math': training time, communication and energy below FedIT; the "
                       'extracted text gives no values'),
}


# ------------------------------------------------------------------------------ FedMosaic
def mosaic_round(procedure, round_idx: int) -> tuple[int, float, int]:
    """(FLOPs, seconds, optimiser steps) of one local round."""
    start = time.perf_counter()
    with FlopCounterMode(display=False) as counter:
        procedure.run_round(round_idx)
    return counter.get_total_flops(), time.perf_counter() - start, len(procedure.step_phases)


def mosaic_compute(args, workdir: str) -> dict[str, dict]:
    """Per client: FLOPs and median seconds per optimiser step over interleaved rounds."""
    clients = {m: bench_fedmosaic.client(m, args.model, args.mosaic_steps, args.batch, workdir)
               for m in MOSAIC_CLIENTS}
    for procedure in clients.values():   # warm-up: W_s loading, allocator
        procedure.run_round(0)
    flops = {m: [] for m in clients}
    seconds = {m: [] for m in clients}
    for repeat in range(args.repeats):
        for name, procedure in clients.items():
            count, elapsed, steps = mosaic_round(procedure, repeat + 1)
            flops[name].append(count / steps)
            seconds[name].append(elapsed / steps)
    return {m: {'flops': statistics.median(flops[m]), 'step_s': statistics.median(seconds[m])}
            for m in clients}


def mosaic_memory(args, workdir: str) -> dict:
    """Runs in the per-client subprocess: peak RSS of one round after a warm-up round, less
    the runtime's RSS (bench_fedmole's reading)."""
    import peft  # noqa: F401  (the runtime the build imports, loaded before the baseline)

    from fs_plugins.methods.registry import all_methods
    all_methods()
    runtime = bench_fedmole._status_kb('VmRSS')
    procedure = bench_fedmosaic.client(args.memory_of, args.model, args.round_steps, args.batch,
                                       workdir)
    procedure.run_round(0)
    with open('/proc/self/clear_refs', 'w') as handle:
        handle.write('5')                   # VmHWM back to the current RSS: loading peaks go
    procedure.run_round(1)
    return {'peak_mb': (bench_fedmole._status_kb('VmHWM') - runtime) / 1024,
            'small_mb': small_model_mb()}


def small_model_mb() -> float:
    """MB of the W_s copies FedMosaic loaded in this process (its own load of the base, beside
    the client's)."""
    from fs_plugins.methods.fedmosaic import _SMALL_BASES
    return sum(p.numel() * p.element_size() for base in _SMALL_BASES.values()
               for p in base.model.parameters()) / 2 ** 20


def fedmosaic_section(args, workdir: str) -> list[tuple]:
    memory_args = argparse.Namespace(**{**vars(args), 'round_steps': args.mosaic_steps})
    memory = {m: bench_fedmole.memory_in_subprocess(memory_args, m, __file__,
                                                    ['--model', args.model])
              for m in MOSAIC_CLIENTS}
    compute = mosaic_compute(args, workdir)
    sft, mosaic = compute['standalone'], compute['fedmosaic']
    print(f'\n== FedMosaic vs SFT (standalone), {args.model}, {args.mosaic_steps} steps of batch '
          f'{args.batch} per round, RELA every 10 steps, median of {args.repeats} rounds ==')
    print(f"{'client':<11} {'MFLOPs/step':>12} {'step ms':>8} {'peak MB':>9}")
    for name in MOSAIC_CLIENTS:
        print(f"{name:<11} {compute[name]['flops'] / 1e6:>12.1f} "
              f"{1000 * compute[name]['step_s']:>8.1f} {memory[name]['peak_mb']:>9.1f}")
    command = f'python scripts/bench_paper_costs.py --only fedmosaic --model {args.model}'
    flops_ratio = mosaic['flops'] / sft['flops']
    time_ratio = mosaic['step_s'] / sft['step_s']
    memory_ratio = memory['fedmosaic']['peak_mb'] / memory['standalone']['peak_mb']
    small_mb = memory['fedmosaic'].get('small_mb', 0.0)
    without_small = (memory['fedmosaic']['peak_mb'] - small_mb) / memory['standalone']['peak_mb']
    print(f'W_s (RELA) is its own copy of the base: {small_mb:.1f} MB of fedmosaic\'s peak; '
          f'peak without it / SFT {without_small:.3f}')
    return [('FedMosaic compute / SFT', PAPER['fedmosaic_compute'],
             f'{flops_ratio:.3f} FLOPs/step, {time_ratio:.3f} step time ({args.model})', command),
            ('FedMosaic memory / SFT', PAPER['fedmosaic_memory'],
             f'{memory_ratio:.3f} peak RSS, {without_small:.3f} without the W_s copy '
             f'({args.model})', command)]


# ------------------------------------------------------------------ Table 15's relative costs
TABLE15_METHODS = ('ditto', 'fedsim', 'fedavg', 'takfl', 'perada', 'feddat', 'feddpa', 'fedmkt',
                   'fedmosaic')


def table15_section(args, workdir: str) -> list[tuple]:
    """Each Table 15 method's relative cost to SFT: the paper's (Method.paper_relative_cost)
    beside ours measured with the FLOP counter (fs_plugins.run.flops: one step per phase, the
    mean over RELA's interval for FedMosaic) and the one `local_compute: matched` uses."""
    from fs_plugins.run.flops import measured_relative_cost
    print(f'\n== Table 15: relative compute to SFT, {args.model}, batch {args.batch}, RELA every 10 '
          f'steps ==')
    print(f"{'method':<10} {'paper':>7} {'measured':>9} {'matched uses':>13}")
    rows = []
    for method in TABLE15_METHODS:
        procedure = bench_fedmosaic.client(method, args.model, args.mosaic_steps, args.batch,
                                           os.path.join(workdir, method))
        measured = measured_relative_cost(procedure)
        paper = procedure.method.paper_relative_cost or (1.0 if method == 'fedavg' else None)
        used = procedure.relative_cost() if procedure.method.relative_cost is not None else measured
        print(f"{method:<10} {paper_figure(paper):>7} {measured:>9.3f} {used:>13.3f}", flush=True)
        rows.append((f'{method} compute / SFT', (paper, 'FedMosaic A.8, Table 15'),
                     f'{measured:.3f} measured, {used:.3f} under matched ({args.model})',
                     'python scripts/bench_paper_costs.py --only table15'))
    return rows


# ------------------------------------------------------------------------------- SmartFed
def smartfed_section(args, workdir: str) -> list[tuple]:
    bench = argparse.Namespace(batch=args.batch, seq_len=args.seq_len, round_steps=2,
                               blocks=args.repeats, threads=args.threads)
    configs = ('fedavg', 'smartfed')
    bench_smartfed.make_library(workdir)
    memory = {c: bench_fedmole.memory_in_subprocess(bench, c, bench_smartfed.__file__,
                                                    ['--workdir', workdir]) for c in configs}
    times, sent = bench_smartfed.time_steps(bench, workdir)
    step = {c: statistics.median(times[c]) for c in configs}
    print(f'\n== SmartFed vs FedIT (fedavg), smollm2, batch {args.batch} x {args.seq_len}, '
          f'{args.repeats} blocks ==')
    print(f"{'config':<10} {'step ms':>8} {'peak MB':>9} {'bytes/round':>12}")
    for c in configs:
        print(f"{c:<10} {1000 * step[c]:>8.1f} {memory[c]['peak_mb']:>9.1f} {sent[c]:>12,d}")
    ours = (f"{step['smartfed'] / step['fedavg']:.3f} step time, "
            f"{memory['smartfed']['peak_mb'] / memory['fedavg']['peak_mb']:.3f} peak RSS, "
            f"{sent['smartfed'] / sent['fedavg']:.3f} bytes up (smollm2)")
    return [('SmartFed training time, bytes / FedIT', PAPER['smartfed'], ours,
             'python scripts/bench_paper_costs.py --only smartfed')]


# ------------------------------------------------------------------------------- Fed-MoLE
def fedmole_section(args, workdir: str) -> list[tuple]:
    bench = argparse.Namespace(model=args.model, batch=args.batch, seq_len=args.seq_len,
                               round_steps=4, blocks=args.repeats, threads=args.threads)
    configs = ('fedavg', 'fedmole_n8')
    memory = {c: bench_fedmole.memory_in_subprocess(bench, c) for c in configs}
    ratio = memory['fedmole_n8']['peak_mb'] / memory['fedavg']['peak_mb']
    overhead = memory['fedmole_n8']['overhead_mb'] / memory['fedavg']['overhead_mb']
    print(f'\n== Fed-MoLE (N = 8, K = 2) vs FedAvg-LoRA, {args.model}, batch {args.batch} x '
          f'{args.seq_len}: peak MB {memory["fedmole_n8"]["peak_mb"]:.1f} vs '
          f'{memory["fedavg"]["peak_mb"]:.1f} ({ratio:.3f}); training overhead ratio '
          f'{overhead:.3f} ==')
    return [('Fed-MoLE peak memory / FedAvg-LoRA', PAPER['fedmole_memory'],
             f'{ratio:.3f} peak RSS, {overhead:.3f} training overhead ({args.model})',
             f'python scripts/bench_paper_costs.py --only fedmole --model {args.model}')]


# ---------------------------------------------------------------------------------- FLAME
def flame_section(args, workdir: str) -> list[tuple]:
    paper, _ = PAPER['flame_flops']
    ours = {k: bench_flame.forward_flops(bench_flame.OLMOE_1B_7B_DIMS, 128, k) for k in paper}
    print('\n== FLAME forward FLOPs, 128 tokens, OLMoE-1B-7B dimensions ==')
    print(f"{'k':>2} {'ours (B)':>9} {'ratio to k=8':>13} {'paper (B)':>10} {'ratio':>6}")
    for k in paper:
        print(f'{k:>2} {ours[k] / 1e9:>9.1f} {ours[k] / ours[8]:>13.3f} {paper[k] / 1e9:>10.1f} '
              f'{paper[k] / paper[8]:>6.3f}')
    shown = ', '.join(f'k={k} {ours[k] / ours[8]:.3f}' for k in paper)
    return [('FLAME FLOPs per budget / k = 8', PAPER['flame_flops'], shown,
             'python scripts/bench_paper_costs.py --only flame')]


# ---------------------------------------------------------------------------------- table
def paper_figure(value) -> str:
    if value is None:
        return 'no value'
    if isinstance(value, dict):
        return ', '.join(f'k={k} {v / value[8]:.3f}' for k, v in value.items())
    return f'{value:.3f}'


def claims_table(rows: list[tuple]) -> list[str]:
    lines = ['| claim | paper | where | ours | command |', '|---|---|---|---|---|']
    for claim, (value, where), ours, command in rows:
        lines.append(f'| {claim} | {paper_figure(value)} | {where} | {ours} | `{command}` |')
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', choices=sorted(bench_fedmosaic.MODELS), default='tiny',
                        help='base of the FedMosaic and Fed-MoLE measurements')
    parser.add_argument('--only', nargs='+', choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument('--mosaic-steps', type=int, default=20,
                        help='FedMosaic local steps per round (RELA every 10)')
    parser.add_argument('--batch', type=int, default=4)
    parser.add_argument('--seq-len', type=int, default=128, help='Fed-MoLE / SmartFed batch length')
    parser.add_argument('--repeats', type=int, default=3, help='interleaved timing rounds / blocks')
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--quick', action='store_true',
                        help='tiny model, 4 FedMosaic steps of batch 2, 1 repeat, no smartfed: seconds')
    parser.add_argument('--round-steps', type=int, default=20, help=argparse.SUPPRESS)
    parser.add_argument('--memory-of', default='', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.model, args.mosaic_steps, args.repeats, args.batch, args.seq_len = 'tiny', 4, 1, 2, 32
        args.only = [s for s in args.only if s != 'smartfed']
    with tempfile.TemporaryDirectory() as workdir:
        if args.memory_of:
            print(json.dumps(mosaic_memory(args, workdir)))
            return 0
        sections = {'fedmosaic': fedmosaic_section, 'table15': table15_section,
                    'smartfed': smartfed_section,
                    'fedmole': fedmole_section, 'flame': flame_section}
        rows = [row for name in args.only for row in sections[name](args, workdir)]
    print('\n' + '\n'.join(claims_table(rows)))
    return 0


if __name__ == '__main__':
    sys.exit(main())

"""Server-side aggregation cost of FedAvg vs FedA²-LoRA (efficient and naive), on CPU.

A script, not a test: prints tables.

--quick: a check that the script works, in seconds: d = 256, r = 8, K in {5, 10}, 1 repeat.

1. Time per LoRA module, d_in = d_out = 4096 (--dim), r in {8, 16, 64}, K in {5, 50} clients,
   float32 client factors, random sample-count weights:
     fedavg   fs_plugins.aggregation.weighted_average on dicts {'A': A_k, 'B': B_k}
     fed_a2   fs_plugins.aggregation.fed_a2 (never forms a d_out × d_in matrix)
     naive    fs_plugins.aggregation.fed_a2_naive (materialises U = Σ p_k B_k A_k in float64,
              then torch.linalg.lstsq; it is the tests' accuracy reference)
   Each repeat runs the three methods one after the other (interleaved), timed with
   time.perf_counter; the median over repeats is printed. naive is slow at K=50, so it runs
   only in the first --naive-repeats repeats. Ratios: fed_a2/fedavg and naive/fed_a2.

2. "Whole model": 32 layers × 4 targets (q, k, v, o) = 128 modules at d = 4096, r = 8, K = 50
   (K = 10 with --quick), total time to aggregate all 128, FedAvg vs FedA² efficient. To bound
   memory, the client tensors of 8 distinct modules (105 MB at K = 50) are generated and cycled
   through the 128 modules. naive is not run there: it is extrapolated as 128 × its per-module
   median from table 1 (same d, r, K), marked "(extrapolated)".

3. Peak extra memory of one aggregation at d = 4096, r = 8, K = 50, fed_a2 vs
   naive, plus fed_a2 at other (d, r) to show it scales like (d_in + d_out)·r and not with K or
   d_in·d_out. Method: torch.profiler with profile_memory=True on CPU records every
   allocation (attributed to the op that made it) and every free ("[memory]" events, negative
   sizes). Summing those in time order gives the live memory the call allocated on top of its
   inputs; its maximum is the "peak extra" (it includes the returned A, B). Limitation:
   scratch memory that an op allocates and frees inside itself (e.g. LAPACK workspaces) is
   netted out within that op and not seen.

Shared machines: when other processes occupy the cores, every multi-threaded torch op waits
at its OpenMP barrier for a descheduled thread (observed on 2 busy cores: ~170 ms per
parallel op instead of ~1 ms), which swamps these millisecond timings. Pass --threads 1
there; the load average is printed at the start and end of the run.

    python scripts/bench_aggregation.py [--quick] [--repeats N] [--naive-repeats N] [--threads N]
                                        [--dim D]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fs_plugins.aggregation import fed_a2, fed_a2_naive, weighted_average  # noqa: E402


def make_clients(K: int, r: int, d_in: int, d_out: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    As = [torch.randn(r, d_in, generator=gen) * d_in ** -0.5 for _ in range(K)]
    Bs = [torch.randn(d_out, r, generator=gen) * 0.01 for _ in range(K)]
    weights = torch.randint(50, 500, (K,), generator=gen).tolist()
    return As, Bs, weights


def run_fedavg(As, Bs, weights):
    out = weighted_average([{'A': a, 'B': b} for a, b in zip(As, Bs)], weights)
    return out['A'], out['B']


METHODS = {'fedavg': run_fedavg, 'fed_a2': fed_a2, 'naive': fed_a2_naive}


def load() -> str:
    try:
        return ' '.join(f'{x:.2f}' for x in os.getloadavg())
    except OSError:
        return 'n/a'


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def fmt_s(seconds: float) -> str:
    if seconds < 1e-3:
        return f'{seconds * 1e6:7.0f} us'
    if seconds < 1.0:
        return f'{seconds * 1e3:7.1f} ms'
    return f'{seconds:7.2f} s '


def fmt_b(n: float) -> str:
    for unit in ('B', 'KiB', 'MiB', 'GiB'):
        if abs(n) < 1024 or unit == 'GiB':
            return f'{n:8.1f} {unit}'
        n /= 1024


def per_module_table(Ks, ranks, repeats, naive_repeats, dim):
    print(f'\n[1] time per module, d_in = d_out = {dim}, float32 factors; median of {repeats} '
          f'repeats ({naive_repeats} for naive), methods interleaved within each repeat')
    head = (f'{"r":>4} {"K":>4} | {"fedavg":>10} {"fed_a2":>10} {"naive":>10} | '
            f'{"fed_a2/fedavg":>13} {"naive/fed_a2":>12}')
    print(head)
    print('-' * len(head))
    medians = {}
    for r in ranks:
        for K in Ks:
            As, Bs, weights = make_clients(K, r, dim, dim, seed=1000 * r + K)
            for fn in METHODS.values():                     # warm-up (allocator, BLAS threads)
                if fn is fed_a2_naive and K > 10:
                    continue
                fn(As[:2], Bs[:2], weights[:2])
            times = {name: [] for name in METHODS}
            for rep in range(repeats):
                for name, fn in METHODS.items():
                    if name == 'naive' and rep >= naive_repeats:
                        continue
                    times[name].append(timed(fn, As, Bs, weights))
            med = {name: statistics.median(t) for name, t in times.items()}
            medians[(r, K)] = med
            print(f'{r:>4} {K:>4} | {fmt_s(med["fedavg"]):>10} {fmt_s(med["fed_a2"]):>10} '
                  f'{fmt_s(med["naive"]):>10} | {med["fed_a2"] / med["fedavg"]:13.2f} '
                  f'{med["naive"] / med["fed_a2"]:12.1f}')
            del As, Bs
    return medians


def whole_model(K, repeats, naive_per_module, dim, layers=32, targets=4, r=8, pool=8):
    n_modules = layers * targets
    print(f'\n[2] whole model: {layers} layers x {targets} targets = {n_modules} modules, '
          f'd = {dim}, r = {r}, K = {K}; {pool} distinct modules of client tensors cycled; '
          f'median of {repeats} repeats, methods interleaved')
    modules = [make_clients(K, r, dim, dim, seed=50_000 + m) for m in range(pool)]

    def all_modules(fn):
        t0 = time.perf_counter()
        for m in range(n_modules):
            fn(*modules[m % pool])
        return time.perf_counter() - t0

    run_fedavg(*modules[0])
    fed_a2(*modules[0])
    times = {'fedavg': [], 'fed_a2': []}
    for _ in range(repeats):
        times['fedavg'].append(all_modules(run_fedavg))
        times['fed_a2'].append(all_modules(fed_a2))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f'  fedavg  {fmt_s(med["fedavg"])}')
    print(f'  fed_a2  {fmt_s(med["fed_a2"])}   (fed_a2/fedavg = {med["fed_a2"] / med["fedavg"]:.2f})')
    if naive_per_module is not None:
        naive = n_modules * naive_per_module
        print(f'  naive   {fmt_s(naive)}   (extrapolated: {n_modules} x per-module median from [1]; '
              f'naive/fed_a2 = {naive / med["fed_a2"]:.1f})')


def peak_extra_memory(fn, *args):
    """(peak live bytes allocated by fn above its inputs, largest single allocation)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    events = sorted(prof.events(), key=lambda ev: ev.time_range.start)
    live = peak = largest = 0
    for ev in events:
        delta = ev.self_cpu_memory_usage
        live += delta
        peak = max(peak, live)
        largest = max(largest, delta)
    return peak, largest


def memory_table(K, dim):
    print('\n[3] peak extra memory of one aggregation (torch.profiler profile_memory: running sum '
          'of allocations and frees, inputs excluded, outputs included)')
    head = (f'{"method":>7} {"d_in=d_out":>10} {"r":>3} {"K":>4} | {"peak extra":>12} '
            f'{"largest alloc":>13} | {"peak/((d_in+d_out)*r*8B)":>24} {"peak/(d_in*d_out*4B)":>20}')
    print(head)
    print('-' * len(head))
    rows = [('fed_a2', dim, 8, K), ('naive', dim, 8, K), ('fed_a2', dim, 64, K), ('fed_a2', dim, 8, 5),
            ('fed_a2', dim // 4, 8, K), ('fed_a2', dim // 4, 64, K)]
    for name, d, r, k in rows:
        As, Bs, weights = make_clients(k, r, d, d, seed=7)
        peak, largest = peak_extra_memory(METHODS[name], As, Bs, weights)
        print(f'{name:>7} {d:>10} {r:>3} {k:>4} | {fmt_b(peak):>12} {fmt_b(largest):>13} | '
              f'{peak / ((2 * d) * r * 8):24.2f} {peak / (d * d * 4):20.4f}')
    print('  fed_a2 keeps peak/((d_in+d_out)*r*8 bytes) constant across d, r and K '
          '(O((d_in+d_out)·r)); naive needs d_in*d_out float64 buffers (U and the lstsq '
          'right-hand side).')


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--quick', action='store_true', help='d = 256, r = 8, K in {5, 10}, 1 repeat')
    ap.add_argument('--dim', type=int, default=4096, help='d_in = d_out of the modules')
    ap.add_argument('--repeats', type=int, default=None, help='timing repeats (default 5, quick 1)')
    ap.add_argument('--naive-repeats', type=int, default=None, help='repeats for naive (default 3, quick 1)')
    ap.add_argument('--whole-repeats', type=int, default=None, help='whole-model repeats (default 3, quick 1)')
    ap.add_argument('--threads', type=int, default=None, help='torch.set_num_threads')
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.quick else 5)
    dim = 256 if args.quick else args.dim
    naive_repeats = min(repeats, args.naive_repeats or (1 if args.quick else 3))
    whole_repeats = args.whole_repeats or (1 if args.quick else 3)
    Ks = [5, 10] if args.quick else [5, 50]
    ranks = [8] if args.quick else [8, 16, 64]
    print(f'bench_aggregation: torch {torch.__version__}, {torch.get_num_threads()} threads, '
          f'{os.cpu_count()} CPUs, {"quick" if args.quick else "full"} run, '
          f'load average at start {load()}')
    t0 = time.perf_counter()
    medians = per_module_table(Ks, ranks, repeats, naive_repeats, dim)
    K_big = Ks[-1]
    whole_model(K_big, whole_repeats, medians[(8, K_big)]['naive'], dim)
    memory_table(K_big, dim)
    print(f'\ntotal bench time {time.perf_counter() - t0:.1f} s; load average at end '
          f'{load()} (other processes on these cores inflate and scatter the timings)')


if __name__ == '__main__':
    main()

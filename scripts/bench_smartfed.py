"""SmartFed's cost, ratios in one run.

1. Training step (smollm2 base, batch x seq_len tokens, one optimiser step on a fixed batch):
   fedavg            FedAvg-LoRA from scratch, r = 16 on q_proj, v_proj (FedIT)
   smartfed          routers only over a library of two r = 16 LoRAs on q, v (E = 32 rank-1
                     experts per matrix), K = 16 (activated rank 16), the default router over
                     the experts' activations, W_r (A x) with W_r E × E
   smartfed_hidden   the same with `router_input: hidden` (a free E × d_in W_r on x)
   Step time: configurations timed in interleaved blocks, median of block means. Peak memory:
   a fresh subprocess per configuration, VmHWM after one local round minus the runtime's RSS
   (bench_fedmole's method). Bytes per round: what a client uploads (= what it receives).
2. One MoRE layer at LLaMA2-7B dimensions (d = 4096, two r = 32 LoRAs: E = 64), T tokens,
   forward + backward: the sparse top-q dispatch (tuners.library.rank_one_mixture) vs the dense
   compute-everything-then-mask formula, for several q (the activated rank) — the sparse one
   must track q; and the per-matrix bytes of the routers vs a LoRA.
3. Activated rank under EEQA at several budgets K (random importance, the smollm2 library):
   the mean of q_j is K whatever the allocation.

    python scripts/bench_smartfed.py [--batch 4] [--seq-len 128] [--tokens 1024] [--quick]

--quick: a check that the script works: the tiny random Llama instead of smollm2, batch 1 x 16
tokens, 1 block of 1 step, a 16-token layer benchmark, 1 repeat.
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

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(SCRIPTS))
sys.path.insert(0, SCRIPTS)
from bench_fedmole import MODELS, Trainer, _status_kb, memory_in_subprocess, random_batch  # noqa: E402

RANK, TARGETS = 16, ['q_proj', 'v_proj']
CONFIGS = {'fedavg': ('fedavg', {}),
           'smartfed': ('smartfed', {'budget': RANK}),
           'smartfed_hidden': ('smartfed', {'budget': RANK, 'router_input': 'hidden'})}


def make_library(workdir: str, model_name: str) -> list[str]:
    """Two random r = 16 peft LoRAs on q, v of the base, saved as adapter folders."""
    from peft import LoraConfig, get_peft_model

    from fs_plugins.methods.specs import model_spec
    from fs_plugins.models.builders import load_base
    from fs_plugins.run.config import load_config
    folders = []
    for seed in (1, 2):
        folder = os.path.join(workdir, f'library_{seed}')
        if not os.path.isdir(folder):
            cfg = base_config(workdir, 'fedavg', {}, model_name)
            base = load_base(model_spec(load_config(overrides=cfg))).model
            torch.manual_seed(seed)
            model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                                    init_lora_weights=False))
            model.save_pretrained(folder)
        folders.append(folder)
    return folders


def base_config(workdir: str, method: str, hparams: dict, model: str, library=()) -> dict:
    model_type, builder = MODELS[model]
    return {'seed': 1, 'outdir': workdir,
            'federate': {'client_num': 1, 'method': 'fsplug'}, 'trainer': {'type': 'fsplug'},
            'data': {'type': 'tiny_tasks@fsplug', 'splitter': 'iid', 'root': workdir},
            'model': {'type': model_type},
            'train': {'optimizer': {'type': 'AdamW', 'lr': 1e-4}},
            'fsplug': {'method': method, method: hparams, 'model': {
                'builder': builder, 'library': {'adapters': list(library)},
                'lora': {'r': RANK, 'alpha': 2 * RANK, 'target_modules': TARGETS}}}}


def make_trainer(config: str, workdir: str, args, hparams_extra=None) -> Trainer:
    from fs_plugins.methods.building import build_model
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.run.config import load_config
    method_name, hparams = CONFIGS[config]
    library = make_library(workdir, args.model) if method_name == 'smartfed' else ()
    cfg = load_config(overrides=base_config(workdir, method_name, {**hparams, **(hparams_extra or {})},
                                            args.model, library))
    method = get_method_class(method_name)(cfg)
    built = build_model(cfg, method)
    trainer = Trainer(built.model, built.trainable_names, method, cfg,
                      random_batch(built.model.config.vocab_size, args.batch, args.seq_len), 1)
    trainer.method = method
    return trainer


def upload_bytes(trainer: Trainer) -> int:
    shared = trainer.method.shared_tensors(trainer.model, trainer.names)
    return sum(t.numel() * t.element_size() for t in shared.values())


def time_steps(args, workdir) -> dict[str, list[float]]:
    trainers = {c: make_trainer(c, workdir, args) for c in CONFIGS}
    for trainer in trainers.values():
        trainer.step(0)
    times = {c: [] for c in CONFIGS}
    for _ in range(args.blocks):
        for config, trainer in trainers.items():
            start = time.perf_counter()
            for i in range(args.round_steps):
                trainer.step(i)
            times[config].append((time.perf_counter() - start) / args.round_steps)
    return times, {c: upload_bytes(t) for c, t in trainers.items()}


def measure_memory(args, workdir) -> dict:
    import peft  # noqa: F401

    from fs_plugins.methods.registry import all_methods
    all_methods()
    make_library(workdir, args.model)   # built before the baseline reading
    runtime = _status_kb('VmRSS')
    trainer = make_trainer(args.memory_of, workdir, args)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.sum()
    with open('/proc/self/clear_refs', 'w') as handle:
        handle.write('5')
    for i in range(args.round_steps):
        trainer.step(i)
    return {'peak_mb': (_status_kb('VmHWM') - runtime) / 1024}


def step_table(args, workdir) -> None:
    memory = {c: memory_in_subprocess(args, c, __file__, ['--workdir', workdir, '--model', args.model])
              for c in CONFIGS}
    times, sent = time_steps(args, workdir)
    base_t, base_m, base_b = statistics.median(times['fedavg']), memory['fedavg'], sent['fedavg']
    print(f"\n== 1. training step, {args.model}, batch {args.batch} x {args.seq_len} tokens, "
          f"{args.blocks} blocks x {args.round_steps} steps, {torch.get_num_threads()} threads ==")
    print(f"{'config':<18} {'step ms':>8} {'ratio':>6} {'peak MB':>9} {'ratio':>6} "
          f"{'bytes/round':>12} {'ratio':>7}")
    for config in CONFIGS:
        t = statistics.median(times[config])
        print(f"{config:<18} {1000 * t:>8.1f} {t / base_t:>6.3f} {memory[config]['peak_mb']:>9.1f} "
              f"{memory[config]['peak_mb'] / base_m['peak_mb']:>6.3f} {sent[config]:>12,d} "
              f"{sent[config] / base_b:>7.3f}")


def layer_table(args) -> None:
    from fs_plugins.tuners.library import dense_rank_mixture, rank_one_mixture
    d, E, T = 4096, 64, args.tokens
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(E, d, generator=gen) / d ** 0.5
    B_t = torch.randn(E, d, generator=gen) / E
    router = torch.randn(E, d, generator=gen) / d ** 0.5
    x = torch.randn(T, d, generator=gen)

    def sparse(q):
        xr = x.clone().requires_grad_(True)
        top, idx = (xr @ router.t()).topk(q, dim=-1)
        rank_one_mixture(xr, top.softmax(-1), idx, A, B_t).sum().backward()

    def masked(q):
        xr = x.clone().requires_grad_(True)
        logits = xr @ router.t()
        top, idx = logits.topk(q, dim=-1)
        gates = torch.zeros_like(logits).scatter(1, idx, top.softmax(-1))
        dense_rank_mixture(xr, gates, A, B_t).sum().backward()

    def timed(fn, q):
        fn(q)
        samples = []
        for _ in range(args.layer_repeats):
            start = time.perf_counter()
            fn(q)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    print(f"\n== 2. one MoRE layer at LLaMA2-7B dims: d = {d}, E = {E} experts (two r = 32 "
          f"LoRAs), {T} tokens, forward + backward ==")
    print(f"{'activated rank q':>16} {'sparse ms':>10} {'vs q=64':>8} {'masked ms':>10} {'sparse/masked':>14}")
    rows = [(q, timed(sparse, q), timed(masked, q)) for q in (4, 8, 16, 32, 64)]
    full = rows[-1][1]
    for q, s, m in rows:
        print(f"{q:>16} {1000 * s:>10.1f} {s / full:>8.3f} {1000 * m:>10.1f} {s / m:>14.3f}")
    lora = 32 * (d + d)
    print(f"bytes per matrix (float32): router W_r x (router_input hidden) {4 * E * d:,} "
          f"({E * d / lora:.2f}x a r = 32 LoRA's {4 * lora:,}); router over the experts' "
          f"activations W_r (A x) (the default) {4 * E * E:,} ({E * E / lora:.4f}x)")


def rank_table(args, workdir) -> None:
    from fs_plugins.aggregation import eeqa_quota
    trainer = make_trainer('smartfed', workdir, args)
    layers = trainer.model.library_layers
    pools = [layer.num_experts for layer in layers.values()]
    gen = torch.Generator().manual_seed(0)
    importance = torch.rand(len(pools), generator=gen).tolist()
    print(f"\n== 3. activated rank under EEQA (random importance, {len(pools)} matrices of "
          f"{pools[0]} experts, cap M_j = each pool, the default) ==")
    print(f"{'budget K':>8} {'activated rank':>15} {'min q':>6} {'max q':>6}")
    for budget in (2, 4, 8, 16, 32):
        quota = eeqa_quota(importance, budget * len(pools), pools)
        trainer.method.apply_quota(trainer.model, torch.tensor(quota))
        print(f"{budget:>8} {trainer.method.activated_rank(trainer.model):>15.2f} "
              f"{min(quota):>6} {max(quota):>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', choices=sorted(MODELS), default='smollm2')
    parser.add_argument('--batch', type=int, default=4)
    parser.add_argument('--seq-len', type=int, default=128)
    parser.add_argument('--round-steps', type=int, default=3)
    parser.add_argument('--blocks', type=int, default=5)
    parser.add_argument('--tokens', type=int, default=1024, help='tokens of the layer benchmark')
    parser.add_argument('--layer-repeats', type=int, default=5)
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--skip-model', action='store_true', help='layer benchmark only')
    parser.add_argument('--memory-of', default='', help=argparse.SUPPRESS)
    parser.add_argument('--workdir', default='', help=argparse.SUPPRESS)
    parser.add_argument('--quick', action='store_true', help='a check that the script works '
                                                             '(see the module docstring)')
    args = parser.parse_args()
    if args.quick:
        args.model, args.batch, args.seq_len, args.round_steps, args.blocks = 'tiny', 1, 16, 1, 1
        args.tokens, args.layer_repeats = 16, 1
    torch.set_num_threads(args.threads)
    if args.memory_of:
        print(json.dumps(measure_memory(args, args.workdir)))
        return
    with tempfile.TemporaryDirectory() as workdir:
        if not args.skip_model:
            step_table(args, workdir)
            rank_table(args, workdir)
        layer_table(args)


if __name__ == '__main__':
    main()

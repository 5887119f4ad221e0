"""FedMosaic's costs beside its baselines, printed side by side in one run (issue 11).

1. Bytes per round at the paper's dimensions (A.7: LoRA r = 128 on all linear layers of the
   LLM, N_B = 4 PQ-LoRA blocks, N_s = 40 %, W_s = the smallest client model), counted from the
   module shapes of the language models built on the meta device (no weights): LLaVA-Llama3.2-1B
   and -3B language models. FedMosaic uploads conventional LoRA + P, Q (+ the sanitised W_s
   output-layer gradient); FedAvg-LoRA uploads LoRA on every layer. Paper Table 9: FedMosaic
   sends 10.9 % less than FedAvg-LoRA.
2. Client compute vs Standalone (paper A.8: 1.098×): one local round of a FedMosaic client
   (gated local + global modules, RELA's W_s gradient every f steps) against a Standalone
   client (plain LoRA) on the same base, data and batches, timed in interleaved blocks (load
   drift on a shared machine hits both alike); the median of the rounds' wall times.
3. Server RELA time for N clients: rela_weights (cosines + softmax) on N gradients of --grad-dim
   coordinates, and customised_globals (one G_i per client) on N clients' P, Q of the paper's
   1B model (4 blocks × 7 modules, r = 128); beside item 2's local round time.

    python scripts/bench_fedmosaic.py [--model tiny|smollm2] [--steps 20] [--repeats 3]
                                      [--clients 10 100 1000] [--grad-dim 100000] [--quick]

--quick: a check that the script works: the tiny model, 2 steps of batch 1, 1 repeat, 2 server
clients of 1000 gradient coordinates.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# the language models of LLaVA-Llama3.2-1B / -3B (Llama-3.2 configs)
PAPER_MODELS = {
    'LLaVA-Llama3.2-1B': dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                              vocab_size=128256),
    'LLaVA-Llama3.2-3B': dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                              num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                              vocab_size=128256)}
ALL_LINEAR = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
FLOAT_BYTES = 4


def linear_shapes(dims: dict) -> dict[str, tuple[int, int]]:
    """{module name: (in, out)} of the decoder's linear layers, from a meta-device Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM
    with torch.device('meta'):
        model = LlamaForCausalLM(LlamaConfig(**dims))
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.rsplit('.', 1)[-1] in ALL_LINEAR}


def upload_floats(dims: dict, r: int, num_blocks: int) -> tuple[int, int]:
    """(FedAvg-LoRA floats, FedMosaic floats without the RELA gradient) per client and round."""
    from fs_plugins.aggregation.mosaic import pq_block_layers
    from fs_plugins.tuners.mosaic.model import layer_position
    pq_layers = set(pq_block_layers(dims['num_hidden_layers'], num_blocks))
    lora = mosaic = 0
    for name, (d_in, d_out) in linear_shapes(dims).items():
        lora += r * (d_in + d_out)
        mosaic += r * r + r if layer_position(name)[0] in pq_layers else r * (d_in + d_out)
    return lora, mosaic


def bytes_table(r: int, num_blocks: int, keep: float) -> list[str]:
    small = PAPER_MODELS['LLaVA-Llama3.2-1B']
    gradient = int(round(keep * small['vocab_size'] * small['hidden_size']))
    lines = [f'Upload per client and round, float32 (r = {r} on {", ".join(ALL_LINEAR)}, '
             f'N_B = {num_blocks}, N_s = {keep:.0%}, W_s = LLaVA-Llama3.2-1B):',
             '| model | FedAvg-LoRA | FedMosaic (LoRA + P, Q) | ratio | + RELA gradient | ratio |',
             '|---|---|---|---|---|---|']
    for label, dims in PAPER_MODELS.items():
        lora, mosaic = upload_floats(dims, r, num_blocks)
        with_grad = mosaic + gradient
        lines.append(f'| {label} | {lora * FLOAT_BYTES / 1e6:.1f} MB | '
                     f'{mosaic * FLOAT_BYTES / 1e6:.1f} MB | {mosaic / lora:.3f} | '
                     f'{with_grad * FLOAT_BYTES / 1e6:.1f} MB | {with_grad / lora:.3f} |')
    return lines


# ------------------------------------------------------------------- client compute
MODELS = {'tiny': ('tiny-llama@fsplug_llm', 'tiny_llama', ['q_proj', 'v_proj', 'up_proj', 'down_proj'], 1),
          'smollm2': ('smollm2@fsplug_llm', 'smollm2', list(ALL_LINEAR), 4)}


def client(method: str, model: str, steps: int, batch: int, workdir: str):
    from fs_plugins.methods.building import build_model
    from fs_plugins.methods.registry import get_method_class
    from fs_plugins.run.client import ClientProcedure
    from fs_plugins.run.config import load_config
    from fs_plugins.run.runtime import build_federated_records
    model_type, builder, targets, blocks = MODELS[model]
    cfg = load_config(overrides={
        'seed': 1, 'outdir': workdir, 'federate': {'client_num': 1, 'method': 'fsplug',
                                                   'total_round_num': 100},
        'trainer': {'type': 'fsplug'}, 'data': {'type': 'tiny_tasks@fsplug', 'root': workdir,
                                                'splitter': 'iid'},
        'model': {'type': model_type}, 'dataloader': {'batch_size': batch},
        'train': {'local_update_steps': steps, 'batch_or_epoch': 'batch'},
        'llm': {'tok_len': 128},
        'fsplug': {'method': method, 'model': {'builder': builder, 'lora': {
            'r': 16, 'alpha': 32, 'target_modules': targets}},
                   'fedmosaic': {'num_blocks': blocks, 'gradient_every': 10},
                   # the distillation baselines' public set: 8 records held apart
                   **{m: {'public_samples': 8} for m in ('perada', 'fedmkt', 'takfl')},
                   'data': {'prompt': 'plain'}}})
    records = build_federated_records(cfg)
    method_obj = get_method_class(method)(cfg)
    return ClientProcedure(1, cfg, method_obj, build_model(cfg, method_obj), records.clients[1])


def compute_ratio(model: str, steps: int, batch: int, repeats: int) -> tuple[float, float]:
    """Median local-round seconds of (Standalone, FedMosaic), interleaved."""
    with tempfile.TemporaryDirectory() as workdir:
        clients = {m: client(m, model, steps, batch, workdir) for m in ('standalone', 'fedmosaic')}
        for c in clients.values():      # warm-up round (W_s loading, allocator)
            c.run_round(0)
        times = {m: [] for m in clients}
        for repeat in range(repeats):
            for name, c in clients.items():
                start = time.perf_counter()
                c.run_round(repeat + 1)
                times[name].append(time.perf_counter() - start)
    return statistics.median(times['standalone']), statistics.median(times['fedmosaic'])


# ------------------------------------------------------------------------ server
def server_times(clients: list[int], grad_dim: int, r: int) -> list[tuple[int, float, float]]:
    from fs_plugins.aggregation.mosaic import customised_globals, rela_weights
    generator = torch.Generator().manual_seed(0)
    pq_names = [f'pq/block{k}.{m}/{leaf}' for k in range(1, 5) for m in ALL_LINEAR
                for leaf in ('P', 'Q')]
    rows = []
    for n in clients:
        grads = torch.randn(n, grad_dim, generator=generator)
        start = time.perf_counter()
        weights = rela_weights(grads, 0.5)
        rela = time.perf_counter() - start
        modules = [{name: torch.randn((r, r) if name.endswith('/P') else (r,), generator=generator)
                    for name in pq_names} for _ in range(n)]
        start = time.perf_counter()
        customised_globals(modules, weights, [0] * n, lambda name: True)
        rows.append((n, rela, time.perf_counter() - start))
        del grads, modules
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', choices=sorted(MODELS), default='tiny')
    parser.add_argument('--steps', type=int, default=20)
    parser.add_argument('--batch', type=int, default=4)
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--clients', type=int, nargs='+', default=[10, 100, 1000])
    parser.add_argument('--grad-dim', type=int, default=100_000)
    parser.add_argument('--rank', type=int, default=128)
    parser.add_argument('--quick', action='store_true', help='a check that the script works')
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.batch, args.repeats = 'tiny', 2, 1, 1
        args.clients, args.grad_dim = [2], 1000
    torch.manual_seed(0)
    print('\n'.join(bytes_table(args.rank, 4, 0.4)))
    standalone, mosaic = compute_ratio(args.model, args.steps, args.batch, args.repeats)
    print(f'\nClient compute, {args.model}, {args.steps} local steps of batch {args.batch} '
          f'(RELA gradient every 10 steps), median of {args.repeats} interleaved rounds:\n'
          f'| Standalone | FedMosaic | ratio |\n|---|---|---|\n'
          f'| {standalone:.2f} s | {mosaic:.2f} s | {mosaic / standalone:.3f} |')
    print(f'\nServer RELA per round (gradients of {args.grad_dim} coordinates; G_i over P, Q of '
          f'4 blocks × 7 modules, r = {args.rank}); a FedMosaic local round above: {mosaic:.2f} s')
    print('| clients N | rela_weights | customised_globals |\n|---|---|---|')
    for n, rela, globals_time in server_times(args.clients, args.grad_dim, args.rank):
        print(f'| {n} | {rela:.3f} s | {globals_time:.3f} s |')


if __name__ == '__main__':
    main()

"""FLAME's compute claims, measured.

[0] Trainable LoRA parameters per budget level (paper Table 1 / A1), counted on peft models
    built on the meta device at full size (no weights, no RAM): OLMoE-1B-7B with the paper's
    placement (separate LoRA on gate, up and down of every expert + q, k, v, o) — FLAME r = 20
    at k = 8, 4, 2, 1; HLoRA / FlexLoRA r = 20, 12, 8, 6 at k = 8 — and the dense OLMo-1B with
    LoRA on every linear layer at r = 40, 24, 16, 12. Total P̂ and active P̂_a (expert factors
    count k/E), next to Table 1's numbers.
[1] FLOPs of one forward of 128 tokens (batch 1) on OLMoE-1B-7B's dimensions for k = 8, 4, 2, 1
    active experts, without weights: an analytic matmul count, checked first against
    torch.utils.flop_counter on a small random OLMoE (eager experts, so only routed tokens
    are counted), then evaluated at full size. The paper (DeepSpeed profiler) reports
    342.8 B (k = 8) -> 158.0 B (k = 1), 46.1 %.
[2] CPU time of one training step (forward + backward + AdamW) of a mid-size random OLMoE
    with LoRA on every expert (peft target_parameters) at k = 8, 4, 2, 1 (FLAME), and at
    k = 8 with the LoRA rank cut from 20 to 6 (HLoRA's largest reduction), median over
    interleaved repeats.

python scripts/bench_flame.py [--threads 1] [--repeats 5] [--skip-steps] [--only-params] [--quick]

--quick: a check that the script works: [0] only FLAME's rows, [2] on the small OLMoE of [1]'s
check, 1 repeat, batch 1 x 16 tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from fs_plugins.models.olmo import DENSE_LORA_MODULES, OLMO_1B_DIMS, random_olmo
from fs_plugins.models.olmoe import (
    EXPERT_LORA_PARAMETERS,
    OLMOE_1B_7B_DIMS,
    PAPER_ATTENTION_LORA_MODULES,
    PAPER_EXPERT_LORA_PARAMETERS,
    base_parameter_counts,
    lora_parameter_counts,
    random_olmoe,
    split_expert_gate_up,
)

PAPER = {8: 342.8e9, 1: 158.0e9}
# Table 1 / A1: (P_a, P) in B and (P̂_a, P̂) in M per budget level β1..β4
TABLE1 = {
    'FLAME (OLMoE) r=20': {8: ((1.3, 6.9), (30, 198)), 4: ((0.9, 6.9), (18, 198)),
                           2: ((0.7, 6.9), (12, 198)), 1: ((0.6, 6.9), (9, 198))},
    'HLoRA/FlexLoRA (OLMoE) k=8': {20: ((1.3, 6.9), (30, 198)), 12: ((1.3, 6.9), (18, 118)),
                                   8: ((1.3, 6.9), (12, 78)), 6: ((1.3, 6.9), (9, 58))},
    'HLoRA/FlexLoRA (OLMo-1B dense)': {40: ((1.3, 1.3), (30, 30)), 24: ((1.3, 1.3), (18, 18)),
                                       16: ((1.3, 1.3), (12, 12)), 12: ((1.3, 1.3), (9, 9))},
}
CHECK_DIMS = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=32, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=16, num_experts_per_tok=8, vocab_size=300)
MID_DIMS = dict(num_hidden_layers=4, hidden_size=512, intermediate_size=256,
                num_attention_heads=8, num_key_value_heads=8, num_experts=64,
                num_experts_per_tok=8, vocab_size=4096)


def forward_flops(dims: dict, tokens: int, k: int) -> int:
    """Matmul FLOPs (2 per multiply-add) of one forward of `tokens` tokens, batch 1:
    q/k/v/o projections, attention scores and values (full T × T, as SDPA is counted),
    router, k SwiGLU experts per token (gate+up: H -> 2I, down: I -> H), LM head."""
    h, i, e = dims['hidden_size'], dims['intermediate_size'], dims['num_experts']
    head_dim = h // dims['num_attention_heads']
    kv = dims['num_key_value_heads'] * head_dim
    per_layer = (2 * tokens * h * (2 * h + 2 * kv)          # q, o (h x h); k, v (kv x h)
                 + 2 * 2 * tokens * tokens * h              # QK^T and AV
                 + 2 * tokens * h * e                       # router
                 + 2 * tokens * k * 3 * h * i)              # experts
    return dims['num_hidden_layers'] * per_layer + 2 * tokens * h * dims['vocab_size']


def counted_flops(dims: dict, tokens: int, k: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode
    model = random_olmoe(seed=0, **dims).eval()
    model.set_experts_implementation('eager')
    model.set_attn_implementation('eager')    # plain matmuls, which the counter sees
    for layer in model.model.layers:
        layer.mlp.gate.top_k = k
    ids = torch.randint(0, dims['vocab_size'], (1, tokens))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids)
    return counter.get_total_flops()


def flop_table(tokens: int) -> None:
    print(f'[1] forward FLOPs, {tokens} tokens, batch 1')
    print('  check against torch.utils.flop_counter on a small random OLMoE '
          f'({CHECK_DIMS["num_hidden_layers"]} layers, hidden {CHECK_DIMS["hidden_size"]}, '
          f'{CHECK_DIMS["num_experts"]} experts):')
    for k in (8, 4, 2, 1):
        analytic, counted = forward_flops(CHECK_DIMS, tokens, k), counted_flops(CHECK_DIMS, tokens, k)
        print(f'    k={k}: analytic {analytic:,}  counted {counted:,}  '
              f'(analytic/counted = {analytic / counted:.6f})')
    print('  OLMoE-1B-7B dimensions (16 layers, hidden 2048, 64 experts, width 1024, vocab 50304):')
    full = {k: forward_flops(OLMOE_1B_7B_DIMS, tokens, k) for k in (8, 4, 2, 1)}
    for k, flops in full.items():
        paper = f'   paper {PAPER[k] / 1e9:.1f} B' if k in PAPER else ''
        print(f'    k={k}: {flops / 1e9:7.1f} B  ratio to k=8 {flops / full[8]:.3f}{paper}')
    print(f'    paper k=1/k=8: {PAPER[1] / PAPER[8]:.3f}')


def meta_peft_model(dense: bool, rank: int, router: bool = False):
    """A peft model at full OLMoE-1B-7B / OLMo-1B size on the meta device (shapes only);
    `router`: LoRA on the routers too (not the paper's stated placement; printed for comparison)."""
    from peft import LoraConfig, get_peft_model
    with torch.device('meta'):
        model = random_olmo(**OLMO_1B_DIMS) if dense else random_olmoe(**OLMOE_1B_7B_DIMS)
    if dense:
        config = LoraConfig(r=rank, lora_alpha=16, target_modules=DENSE_LORA_MODULES)
    else:
        split_expert_gate_up(model)
        config = LoraConfig(r=rank, lora_alpha=16, target_modules=PAPER_ATTENTION_LORA_MODULES,
                            target_parameters=PAPER_EXPERT_LORA_PARAMETERS
                            + (['mlp.gate.weight'] if router else []))
    return get_peft_model(model, config)


def param_table(quick: bool = False) -> None:
    """`quick`: only the FLAME rows (one model instead of ten)."""
    print('[0] parameters per budget level (paper placement; meta-device models at full size)')
    print(f'    {"setting":40s} {"β":>2s}  {"P_a / P (B)":>13s}  {"paper":>9s}   '
          f'{"P̂_a / P̂ (M)":>15s}  {"paper":>9s}')
    rows = []
    flame = meta_peft_model(False, 20)
    for level, k in enumerate((8, 4, 2, 1), start=1):
        rows.append(('FLAME (OLMoE) r=20', f'k={k}', level, flame, k, TABLE1['FLAME (OLMoE) r=20'][k]))
    if quick:
        print_param_rows(rows)
        return
    routed = meta_peft_model(False, 20, router=True)
    for level, k in enumerate((8, 4, 2, 1), start=1):
        rows.append(('FLAME (OLMoE) r=20 +router LoRA', f'k={k}', level, routed, k,
                     TABLE1['FLAME (OLMoE) r=20'][k]))
    for level, r in enumerate((20, 12, 8, 6), start=1):
        rows.append(('HLoRA/FlexLoRA (OLMoE) k=8', f'r={r}', level, meta_peft_model(False, r), 8,
                     TABLE1['HLoRA/FlexLoRA (OLMoE) k=8'][r]))
    for level, r in enumerate((40, 24, 16, 12), start=1):
        rows.append(('HLoRA/FlexLoRA (OLMo-1B dense)', f'r={r}', level, meta_peft_model(True, r), 8,
                     TABLE1['HLoRA/FlexLoRA (OLMo-1B dense)'][r]))
    print_param_rows(rows)


def print_param_rows(rows) -> None:
    for name, knob, level, model, k, (paper_base, paper_lora) in rows:
        base, base_active = base_parameter_counts(model, k)
        lora, lora_active = lora_parameter_counts(model, k)
        print(f'    {name + " " + knob:40s} β{level}  {base_active / 1e9:5.2f} / {base / 1e9:5.2f}  '
              f'{paper_base[0]:>3} / {paper_base[1]:<3}   {lora_active / 1e6:6.2f} / {lora / 1e6:6.2f}  '
              f'{paper_lora[0]:>3} / {paper_lora[1]:<3}')


def lora_model(rank: int, dims: dict):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    model = get_peft_model(random_olmoe(seed=0, **dims),
                           LoraConfig(r=rank, lora_alpha=16, target_modules=['q_proj', 'v_proj'],
                                      target_parameters=EXPERT_LORA_PARAMETERS))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, optimizer


def step_time(model, optimizer, ids) -> float:
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def set_top_k(model, k: int) -> None:
    for _name, module in model.named_modules():
        if hasattr(module, 'top_k') and hasattr(module, 'num_experts'):
            module.top_k = k


def step_table(tokens: int, batch: int, repeats: int, dims: dict) -> None:
    print(f'\n[2] training step on CPU, random OLMoE {dims["num_hidden_layers"]} layers, '
          f'hidden {dims["hidden_size"]}, {dims["num_experts"]} experts (width '
          f'{dims["intermediate_size"]}), vocab {dims["vocab_size"]}; batch {batch} x '
          f'{tokens} tokens; LoRA on q, v and every expert; median of {repeats} interleaved repeats')
    ids = torch.randint(0, dims['vocab_size'], (batch, tokens))
    flame_model, flame_opt = lora_model(20, dims)
    hlora_model, hlora_opt = lora_model(6, dims)
    runs = {f'FLAME k={k}, r=20': (flame_model, flame_opt, k) for k in (8, 4, 2, 1)}
    runs['HLoRA k=8, r=6'] = (hlora_model, hlora_opt, 8)
    times = {name: [] for name in runs}
    for _name, (model, opt, k) in runs.items():   # warm-up
        set_top_k(model, k)
        step_time(model, opt, ids)
    for _ in range(repeats):
        for name, (model, opt, k) in runs.items():
            set_top_k(model, k)
            times[name].append(step_time(model, opt, ids))
    med = {name: statistics.median(values) for name, values in times.items()}
    base = med['FLAME k=8, r=20']
    for name, value in med.items():
        print(f'    {name:18s} {value * 1e3:8.1f} ms   ratio to FLAME k=8: {value / base:.3f}')
    ratio = med['FLAME k=1, r=20'] / base
    print(f'  FLAME k=1/k=8 step-time ratio {ratio:.3f} (target <= 0.6: '
          f'{"met" if ratio <= 0.6 else "NOT met"}); HLoRA r=6/r=20 at k=8: '
          f'{med["HLoRA k=8, r=6"] / base:.3f}')


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--threads', type=int, default=1,
                        help='torch threads (0 = torch default). 1 by default: on the shared '
                             '2-core machine multi-threaded small matmuls were up to 60x slower')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--tokens', type=int, default=128)
    parser.add_argument('--batch', type=int, default=16,
                        help='sequences per training step (16: the paper\'s batch size)')
    parser.add_argument('--skip-steps', action='store_true', help='no step timing ([2])')
    parser.add_argument('--only-params', action='store_true', help='only the parameter table ([0])')
    parser.add_argument('--quick', action='store_true', help='a check that the script works '
                                                             '(see the module docstring)')
    args = parser.parse_args()
    step_dims = CHECK_DIMS if args.quick else MID_DIMS
    if args.quick:
        args.repeats, args.tokens, args.batch = 1, 16, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    param_table(args.quick)
    if args.only_params:
        return
    print()
    flop_table(args.tokens)
    if not args.skip_steps:
        step_table(args.tokens, args.batch, args.repeats, step_dims)


if __name__ == '__main__':
    main()

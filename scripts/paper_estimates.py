"""`fs-plugins estimate` for the papers' 7B settings on a machine without their checkpoints.

The estimate reads only a model's config (never its weights); offline, this script writes
folders with the architecture config of LLaVA-1.5-7B (LLaMA-7B + CLIP ViT-L/14-336, as
llava-hf/llava-1.5-7b-hf) and OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924), each beside the tiny
models' tokenizer and processor (the estimate does not tokenise), then estimates the shipped
paper YAMLs with model.type pointing there. With the hub reachable, run
`fs-plugins estimate --cfg <yaml>` directly instead.

    python scripts/paper_estimates.py [--out DIR] [--seq-len N ...]   (each run at its own length, plus these)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAVA15_7B = {'text_config': dict(hidden_size=4096, intermediate_size=11008,
                                  num_hidden_layers=32, num_attention_heads=32,
                                  num_key_value_heads=32, head_dim=128, vocab_size=32064,
                                  max_position_embeddings=4096, rms_norm_eps=1e-5),
              'vision_config': dict(hidden_size=1024, intermediate_size=4096,
                                    num_hidden_layers=24, num_attention_heads=16,
                                    image_size=336, patch_size=14, projection_dim=768),
              'vision_feature_layer': -2, 'vision_feature_select_strategy': 'default'}

# (paper YAML, config folder, text tokens per sample, further overrides): Fed-MoLE and its
# FedAvg-LoRA row (Table 5's memory) at 64 text tokens (a VQA question and short answer; the
# YAML's llm.tok_len 1024 is only the truncation limit) besides the 576 image tokens; FLAME on
# OLMoE at its YAML's 512 tokens
RUNS = [('yamls/fedmole/fedvqa_llava15_7b.yaml', 'llava-1.5-7b', 64, []),
        ('yamls/fedmole/fedvqa_llava15_7b.yaml', 'llava-1.5-7b', 64, ['fsplug.method', 'fedavg']),
        ('yamls/flame/alpagasus_flame.yaml', 'olmoe-1b-7b', 512, [])]


def write_llava(out: str) -> str:
    from fs_plugins.models.vision_language import build_tiny_llava_dir
    folder = os.path.join(out, 'llava-1.5-7b')
    if not os.path.isdir(folder):
        build_tiny_llava_dir(folder)
    with open(os.path.join(folder, 'config.json')) as handle:
        config = json.load(handle)
    for part in ('text_config', 'vision_config'):
        config[part].update(LLAVA15_7B[part])
    config.update({k: v for k, v in LLAVA15_7B.items() if not k.endswith('_config')})
    _replace_config(folder, config)
    return folder


def write_olmoe(out: str) -> str:
    from fs_plugins.models.olmoe import OLMOE_1B_7B_DIMS, ensure_tiny_olmoe
    folder = os.path.join(out, 'olmoe-1b-7b')
    if not os.path.isdir(folder):
        shutil.copytree(ensure_tiny_olmoe(), folder)
    with open(os.path.join(folder, 'config.json')) as handle:
        config = json.load(handle)
    config.update(OLMOE_1B_7B_DIMS)
    _replace_config(folder, config)
    return folder


def _replace_config(folder: str, config: dict) -> None:
    with open(os.path.join(folder, 'config.json'), 'w') as handle:
        json.dump(config, handle, indent=2)
    for name in os.listdir(folder):   # the tiny weights do not fit the config: none is read
        if name.endswith(('.safetensors', '.bin')) or name.endswith('.index.json'):
            os.remove(os.path.join(folder, name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', default=os.path.join(REPO, 'exp', 'paper_configs'))
    parser.add_argument('--seq-len', type=int, nargs='*', default=[],
                        help='further text-token counts per sample to estimate')
    args = parser.parse_args()
    folders = {'llava-1.5-7b': write_llava(args.out), 'olmoe-1b-7b': write_olmoe(args.out)}
    for yaml_path, folder, seq_len, extra in RUNS:
        builder = 'llava' if folder == 'llava-1.5-7b' else 'olmoe'
        for seq in [seq_len] + args.seq_len:
            cmd = [sys.executable, '-m', 'fs_plugins.commands.cli', 'estimate', '--cfg', yaml_path,
                   '--seq-len', str(seq),
                   'model.type', f'{folders[folder]}@fsplug_llm', 'fsplug.model.builder', builder,
                   'fsplug.model.local_files_only', 'True', 'data.root', args.out, *extra]
            print(f'$ {" ".join(cmd[1:])}', flush=True)
            subprocess.run(cmd, cwd=REPO, check=False)


if __name__ == '__main__':
    main()

"""`fs-plugins estimate` for the papers' 7B settings on a machine without their checkpoints.

The estimate reads only a model's config (never its weights); offline, this script writes
folders with the architecture config of LLaVA-1.5-7B (LLaMA-7B + CLIP ViT-L/14-336, as
llava-hf/llava-1.5-7b-hf), FedMosaic's LLaVA-Llama3.2-1B and -3B (Llama-3.2-1B / -3B + the
same CLIP tower; the paper's checkpoints are its own) and OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924),
each beside the tiny models' tokenizer and processor (the estimate does not tokenise), then
estimates the shipped paper YAMLs with model.type pointing there. FedMosaic's DRAKE YAML runs
with one 1B and one 3B client (Table 2's two sizes; W_s = the 1B), each beside SFT's peak and
Table 15's 1.053. With the hub reachable, run `fs-plugins estimate --cfg <yaml>` directly instead.

    python scripts/paper_estimates.py [--out DIR] [--seq-len N ...] [--only WORD ...] [--configs-only]
    (each run at its own length, plus --seq-len's)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LLAVA15_7B = {'text_config': dict(hidden_size=4096, intermediate_size=11008,
                                  num_hidden_layers=32, num_attention_heads=32,
                                  num_key_value_heads=32, head_dim=128, vocab_size=32064,
                                  max_position_embeddings=4096, rms_norm_eps=1e-5),
              'vision_config': dict(hidden_size=1024, intermediate_size=4096,
                                    num_hidden_layers=24, num_attention_heads=16,
                                    image_size=336, patch_size=14, projection_dim=768),
              'vision_feature_layer': -2, 'vision_feature_select_strategy': 'default'}

CLIP_L336 = LLAVA15_7B['vision_config']
LLAMA32_KEYS = ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
                'num_key_value_heads', 'head_dim', 'vocab_size', 'max_position_embeddings',
                'rms_norm_eps', 'rope_theta', 'rope_scaling', 'tie_word_embeddings')


def llava_llama32(size: str) -> dict:
    """LLaVA-1.5's layout over Llama-3.2-<size> (FedMosaic's LLaVA-Llama3.2-1B / -3B)."""
    from fs_plugins.models.builders import ARCHITECTURES_DIR
    with open(os.path.join(ARCHITECTURES_DIR, f'meta-llama--Llama-3.2-{size}.json')) as handle:
        text = json.load(handle)
    return {'text_config': {k: text[k] for k in LLAMA32_KEYS}, 'vision_config': CLIP_L336,
            'vision_feature_layer': -2, 'vision_feature_select_strategy': 'default'}


LLAVA_FOLDERS = {'llava-1.5-7b': LLAVA15_7B, 'llava-llama3.2-1b': llava_llama32('1B'),
                 'llava-llama3.2-3b': llava_llama32('3B')}
# FedMosaic's two client sizes (one client each), written as a --client_cfg file
MOSAIC_CLIENTS = {'client_1': 'llava-llama3.2-1b', 'client_2': 'llava-llama3.2-3b'}

# (paper YAML, config folder, text tokens per sample, further overrides): Fed-MoLE and its
# FedAvg-LoRA row (Table 5's memory) at 64 text tokens (a VQA question and short answer; the
# YAML's llm.tok_len 1024 is only the truncation limit) besides the 576 image tokens; FLAME on
# OLMoE at its YAML's 512 tokens; FedMosaic on DRAKE at 128 text tokens (a question with its
# choices and a short answer) besides one image's 576 tokens, batch 4 (line 734)
RUNS = [('yamls/fedmole/fedvqa_llava15_7b.yaml', 'llava-1.5-7b', 64, []),
        ('yamls/fedmole/fedvqa_llava15_7b.yaml', 'llava-1.5-7b', 64, ['fsplug.method', 'fedavg']),
        ('yamls/flame/alpagasus_flame.yaml', 'olmoe-1b-7b', 512, []),
        ('yamls/fedmosaic/drake_dynamic.yaml', 'llava-llama3.2-1b', 128,
         ['federate.client_num', '2', 'federate.sample_client_num', '2'])]


def write_llava(out: str, name: str) -> str:
    from fs_plugins.models.vision_language import build_tiny_llava_dir
    folder, dims = os.path.join(out, name), LLAVA_FOLDERS[name]
    if not os.path.isdir(folder):
        build_tiny_llava_dir(folder)
    with open(os.path.join(folder, 'config.json')) as handle:
        config = json.load(handle)
    for part in ('text_config', 'vision_config'):
        config[part].update(dims[part])
    config.update({k: v for k, v in dims.items() if not k.endswith('_config')})
    _replace_config(folder, config)
    return folder


def write_mosaic_clients(out: str, folders: dict) -> str:
    """The --client_cfg file giving FedMosaic's estimate one client of each size."""
    import yaml
    path = os.path.join(out, 'fedmosaic_sizes_clients.yaml')
    entries = {cid: {'model': {'type': f'{folders[name]}@fsplug_llm'}}
               for cid, name in MOSAIC_CLIENTS.items()}
    with open(path, 'w') as handle:
        yaml.safe_dump(entries, handle)
    return path


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
    parser.add_argument('--only', nargs='*', default=None, metavar='WORD',
                        help='only the runs whose YAML path contains one of these (fedmosaic, flame ...)')
    parser.add_argument('--configs-only', action='store_true',
                        help='write the config folders (for scripts/gpu_paper_memory.py) and stop')
    args = parser.parse_args()
    folders = {name: write_llava(args.out, name) for name in LLAVA_FOLDERS}
    folders['olmoe-1b-7b'] = write_olmoe(args.out)
    mosaic_clients = write_mosaic_clients(args.out, folders)
    if args.configs_only:
        print('\n'.join(folders.values()))
        return
    for yaml_path, folder, seq_len, extra in RUNS:
        if args.only and not any(word in yaml_path for word in args.only):
            continue
        builder = 'llava' if folder.startswith('llava') else 'olmoe'
        clients = ['--client_cfg', mosaic_clients] if 'fedmosaic' in yaml_path else []
        for seq in [seq_len] + args.seq_len:
            cmd = [sys.executable, '-m', 'fs_plugins.commands.cli', 'estimate', '--cfg', yaml_path,
                   *clients, '--seq-len', str(seq),
                   'model.type', f'{folders[folder]}@fsplug_llm', 'fsplug.model.builder', builder,
                   'fsplug.model.local_files_only', 'True', 'data.root', args.out, *extra]
            print(f'$ {" ".join(cmd[1:])}', flush=True)
            subprocess.run(cmd, cwd=REPO, check=False)


if __name__ == '__main__':
    main()

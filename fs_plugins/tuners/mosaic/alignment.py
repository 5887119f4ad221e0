"""Weight alignment of PQ-LoRA across architectures before federated training (paper §4.2.2,
A.5, Algorithms 3-4), run once per pair (pivot model, other model) and cached on disk.

Both models run their frozen base (adapters disabled) on the same public records, batch by
batch; forward hooks on the PQ-LoRA layers capture each layer's input x, which is reduced at
once to sums (aggregation.mosaic.AlignmentMoments), so memory does not grow with the public
data (the paper aligns on 5000 samples). Per pair of PQ layers (same block, same module path
inside the decoder layer), over all the public rows at once:
  A: the other model's A_j is fitted so that A_j x_j matches the pivot's A_i x_i, plus
     λ‖A_j A_jᵀ − I‖², then projected to orthonormal rows. alignment_schedule = paper (A.17):
     one epoch over the public records, one Adam step per batch of alignment_batch_size (4)
     at alignment_lr (5e-5) on a cosine schedule, taken while the batches stream
     (aggregation.mosaic.MiniBatchAlignment); full_batch: alignment_steps full-batch Adam steps
     at alignment_full_batch_lr on the objective over all rows, from the sums
     (aggregation.mosaic.align_a_from_moments);
  B: CCA between the B outputs B_i A_i x_i and B_j A_j x_j (with the aligned A_j), then
     B_j = (Π_j⁺)ᵀ Π_iᵀ B_i (aggregation.mosaic.b_output_cca, align_b).
Table 32's ablations switch either part off (`align_a`, `align_b`: False keeps that factor at
its random orthonormal start, Eq. 18); with A not aligned, B's CCA uses the random A_j.
When both models tokenise the public records identically (same tokenizer and image
tokens), the features are per token, as in Algorithm 3; otherwise each record's tokens are
averaged, so models with different tokenizers can still be aligned.

The result is keyed by both models' digests (config and base weights), r and every setting
that changes it, and written atomically, so a changed model never reuses a stale alignment.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fs_plugins.aggregation.mosaic import (
    AlignmentMoments,
    MiniBatchAlignment,
    a_alignment_loss_from_moments,
    align_a_from_moments,
    align_b,
    b_output_cca,
)
from fs_plugins.core.cache import cache_dir
from fs_plugins.core.errors import ConfigError
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.public import CLIENTS, HELD_OUT, public_records
from fs_plugins.models.codecs import EncodedDataset
from fs_plugins.schema.specs import ModelSpec
from fs_plugins.tuners.mosaic.layer import GATE_ATTR, MOSAIC_ATTR, MosaicLinear

logger = logging.getLogger(__name__)


def model_digest(model: torch.nn.Module) -> str:
    """sha256 of a model's base config and frozen base weights (adapters left out); where the
    model was loaded from does not count."""
    base = model.get_base_model() if hasattr(model, 'get_base_model') else model
    config = {k: v for k, v in base.config.to_dict().items() if k != '_name_or_path'}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in base.named_parameters():
        if 'lora_' in name or f'.{MOSAIC_ATTR}.' in name or f'.{GATE_ATTR}.' in name:
            continue
        digest.update(name.encode())
        tensor = param.detach().to('cpu').contiguous()
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b'')
    return digest.hexdigest()


def alignment_path(folder: str, pivot_digest: str, other_digest: str, r: int,
                   settings: dict) -> str:
    """The cache file of one alignment: both model digests and r in the name, a hash of the
    remaining settings (blocks, targets, seed, public data, optimiser) after them."""
    tail = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
    return os.path.join(folder, f'pivot-{pivot_digest[:16]}_model-{other_digest[:16]}_r{r}_'
                                f'{tail[:16]}.safetensors')


def save_alignment(path: str, aligned: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   meta: dict) -> None:
    """Writes {pq key: (A, B)} to `path` atomically (temporary file + rename)."""
    import safetensors.torch
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tensors = {f'{key}/{part}': t.detach().to('cpu', torch.float32).contiguous()
               for key, pair in aligned.items() for part, t in zip(('A', 'B'), pair)}
    handle, tmp = tempfile.mkstemp(prefix='.alignment-', suffix='.tmp', dir=folder)
    os.close(handle)
    try:
        safetensors.torch.save_file(tensors, tmp, metadata={'fsplug': json.dumps(meta)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_alignment(path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    import safetensors.torch
    tensors = safetensors.torch.load_file(path)
    keys = {name.rsplit('/', 1)[0] for name in tensors}
    return {key: (tensors[f'{key}/A'], tensors[f'{key}/B']) for key in keys}


# ------------------------------------------------------------------------- features
def _batches(codec, records: list[dict], batch_size: int):
    dataset = EncodedDataset(records, codec, 'FedMosaic alignment public data')
    for start in range(0, len(dataset), batch_size):
        batch = codec.collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        batch.pop('labels', None)
        yield batch


def same_tokens(pivot_codec, codec, records: list[dict]) -> bool:
    """Whether both codecs encode every record to the same token ids (then the two models'
    layer inputs pair token by token)."""
    return all(torch.equal(pivot_codec.encode(r)['input_ids'], codec.encode(r)['input_ids'])
               for r in records)


@contextmanager
def base_layer_inputs(model, pq_layers: dict[str, str]):
    """While open, every forward of `model` runs its frozen base (adapters disabled, eval
    mode) and leaves each PQ layer's input in the yielded {pq key: (batch, tokens, d_in)}."""
    modules = dict(model.named_modules())
    current: dict[str, torch.Tensor] = {}
    handles = [modules[name].register_forward_hook(
        lambda _m, args, _out, key=key: current.__setitem__(key, args[0].detach()))
        for name, key in pq_layers.items()]
    was_training = model.training
    # peft's disable_adapter() re-enables adapters on exit with set_adapter(), which makes
    # every LoRA weight trainable again, PQ-LoRA's frozen A, B included: restore the flags
    requires_grad = {param: param.requires_grad for param in model.parameters()}
    model.eval()
    try:
        with model.disable_adapter():
            yield current
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
        for param, flag in requires_grad.items():
            param.requires_grad_(flag)


def _rows(value: torch.Tensor, mask: torch.Tensor, per_token: bool, key: str) -> torch.Tensor:
    """(n, d) float64 rows of one batch's layer input: its non-padding tokens, or the mean of
    each record's tokens."""
    if value.shape[:2] != mask.shape:
        raise ValueError(f'FedMosaic alignment: the input of PQ layer {key} has shape '
                         f'{tuple(value.shape)}, expected (batch, tokens) = {tuple(mask.shape)} '
                         f'first')
    value = value.to(torch.float64)
    if per_token:
        return value[mask]
    return torch.stack([value[row][mask[row]].mean(0) for row in range(mask.shape[0])])


@torch.no_grad()
def alignment_moments(pivot_model, pivot_codec, pivot_factors: dict, model, codec,
                      records: list[dict], per_token: bool, batch_size: int = 8,
                      fit: Callable[[dict], None] | None = None) -> dict[str, AlignmentMoments]:
    """Streams `records` through both frozen bases batch by batch; per PQ key, the moments of
    the pivot's A outputs z = A_i x_i (A_i from `pivot_factors`) and the other model's layer
    inputs x_j (aggregation.mosaic.AlignmentMoments), so no layer input is kept. `fit`, if
    given, is called with every batch's rows {key: (z, x)} (the paper's mini-batch fit of A)."""
    pivot_a = {key: a.to(torch.float64) for key, (a, _) in pivot_factors.items()}
    moments: dict[str, AlignmentMoments] = {}
    devices = (next(pivot_model.parameters()).device, next(model.parameters()).device)
    with base_layer_inputs(pivot_model, pivot_model.fedmosaic_pq) as pivot_inputs, \
            base_layer_inputs(model, model.fedmosaic_pq) as other_inputs:
        for pivot_batch, other_batch in zip(_batches(pivot_codec, records, batch_size),
                                            _batches(codec, records, batch_size)):
            masks = []
            for net, batch, device in ((pivot_model, pivot_batch, devices[0]),
                                       (model, other_batch, devices[1])):
                batch = {k: v.to(device) for k, v in batch.items()}
                net(**batch)
                masks.append(batch['attention_mask'].bool().cpu())
            rows = {}
            for key, a in pivot_a.items():
                z = _rows(pivot_inputs[key].cpu(), masks[0], per_token, key) @ a.T
                x = _rows(other_inputs[key].cpu(), masks[1], per_token, key)
                if key not in moments:
                    moments[key] = AlignmentMoments.zeros(z.shape[1], x.shape[1])
                moments[key].add(z, x)
                rows[key] = (z, x)
            if fit is not None:
                fit(rows)
            pivot_inputs.clear()
            other_inputs.clear()
    return moments


# ------------------------------------------------------------------------- alignment
def lora_factors(model, pq_layers: dict[str, str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{pq key: (A (r × d_in), B (d_out × r))} of a model's PQ-LoRA layers."""
    modules = dict(model.named_modules())
    out = {}
    for name, key in pq_layers.items():
        module: MosaicLinear = modules[name]
        out[key] = (module.lora_A['default'].weight.detach().float().cpu(),
                    module.lora_B['default'].weight.detach().float().cpu())
    return out


def rank_of(factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """r of a model's PQ-LoRA layers (rows of A)."""
    return next(iter(factors.values()))[0].shape[0]


def check_pairing(pivot_keys, other_keys, pivot_r: int, other_r: int, other_name: str) -> None:
    """The two models must have the same PQ layers (block and module path) and the same r."""
    if set(pivot_keys) != set(other_keys):
        raise ConfigError(f"FedMosaic: the PQ-LoRA layers of {other_name} "
                          f"({sorted(other_keys)}) do not pair with the pivot's "
                          f"({sorted(pivot_keys)}); give every model the same "
                          f"fsplug.model.lora.target_modules and fsplug.fedmosaic.num_blocks")
    if pivot_r != other_r:
        raise ConfigError(f"FedMosaic: fsplug.model.lora.r is {other_r} for {other_name} but "
                          f"{pivot_r} for the pivot; P (r × r) and Q (r) are shared across "
                          f"architectures, so r must be the same for every model")


def compute_alignment(moments: dict[str, AlignmentMoments], pivot_factors: dict,
                      other_factors: dict, reg: float, steps: int,
                      lr: float, fitted_a: dict | None = None,
                      cca_b: bool = True) -> tuple[dict, dict]:
    """{pq key: (aligned A_j, aligned B_j)} and per key the A objective before / after.
    `fitted_a` {key: A_j}: A already fitted (the paper's mini-batch schedule), or left as it
    is (A not aligned); else A is fitted here with `steps` full-batch Adam steps at `lr`.
    `cca_b` False keeps B_j as it is (Table 32's 'Random' B)."""
    aligned, report = {}, {}
    for key in sorted(pivot_factors):
        _, b_i = pivot_factors[key]
        a_j, b_j = other_factors[key]
        new_a = (fitted_a[key].to(a_j.dtype) if fitted_a is not None else
                 align_a_from_moments(moments[key], a_j, reg=reg, steps=steps, lr=lr))
        new_b = b_j
        if cca_b:
            pi_i, pi_j = b_output_cca(moments[key], b_i, new_a, b_j)
            new_b = align_b(b_i, pi_i, pi_j).to(b_j.dtype)
        aligned[key] = (new_a, new_b)
        report[key] = tuple(float(a_alignment_loss_from_moments(moments[key], a.double(), reg))
                            for a in (a_j, new_a))
    return aligned, report


@torch.no_grad()
def apply_alignment(model, pq_layers: dict[str, str],
                    aligned: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies the aligned A, B into the model's (frozen) PQ-LoRA factors."""
    modules = dict(model.named_modules())
    for name, key in pq_layers.items():
        a, b = aligned[key]
        lora_a, lora_b = modules[name].lora_A['default'].weight, modules[name].lora_B['default'].weight
        if lora_a.shape != a.shape or lora_b.shape != b.shape:
            raise ValueError(f'FedMosaic alignment for PQ layer {key} has A {tuple(a.shape)}, '
                             f'B {tuple(b.shape)}; the model has {tuple(lora_a.shape)}, '
                             f'{tuple(lora_b.shape)} (stale alignment file?)')
        lora_a.copy_(a.to(lora_a.dtype))
        lora_b.copy_(b.to(lora_b.dtype))


# ------------------------------------------------------------------------- orchestration
def default_folder() -> str:
    return os.path.join(cache_dir(), 'fedmosaic_alignment')


@dataclass
class Pivot:
    """What aligning to the pivot needs: its digest, PQ factors and codec always; its model
    (`built`, else `build()`) only when an alignment is computed rather than read."""
    digest: str
    factors: dict
    codec: object
    build: Callable[[], object]           # -> BuiltModel of the pivot
    built: object | None = None

    @classmethod
    def of(cls, built, build) -> Pivot:
        return cls(model_digest(built.model), lora_factors(built.model, built.model.fedmosaic_pq),
                   built.codec, build, built)

    def model(self):
        if self.built is None:
            self.built = self.build()
        return self.built

    def release(self) -> None:
        """Frees the pivot's model; digest, factors and codec stay."""
        self.built = None


def align_to_pivot(model, codec, spec: ModelSpec, pivot: Pivot, pivot_type: str, hp,
                   split=None) -> str:
    """Aligns `model`'s PQ-LoRA A, B to those of the pivot (model.type `pivot_type`)
    (Algorithms 3-4), from the cache when the same alignment was computed before; returns the
    cache file. `split`: the run's SplitSpec (its held-apart records, alignment_data
    'held_out')."""
    name = f"model.type '{spec.type_value}'"
    pivot_factors = pivot.factors
    other_factors = lora_factors(model, model.fedmosaic_pq)
    r = rank_of(other_factors)
    check_pairing(pivot_factors, other_factors, rank_of(pivot_factors), r, name)
    settings = alignment_settings(spec, hp)
    path = alignment_path(hp.alignment_dir or default_folder(), pivot.digest,
                          model_digest(model), r, settings)
    if os.path.isfile(path):
        apply_alignment(model, model.fedmosaic_pq, load_alignment(path))
        logger.info(f'FedMosaic: {name} aligned to the pivot from {path}')
        return path
    if hp.alignment == 'require':
        raise ConfigError(f"FedMosaic: {name} has no alignment to the pivot "
                          f"'{pivot_type}' (r={r}) in {os.path.dirname(path)} and "
                          f"fsplug.fedmosaic.alignment = 'require'; run once with 'compute'")
    records = public_records(hp.alignment_data, spec.data, hp.alignment_samples,
                             derive_alignment_seed(spec.seed), 'fsplug.fedmosaic.alignment_data',
                             split)
    pivot_model = pivot.model().model
    per_token = same_tokens(pivot.codec, codec, records)
    fit = None
    if hp.align_a and hp.alignment_schedule == 'paper':
        fit = MiniBatchAlignment({key: a for key, (a, _) in other_factors.items()},
                                 paper_steps(len(records), hp.alignment_batch_size),
                                 hp.alignment_lr, hp.alignment_reg)
    moments = alignment_moments(pivot_model, pivot.codec, pivot_factors, model, codec, records,
                                per_token, hp.alignment_batch_size,
                                fit.step if fit is not None else None)
    fitted_a = fit.result() if fit is not None else None
    if not hp.align_a:
        fitted_a = {key: a for key, (a, _) in other_factors.items()}
    aligned, report = compute_alignment(moments, pivot_factors, other_factors, hp.alignment_reg,
                                        hp.alignment_steps, hp.alignment_full_batch_lr,
                                        fitted_a, cca_b=hp.align_b)
    apply_alignment(model, model.fedmosaic_pq, aligned)
    save_alignment(path, aligned, {'pivot': pivot_type, 'model': spec.type_value, 'r': r,
                                   'per_token': per_token, **settings})
    before = sum(b for b, _ in report.values()) / len(report)
    after = sum(a for _, a in report.values()) / len(report)
    logger.info(f"FedMosaic: aligned {name} to the pivot '{pivot_type}' on "
                f"{len(records)} public records ({'per token' if per_token else 'per record'}): "
                f"mean A objective {before:.4g} -> {after:.4g}; saved {path}")
    return path


def paper_steps(samples: int, batch_size: int) -> int:
    """Optimiser steps of the paper's schedule: one epoch of batches, ⌈samples / batch⌉."""
    return max(1, math.ceil(samples / batch_size))


def alignment_settings(spec: ModelSpec, hp) -> dict:
    """Everything besides the two models and r that changes an alignment (its cache key)."""
    settings = {'seed': spec.seed, 'blocks': hp.num_blocks, 'placement': hp.placement,
                'targets': sorted(spec.model.lora.target_modules),
                'data': (f'{hp.alignment_data}:{spec.data.type_value}'
                         if hp.alignment_data in (HELD_OUT, CLIENTS) else hp.alignment_data),
                'samples': hp.alignment_samples,
                'reg': hp.alignment_reg, 'schedule': hp.alignment_schedule,
                'batch_size': hp.alignment_batch_size}
    if hp.alignment_schedule == 'paper':
        settings.update(lr=hp.alignment_lr, lr_schedule='cosine', epochs=1)
    else:
        settings.update(steps=hp.alignment_steps, lr=hp.alignment_full_batch_lr)
    # only a part switched off enters the key, so the default's cached alignments stay valid
    settings.update({part: False for part in ('align_a', 'align_b') if not getattr(hp, part)})
    return settings


def derive_alignment_seed(seed: int) -> int:
    return derive_seed(seed, 'fedmosaic-public-data')

"""Weight alignment of PQ-LoRA across architectures before federated training (paper §4.2.2,
A.5, Algorithms 3-4), run once per pair (pivot model, other model) and cached on disk.

Both models run their frozen base (LoRA scaled to 0) on the same public records; forward
hooks on the PQ-LoRA layers capture each layer's input x. Per pair of PQ layers (same block,
same module path inside the decoder layer):
  A: the other model's A_j is fitted so that A_j x_j matches the pivot's A_i x_i, plus
     λ‖A_j A_jᵀ − I‖², then projected to orthonormal rows (aggregation.mosaic.align_a);
  B: CCA between the B outputs B_i A_i x_i and B_j A_j x_j (with the aligned A_j), then
     B_j = (Π_j⁺)ᵀ Π_iᵀ B_i (aggregation.mosaic.cca_projections, align_b).
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
import os
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fs_plugins.aggregation.mosaic import align_a, align_b, cca_projections
from fs_plugins.data.public import public_records
from fs_plugins.errors import ConfigError
from fs_plugins.tuners.mosaic.layer import MosaicLinear

logger = logging.getLogger(__name__)


def model_digest(model: torch.nn.Module) -> str:
    """sha256 of a model's base config and frozen base weights (adapters left out); where the
    model was loaded from does not count."""
    base = model.get_base_model() if hasattr(model, 'get_base_model') else model
    config = {k: v for k, v in base.config.to_dict().items() if k != '_name_or_path'}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in base.named_parameters():
        if 'lora_' in name or '.mosaic.' in name:
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
    from fs_plugins.models.codecs import EncodedDataset
    dataset = EncodedDataset(records, codec, 'FedMosaic alignment public data')
    items = [dataset[i] for i in range(len(dataset))]
    for start in range(0, len(items), batch_size):
        batch = codec.collate(items[start:start + batch_size])
        batch.pop('labels', None)
        yield batch


@torch.no_grad()
def layer_inputs(model, pq_layers: dict[str, str], codec, records: list[dict],
                 batch_size: int = 8) -> tuple[dict[str, list[torch.Tensor]], list[torch.Tensor]]:
    """Runs the frozen base (adapters disabled) on `records`; returns, per PQ key, one
    (tokens, d_in) float32 tensor per record (its non-padding tokens' inputs to the layer),
    and each record's input ids (to tell whether two models tokenise alike)."""
    modules = dict(model.named_modules())
    captured: dict[str, list[torch.Tensor]] = {key: [] for key in pq_layers.values()}
    current: dict[str, torch.Tensor] = {}
    handles = [modules[name].register_forward_hook(
        lambda _m, args, _out, key=key: current.__setitem__(key, args[0].detach()))
        for name, key in pq_layers.items()]
    ids_per_record: list[torch.Tensor] = []
    device = next(model.parameters()).device
    was_training = model.training
    # peft's disable_adapter() re-enables adapters on exit with set_adapter(), which makes
    # every LoRA weight trainable again, PQ-LoRA's frozen A, B included: restore the flags
    requires_grad = {param: param.requires_grad for param in model.parameters()}
    model.eval()
    try:
        with model.disable_adapter():
            for batch in _batches(codec, records, batch_size):
                batch = {k: v.to(device) for k, v in batch.items()}
                model(**batch)
                mask = batch['attention_mask'].bool()
                for row in range(mask.shape[0]):
                    ids_per_record.append(batch['input_ids'][row][mask[row]].cpu())
                for key, value in current.items():
                    if value.shape[:2] != mask.shape:
                        raise ValueError(f'FedMosaic alignment: the input of PQ layer {key} has '
                                         f'shape {tuple(value.shape)}, expected (batch, tokens) '
                                         f'= {tuple(mask.shape)} first')
                    captured[key] += [value[row][mask[row]].float().cpu()
                                      for row in range(mask.shape[0])]
                current.clear()
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
        for param, flag in requires_grad.items():
            param.requires_grad_(flag)
    return captured, ids_per_record


def paired_features(pivot: list[torch.Tensor], other: list[torch.Tensor],
                    per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, d_i), (m, d_j) rows of matching samples: tokens when per_token, else record means."""
    if per_token:
        return torch.cat(pivot), torch.cat(other)
    return (torch.stack([t.mean(dim=0) for t in pivot]),
            torch.stack([t.mean(dim=0) for t in other]))


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


def compute_alignment(pivot_inputs: dict[str, list[torch.Tensor]],
                      other_inputs: dict[str, list[torch.Tensor]],
                      pivot_factors: dict, other_factors: dict, per_token: bool,
                      reg: float, steps: int, lr: float) -> tuple[dict, dict]:
    """{pq key: (aligned A_j, aligned B_j)} and per key the A objective before / after."""
    from fs_plugins.aggregation.mosaic import a_alignment_loss
    aligned, report = {}, {}
    for key in sorted(pivot_factors):
        a_i, b_i = pivot_factors[key]
        a_j, b_j = other_factors[key]
        x_i, x_j = paired_features(pivot_inputs[key], other_inputs[key], per_token)
        target = x_i @ a_i.T
        new_a = align_a(target, x_j, a_j, reg=reg, steps=steps, lr=lr)
        h_i = target @ b_i.T
        h_j = (x_j @ new_a.T) @ b_j.T
        pi_i, pi_j = cca_projections(h_i, h_j, a_i.shape[0])
        new_b = align_b(b_i, pi_i, pi_j)
        aligned[key] = (new_a, new_b)
        report[key] = (float(a_alignment_loss(target, x_j, a_j, reg)),
                       float(a_alignment_loss(target, x_j, new_a, reg)))
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
    from fs_plugins.models.cache import cache_dir
    return os.path.join(cache_dir(), 'fedmosaic_alignment')


@dataclass
class Pivot:
    """What aligning to the pivot needs: its digest, PQ factors and codec always; its model
    (`built`, else `build()`) only when an alignment is computed rather than read."""
    digest: str
    factors: dict
    codec: object
    build: Callable[[], object]           # -> BuiltModel of the pivot
    built: Optional[object] = None

    @classmethod
    def of(cls, built, build) -> 'Pivot':
        return cls(model_digest(built.model), lora_factors(built.model, built.model.fedmosaic_pq),
                   built.codec, build, built)

    def model(self):
        if self.built is None:
            self.built = self.build()
        return self.built

    def release(self) -> None:
        """Frees the pivot's model; digest, factors and codec stay."""
        self.built = None


def align_to_pivot(model, codec, cfg, pivot: Pivot, pivot_cfg, hp) -> str:
    """Aligns `model`'s PQ-LoRA A, B to those of the pivot built from `pivot_cfg`
    (Algorithms 3-4), from the cache when the same alignment was computed before; returns the
    cache file."""
    name = f"model.type '{cfg.model.type}'"
    pivot_factors = pivot.factors
    other_factors = lora_factors(model, model.fedmosaic_pq)
    r = rank_of(other_factors)
    check_pairing(pivot_factors, other_factors, rank_of(pivot_factors), r, name)
    settings = {'seed': int(cfg.seed), 'blocks': hp.num_blocks, 'placement': hp.placement,
                'targets': sorted(cfg.fsplug.model.lora.target_modules),
                'data': hp.alignment_data or str(cfg.data.type), 'samples': hp.alignment_samples,
                'reg': hp.alignment_reg, 'steps': hp.alignment_steps, 'lr': hp.alignment_lr}
    path = alignment_path(hp.alignment_dir or default_folder(), pivot.digest,
                          model_digest(model), r, settings)
    if os.path.isfile(path):
        apply_alignment(model, model.fedmosaic_pq, load_alignment(path))
        logger.info(f'FedMosaic: {name} aligned to the pivot from {path}')
        return path
    if hp.alignment == 'require':
        raise ConfigError(f"FedMosaic: {name} has no alignment to the pivot "
                          f"'{pivot_cfg.model.type}' (r={r}) in {os.path.dirname(path)} and "
                          f"fsplug.fedmosaic.alignment = 'require'; run once with 'compute'")
    records = public_records(hp.alignment_data, cfg, hp.alignment_samples,
                             derive_alignment_seed(cfg.seed), 'fsplug.fedmosaic.alignment_data')
    pivot_model = pivot.model().model
    pivot_inputs, pivot_ids = layer_inputs(pivot_model, pivot_model.fedmosaic_pq, pivot.codec,
                                           records)
    other_inputs, other_ids = layer_inputs(model, model.fedmosaic_pq, codec, records)
    per_token = len(pivot_ids) == len(other_ids) and all(
        a.shape == b.shape and bool((a == b).all()) for a, b in zip(pivot_ids, other_ids))
    aligned, report = compute_alignment(pivot_inputs, other_inputs, pivot_factors, other_factors,
                                        per_token, hp.alignment_reg, hp.alignment_steps,
                                        hp.alignment_lr)
    apply_alignment(model, model.fedmosaic_pq, aligned)
    save_alignment(path, aligned, {'pivot': pivot_cfg.model.type, 'model': cfg.model.type, 'r': r,
                                   'per_token': per_token, **settings})
    before = sum(b for b, _ in report.values()) / len(report)
    after = sum(a for _, a in report.values()) / len(report)
    logger.info(f"FedMosaic: aligned {name} to the pivot '{pivot_cfg.model.type}' on "
                f"{len(records)} public records ({'per token' if per_token else 'per record'}): "
                f"mean A objective {before:.4g} -> {after:.4g}; saved {path}")
    return path


def derive_alignment_seed(seed: int) -> int:
    from fs_plugins.seeding import derive_seed
    return derive_seed(seed, 'fedmosaic-public-data')

"""UniBind's checkpoints (Lyu et al., CVPR 2024, "UniBind: LLM-Augmented Unified and Balanced
Representation Space to Bind Them All") read into ImageBind's layout, and UniBind's embedding.
UniFLoW Appendix E.7 / Table 13 swaps ImageBind for UniBind as the multimodal encoder.

What a UniBind checkpoint is (the official code, QC-LY/UniBind: model.py, train.py, demo_for_*.py;
its backbone is Point-Bind's, ZiyuGuo99/Point-Bind_Point-LLM: models/PointBind_models.py,
imagebind/imagebind_model.py):
- `ckpts/pretrained_weights.pt`, loaded strictly into Point-Bind's POINTBIND model: the whole
  ImageBind-huge under `bind.` (Point-Bind's copy of ImageBindModel, same module names as Meta's,
  plus a point-cloud head `bind.modality_head_point.*` / `bind.modality_postprocessor_point.*`),
  the point encoder `point_encoder.*`, `pc_projection` and `logit_scale`. A full state dict, not
  LoRA or adapter deltas.
- `<modality>_model_best.pt` (train.py's output): the UniBind module's state dict, that is the
  above under `backbone.` and one trained head `mlp_for_<modality>` (nn.Linear(1024, 1024); the
  backbone stays frozen in UniBind's training, only this head learns to align the modality's
  embeddings with the LLM-augmented class-centre embeddings).
The embedding UniBind gives for an image or an audio clip (model.py `encode_vision` /
`encode_vision_with_mlp`): ImageBind's own output for that modality (trunk, head, postprocessor:
normalised, audio scaled by 20 and its clips averaged), then the modality's `mlp_for_<modality>`
where the checkpoint has one, then divided by its L2 norm.

The choices. Paper's (UniBind's code): the architecture (ImageBind-huge; the point branch is
not loaded since UniFLoW encodes images and audio), the inputs (UniBind's
utils/data_transform.py is ImageBind's load_and_transform_{vision,audio}_data), the head and
the final normalisation. Ours, where UniBind is silent about use as an LLM's encoder: the head
is applied exactly when the checkpoint carries it (pretrained_weights.pt -> `encode_vision`, the
demos' and zero-shot path; a fine-tuned checkpoint -> `encode_vision_with_mlp`, the path its
evaluation uses), and a fine-tuned checkpoint of another modality is refused rather than read
without its head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling

from fs_plugins.core.errors import ConfigError

PRETRAINED_PREFIX = 'bind.'                 # ckpts/pretrained_weights.pt (Point-Bind's POINTBIND)
FINE_TUNED_PREFIX = 'backbone.bind.'        # train.py's <modality>_model_best.pt (UniBind)
# Point-Bind's additions to ImageBindModel (the point-cloud head), not in Meta's ImageBindModel
POINT_HEAD_KEYS = ('modality_head_point.', 'modality_postprocessor_point.')
SHOWN_KEYS = 5


def head_prefix(modality: str) -> str:
    """UniBind's per-modality head in a fine-tuned checkpoint (model.py: mlp_for_image, ...)."""
    return f'mlp_for_{modality}.'


@dataclass
class UniBindWeights:
    """One modality's share of a UniBind checkpoint: the ImageBind state dict (ImageBindModel's
    key names) and the head's (`weight`, `bias`; None for pretrained_weights.pt)."""
    imagebind: dict[str, torch.Tensor]
    head: dict[str, torch.Tensor] | None
    prefix: str


def _shown(keys) -> str:
    keys = sorted(keys)
    more = f' ... ({len(keys)} in all)' if len(keys) > SHOWN_KEYS else ''
    return ', '.join(keys[:SHOWN_KEYS]) + more


def split_unibind_checkpoint(state: dict, modality: str, where: str) -> UniBindWeights:
    """`state` (a UniBind checkpoint) -> the ImageBind weights and this modality's head.
    `where`: the config key and file, for errors."""
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise ConfigError(f'{where}: not a UniBind checkpoint (a state dict of named tensors); '
                          f'got {type(state).__name__}')
    fine_tuned = any(k.startswith(FINE_TUNED_PREFIX) for k in state)
    if not fine_tuned and not any(k.startswith(PRETRAINED_PREFIX) for k in state):
        raise ConfigError(f"{where}: not a UniBind checkpoint: no key starts with "
                          f"'{PRETRAINED_PREFIX}' (ckpts/pretrained_weights.pt) or "
                          f"'{FINE_TUNED_PREFIX}' (train.py's <modality>_model_best.pt); "
                          f'its keys: {_shown(state)}')
    prefix = FINE_TUNED_PREFIX if fine_tuned else PRETRAINED_PREFIX
    imagebind = {k[len(prefix):]: v for k, v in state.items()
                 if k.startswith(prefix) and not k[len(prefix):].startswith(POINT_HEAD_KEYS)}
    return UniBindWeights(imagebind, _head(state, modality, where) if fine_tuned else None, prefix)


def _head(state: dict, modality: str, where: str) -> dict[str, torch.Tensor]:
    own = head_prefix(modality)
    head = {k[len(own):]: v for k, v in state.items() if k.startswith(own)}
    if not head:
        others = sorted({k.split('.', 1)[0] for k in state if k.startswith('mlp_for_')})
        raise ConfigError(f"{where}: a fine-tuned UniBind checkpoint ('{FINE_TUNED_PREFIX}*' keys) "
                          f"without '{own}weight' (UniBind's {modality} head; it has "
                          f"{others or 'no head'}): use the {modality} model's checkpoint or "
                          'ckpts/pretrained_weights.pt')
    return head


def load_exactly(module: torch.nn.Module, state: dict[str, torch.Tensor], prefix: str,
                 where: str) -> None:
    """module.load_state_dict(state), every key and shape checked first; an error names the
    checkpoint's keys (with `prefix`) that are missing, unexpected or of another shape."""
    expected = module.state_dict()
    problems = []
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing:
        problems.append(f'{where}: missing {_shown(prefix + k for k in missing)}')
    if unexpected:
        problems.append(f'{where}: unexpected {_shown(prefix + k for k in unexpected)}')
    problems += [f'{where}: {prefix}{k} has shape {tuple(state[k].shape)}, the model '
                 f'{tuple(expected[k].shape)}'
                 for k in sorted(expected.keys() & state.keys())
                 if state[k].shape != expected[k].shape][:SHOWN_KEYS]
    if problems:
        raise ConfigError(problems)
    module.load_state_dict(state)


def unibind_head(weights: UniBindWeights, modality: str, width: int,
                 where: str) -> torch.nn.Linear | None:
    """UniBind's `mlp_for_<modality>` (Linear(width, width)) from the checkpoint, or None."""
    if weights.head is None:
        return None
    head = torch.nn.Linear(width, width)
    load_exactly(head, weights.head, head_prefix(modality), where)
    return head


class UniBindEmbedding(torch.nn.Module):
    """UniBind's embedding of one modality: ImageBind's (`imagebind`: inputs -> (n, 1, out)),
    UniBind's head where there is one, then L2-normalised (model.py encode_vision[_with_mlp])."""

    def __init__(self, imagebind: torch.nn.Module, head: torch.nn.Linear | None):
        super().__init__()
        self.imagebind = imagebind
        self.head = head if head is not None else torch.nn.Identity()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.head(self.imagebind(inputs)), dim=-1)

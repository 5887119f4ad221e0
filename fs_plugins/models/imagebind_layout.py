"""ImageBind's transformer trunks with attention LoRA that trains, a tiny random model of
ImageBind's layout, and the encoder-LoRA size at ImageBind-huge's widths (UniFLoW Table 6).

The problem. ImageBind's blocks (facebookresearch/ImageBind, imagebind/models/transformer.py,
`BlockWithMasking`) hold `attn`, a subclass of torch.nn.MultiheadAttention called as
`attn(x, attn_mask)` on sequence-first (L, N, D) tokens and returning the output alone, and
`mlp.fc1` / `mlp.fc2` (nn.Linear). nn.MultiheadAttention hands `in_proj_weight` and
`out_proj.weight` to F.multi_head_attention_forward: the `out_proj` module's forward never runs,
so a peft LoRA wrapped around `out_proj` is outside the computation and never gets a gradient
(fs_plugins.models.target_check refuses such targets when the model is built).

The choice: a small wrapper, not peft's own MultiheadAttention LoRA. `expose_attention` swaps
each such attention module for `SelfAttention`, which holds the same parameter objects under the
same names (`in_proj_weight`, `in_proj_bias`, `bias_k`, `bias_v`, `out_proj.weight`,
`out_proj.bias`: checkpoints and the clients' shared frozen tensors are unchanged) and computes
the same function (F.multi_head_attention_forward's steps: packed input projection, the key /
value biases, masks, scaled dot-product attention), but calls `out_proj` as a module; so
`out_proj`, like `fc1` and `fc2`, takes an ordinary peft LoRA (Linear). peft's
`lora.layer.MultiheadAttention` (targeted by naming `attn`) is not used because (1) it always
puts LoRA on in_proj and out_proj together (15.7M parameters on the huge vision trunk at r = 64,
not Table 6's 6M); (2) it merges the LoRA delta into the frozen weights before every forward and
subtracts it after, replacing the weight Parameters: in bfloat16 the frozen weights drift by the
rounding of each merge (about 2e-3 after ten forwards of a 16-wide toy layer), and the clients of
one process stop sharing their frozen tensors; (3) it calls the wrapped module and reads its
result as (output, weights): ImageBind's subclass returns the output alone, so it would silently
get the first two sequence positions.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling

# ImageBind-huge's trunks (imagebind/models/imagebind_model.py: imagebind_huge and the
# ImageBindModel defaults, mlp_ratio 4 in SimpleTransformer); the text, depth, thermal and IMU
# trunks are not UniFLoW's encoders
IMAGEBIND_HUGE_TRUNKS = {'vision': {'width': 1280, 'blocks': 32, 'heads': 16, 'mlp': 5120},
                         'audio': {'width': 768, 'blocks': 12, 'heads': 12, 'mlp': 3072}}


def trunk_linear_shapes(width: int, mlp: int) -> dict[str, tuple[int, int]]:
    """(in, out) of the Linear modules of one ImageBind block that LoRA can take (the packed
    in_proj is a Parameter, not a module)."""
    return {'out_proj': (width, width), 'fc1': (width, mlp), 'fc2': (mlp, width)}


def trunk_lora_parameters(targets, r: int, trunks: dict | None = None) -> dict[str, int]:
    """LoRA parameters (A: r × in, B: out × r) on `targets` in every block of each trunk of
    `trunks` (default ImageBind-huge's vision and audio trunks): trunk -> count."""
    counts = {}
    for name, trunk in (trunks or IMAGEBIND_HUGE_TRUNKS).items():
        shapes = trunk_linear_shapes(trunk['width'], trunk['mlp'])
        unknown = sorted(set(targets) - set(shapes))
        if unknown:
            raise ValueError(f'{unknown}: not a Linear of an ImageBind block ({sorted(shapes)})')
        counts[name] = trunk['blocks'] * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)
    return counts


# ------------------------------------------------------------------ attention with out_proj called
class SelfAttention(torch.nn.Module):
    """An nn.MultiheadAttention's self-attention, called as ImageBind calls its attention
    (`forward(x, attn_mask)` -> output), on the same parameters, with `out_proj` called as a
    module (so a LoRA on it trains)."""

    def __init__(self, attention: torch.nn.MultiheadAttention):
        super().__init__()
        if not attention._qkv_same_embed_dim:
            raise ValueError('SelfAttention needs query, key and value of the embedding width '
                             '(one packed in_proj_weight)')
        self.embed_dim, self.num_heads = attention.embed_dim, attention.num_heads
        self.dropout, self.batch_first = attention.dropout, attention.batch_first
        self.add_zero_attn = attention.add_zero_attn
        self.in_proj_weight = attention.in_proj_weight
        self.register_parameter('in_proj_bias', attention.in_proj_bias)
        self.register_parameter('bias_k', attention.bias_k)
        self.register_parameter('bias_v', attention.bias_v)
        self.out_proj = attention.out_proj

    def _additive_mask(self, mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
        """MultiheadAttention's attn_mask ((L, S) or (N·heads, L, S); bool: True = blocked) as an
        additive float mask of shape (1, L, S) or (N·heads, L, S)."""
        if mask is None:
            return None
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float('-inf'))
        return mask.to(dtype).unsqueeze(0) if mask.dim() == 2 else mask.to(dtype)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.batch_first:
            x = x.transpose(0, 1)
        length, batch, width = x.shape
        heads = self.num_heads
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        mask = self._additive_mask(attn_mask, q.dtype)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(1, batch, width)])
            v = torch.cat([v, self.bias_v.expand(1, batch, width)])
            mask = F.pad(mask, (0, 1)) if mask is not None else None
        # (seq, N, D) -> (N·heads, seq, head_dim), as F.multi_head_attention_forward lays it out
        q, k, v = (t.reshape(t.shape[0], batch * heads, -1).transpose(0, 1) for t in (q, k, v))
        if self.add_zero_attn:
            zeros = k.new_zeros(batch * heads, 1, k.shape[-1])
            k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
            mask = F.pad(mask, (0, 1)) if mask is not None else None
        source = k.shape[1]
        if mask is not None:
            mask = mask.unsqueeze(0) if mask.shape[0] == 1 else mask.view(batch, heads, -1, source)
        q, k, v = (t.view(batch, heads, t.shape[1], -1) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             dropout_p=self.dropout if self.training else 0.0)
        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(length, batch, width))
        return out.transpose(0, 1) if self.batch_first else out


def _called_like_imagebind(module: torch.nn.Module) -> bool:
    """A MultiheadAttention subclass called as `attn(x, attn_mask)` (ImageBind's)."""
    forward = type(module).forward
    if forward is torch.nn.MultiheadAttention.forward:
        return False
    return list(inspect.signature(forward).parameters)[1:3] == ['x', 'attn_mask']


def expose_attention(root: torch.nn.Module) -> list[str]:
    """Swaps every ImageBind-style attention (a MultiheadAttention subclass called as
    `attn(x, attn_mask)`) under `root` for a `SelfAttention` on the same parameters; plain
    MultiheadAttention modules (called with query, key, value) are left as they are. Returns the
    names swapped."""
    swapped = []
    for name, module in list(root.named_modules()):
        if isinstance(module, torch.nn.MultiheadAttention) and _called_like_imagebind(module):
            parent_name, _, child = name.rpartition('.')
            setattr(root.get_submodule(parent_name) if parent_name else root, child,
                    SelfAttention(module))
            swapped.append(name)
    return swapped


# ------------------------------------------------------------------ a tiny model of ImageBind's layout
class ImageBindStyleAttention(torch.nn.MultiheadAttention):
    """Self-attention called as ImageBind's blocks call theirs: `attn(x, attn_mask)` on
    sequence-first tokens, returning the output alone."""

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, x, x, need_weights=False, attn_mask=attn_mask)[0]


class Mlp(torch.nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = (torch.nn.Linear(width, hidden), torch.nn.GELU(),
                                        torch.nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(torch.nn.Module):
    """A pre-norm block laid out as ImageBind's: norm_1, attn, norm_2, mlp.fc1 / mlp.fc2."""

    def __init__(self, width: int, heads: int, mlp: int, add_bias_kv: bool):
        super().__init__()
        self.attn = ImageBindStyleAttention(width, heads, bias=True, add_bias_kv=add_bias_kv)
        self.norm_1 = torch.nn.LayerNorm(width, eps=1e-6)
        self.mlp = Mlp(width, mlp)
        self.norm_2 = torch.nn.LayerNorm(width, eps=1e-6)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), attn_mask)
        return x + self.mlp(self.norm_2(x))


class SeqFirst(torch.nn.Module):
    """(N, L, D) <-> (L, N, D), as ImageBind's EinOpsRearrange around its trunks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)


class Trunk(torch.nn.Module):
    """ImageBind's SimpleTransformer layout: pre_transformer_layer (LayerNorm or identity, then
    sequence-first), `blocks`, post_transformer_layer (batch-first again)."""

    def __init__(self, width: int, blocks: int, heads: int, mlp: int, pre_norm: bool,
                 add_bias_kv: bool):
        super().__init__()
        self.pre_transformer_layer = torch.nn.Sequential(
            torch.nn.LayerNorm(width, eps=1e-6) if pre_norm else torch.nn.Identity(), SeqFirst())
        self.blocks = torch.nn.Sequential(*[Block(width, heads, mlp, add_bias_kv) for _ in range(blocks)])
        self.post_transformer_layer = SeqFirst()

    def forward(self, tokens: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        tokens = self.pre_transformer_layer(tokens)
        for block in self.blocks:
            tokens = block(tokens, attn_mask=attn_mask)
        return self.post_transformer_layer(tokens)


class PatchPreprocessor(torch.nn.Module):
    """Patches (a strided convolution) + a class token + learned positions, returning ImageBind's
    preprocessor output {'trunk': {'tokens': ...}, 'head': {}} (ImageBind's own preprocessors
    are richer: video padding, fixed sin-cos positions; the trunk is what LoRA concerns)."""

    def __init__(self, key: str, channels: int, width: int, kernel: int, stride: int, patches: int):
        super().__init__()
        self.key = key
        self.patch = torch.nn.Conv2d(channels, width, kernel, stride=stride, bias=False)
        self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = torch.nn.Parameter(torch.randn(1, patches + 1, width) * 0.02)

    def forward(self, **inputs) -> dict:
        tokens = self.patch(inputs[self.key]).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1)
        return {'trunk': {'tokens': tokens + self.pos_embed}, 'head': {}}


class SelectFirst(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0]


class Normalize(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1)


@dataclass(frozen=True)
class TrunkSize:
    width: int
    blocks: int
    heads: int
    mlp: int


# image: 32 × 32 pixels in 8 × 8 patches; audio: 80 mel bins in 16 × 16 patches, stride 10
TINY_IMAGEBIND = {'vision': TrunkSize(32, 2, 2, 64), 'audio': TrunkSize(32, 2, 2, 64)}
TINY_IMAGE_SIZE, TINY_MEL_BINS, TINY_OUT = 32, 80, 32


class ImageBindLayout(torch.nn.Module):
    """The four per-modality dicts ImageBindModel holds (modality_preprocessors,
    modality_trunks, modality_heads, modality_postprocessors) for the vision and audio
    modalities, with ImageBind's trunk layout: vision trunk with a pre-norm, audio trunk with
    key / value biases (add_bias_kv), head LayerNorm -> class token -> Linear, normalised
    output."""

    def __init__(self, sizes: dict[str, TrunkSize], out_dim: int, audio_frames: int,
                 image_size: int = TINY_IMAGE_SIZE, mel_bins: int = TINY_MEL_BINS):
        super().__init__()
        vision, audio = sizes['vision'], sizes['audio']
        audio_patches = ((mel_bins - 16) // 10 + 1) * ((audio_frames - 16) // 10 + 1)
        self.modality_preprocessors = torch.nn.ModuleDict({
            'vision': PatchPreprocessor('vision', 3, vision.width, 8, 8, (image_size // 8) ** 2),
            'audio': PatchPreprocessor('audio', 1, audio.width, 16, 10, audio_patches)})
        self.modality_trunks = torch.nn.ModuleDict({
            'vision': Trunk(vision.width, vision.blocks, vision.heads, vision.mlp, True, False),
            'audio': Trunk(audio.width, audio.blocks, audio.heads, audio.mlp, False, True)})
        self.modality_heads = torch.nn.ModuleDict({
            key: torch.nn.Sequential(torch.nn.LayerNorm(size.width, eps=1e-6), SelectFirst(),
                                     torch.nn.Linear(size.width, out_dim, bias=False))
            for key, size in sizes.items()})
        self.modality_postprocessors = torch.nn.ModuleDict({key: Normalize() for key in sizes})


def tiny_imagebind(audio_frames: int, seed: int = 1234) -> ImageBindLayout:
    """A random tiny model of ImageBind's layout (its trunks' module names and attention
    calls), for tests and the wiring audit: no ImageBind weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ImageBindLayout(TINY_IMAGEBIND, TINY_OUT, audio_frames)

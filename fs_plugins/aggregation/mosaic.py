"""FedMosaic's aggregation and alignment maths, as pure functions over tensors.

RELA (relevance-guided aggregation, paper §4.1): each client keeps an EMA of a frozen small
model's last-layer gradient (:func:`ema_update`, Eq. 2), sends a noisy, subsampled copy
(:func:`shared_mask`, :func:`sanitise_gradient`, Eq. 3), and the server turns the cosine
similarities of those into per-client aggregation weights (:func:`rela_weights`, Eq. 4).

PQ-LoRA (§4.2, A.5): PQ-LoRA sits at the last layer of each of N_B blocks
(:func:`pq_block_layers`, Eq. 6 / Algorithm 2). Its frozen A (r × d_in) and B (d_out × r) start
orthonormal (:func:`orthonormal_rows`, :func:`orthonormal_columns`, Eq. 18). Before training,
the A of a non-pivot model is fitted to the pivot's A outputs on public data (:func:`align_a`,
Eq. 20) and projected back to orthonormal rows (:func:`nearest_orthonormal_rows`, Eqs. 21-23);
its B is mapped through the CCA space of the two models' B outputs (:func:`cca_projections`,
:func:`align_b`, §4.2.2).

Small matrix work (SVD, QR, eigh, cosines) is done in float64. Results are float32, or float64
when an input is float64, unless a function says otherwise. Inputs are never modified.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = [
    'pq_block_layers', 'rela_weights', 'uniform_weights', 'shared_mask', 'sanitise_gradient', 'ema_update',
    'orthonormal_rows', 'orthonormal_columns', 'nearest_orthonormal_rows', 'align_a',
    'AlignmentMoments', 'a_alignment_loss_from_moments', 'align_a_from_moments',
    'a_alignment_loss', 'cca_projections', 'cca_from_covariances', 'b_output_cca',
    'canonical_correlations', 'align_b', 'cosine_learning_rate', 'MiniBatchAlignment',
    'customised_globals', 'fake_quantise', 'NF4_LEVELS',
]


def _result_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_matrix(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f'{name} must be a 2-D tensor, got {shape}')


# --------------------------------------------------------------------------------------------
# PQ-LoRA placement
# --------------------------------------------------------------------------------------------

def pq_block_layers(num_layers: int, num_blocks: int, rule: str = 'equation') -> list[int]:
    """1-based indices of the layers that carry PQ-LoRA: the last layer of each of N_B blocks.

    rule='equation' (Eq. 6): I_k = k·⌊L/N_B⌋ for k < N_B and I_{N_B} = L, so the last block
    absorbs the L mod N_B leftover layers. rule='algorithm' (Algorithm 2): the layers
    l = n·⌊L/N_B⌋ + (L mod N_B), n = 1..N_B, so the first block absorbs them. Both agree when
    N_B divides L; both end at layer L.
    """
    if num_layers < 1:
        raise ValueError(f'num_layers must be >= 1, got {num_layers}')
    if not 1 <= num_blocks <= num_layers:
        raise ValueError(f'num_blocks must be in [1, num_layers={num_layers}], got {num_blocks}')
    size, leftover = divmod(num_layers, num_blocks)
    if rule == 'equation':
        return [k * size for k in range(1, num_blocks)] + [num_layers]
    if rule == 'algorithm':
        return [n * size + leftover for n in range(1, num_blocks + 1)]
    raise ValueError(f"rule must be 'equation' or 'algorithm', got {rule!r}")


# --------------------------------------------------------------------------------------------
# RELA
# --------------------------------------------------------------------------------------------

def ema_update(previous: torch.Tensor | None, current: torch.Tensor, ratio: float) -> torch.Tensor:
    """Decayed gradient ĝ(t) = (1 − α)·ĝ(t−1) + α·g(t) (Eq. 2). previous=None is ĝ(0) = 0,
    as Algorithm 1 initialises it, giving α·g(t)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f'ratio (the EMA α) must be in [0, 1], got {ratio}')
    if previous is None:
        return ratio * current
    if previous.shape != current.shape:
        raise ValueError(f'previous has shape {tuple(previous.shape)} but current has shape '
                         f'{tuple(current.shape)}')
    return (1.0 - ratio) * previous + ratio * current


def kept_coordinates(dim: int, keep_fraction: float) -> int:
    """How many of a gradient's `dim` coordinates the mask keeps: round(N_s·dim), at least 1."""
    return max(1, round(keep_fraction * dim))


def shared_mask(dim: int, keep_fraction: float, seed: int) -> torch.Tensor:
    """The subsampling mask M of Eq. 3: a bool vector of length dim with round(N_s·dim) (at
    least 1) True entries at positions drawn from a generator seeded with seed. Every client
    must compare the same coordinates, so all of them call this with the same seed
    (Algorithm 1 draws `subsample_index` once, before training)."""
    if dim < 1:
        raise ValueError(f'dim must be >= 1, got {dim}')
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f'keep_fraction must be in (0, 1], got {keep_fraction}')
    count = kept_coordinates(dim, keep_fraction)
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(dim, dtype=torch.bool)
    mask[torch.randperm(dim, generator=generator)[:count]] = True
    return mask


def sanitise_gradient(ema_grad: torch.Tensor, mask: torch.Tensor, noise_scale: float,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Sanitised gradient g̃ = M ⊙ (ĝ + μ·ε), ε ~ N(0, I) (Eq. 3), returning only the kept
    coordinates ĝ[M] + μ·ε[M], which is what a client sends. Only the kept coordinates' noise
    is drawn (the rest would be masked away; the same distribution as Algorithm 1's
    eps[subsample_index]), with generator (the global RNG when None); noise_scale=0 returns
    ĝ[M] exactly."""
    if mask.dtype != torch.bool:
        raise ValueError(f'mask must be a bool tensor, got {mask.dtype}')
    if mask.shape != ema_grad.shape:
        raise ValueError(f'ema_grad has shape {tuple(ema_grad.shape)} but mask has shape '
                         f'{tuple(mask.shape)}')
    if noise_scale < 0:
        raise ValueError(f'noise_scale must be >= 0, got {noise_scale}')
    if noise_scale == 0:
        return ema_grad[mask].clone()
    kept = ema_grad[mask]
    noise = torch.randn(kept.shape, generator=generator, dtype=kept.dtype, device=kept.device)
    return kept + noise_scale * noise


# QLoRA's NormalFloat-4 code book (Dettmers et al., 2023, Appendix E; bitsandbytes' nf4 values)
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
              -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
              0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
              0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
NF4_BLOCK = 64          # QLoRA / bitsandbytes' 4-bit block size
QUANTISATION_MODES = ('none', '8bit', '4bit')


def fake_quantise(weight: torch.Tensor, mode: str) -> torch.Tensor:
    """The weight a k-bit quantised copy of `weight` computes with (quantised, then
    dequantised), as bitsandbytes stores it for `fsplug.model.quantization`'s modes:
    '8bit': LLM.int8's weight quantisation, one absmax scale per output row,
    round(127 · w / absmax_row) / 127 · absmax_row; '4bit': NF4, blocks of 64 consecutive
    values (row-major) scaled by their absmax, each value replaced by the nearest NF4 level;
    'none': `weight` itself. Returns the input's dtype and shape; all-zero rows / blocks stay 0."""
    if mode == 'none':
        return weight
    if mode not in QUANTISATION_MODES:
        raise ValueError(f'mode must be one of {QUANTISATION_MODES}, got {mode!r}')
    _check_matrix('weight', weight)
    w = weight.detach().double()
    if mode == '8bit':
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
        return (torch.round(w / scale * 127) / 127 * scale).to(weight.dtype)
    flat = w.flatten()
    pad = (-flat.numel()) % NF4_BLOCK
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, NF4_BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float64)
    nearest = (blocks / scale).unsqueeze(-1).sub(levels).abs().argmin(dim=-1)
    out = (levels[nearest] * scale).flatten()[:flat.numel()]
    return out.view(weight.shape).to(weight.dtype)


def _cosine_matrix(vectors: torch.Tensor) -> torch.Tensor:
    """S_ij = cos(v_i, v_j) in float64; a zero vector has cosine 0 with everything."""
    v = vectors.detach().to(torch.float64)
    norms = v.norm(dim=1, keepdim=True)
    unit = torch.where(norms > 0, v / norms.clamp_min(torch.finfo(v.dtype).tiny), 0.0)
    return (unit @ unit.T).clamp(-1.0, 1.0)


def rela_weights(grads: torch.Tensor, tau: float = 0.5, include_self: bool = True) -> torch.Tensor:
    """RELA aggregation weights w_ij = softmax_j(cos(g̃_i, g̃_j) / τ) (Eq. 4), an (N, N) float32
    matrix whose rows sum to 1; client i's global module is G_i = Σ_j w_ij L_j.

    grads is (N, d): one sanitised gradient per client. A zero gradient has cosine 0 with every
    client (itself included), so its row is a softmax over zeros, never NaN.

    include_self=True is Eq. 4 as written (n runs over all N clients). include_self=False drops
    j = i from each row (the public reference code's reading); a lone client (N = 1) then still
    keeps itself, w = [[1.0]], since there is nothing else to aggregate.
    """
    _check_matrix('grads', grads)
    num_clients = grads.shape[0]
    if num_clients < 1:
        raise ValueError('grads has no clients (shape (0, d))')
    if not tau > 0:
        raise ValueError(f'tau must be > 0, got {tau}')
    logits = _cosine_matrix(grads) / tau
    if not include_self and num_clients > 1:
        logits.fill_diagonal_(float('-inf'))
    return torch.softmax(logits, dim=1).to(torch.float32)


def uniform_weights(num_clients: int, include_self: bool = True) -> torch.Tensor:
    """Equal aggregation weights, the ablation without RELA (Table 7 '(+) PQ-LoRA', Table 30
    'Equal-weight aggregation'): w_ij = 1/N, or 1/(N − 1) over j ≠ i when include_self is
    False (a lone client keeps itself)."""
    if num_clients < 1:
        raise ValueError(f'num_clients must be >= 1, got {num_clients}')
    weights = torch.ones(num_clients, num_clients, dtype=torch.float64)
    if not include_self and num_clients > 1:
        weights.fill_diagonal_(0.0)
    return (weights / weights.sum(dim=1, keepdim=True)).to(torch.float32)


def customised_globals(local_modules: list[dict[str, torch.Tensor]], weights: torch.Tensor,
                       architectures: list, shared_across: Callable[[str], bool]
                       ) -> list[dict[str, torch.Tensor]]:
    """RELA's customised global module per client (Eq. 4): G_i = Σ_j w_ij L_j.

    local_modules[j]: client j's uploaded tensors by name; weights: (N × N) rows from
    :func:`rela_weights`; architectures[j]: client j's model type. A tensor for which
    `shared_across(name)` holds (PQ-LoRA's P and Q, named by block, not by layer) is mixed over
    every client that sent it; any other tensor only over the clients of client i's
    architecture. In both cases row i's weights are renormalised over the clients that take
    part, so a client whose architecture is alone keeps its own conventional LoRA."""
    count = len(local_modules)
    if weights.shape != (count, count) or len(architectures) != count:
        raise ValueError(f'customised_globals: {count} clients, weights {tuple(weights.shape)}, '
                         f'{len(architectures)} architectures')
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
    names = dict.fromkeys(name for module in local_modules for name in module)
    for name in names:   # one matrix product per tensor name and group of clients
        holders = [j for j in range(count) if name in local_modules[j]]
        groups = [holders] if shared_across(name) else [
            [j for j in holders if architectures[j] == kind]
            for kind in dict.fromkeys(architectures[j] for j in holders)]
        for group in groups:
            _mix_into(out, local_modules, weights, name, group)
    return out


def _mix_into(out, local_modules, weights, name: str, group: list[int]) -> None:
    """out[i][name] = Σ_j w_ij L_j[name] / Σ_j w_ij over j in group, for every i in group."""
    shapes = {tuple(local_modules[j][name].shape) for j in group}
    if len(shapes) > 1:
        raise ValueError(f"customised_globals: '{name}' has shapes {sorted(shapes)} across the "
                         f"clients that share it")
    stacked = torch.stack([local_modules[j][name].reshape(-1).to(torch.float64) for j in group])
    row_weights = weights[group][:, group].to(torch.float64)
    totals = row_weights.sum(dim=1, keepdim=True)
    mixed = (row_weights / totals.clamp_min(torch.finfo(torch.float64).tiny)) @ stacked
    for row, j in enumerate(group):
        own = local_modules[j][name]
        merged = mixed[row] if float(totals[row]) > 0 else own.reshape(-1)
        out[j][name] = merged.reshape(own.shape).to(own.dtype)


# --------------------------------------------------------------------------------------------
# Orthonormal A and B
# --------------------------------------------------------------------------------------------

def _orthonormal_columns64(rows: int, cols: int, generator: torch.Generator | None) -> torch.Tensor:
    gaussian = torch.randn(rows, cols, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    # Fixing the signs of diag(R) makes Q Haar-distributed rather than biased by LAPACK's choice.
    signs = torch.sign(torch.diagonal(r))
    return q * torch.where(signs == 0, 1.0, signs)


def orthonormal_rows(rows: int, cols: int,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """A random (rows × cols) float32 A with orthonormal rows, A Aᵀ = I (Eq. 18, PQ-LoRA's A
    initialisation): QR of a gaussian. Needs rows <= cols."""
    if not 1 <= rows <= cols:
        raise ValueError(f'orthonormal rows need 1 <= rows <= cols, got rows={rows}, cols={cols}')
    return _orthonormal_columns64(cols, rows, generator).T.to(torch.float32)


def orthonormal_columns(rows: int, cols: int,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """A random (rows × cols) float32 B with orthonormal columns, Bᵀ B = I (Eq. 18, PQ-LoRA's B
    initialisation): QR of a gaussian. Needs cols <= rows."""
    if not 1 <= cols <= rows:
        raise ValueError(f'orthonormal columns need 1 <= cols <= rows, got rows={rows}, '
                         f'cols={cols}')
    return _orthonormal_columns64(rows, cols, generator).to(torch.float32)


def nearest_orthonormal_rows(a: torch.Tensor) -> torch.Tensor:
    """The matrix with orthonormal rows closest to a (r × d, r <= d) in Frobenius norm:
    a = U Σ Vᵀ (thin SVD), result U Vᵀ (Eqs. 21-23; the polar factor of a).

    Eq. 21 writes the constraint as A*ᵀ A* = I, which a wide r × d matrix cannot meet; the
    reachable one, and the one U Vᵀ satisfies, is A* A*ᵀ = I_r. Returned in a's dtype (float32
    or float64), SVD in float64.
    """
    _check_matrix('a', a)
    if a.shape[0] > a.shape[1]:
        raise ValueError(f'a has shape {tuple(a.shape)}; orthonormal rows need rows <= columns')
    u, _, vh = torch.linalg.svd(a.detach().to(torch.float64), full_matrices=False)
    return (u @ vh).to(_result_dtype(a))


# --------------------------------------------------------------------------------------------
# Aligning A (L2 fit + orthogonality regulariser)
# --------------------------------------------------------------------------------------------

def a_alignment_loss(pivot_features: torch.Tensor, inputs: torch.Tensor, a: torch.Tensor,
                     reg: float) -> torch.Tensor:
    """Eq. 20's objective: mean_k ‖A_i(x_k) − A_j x_k‖² + λ‖A_j A_jᵀ − I_r‖²_F, a 0-dim tensor
    (differentiable in a). pivot_features (m, r) are A_i(x_k), inputs (m, d_j) the x_k, a the
    (r, d_j) A_j. The regulariser uses A_j A_jᵀ (r × r), see :func:`align_a`."""
    _check_alignment_shapes(pivot_features, inputs, a)
    fit = (pivot_features - inputs @ a.T).pow(2).sum(dim=1).mean()
    identity = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    return fit + reg * (a @ a.T - identity).pow(2).sum()


def _check_alignment_shapes(pivot_features: torch.Tensor, inputs: torch.Tensor,
                            a: torch.Tensor) -> None:
    for name, t in (('pivot_features', pivot_features), ('inputs', inputs), ('a', a)):
        _check_matrix(name, t)
    m, r = pivot_features.shape
    if inputs.shape[0] != m or a.shape != (r, inputs.shape[1]):
        raise ValueError(f'expected pivot_features (m, r), inputs (m, d), a (r, d); got '
                         f'{tuple(pivot_features.shape)}, {tuple(inputs.shape)}, '
                         f'{tuple(a.shape)}')


@dataclass
class AlignmentMoments:
    """Sums over m paired public rows of the pivot's A outputs z_k = A_i x_k^(i) (r) and the
    other model's inputs x_k (d_j) to the same PQ layer: everything Eq. 20's fit term and the
    CCA of the two B outputs need, so public data of any size streams through in batches
    (memory O(d_j²), not O(m·d_j)). float64."""
    count: int
    sum_z: torch.Tensor    # (r,)    Σ z_k
    sum_x: torch.Tensor    # (d_j,)  Σ x_k
    zz: torch.Tensor       # (r, r)  Σ z_k z_kᵀ
    xz: torch.Tensor       # (d_j, r) Σ x_k z_kᵀ
    xx: torch.Tensor       # (d_j, d_j) Σ x_k x_kᵀ

    @classmethod
    def zeros(cls, r: int, d: int) -> AlignmentMoments:
        def z(*shape):
            return torch.zeros(*shape, dtype=torch.float64)
        return cls(0, z(r), z(d), z(r, r), z(d, r), z(d, d))

    @classmethod
    def of(cls, pivot_features: torch.Tensor, inputs: torch.Tensor) -> AlignmentMoments:
        moments = cls.zeros(pivot_features.shape[1], inputs.shape[1])
        moments.add(pivot_features, inputs)
        return moments

    def add(self, pivot_features: torch.Tensor, inputs: torch.Tensor) -> None:
        """Adds rows: pivot_features (n, r) = z_k, inputs (n, d_j) = x_k."""
        for name, t in (('pivot_features', pivot_features), ('inputs', inputs)):
            _check_matrix(name, t)
        if (pivot_features.shape[0] != inputs.shape[0]
                or pivot_features.shape[1] != self.zz.shape[0] or inputs.shape[1] != self.xx.shape[0]):
            raise ValueError(f'expected pivot_features (n, {self.zz.shape[0]}) and inputs '
                             f'(n, {self.xx.shape[0]}); got {tuple(pivot_features.shape)}, '
                             f'{tuple(inputs.shape)}')
        z = pivot_features.detach().to(torch.float64)
        x = inputs.detach().to(torch.float64)
        self.count += z.shape[0]
        self.sum_z += z.sum(0)
        self.sum_x += x.sum(0)
        self.zz += z.T @ z
        self.xz += x.T @ z
        self.xx += x.T @ x

    def covariances(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample covariances (÷ (m − 1)): Cov(z) (r, r), Cov(x) (d_j, d_j), Cov(x, z) (d_j, r)."""
        m = self.count
        if m < 2:
            raise ValueError(f'covariances need at least 2 rows, got {m}')
        mean_z, mean_x = self.sum_z / m, self.sum_x / m
        return ((self.zz - m * torch.outer(mean_z, mean_z)) / (m - 1),
                (self.xx - m * torch.outer(mean_x, mean_x)) / (m - 1),
                (self.xz - m * torch.outer(mean_x, mean_z)) / (m - 1))


def a_alignment_loss_from_moments(moments: AlignmentMoments, a: torch.Tensor,
                                  reg: float) -> torch.Tensor:
    """:func:`a_alignment_loss` from the rows' moments: mean_k ‖z_k − A x_k‖² =
    (tr Σzzᵀ − 2 tr(A Σxzᵀ) + tr(A Σxxᵀ Aᵀ)) / m, plus λ‖A Aᵀ − I_r‖²_F (a's dtype)."""
    if moments.count < 1 or a.shape != (moments.zz.shape[0], moments.xx.shape[0]):
        raise ValueError(f'a must be (r, d_j) = {tuple(moments.xz.T.shape)} and the moments '
                         f'non-empty; got a {tuple(a.shape)}, {moments.count} rows')
    zz, xz, xx = (t.to(a.dtype) for t in (moments.zz, moments.xz, moments.xx))
    fit = (zz.trace() - 2 * (a @ xz).trace() + (a @ xx * a).sum()) / moments.count
    identity = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    return fit + reg * (a @ a.T - identity).pow(2).sum()


def align_a(pivot_features: torch.Tensor, inputs: torch.Tensor, a_init: torch.Tensor,
            reg: float = 0.5, steps: int = 200, lr: float = 1e-2) -> torch.Tensor:
    """Align a non-pivot model's PQ-LoRA A_j to the frozen pivot A_i (§4.2.2, Eq. 20, then
    Eq. 23): :func:`align_a_from_moments` of the rows' :class:`AlignmentMoments`.

    pivot_features (m, r) are the pivot's A outputs A_i(x) on public data, inputs (m, d_j) the
    other model's inputs to that layer on the same data, a_init (r, d_j) its initial A.
    """
    _check_alignment_shapes(pivot_features, inputs, a_init)
    return align_a_from_moments(AlignmentMoments.of(pivot_features, inputs), a_init, reg, steps, lr)


def align_a_from_moments(moments: AlignmentMoments, a_init: torch.Tensor, reg: float = 0.5,
                         steps: int = 200, lr: float = 1e-2) -> torch.Tensor:
    """Minimises Eq. 20 over all the public rows at once (:func:`a_alignment_loss_from_moments`)
    from a_init with `steps` full-batch Adam steps (float64, deterministic), then returns
    :func:`nearest_orthonormal_rows` of the result, an (r, d_j) matrix with A_j A_jᵀ = I.

    Eq. 20 writes the regulariser as ‖A_jᵀ A_j − I‖²_F, but A_j is r × d_j with orthonormal
    rows (Eq. 18), so A_jᵀ A_j is a rank-r projection that can never equal I_{d_j}; the
    identity-sized term that matches Eq. 18 is A_j A_jᵀ (r × r), used here.
    """
    _check_matrix('a_init', a_init)
    if steps < 0:
        raise ValueError(f'steps must be >= 0, got {steps}')
    a = a_init.detach().to(torch.float64).clone().requires_grad_(True)
    a_alignment_loss_from_moments(moments, a.detach(), reg)   # checks the shapes
    optimiser = torch.optim.Adam([a], lr=lr)
    with torch.enable_grad():
        for _ in range(steps):
            optimiser.zero_grad()
            a_alignment_loss_from_moments(moments, a, reg).backward()
            optimiser.step()
    return nearest_orthonormal_rows(a.detach()).to(_result_dtype(a_init))


def cosine_learning_rate(base_lr: float, step: int, total_steps: int) -> float:
    """The cosine schedule without warm-up: base_lr · ½(1 + cos(π·step/total_steps)) at
    0-based `step` of `total_steps` (base_lr at step 0, decaying towards 0)."""
    if total_steps < 1 or not 0 <= step < total_steps:
        raise ValueError(f'need 0 <= step < total_steps, got step={step}, total_steps={total_steps}')
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * step / total_steps))


@dataclass
class MiniBatchAlignment:
    """Eq. 20 fitted batch by batch, as the paper aligns A (A.17: "1 epoch using a batch size of
    4, a learning rate of 5e-5, and the Adam optimizer with cosine scheduler"; Algorithm 3, step
    2): one Adam step per public batch on Σ_keys [mean_rows ‖z − A x‖² + λ‖A Aᵀ − I‖²] over the
    batch's rows, at :func:`cosine_learning_rate` over `total_steps`; :meth:`result` projects
    every A to orthonormal rows (Eq. 23). float64; `a_init` {key: (r, d) A_j} is not modified.
    `learning_rates` records the rate of every step taken."""
    a_init: dict
    total_steps: int
    lr: float = 5e-5
    reg: float = 0.5
    learning_rates: list = field(default_factory=list)

    def __post_init__(self):
        if self.total_steps < 1:
            raise ValueError(f'total_steps must be >= 1, got {self.total_steps}')
        self.a = {key: a.detach().to(torch.float64).clone().requires_grad_(True)
                  for key, a in self.a_init.items()}
        self.optimiser = torch.optim.Adam(list(self.a.values()), lr=self.lr)

    def step(self, rows: dict) -> None:
        """One optimiser step on one batch: rows {key: (z (n, r) pivot A outputs, x (n, d_j)
        inputs)}; keys without rows in the batch do not count."""
        step = len(self.learning_rates)
        if step >= self.total_steps:
            raise ValueError(f'MiniBatchAlignment: more than total_steps = {self.total_steps} steps')
        lr = cosine_learning_rate(self.lr, step, self.total_steps)
        for group in self.optimiser.param_groups:
            group['lr'] = lr
        with torch.enable_grad():
            self.optimiser.zero_grad()
            losses = [a_alignment_loss(z.detach().to(torch.float64), x.detach().to(torch.float64),
                                       self.a[key], self.reg)
                      for key, (z, x) in rows.items() if z.shape[0]]
            if losses:
                sum(losses).backward()
                self.optimiser.step()
        self.learning_rates.append(lr)

    def result(self) -> dict:
        """{key: the fitted A_j projected to orthonormal rows}, in each a_init's dtype."""
        return {key: nearest_orthonormal_rows(a.detach()).to(_result_dtype(self.a_init[key]))
                for key, a in self.a.items()}


# --------------------------------------------------------------------------------------------
# Aligning B (CCA)
# --------------------------------------------------------------------------------------------

def _inverse_sqrt(cov: torch.Tensor) -> torch.Tensor:
    """C^{-1/2} of a symmetric positive definite float64 matrix, via eigh."""
    eigenvalues, vectors = torch.linalg.eigh(cov)
    return (vectors * eigenvalues.clamp_min(torch.finfo(cov.dtype).tiny).rsqrt()) @ vectors.T


def cca_projections(h_pivot: torch.Tensor, h_other: torch.Tensor, r: int,
                    eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Classic CCA between features H_i (m, d_i) and H_j (m, d_j) of the same m public samples
    (§4.2.2): Π_i (d_i, r) and Π_j (d_j, r) such that the columns of H_i Π_i and H_j Π_j are
    pairwise maximally correlated, canonical correlations in descending order.

    Both feature sets are centred; covariances C_ii, C_jj get eps·I added (so rank-deficient
    features, e.g. the rank-r outputs of a B, still whiten), the whitened cross-covariance
    C_ii^{-1/2} C_ij C_jj^{-1/2} = U S Vᵀ is decomposed, and Π_i = C_ii^{-1/2} U_r,
    Π_j = C_jj^{-1/2} V_r (S_r are the canonical correlations). eps is absolute, so features
    on a tiny scale need a smaller eps. Computed in float64; r must be <= min(d_i, d_j).
    """
    _check_matrix('h_pivot', h_pivot)
    _check_matrix('h_other', h_other)
    m = h_pivot.shape[0]
    if h_other.shape[0] != m or m < 2:
        raise ValueError(f'h_pivot and h_other need the same m >= 2 rows, got shapes '
                         f'{tuple(h_pivot.shape)} and {tuple(h_other.shape)}')
    hi = h_pivot.detach().to(torch.float64)
    hj = h_other.detach().to(torch.float64)
    hi, hj = hi - hi.mean(dim=0), hj - hj.mean(dim=0)
    pi_i, pi_j = cca_from_covariances(hi.T @ hi / (m - 1), hj.T @ hj / (m - 1),
                                      hi.T @ hj / (m - 1), r, eps)
    dtype = _result_dtype(h_pivot, h_other)
    return pi_i.to(dtype), pi_j.to(dtype)


def cca_from_covariances(c_ii: torch.Tensor, c_jj: torch.Tensor, c_ij: torch.Tensor, r: int,
                         eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cca_projections` from the covariances C_ii (d_i, d_i), C_jj (d_j, d_j) and
    C_ij = Cov(H_i, H_j) (d_i, d_j); float64 Π_i (d_i, r), Π_j (d_j, r)."""
    d_i, d_j = c_ii.shape[0], c_jj.shape[0]
    if c_ij.shape != (d_i, d_j):
        raise ValueError(f'expected c_ij of shape ({d_i}, {d_j}), got {tuple(c_ij.shape)}')
    if not 1 <= r <= min(d_i, d_j):
        raise ValueError(f'r must be in [1, min(d_i={d_i}, d_j={d_j})], got r={r}')
    c_ii, c_jj, c_ij = (t.detach().to(torch.float64) for t in (c_ii, c_jj, c_ij))
    whiten_i = _inverse_sqrt(c_ii + eps * torch.eye(d_i, dtype=torch.float64))
    whiten_j = _inverse_sqrt(c_jj + eps * torch.eye(d_j, dtype=torch.float64))
    u, _, vh = torch.linalg.svd(whiten_i @ c_ij @ whiten_j, full_matrices=False)
    return whiten_i @ u[:, :r], whiten_j @ vh[:r].T


def b_output_cca(moments: AlignmentMoments, b_pivot: torch.Tensor, a_other: torch.Tensor,
                 b_other: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The CCA of the two models' B outputs h_i = B_i z and h_j = B_j A_j x (Algorithm 4) from
    the rows' moments: C_ii = B_i Cov(z) B_iᵀ, C_jj = B_j A_j Cov(x) A_jᵀ B_jᵀ,
    C_ij = B_i Cov(x, z)ᵀ A_jᵀ B_jᵀ; returns :func:`cca_from_covariances` at r = B's rank."""
    cov_z, cov_x, cov_xz = moments.covariances()
    b_i, a_j, b_j = (t.detach().to(torch.float64) for t in (b_pivot, a_other, b_other))
    map_j = b_j @ a_j                                   # x -> h_j
    return cca_from_covariances(b_i @ cov_z @ b_i.T, map_j @ cov_x @ map_j.T,
                                b_i @ cov_xz.T @ map_j.T, b_i.shape[1], eps)


def canonical_correlations(h_pivot: torch.Tensor, h_other: torch.Tensor, pi_pivot: torch.Tensor,
                           pi_other: torch.Tensor) -> torch.Tensor:
    """Per-dimension Pearson correlation between the columns of H_i Π_i and H_j Π_j, an (r,)
    float64 tensor (0 where a projected column is constant)."""
    zi = (h_pivot.detach().to(torch.float64) @ pi_pivot.detach().to(torch.float64))
    zj = (h_other.detach().to(torch.float64) @ pi_other.detach().to(torch.float64))
    zi, zj = zi - zi.mean(dim=0), zj - zj.mean(dim=0)
    scale = zi.norm(dim=0) * zj.norm(dim=0)
    covariance = (zi * zj).sum(dim=0)
    return torch.where(scale > 0, covariance / scale.clamp_min(torch.finfo(scale.dtype).tiny),
                       0.0)


def align_b(b_pivot: torch.Tensor, pi_pivot: torch.Tensor, pi_other: torch.Tensor,
            orthonormalise: bool = False) -> torch.Tensor:
    """A non-pivot model's PQ-LoRA B_j from the pivot's B_i through the CCA space (§4.2.2):
    B_j = (Π_j⁺)ᵀ Π_iᵀ B_i, shape (d_j, r), with b_pivot (d_i, r), pi_pivot (d_i, r),
    pi_other (d_j, r) and ⁺ the Moore-Penrose pseudo-inverse. This is the minimum-norm B_j with
    Π_jᵀ B_j = Π_iᵀ B_i, i.e. (z B_jᵀ) Π_j = (z B_iᵀ) Π_i for every r-dim input z of B.
    (Eq. 19 in A.5 prints Π_i⁻¹ in place of Π_j⁺; §4.2.2 and Algorithm 4 use the other
    model's projection, as here.)

    Theorem 1 wants B with orthonormal columns, and A.5 says the map preserves them, but it does
    not in general (Π_i, Π_j are whitening-scaled, not orthogonal). orthonormalise=True returns
    the nearest matrix with orthonormal columns instead (U Vᵀ of the thin SVD of B_j, the same
    post-processing as Eq. 23); the default returns the map's B_j unchanged.
    """
    for name, t in (('b_pivot', b_pivot), ('pi_pivot', pi_pivot), ('pi_other', pi_other)):
        _check_matrix(name, t)
    if b_pivot.shape[0] != pi_pivot.shape[0] or pi_pivot.shape[1] != pi_other.shape[1]:
        raise ValueError(f'expected b_pivot (d_i, r), pi_pivot (d_i, k), pi_other (d_j, k); got '
                         f'{tuple(b_pivot.shape)}, {tuple(pi_pivot.shape)}, '
                         f'{tuple(pi_other.shape)}')
    pi_i = pi_pivot.detach().to(torch.float64)
    pi_j = pi_other.detach().to(torch.float64)
    b_other = torch.linalg.pinv(pi_j).T @ (pi_i.T @ b_pivot.detach().to(torch.float64))
    if orthonormalise:
        b_other = nearest_orthonormal_rows(b_other.T).T
    return b_other.to(_result_dtype(b_pivot, pi_pivot, pi_other))

"""Server-side aggregation of LoRA factors, as pure functions over tensors.

Conventions (all functions):

* Client k sends A_k of shape (r_k, d_in) and B_k of shape (d_out, r_k); its update is
  ΔW_k = B_k A_k (d_out × d_in).
* ``weights`` are non-negative per-client weights (e.g. sample counts n_k); they need not sum
  to 1 and are normalised with :func:`fs_plugins.aggregation.average.normalise_weights` into
  p_k = w_k / Σ_j w_j.
* Arithmetic is done in float32 ("compute dtype"), or float64 when any input is float64;
  results are cast back to the input dtype (that of ``As[0]`` for A factors, ``Bs[0]`` for B
  factors). bfloat16/float16 inputs are therefore computed in float32. A few small
  (r × r or r × d) quantities are deliberately formed in float64; each function says where
  and why.
* Nothing is done in place; inputs are never modified.
* Malformed inputs raise ValueError naming the offending client index and shapes.

Functions: :func:`fed_a2` (FedA²-LoRA analytical aggregation, never forms a d_out × d_in
matrix; mixed ranks by zero padding with ``pad=True``) and its materialising reference
:func:`fed_a2_naive`, :func:`fed_a2_vera` / :func:`fed_a2_vera_naive` (the same for VeRA's
scaling vectors λ_d, λ_b over frozen shared projections), with their one rule for the Tikhonov
λ (:func:`ridge_lambda`: RIDGE_MODES, :func:`is_singular` at FED_A2_SINGULAR_COND), :func:`flexlora` (SVD
redistribution for heterogeneous ranks), :func:`hetlora_pad` / :func:`hetlora_truncate`
(HetLoRA zero-padding aggregation), :func:`lora_delta_norm` (‖B A‖_F without B A),
:func:`flora_stack` (FLoRA's stacking, B A = Σ p_k s_k B_k A_k at any ranks), and FRLoRA's
:func:`principal_factors` (SVD initialisation) and :func:`frlora_step` (residual update).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fs_plugins.aggregation.average import normalise_weights

__all__ = [
    'fed_a2', 'fed_a2_naive', 'fed_a2_vera', 'fed_a2_vera_naive', 'flexlora', 'hetlora_pad',
    'hetlora_truncate', 'lora_delta_norm', 'flora_stack', 'principal_factors', 'frlora_step',
    'FED_A2_SINGULAR_COND', 'FED_A2_RIDGE_EPS', 'FED_A2_FLOAT32_COND',
    'RIDGE_MODES', 'gram_condition', 'is_singular', 'ridge_lambda',
]

#: When a Tikhonov λ applies (UniFLoW Eq. 13 / Algorithm 1 lines 14-18): 'when_singular' (λ only
#: when the Gram matrix A Aᵀ is singular, see FED_A2_SINGULAR_COND; the plain least-squares
#: B = U Aᵀ (A Aᵀ)⁻¹ otherwise) or 'always' (λ every round: Table 12's λ = 0.1 setting).
RIDGE_MODES = ('when_singular', 'always')
#: Eq. 13's "(A Aᵀ)⁻¹ does not exist", numerically: the Gram matrix (float64 eigenvalues) counts
#: as singular when its condition number λ_max/λ_min is at least this (λ_min <= 0: infinite).
#: One definition for the LoRA solve (fed_a2), VeRA's diagonal Gram matrix (fed_a2_vera) and the
#: lam=None fallback. Why 1e6: the factors are trained and sent in float32, and a float32 Gram
#: matrix is singular to working precision (LAPACK's / MATLAB's rcond < ε test) from
#: cond ≈ 1/ε₃₂ = 8.4e6; 1e6 keeps a ~10x margin below that. Up to it the unregularised solve is
#: sound: the float64 solve's own error is ≤ cond·ε₆₄ ≈ 1e-10, and the float32 rounding of the
#: factors (2⁻²⁴ ≈ 6e-8) is amplified at most ~cond-fold, to ≤ 6e-2 relative at the threshold.
#: `fsplug.fed_a2.singular_cond` overrides it per run.
FED_A2_SINGULAR_COND = 1e6
#: lam=None: the scale-relative numerical λ = FED_A2_RIDGE_EPS · mean eigenvalue of the Gram
#: matrix (trace(A Aᵀ) / r), which bounds cond(A Aᵀ + λ I) by about r / eps.
FED_A2_RIDGE_EPS = 1e-6
#: fed_a2 accumulates U Aᵀ in float32 (float32 inputs) when cond(A Aᵀ + λ I) is below this, so
#: float32 rounding (~1e-7) stays below ~1e-4 relative after the solve; float64 otherwise.
FED_A2_FLOAT32_COND = 1e3


def _condition(G: torch.Tensor) -> float:
    """λ_max / λ_min of a symmetric float64 matrix (inf when λ_min <= 0)."""
    return gram_condition(torch.linalg.eigvalsh(G))


def gram_condition(eigenvalues: torch.Tensor) -> float:
    """λ_max / λ_min of a Gram matrix given its eigenvalues (for a diagonal one, its
    entries); inf when λ_min <= 0."""
    lo, hi = float(eigenvalues.min()), float(eigenvalues.max())
    return hi / lo if lo > 0.0 else math.inf


def is_singular(eigenvalues: torch.Tensor, singular_cond: float = FED_A2_SINGULAR_COND) -> bool:
    """Eq. 13's "(A Aᵀ)⁻¹ does not exist" for a Gram matrix with these eigenvalues: its
    condition number is at least `singular_cond` (FED_A2_SINGULAR_COND by default)."""
    return gram_condition(eigenvalues) >= singular_cond


def _check_mode(ridge_mode: str, singular_cond: float) -> None:
    if ridge_mode not in RIDGE_MODES:
        raise ValueError(f'ridge_mode must be one of {RIDGE_MODES}, got {ridge_mode!r}')
    if not isinstance(singular_cond, (int, float)) or isinstance(singular_cond, bool) \
            or not math.isfinite(singular_cond) or singular_cond <= 1:
        raise ValueError(f'singular_cond must be a finite number > 1, got {singular_cond!r}')


def ridge_lambda(eigenvalues: torch.Tensor, lam=None, ridge_mode: str | None = None,
                 singular_cond: float = FED_A2_SINGULAR_COND) -> float:
    """The Tikhonov λ that FedA²'s solve uses for a Gram matrix with these eigenvalues (A Aᵀ
    for LoRA; the diagonal c_i G c_iᵀ for VeRA's λ_b): the one rule of fed_a2, fed_a2_naive,
    fed_a2_vera and fed_a2_vera_naive.

    * ridge_mode 'when_singular' (Eq. 13, Algorithm 1 lines 14-18): 0 unless the matrix is
      singular (:func:`is_singular` with `singular_cond`), then λ;
      'always': λ whatever the conditioning (Table 12's λ = 0.1 reading);
      None (the functions' default, their behaviour before ridge_mode existed): 'always' for a
      given lam, 'when_singular' for lam=None. The method fed_a2 always passes its mode.
    * λ = lam (a float ≥ 0), or for lam=None the scale-relative numerical
      FED_A2_RIDGE_EPS · mean eigenvalue (1e-6 × trace / r).
    * All eigenvalues 0 (A = 0) with lam=None: 1.0, which makes B = 0, the minimum-norm
      minimiser; with lam = 0 the LoRA solve then raises ValueError.
    """
    value = None if lam is None else _check_lam(lam)
    if ridge_mode is None:
        ridge_mode = 'when_singular' if value is None else 'always'
    _check_mode(ridge_mode, singular_cond)
    total = float(eigenvalues.sum())
    if ridge_mode == 'when_singular' and not is_singular(eigenvalues, singular_cond):
        return 0.0
    if value is not None:
        return value
    if total <= 0.0:
        return 1.0
    return FED_A2_RIDGE_EPS * total / eigenvalues.numel()


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_factors(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor],
                   weights: Sequence[float] | None, same_rank: bool) -> tuple[list[int], int, int]:
    """Validate client factors; returns (ranks, d_in, d_out)."""
    if len(As) == 0:
        raise ValueError('No clients: As is empty')
    if len(As) != len(Bs):
        raise ValueError(f'{len(As)} A factors but {len(Bs)} B factors')
    if weights is not None and len(weights) != len(As):
        raise ValueError(f'{len(As)} clients but {len(weights)} weights')
    ranks = []
    for k, (A, B) in enumerate(zip(As, Bs)):
        for name, t in (('A', A), ('B', B)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f'client {k}: {name} is a {type(t).__name__}, not a tensor')
            if t.dim() != 2:
                raise ValueError(f'client {k}: {name} must be 2-D, got shape {tuple(t.shape)}')
            if not t.is_floating_point():
                raise ValueError(f'client {k}: {name} has non-floating dtype {t.dtype}')
        if B.shape[1] != A.shape[0]:
            raise ValueError(f'client {k}: A has shape {tuple(A.shape)} (r, d_in) but B has shape '
                             f'{tuple(B.shape)} (d_out, r); their ranks differ')
        if A.shape[0] == 0:
            raise ValueError(f'client {k}: rank 0 (A has shape {tuple(A.shape)})')
        ranks.append(int(A.shape[0]))
    d_in, d_out = int(As[0].shape[1]), int(Bs[0].shape[0])
    for k, (A, B) in enumerate(zip(As, Bs)):
        if A.shape[1] != d_in:
            raise ValueError(f'client {k}: A has shape {tuple(A.shape)}, expected d_in={d_in} '
                             f'(client 0 A: {tuple(As[0].shape)})')
        if B.shape[0] != d_out:
            raise ValueError(f'client {k}: B has shape {tuple(B.shape)}, expected d_out={d_out} '
                             f'(client 0 B: {tuple(Bs[0].shape)})')
        if same_rank and ranks[k] != ranks[0]:
            raise ValueError(f'client {k}: rank {ranks[k]} (A {tuple(A.shape)}, B {tuple(B.shape)}) '
                             f'differs from client 0 rank {ranks[0]}; use pad=True (fed_a2), '
                             f'hetlora_pad or flexlora for heterogeneous ranks')
    return ranks, d_in, d_out


def _check_pair(A, B, a_name: str, b_name: str) -> None:
    """A (r, d_in) and B (d_out, r): 2-D tensors of the same rank."""
    for name, t in ((a_name, A), (b_name, B)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f'{name} must be a 2-D tensor, got '
                             f'{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}')
    if B.shape[1] != A.shape[0]:
        raise ValueError(f'{a_name} has shape {tuple(A.shape)} (r, d_in) but {b_name} has shape '
                         f'{tuple(B.shape)} (d_out, r); their ranks differ')


def _average_A(As: Sequence[torch.Tensor], p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Σ p_k pad(A_k) accumulated in `dtype` (same arithmetic as weighted_average): A_k of rank
    r_k fills the first r_k rows of the (max_k r_k, d_in) result, i.e. it is zero-padded with
    rows (a no-op when all ranks agree)."""
    r_max = max(int(A.shape[0]) for A in As)
    acc = torch.zeros((r_max, As[0].shape[1]), dtype=dtype, device=As[0].device)
    for pk, A in zip(p.tolist(), As):
        acc[:A.shape[0]] += pk * A.detach().to(dtype)
    return acc


def _check_lam(lam) -> float:
    try:
        value = float(lam)
    except (TypeError, ValueError):
        raise ValueError(f'lam must be None or a float >= 0, got {lam!r}') from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f'lam must be None or a finite float >= 0, got {lam!r}')
    return value


# --------------------------------------------------------------------------------------------
# FedA²-LoRA
# --------------------------------------------------------------------------------------------

def fed_a2(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], weights: Sequence[float],
           lam: float | None = None, pad: bool = False, ridge_mode: str | None = None,
           singular_cond: float = FED_A2_SINGULAR_COND,
           info: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FedA²-LoRA analytical aggregation, without ever forming a d_out × d_in matrix.

    With p = normalise_weights(weights)::

        A = Σ_k p_k A_k                                   (= FedAvg of the A's)
        B = argmin_B ‖B A − Σ_k p_k B_k A_k‖²_F + λ ‖B‖²_F
          = (U Aᵀ) (A Aᵀ + λ I_r)⁻¹,   U = Σ_k p_k B_k A_k,
        U Aᵀ = Σ_k p_k B_k (A_k Aᵀ)                       (d_out × r, U itself is never built)

    and B = solve(G, (U Aᵀ)ᵀ)ᵀ with G = A Aᵀ + λ I (symmetric, r × r), i.e. the system is
    solved from the right.

    Cost O(K r² (d_in + d_out)) time; extra memory O(r (d_in + d_out)): per client one float64
    copy of A_k and B_k plus r × r and d_out × r accumulators.

    Precision: A is accumulated in the compute dtype (float32, float64 for float64 inputs), so it
    equals FedAvg's A. A Aᵀ and the solve are always float64. U Aᵀ (with the A_k Aᵀ) is
    accumulated in float32 when cond(A Aᵀ + λI) < FED_A2_FLOAT32_COND (1e3) and the inputs are
    float32, else in float64: when A Aᵀ is ill conditioned, rounding in U Aᵀ is amplified by up
    to its condition number and float32 rounding (~1e-7) would dominate the solution.

    λ (:func:`ridge_lambda`, the rule shared with the VeRA path):
      * ridge_mode 'when_singular' (Eq. 13 and Algorithm 1 lines 14-18): λ = 0, the
        exact least-squares B = U Aᵀ (A Aᵀ)⁻¹, unless A Aᵀ is singular, i.e. cond(A Aᵀ) ≥
        singular_cond (FED_A2_SINGULAR_COND = 1e6, float64 eigenvalues; λ_min <= 0 counts as
        infinite); then the ridge λ below. 'always': the ridge λ whatever the conditioning
        (Table 12's λ = 0.1 reading; λ = 0 there is its "w/o Tik." row). None (default):
        'always' for a given lam, 'when_singular' for lam=None (the method fed_a2 defaults to
        'when_singular' with lam = 1).
      * the ridge λ: lam (a float ≥ 0; the method fed_a2 passes the paper's λ = 1 by default,
        §3 after Eq. 13), or for lam=None (default here) the scale-relative numerical
        λ = FED_A2_RIDGE_EPS · trace(A Aᵀ)/r (1e-6 × the mean eigenvalue of A Aᵀ). A ridge is
        used rather than a pseudo-inverse because it is continuous in the data (pinv jumps when
        a singular value crosses its cut-off), keeps the single symmetric solve above, and is
        deterministic. If A is exactly zero and lam=None, B = 0 (the minimum-norm minimiser);
        a λ of 0 with an exactly singular A Aᵀ raises ValueError.

    info: a dict, if given, receives 'lam' (the λ used) and 'cond' (cond(A Aᵀ), inf when
    singular), e.g. for the caller to log how often the singular branch ran.

    pad (mixed ranks, UniFLoW appendix E.4 / Table 10 "zero-padding"): with pad=True clients
    may have different ranks r_k; every A_k (r_k, d_in) is zero-padded with rows and every B_k
    (d_out, r_k) with columns to r = max_k r_k. Padding leaves each update unchanged
    (pad(B_k) pad(A_k) = B_k A_k, so U is the same), A = Σ p_k pad(A_k) (row i averages the
    clients with r_k > i, with the full p_k), and B is solved as above at rank r; nothing is
    actually padded (U Aᵀ = Σ p_k B_k (A_k Aᵀ) with A_k Aᵀ of shape r_k × r). With pad=False
    (default) all clients must share the rank r, else ValueError. Clients then take
    :func:`hetlora_truncate` of the result (their first r_k components).

    Returns (A, B) in the dtypes of As[0] and Bs[0].
    """
    _check_factors(As, Bs, weights, same_rank=not pad)
    p = normalise_weights(weights)
    cdtype = _compute_dtype(*As, *Bs)
    A = _average_A(As, p, cdtype)
    A64 = A.to(torch.float64)
    G = A64 @ A64.T                                            # r × r
    eig = torch.linalg.eigvalsh(G)
    lam_used = ridge_lambda(eig, lam, ridge_mode, singular_cond)
    if info is not None:
        info.update(lam=lam_used, cond=gram_condition(eig))
    if lam_used:
        G = G + lam_used * torch.eye(G.shape[0], dtype=G.dtype, device=G.device)
    # U Aᵀ in float32 when the solve cannot amplify float32 rounding much (the common case,
    # ~2x faster: no float64 copies of the factors); in float64 otherwise.
    acc_dtype = (torch.float32 if cdtype == torch.float32
                 and _condition(G) < FED_A2_FLOAT32_COND else torch.float64)
    A_acc = A.to(acc_dtype).T
    UAt = torch.zeros((Bs[0].shape[0], A.shape[0]), dtype=acc_dtype, device=A.device)  # d_out × r
    for pk, Ak, Bk in zip(p.tolist(), As, Bs):
        Gk = Ak.detach().to(acc_dtype) @ A_acc                 # A_k Aᵀ, r_k × r
        UAt.addmm_(Bk.detach().to(acc_dtype), Gk, alpha=pk)
    UAt = UAt.to(torch.float64)
    try:
        B = torch.linalg.solve(G, UAt.T).T
    except RuntimeError as err:                                 # exactly singular, lam = 0
        raise ValueError(f'fed_a2: A Aᵀ + {lam_used} I is singular (r={G.shape[0]}); '
                         f'use lam > 0 (or lam=None) with ridge_mode \'when_singular\' '
                         f'({err})') from None
    return A.to(As[0].dtype), B.to(Bs[0].dtype)


def fed_a2_naive(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], weights: Sequence[float],
                 lam: float | None = None, pad: bool = False, ridge_mode: str | None = None,
                 singular_cond: float = FED_A2_SINGULAR_COND) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference FedA²: materialises U = Σ_k p_k B_k A_k (d_out × d_in) and solves with lstsq.

    Same problem and the same λ rule (:func:`ridge_lambda`: lam, ridge_mode, singular_cond) as
    :func:`fed_a2` (λ is chosen from the same float64 A Aᵀ, with A = Σ p_k A_k accumulated the
    same way), but solved independently:
    B minimises ‖B A − U‖²_F + λ ‖B‖²_F, i.e. Bᵀ is the least-squares solution of the stacked
    system

        [ Aᵀ      ]  Bᵀ  =  [ Uᵀ ]        ((d_in + r) × r, right-hand sides d_out)
        [ √λ I_r  ]         [ 0  ]

    via torch.linalg.lstsq (QR based, no normal equations). U and the solve are in float64 so it
    can serve as the accuracy reference. Cost O(K r d_in d_out) time, O(d_in d_out) memory.
    pad=True: mixed ranks, A = Σ p_k pad(A_k) as in :func:`fed_a2` (U needs no padding).
    Returns (A, B) in the dtypes of As[0] and Bs[0].
    """
    _check_factors(As, Bs, weights, same_rank=not pad)
    p = normalise_weights(weights)
    cdtype = _compute_dtype(*As, *Bs)
    A = _average_A(As, p, cdtype)
    A64 = A.to(torch.float64)
    r, d_in = A64.shape
    U = torch.zeros((Bs[0].shape[0], d_in), dtype=torch.float64, device=A.device)
    for pk, Ak, Bk in zip(p.tolist(), As, Bs):
        U.addmm_(Bk.detach().to(torch.float64), Ak.detach().to(torch.float64), alpha=pk)
    lam_used = ridge_lambda(torch.linalg.eigvalsh(A64 @ A64.T), lam, ridge_mode, singular_cond)
    if lam_used:
        lhs = torch.cat([A64.T, math.sqrt(lam_used) * torch.eye(r, dtype=torch.float64, device=A.device)])
        rhs = torch.cat([U.T, torch.zeros((r, U.shape[0]), dtype=torch.float64, device=A.device)])
    else:
        lhs, rhs = A64.T, U.T
    Bt = torch.linalg.lstsq(lhs, rhs).solution                # r × d_out
    return A.to(As[0].dtype), Bt.T.to(Bs[0].dtype)


# --------------------------------------------------------------------------------------------
# FedA² for VeRA
# --------------------------------------------------------------------------------------------

def _check_vera(A, B, lambda_ds: Sequence[torch.Tensor], lambda_bs: Sequence[torch.Tensor],
                weights: Sequence[float]) -> None:
    """A (r, d_in), B (d_out, r) frozen projections; per client λ_d,k (r,) and λ_b,k (d_out,)."""
    _check_pair(A, B, 'A', 'B')
    if len(lambda_ds) == 0:
        raise ValueError('No clients: lambda_ds is empty')
    if not len(lambda_ds) == len(lambda_bs) == len(weights):
        raise ValueError(f'{len(lambda_ds)} λ_d vectors, {len(lambda_bs)} λ_b vectors and '
                         f'{len(weights)} weights; expected one of each per client')
    r, d_out = int(A.shape[0]), int(B.shape[0])
    for k, (d, b) in enumerate(zip(lambda_ds, lambda_bs)):
        for name, t, n in (('lambda_d', d, r), ('lambda_b', b, d_out)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != (n,):
                raise ValueError(f'client {k}: {name} must be a floating tensor of shape ({n},) '
                                 f'(A {tuple(A.shape)}, B {tuple(B.shape)}), got '
                                 f'{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}')


def _average_vectors(vectors: Sequence[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    """Σ p_k v_k in float32 (float64 for float64 inputs) with the arithmetic of
    weighted_average, so fed_a2_vera's λ_d equals FedAvg's bit for bit."""
    acc_dtype = torch.float64 if vectors[0].dtype == torch.float64 else torch.float32
    acc = torch.zeros(vectors[0].shape, dtype=acc_dtype, device=vectors[0].device)
    for pk, v in zip(p.tolist(), vectors):
        acc += float(pk) * v.detach().to(acc_dtype)
    return acc


def fed_a2_vera(A: torch.Tensor, B: torch.Tensor, lambda_ds: Sequence[torch.Tensor],
                lambda_bs: Sequence[torch.Tensor], weights: Sequence[float],
                lam: float | None = None, ridge_mode: str | None = None,
                singular_cond: float = FED_A2_SINGULAR_COND,
                info: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FedA² for VeRA: the analytical aggregation of the trained scaling vectors, without
    forming any d_out × d_in matrix.

    VeRA (Kopiczko et al., 2024) freezes random projections A (r, d_in) and B (d_out, r),
    shared by all clients (same seed), and trains λ_d (r) and λ_b (d_out) per layer::

        ΔW_k = diag(λ_b,k) B diag(λ_d,k) A.

    FedA² (UniFLoW Eqs. 9-13) averages the input-side factor and fits the output-side one to
    the averaged update U = Σ_k p_k ΔW_k. Here λ_d plays A's part and λ_b plays B's part::

        λ_d = Σ_k p_k λ_d,k                                   (Eq. 9: FedAvg of λ_d)
        λ_b = argmin_x ‖diag(x) M − U‖²_F + λ ‖x‖²,  M = B diag(λ_d) A.

    Derivation. Row i of diag(x) M is x_i c_i A with c_i = B[i, :] ∘ λ_d (1 × r); row i of
    U is Σ_k p_k λ_b,k[i] c_{k,i} A with c_{k,i} = B[i, :] ∘ λ_d,k. The objective is a sum of
    independent scalar ridge problems Σ_i (‖x_i c_i A − u_i‖² + λ x_i²); setting each
    derivative 2 ⟨x_i c_i A − u_i, c_i A⟩ + 2 λ x_i to 0 gives, with G = A Aᵀ (r × r)::

        λ_b[i] = Σ_k p_k λ_b,k[i] (c_i G c_{k,i}ᵀ) / (c_i G c_iᵀ + λ).

    Vectorised: with H = (C G) ∘ B (d_out × r, C = B diag(λ_d) the rows c_i),
    (H x)_i = c_i G (B[i, :] ∘ x)ᵀ, so the denominators are H λ_d and the numerators
    Σ_k p_k λ_b,k ∘ (H λ_d,k). If every client kept λ_d,k = λ_d, λ_b[i] = (Σ p_k λ_b,k[i]) ·
    den_i/(den_i + λ): FedAvg of λ_b, shrunk by the ridge (exact FedAvg for λ = 0).

    λ: the problem's Gram matrix is diag(c_i G c_iᵀ) (d_out × d_out), so the rule of
    :func:`fed_a2` (:func:`ridge_lambda`) applies to its diagonal, whose condition number is
    max_i/min_i of c_i G c_iᵀ: with ridge_mode 'when_singular' λ = 0 unless that is ≥
    singular_cond, 'always' applies λ every round; λ = lam, or for lam=None
    FED_A2_RIDGE_EPS · the mean of c_i G c_iᵀ. `info` as in fed_a2. A row with
    c_i G c_iᵀ + λ = 0 (c_i A = 0: any x_i fits equally) gets λ_b[i] = 0, the minimum-norm
    minimiser. Note λ penalises ‖λ_b‖² here, a different scale from LoRA's ‖B‖²_F.

    Cost O(r² d_in + r² d_out + K r d_out), memory O(r (d_in + d_out)); G, H and the solve in
    float64. λ_d is averaged like weighted_average (float32 for float32 inputs), so it equals
    FedAvg's. Returns (λ_d, λ_b) in the dtypes of lambda_ds[0] and lambda_bs[0].
    """
    _check_vera(A, B, lambda_ds, lambda_bs, weights)
    p = normalise_weights(weights)
    lambda_d = _average_vectors(lambda_ds, p)
    A64, B64 = A.detach().to(torch.float64), B.detach().to(torch.float64)
    d64 = lambda_d.to(device=B64.device, dtype=torch.float64)
    G = A64 @ A64.T                                                 # r × r
    H = ((B64 * d64) @ G) * B64                                     # d_out × r
    den = H @ d64                                                   # c_i G c_iᵀ
    D = torch.stack([d.detach().to(B64.device, torch.float64) for d in lambda_ds], dim=1)
    Lb = torch.stack([b.detach().to(B64.device, torch.float64) for b in lambda_bs], dim=1)
    num = ((H @ D) * Lb) @ p.to(B64.device)                         # Σ_k p_k λ_b,k[i] c_i G c_{k,i}ᵀ
    lam_used = ridge_lambda(den, lam, ridge_mode, singular_cond)
    if info is not None:
        info.update(lam=lam_used, cond=gram_condition(den))
    den = den + lam_used
    safe = torch.where(den > 0, den, torch.ones_like(den))
    lambda_b = torch.where(den > 0, num / safe, torch.zeros_like(num))
    return lambda_d.to(lambda_ds[0].dtype), lambda_b.to(lambda_bs[0].dtype)


def fed_a2_vera_naive(A: torch.Tensor, B: torch.Tensor, lambda_ds: Sequence[torch.Tensor],
                      lambda_bs: Sequence[torch.Tensor], weights: Sequence[float],
                      lam: float | None = None, ridge_mode: str | None = None,
                      singular_cond: float = FED_A2_SINGULAR_COND) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`fed_a2_vera`: materialises U = Σ_k p_k diag(λ_b,k) B diag(λ_d,k) A
    and M = B diag(λ_d) A (d_out × d_in, float64) and solves, for every row i, the
    least-squares problem [M[i, :]ᵀ; √λ] x_i = [U[i, :]ᵀ; 0] with torch.linalg.lstsq
    (batched over rows, no normal equations). λ is resolved as in fed_a2_vera from the row
    norms ‖M[i, :]‖², computed here from M. O(K d_in d_out) time, O(d_in d_out) memory."""
    _check_vera(A, B, lambda_ds, lambda_bs, weights)
    p = normalise_weights(weights)
    lambda_d = _average_vectors(lambda_ds, p)
    A64, B64 = A.detach().to(torch.float64), B.detach().to(torch.float64)

    def update(d, b):
        return (b.detach().to(torch.float64)[:, None] * B64) @ (d.detach().to(torch.float64)[:, None] * A64)

    U = sum(float(pk) * update(d, b) for pk, d, b in zip(p, lambda_ds, lambda_bs))
    M = B64 @ (lambda_d.to(torch.float64)[:, None] * A64)
    lam_used = ridge_lambda((M * M).sum(dim=1), lam, ridge_mode, singular_cond)
    lhs, rhs = M.unsqueeze(2), U.unsqueeze(2)                       # d_out × d_in × 1
    if lam_used:
        lhs = torch.cat([lhs, torch.full((M.shape[0], 1, 1), math.sqrt(lam_used),
                                         dtype=torch.float64)], dim=1)
        rhs = torch.cat([rhs, torch.zeros((M.shape[0], 1, 1), dtype=torch.float64)], dim=1)
    lambda_b = torch.linalg.lstsq(lhs, rhs).solution[:, 0, 0]
    return lambda_d.to(lambda_ds[0].dtype), lambda_b.to(lambda_bs[0].dtype)


# --------------------------------------------------------------------------------------------
# FlexLoRA
# --------------------------------------------------------------------------------------------

def flexlora(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], weights: Sequence[float],
             ranks: Sequence[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """FlexLoRA: average the full updates, then hand each client a truncated SVD of its rank.

    With p = normalise_weights(weights)::

        ΔW = Σ_k p_k B_k A_k                  (d_out × d_in; forming it is inherent here)
        ΔW = U S Vᵀ                           (thin SVD, torch.linalg.svd(full_matrices=False))
        B'_j = U[:, :r_j] · diag(√S[:r_j])    (d_out × r_j)
        A'_j = diag(√S[:r_j]) · Vᵀ[:r_j, :]   (r_j × d_in)

    so B'_j A'_j is the best rank-r_j approximation of ΔW (Eckart–Young) and the singular values
    are split evenly (√S on each side) between the two factors.

    Clients may have different ranks (As[k] is (r_k, d_in), Bs[k] is (d_out, r_k)); d_in and
    d_out must agree. ``ranks`` are the ranks to hand out, one entry per returned pair
    (default: each client's own rank, [As[k].shape[0]]); each must satisfy
    1 ≤ r_j ≤ min(d_in, d_out).

    Sign convention (deterministic): each singular pair (U[:, i], Vᵀ[i, :]) is flipped so that
    the entry of largest absolute value in U[:, i] (the first such entry on ties) is positive.
    Singular vectors of repeated singular values remain as LAPACK returns them.

    Computed in float32 (float64 if any input is float64). Returns a list of (A'_j, B'_j) in the
    dtypes of As[0] and Bs[0].
    """
    client_ranks, d_in, d_out = _check_factors(As, Bs, weights, same_rank=False)
    if ranks is None:
        ranks = client_ranks
    ranks = list(ranks)
    max_rank = min(d_in, d_out)
    for j, rj in enumerate(ranks):
        if isinstance(rj, bool) or int(rj) != rj or not 1 <= int(rj) <= max_rank:
            raise ValueError(f'ranks[{j}] = {rj!r}; expected an integer in [1, {max_rank}] '
                             f'(min(d_in={d_in}, d_out={d_out}))')
    p = normalise_weights(weights)
    cdtype = _compute_dtype(*As, *Bs)
    dW = torch.zeros((d_out, d_in), dtype=cdtype, device=As[0].device)
    for pk, Ak, Bk in zip(p.tolist(), As, Bs):
        dW.addmm_(Bk.detach().to(cdtype), Ak.detach().to(cdtype), alpha=pk)
    U, S, Vh = torch.linalg.svd(dW, full_matrices=False)
    top = max(int(r) for r in ranks) if ranks else 0
    U, S, Vh = U[:, :top], S[:top], Vh[:top]
    pivot = U.abs().argmax(dim=0)                                # first max on ties
    sign = torch.sign(U.gather(0, pivot.unsqueeze(0)).squeeze(0))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    root = S.clamp_min(0).sqrt()
    Bfull = U * (sign * root).unsqueeze(0)                       # d_out × top
    Afull = Vh * (sign * root).unsqueeze(1)                      # top × d_in
    return [(Afull[:int(r)].to(As[0].dtype).clone(), Bfull[:, :int(r)].to(Bs[0].dtype).clone())
            for r in ranks]


# --------------------------------------------------------------------------------------------
# HetLoRA
# --------------------------------------------------------------------------------------------

def _delta_norm64(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    A64, B64 = A.detach().to(torch.float64), B.detach().to(torch.float64)
    gram_b = B64.T @ B64                                         # r × r
    gram_a = A64 @ A64.T                                         # r × r
    # trace(X Y) = Σ_ij X_ij Y_ji = Σ_ij X_ij Y_ij for symmetric Y
    return (gram_b * gram_a).sum().clamp_min(0).sqrt()


def lora_delta_norm(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """‖B A‖_F without forming B A.

        ‖B A‖²_F = trace(Aᵀ Bᵀ B A) = trace((Bᵀ B)(A Aᵀ)) = Σ_ij (BᵀB)_ij (AAᵀ)_ij

    with A (r, d_in), B (d_out, r): O(r² (d_in + d_out)) time, O(r²) extra memory (besides
    float64 copies of the factors). The two r × r Gram matrices and the sum are computed in
    float64 because the sum can cancel (when ‖B A‖ ≪ ‖B‖ ‖A‖), which float32 would resolve
    poorly; the result is clamped at 0 before the square root. Returns a 0-dim tensor in the
    promoted dtype of A and B.
    """
    _check_pair(A, B, 'A', 'B')
    return _delta_norm64(A, B).to(torch.promote_types(A.dtype, B.dtype))


def hetlora_pad(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], weights: Sequence[float],
                sparsity_weighted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """HetLoRA aggregation of mixed-rank clients by zero padding.

    Every A_k (r_k, d_in) is zero-padded to (r_max, d_in) (extra rows) and every B_k
    (d_out, r_k) to (d_out, r_max) (extra columns), r_max = max_k r_k, and then::

        A = Σ_k p_k pad(A_k),   B = Σ_k p_k pad(B_k)

    (so row i of A averages only clients with r_k > i, still with the full p_k denominators).

    Weights:
      * sparsity_weighted=False: p = normalise_weights(weights).
      * sparsity_weighted=True (HetLoRA's sparsity-weighted aggregation): with
        s_k = ‖B_k A_k‖_F (via :func:`lora_delta_norm`, never forming B_k A_k, in float64),
        p_k = w_k s_k / Σ_j w_j s_j, w_k the given weights (e.g. sample counts n_k). If every
        s_k with w_k > 0 is 0 (e.g. all B_k = 0 right after initialisation) the plain weights
        are used instead.

    Computed in float32 (float64 for float64 inputs). Returns (A, B) of shapes (r_max, d_in),
    (d_out, r_max) in the dtypes of As[0] and Bs[0]. Clients then take
    :func:`hetlora_truncate` of the result.
    """
    ranks, d_in, d_out = _check_factors(As, Bs, weights, same_rank=False)
    p = normalise_weights(weights)
    if sparsity_weighted:
        norms = torch.stack([_delta_norm64(A, B) for A, B in zip(As, Bs)]).cpu()
        scaled = p * norms
        if float(scaled.sum()) > 0:
            p = normalise_weights(scaled.tolist())
    r_max = max(ranks)
    cdtype = _compute_dtype(*As, *Bs)
    device = As[0].device
    A = torch.zeros((r_max, d_in), dtype=cdtype, device=device)
    B = torch.zeros((d_out, r_max), dtype=cdtype, device=device)
    for pk, Ak, Bk, rk in zip(p.tolist(), As, Bs, ranks):
        A[:rk].add_(Ak.detach().to(cdtype), alpha=pk)
        B[:, :rk].add_(Bk.detach().to(cdtype), alpha=pk)
    return A.to(As[0].dtype), B.to(Bs[0].dtype)


def hetlora_truncate(A_global: torch.Tensor, B_global: torch.Tensor,
                     rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a HetLoRA client of rank r receives: A = A_global[:r, :], B = B_global[:, :r].

    A_global is (r_max, d_in), B_global (d_out, r_max), 1 ≤ rank ≤ r_max. Returns copies (not
    views), in the input dtypes.
    """
    _check_pair(A_global, B_global, 'A_global', 'B_global')
    r_max = A_global.shape[0]
    if isinstance(rank, bool) or int(rank) != rank or not 1 <= int(rank) <= r_max:
        raise ValueError(f'rank = {rank!r}; expected an integer in [1, {r_max}]')
    rank = int(rank)
    return A_global[:rank].clone(), B_global[:, :rank].clone()


def fedex_residual(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], weights: Sequence[float],
                   A_avg: torch.Tensor, B_avg: torch.Tensor) -> torch.Tensor:
    """FedEx-LoRA's residual R = Σ p_k B_k A_k − B̄ Ā (d_out × d_in, float32): the part of the
    averaged update that the product of the averaged factors misses."""
    p = normalise_weights(weights)
    product = sum(float(pk) * (b.float() @ a.float()) for pk, a, b in zip(p, As, Bs))
    return product - B_avg.float() @ A_avg.float()


def flora_stack(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], weights: Sequence[float],
                scales: Sequence[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FLoRA's noise-free aggregation by stacking (Wang et al., NeurIPS 2024, Sec. 3):
    A = [p_1 s_1 A_1; …; p_K s_K A_K] ((Σ r_k) × d_in) and B = [B_1, …, B_K] (d_out × Σ r_k),
    so that B A = Σ_k p_k s_k B_k A_k exactly, whatever the ranks r_k. p_k goes on A, as in the
    official code; s_k (each client's LoRA scaling α_k / r_k, default 1) too, so clients with
    different scalings stack correctly (the code relies on α_k = 2 r_k instead)."""
    _check_factors(As, Bs, weights, same_rank=False)
    p = normalise_weights(weights)
    scales = [1.0] * len(As) if scales is None else [float(s) for s in scales]
    if len(scales) != len(As):
        raise ValueError(f'flora_stack: {len(scales)} scales for {len(As)} clients')
    dtype = _compute_dtype(*As, *Bs)
    A = torch.cat([(float(pk) * sk) * a.to(dtype) for pk, sk, a in zip(p, scales, As)], dim=0)
    B = torch.cat([b.to(dtype) for b in Bs], dim=1)
    return A.to(As[0].dtype), B.to(Bs[0].dtype)


def principal_factors(weight: torch.Tensor, rank: int, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """FRLoRA's (and PiSSA's) initialisation (Yan et al., ICLR 2025, Eqs. 6-7): from the SVD
    W = U S Vᵀ of the pretrained weight (float32), A0 = √(S_r / s) V_rᵀ and B0 = U_r √(S_r / s)
    with the top-r singular triplets, so that s · B0 A0 = U_r S_r V_rᵀ (s: the LoRA scaling)."""
    if rank > min(weight.shape):
        raise ValueError(f'principal_factors: rank {rank} exceeds the weight shape '
                         f'{tuple(weight.shape)}')
    U, S, Vh = torch.linalg.svd(weight.float(), full_matrices=False)
    root = torch.sqrt(S[:rank] / float(scale))
    return root[:, None] * Vh[:rank], U[:, :rank] * root[None, :]


def frlora_step(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], weights: Sequence[float],
                A0: torch.Tensor, B0: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """FRLoRA's residual update of one round, before the LoRA scaling s (float32, d_out × d_in):
    B̄ Ā − B0 A0 with Ā, B̄ the p-weighted means (the paper, which sums s times this into the
    global weight), or Σ_k p_k B_k A_k − B0 A0 with `exact` (no cross terms). Subtracting the
    principal start B0 A0, which every client's LoRA is reset to, keeps it from being added
    again every round."""
    _check_factors(As, Bs, weights, same_rank=True)
    _check_pair(A0, B0, 'A0', 'B0')
    p = normalise_weights(weights)
    if exact:
        product = sum(float(pk) * (b.float() @ a.float()) for pk, a, b in zip(p, As, Bs))
    else:
        B_avg = sum(float(pk) * b.float() for pk, b in zip(p, Bs))
        product = B_avg @ _average_A(As, p, torch.float32)
    return product - B0.float() @ A0.float()

"""LoRA-specific aggregation maths (fs_plugins.aggregation.lora) against naive references."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from fs_plugins.aggregation import (
    fed_a2,
    fed_a2_naive,
    flexlora,
    hetlora_pad,
    hetlora_truncate,
    lora_delta_norm,
    weighted_average,
)
from fs_plugins.aggregation.lora import FED_A2_RIDGE_EPS, FED_A2_SINGULAR_COND, is_singular, ridge_lambda

SHAPES = [(24, 16), (10, 33)]          # (d_in, d_out), both d_in != d_out
WEIGHTS = {
    1: [[3.0], [0.5]],
    3: [[1, 2, 3], [10, 0, 5]],
    5: [[1, 1, 1, 1, 1], [7, 0.5, 0, 2, 30]],
}


def _clients(K, ranks, d_in, d_out, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if isinstance(ranks, int):
        ranks = [ranks] * K
    As = [torch.randn(r, d_in, generator=gen, dtype=torch.float64).to(dtype) for r in ranks]
    Bs = [torch.randn(d_out, r, generator=gen, dtype=torch.float64).to(dtype) for r in ranks]
    return As, Bs


def _p(weights):
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    return w / w.sum()


def _rel(x, y):
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm().clamp_min(1e-300))


def _U(As, Bs, weights):
    return sum(pk * B.double() @ A.double() for pk, A, B in zip(_p(weights), As, Bs))


def _closed_form(As, Bs, weights, lam):
    """B = U Aᵀ (A Aᵀ + lam I)⁻¹ with U materialised, explicit inverse, float64."""
    A = sum(pk * A.double() for pk, A in zip(_p(weights), As))
    G = A @ A.T + lam * torch.eye(A.shape[0], dtype=torch.float64)
    return A, _U(As, Bs, weights) @ A.T @ torch.linalg.inv(G)


def _ridge(A):
    A = A.double()
    return FED_A2_RIDGE_EPS * float(torch.trace(A @ A.T)) / A.shape[0]


# ------------------------------------------------------------------------------ FedA²

@pytest.mark.parametrize('K', [1, 3, 5])
@pytest.mark.parametrize('r', [1, 4, 8])
def test_fed_a2_matches_naive(r, K):
    for d_in, d_out in SHAPES:
        for weights in WEIGHTS[K]:
            As, Bs = _clients(K, r, d_in, d_out, seed=r * 100 + K)
            A, B = fed_a2(As, Bs, weights)
            A_ref, B_ref = fed_a2_naive(As, Bs, weights)
            assert A.shape == (r, d_in) and B.shape == (d_out, r)
            assert torch.equal(A, A_ref)
            assert _rel(B, B_ref) < 1e-4, (d_in, d_out, weights)
            # A is exactly FedAvg's A
            assert torch.equal(A, weighted_average([{'A': a} for a in As], weights)['A'])
            # well conditioned here, so lam=None means lam=0: the closed form with explicit inverse
            _, B_cf = _closed_form(As, Bs, weights, 0.0)
            assert _rel(B, B_cf) < 1e-4


@pytest.mark.parametrize('lam', [0.0, 0.1, 3.0])
def test_fed_a2_given_lam_is_closed_form(lam):
    for d_in, d_out in SHAPES:
        As, Bs = _clients(3, 4, d_in, d_out, dtype=torch.float64, seed=7)
        weights = [2, 1, 5]
        A, B = fed_a2(As, Bs, weights, lam=lam, ridge_mode='always')
        A_cf, B_cf = _closed_form(As, Bs, weights, lam)
        assert _rel(A, A_cf) < 1e-12
        assert _rel(B, B_cf) < 1e-10
        assert _rel(B, fed_a2_naive(As, Bs, weights, lam=lam, ridge_mode='always')[1]) < 1e-10
        # when_singular (the method's default): A Aᵀ is well conditioned here, so no λ
        B_split = fed_a2(As, Bs, weights, lam=lam, ridge_mode='when_singular')[1]
        assert _rel(B_split, _closed_form(As, Bs, weights, 0.0)[1]) < 1e-10
        # first-order optimality of ‖BA − U‖² + lam‖B‖²: (BA − U)Aᵀ + lam B = 0
        U = _U(As, Bs, weights)
        grad = (B @ A - U) @ A.T + lam * B
        assert float(grad.norm()) < 1e-9 * float((U @ A.T).norm())


def _naive_fed_a2_ridge(As, Bs, weights, lam):
    """A = Σ p_k A_k and B = (Σ p_k B_k A_k) Aᵀ (A Aᵀ + λ I)⁻¹, all materialised in float64,
    with p_k = w_k / Σ w_j computed in plain Python floats."""
    total = sum(float(w) for w in weights)
    p = [float(w) / total for w in weights]
    A = torch.zeros(As[0].shape, dtype=torch.float64)
    U = torch.zeros(Bs[0].shape[0], As[0].shape[1], dtype=torch.float64)
    for pk, Ak, Bk in zip(p, As, Bs):
        A = A + pk * Ak.double()
        U = U + pk * (Bk.double() @ Ak.double())
    r = A.shape[0]
    return A, U @ A.T @ torch.linalg.inv(A @ A.T + lam * torch.eye(r, dtype=torch.float64))


@pytest.mark.parametrize('lam', [0.05, 0.5, 4.0])
def test_fed_a2_explicit_ridge_matches_naive_float64(lam):
    """float32 clients, explicit λ > 0: fed_a2 returns the ridge solution of the naive formula."""
    for d_in, d_out in SHAPES:
        for K, weights in ((2, [3, 1]), (4, [1, 0, 2.5, 7])):
            As, Bs = _clients(K, 3, d_in, d_out, dtype=torch.float32, seed=K * 31 + d_in)
            A, B = fed_a2(As, Bs, weights, lam=lam, ridge_mode='always')
            A_ref, B_ref = _naive_fed_a2_ridge(As, Bs, weights, lam)
            assert A.dtype == torch.float32 and B.dtype == torch.float32
            assert A.shape == (3, d_in) and B.shape == (d_out, 3)
            torch.testing.assert_close(A.double(), A_ref, rtol=1e-6, atol=1e-6)
            assert _rel(B, B_ref) < 1e-5, (lam, d_in, d_out, weights)
            # λ really enters: the unregularised solution is measurably different
            _, B_plain = _naive_fed_a2_ridge(As, Bs, weights, 0.0)
            assert _rel(B_plain, B_ref) > 1e-3, (lam, d_in, d_out, weights)


def test_fed_a2_identical_A_gives_fedavg_B():
    for K in (1, 3, 5):
        As, Bs = _clients(K, 4, 40, 12, seed=K)
        As = [As[0].clone() for _ in range(K)]
        weights = WEIGHTS[K][1]
        A, B = fed_a2(As, Bs, weights)
        B_avg = sum(pk * b.double() for pk, b in zip(_p(weights), Bs))
        assert _rel(B, B_avg) < 1e-5
        assert _rel(A, As[0]) < 1e-6


def _rank_deficient_cases():
    d_in, d_out, r = 20, 14, 4
    # identical A (shared by all clients) with two identical rows
    As, Bs = _clients(3, r, d_in, d_out, seed=11)
    shared = As[0].clone()
    shared[1] = shared[0]
    yield 'identical rows', [shared.clone() for _ in As], Bs
    # every client's A has a zero row (different A's otherwise)
    As, Bs = _clients(3, r, d_in, d_out, seed=12)
    for a in As:
        a[2] = 0
    yield 'zero row', As, Bs
    # generic: A_k = C_k M with M (r-2, d_in), float64, so A Aᵀ has rank r-2
    gen = torch.Generator().manual_seed(13)
    M = torch.randn(r - 2, d_in, generator=gen, dtype=torch.float64)
    As = [torch.randn(r, r - 2, generator=gen, dtype=torch.float64) @ M for _ in range(3)]
    Bs = [torch.randn(d_out, r, generator=gen, dtype=torch.float64) for _ in range(3)]
    yield 'low rank span', As, Bs


@pytest.mark.parametrize('case', ['identical rows', 'zero row', 'low rank span'])
def test_fed_a2_rank_deficient_fallback(case):
    name, As, Bs = next(c for c in _rank_deficient_cases() if c[0] == case)
    weights = [1, 2, 3]
    A, B = fed_a2(As, Bs, weights)
    G = A.double() @ A.double().T
    eig = torch.linalg.eigvalsh(G)
    assert eig[0] <= 0 or eig[-1] / eig[0] >= FED_A2_SINGULAR_COND    # the fallback is exercised
    assert torch.isfinite(B).all()
    _, B_ref = fed_a2_naive(As, Bs, weights)
    assert _rel(B, B_ref) < 1e-4, name
    # the fallback is the documented ridge λ = eps · trace(A Aᵀ) / r
    lam = _ridge(A)
    assert lam > 0
    assert _rel(B, fed_a2(As, Bs, weights, lam=lam, ridge_mode='always')[1]) < 1e-12
    assert _rel(B, _closed_form(As, Bs, weights, lam)[1]) < 1e-4
    # singular, so when_singular applies a given λ too, the same as always
    for given in (lam, 0.3):
        assert torch.equal(fed_a2(As, Bs, weights, lam=given, ridge_mode='when_singular')[1],
                           fed_a2(As, Bs, weights, lam=given, ridge_mode='always')[1])
    # deterministic
    assert torch.equal(B, fed_a2(As, Bs, weights)[1])


def test_fed_a2_degenerate_inputs():
    As, Bs = _clients(2, 3, 9, 5, seed=3)
    zeros = [torch.zeros_like(a) for a in As]
    A, B = fed_a2(zeros, Bs, [1, 1])                   # A = 0: B = 0, the min-norm minimiser
    assert torch.count_nonzero(A) == 0 and torch.count_nonzero(B) == 0
    singular = [As[0].clone(), As[0].clone()]
    singular[0][1] = 0
    singular[1][1] = 0
    with pytest.raises(ValueError, match='singular'):
        fed_a2(singular, Bs, [1, 1], lam=0.0)
    with pytest.raises(ValueError, match='singular'):
        fed_a2(singular, Bs, [1, 1], lam=0.0, ridge_mode='always')
    for bad in (-1.0, float('nan'), float('inf'), 'x'):
        with pytest.raises(ValueError, match='lam'):
            fed_a2(As, Bs, [1, 1], lam=bad)
    with pytest.raises(ValueError, match='ridge_mode'):
        fed_a2(As, Bs, [1, 1], ridge_mode='sometimes')
    for bad in (1.0, 0.5, float('inf')):
        with pytest.raises(ValueError, match='singular_cond'):
            fed_a2(As, Bs, [1, 1], singular_cond=bad)


def test_ridge_lambda_is_the_one_rule():
    """ridge_lambda: when_singular gives 0 below the threshold and λ (or the scale-relative
    1e-6·mean eigenvalue for lam=None) at or above it; always gives λ whatever the condition."""
    well = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    ill = torch.tensor([1e-7, 1.0, 2.0], dtype=torch.float64)          # cond 2e7
    singular = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    assert not is_singular(well) and is_singular(ill) and is_singular(singular)
    assert is_singular(well, singular_cond=4.0) and not is_singular(well, singular_cond=4.5)
    split = 'when_singular'
    assert ridge_lambda(well, 1.0, split) == 0.0
    assert ridge_lambda(ill, 1.0, split) == ridge_lambda(singular, 1.0, split) == 1.0
    assert ridge_lambda(well, 1.0, 'always') == 1.0
    # no mode given: a given λ always applies, lam=None only when singular
    assert ridge_lambda(well, 1.0) == 1.0 and ridge_lambda(well, None) == 0.0
    assert ridge_lambda(well, 0.0, 'always') == 0.0
    assert ridge_lambda(ill, None) == pytest.approx(FED_A2_RIDGE_EPS * float(ill.mean()))
    assert ridge_lambda(well, None, 'always') == pytest.approx(FED_A2_RIDGE_EPS * float(well.mean()))
    assert ridge_lambda(torch.zeros(3, dtype=torch.float64), None) == 1.0     # A = 0: B = 0
    assert ridge_lambda(ill, 1.0, split, singular_cond=1e8) == 0.0


def test_fed_a2_info_reports_lambda_and_condition():
    As, Bs = _clients(3, 4, 24, 16, seed=21)
    info = {}
    A, _ = fed_a2(As, Bs, [1, 2, 3], lam=0.7, ridge_mode='when_singular', info=info)
    eig = torch.linalg.eigvalsh(A.double() @ A.double().T)
    assert info['lam'] == 0.0 and info['cond'] == pytest.approx(float(eig[-1] / eig[0]))
    fed_a2(As, Bs, [1, 2, 3], lam=0.7, ridge_mode='always', info=info)
    assert info['lam'] == 0.7


def _largest_allocation(fn):
    """Largest net allocation (bytes) made by a single op while fn runs (CPU memory profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(ev.self_cpu_memory_usage for ev in prof.events())


def test_fed_a2_never_allocates_dout_by_din():
    d_in = d_out = 4096
    As, Bs = _clients(3, 4, d_in, d_out, seed=5)
    weights = [3, 1, 2]
    out = {}
    largest = _largest_allocation(lambda: out.update(res=fed_a2(As, Bs, weights)))
    assert largest < d_out * d_in * 4
    assert largest <= d_out * 4 * 8 * 2                # O((d_in + d_out) r) float64 buffers
    # the check does catch a materialised d_out × d_in tensor (naive reference, smaller sizes)
    small_As, small_Bs = _clients(3, 4, 600, 500, seed=6)
    assert _largest_allocation(lambda: fed_a2_naive(small_As, small_Bs, weights)) >= 600 * 500 * 8
    # and the large result is still right: check against the closed form on a row subset of B
    A, B = out['res']
    A64 = A.double()
    rows = slice(0, 64)
    UAt_rows = sum(pk * Bk[rows].double() @ (Ak.double() @ A64.T)
                   for pk, Ak, Bk in zip(_p(weights), As, Bs))
    assert _rel(B[rows], UAt_rows @ torch.linalg.inv(A64 @ A64.T)) < 1e-5


# ------------------------------------------------------------------------------ FlexLoRA

@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_flexlora_single_client_reproduces_update(dtype):
    for r in (1, 4, 8):
        for d_in, d_out in SHAPES:
            As, Bs = _clients(1, r, d_in, d_out, dtype=dtype, seed=r)
            [(A, B)] = flexlora(As, Bs, [5.0], [r])
            assert A.shape == (r, d_in) and B.shape == (d_out, r)
            tol = 1e-5 if dtype == torch.float32 else 1e-12
            assert _rel(B @ A, Bs[0] @ As[0]) < tol


def test_flexlora_heterogeneous_ranks_and_eckart_young():
    d_in, d_out = 30, 20
    ranks = [1, 4, 8, 2, 4]
    As, Bs = _clients(5, ranks, d_in, d_out, dtype=torch.float64, seed=21)
    weights = [3, 1, 4, 1, 5]
    out = flexlora(As, Bs, weights, ranks)
    dW = _U(As, Bs, weights)
    s = torch.linalg.svdvals(dW)
    assert len(out) == 5
    for rk, (A, B) in zip(ranks, out):
        assert A.shape == (rk, d_in) and B.shape == (d_out, rk)
        err = float((dW - B @ A).norm() ** 2)
        assert math.isclose(err, float((s[rk:] ** 2).sum()), rel_tol=1e-9, abs_tol=1e-12)
        # singular values split evenly: both factors carry √S
        torch.testing.assert_close(A.norm(dim=1), s[:rk].sqrt())
        torch.testing.assert_close(B.norm(dim=0), s[:rk].sqrt())
        # sign convention: largest-|.| entry of each column of B is positive
        idx = B.abs().argmax(dim=0)
        assert (B.gather(0, idx.unsqueeze(0)) > 0).all()
    # nested: a lower-rank client gets the leading part of a higher-rank client's factors
    torch.testing.assert_close(out[1][0], out[2][0][:4])
    torch.testing.assert_close(out[1][1], out[2][1][:, :4])
    # default ranks = the clients' own; explicit other ranks; deterministic
    default = flexlora(As, Bs, weights)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(default, out))
    assert [a.shape[0] for a, _ in flexlora(As, Bs, weights, [3, 12])] == [3, 12]


def test_flexlora_rank_validation():
    As, Bs = _clients(2, 4, 6, 5, seed=1)
    for bad in (0, 6, 2.5):
        with pytest.raises(ValueError, match=r'ranks\[1\]'):
            flexlora(As, Bs, [1, 1], [2, bad])


# ------------------------------------------------------------------------------ HetLoRA

def _pad_reference(As, Bs, p):
    r_max = max(a.shape[0] for a in As)
    A = sum(pk * F.pad(a.double(), (0, 0, 0, r_max - a.shape[0])) for pk, a in zip(p, As))
    B = sum(pk * F.pad(b.double(), (0, r_max - b.shape[1])) for pk, b in zip(p, Bs))
    return A, B


@pytest.mark.parametrize('ranks', [[4], [1, 4, 8], [8, 2, 2, 4, 1]])
def test_hetlora_pad_matches_explicit_padding(ranks):
    for d_in, d_out in SHAPES:
        As, Bs = _clients(len(ranks), ranks, d_in, d_out, seed=len(ranks))
        for weights in WEIGHTS[len(ranks)]:
            A, B = hetlora_pad(As, Bs, weights)
            A_ref, B_ref = _pad_reference(As, Bs, _p(weights))
            assert A.shape == (max(ranks), d_in) and B.shape == (d_out, max(ranks))
            assert _rel(A, A_ref) < 1e-6 and _rel(B, B_ref) < 1e-6
            # sparsity-weighted: p_k ∝ n_k ‖B_k A_k‖_F, norms from the materialised product
            norms = torch.stack([torch.linalg.norm(b.double() @ a.double()) for a, b in zip(As, Bs)])
            p_sparse = _p(weights) * norms
            p_sparse = p_sparse / p_sparse.sum()
            A, B = hetlora_pad(As, Bs, weights, sparsity_weighted=True)
            A_ref, B_ref = _pad_reference(As, Bs, p_sparse)
            assert _rel(A, A_ref) < 1e-6 and _rel(B, B_ref) < 1e-6


def test_hetlora_equal_ranks_is_fedavg_and_zero_updates_fall_back():
    As, Bs = _clients(3, 4, 12, 7, seed=9)
    weights = [1, 2, 3]
    A, B = hetlora_pad(As, Bs, weights)
    avg = weighted_average([{'A': a, 'B': b} for a, b in zip(As, Bs)], weights)
    torch.testing.assert_close(A, avg['A'])
    torch.testing.assert_close(B, avg['B'])
    zero_Bs = [torch.zeros_like(b) for b in Bs]            # all updates 0: plain weights
    A, _ = hetlora_pad(As, zero_Bs, weights, sparsity_weighted=True)
    torch.testing.assert_close(A, avg['A'])


def test_hetlora_truncate():
    As, Bs = _clients(3, [2, 6, 4], 10, 8, seed=2)
    A_g, B_g = hetlora_pad(As, Bs, [1, 1, 1])
    for rk in (1, 4, 6):
        A, B = hetlora_truncate(A_g, B_g, rk)
        assert torch.equal(A, A_g[:rk]) and torch.equal(B, B_g[:, :rk])
        A.add_(1)                                          # copies, not views
        assert not torch.equal(A, A_g[:rk])
    for bad in (0, 7, 1.5):
        with pytest.raises(ValueError, match='rank'):
            hetlora_truncate(A_g, B_g, bad)
    with pytest.raises(ValueError, match='ranks differ'):
        hetlora_truncate(A_g, B_g[:, :3], 2)


def test_lora_delta_norm():
    for r in (1, 4, 8):
        for d_in, d_out in SHAPES:
            (A,), (B,) = _clients(1, r, d_in, d_out, seed=r)
            expected = torch.linalg.norm(B.double() @ A.double())
            assert lora_delta_norm(A, B).dtype == torch.float32
            assert math.isclose(float(lora_delta_norm(A, B)), float(expected), rel_tol=1e-6)
    # full cancellation: ‖B‖, ‖A‖ > 0 but B A = 0 exactly
    A = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    B = torch.tensor([[1.0, -1.0]])
    assert float(lora_delta_norm(A, B)) == 0.0
    with pytest.raises(ValueError, match='ranks differ'):
        lora_delta_norm(torch.ones(3, 5), torch.ones(4, 2))


# ------------------------------------------------------------------------------ dtypes, errors

@pytest.mark.parametrize('dtype', [torch.float32, torch.float64, torch.bfloat16])
def test_dtype_preserved(dtype):
    As, Bs = _clients(3, [4, 4, 4], 16, 12, dtype=dtype, seed=4)
    weights = [1, 2, 3]
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    for fn in (fed_a2, fed_a2_naive, hetlora_pad):
        A, B = fn(As, Bs, weights)
        assert A.dtype == dtype and B.dtype == dtype, fn.__name__
    A, B = fed_a2(As, Bs, weights)
    assert _rel(B, fed_a2_naive(As, Bs, weights)[1]) < tol
    for A, B in flexlora(As, Bs, weights, [2, 4]):
        assert A.dtype == dtype and B.dtype == dtype
    A, B = hetlora_truncate(*hetlora_pad(As, Bs, weights), 2)
    assert A.dtype == dtype and B.dtype == dtype
    assert lora_delta_norm(As[0], Bs[0]).dtype == dtype


ALL = [fed_a2, fed_a2_naive, flexlora, hetlora_pad]


@pytest.mark.parametrize('fn', ALL, ids=lambda f: f.__name__)
def test_errors_name_the_client(fn):
    As, Bs = _clients(3, 4, 10, 8, seed=0)
    bad_din = list(As)
    bad_din[2] = torch.randn(4, 11)
    with pytest.raises(ValueError, match=r'client 2.*\(4, 11\)'):
        fn(bad_din, Bs, [1, 1, 1])
    bad_dout = list(Bs)
    bad_dout[1] = torch.randn(9, 4)
    with pytest.raises(ValueError, match=r'client 1.*\(9, 4\)'):
        fn(As, bad_dout, [1, 1, 1])
    bad_rank = list(Bs)
    bad_rank[2] = torch.randn(8, 3)
    with pytest.raises(ValueError, match=r'client 2.*ranks differ'):
        fn(As, bad_rank, [1, 1, 1])
    bad_dim = list(As)
    bad_dim[0] = torch.randn(4, 10, 1)
    with pytest.raises(ValueError, match=r'client 0.*2-D'):
        fn(bad_dim, Bs, [1, 1, 1])
    with pytest.raises(ValueError, match='3 clients but 2 weights'):
        fn(As, Bs, [1, 1])
    with pytest.raises(ValueError, match='3 A factors but 2 B factors'):
        fn(As, Bs[:2], [1, 1, 1])
    with pytest.raises(ValueError):
        fn(As, Bs, [0, 0, 0])
    with pytest.raises(ValueError):
        fn(As, Bs, [1, -1, 1])


@pytest.mark.parametrize('fn', [fed_a2, fed_a2_naive], ids=lambda f: f.__name__)
def test_fed_a2_rejects_mixed_ranks(fn):
    As, Bs = _clients(2, [4, 2], 10, 8)
    with pytest.raises(ValueError, match=r'client 1: rank 2.*pad=True'):
        fn(As, Bs, [1, 1])


def _naive_padded_fed_a2(As, Bs, weights, lam):
    """UniFLoW's zero padding (appendix E.4, Table 10) written out: every A_k padded with zero
    rows and B_k with zero columns to r_max, then Algorithm 1 on the padded factors, with U
    materialised and an explicit inverse, all in float64."""
    p = _p(weights)
    r_max = max(a.shape[0] for a in As)
    pA = [F.pad(a.double(), (0, 0, 0, r_max - a.shape[0])) for a in As]
    pB = [F.pad(b.double(), (0, r_max - b.shape[1])) for b in Bs]
    for a, b, pa, pb in zip(As, Bs, pA, pB):              # padding leaves every update unchanged
        torch.testing.assert_close(pb @ pa, b.double() @ a.double(), rtol=0, atol=0)
    A = sum(pk * a for pk, a in zip(p, pA))
    U = sum(pk * b @ a for pk, a, b in zip(p, pA, pB))
    return A, U @ A.T @ torch.linalg.inv(A @ A.T + lam * torch.eye(r_max, dtype=torch.float64))


@pytest.mark.parametrize('lam', [0.0, 0.1, 1.0])
@pytest.mark.parametrize('ranks', [[8, 4], [4, 8, 4, 8, 4], [2, 6, 3]])
def test_fed_a2_pad_mixed_ranks_matches_naive_padding(ranks, lam):
    for d_in, d_out in SHAPES:
        for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
            As, Bs = _clients(len(ranks), ranks, d_in, d_out, dtype=dtype, seed=sum(ranks) + d_in)
            weights = list(range(1, len(ranks) + 1))
            A, B = fed_a2(As, Bs, weights, lam=lam, pad=True, ridge_mode='always')
            A_ref, B_ref = _naive_padded_fed_a2(As, Bs, weights, lam)
            assert A.shape == (max(ranks), d_in) and B.shape == (d_out, max(ranks))
            assert A.dtype == dtype and B.dtype == dtype
            assert _rel(A, A_ref) < tol and _rel(B, B_ref) < tol, (ranks, lam, dtype)
            # the materialising reference agrees, and A is HetLoRA's padded average of the A's
            assert _rel(B, fed_a2_naive(As, Bs, weights, lam=lam, pad=True, ridge_mode='always')[1]) < tol
            torch.testing.assert_close(A, hetlora_pad(As, Bs, weights)[0])
            # a client keeps the first r_k components (hetlora_truncate)
            A_k, B_k = hetlora_truncate(A, B, min(ranks))
            assert torch.equal(A_k, A[:min(ranks)]) and torch.equal(B_k, B[:, :min(ranks)])


def test_fed_a2_pad_is_a_no_op_for_equal_ranks():
    As, Bs = _clients(3, 4, 24, 16, seed=8)
    for lam in (None, 0.0, 1.0):
        for mode in ('when_singular', 'always'):
            plain = fed_a2(As, Bs, [1, 2, 3], lam=lam, ridge_mode=mode)
            padded = fed_a2(As, Bs, [1, 2, 3], lam=lam, pad=True, ridge_mode=mode)
            assert all(torch.equal(x, y) for x, y in zip(plain, padded))


# ------------------------------------------------------------------------------ FedEx residual

@pytest.mark.parametrize('K, weights', [(1, [4.0]), (2, [1, 3]), (3, [2, 0, 5])])
def test_fedex_residual_matches_naive(K, weights):
    """R = Σ p_k B_k A_k − B̄ Ā with Ā, B̄ the p-weighted means, computed naively in float64."""
    from fs_plugins.aggregation.lora import fedex_residual
    for d_in, d_out in SHAPES:
        As, Bs = _clients(K, 4, d_in, d_out, dtype=torch.float32, seed=K + d_out)
        total = sum(float(w) for w in weights)
        p = [float(w) / total for w in weights]
        A_avg = sum(pk * A.double() for pk, A in zip(p, As))
        B_avg = sum(pk * B.double() for pk, B in zip(p, Bs))
        expected = torch.zeros(d_out, d_in, dtype=torch.float64)
        for i in range(d_out):
            for j in range(d_in):
                prod = sum(pk * float(B[i].double() @ A[:, j].double()) for pk, A, B in zip(p, As, Bs))
                expected[i, j] = prod - float(B_avg[i] @ A_avg[:, j])
        R = fedex_residual(As, Bs, weights, A_avg.float(), B_avg.float())
        assert R.dtype == torch.float32 and R.shape == (d_out, d_in)
        torch.testing.assert_close(R.double(), expected, rtol=1e-4, atol=1e-4)
        if K == 1:
            # one client: the product of the averages is the average product
            assert float(expected.abs().max()) < 1e-12
        else:
            assert float(expected.abs().max()) > 1e-1     # a non-trivial residual is checked


# ------------------------------------------------------------------------------ FLoRA, FRLoRA

def _naive_weighted_products(As, Bs, weights, scales):
    """Σ_k p_k s_k B_k A_k entry by entry in float64."""
    total = sum(float(w) for w in weights)
    d_out, d_in = Bs[0].shape[0], As[0].shape[1]
    out = torch.zeros(d_out, d_in, dtype=torch.float64)
    for i in range(d_out):
        for j in range(d_in):
            out[i, j] = sum(float(w) / total * s * float(B[i].double() @ A[:, j].double())
                            for w, s, A, B in zip(weights, scales, As, Bs))
    return out


@pytest.mark.parametrize('ranks, weights, scales', [([4], [2.0], [2.0]),
                                                    ([8, 4, 2], [1, 2, 3], [2.0, 4.0, 8.0]),
                                                    ([3, 3], [5, 0], [1.0, 1.0])])
def test_flora_stack_is_the_exact_weighted_sum_at_any_ranks(ranks, weights, scales):
    from fs_plugins.aggregation.lora import flora_stack
    for d_in, d_out in SHAPES:
        As, Bs = _clients(len(ranks), ranks, d_in, d_out, seed=sum(ranks) + d_out)
        A, B = flora_stack(As, Bs, weights, scales)
        assert A.shape == (sum(ranks), d_in) and B.shape == (d_out, sum(ranks))
        torch.testing.assert_close((B.double() @ A.double()),
                                   _naive_weighted_products(As, Bs, weights, scales),
                                   rtol=1e-4, atol=1e-4)
        # B is the plain concatenation: p_k s_k goes on A
        assert torch.equal(B[:, :ranks[0]], Bs[0])


def test_flora_stack_names_a_mismatched_client():
    from fs_plugins.aggregation.lora import flora_stack
    As, Bs = _clients(2, [4, 2], 8, 6)
    with pytest.raises(ValueError, match='client 1: A has shape'):
        flora_stack(As, [Bs[0], torch.zeros(6, 3)], [1, 1])
    with pytest.raises(ValueError, match='2 scales for 1 clients|1 scales for 2 clients'):
        flora_stack(As, Bs, [1, 1], [1.0])


@pytest.mark.parametrize('rank, scale', [(1, 1.0), (4, 2.0), (6, 0.5)])
def test_principal_factors_are_the_scaled_top_r_svd(rank, scale):
    from fs_plugins.aggregation.lora import principal_factors
    gen = torch.Generator().manual_seed(rank)
    W = torch.randn(12, 9, generator=gen)
    A0, B0 = principal_factors(W, rank, scale)
    assert A0.shape == (rank, 9) and B0.shape == (12, rank)
    U, S, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    top = U[:, :rank] @ torch.diag(S[:rank]) @ Vh[:rank]
    torch.testing.assert_close(scale * (B0.double() @ A0.double()), top, rtol=1e-5, atol=1e-5)
    # the residual W − s B0 A0 holds exactly the other singular values
    rest = torch.linalg.svdvals(W.double() - scale * B0.double() @ A0.double())
    torch.testing.assert_close(rest[:9 - rank], S[rank:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match='rank 10 exceeds the weight shape'):
        principal_factors(W, 10, scale)


@pytest.mark.parametrize('exact', [False, True])
def test_frlora_step_matches_naive(exact):
    from fs_plugins.aggregation.lora import frlora_step
    weights = [3, 1, 2]
    for d_in, d_out in SHAPES:
        As, Bs = _clients(3, 4, d_in, d_out, seed=d_in)
        (A0,), (B0,) = _clients(1, 4, d_in, d_out, seed=99)
        p = [w / sum(weights) for w in weights]
        if exact:
            product = _naive_weighted_products(As, Bs, weights, [1.0] * 3)
        else:
            product = sum(pk * B.double() for pk, B in zip(p, Bs)) @ \
                sum(pk * A.double() for pk, A in zip(p, As))
        expected = product - B0.double() @ A0.double()
        step = frlora_step(As, Bs, weights, A0, B0, exact=exact)
        assert step.dtype == torch.float32
        torch.testing.assert_close(step.double(), expected, rtol=1e-4, atol=1e-4)


def test_frlora_products_coincide_when_a_is_frozen():
    from fs_plugins.aggregation.lora import frlora_step
    As, Bs = _clients(3, 4, 24, 16, seed=3)
    (A0,), (B0,) = _clients(1, 4, 24, 16, seed=4)
    frozen = [A0.clone() for _ in As]
    torch.testing.assert_close(frlora_step(frozen, Bs, [1, 2, 3], A0, B0),
                               frlora_step(frozen, Bs, [1, 2, 3], A0, B0, exact=True),
                               rtol=1e-5, atol=1e-5)
    assert float((frlora_step(As, Bs, [1, 2, 3], A0, B0)
                  - frlora_step(As, Bs, [1, 2, 3], A0, B0, exact=True)).abs().max()) > 1e-2

"""FedMosaic maths (fs_plugins.aggregation.mosaic): RELA weights, gradient sanitising, PQ-LoRA
placement, orthonormal factors and A / B alignment."""
from __future__ import annotations

import math

import pytest
import torch

from fs_plugins.aggregation.mosaic import (
    a_alignment_loss,
    align_a,
    align_b,
    canonical_correlations,
    cca_projections,
    ema_update,
    nearest_orthonormal_rows,
    orthonormal_columns,
    orthonormal_rows,
    pq_block_layers,
    rela_weights,
    sanitise_gradient,
    shared_mask,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _eye(n: int) -> torch.Tensor:
    return torch.eye(n, dtype=torch.float32)


# ------------------------------------------------------------------------------ PQ-LoRA layers

@pytest.mark.parametrize('rule, expected', [('equation', [7, 14, 21, 30]),
                                            ('algorithm', [9, 16, 23, 30])])
def test_pq_block_layers_with_leftover_layers(rule, expected):
    assert pq_block_layers(30, 4, rule) == expected


@pytest.mark.parametrize('rule', ['equation', 'algorithm'])
def test_pq_block_layers_divisible(rule):
    assert pq_block_layers(16, 4, rule) == [4, 8, 12, 16]


@pytest.mark.parametrize('rule', ['equation', 'algorithm'])
def test_pq_block_layers_single_block_is_last_layer(rule):
    assert pq_block_layers(22, 1, rule) == [22]


@pytest.mark.parametrize('num_blocks', [0, 17])
def test_pq_block_layers_rejects_bad_block_count(num_blocks):
    with pytest.raises(ValueError, match='num_blocks'):
        pq_block_layers(16, num_blocks)


def test_pq_block_layers_rejects_unknown_rule():
    with pytest.raises(ValueError, match='rule'):
        pq_block_layers(16, 4, 'nearest')


# ------------------------------------------------------------------------------ RELA

def _naive_rela(grads: torch.Tensor, tau: float, include_self: bool) -> torch.Tensor:
    rows = grads.tolist()
    n = len(rows)

    def cos(u, v):
        dot = sum(x * y for x, y in zip(u, v))
        return dot / (math.sqrt(sum(x * x for x in u)) * math.sqrt(sum(y * y for y in v)))

    weights = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        others = [j for j in range(n) if include_self or j != i]
        total = sum(math.exp(cos(rows[i], rows[j]) / tau) for j in others)
        for j in others:
            weights[i, j] = math.exp(cos(rows[i], rows[j]) / tau) / total
    return weights


@pytest.mark.parametrize('include_self', [True, False])
@pytest.mark.parametrize('tau', [0.5, 0.1])
def test_rela_weights_match_naive_formula(include_self, tau):
    grads = torch.randn(5, 12, generator=_gen(1), dtype=torch.float64)
    weights = rela_weights(grads, tau=tau, include_self=include_self)
    assert weights.dtype == torch.float32
    expected = _naive_rela(grads, tau, include_self)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(5), rtol=0, atol=1e-6)
    if not include_self:
        assert torch.diagonal(weights).abs().max() == 0


def test_rela_identical_gradients_give_uniform_rows():
    scales = torch.tensor([[1.0], [2.0], [3.0], [0.5]])      # cosine ignores the length
    grads = torch.randn(1, 7, generator=_gen(2)).repeat(4, 1) * scales
    torch.testing.assert_close(rela_weights(grads), torch.full((4, 4), 0.25))
    torch.testing.assert_close(rela_weights(grads, include_self=False),
                               (torch.ones(4, 4) - torch.eye(4)) / 3)


def test_rela_most_similar_client_gets_largest_weight():
    base = torch.randn(3, 20, generator=_gen(3))
    grads = torch.cat([base, base[:1] + 0.1 * torch.randn(1, 20, generator=_gen(4))])
    weights = rela_weights(grads, include_self=False)
    assert int(weights[0].argmax()) == 3
    assert int(weights[3].argmax()) == 0


def test_rela_zero_gradient_gives_no_nan():
    grads = torch.randn(3, 6, generator=_gen(5))
    grads[1] = 0
    for include_self in (True, False):
        weights = rela_weights(grads, include_self=include_self)
        assert torch.isfinite(weights).all()
        torch.testing.assert_close(weights.sum(dim=1), torch.ones(3))
    torch.testing.assert_close(rela_weights(grads)[1], torch.full((3,), 1 / 3))


def test_rela_single_client_keeps_itself():
    grads = torch.randn(1, 4, generator=_gen(6))
    for include_self in (True, False):
        assert rela_weights(grads, include_self=include_self).tolist() == [[1.0]]


# ------------------------------------------------------------------------------ sanitising

def test_shared_mask_is_reproducible_and_sized():
    dim = 1000
    mask = shared_mask(dim, 0.4, seed=7)
    assert mask.dtype == torch.bool and mask.shape == (dim,)
    assert int(mask.sum()) == round(0.4 * dim)
    assert torch.equal(mask, shared_mask(dim, 0.4, seed=7))
    assert not torch.equal(mask, shared_mask(dim, 0.4, seed=8))


def test_shared_mask_keeps_at_least_one_and_rejects_bad_fraction():
    assert int(shared_mask(10, 0.01, seed=0).sum()) == 1
    assert bool(shared_mask(10, 1.0, seed=0).all())
    for fraction in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match='keep_fraction'):
            shared_mask(10, fraction, seed=0)


def test_sanitise_gradient_without_noise_is_the_masked_gradient():
    grad = torch.randn(50, generator=_gen(9))
    mask = shared_mask(50, 0.4, seed=1)
    assert torch.equal(sanitise_gradient(grad, mask, 0.0), grad[mask])


def test_sanitise_gradient_noise_has_scale_mu():
    dim, mu = 20000, 0.3
    grad = torch.randn(dim, generator=_gen(10))
    mask = shared_mask(dim, 0.4, seed=2)
    sent = sanitise_gradient(grad, mask, mu, generator=_gen(11))
    assert sent.shape == (int(mask.sum()),)
    noise = sent - grad[mask]
    assert abs(float(noise.std()) - mu) < 0.05 * mu
    assert abs(float(noise.mean())) < 0.02
    expected = grad[mask] + mu * torch.randn(int(mask.sum()), generator=_gen(11))
    torch.testing.assert_close(sent, expected)


def test_sanitise_gradient_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r'\(12,\).*\(10,\)'):
        sanitise_gradient(torch.zeros(12), torch.ones(10, dtype=torch.bool), 0.1)


@pytest.mark.parametrize('ratio', [0.0, 0.3, 1.0])
def test_ema_update_matches_eq2(ratio):
    previous = torch.randn(8, generator=_gen(12))
    current = torch.randn(8, generator=_gen(13))
    torch.testing.assert_close(ema_update(previous, current, ratio),
                               (1 - ratio) * previous + ratio * current)
    torch.testing.assert_close(ema_update(None, current, ratio), ratio * current)


def test_ema_update_chain_decays_old_gradients():
    g = None
    for step in range(3):
        g = ema_update(g, torch.full((2,), float(step)), 0.5)
    # ĝ = 0.5·2 + 0.25·1 + 0.125·0
    torch.testing.assert_close(g, torch.full((2,), 1.25))


# ------------------------------------------------------------------------------ orthonormal

@pytest.mark.parametrize('rows, cols', [(4, 16), (8, 8), (1, 5)])
def test_orthonormal_rows_and_columns(rows, cols):
    a = orthonormal_rows(rows, cols, generator=_gen(14))
    assert a.shape == (rows, cols) and a.dtype == torch.float32
    torch.testing.assert_close(a @ a.T, _eye(rows), rtol=0, atol=1e-5)
    b = orthonormal_columns(cols, rows, generator=_gen(15))
    assert b.shape == (cols, rows)
    torch.testing.assert_close(b.T @ b, _eye(rows), rtol=0, atol=1e-5)


def test_orthonormal_factors_reject_impossible_shapes():
    with pytest.raises(ValueError):
        orthonormal_rows(6, 4)
    with pytest.raises(ValueError):
        orthonormal_columns(4, 6)


def test_nearest_orthonormal_rows_is_orthonormal_and_closest():
    a = torch.randn(4, 10, generator=_gen(16))
    nearest = nearest_orthonormal_rows(a)
    assert nearest.shape == a.shape
    torch.testing.assert_close(nearest @ nearest.T, _eye(4), rtol=0, atol=1e-5)
    distance = float((a - nearest).norm())
    q, _ = torch.linalg.qr(a.T)                              # Gram-Schmidt of a's rows
    candidates = [q.T, -q.T] + [orthonormal_rows(4, 10, generator=_gen(s)) for s in range(5)]
    jitter = nearest + 0.05 * torch.randn(4, 10, generator=_gen(17))
    candidates.append(nearest_orthonormal_rows(jitter))
    for other in candidates:
        assert distance <= float((a - other).norm()) + 1e-6
    assert distance < float((a - q.T).norm()) - 1e-3


def test_nearest_orthonormal_rows_keeps_an_orthonormal_matrix():
    a = orthonormal_rows(3, 7, generator=_gen(18))
    torch.testing.assert_close(nearest_orthonormal_rows(a), a, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ aligning A

def test_align_a_recovers_an_exactly_alignable_a():
    m, r, d = 256, 4, 16
    a_true = orthonormal_rows(r, d, generator=_gen(19))
    inputs = torch.randn(m, d, generator=_gen(20))
    pivot_features = inputs @ a_true.T
    a_init = orthonormal_rows(r, d, generator=_gen(21))
    aligned = align_a(pivot_features, inputs, a_init)
    assert aligned.shape == (r, d)
    torch.testing.assert_close(aligned @ aligned.T, _eye(r), rtol=0, atol=1e-5)
    before = float(a_alignment_loss(pivot_features, inputs, a_init, 0.5))
    after = float(a_alignment_loss(pivot_features, inputs, aligned, 0.5))
    assert after < 0.1 * before
    assert not a_init.requires_grad


def test_align_a_is_deterministic_and_works_under_no_grad():
    inputs = torch.randn(64, 8, generator=_gen(22))
    pivot_features = inputs @ orthonormal_rows(2, 8, generator=_gen(23)).T
    a_init = orthonormal_rows(2, 8, generator=_gen(24))
    with torch.no_grad():
        first = align_a(pivot_features, inputs, a_init, steps=20)
    assert torch.equal(first, align_a(pivot_features, inputs, a_init, steps=20))
    assert not torch.equal(first, nearest_orthonormal_rows(a_init))


def test_a_alignment_loss_value():
    a = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    inputs = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    pivot = torch.tensor([[1.0, 0.0], [1.0, 3.0]])
    # fit: (‖(1, 0) − (2, 0)‖² + ‖(1, 3) − (0, 1)‖²) / 2 = (1 + 5) / 2 = 3;  reg: (4 − 1)² = 9
    assert float(a_alignment_loss(pivot, inputs, a, reg=0.5)) == pytest.approx(3 + 0.5 * 9)


def test_align_a_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match='pivot_features'):
        align_a(torch.zeros(5, 3), torch.zeros(5, 8), torch.zeros(2, 8))


# ------------------------------------------------------------------------------ CCA, aligning B

def test_cca_finds_a_linear_relation():
    m, d, r = 400, 6, 3
    h_pivot = torch.randn(m, d, generator=_gen(25), dtype=torch.float64)
    mixing = torch.randn(d, d, generator=_gen(26), dtype=torch.float64) + 3 * torch.eye(
        d, dtype=torch.float64)
    h_other = h_pivot @ mixing + 1e-3 * torch.randn(m, d, generator=_gen(27), dtype=torch.float64)
    pi_pivot, pi_other = cca_projections(h_pivot, h_other, r)
    assert pi_pivot.shape == (d, r) and pi_other.shape == (d, r)
    correlations = canonical_correlations(h_pivot, h_other, pi_pivot, pi_other)
    assert bool((correlations > 0.99).all())


def test_cca_of_independent_features_is_weak_and_sorted():
    m, r = 500, 4
    h_pivot = torch.randn(m, 6, generator=_gen(28))
    h_other = torch.randn(m, 9, generator=_gen(29))
    pi_pivot, pi_other = cca_projections(h_pivot, h_other, r)
    assert pi_pivot.shape == (6, r) and pi_other.shape == (9, r)
    correlations = canonical_correlations(h_pivot, h_other, pi_pivot, pi_other)
    assert float(correlations.max()) < 0.4
    assert bool((correlations[:-1] >= correlations[1:] - 1e-6).all())


def test_cca_picks_the_correlated_directions_first():
    m, r = 500, 4
    h_pivot = torch.randn(m, 5, generator=_gen(31), dtype=torch.float64) + 5.0
    shared = h_pivot[:, :2] @ torch.randn(2, 2, generator=_gen(32), dtype=torch.float64)
    unrelated = torch.randn(m, 4, generator=_gen(33), dtype=torch.float64) - 3.0
    h_other = torch.cat([unrelated[:, :2], shared, unrelated[:, 2:]], dim=1)
    pi_pivot, pi_other = cca_projections(h_pivot, h_other, r)
    correlations = canonical_correlations(h_pivot, h_other, pi_pivot, pi_other)
    assert bool((correlations[:2] > 0.99).all())
    assert bool((correlations[2:].abs() < 0.4).all())
    # CCA's constraint: projected (centred) features are white, Πᵀ C Π = I
    for h, pi in ((h_pivot, pi_pivot), (h_other, pi_other)):
        centred = h - h.mean(dim=0)
        covariance = pi.T @ (centred.T @ centred / (m - 1)) @ pi
        torch.testing.assert_close(covariance, torch.eye(r, dtype=torch.float64), rtol=0,
                                   atol=1e-4)


def test_canonical_correlations_are_signed_pearson():
    h = torch.randn(50, 3, generator=_gen(34), dtype=torch.float64)
    other = torch.stack([h[:, 0], -2 * h[:, 1] + 1, torch.ones(50, dtype=torch.float64)], dim=1)
    eye = torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(canonical_correlations(h, other, eye, eye),
                               torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64))


def test_cca_rejects_too_large_r():
    with pytest.raises(ValueError, match='r='):
        cca_projections(torch.randn(20, 5), torch.randn(20, 3), 4)


def _b_alignment_problem(m=300, r=4, d_pivot=12, d_other=20, seed=30):
    """Two models' B outputs on shared r-dim inputs Z: H_i = Z B_iᵀ, H_j = Z B_j0ᵀ (+ noise)."""
    z = torch.randn(m, r, generator=_gen(seed), dtype=torch.float64)
    b_pivot = orthonormal_columns(d_pivot, r, generator=_gen(seed + 1)).double()
    b_other_init = orthonormal_columns(d_other, r, generator=_gen(seed + 2)).double()
    h_pivot = z @ b_pivot.T + 1e-3 * torch.randn(m, d_pivot, generator=_gen(seed + 3),
                                                  dtype=torch.float64)
    h_other = z @ b_other_init.T + 1e-3 * torch.randn(m, d_other, generator=_gen(seed + 4),
                                                       dtype=torch.float64)
    return z, b_pivot, h_pivot, h_other


def test_align_b_maps_into_the_pivots_correlated_space():
    z, b_pivot, h_pivot, h_other = _b_alignment_problem()
    r = b_pivot.shape[1]
    pi_pivot, pi_other = cca_projections(h_pivot, h_other, r)
    b_other = align_b(b_pivot, pi_pivot, pi_other)
    assert b_other.shape == (h_other.shape[1], r)
    aligned = canonical_correlations(z @ b_pivot.T, z @ b_other.T, pi_pivot, pi_other)
    b_random = orthonormal_columns(h_other.shape[1], r, generator=_gen(40)).double()
    unaligned = canonical_correlations(z @ b_pivot.T, z @ b_random.T, pi_pivot, pi_other)
    assert bool((aligned > 0.999).all())
    assert float(aligned.min()) > float(unaligned.abs().max())
    assert float(unaligned.abs().mean()) < 0.8


def test_align_b_orthonormalise_gives_orthonormal_columns():
    _, b_pivot, h_pivot, h_other = _b_alignment_problem(seed=50)
    r = b_pivot.shape[1]
    pi_pivot, pi_other = cca_projections(h_pivot.float(), h_other.float(), r)
    b_plain = align_b(b_pivot.float(), pi_pivot, pi_other)
    b_ortho = align_b(b_pivot.float(), pi_pivot, pi_other, orthonormalise=True)
    assert b_ortho.dtype == torch.float32 and b_ortho.shape == b_plain.shape
    torch.testing.assert_close(b_ortho.T @ b_ortho, _eye(r), rtol=0, atol=1e-5)
    # the plain CCA map does not preserve orthonormality (contrary to A.5)
    assert float((b_plain.T @ b_plain - _eye(r)).abs().max()) > 1e-3


def test_align_b_matches_formula():
    b_pivot = torch.randn(5, 2, generator=_gen(60), dtype=torch.float64)
    pi_pivot = torch.randn(5, 2, generator=_gen(61), dtype=torch.float64)
    pi_other = torch.randn(7, 2, generator=_gen(62), dtype=torch.float64)
    expected = torch.linalg.pinv(pi_other).T @ pi_pivot.T @ b_pivot
    torch.testing.assert_close(align_b(b_pivot, pi_pivot, pi_other), expected)
    # Π_jᵀ B_j = Π_iᵀ B_i, i.e. z B_jᵀ Π_j = z B_iᵀ Π_i for every z
    torch.testing.assert_close(pi_other.T @ expected, pi_pivot.T @ b_pivot)


def test_customised_globals_follow_eq4_within_and_across_architectures():
    from fs_plugins.aggregation.mosaic import customised_globals, rela_weights
    torch.manual_seed(0)
    grads = torch.randn(4, 12)
    weights = rela_weights(grads, tau=0.5)
    arch = ['small', 'small', 'large', 'large']
    locals_ = [{'pq/block1.q/P': torch.randn(3, 3),
                'conv.A': torch.randn(2, 5 if a == 'small' else 7)} for a in arch]
    globals_ = customised_globals(locals_, weights, arch, lambda n: n.startswith('pq/'))
    for i in range(4):
        expected_pq = sum(weights[i, j].double() * locals_[j]['pq/block1.q/P'].double()
                          for j in range(4)).float()
        torch.testing.assert_close(globals_[i]['pq/block1.q/P'], expected_pq, rtol=1e-5, atol=1e-6)
        peers = [j for j in range(4) if arch[j] == arch[i]]
        row = weights[i, peers] / weights[i, peers].sum()
        expected_conv = sum(w * locals_[j]['conv.A'] for w, j in zip(row, peers))
        torch.testing.assert_close(globals_[i]['conv.A'], expected_conv, rtol=1e-5, atol=1e-6)
    # different gradients give different customised modules
    assert not torch.allclose(globals_[0]['pq/block1.q/P'], globals_[2]['pq/block1.q/P'])
    with pytest.raises(ValueError, match='4 clients, weights'):
        customised_globals(locals_, weights[:3, :3], arch, lambda n: True)


# ------------------------------------------------------------------------------ streamed moments

def test_alignment_moments_stream_to_the_full_batch_objective_and_cca():
    """Rows added batch by batch give Eq. 20's value and the B-output CCA of all rows at once."""
    from fs_plugins.aggregation.mosaic import (
        AlignmentMoments,
        a_alignment_loss_from_moments,
        align_a_from_moments,
        b_output_cca,
    )
    m, r, d_i, d_j, out_i, out_j = 90, 3, 10, 12, 14, 9
    x_i = torch.randn(m, d_i, generator=_gen(60), dtype=torch.float64) + 0.5
    x_j = x_i @ torch.randn(d_i, d_j, generator=_gen(61), dtype=torch.float64)
    a_i = orthonormal_rows(r, d_i, generator=_gen(62)).double()
    a_j = orthonormal_rows(r, d_j, generator=_gen(63)).double()
    b_i = orthonormal_columns(out_i, r, generator=_gen(64)).double()
    b_j = orthonormal_columns(out_j, r, generator=_gen(65)).double()
    z = x_i @ a_i.T
    streamed = AlignmentMoments.zeros(r, d_j)
    for start in range(0, m, 7):
        streamed.add(z[start:start + 7], x_j[start:start + 7])
    assert streamed.count == m
    torch.testing.assert_close(a_alignment_loss_from_moments(streamed, a_j, 0.5),
                               a_alignment_loss(z, x_j, a_j, 0.5))
    torch.testing.assert_close(align_a_from_moments(streamed, a_j, steps=30),
                               align_a(z, x_j, a_j, steps=30))
    pi_i, pi_j = b_output_cca(streamed, b_i, a_j, b_j)
    ref_i, ref_j = cca_projections(z @ b_i.T, x_j @ a_j.T @ b_j.T, r)
    # canonical directions are unique up to sign: compare the projected features
    h_i, h_j = z @ b_i.T, x_j @ a_j.T @ b_j.T
    for h, got, ref in ((h_i, pi_i, ref_i), (h_j, pi_j, ref_j)):
        got, ref = h @ got, h @ ref
        signs = torch.sign((got * ref).sum(0))
        torch.testing.assert_close(got * signs, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match='expected pivot_features'):
        streamed.add(z[:3], x_i[:3])


# ------------------------------------------------------------------------------ issue 38

def test_uniform_weights_are_equal_weight_aggregation():
    """RELA off (Table 7 '(+) PQ-LoRA', Table 30 'Equal-weight aggregation'): w_ij = 1/N."""
    from fs_plugins.aggregation.mosaic import uniform_weights
    torch.testing.assert_close(uniform_weights(4), torch.full((4, 4), 0.25))
    others = uniform_weights(3, include_self=False)
    torch.testing.assert_close(others, (torch.ones(3, 3) - torch.eye(3)) / 2)
    torch.testing.assert_close(uniform_weights(1, include_self=False), torch.ones(1, 1))


def test_cosine_learning_rate():
    from fs_plugins.aggregation.mosaic import cosine_learning_rate
    assert cosine_learning_rate(5e-5, 0, 10) == 5e-5
    assert cosine_learning_rate(5e-5, 5, 10) == pytest.approx(2.5e-5)
    assert cosine_learning_rate(1.0, 3, 4) == pytest.approx(0.5 * (1 + math.cos(math.pi * 3 / 4)))
    with pytest.raises(ValueError):
        cosine_learning_rate(1.0, 4, 4)


def test_mini_batch_alignment_is_adam_on_batches_with_a_cosine_schedule():
    """The paper's A fit (A.17): one Adam step per batch on Eq. 20 over the batch's rows, the
    learning rate on a cosine schedule; checked against torch's Adam + LambdaLR written out."""
    from fs_plugins.aggregation.mosaic import MiniBatchAlignment
    r, d_i, d_j, batches = 3, 8, 10, 5
    a_i = orthonormal_rows(r, d_i, generator=_gen(70)).double()
    a_j = orthonormal_rows(r, d_j, generator=_gen(71)).double()
    rows = []
    for k in range(batches):
        x_i = torch.randn(6, d_i, generator=_gen(80 + k), dtype=torch.float64)
        rows.append((x_i @ a_i.T, torch.cat([x_i, x_i[:, :2]], dim=1)))
    fit = MiniBatchAlignment({'k': a_j}, total_steps=batches, lr=0.05, reg=0.5)
    for z, x in rows:
        fit.step({'k': (z, x)})
    assert fit.learning_rates == pytest.approx(
        [0.05 * 0.5 * (1 + math.cos(math.pi * t / batches)) for t in range(batches)])
    reference = a_j.clone().requires_grad_(True)
    optimiser = torch.optim.Adam([reference], lr=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda t: 0.5 * (1 + math.cos(math.pi * t / batches)))
    for z, x in rows:
        optimiser.zero_grad()
        a_alignment_loss(z, x, reference, 0.5).backward()
        optimiser.step()
        schedule.step()
    torch.testing.assert_close(fit.a['k'].detach(), reference.detach())
    result = fit.result()['k']
    torch.testing.assert_close(result, nearest_orthonormal_rows(reference.detach()))
    assert not torch.equal(result, a_j)               # it moved
    with pytest.raises(ValueError, match='more than total_steps'):
        fit.step({'k': rows[0]})

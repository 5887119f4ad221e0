"""SmartFed's EEQA (Algorithm 1) on hand-worked cases: proportional shares, caps, the greedy
residual by importance, ties, and budgets the caps cannot hold."""
import pytest

from fs_plugins.aggregation import eeqa_quota


def test_proportional_shares_when_they_divide_exactly():
    assert eeqa_quota([0.5, 0.3, 0.2], budget=10, cap=10) == [5, 3, 2]


def test_scores_are_normalised_first():
    assert eeqa_quota([5, 3, 2], budget=10, cap=10) == [5, 3, 2]


def test_residual_goes_to_the_most_important_matrices_first():
    # floors 3, 3, 3 (9 of 10): the residual 1 goes to the largest alpha
    assert eeqa_quota([0.34, 0.33, 0.33], budget=10, cap=8) == [4, 3, 3]


def test_cap_binds_and_the_excess_flows_by_importance():
    # phase 1: min(7, 4) = 4, min(2, 4) = 2, min(1, 4) = 1 -> residual 3: matrix 1 (alpha 0.2)
    # takes 2 to its cap, matrix 2 (alpha 0.1) the last 1
    assert eeqa_quota([0.7, 0.2, 0.1], budget=10, cap=4) == [4, 4, 2]


def test_ties_keep_the_matrices_order():
    # floors 2, 2, 2, 2 (8 of 10): equal alphas, so the first matrix comes first and takes
    # all of the residual 2 (line 13: Δ = min(M − q_j, R), not one at a time)
    assert eeqa_quota([1, 1, 1, 1], budget=10, cap=5) == [4, 2, 2, 2]
    assert eeqa_quota([1, 1, 1, 1], budget=10, cap=3) == [3, 3, 2, 2]


def test_a_budget_above_what_the_caps_hold_gives_every_matrix_its_cap():
    assert eeqa_quota([0.6, 0.4], budget=10, cap=3) == [3, 3]


def test_zero_budget_and_zero_importance_matrix():
    assert eeqa_quota([0.5, 0.5], budget=0, cap=4) == [0, 0]
    # a matrix of importance 0 only gets what is left after the important ones are capped
    assert eeqa_quota([1.0, 0.0], budget=6, cap=4) == [4, 2]


def test_floating_point_products_floor_to_the_exact_share():
    # 0.29 * 100 is 28.999999999999996 in floating point
    assert eeqa_quota([0.29, 0.71], budget=100, cap=100) == [29, 71]


def test_whole_budget_is_spent_whenever_the_caps_allow_it():
    import numpy as np
    rng = np.random.default_rng(0)
    for _ in range(200):
        count = int(rng.integers(1, 12))
        importance = rng.random(count) ** 3
        cap = int(rng.integers(1, 9))
        budget = int(rng.integers(0, count * cap + 5))
        quota = eeqa_quota(importance, budget, cap)
        assert all(0 <= q <= cap for q in quota)
        assert sum(quota) == min(budget, count * cap)


@pytest.mark.parametrize('importance, match', [([0.5, -0.1], 'matrix 1 is -0.1'),
                                               ([0.5, float('nan')], 'matrix 1 is nan'),
                                               ([0, 0], 'at least one positive')])
def test_bad_importance_is_named(importance, match):
    with pytest.raises(ValueError, match=match):
        eeqa_quota(importance, 4, 2)


def test_bad_budget_or_cap_is_named():
    with pytest.raises(ValueError, match='budget .* and cap'):
        eeqa_quota([1.0], -1, 2)


# ------------------------------------------------------------ one cap per matrix
def test_one_cap_per_matrix_runs_the_same_two_phases():
    # phase 1: 1, 1, min(8, 4) = 4 -> residual 4: matrix 2 is full; of the tied others the
    # first takes all 4 it can (its cap 8 leaves room)
    assert eeqa_quota([0.1, 0.1, 0.8], budget=10, cap=[8, 8, 4]) == [5, 1, 4]
    # the same caps as one int give the one-M result
    assert eeqa_quota([0.7, 0.2, 0.1], budget=10, cap=[4, 4, 4]) == eeqa_quota([0.7, 0.2, 0.1], 10, 4)
    with pytest.raises(ValueError, match='2 caps for 3 matrices'):
        eeqa_quota([1, 1, 1], 3, [2, 2])


def test_phase_one_is_the_papers_floor():
    # α·B = 3.9, 3.9, 2.2: floors 3, 3, 2 (not rounded to 4, 4, 2); the residual 2 goes by α
    # (ties in order) whole: the first matrix takes both
    assert eeqa_quota([0.39, 0.39, 0.22], budget=10, cap=10) == [5, 3, 2]


def test_eeqa_is_forced_exactly_when_the_budget_fills_every_cap():
    from fs_plugins.aggregation.eeqa import eeqa_is_forced
    # one M: M <= K (B = K·J) is uniform; the tiny library's pools (8 on q, v; 4 on up, down)
    # with K = 4 are not
    assert eeqa_is_forced(4 * 8, 4, 8) and eeqa_is_forced(4 * 8, 3, 8)
    assert not eeqa_is_forced(4 * 8, 5, 8)
    pools = [8, 8, 4, 4] * 2
    assert not eeqa_is_forced(4 * 8, pools, 8) and eeqa_is_forced(6 * 8, pools, 8)
    for importance in ([1, 2, 3, 4, 5, 6, 7, 8], [8, 1, 1, 1, 1, 1, 1, 1]):
        assert eeqa_quota(importance, 4 * 8, 4) == [4] * 8                     # forced
        assert len(set(eeqa_quota(importance, 4 * 8, pools))) > 1              # follows α

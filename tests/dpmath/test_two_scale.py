"""The two-scale lower bound for subsampled Gaussians whose steps' losses sit far below the loss grid."""

import math

import numpy as np
import pytest

from dpmath import PLDAccountant, SubsampledGaussian
from dpmath.pld.distribution import Pld
from dpmath.pld.two_scale import TwoScaleLower, tail_threshold
from dpmath.referee import referee_delta, referee_epsilon


def test_the_vectorized_hockey_stick_curve_is_the_sum_over_the_masses_everywhere():
    # delta(eps) = inf + sum_j p_j (1 - e^{eps - t_j})_+ - slack, at grid points, between them, below the grid
    # (where every mass counts) and above it (only inf), and at -inf
    rng = np.random.default_rng(3)
    pld = Pld(0.01, -7, rng.random(40) / 40, 0.003, False, slack=0.001)
    t = (pld.start + np.arange(pld.pmf.size)) * pld.h
    eps = np.concatenate([[-np.inf, -5.0, -0.07, 0.0, 0.1, 0.105, 0.3, 0.32, 1.0], rng.uniform(-0.2, 0.4, 200)])
    direct = [pld.inf + float(pld.pmf @ np.maximum(-np.expm1(e - t), 0.0)) - pld.slack for e in eps]
    np.testing.assert_allclose(pld.deltas(eps), np.clip(direct, 0.0, 1.0), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose([pld.delta(float(e)) for e in eps[1:]], pld.deltas(eps[1:]), rtol=1e-14, atol=1e-17)


def test_the_tail_threshold_keeps_the_expected_number_of_tail_steps_small():
    # n P(L > tau) <= 1e-3 at tau, and tau / 2 fails it (tau = h 2^j)
    from dpmath.pld.losses import pair_cdfs

    for mu, q, n in [(2.0, 1e-6, 10**4), (1.0, 1e-3, 2000), (0.5, 0.01, 500)]:
        tau = tail_threshold(mu, q, n, 1e-4)
        assert n * pair_cdfs(np.array([tau]), mu, q, "remove")[1][0] <= 1e-3
        if tau > 1e-4:
            assert n * pair_cdfs(np.array([tau / 2]), mu, q, "remove")[1][0] > 1e-3


@pytest.mark.parametrize("sigma, q, steps, delta", [
    (2.0, 0.01, 500, 1e-6),     # referee (0.50506659, 0.50506659); two-scale 0.50506645
    pytest.param(1.0, 1e-3, 2000, 1e-5, marks=pytest.mark.slow),   # referee (0.20860867, 0.20860867); two-scale
    #                                                                 0.20860594
])
def test_the_two_scale_lower_end_lies_below_the_referee_and_close_to_it(sigma, q, steps, delta):
    # the referee inverts the characteristic function, independent of every grid here
    hi = PLDAccountant().compose(SubsampledGaussian(sigma, q), steps).epsilon(delta)
    curve = TwoScaleLower.build(1.0 / sigma, q, steps, 1e-4, 1e-18)
    low = curve.epsilon(delta, hi)
    ref_low, ref_high = referee_epsilon([(sigma, q, steps)], delta, guess=hi)
    assert low <= ref_low and ref_low - low <= 3e-5 * ref_low
    # the curve itself, at the referee's epsilon and a little below: under the certified delta, and above delta
    # where the truth is clearly above it
    for eps in (ref_low, 0.99 * ref_low):
        assert curve.delta(eps) <= referee_delta([(sigma, q, steps)], eps).low
    assert curve.delta(0.99 * ref_low) > delta


@pytest.mark.slow   # 14 s
def test_a_collapsed_lower_end_at_a_tiny_sampling_rate_is_lifted_to_within_a_tenth_of_a_percent():
    # accountant_bench Table 5: at q = 1e-5 the lowered split rounds each step's bulk down by about a grid step,
    # and the lower end was 0.109654 under an upper end of 0.910176 (dp_accounting's estimate: 0.910239)
    acc = PLDAccountant().compose(SubsampledGaussian(0.5, 1e-5), 10**4)
    lo, hi = acc.epsilon_bracket(1e-8)
    assert 0 < hi - lo <= 1e-3 * hi
    assert acc.epsilon(1e-8) == hi    # the published upper end is untouched
    d_lo, d_hi = acc.delta_bracket(0.9)
    assert 0 < d_lo <= d_hi and d_hi - d_lo <= 0.02 * d_hi


def test_the_two_scale_curve_is_used_only_for_a_single_subsampled_gaussian_adding_or_removing():
    from dpmath import Gaussian

    loose = (0.0, 1.0)
    assert PLDAccountant(neighboring="replace_one").compose(SubsampledGaussian(0.5, 1e-5), 100)._two_scale_lower(
        True, *loose) is None
    two = PLDAccountant().compose(SubsampledGaussian(0.5, 1e-5), 100).compose(Gaussian(50.0), 1)
    assert two._two_scale_lower(True, *loose) is None
    one = PLDAccountant().compose(SubsampledGaussian(0.5, 0.01), 500)
    assert one._two_scale_lower(False, *loose) is None       # no lower end asked for
    assert one._two_scale_lower(True, 0.9995, 1.0) is None   # already within the default's 0.1 %
    assert one._two_scale_lower(True, *loose) is not None
    assert math.isfinite(tail_threshold(2.0, 0.01, 500, 1e-4))


def test_a_two_scale_lower_end_at_a_large_sampling_rate_keeps_its_fine_grid_small():
    # sigma = 1e4, q = 0.5: a step's losses reach log(1 - q) = -0.69, 454M points of the fine grid below tau at
    # h_f = tau / 2^17 (12 GB); from 9 standard deviations below, on a grid 4 times coarser, it takes 0.3 s
    import tracemalloc

    acc = PLDAccountant().compose(SubsampledGaussian(1e4, 0.5), 10)
    hi = acc.epsilon(1e-5)
    tracemalloc.start()
    lo, upper = acc.epsilon_bracket(1e-5)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 200e6
    # the referee (characteristic-function inversion, 11 s) gives [1.8040742664e-4, 1.8040742705e-4]
    assert upper == hi and 1.8e-4 < lo <= 1.8040742664e-4 < hi

"""dpmath.correlated: banded Toeplitz strategies, their streaming inverse, sensitivity and error, and the accounting
of banded matrix factorization under cyclic Poisson sampling."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpmath import HutchEnvelope, PLDAccountant, SubsampledGaussian
from dpmath.correlated import BandedMatrixFactorization, BandedStrategy, BLTStrategy, prefix_sum_errors

coefficients = st.lists(st.floats(-0.9, 0.9), min_size=0, max_size=5).map(lambda t: (1.0, *t))


@settings(max_examples=60, deadline=None)
@given(coefficients, st.integers(1, 12))
def test_the_streaming_recurrence_is_the_inverse_of_the_strategy_step_by_step_or_at_once(c, n):
    strategy = BandedStrategy(c)
    z = np.random.default_rng(n).standard_normal((n, 3))
    dense = np.linalg.solve(strategy.matrix(n), z)
    assert np.allclose(strategy.correlate(z), dense, rtol=1e-9, atol=1e-9)
    past = []
    stepwise = np.concatenate([strategy.correlate(z[t:t + 1], past) for t in range(n)])
    assert np.allclose(stepwise, dense, rtol=1e-9, atol=1e-9)
    assert len(past) <= strategy.bands - 1   # O(b d) state
    r = strategy.inverse_coefficients(n)
    assert np.allclose(np.linalg.inv(strategy.matrix(n))[:, 0], r, rtol=1e-9, atol=1e-9)


def test_correlated_noise_has_the_strategys_covariance():
    """200,000 draws of C^{-1} z for n = 5: every entry of the empirical covariance within 5 standard errors of
    sigma^2 C^{-1} C^{-T} (a false failure has probability below 1e-5 for the 15 entries, fixed seed)."""
    strategy, n, draws, sigma = BandedStrategy.sqrt_prefix_sum(3), 5, 200_000, 1.5
    z = sigma * np.random.default_rng(0).standard_normal((n, draws))
    w = strategy.correlate(z)
    inv = np.linalg.inv(strategy.matrix(n))
    cov = sigma ** 2 * inv @ inv.T
    emp = w @ w.T / draws
    se = np.sqrt((np.outer(np.diag(cov), np.diag(cov)) + cov ** 2) / draws)
    assert np.all(np.abs(emp - cov) <= 5 * se)


def _brute_force_sensitivity(strategy, n, k, s):
    """The largest ||sum_{t in pi} C[:, t] g_t|| over patterns of k steps at least s apart and signs g_t = +-1."""
    cols = strategy.matrix(n)
    best = 0.0
    for pi in itertools.combinations(range(n), k):
        if any(b - a < s for a, b in zip(pi, pi[1:], strict=False)):
            continue
        for signs in itertools.product((1.0, -1.0), repeat=k):
            best = max(best, float(np.linalg.norm(cols[:, pi] @ np.array(signs))))
    return best


@pytest.mark.parametrize("c", [(1.0, 0.5, 0.375), (1.0, -0.6, 0.3), (1.0, 0.2, 0.7, -0.4), (1.0, 0.5, -0.5)])
@pytest.mark.parametrize("k,s", [(1, 1), (2, 1), (2, 2), (3, 2), (2, 3), (3, 4)])
def test_sensitivity_bounds_every_pattern_and_is_exact_when_participations_are_a_band_apart(c, k, s):
    strategy = BandedStrategy(c)
    n = 12
    truth = _brute_force_sensitivity(strategy, n, k, s)
    bound = strategy.sensitivity(k, s)
    assert bound >= truth - 1e-12
    if s >= strategy.bands:
        assert bound == pytest.approx(truth, rel=1e-12) == pytest.approx(math.sqrt(k) * strategy.column_norm)
    if all(a >= b >= 0 for a, b in zip(c, c[1:], strict=False)):   # non-negative, non-increasing: exact
        assert bound == pytest.approx(truth, rel=1e-12)


@pytest.mark.parametrize("c", [(1.0, -0.6, 0.3), (1.0, 0.2, 0.7, -0.4), (1.0, 0.5, -0.5), (1.0, 0.3, -0.2, 0.25, 0.1)])
@pytest.mark.parametrize("k,s", [(2, 1), (3, 1), (3, 2), (4, 2), (6, 1)])
def test_a_close_participation_charges_at_most_k_minus_1_others_s_apart_on_its_two_sides(c, k, s):
    # each participation's row of |C^T C| meets at most k - 1 others within its band, those on one side at least s
    # apart: never above charging the largest offsets on both sides, and still above every sign pattern's norm
    strategy = BandedStrategy(c)
    b = strategy.bands
    near = sorted((float(np.max(np.abs(np.cumsum(np.array(c[:b - d]) * np.array(c[d:]))))) for d in range(s, b)),
                  reverse=True)
    loose = math.sqrt(k * (strategy.column_norm ** 2 + 2 * sum(near[:min(len(near), (b - 1) // s, k - 1)])))
    bound = strategy.sensitivity(k, s)
    assert _brute_force_sensitivity(strategy, (k - 1) * s + b + 1, k, s) - 1e-12 <= bound <= loose + 1e-12
    if k == 2:   # one other participation: on one side only
        assert bound == pytest.approx(math.sqrt(2 * (strategy.column_norm ** 2 + max(near))), rel=1e-12)


def test_prefix_sum_errors_equal_the_dense_computation_and_the_optimizer_improves_on_the_square_root():
    strategy, n = BandedStrategy((1.0, 0.4, -0.1)), 9
    a = np.tril(np.ones((n, n)))
    rows = (np.linalg.solve(strategy.matrix(n).T, a.T).T ** 2).sum(1) * strategy.column_norm ** 2
    assert prefix_sum_errors(strategy, n) == pytest.approx((rows.mean(), rows[-1]), rel=1e-10)
    assert prefix_sum_errors(BandedStrategy((1.0,)), n) == ((n + 1) / 2, n)
    for error, which in (("mean", 0), ("max", 1)):
        best = BandedStrategy.optimized(6, 200, error=error)
        assert best.coefficients[0] == 1.0 and best.bands == 6
        assert prefix_sum_errors(best, 200)[which] <= prefix_sum_errors(BandedStrategy.sqrt_prefix_sum(6), 200)[which]
    # a banded strategy beats independent noise by far on the prefix sums of a long run
    assert prefix_sum_errors(BandedStrategy.optimized(16, 1000), 1000)[0] < 0.1 * prefix_sum_errors(
        BandedStrategy((1.0,)), 1000)[0]


def test_one_band_is_dp_sgd_and_more_bands_compose_fewer_steps_at_less_noise():
    plain = BandedMatrixFactorization(1.1, BandedStrategy((1.0,)), steps=300, sample_rate=0.02)
    assert plain.participations == 300 and plain.step() == SubsampledGaussian(1.1, 0.02)
    assert plain.epsilon(1e-5) == PLDAccountant().compose(SubsampledGaussian(1.1, 0.02), 300).epsilon(1e-5)
    banded = BandedMatrixFactorization(1.1, BandedStrategy.sqrt_prefix_sum(4), steps=300, sample_rate=0.02)
    assert banded.participations == 75
    assert banded.step().noise_multiplier == pytest.approx(1.1 / banded.strategy.column_norm)
    rc = BandedMatrixFactorization(1.1, BandedStrategy.sqrt_prefix_sum(4), 300, 0.02, HutchEnvelope(16, 64))
    assert isinstance(rc.step(), SubsampledGaussian) and rc.step().envelope == HutchEnvelope(16, 64)
    assert rc.epsilon(1e-5) > banded.epsilon(1e-5)   # the estimator's random scale costs privacy


@pytest.mark.parametrize("bad,match", [
    (lambda: BandedStrategy(()), "coefficients"),
    (lambda: BandedStrategy((0.0, 1.0)), r"coefficients\[0\]"),
    (lambda: BandedStrategy((1.0, math.nan)), "finite"),
    (lambda: BandedStrategy((1.0,)).sensitivity(0), "participations"),
    (lambda: BandedStrategy.optimized(4, 100, error="median"), "error"),
    (lambda: BandedMatrixFactorization(1.0, (1.0, 0.5), 10), "strategy"),
    (lambda: BandedMatrixFactorization(1.0, BandedStrategy((1.0,)), 10, sample_rate=1.5), "sample_rate"),
    (lambda: BandedMatrixFactorization(0.0, BandedStrategy((1.0,)), 10), "noise_multiplier"),
])
def test_bad_arguments_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


blt_params = st.lists(st.tuples(st.floats(0.0, 2.0), st.floats(0.0, 0.95)), min_size=1, max_size=3)


@settings(max_examples=40, deadline=None)
@given(blt_params, st.integers(1, 10))
def test_blt_buffers_invert_the_strategy_step_by_step(params, n):
    strategy = BLTStrategy(tuple(w for w, _ in params), tuple(t for _, t in params))
    z = np.random.default_rng(n).standard_normal((n, 2))
    dense = np.linalg.solve(strategy.matrix(n), z)
    assert np.allclose(strategy.correlate(z), dense, rtol=1e-9, atol=1e-9)
    state = []
    stepwise = np.concatenate([strategy.correlate(z[t:t + 1], state) for t in range(n)])
    assert np.allclose(stepwise, dense, rtol=1e-9, atol=1e-9) and len(state) == strategy.buffers
    assert np.allclose(strategy.inverse_coefficients(n), np.linalg.inv(strategy.matrix(n))[:, 0], atol=1e-9)


@pytest.mark.parametrize("params", [((0.5,), (0.5,)), ((0.3, 0.2), (0.9, 0.4)), ((1.2,), (0.7,))])
@pytest.mark.parametrize("k,s", [(1, 1), (2, 1), (3, 2), (2, 4), (4, 3)])
def test_blt_sensitivity_per_participation_bounds_every_pattern_and_is_the_limit_of_the_regular_one(params, k, s):
    strategy = BLTStrategy(*params)
    per = strategy.sensitivity_per_participation(s)
    n = (k - 1) * s + 8
    cols = strategy.matrix(n)
    best = 0.0
    for pi in itertools.combinations(range(n), k):
        if any(b - a < s for a, b in zip(pi, pi[1:], strict=False)):
            continue
        best = max(best, float(np.linalg.norm(cols[:, pi].sum(1))) ** 2)   # G >= 0: equal signs are the worst
    assert k * per >= best - 1e-9
    assert strategy.column_norm ** 2 >= float(np.linalg.norm(cols[:, 0])) ** 2 - 1e-12
    # the regular pattern 0, s, 2s, ... over a long run approaches k * per
    m, long = 200, BLTStrategy(*params).matrix(200 * s + 400)
    regular = float(np.linalg.norm(long[:, ::s][:, :m].sum(1))) ** 2 / m
    assert regular <= per + 1e-9 and regular >= 0.9 * per   # the edges lose half their cross terms


def test_blt_is_refused_with_bad_parameters_by_name():
    for bad, match in [(((-0.1,), (0.5,)), "weights"), (((0.1,), (1.0,)), "decays"), (((0.1, 0.2), (0.5,)), "length")]:
        with pytest.raises(ValueError, match=match):
            BLTStrategy(*bad)
    assert prefix_sum_errors(BLTStrategy((0.5,), (0.5,)), 100)[0] < prefix_sum_errors(BandedStrategy((1.0,)), 100)[0]


def test_optimized_blt_beats_its_start_and_banded_memory_and_nears_the_full_toeplitz_optimum():
    """n = 128, 2 buffers: not above the error of its two geometric starting points, less than half the banded
    optimum's with 3 bands (as much memory: 2 vectors), and within 1% (mean) or 3% (max) of the best Toeplitz
    strategy (b = n bands), which no BLT can beat: its coefficients cut at n are such a strategy, charged the column
    norm over n steps where the BLT is charged its limit (the larger part of the 2.2% gap for max error)."""
    from dpmath.correlated import _blt_interlaced

    n, d = 128, 2
    full = {e: prefix_sum_errors(BandedStrategy.optimized(n, n, error=e), n) for e in ("mean", "max")}
    for error, which in (("mean", 0), ("max", 1)):
        blt = BLTStrategy.optimized(d, n, error=error)
        value = prefix_sum_errors(blt, n)[which]
        for high in (0.9, 0.6):   # the docstring's starting points
            one_minus = np.geomspace(high, 3.0 / n, 2 * d)
            gaps = np.diff(np.concatenate([[0.0], 1.0 - one_minus, [1.0]]))
            decays, _, _, weights = _blt_interlaced(np.log(gaps[:-1] / gaps[-1]))
            assert value <= prefix_sum_errors(BLTStrategy(tuple(weights), tuple(decays)), n)[which]
        assert full[error][which] <= value <= (1.01 if error == "mean" else 1.03) * full[error][which]
        assert value < 0.5 * prefix_sum_errors(BandedStrategy.optimized(d + 1, n, error=error), n)[which]


def test_optimized_blt_is_a_valid_deterministic_blt_whose_inverse_streams_with_decaying_negative_terms():
    blt = BLTStrategy.optimized(3, 200)
    assert blt.buffers == 3 and blt == BLTStrategy.optimized(3, 200)   # deterministic
    assert all(w > 0 for w in blt.weights) and all(0 < t < 1 for t in blt.decays)
    assert list(blt.decays) == sorted(blt.decays, reverse=True)
    c, r = blt.coefficients(200), blt.inverse_coefficients(200)
    assert c[0] == 1 and np.all(np.diff(c) <= 0)                    # non-negative, non-increasing: G >= 0
    assert np.all(r[1:] < 0) and np.all(np.diff(r[1:]) > 0)         # the interlaced inverse: negative, decaying
    assert np.allclose(np.linalg.solve(blt.matrix(200), np.eye(200)[:, 0]), r, atol=1e-12)


def test_optimized_blt_for_a_participation_pattern_beats_the_single_participation_optimum_under_that_pattern():
    n, s = 256, 32

    def charged(blt):
        return prefix_sum_errors(blt, n)[0] * blt.sensitivity_per_participation(s) / blt.column_norm ** 2

    multi, single = BLTStrategy.optimized(3, n, min_separation=s), BLTStrategy.optimized(3, n)
    assert charged(multi) < 0.95 * charged(single)
    assert prefix_sum_errors(single, n)[0] <= prefix_sum_errors(multi, n)[0]   # and not the other way round


@pytest.mark.parametrize("bad,match", [
    (lambda: BLTStrategy.optimized(0, 100), "buffers"),
    (lambda: BLTStrategy.optimized(2.5, 100), "buffers"),
    (lambda: BLTStrategy.optimized(2, 0), "steps"),
    (lambda: BLTStrategy.optimized(2, 100, error="median"), "error"),
    (lambda: BLTStrategy.optimized(2, 100, min_separation=0), "min_separation"),
])
def test_optimized_blt_refuses_bad_arguments_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


@pytest.mark.parametrize("d,n", [(1, 1), (2, 2), (4, 3)])
def test_optimized_blt_survives_runs_shorter_than_its_buffers(d, n):
    blt = BLTStrategy.optimized(d, n, error="max")   # independent noise is the optimum: weights near 0
    assert blt.buffers == d and prefix_sum_errors(blt, n)[1] <= (1 + 1e-9) * prefix_sum_errors(
        BandedStrategy((1.0,)), n)[1]


@settings(max_examples=40, deadline=None)
@given(decrements=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4), k=st.integers(2, 3), s=st.integers(1, 3))
def test_non_negative_non_increasing_bands_have_the_evenly_spaced_pattern_as_their_worst(decrements, k, s):
    # every pattern of k participations s apart, in a run long enough for any of them, and every sign: the exact
    # value is the brute-force maximum (in one dimension, which the non-negative Gram entries make the worst)
    c = [1.0]
    for x in decrements:
        c.append(c[-1] * (1.0 - x))
    strategy = BandedStrategy(tuple(c))
    b = strategy.bands
    truth = _brute_force_sensitivity(strategy, (k - 1) * s + b + 2, k, s)
    assert strategy.sensitivity(k, s) == pytest.approx(truth, rel=1e-12)

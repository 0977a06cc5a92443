"""The referee (Laplace inversion of the composed privacy loss, dpmath.referee) against closed forms, and our
PLD bracket against the referee."""

import math

import pytest
from scipy.stats import norm

from dpmath import PLDAccountant, SubsampledGaussian
from dpmath.referee import referee_delta, referee_epsilon


def gaussian_delta(mu: float, eps: float) -> float:
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


@pytest.mark.parametrize("sigma, steps, eps", [(1.0, 4, 2.0), (1.0, 4, 8.0), (2.0, 10, 1.0), (5.0, 100, 3.0),
                                               (20.0, 10000, 0.5)])
def test_the_referee_reproduces_the_composed_gaussian_curve_within_its_error_bound(sigma, steps, eps):
    d = referee_delta([(sigma, 1.0, steps)], eps)
    exact = gaussian_delta(math.sqrt(steps) / sigma, eps)
    assert abs(d.value - exact) <= d.error
    assert d.error <= 1e-8 * exact


def test_the_referee_composes_heterogeneous_steps_like_one_gaussian():
    # 50 steps at sigma 10 and 50 at sigma 5 are one Gaussian with 1/sigma^2 = 50/100 + 50/25 (prv's test case)
    d = referee_delta([(10.0, 1.0, 50), (5.0, 1.0, 50)], 4.0)
    exact = gaussian_delta(math.sqrt(50 / 100 + 50 / 25), 4.0)
    assert abs(d.value - exact) <= d.error <= 1e-9 * exact


def test_the_referee_epsilon_encloses_the_exact_gaussian_epsilon():
    lo, hi = referee_epsilon([(2.0, 1.0, 16)], 1e-5)   # mu = 2, as four steps at sigma 1
    assert lo <= 9.997256146434298 <= hi     # brentq on the closed form, xtol 1e-14
    assert hi - lo < 1e-7


@pytest.mark.parametrize("sigma, q, steps, delta", [
    (1.0, 0.01, 1000, 1e-6),
    (0.8, 0.1, 100, 1e-5),
    pytest.param(2.0, 0.05, 500, 1e-8, marks=pytest.mark.slow),
    pytest.param(1.5, 0.2, 50, 1e-6, marks=pytest.mark.slow),
    pytest.param(0.7, 0.02, 2000, 1e-7, marks=pytest.mark.slow),
])
def test_our_pld_bracket_contains_the_refereed_epsilon(sigma, q, steps, delta):
    lo, hi = PLDAccountant().compose(SubsampledGaussian(sigma, q), steps).epsilon_bracket(delta)
    r_lo, r_hi = referee_epsilon([(sigma, q, steps)], delta)
    assert r_hi - r_lo <= 1e-6 * r_hi
    assert lo <= r_hi and r_lo <= hi          # our lower end is below the truth and our upper end above it


@pytest.mark.slow
@pytest.mark.parametrize("sigma, q, steps, delta, prv_low", [
    (0.6, 0.01, 100000, 1e-8, 126.024),      # prv_accountant 0.2 at eps_error 0.01: [126.024, 126.049]
    (0.9, 0.1, 3000, 1e-5, 65.309),         # prv: [65.309, 65.333]
])
def test_the_referee_settles_the_large_epsilon_disagreement_with_prv(sigma, q, steps, delta, prv_low):
    lo, hi = PLDAccountant().compose(SubsampledGaussian(sigma, q), steps).epsilon_bracket(delta)
    r_lo, r_hi = referee_epsilon([(sigma, q, steps)], delta)
    assert lo <= r_hi and r_lo <= hi
    if prv_low is not None:
        assert r_hi < prv_low                  # prv's certified lower end lies above the truth


@pytest.mark.parametrize("events, eps, match", [
    ([(0.0, 0.1, 10)], 1.0, "sigma"),
    ([(1.0, 1.5, 10)], 1.0, "q"),
    ([(1.0, 0.1, 0)], 1.0, "count"),
    ([], 1.0, "events"),
    ([(1.0, 0.1, 10)], -1.0, "epsilon"),
])
def test_bad_input_to_the_referee_names_the_argument(events, eps, match):
    with pytest.raises(ValueError, match=match):
        referee_delta(events, eps)


@pytest.mark.parametrize("sigma, q, steps, delta, truth", [
    (1.1, 256 / 60000, 14063, 1e-5, 2.381689725),      # the referee's enclosure, to 1e-8 (benchmarks page)
    (2.0, 1e-3, 1000000, 1e-9, 3.12043616),
    pytest.param(0.8, 1e-3, 50000, 1e-6, 2.02440556, marks=pytest.mark.slow),
    pytest.param(0.6, 0.01, 100000, 1e-8, 126.0192849, marks=pytest.mark.slow),
])
def test_a_refined_bracket_is_within_a_tenth_of_a_percent_and_holds_the_truth(sigma, q, steps, delta, truth):
    acc = PLDAccountant(bracket_rtol=1e-3).compose(SubsampledGaussian(sigma, q), steps)
    lo, hi = acc.epsilon_bracket(delta)
    assert hi - lo <= 1e-3 * hi
    assert lo <= truth * (1 + 1e-8) and truth * (1 - 1e-8) <= hi
    assert acc.epsilon(delta) == hi


def test_without_bracket_rtol_one_grid_is_used_and_a_refined_bracket_lies_inside_it():
    coarse = PLDAccountant().compose(SubsampledGaussian(2.0, 1e-3), 1000000).epsilon_bracket(1e-9)
    fine = PLDAccountant(bracket_rtol=1e-3).compose(SubsampledGaussian(2.0, 1e-3), 1000000).epsilon_bracket(1e-9)
    assert coarse[1] - coarse[0] > 1e-2 * coarse[1]            # 2.7 % wide on the default grid
    assert coarse[0] <= fine[0] <= fine[1] <= coarse[1]


@pytest.mark.parametrize("bad", [0.0, 1.0, -1e-3, float("nan")])
def test_bracket_rtol_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="bracket_rtol"):
        PLDAccountant(bracket_rtol=bad)

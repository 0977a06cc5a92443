"""The referee (Laplace inversion of the composed privacy loss, dpmath.referee) against closed forms, and our
PLD bracket against the referee."""

import math

import pytest
from scipy import integrate
from scipy.stats import norm

from dpmath import (
    HutchEnvelope,
    HutchPPEnvelope,
    PLDAccountant,
    PointMassEnvelope,
    SubsampledGaussian,
)
from dpmath.referee import referee_delta, referee_epsilon, referee_rc_delta, referee_rc_epsilon


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
    coarse = PLDAccountant(bracket_rtol=None).compose(SubsampledGaussian(2.0, 1e-3), 1000000).epsilon_bracket(1e-9)
    fine = PLDAccountant(bracket_rtol=1e-3).compose(SubsampledGaussian(2.0, 1e-3), 1000000).epsilon_bracket(1e-9)
    assert coarse[1] - coarse[0] > 1e-2 * coarse[1]            # 1.0 % wide on the coarse grid
    assert coarse[0] <= fine[0] <= fine[1] <= coarse[1]


@pytest.mark.parametrize("bad", [0.0, 1.0, -1e-3, float("nan")])
def test_bracket_rtol_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="bracket_rtol"):
        PLDAccountant(bracket_rtol=bad)


# --- randomized clipping ---------------------------------------------------------------------------------------

def _quadrature_delta(mu: float, q: float, eps: float) -> float:
    """The subsampled Gaussian's curve by adaptive quadrature of ``(p - e^eps q)_+``, both directions."""
    def hockey(p, r):
        return integrate.quad(lambda x: max(p(x) - math.exp(eps) * r(x), 0.0), -40, 40 + mu, limit=400,
                              epsabs=1e-14, epsrel=1e-12)[0]

    def mix(x):
        return q * norm.pdf(x - mu) + (1 - q) * norm.pdf(x)
    return max(hockey(mix, norm.pdf), hockey(norm.pdf, mix))


@pytest.mark.parametrize("sigma, q, eps", [(1.0, 0.1, 0.5), (0.5, 0.3, 3.0), (2.0, 1.0, 0.2), (1.0, 0.01, 0.005)])
def test_the_rc_referee_with_a_constant_scale_encloses_the_subsampled_gaussian_curve(sigma, q, eps):
    """Y = 1: the mechanism is the subsampled Gaussian; one step's enclosure (closed forms per scale bin) must
    hold an independent quadrature and be as narrow as the bins (resolution 2e-4)."""
    truth = _quadrature_delta(1.0 / sigma, q, eps)
    low, high = referee_rc_delta(sigma, q, PointMassEnvelope(1.0), 1, eps)
    assert low <= truth <= high
    assert high - low <= 2e-3 * truth


def test_the_rc_referee_composition_encloses_the_subsampled_gaussian_referee():
    """Its composition path (the bins' mixed MGF, Laplace inversion) against the Gaussian referee's: with
    Y = 1 the truth is the composed subsampled Gaussian."""
    truth = referee_delta([(1.0, 0.1, 20)], 1.5)
    low, high = referee_rc_delta(1.0, 0.1, PointMassEnvelope(1.0), 20, 1.5)
    assert low <= truth.low and truth.high <= high
    assert high - low <= 5e-3 * truth.value


@pytest.mark.parametrize("envelope, sigma, q, delta, truth", [
    # the three one-step cases of issue 16, where our bracket was [92.7, 123.2], [22.68, 24.25], [2.295, 2.328]
    (HutchEnvelope(8, 200), 0.8, 0.3, 1e-8, (105.5401, 105.5818)),
    (HutchEnvelope(4, 8), 3.0, 0.1, 1e-6, (23.4414, 23.4515)),
    (HutchEnvelope(32, 2048), 1.0, 0.05, 1e-6, (2.30992, 2.31113)),
    (HutchPPEnvelope(32, 2048), 1.0, 0.05, 1e-6, (2.31004, 2.31125)),
    pytest.param(HutchEnvelope(32, 2048), 2.0, 0.01, 1e-5, (0.0350341, 0.0350514), marks=pytest.mark.slow),
    pytest.param(HutchEnvelope(4, 64), 1.5, 0.5, 1e-5, (70.3904, 70.4186), marks=pytest.mark.slow),
    pytest.param(HutchEnvelope(2, 4), 4.0, 0.01, 1e-3, (0.00218553, 0.00218707), marks=pytest.mark.slow),
])
def test_our_rc_bracket_holds_the_refereed_one_step_epsilon(envelope, sigma, q, delta, truth):
    r_lo, r_hi = referee_rc_epsilon(sigma, q, envelope, 1, delta)
    assert r_hi - r_lo <= 1e-3 * r_hi                        # 0.01 to 0.05 %: 10 to 40 times narrower than ours
    assert truth[0] - 1e-4 * truth[0] <= r_lo and r_hi <= truth[1] + 1e-4 * truth[1]   # the values quoted in docs
    lo, hi = PLDAccountant().compose(SubsampledGaussian(sigma, q, envelope), 1).epsilon_bracket(delta)
    assert lo <= r_hi and r_lo <= hi
    assert hi - lo <= 0.02 * r_hi                            # 0.5 to 1.7 % wide on the default grid


@pytest.mark.parametrize("envelope, sigma, q, delta, truth", [
    (HutchEnvelope(32, 2048), 1.0, 0.05, 1e-6, (2.30992, 2.31113)),
    pytest.param(HutchEnvelope(8, 200), 0.8, 0.3, 1e-8, (105.5401, 105.5818), marks=pytest.mark.slow),
    pytest.param(HutchEnvelope(4, 8), 3.0, 0.1, 1e-6, (23.4414, 23.4515), marks=pytest.mark.slow),
])
def test_a_refined_rc_bracket_is_within_half_a_percent_and_holds_the_refereed_truth(envelope, sigma, q, delta,
                                                                                    truth):
    """Issue 16 item 1 for randomized clipping (0.5 %): one step's width is the scale grid's, which the
    refinement finds and shrinks (the truth is the referee's, from the test above)."""
    lo, hi = PLDAccountant(bracket_rtol=5e-3).compose(SubsampledGaussian(sigma, q, envelope)).epsilon_bracket(delta)
    assert hi - lo <= 5e-3 * hi
    assert lo <= truth[1] and truth[0] <= hi


@pytest.mark.slow
def test_our_rc_bracket_holds_the_refereed_composed_epsilon():
    """100 steps: the referee's bins are coarse (resolution 0.02: [4.387, 4.584]), so this checks that the
    composed truth lies inside both, not tightness."""
    env = HutchEnvelope(32, 2048)
    r_lo, r_hi = referee_rc_epsilon(1.0, 0.05, env, 100, 1e-5, resolution=0.02, rtol=1e-3)
    lo, hi = PLDAccountant().compose(SubsampledGaussian(1.0, 0.05, env), 100).epsilon_bracket(1e-5)
    assert lo <= r_hi and r_lo <= hi
    assert r_lo <= lo and hi <= r_hi                          # ours is the narrower


@pytest.mark.parametrize("kw, match", [
    ({"noise_multiplier": 0.0}, "noise_multiplier"), ({"sample_rate": 0.0}, "sample_rate"), ({"steps": 0}, "steps"),
    ({"epsilon": -1.0}, "epsilon"),
    ({"resolution": 0.5}, "resolution"), ({"tail": 0.1}, "tail"), ({"envelope": 3.0}, "envelope"),
])
def test_bad_input_to_the_rc_referee_names_the_argument(kw, match):
    args = {"noise_multiplier": 1.0, "sample_rate": 0.1, "envelope": HutchEnvelope(32, 2048), "steps": 1,
            "epsilon": 1.0} | kw
    with pytest.raises(ValueError, match=match):
        referee_rc_delta(**args)

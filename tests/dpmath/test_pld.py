"""The PLD accountant: soundness against closed forms, the bracket, monotonicity, mechanisms, errors."""

import math

import mpmath
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy import integrate, special, stats

from dpmath import (
    Gaussian,
    HutchEnvelope,
    HutchPPEnvelope,
    PLDAccountant,
    PointMassEnvelope,
    SubsampledGaussian,
)


def gaussian_delta(eps: float, mu: float) -> float:
    """Exact hockey-stick divergence of N(mu, 1) against N(0, 1)."""
    return float(stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2))


def subsampled_delta(eps: float, mu: float, q: float, relation: str) -> float:
    """Exact one-step delta of the Poisson-subsampled Gaussian (closed form, independent of dpmath)."""
    if relation == "remove":  # P = q N(mu) + (1-q) N(0), Q = N(0)
        if q < 1 and eps <= math.log1p(-q):
            return 1.0 - math.exp(eps)
        x = math.log((math.exp(eps) - (1 - q)) / q) / mu + mu / 2
        return q * special.ndtr(mu - x) + (1 - q) * special.ndtr(-x) - math.exp(eps) * special.ndtr(-x)
    if q < 1 and eps >= -math.log1p(-q):  # add: P = N(0), Q = q N(mu) + (1-q) N(0)
        return 0.0
    x = math.log((math.exp(-eps) - (1 - q)) / q) / mu + mu / 2
    return special.ndtr(x) - math.exp(eps) * (q * special.ndtr(x - mu) + (1 - q) * special.ndtr(x))


# --------------------------------------------------------------------------- exact Gaussian composition
def gaussian_delta_mp(eps: float, sigmas_counts: list[tuple[float, int]], digits: int = 400) -> mpmath.mpf:
    """delta(eps) of composed Gaussians in mpmath at ``digits`` digits (the difference cancels up to 300 of
    them at mu = 1e-300), from the floats given: independent of dpmath's evaluation."""
    with mpmath.workdps(digits):
        mu = mpmath.sqrt(mpmath.fsum(mpmath.mpf(n) / mpmath.mpf(s) ** 2 for s, n in sigmas_counts))
        e = mpmath.mpf(eps)
        return mpmath.ncdf(mu / 2 - e / mu) - mpmath.exp(e) * mpmath.ncdf(-mu / 2 - e / mu)


@settings(max_examples=40, deadline=None)
@given(log_sigma=st.floats(-2.0, 3.0), count=st.integers(1, 3000), eps=st.floats(0.0, 30.0))
def test_gaussian_composition_brackets_the_exact_delta_between_neighbouring_floats(log_sigma, count, eps):
    sigma = 10.0 ** log_sigma
    assume(eps * sigma / math.sqrt(count) < 500)   # the reference's mpmath ncdf is exact to arguments of 1e3
    lo, hi = PLDAccountant().compose(Gaussian(sigma), count).delta_bracket(eps)
    exact = gaussian_delta_mp(eps, [(sigma, count)])
    assert lo <= exact <= hi
    assert hi <= math.nextafter(math.nextafter(lo, 1.0), 1.0) or hi <= 5e-324   # at most two floats apart


@pytest.mark.parametrize(("sigma", "count", "delta"), [
    (1e-3, 1, 1e-5), (0.05, 7, 1e-10), (1.0, 1, 1e-5), (3.0, 1000, 0.3), (50.0, 10, 1e-12), (0.2, 3, 1 - 1e-9)])
def test_a_gaussian_epsilon_bracket_is_two_neighbouring_floats_around_the_exact_root(sigma, count, delta):
    lo, hi = PLDAccountant().compose(Gaussian(sigma), count).epsilon_bracket(delta)
    # delta(eps) decreases: the exact root is above lo (delta(lo) > delta) and at most hi (delta(hi) <= delta)
    assert gaussian_delta_mp(hi, [(sigma, count)]) <= delta
    assert lo == 0.0 or gaussian_delta_mp(lo, [(sigma, count)]) > delta
    assert hi <= math.nextafter(math.nextafter(lo, math.inf), math.inf)


@pytest.mark.parametrize("sigma", [1e-150, 1e-100, 1e-20])
def test_near_zero_gaussian_noise_gives_a_huge_finite_epsilon_in_closed_form(sigma):
    import tracemalloc

    tracemalloc.start()
    lo, hi = PLDAccountant().compose(Gaussian(sigma), 4).epsilon_bracket(1e-5)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 5e6   # in closed form: no loss grid (a grid of this range would hold billions of points)
    # mu = 2 / sigma: the root is mu^2/2 - mu Phi^-1(delta), less about 1 (the second term of delta is phi(a) / mu)
    with mpmath.workdps(60):
        mu = 2 / mpmath.mpf(sigma)
        first = mu * mu / 2 - mu * mpmath.mpf(float(special.ndtri(1e-5)))
        assert first - 2 <= hi and lo <= first
    assert hi <= math.nextafter(math.nextafter(lo, math.inf), math.inf) and math.isfinite(hi)


def test_gaussian_noise_too_small_for_a_float_epsilon_is_refused_and_its_delta_is_one():
    acc = PLDAccountant().compose(Gaussian(1e-300))
    with pytest.raises(ValueError, match=r"exceeds the largest float.*use a larger noise_multiplier"):
        acc.epsilon(1e-5)
    lo, hi = acc.delta_bracket(1.0)
    assert hi == 1.0 and lo == math.nextafter(1.0, 0.0)   # exactly 1 - (below 1e-300): the float under 1
    assert acc.tradeoff(1e-3) == 0.0


@pytest.mark.parametrize("sigma", [1e10, 1e100, 1e300])
def test_huge_gaussian_noise_gives_epsilon_zero_and_a_delta_that_is_never_rounded_to_zero(sigma):
    acc = PLDAccountant().compose(Gaussian(sigma))
    assert acc.epsilon_bracket(1e-5) == (0.0, 0.0)
    lo, hi = acc.delta_bracket(0.0)   # 2 Phi(mu/2) - 1 = mu / sqrt(2 pi) (1 - mu^2/24 + ...), mu = 1/sigma
    exact = 1 / mpmath.mpf(sigma) / mpmath.sqrt(2 * mpmath.pi)
    assert 0 < lo <= exact <= hi
    assert acc.delta_bracket(1.0)[1] > 0.0     # positive, if below every float: the smallest one


def test_a_gaussian_tradeoff_is_a_lower_bound_one_float_below_the_exact_curve():
    alpha = np.array([1e-300, 1e-12, 1e-3, 0.3, 1 - 1e-12])
    for sigma, count in ((0.5, 1), (2.0, 50), (1e10, 1)):
        beta = PLDAccountant().compose(Gaussian(sigma), count).tradeoff(alpha)
        with mpmath.workdps(80):
            mu = mpmath.sqrt(count / mpmath.mpf(sigma) ** 2)
            for a, b in zip(alpha, beta, strict=True):
                z = mpmath.findroot(lambda x, a=a: mpmath.ncdf(x) - a, float(special.ndtri(a)))
                exact = mpmath.ncdf(-z - mu)
                assert b <= exact and (exact == 0 or mpmath.mpf(math.nextafter(b, 2.0)) > exact * (1 - 1e-14))


def test_an_rdp_or_grid_accountant_at_extreme_noise_answers_or_says_what_to_do():
    from dpmath import GridTooLargeError, RDPAccountant

    assert RDPAccountant().compose(SubsampledGaussian(1e-300, 0.01), 10).epsilon(1e-5) == math.inf
    assert RDPAccountant().compose(Gaussian(1e-300), 10).epsilon(1e-5) == math.inf
    assert 0 < RDPAccountant().compose(Gaussian(1e300), 10).epsilon(1e-5) < 0.01
    mixed = PLDAccountant().compose(Gaussian(1e-300)).compose(SubsampledGaussian(1.0, 0.01), 10)
    with pytest.raises(GridTooLargeError, match=r"passes the largest float.*RDPAccountant.*more noise"):
        mixed.epsilon(1e-5)
    lo, hi = PLDAccountant().compose(Gaussian(1e300)).compose(SubsampledGaussian(1.0, 0.01), 10).epsilon_bracket(1e-5)
    assert 0 < lo <= hi < 0.4


@pytest.mark.parametrize("count", [9999, 10000])
@pytest.mark.parametrize("eps", [0.1, 1.0, 10.0, 100.0])
def test_prv_accountant_gaussian_cases(count, eps):
    # microsoft/prv_accountant's own test cases: sigma = 100 composed ~10^4 times
    mu = math.sqrt(count) / 100.0
    exact = gaussian_delta(eps, mu)
    lo, hi = PLDAccountant().compose(Gaussian(100.0), count).delta_bracket(eps)
    assert lo * (1 - 1e-12) <= exact <= hi * (1 + 1e-12)
    assert hi <= exact * (1 + 1e-6) + 1e-15


def test_heterogeneous_gaussian_composition():
    acc = PLDAccountant().compose(Gaussian(10.0), 50).compose(Gaussian(5.0), 50)
    exact = gaussian_delta(4.0, math.sqrt(50 / 100 + 50 / 25))
    lo, hi = acc.delta_bracket(4.0)
    assert lo * (1 - 1e-12) <= exact <= hi * (1 + 1e-12)
    assert hi <= exact * (1 + 1e-6)


def test_heterogeneous_subsampled_composition_equals_its_parts_merged():
    # two blocks of the same mechanism = one block of the sum, up to floating point
    m = SubsampledGaussian(1.2, 0.02)
    split = PLDAccountant().compose(m, 300).compose(m, 700).epsilon(1e-6)
    joint = PLDAccountant().compose(m, 1000).epsilon(1e-6)
    assert split == pytest.approx(joint, rel=1e-9)


def test_mixed_mechanisms_bracket_and_order():
    acc = PLDAccountant().compose(SubsampledGaussian(1.0, 0.01), 500).compose(Gaussian(20.0), 10)
    lo, hi = acc.epsilon_bracket(1e-6)
    alone = PLDAccountant().compose(SubsampledGaussian(1.0, 0.01), 500).epsilon(1e-6)
    assert lo <= hi
    assert hi > alone   # adding a mechanism cannot help


# --------------------------------------------------------------------------- one step: connect the dots
@given(sigma=st.floats(0.5, 20.0), q=st.floats(1e-3, 1.0), k=st.integers(-5000, 40000),
       relation=st.sampled_from(["add", "remove"]))
def test_one_step_upper_bound_is_exact_at_grid_points(sigma, q, k, relation):
    h = 1e-4
    eps = k * h
    mech = SubsampledGaussian(sigma, q)
    acc = PLDAccountant(h).compose(mech)
    comp = acc._composed(True)[0 if relation == "remove" else 1]
    exact = max(subsampled_delta(eps, 1 / sigma, q, relation), 0.0)
    got = comp.delta(eps) if eps >= 0 else comp.single.delta(eps)
    assert got >= exact - 1e-14
    assert got <= exact + 1e-9 * max(exact, 1e-6)


@given(sigma=st.floats(0.5, 20.0), q=st.floats(1e-3, 1.0), eps=st.floats(0.0, 4.0))
def test_one_step_bracket_contains_exact_delta_off_grid(sigma, q, eps):
    acc = PLDAccountant(1e-3).compose(SubsampledGaussian(sigma, q))
    exact = max(subsampled_delta(eps, 1 / sigma, q, "remove"), subsampled_delta(eps, 1 / sigma, q, "add"), 0.0)
    lo, hi = acc.delta_bracket(eps)
    assert lo <= exact + 1e-14
    assert hi >= exact - 1e-14


# --------------------------------------------------------------------------- monotonicity
@pytest.mark.slow  # 10-13 s: kept out of the README's 10-minute run
@given(sigma=st.floats(0.5, 5.0), q=st.floats(0.01, 0.8), steps=st.integers(1, 300))
def test_epsilon_is_monotone_in_sigma_q_and_steps(sigma, q, steps):
    def eps(s, qq, n):
        return PLDAccountant(1e-3).compose(SubsampledGaussian(s, qq), n).epsilon(1e-6)

    base = eps(sigma, q, steps)
    assert eps(sigma * 1.1, q, steps) <= base + 1e-12
    assert eps(sigma, min(1.0, q * 1.2), steps) >= base - 1e-12
    assert eps(sigma, q, steps + 7) >= base - 1e-12


@settings(max_examples=8)
@given(sigma=st.floats(0.5, 5.0), q=st.floats(0.01, 1.0), steps=st.integers(1, 300))
def test_delta_is_monotone_decreasing_in_epsilon(sigma, q, steps):
    # one grid's curve (the default bracket may read each epsilon on its own sequence of grids)
    acc = PLDAccountant(1e-3, bracket_rtol=None).compose(SubsampledGaussian(sigma, q), steps)
    grid = np.linspace(0.0, 12.0, 25)
    deltas = np.array([acc.delta(e) for e in grid])
    assert (np.diff(deltas) <= 1e-15).all()
    assert ((deltas >= 0) & (deltas <= 1)).all()


def test_epsilon_and_delta_are_inverse():
    acc = PLDAccountant().compose(SubsampledGaussian(1.0, 0.02), 2000)
    eps = acc.epsilon(1e-7)
    assert acc.delta(eps) == pytest.approx(1e-7, rel=1e-6)


# --------------------------------------------------------------------------- f-DP
@pytest.mark.parametrize(("alpha", "tpr"), [(1e-3, 0.01830), (1e-4, 0.003274), (1e-5, 0.0005475),
                                            (1e-6, 8.7218e-5)])
def test_gaussian_tradeoff_golden_numbers(alpha, tpr):
    beta = float(PLDAccountant().compose(Gaussian(1.0)).tradeoff(alpha))
    exact = float(stats.norm.cdf(stats.norm.ppf(alpha) + 1.0))
    assert 1 - beta >= exact * (1 - 1e-12)          # a lower bound on beta: never claims more privacy
    assert 1 - beta == pytest.approx(exact, rel=1e-4)
    assert 1 - beta == pytest.approx(tpr, rel=2e-3)  # the published (rounded) values


def test_tradeoff_is_a_tradeoff_function():
    acc = PLDAccountant().compose(SubsampledGaussian(1.0, 0.05), 300)
    alpha = np.linspace(0, 1, 201)
    beta = acc.tradeoff(alpha)
    assert beta[0] <= 1 and beta[-1] == 0
    assert (np.diff(beta) <= 1e-12).all()
    assert (beta <= 1 - alpha + 1e-12).all()
    # the curve implied by one (eps, delta) point bounds the true curve from below
    eps = acc.epsilon(1e-5)
    assert (beta >= np.maximum(0, 1 - 1e-5 - np.exp(eps) * alpha) - 1e-9).all()


# --------------------------------------------------------------------------- randomized clipping
def test_trivial_envelope_reproduces_subsampled_gaussian_exactly():
    plain = PLDAccountant().compose(SubsampledGaussian(2.0, 0.03), 400)
    for env in (PointMassEnvelope(1.0), HutchPPEnvelope(projection_dim=32, dim=16)):
        rc = PLDAccountant().compose(SubsampledGaussian(2.0, 0.03, env), 400)
        assert rc.epsilon_bracket(1e-6) == plain.epsilon_bracket(1e-6)
        assert rc.delta_bracket(1.0) == plain.delta_bracket(1.0)


def _rc_exact_delta(eps, sigma, q, k, relation):
    """E_Y[delta(eps; sigma sqrt(Y))] for Y = min(chi2(k)/k, 1) (Hutch++), by adaptive quadrature."""
    dens = stats.gamma(a=k / 2, scale=2 / k)

    def integrand(y):
        return subsampled_delta(eps, 1 / (sigma * math.sqrt(y)), q, relation) * dens.pdf(y)

    inner, _ = integrate.quad(integrand, 1e-9, 1.0, limit=400, epsabs=1e-15, epsrel=1e-11)
    return inner + dens.sf(1.0) * subsampled_delta(eps, 1 / sigma, q, relation)


# two cases in the default run (6.5 s each), all six with -m slow
@pytest.mark.parametrize(("eps", "relation"), [
    (0.0, "remove"), (0.1, "add"), *(pytest.param(e, r, marks=pytest.mark.slow)
                                     for e, r in ((0.0, "add"), (0.02, "remove"), (0.02, "add"), (0.1, "remove")))])
def test_randomized_clip_one_step_brackets_the_scale_average(eps, relation):
    # the mechanism is the Y-average of subsampled Gaussians: check it against direct quadrature
    sigma, q, k = 2.0, 0.05, 4
    mech = SubsampledGaussian(sigma, q, HutchPPEnvelope(projection_dim=k, dim=64), scale_resolution=1e-2)
    acc = PLDAccountant().compose(mech)
    comp_hi = acc._composed(True)[0 if relation == "remove" else 1]
    comp_lo = acc._composed(False)[0 if relation == "remove" else 1]
    exact = _rc_exact_delta(eps, sigma, q, k, relation)
    hi, lo = comp_hi.delta(eps), comp_lo.delta(eps)
    assert lo <= exact * (1 + 1e-9) + 1e-15
    assert hi >= exact * (1 - 1e-9) - 1e-15
    assert hi <= exact * 1.03 + 1e-12   # a 1e-2 scale resolution costs a few per cent at k = 4


@pytest.mark.slow  # about 8 s: kept out of the README's 10-minute run
def test_randomized_clipping_costs_privacy_and_more_probes_cost_less():
    sigma, q, steps = 3.0, 0.02, 500
    plain = PLDAccountant().compose(SubsampledGaussian(sigma, q), steps).epsilon(1e-5)
    by_k = [PLDAccountant().compose(SubsampledGaussian(sigma, q, HutchEnvelope(k, 256)), steps).epsilon(1e-5)
            for k in (16, 32, 128)]
    assert by_k[0] > by_k[1] > by_k[2] > plain


@pytest.mark.parametrize(("sigma", "q", "steps", "rtol"), [(4.36, 64 / 1139, 180, 0.005),
                                                            pytest.param(1.1, 0.004, 14000, 0.01,
                                                                         marks=pytest.mark.slow)])
def test_randomized_clipping_bracket_is_tight(sigma, q, steps, rtol):
    # both directions matter: the add direction's long negative loss tail must not be clipped
    env = HutchEnvelope(projection_dim=32, dim=2048)
    lo, hi = PLDAccountant().compose(SubsampledGaussian(sigma, q, env), steps).epsilon_bracket(1e-5)
    assert lo <= hi <= lo * (1 + rtol)


@pytest.mark.slow  # about 30 s
def test_refined_randomized_clipping_bracket_reaches_half_a_percent_at_small_sigma():
    # issue 16's hardest randomized-clipping configuration: the refinement shrinks the scale grid with the
    # loss grid (the first scale grid stopped at 2.6 %: its tail bins, not h, set the upper end); the finest
    # bracket measured with the earlier lower-bound split, [4.2696, 4.2883], must overlap it (both are sound)
    acc = PLDAccountant(bracket_rtol=5e-3).compose(SubsampledGaussian(0.8, 1e-3, HutchEnvelope(32, 2048)), 50000)
    lo, hi = acc.epsilon_bracket(1e-6)
    assert 4.26 < lo <= 4.2883 and 4.2696 <= hi <= lo * 1.005


@pytest.mark.parametrize("env", [HutchEnvelope(32, 2048), HutchEnvelope(1, 2048), HutchPPEnvelope(4, 64)],
                         ids=repr)
def test_scale_grid_is_fine_into_the_tail_and_bounded_in_size(env):
    from dpmath.pld import scale_atoms

    res = 2e-3
    scales, weights, unbounded = scale_atoms(env, res, True)
    assert 0 < unbounded <= 1.1e-20 and weights.sum() + unbounded == pytest.approx(1.0, abs=1e-12)
    assert scales.size < 6000 and np.all(np.diff(scales) < 0)   # k = 1: 5189, 3609 of them in its tail
    # atom i (scales decreasing, Y increasing) holds the bin of Y between 1/s_i^2 and 1/s_{i+1}^2; down to the
    # 1e-12 quantile of Y a bin is one scale step wide or holds at most a 1/256 decade of the tail's mass
    below = unbounded + np.cumsum(weights)[:-1]        # P(Y <= the bin's upper end)
    wide = scales[:-1] / scales[1:] - 1 > res * (1 + 1e-9)
    heavy = weights[:-1] > (1 - 10 ** (-1 / 256)) * below * 1.01
    assert not np.any(wide & heavy & (below >= 1e-12) & (below <= 1e-2))
    assert np.all(scales[:-1] / scales[1:] - 1 < 0.5)   # below 1e-12: an 1/8 decade (k = 1: a factor 1.33)


@pytest.mark.parametrize("k", [4, 8])
def test_a_heavy_tails_scale_bins_are_one_step_wide_where_its_large_losses_set_epsilon(k):
    # P(a > s) ~ s^-k: a bin of a 1/64 decade of mass spanned about 18 / k steps of a (four at k = 4), and a long
    # composition's epsilon in the thousands, set by one tail atom's loss ~a^2, kept a bracket of 0.97 % (Hutch k 4,
    # d 256, 51 steps); a 1/256 decade spans one step from k = 4 on
    from dpmath.pld import scale_atoms

    res = 1e-3
    scales, weights, unbounded = scale_atoms(HutchEnvelope(k, 256), res, True)
    below = unbounded + np.cumsum(weights)[:-1]
    tail = (below >= 1e-12) & (below <= 1e-2)
    assert tail.sum() > 100
    assert np.all(scales[:-1][tail] / scales[1:][tail] - 1 <= res * (1 + 1e-9))


@pytest.mark.slow  # 10-20 s: kept out of the README's 10-minute run
def test_unbounded_scale_mass_is_charged_to_delta():
    # with q = 1 the mass of Y below the scale grid is an infinite loss: delta never drops below it
    acc = PLDAccountant().compose(SubsampledGaussian(1.0, 1.0, HutchEnvelope(projection_dim=2, dim=4)))
    assert acc.delta(1e4) > 0


# --------------------------------------------------------------------------- errors and extremes
@pytest.mark.parametrize(("call", "name"), [
    (lambda: Gaussian(0.0), "noise_multiplier"),
    (lambda: Gaussian(-1.0), "noise_multiplier"),
    (lambda: Gaussian(float("nan")), "noise_multiplier"),
    (lambda: SubsampledGaussian(1.0, 0.0), "sample_rate"),
    (lambda: SubsampledGaussian(1.0, 1.5), "sample_rate"),
    (lambda: SubsampledGaussian(1.0, 0.1, "hutch"), "envelope"),
    (lambda: SubsampledGaussian(1.0, 0.1, PointMassEnvelope(), scale_resolution=0.5), "scale_resolution"),
    (lambda: PLDAccountant(discretization=0.0), "discretization"),
    (lambda: PLDAccountant(neighboring="swap"), "neighboring"),
    (lambda: PLDAccountant().compose(Gaussian(1.0), count=-3), "count"),
    (lambda: PLDAccountant().compose(Gaussian(1.0), count=2.5), "count"),
    (lambda: PLDAccountant().compose(Gaussian(1.0)).epsilon(0.0), "delta"),
    (lambda: PLDAccountant().compose(Gaussian(1.0)).epsilon(1.0), "delta"),
    (lambda: PLDAccountant().compose(Gaussian(1.0)).delta(-0.5), "epsilon"),
    (lambda: PLDAccountant().compose(Gaussian(1.0)).tradeoff(1.5), "alpha"),
    (lambda: PLDAccountant().compose("gaussian"), "mechanism"),
    (lambda: PLDAccountant("1e-4", "replace_one").compose(
        SubsampledGaussian(1.0, 0.1, PointMassEnvelope())), "replace_one"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_failed_compose_leaves_the_ledger_unchanged():
    acc = PLDAccountant().compose(Gaussian(2.0), 10)
    before = acc.epsilon(1e-5)
    with pytest.raises(ValueError):
        acc.compose(Gaussian(2.0), count=0)
    assert len(acc.events) == 1 and acc.epsilon(1e-5) == before


@pytest.mark.parametrize(("sigma", "q", "steps", "delta"), [
    (0.3, 1.0, 1, 1e-12),
    (100.0, 1.0, 10**6, 1e-12),
    (100.0, 1e-6, 10**6, 1e-12),
    # 5-6 s each: the README run keeps the tiny-q and 1e-12 cases in their own value tests
    # (test_at_a_tiny_sampling_rate_..., test_small_delta_tails_match_the_prv_bracket)
    pytest.param(0.3, 1e-6, 10**6, 1e-12, marks=pytest.mark.slow),
    (1.0, 1e-3, 10**6, 1e-10),
    pytest.param(0.3, 1e-4, 10**4, 1e-12, marks=pytest.mark.slow),
    (0.3, 1.0, 10**6, 1e-5),
    (0.3, 0.01, 10**6, 1e-5),
])
def test_extreme_regimes_give_finite_brackets_or_a_clear_error(sigma, q, steps, delta):
    acc = PLDAccountant().compose(SubsampledGaussian(sigma, q), steps)
    try:
        lo, hi = acc.epsilon_bracket(delta)
    except ValueError as exc:
        assert "discretization" in str(exc)
        return
    assert math.isfinite(lo) and math.isfinite(hi)
    assert 0 <= lo <= hi


def test_small_delta_tails_match_the_prv_bracket():
    # a 1e-12 tail is below the noise floor of a plain FFT (dp_accounting gives 28.98 here); the
    # tilted composition agrees with prv_accountant's certified bracket [29.3789, 29.4010]
    lo, hi = PLDAccountant().compose(SubsampledGaussian(0.3, 1e-4), 10**4).epsilon_bracket(1e-12)
    assert lo <= 29.401 and 29.3789 <= hi <= 29.401


def test_replace_one_relation():
    # q = 1: replacing an example is a Gaussian with twice the shift
    rep = PLDAccountant(neighboring="replace_one").compose(Gaussian(2.0)).epsilon(1e-5)
    assert rep == pytest.approx(PLDAccountant().compose(Gaussian(1.0)).epsilon(1e-5), rel=1e-9)
    sub = PLDAccountant(neighboring="replace_one").compose(SubsampledGaussian(1.0, 0.01), 100).epsilon(1e-5)
    add_remove = PLDAccountant().compose(SubsampledGaussian(1.0, 0.01), 100).epsilon(1e-5)
    assert add_remove < sub < 2.2 * add_remove


def test_a_grid_over_the_size_limit_raises_the_typed_error_that_calibration_catches():
    from dpmath import GridTooLargeError

    with pytest.raises(GridTooLargeError, match="coarser discretization"):
        PLDAccountant(1e-7).compose(SubsampledGaussian(0.05, 0.5), 1).epsilon(1e-5)
    assert issubclass(GridTooLargeError, ValueError)   # code that caught ValueError keeps working


@pytest.mark.parametrize(("sigma", "steps", "advice"), [
    (1e-3, 1000, r"losses reach 5.1e\+05 nats \(a far tail.*discretization=0.03 for one step.*fits but is slow; "
                 r"or bound epsilon with dpmath.RDPAccountant where it supports the mechanism"),
    (1.0, 10**12, r"losses reach 8.39e\+07 nats \(a far tail.*discretization=0.0089.*"
                  r"dpmath.RDPAccountant where it supports the mechanism"),
    (1.0, 10**18, r"which no discretization up to 1 holds .*: bound epsilon with dpmath.RDPAccountant.*fewer steps"),
])
def test_a_grid_too_large_says_what_to_do_and_names_no_private_module(sigma, steps, advice):
    from dpmath import GridTooLargeError

    with pytest.raises(GridTooLargeError, match=advice) as err:
        PLDAccountant().compose(SubsampledGaussian(sigma, 0.01), steps).epsilon(1e-5)
    for text in (str(err.value), repr(err.value)):
        assert "dpmath.pld" not in text and "._" not in text and " _" not in text
    assert err.type.__module__.split(".")[:2] == ["dpmath", "pld"]   # a public module's class


@pytest.mark.parametrize("relation", ["remove", "add"])
@pytest.mark.parametrize("upper", [True, False])
def test_scales_sharing_a_grid_are_one_mixture_with_the_weighted_masses(relation, upper):
    from dpmath.pld.losses import mixture_masses, sparse_points, step_grid

    q, h = 0.01, 1e-3
    mus = np.array([0.9, 1.3, 2.0, 3.1])
    weights = np.array([0.5, 0.3, 0.15, 0.05])
    k_lo, k_hi, n = step_grid(3.1, q, relation, h, 9.0, max_points=500)
    assert n is not None and n >= 500 and k_hi - k_lo + 1 > 500   # sparse, rounded up to a bucket
    idx = sparse_points(k_lo, k_hi, n)
    assert idx[0] == k_lo and idx[-1] == k_hi and np.all(np.diff(idx) > 0)
    whole = mixture_masses(mus, weights[None], q, relation, h, (upper,), k_lo, k_hi, idx)[0]
    parts = [mixture_masses(mus[i:i + 1], weights[None, i:i + 1], q, relation, h, (upper,), k_lo, k_hi, idx)[0]
             for i in range(4)]
    for field in ("p_int", "q_int", "atoms"):
        summed = sum(getattr(p, field) for p in parts)
        np.testing.assert_allclose(getattr(whole, field), summed, rtol=1e-13, atol=1e-300)
    assert whole.inf == pytest.approx(sum(p.inf for p in parts), rel=1e-13, abs=1e-300)
    # the upper bound keeps all of P's mass (below the grid at its first point, above it at the last and +inf);
    # the lower bound drops what lies below the grid
    total = whole.p_int.sum() + whole.atoms.sum() + whole.inf
    assert total == pytest.approx(1.0, abs=1e-12) if upper else total <= 1.0 + 1e-12


@pytest.mark.parametrize("relation", ["remove", "add"])
def test_bounds_computed_together_from_shared_cdfs_equal_each_computed_alone(relation):
    # a randomized-clipping step builds its upper and lower bounds in one pass over the scales (each row of
    # weights is one bound's bins); nothing may leak between the rows
    from dpmath.pld.losses import mixture_masses, sparse_points, step_grid

    q, h = 0.02, 1e-3
    mus = np.array([0.8, 1.1, 1.7, 2.6])
    weights = np.array([[0.0, 0.6, 0.3, 0.1], [0.55, 0.3, 0.15, 0.0]])   # upper: bin tops; lower: bin bottoms
    k_lo, k_hi, n = step_grid(2.6, q, relation, h, 9.0, max_points=600)
    idx = sparse_points(k_lo, k_hi, n)
    both = mixture_masses(mus, weights, q, relation, h, (True, False), k_lo, k_hi, idx)
    for row, upper in enumerate((True, False)):
        alone = mixture_masses(mus, weights[row:row + 1], q, relation, h, (upper,), k_lo, k_hi, idx)[0]
        for field in ("p_int", "q_int", "atoms"):
            np.testing.assert_allclose(getattr(both[row], field), getattr(alone, field), rtol=1e-14, atol=1e-300)
        assert both[row].inf == pytest.approx(alone.inf, rel=1e-14, abs=1e-300)
    assert both[1].inf == 0.0 and both[1].atoms[0] == 0.0   # the lower bound drops what lies below the grid


def test_normal_interval_masses_keep_relative_accuracy_in_both_tails_and_across_the_median():
    # each mass from the tail it lies in: against mpmath at 50 digits, on rows that cross 0 (once, between two
    # points, or exactly at one) and rows wholly in either tail, down to masses of 1e-300
    import mpmath

    from dpmath.pld.losses import interval_masses

    rows = np.array([np.linspace(-37.0, 37.0, 41), np.linspace(-38.5, -8.0, 41), np.linspace(8.0, 38.0, 41),
                     np.r_[np.linspace(-2.0, 0.0, 21), np.linspace(0.05, 2.0, 20)],
                     np.r_[-np.inf, np.linspace(-1e-3, 1e-3, 39), np.inf]])
    masses, first, last_sf = interval_masses(rows)
    mpmath.mp.dps = 50

    def tail(v: float) -> mpmath.mpf:   # the smaller tail, so that no difference of the reference cancels
        return mpmath.ncdf(-abs(mpmath.mpf(v)))

    for r, row in enumerate(rows):
        for j, got in enumerate(masses[r]):
            a, b = float(row[j]), float(row[j + 1])
            want = tail(b) - tail(a) if b <= 0 else tail(a) - tail(b) if a >= 0 else 1 - tail(a) - tail(b)
            # ndtr's own relative error (1e-13 near 1e-300), plus the rounding of two tail values differenced
            bound = 1e-12 * want + 4 * np.finfo(float).eps * max(tail(a), tail(b))
            assert abs(got - want) <= bound + 1e-305, (r, j, got, want)
        assert first[r] == pytest.approx(float(mpmath.ncdf(float(row[0]))), rel=1e-12, abs=1e-305)
        assert last_sf[r] == pytest.approx(float(mpmath.ncdf(-float(row[-1]))), rel=1e-12, abs=1e-305)


def test_the_add_direction_of_a_randomized_clipping_step_costs_no_normal_cdf_after_remove(monkeypatch):
    # adding an example is removing it with the pair swapped: on the mirrored grids its masses are the removal's
    # cached sums, read in reverse, and the step equals the one built from its own (mirrored) grid's CDFs
    import dpmath.pld.losses as losses
    from dpmath import HutchEnvelope, SubsampledGaussian
    from dpmath.pld.steps import scale_sums, step_plds

    m = SubsampledGaussian(1.0, 0.02, HutchEnvelope(16, 512))
    scale_sums.cache_clear()
    step_plds(m, "remove", 1e-3, (True, False), 40)
    calls = []
    original = losses.interval_masses
    monkeypatch.setattr(losses, "interval_masses", lambda u: calls.append(u.size) or original(u))
    add = step_plds(m, "add", 1e-3, (True, False), 40)
    assert calls == []
    scale_sums.cache_clear()
    fresh = step_plds(m, "add", 1e-3, (True, False), 40)
    assert sum(calls) > 10**5
    for a, b in zip(add, fresh, strict=True):
        assert a.start == b.start and a.inf == b.inf
        np.testing.assert_array_equal(a.pmf, b.pmf)


def test_an_rc_upper_end_is_the_same_number_with_or_without_its_lower_end():
    # the bracket's upper end is built together with the lower end (shared CDFs); the published epsilon is
    # built alone: they must agree to the last bit, or a user sees two different epsilons for one run
    from dpmath import HutchEnvelope, SubsampledGaussian

    m = SubsampledGaussian(1.0, 0.05, HutchEnvelope(16, 512))
    alone = PLDAccountant(1e-3).compose(m, 40).epsilon(1e-5)
    lo, hi = PLDAccountant(1e-3).compose(m, 40).epsilon_bracket(1e-5)
    assert lo < hi == alone


def test_the_read_out_of_a_million_point_grid_is_on_its_bounds_side_of_the_exact_discrete_curve():
    """The top-down sum of 1.6M points once read delta 1.4e-12 below the discrete PLD's own value near delta = 1;
    its rounding is charged now, outward for each bound, at grid points, between them and below the grid."""
    from dpmath.pld.distribution import Pld

    rng = np.random.default_rng(7)
    pmf = rng.random(1_600_000) ** 4
    pmf *= 0.999 / pmf.sum()
    h, start = 1e-5, -300_000
    eps = np.array([-3.1, -2.9999937, -1.0, 0.0, 0.5, 4.2, 12.3456789])
    for e in eps:
        t = (start + np.arange(pmf.size)) * h
        terms = pmf * np.maximum(-np.expm1(e - t), 0.0)   # each within 2 eps of its exact value
        exact = 1e-3 + math.fsum(terms)
        for upper in (True, False):
            pld = Pld(h, start, pmf, 1e-3, upper)
            got = (pld.delta(float(e)), float(pld.deltas(np.array([e]))[0]))
            for g in got:
                assert g >= exact * (1 + 4e-16) if upper else g <= exact * (1 - 4e-16)
                assert abs(g - exact) <= 1e-8 * exact   # the charge: at most 5 eps per point below


TOL_REFERENCE = 1e-15   # _exact_delta's rounding: a few units of its terms, each at most 1


def _exact_delta(mus, weights, q, relation, eps):
    """The hockey-stick curve of a weighted mixture of subsampled-Gaussian pairs, P(L > eps) - e^eps Q(L > eps)."""
    from dpmath.pld.losses import pair_cdfs

    out = np.zeros_like(eps)
    for mu, w in zip(mus, weights, strict=True):
        _, p_sf, _, q_sf = pair_cdfs(eps, mu, q, relation)
        out += w * (p_sf - np.exp(eps) * q_sf)
    return out


@pytest.mark.parametrize("relation", ["remove", "add"])
@pytest.mark.parametrize(("mus", "weights", "q", "h", "points"), [
    ([1.25], [1.0], 1e-3, 1e-4, None),                     # small q: a loss spike at log(1 - q), 10 h below 0
    ([1 / 0.6], [1.0], 0.01, 1e-4, None),
    ([0.7, 1.2, 2.5, 4.0], [0.4, 0.3, 0.2, 0.1], 0.05, 1e-3, 400),   # a mixture of scales on a sparse grid
    ([3.0], [1.0], 1.0, 2e-2, None),                      # the Gaussian mechanism on a coarse grid
])
def test_the_lower_split_lies_below_the_exact_curve_everywhere_and_the_upper_above(relation, mus, weights, q, h,
                                                                                  points):
    # a lower bound on a composition needs a pair whose curve is below the exact one at *every* epsilon, not
    # only at the grid points (Blackwell); the upper split is the chord through the grid points, above it
    from dpmath.pld.discretize import assemble, split
    from dpmath.pld.losses import mixture_masses, sparse_points, step_grid

    mus, weights = np.array(mus), np.array(weights)
    k_lo, k_hi, n = step_grid(float(mus.max()), q, relation, h, 9.0, max_points=points or 1 << 25)
    idx = None if n is None else sparse_points(k_lo, k_hi, n)
    t = (np.arange(k_lo, k_hi + 1) if idx is None else idx) * h
    mids = 0.5 * (t[1:] + t[:-1])
    mids = mids[np.abs(mids) < 4]    # between grid points, where connect-the-dots is furthest above
    eps = np.concatenate([np.linspace(-3, 4, 3001), mids])
    exact = _exact_delta(mus, weights, q, relation, eps)
    curves = {}
    for upper in (True, False):
        masses = mixture_masses(mus, weights[None], q, relation, h, (upper,), k_lo, k_hi, idx)[0]
        pld = assemble([split(masses, h, upper)], h, upper)
        assert np.all(pld.pmf >= 0) and pld.pmf.sum() <= 1 + 1e-12
        curves[upper] = np.array([pld.delta(e) for e in eps])
    assert np.all(curves[False] <= exact + TOL_REFERENCE)
    assert np.all(curves[True] >= exact - TOL_REFERENCE)
    # and about as close below as connect-the-dots is above (measured: 1.0 to 2.0 times the largest gap)
    assert np.max(exact - curves[False]) <= 3 * np.max(curves[True] - exact)


def test_the_lower_end_is_as_tight_as_the_upper_end_at_small_sampling_rates():
    # issue 16: at (0.8, 1e-3, 5e4, 1e-6) the greedy post-processing split gave [1.96834, 2.02483] (2.8 %) at
    # h = 1e-4; the lowered curve is second order in h like connect-the-dots (the referee's epsilon is 2.0244056)
    lo, hi = PLDAccountant(1e-4).compose(SubsampledGaussian(0.8, 1e-3), 50000).epsilon_bracket(1e-6)
    assert lo <= 2.0244056 <= hi
    assert hi - lo <= 1e-3 * hi and 2.0244056 - lo <= 3 * (hi - 2.0244056)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(log_mus=st.lists(st.floats(-0.5, 2.0), min_size=1, max_size=4), log_q=st.floats(-3.0, 0.0),
       log_h=st.floats(-4.0, -2.0), points=st.integers(100, 3000), relation=st.sampled_from(["remove", "add"]))
def test_both_splits_bracket_the_exact_curve_of_any_scale_mixture(log_mus, log_q, log_h, points, relation):
    # shifts over 2.5 decades on sparse grids: spikes at log(1 - q) between grid points, Q-masses that
    # underflow in the top tail, caps that bind, intervals rounded down, dropped points of the minorant
    from dpmath import GridTooLargeError
    from dpmath.pld.discretize import assemble, split
    from dpmath.pld.losses import mixture_masses, sparse_points, step_grid

    mus = np.sort(10.0 ** np.array(log_mus))
    weights = np.linspace(1.0, 2.0, mus.size) / np.linspace(1.0, 2.0, mus.size).sum()
    q, h = 10.0 ** log_q, 10.0 ** log_h
    try:
        k_lo, k_hi, n = step_grid(float(mus[-1]), q, relation, h, 9.0, max_points=points)
    except GridTooLargeError:
        assume(False)
    assume(k_hi - k_lo < 1 << 21)   # the read-out's dense array stays small
    idx = None if n is None else sparse_points(k_lo, k_hi, n)
    t = (np.arange(k_lo, k_hi + 1) if idx is None else idx) * h
    mids = 0.5 * (t[1:] + t[:-1])
    near = np.abs(mids) < 30
    eps = np.concatenate([np.linspace(-3, 30, 301), mids[near][::max(1, near.sum() // 300)]])
    exact = _exact_delta(mus, weights, q, relation, eps)
    for upper in (True, False):
        masses = mixture_masses(mus, weights[None], q, relation, h, (upper,), k_lo, k_hi, idx)[0]
        pld = assemble([split(masses, h, upper)], h, upper)
        assert np.all(pld.pmf >= 0) and pld.pmf.sum() + pld.inf <= 1 + 1e-12
        curve = np.array([pld.delta(e) for e in eps])
        # the read-out charges its rounding (Pld._curves: near delta = 1 the top-down sum of a million terms once
        # fell 1.4e-12 below the exact curve), so only the reference's own rounding is allowed for
        tol = TOL_REFERENCE
        assert np.all(curve >= exact - tol) if upper else np.all(curve <= exact + tol)


@pytest.mark.parametrize("relation", ["remove", "add"])
def test_a_band_over_the_examples_losses_brackets_the_exact_curve_and_rounds_them_finely(relation):
    # mu = 30: the example's own outputs put mass q on losses 445 +- 9 * 30, far beyond the points near zero; a
    # band of evenly spaced points covers them (the geometric points had rounded them by 0.5 %), and both splits
    # on it still bracket the exact curve at every epsilon ("add" reads the mirrored grid, as scale_sums does)
    from dpmath.pld.discretize import assemble, split
    from dpmath.pld.losses import band_start, mixture_masses, sparse_points, step_grid

    mus, weights, q, h = np.array([24.0, 27.0, 30.0]), np.array([0.5, 0.3, 0.2]), 0.01, 1e-2
    k_lo, k_hi, n = step_grid(30.0, q, "remove", h, 9.0, max_points=4096, shared=True)
    band = int(band_start(30.0, q, h, 9.0))
    assert 2 * n < band < k_hi
    idx = sparse_points(k_lo, k_hi, n, band)
    assert np.diff(idx[idx >= band]).max() <= (k_hi - band) / (n // 4) + 1    # about 1.1 nats apart at 445
    if relation == "add":
        k_lo, k_hi, idx = -k_hi, -k_lo, -idx[::-1]
    t = idx * h
    mids = 0.5 * (t[1:] + t[:-1])
    eps = np.concatenate([np.linspace(-3, 690, 2001), mids[(mids > -3) & (mids < 690)][::7]])
    exact = _exact_delta(mus, weights, q, relation, eps)
    plds, curves = {}, {}
    for upper in (True, False):
        masses = mixture_masses(mus, weights[None], q, relation, h, (upper,), k_lo, k_hi, idx)[0]
        plds[upper] = assemble([split(masses, h, upper)], h, upper)
        curves[upper] = np.array([plds[upper].delta(e) for e in eps])
    assert np.all(curves[True] >= exact - TOL_REFERENCE) and np.all(curves[False] <= exact + TOL_REFERENCE)
    if relation == "remove":
        # where the band holds the example's mass, epsilon's bracket is 2e-4 wide (the geometric points': 2.4e-3
        # to 3.5e-3, measured)
        for d in (1e-3, 1e-5, 1e-7):
            hi, lo = plds[True].epsilon(d), plds[False].epsilon(d)
            assert 400 < lo <= hi <= lo * (1 + 5e-4)


def test_a_band_changes_only_the_points_above_zero_loss():
    # at q = 0.5 and h = 1e-4 a removing step's least loss, log(1 - q), is 6,931 grid points below zero, beyond the
    # points near zero: the geometric points down to it hold the example-free outputs' mass, with a band or without
    from dpmath.pld.losses import sparse_points

    k_lo, k_hi, n = -7000, 600_000, 8192
    plain, banded = sparse_points(k_lo, k_hi, n), sparse_points(k_lo, k_hi, n, 300_000)
    assert np.all(np.diff(banded) > 0) and banded[0] == k_lo and banded[-1] == k_hi
    np.testing.assert_array_equal(banded[banded <= n // 4], plain[plain <= n // 4])
    assert np.diff(banded[banded >= 300_000]).max() <= (k_hi - 300_000) / (n // 4) + 1


def test_a_lower_end_of_zero_is_refined_until_it_is_positive():
    # q mu = 1e-4 = h: one step's losses span a few grid points and the first grid's lower end is 0; the
    # bracket refines until it is not (the referee's epsilon is 0.156892074 to 0.156892087)
    lo, hi = PLDAccountant(1e-4).compose(SubsampledGaussian(1.0, 1e-4), 100000).epsilon_bracket(1e-6)
    assert 0 < lo <= 0.156892073 and 0.156892087 <= hi <= lo * 1.005
    # the default's published upper end alone (epsilon) is that bracket's; the coarse grid's does not refine
    assert PLDAccountant(1e-4).compose(SubsampledGaussian(1.0, 1e-4), 100000).epsilon(1e-6) == hi
    assert PLDAccountant(1e-4, bracket_rtol=None).compose(SubsampledGaussian(1.0, 1e-4), 100000).epsilon(1e-6) > 0.16


def test_at_a_tiny_sampling_rate_the_published_epsilon_is_not_swamped_by_fft_rounding():
    # q mu = 2e-6, far below h: most of a step's mass sits on two grid points, the spectrum stays near modulus 1
    # and its 10^4-th power amplifies rounding; the float64 error bound (1.1e-8, charged to delta = 1e-9) made
    # the upper end 0.16678.  The pass is redone in extended precision.  dp_accounting (no error bound) gives
    # 0.138402 at h = 1e-4 and 0.138407 at 3e-5
    from dpmath.pld.compose import EXTENDED

    if not EXTENDED:
        pytest.skip("long double is no wider than double on this platform")
    eps = PLDAccountant(1e-4).compose(SubsampledGaussian(0.5, 1e-6), 10_000).epsilon(1e-9)
    assert 0.1383 <= eps <= 0.1386


def _lopsided_factor():
    """A lopsided step law on 60 points (grid 1e-2 from -0.1) composed 500 times, with its composition's full
    index range."""
    from dpmath.pld.compose import Factor
    from dpmath.pld.distribution import Pld

    pmf = np.random.default_rng(3).random(60) ** 4
    pmf /= pmf.sum()
    return Factor(Pld(1e-2, -10, pmf, 0.0, True), 500), 500 * -10, 500 * 49


def test_every_pass_charges_its_inputs_and_untilting_rounding_relative_to_each_value():
    # 500 steps of float64 tilted weights: each value's bound holds at least n * 4 * eps of it (the inputs'
    # rounding) on top of the FFT's absolute error, in the float64 pass too, and a trimmed pass starts at the
    # first value whose bound is at most half of it
    from dpmath.pld.compose import tilted_product

    factor, lo, hi = _lopsided_factor()
    a, val, err = tilted_product([factor], 0.7, lo, hi, lo, hi, 1e-2)
    assert a == lo and np.all(err >= 500 * 4 * np.finfo(np.float64).eps * np.abs(val))
    first, tval, terr = tilted_product([factor], 0.7, lo, hi, lo, hi, 1e-2, trim=True)
    assert first > lo and terr[0] <= 0.5 * abs(tval[0])
    j = first - lo
    assert np.all(err[:j] > 0.5 * np.abs(val[:j]))
    np.testing.assert_allclose(tval, val[j:], rtol=1e-15, atol=0)


def test_an_extended_precision_pass_agrees_with_float64_and_has_a_far_smaller_error_bound():
    from dpmath.pld.compose import EXTENDED, tilted_product

    if not EXTENDED:
        pytest.skip("long double is no wider than double on this platform")
    factor, lo, hi = _lopsided_factor()
    _, val, err = tilted_product([factor], 0.7, lo, hi, lo, hi, 1e-2)
    _, val_x, err_x = tilted_product([factor], 0.7, lo, hi, lo, hi, 1e-2, extended=True)
    assert np.all(np.abs(val - val_x) <= err + err_x)        # both enclose the same exact composition
    # the FFT's rounding is 2000 times finer; near the peak the float64 inputs' relative error is what is left
    assert np.all(err_x <= err)
    noisy = err > 1e-6 * np.abs(val)   # where float64 rounding matters: the far tails
    assert noisy.sum() > 1000 and np.all(err_x[noisy] <= 1e-2 * err[noisy])


@pytest.mark.parametrize("n", [1, 30, 3000])
def test_the_composition_windows_chernoff_search_finds_the_best_exponent_and_a_true_bound(n):
    # one factor (a lopsided law on 40 lattice points) composed n times: the Newton search's distance is
    # within 1e-3 of the best over a dense theta grid, and the exact mass beyond it is at most the tail
    from dpmath.pld.compose import chernoff

    w = np.random.default_rng(5).random(40) ** 3
    w[-3:] *= 20.0   # a cluster at the top: a skewed tail
    w /= w.sum()
    t = np.arange(40) * 0.1
    m = float(w @ t)
    var = n * float(w @ (t - m) ** 2)
    c = t - m
    parts = [(n, np.log(w), c, c * c)]
    tail = 1e-12
    theta, k0 = chernoff(parts, var, math.sqrt(var), level=-math.log(tail))
    dist = (k0 - math.log(tail)) / theta
    grid = np.geomspace(1e-4, 300, 20001) / math.sqrt(var)
    cum = n * special.logsumexp(np.log(w)[None, :] + grid[:, None] * c[None, :], axis=1)
    dense = float(np.min((cum - math.log(tail)) / grid))
    assert dense * (1 - 1e-9) <= dist <= dense * (1 + 1e-3)   # the optimum (to rounding), or within 1e-3
    law = np.array([1.0])
    for _ in range(min(n, 30)):
        law = np.convolve(law, w)   # the exact law of the sum on the lattice (n <= 30)
    lattice = np.arange(law.size) * 0.1 - n * m
    if n <= 30:
        assert float(law[lattice >= dist].sum()) <= tail
    # the mass form: K(theta) - theta D at the search's theta is at most every grid point's value
    far = 2.0 * math.sqrt(var)
    theta2, k2 = chernoff(parts, var, math.sqrt(var), dist=far)
    dense2 = float(np.min(cum - grid * far))
    assert k2 - theta2 * far <= dense2 + 1e-6 * abs(dense2)
    if n <= 30:
        assert float(law[lattice >= far].sum()) <= math.exp(k2 - theta2 * far)


def test_an_rc_direction_whose_coarse_upper_end_is_below_is_never_built_on_the_query_grid():
    """Adding an example (epsilon 1.73) is far below removing one (6.18): its upper end on the coarse grid
    (1e-3, 4 scale steps) settles it, so only the removal's steps are built on the query's grid, and the
    bracket still equals the maximum over both directions built in full."""
    acc = PLDAccountant().compose(SubsampledGaussian(0.8, 0.02, HutchEnvelope(32, 2048)), 200)
    lo, hi = acc.epsilon_bracket(1e-6)
    h, s = acc.first_grid
    assert sorted({(h, s, rel) for h, _, s, rel in acc._plds}) == [(1e-4, s, ("remove",)), (1e-3, 4.0, ("add",))]
    built = max(c.epsilon(1e-6) for c in acc._composed(True, h, s))
    assert built <= hi <= built * (1 + 1e-8)   # moved up only to agree with the delta read back
    assert lo == max(c.epsilon(1e-6) for c in acc._composed(False, h, s))
    assert acc._composed(True, h, s)[1].epsilon(1e-6) < 0.3 * hi


@pytest.mark.parametrize("sigma, q, steps, first", [
    (2.0, 1e-3, 10**6, 5e-5),      # plain step's mean gap 1.9 % at h0: the bracket is mostly loss grid
    (0.8, 1e-3, 50000, 1e-4),      # 0.14 %: neither
    (0.6, 0.01, 100000, 4e-4),     # 7.9e-5 even at 4 h0: the bracket is all scale grid
])
def test_a_refined_rc_bracket_starts_on_the_loss_grid_its_share_calls_for(sigma, q, steps, first):
    """A 0.5 % target starts with the scale step halved and the loss step at h0 / 2, h0 or 4 h0, as a plain
    step's mean gap puts the loss grid's share of the width above half the target, between, or below 1/64
    of it."""
    env = HutchEnvelope(32, 2048)
    acc = PLDAccountant(bracket_rtol=5e-3).compose(SubsampledGaussian(sigma, q, env), steps)
    assert acc._first_loss_step(5e-3) == first


def test_a_refined_rc_bracket_from_a_coarse_loss_grid_still_reaches_its_target():
    env = HutchEnvelope(32, 2048)
    acc = PLDAccountant(bracket_rtol=5e-3).compose(SubsampledGaussian(0.8, 0.02, env), 200)
    assert acc._mean_gap(4e-4) <= 5e-3 / 32
    lo, hi = acc.epsilon_bracket(1e-6)
    assert hi - lo <= 5e-3 * hi
    assert {(h, s) for h, _, s, _ in acc._plds} == {(4e-4, 0.5), (1e-3, 4.0)}
    ref_lo, ref_hi = PLDAccountant(bracket_rtol=5e-3, discretization=2.5e-5).compose(
        SubsampledGaussian(0.8, 0.02, env), 200).epsilon_bracket(1e-6)
    assert max(lo, ref_lo) <= min(hi, ref_hi)     # both hold the truth


@pytest.mark.parametrize("mechanism, steps, delta, skipped", [
    pytest.param(SubsampledGaussian(0.6, 0.01), 100000, 1e-8, True,   # add's epsilon 96.2 against remove's 126.0
                 marks=pytest.mark.slow),   # 5 s; the next case is skipped as well
    (SubsampledGaussian(0.9, 0.1), 3000, 1e-5, True),         # 50.3 against 65.3
    (SubsampledGaussian(1.1, 256 / 60000), 14063, 1e-5, False),  # 2.24 against 2.38: too close to certify
    (SubsampledGaussian(2.0, 0.01, HutchEnvelope(32, 2048)), 300, 1e-6, None),
])
def test_a_direction_is_skipped_only_where_its_chernoff_bound_shows_it_cannot_be_the_larger(mechanism, steps,
                                                                                           delta, skipped):
    """epsilon_bracket reads the first direction and only those others whose exact composition could still
    have delta above the target there; the bracket equals the maximum over every direction, and the bound
    is a true upper bound on each direction's curve."""
    acc = PLDAccountant().compose(mechanism, steps)
    lo, hi = acc.epsilon_bracket(delta)
    grid = acc.first_grid
    assert hi == max(c.epsilon(delta) for c in acc._composed(True, *grid))
    assert lo == max(c.epsilon(delta) for c in acc._composed(False, *grid))
    if skipped is not None:
        assert (acc._composed(True, *grid)[1].delta_bound(hi) <= delta) == skipped
    for comp in acc._composed(True):
        for eps in (0.5 * hi, 0.8 * hi, hi):
            d = comp.delta(eps)
            if d > 1e-12:   # below, the window's charged tail (1e-18 per side) is most of the numerical curve
                assert comp.delta_bound(eps) >= d * (1 - 1e-9)


def test_an_accountant_with_nothing_composed_reports_no_privacy_loss():
    """Nothing composed: the output does not depend on the data, so epsilon and delta are 0 and the trade-off
    curve is chance (1 - alpha), not a ZeroDivisionError."""
    acc = PLDAccountant()
    assert acc.epsilon(1e-5) == 0.0 and acc.epsilon_bracket(1e-5) == (0.0, 0.0)
    assert acc.delta(0.0) == 0.0 and acc.delta_bracket(1.0) == (0.0, 0.0)
    assert acc.tradeoff(0.25) == 0.75 and acc.tradeoff([0.0, 1.0]).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="delta"):
        acc.epsilon(0.0)


@pytest.mark.parametrize("name, value", [("neighboring", "replace_one"), ("discretization", 1e-3),
                                         ("tail_mass", 1e-10), ("bracket_rtol", 1e-3)])
def test_an_accountants_settings_cannot_change_after_it_is_built(name, value):
    # the cached curves were built at the old value: a change would be read against them (a replace-one
    # epsilon off the add-or-remove curve of a Gaussian, 7.51 where the truth is 17.86)
    acc = PLDAccountant().compose(Gaussian(1.0), 10)
    before = acc.epsilon(1e-5)
    with pytest.raises(AttributeError):
        setattr(acc, name, value)
    assert acc.epsilon(1e-5) == before


def test_an_epsilon_query_cuts_the_steps_farthest_losses_for_its_delta_and_stays_a_bracket(monkeypatch):
    # a heavy-tailed randomized-clipping step keeps losses up to where its tail is 1e-15; under the tilt near epsilon
    # those carry most of the mass, so an uncut window holds millions of points.  Cut at 1e-6 delta (upper: to +inf,
    # lower: down to the last point kept), the window shrinks and the bracket still holds the uncut one's truth
    from dpmath.pld import compose
    from dpmath.pld.compose import CUT, Composition, truncated
    from dpmath.pld.steps import step_plds

    mechanism = SubsampledGaussian(1.5665, 0.05, HutchEnvelope(16, 24))
    steps = step_plds(mechanism, "remove", 1e-3, (True, False), 60)
    delta = 1e-5
    for step in steps:
        cut = truncated(step, CUT * delta / 60)
        assert cut.pmf.size < step.pmf.size
        if step.upper:   # the largest losses went to +inf, charged in full
            assert 0 < cut.inf - step.inf <= CUT * delta / 60
        else:            # ... or down to the last point kept, mass and all
            assert cut.pmf.sum() == pytest.approx(step.pmf.sum(), rel=1e-12, abs=0)
        assert Composition([(cut, 60)], 1e-18).hi < 0.5 * Composition([(step, 60)], 1e-18).hi
    hi_cut, lo_cut = (Composition([(step, 60)], 1e-18).epsilon(delta) for step in steps)
    monkeypatch.setattr(compose, "CUT", 0.0)   # nothing cut
    hi_whole, lo_whole = (Composition([(step, 60)], 1e-18).epsilon(delta) for step in steps)
    # each bracket holds the other's truth, and the cut moves the ends by far less than the bracket is wide
    assert lo_cut <= hi_whole and lo_whole <= hi_cut
    assert hi_cut == pytest.approx(hi_whole, rel=1e-6) and lo_cut == pytest.approx(lo_whole, rel=1e-6)


def test_a_narrow_step_is_bracketed_on_the_first_grid_alone_by_the_accountant_and_the_schedule():
    # the step's upper and lower means are within 1e-7 (relative) of each other, far inside the default's 1e-3: the
    # default builds no finer grid, and epsilon is the first grid's upper end, which the bracket's upper end equals
    from dpmath.pld import EpsilonSchedule
    from dpmath.pld.distribution import mean_gap
    from dpmath.pld.steps import step_plds

    mechanism = SubsampledGaussian(1.0, 0.25)
    up, lo = step_plds(mechanism, "remove", 1e-4, (True, False))
    assert mean_gap([(up, 20)], [(lo, 20)]) < 1e-6
    acc = PLDAccountant().compose(mechanism, 20)
    eps = acc.epsilon(1e-5)
    assert {k[0] for k in acc._plds} == {1e-4}
    assert eps == PLDAccountant(bracket_rtol=None).compose(mechanism, 20).epsilon(1e-5)
    lower, upper = acc.epsilon_bracket(1e-5)
    assert upper == eps and (upper - lower) <= 1e-6 * upper
    schedule = EpsilonSchedule(mechanism, 20)
    assert schedule.epsilon(20, 1e-5) == schedule.epsilon_bracket(20, 1e-5)[1] and not schedule._finer
    # a step whose bounds are far apart (q = 1e-3, sigma 0.8: a gap of 1.4e-3) keeps the refinement by width
    wide = PLDAccountant().compose(SubsampledGaussian(0.8, 1e-3), 10_000)
    wide.epsilon(1e-6)
    assert acc._narrow() and not wide._narrow()


def test_a_float_target_asks_the_two_scale_lower_end_before_it_refines_the_grid():
    # q = 1e-6: the grid's lower end is 0 however fine the grid (the losses sit far below it); the two-scale curve
    # closes a 1e-3 bracket at once, so no finer grid is built (it took 73 s of grids 8 and 64 times finer)
    acc = PLDAccountant(bracket_rtol=1e-3).compose(SubsampledGaussian(0.5, 1e-6), 10_000)
    lo, hi = acc.epsilon_bracket(1e-9)
    assert {k[0] for k in acc._plds} == {1e-4}
    assert 0 < hi - lo <= 1e-3 * hi
    assert (lo, hi) == PLDAccountant().compose(SubsampledGaussian(0.5, 1e-6), 10_000).epsilon_bracket(1e-9)


@settings(max_examples=40, deadline=None)
@given(sigma=st.sampled_from([0.5, 0.8, 1.0, 2.0, 4.0]), q=st.sampled_from([1e-3, 1e-2, 0.1, 0.5, 1.0]),
       delta=st.sampled_from([1e-3, 1e-5, 1e-8]), relation=st.sampled_from(["remove", "add"]))
def test_an_upper_pld_reads_back_its_own_epsilon_at_or_below_delta(sigma, q, delta, relation):
    """``delta(epsilon(d)) <= d`` on one upper PLD: each read-out rounds outward on its own, and the root is moved
    up past their margins, so the two never contradict each other (a bound of 1e-13 above d was possible)."""
    from dpmath.pld.steps import step_plds

    (pld,) = step_plds(SubsampledGaussian(sigma, q), relation, 1e-4, (True,))
    eps = pld.epsilon(delta)
    assume(0 < eps < math.inf)
    assert pld.delta(eps) <= delta


def test_a_window_past_the_grid_limit_says_what_its_chernoff_bound_means():
    from dpmath import GridTooLargeError

    # a sparse sum (q 5e-5, sigma 0.3) whose Chernoff window needs 1.34e4 nats at h = 5e-5: the bound at the cut is
    # 1 or more, which the message used to print as "a mass of 1.0e+00 outside"
    acc = PLDAccountant(discretization=5e-5).compose(SubsampledGaussian(0.3, 4.9995e-05), 10_000)
    with pytest.raises(GridTooLargeError, match=r"needs more than 33,554,432 grid points \(the Chernoff bound .* no "
                                                  r"bound at all\); .*coarser discretization"):
        acc.epsilon_bracket(1e-12)


def test_a_delta_read_no_tilt_resolves_ends_on_the_cut_steps_composition_and_stays_a_bracket(monkeypatch):
    # where no tilted pass is enough (at q 1e-6 the extended passes' error bounds sit above 1e-3 of delta), a delta
    # read ends, as an epsilon query does, on the cut steps' untilted composition (its cut mass charged), not on the
    # uncut steps': the reading is still a bound on its side, against both bounds of the uncut composition
    from dpmath.pld.compose import Composition
    from dpmath.pld.steps import step_plds

    steps = step_plds(SubsampledGaussian(1.5665, 0.05, HutchEnvelope(16, 24)), "remove", 1e-3, (True, False), 60)
    eps = Composition([(steps[0], 60)], 1e-18).epsilon(1e-5)
    whole = [Composition([(step, 60)], 1e-18).full().delta(eps) for step in steps]   # untilted, nothing cut
    assert whole[1] <= whole[0]
    monkeypatch.setattr(Composition, "_good", lambda self, pld, e, d: False)   # no pass is enough
    for step in steps:
        comp = Composition([(step, 60)], 1e-18)
        read = comp.delta(eps)
        assert comp._full is None and comp._cut(read) is not comp   # the cut steps' composition ended the read
        if step.upper:
            assert read >= whole[1] and read == pytest.approx(whole[0], rel=1e-3)
        else:
            assert read <= whole[0] and read == pytest.approx(whole[1], rel=1e-3)

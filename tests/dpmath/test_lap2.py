"""LAP2 (paper 003): the univariate moment against quadrature, the published accountant and why it is
unsound, and the sound accountant through Gaussian domination."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import integrate, stats

from dpmath import PLDAccountant, RDPAccountant, SubsampledGaussian, SubsampledL2Laplace
from dpmath.lap2 import (
    LAPLACE_GDP_FACTOR,
    joint_log_moment,
    laplace_gdp_mu,
    laplace_moment,
    laplace_tradeoff,
    majorizer,
    published_epsilon,
    published_log_moment,
    univariate_log_moment,
)
from dpmath.majorization import weakly_submajorizes
from dpmath.schur import check_schur


def _quad_moment(u, eta, b):
    """E_{Lap(0,b)}[(Lap(u,b)/Lap(0,b))^eta] by quadrature, split at the kinks 0 and u."""
    def integrand(z):
        return stats.laplace.pdf(z, 0, b) * math.exp(eta * (abs(z) - abs(z - u)) / b)
    pieces = [(-np.inf, 0.0), (0.0, u), (u, np.inf)]
    return sum(integrate.quad(integrand, a, c, epsabs=0, epsrel=1e-12, limit=200)[0] for a, c in pieces)


@pytest.mark.parametrize("u, eta, b", [(0.3, 2, 1.0), (1.0, 3, 1.0), (2.0, 5, 0.7), (0.01, 8, 1.0), (5.0, 2, 2.0),
                                       (1.0, 0, 1.0), (1.0, 1, 1.0)])
def test_laplace_moment_matches_quadrature(u, eta, b):
    assert laplace_moment(u, eta, b) == pytest.approx(_quad_moment(u, eta, b), rel=1e-9)


def test_univariate_moment_is_the_binomial_expansion_of_the_mixture():
    """alpha(lambda) = log E_{Lap(0)}[(1 - q + q L)^{lambda+1}], checked by quadrature of the mixture."""
    u, b, q, lam = 0.8, 1.0, 0.05, 4

    def integrand(z):
        ratio = math.exp((abs(z) - abs(z - u)) / b)
        return stats.laplace.pdf(z, 0, b) * (1 - q + q * ratio) ** (lam + 1)
    ref = sum(integrate.quad(integrand, a, c, epsrel=1e-12)[0] for a, c in [(-np.inf, 0), (0, u), (u, np.inf)])
    assert float(univariate_log_moment(u, lam, q, b)) == pytest.approx(math.log(ref), rel=1e-10)


def test_joint_moment_by_monte_carlo():
    """The exact joint moment of a shared-subsampling step, checked by simulation (4 SE, 2e6 draws)."""
    rng = np.random.default_rng(7)
    g, b, q, lam = np.array([0.5, 0.5, 0.3]), 1.0, 0.2, 2
    z = rng.laplace(0, b, size=(2_000_000, 3))
    ratio = np.exp(((np.abs(z) - np.abs(z - g)) / b).sum(1))
    vals = (1 - q + q * ratio) ** (lam + 1)
    mean, se = vals.mean(), vals.std() / math.sqrt(vals.size)
    assert abs(math.exp(joint_log_moment(g, lam, q, b)) - mean) < 4 * se


def test_majorizer_weakly_submajorizes_clipped_gradients():
    x = majorizer(64, 2.0)
    assert np.allclose(np.cumsum(x), 2.0 * np.sqrt(np.arange(1, 65)))
    rng = np.random.default_rng(1)
    for _ in range(100):
        g = rng.standard_normal(64) ** 3
        assert weakly_submajorizes(x, 2.0 * np.abs(g) / np.linalg.norm(g))


def test_theorem_iii5_sum_of_univariate_moments_is_schur_convex():
    """Thm III.5's claim (the coordinate sum of alpha is Schur-convex in |g|) holds: alpha is convex in u."""
    f = lambda x: float(univariate_log_moment(x, 6, 0.05, 0.5).sum())  # noqa: E731
    r = check_schur(f, 5, "convex", domain="orthant")
    assert r.holds, r


def test_published_accountant_is_unsound():
    """Thm III.7 claims sum_i alpha(x_i) bounds the moment of every ||g||_2 <= C; a g with ten equal entries
    exceeds it by two orders of magnitude, because sampling is shared across coordinates."""
    g = np.full(10, 1 / math.sqrt(10))
    published = published_log_moment(8, 0.01, 0.5, 1.0, 1000)
    exact = joint_log_moment(g, 8, 0.01, 0.5)
    assert published == pytest.approx(0.0392, abs=1e-4)
    assert exact > 100 * published
    # with q = 1 there is no subsampling and the sum is exact: the published bound then holds
    assert joint_log_moment(g, 8, 1.0, 0.5) <= published_log_moment(8, 1.0, 0.5, 1.0, 1000)


@pytest.mark.slow  # about 8 s: kept out of the README's 10-minute run
def test_published_epsilon_is_below_the_spread_gradient_limit():
    """(eps, delta) view: the published eps is far below the n -> inf limit of an evenly spread gradient."""
    pub = published_epsilon(1e-5, 0.001, 1000, 0.5, 1.0, 10_000)
    clt = PLDAccountant().compose(SubsampledGaussian(0.5, 0.001), 1000).epsilon_bracket(1e-5)[0]
    assert pub == pytest.approx(0.431, abs=1e-3)
    assert clt > 3.2 > pub


def test_laplace_is_dominated_by_gaussian_with_factor_sqrt_pi_over_2():
    ts = np.concatenate([np.geomspace(1e-5, 100, 60)])
    ratios = np.array([laplace_gdp_mu(t) / t for t in ts])
    assert np.all(ratios <= LAPLACE_GDP_FACTOR)
    assert np.all(np.diff(ratios) < 1e-9)  # decreasing in t: the supremum is the limit t -> 0
    assert ratios[0] == pytest.approx(LAPLACE_GDP_FACTOR, rel=1e-5)
    # G_{c t} <= f_t pointwise on a dense alpha grid
    alpha = np.concatenate([np.geomspace(1e-12, 0.5, 3000), 1 - np.geomspace(1e-12, 0.5, 3000)])
    for t in (1e-3, 0.1, 1.0, 5.0):
        g = stats.norm.cdf(stats.norm.isf(alpha) - LAPLACE_GDP_FACTOR * t)
        assert np.all(g <= laplace_tradeoff(alpha, t) + 1e-15)
    # and a smaller factor fails near alpha = 1/2 for small t
    g = stats.norm.cdf(stats.norm.isf(0.5) - 0.99 * LAPLACE_GDP_FACTOR * 1e-3)
    assert g > laplace_tradeoff(0.5, 1e-3)


def test_sound_accountant_composes_through_the_dominating_gaussian():
    m = SubsampledL2Laplace(2.0, 0.01)
    assert m.dominating() == SubsampledGaussian(2.0 / LAPLACE_GDP_FACTOR, 0.01)
    a = PLDAccountant().compose(m, 100).epsilon(1e-5)
    b = PLDAccountant().compose(m.dominating(), 100).epsilon(1e-5)
    assert a == b
    r = RDPAccountant().compose(m, 100).epsilon(1e-5)
    assert r >= a
    assert PLDAccountant().compose(m, 100).events == ((m, 100),)
    with pytest.raises(ValueError, match="replace_one"):
        PLDAccountant(neighboring="replace_one").compose(m)


@given(st.floats(1e-6, 1e6))
def test_the_scale_for_a_dominating_sigma_never_rounds_below_it(sigma):
    m = SubsampledL2Laplace.for_noise_multiplier(sigma, 0.01)
    assert m.dominating().noise_multiplier >= sigma and m.scale == pytest.approx(sigma * LAPLACE_GDP_FACTOR, rel=1e-15)


@given(st.floats(0.01, 5), st.integers(1, 12), st.floats(1e-3, 1))
def test_moments_are_finite_and_increasing_in_the_shift(u, lam, q):
    a = univariate_log_moment([u, u * 1.1], lam, q)
    assert np.isfinite(a).all() and a[1] >= a[0] >= 0


@pytest.mark.parametrize("call, match", [
    (lambda: laplace_moment(-1.0, 2), "shift"),
    (lambda: laplace_moment(1.0, 1.5), "eta"),
    (lambda: laplace_moment(np.nan, 2), "shift must not contain NaN"),
    (lambda: univariate_log_moment(1.0, 0, 0.1), "order"),
    (lambda: univariate_log_moment(1.0, 2, 0.0), "sample_rate"),
    (lambda: majorizer(0), "dim"),
    (lambda: published_epsilon(0.0, 0.1, 10, 1.0, 1.0, 10), "delta"),
    (lambda: joint_log_moment([1.0, np.inf], 2, 0.1), "gradient"),
    (lambda: laplace_gdp_mu(0.0), "shift"),
    (lambda: laplace_tradeoff([1.5], 1.0), "alpha"),
    (lambda: SubsampledL2Laplace(0.0, 0.1), "scale"),
    (lambda: SubsampledL2Laplace(1.0, 1.5), "sample_rate"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_remove_direction_is_dominated_by_the_add_direction():
    """Thm III.2 bounds only A = E_mu0[(mu/mu0)^(lam+1)]; the proof relies on B = E_mu0[(mu0/mu)^lam] <= A
    (its last line says 'B >= A', a typo).  Checked by quadrature on a grid of shifts, rates and orders."""
    def log_b(u, q, lam):
        f = lambda z: stats.laplace.pdf(z) * (1 - q + q * math.exp(abs(z) - abs(z - u))) ** (-lam)  # noqa: E731
        return math.log(sum(integrate.quad(f, a, c, epsrel=1e-12)[0] for a, c in [(-np.inf, 0), (0, u), (u, np.inf)]))
    for u in (0.1, 1.0, 4.0):
        for q in (0.01, 0.5, 0.9):
            for lam in (1, 4, 16):
                assert log_b(u, q, lam) <= float(univariate_log_moment(u, lam, q)) + 1e-12

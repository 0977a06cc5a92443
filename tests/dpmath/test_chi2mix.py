"""chi2_mixture_cdf / sf / pdf: float64 against the mpmath reference, tails, Monte Carlo, bad input."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import special, stats

from dpmath import chi2_mixture_cdf, chi2_mixture_pdf, chi2_mixture_sf, two_block_cdf
from dpmath.contour import contour_inversion
from verify.mixtures import MIXTURES, SLOW_MIXTURES, bulk_points

# (weights, dof): one block, two blocks of every kind the envelope meets (chi2(1) singularities, the
# hot path's huge dof ratio), and three or more distinct weights (Ruben's series)
# the slow ones' kinds are covered by the others in the default run; all run with -m slow
CASES = [*MIXTURES, *(pytest.param(w, nu, marks=pytest.mark.slow) for w, nu in SLOW_MIXTURES)]


@pytest.mark.parametrize("weights,dof", CASES)
def test_float64_matches_mpmath_in_the_bulk(weights, dof):
    x = bulk_points(weights, dof)
    for fn in (chi2_mixture_cdf, chi2_mixture_sf):
        fast = fn(x, weights, dof)
        ref = np.array(fn(x, weights, dof, precision=30), dtype=float)
        np.testing.assert_allclose(fast, ref, rtol=0, atol=1e-12)
    dens = chi2_mixture_pdf(x, weights, dof)
    ref = np.array(chi2_mixture_pdf(x, weights, dof, precision=30), dtype=float)
    np.testing.assert_allclose(dens, ref, rtol=1e-10)


@pytest.mark.parametrize("weights,dof", [([0.3, 0.7], [1, 1]), ([0.2, 0.16], [2, 10]),
                                         ([0.5, 0.3, 0.2], 1),
                                         pytest.param([0.05, 0.25, 0.7], [3, 1, 2], marks=pytest.mark.slow),
                                         ([0.5 / 32, 0.5 / 96], [32, 96])])
def test_left_tail_relative_accuracy_down_to_1e_100(weights, dof):
    total_dof = float(np.sum(np.broadcast_to(np.asarray(dof, float), np.shape(weights))))
    # P(Q <= x) ~ C x^(N/2): spread x so that the cdf runs from ~1e-5 to below 1e-100
    exponents = np.linspace(0.5, 1.0, 6) * (200.0 / total_dof + 1.0)
    x = np.min(weights) * 10.0 ** (-exponents)
    ref = np.array(chi2_mixture_cdf(x, weights, dof, precision=40), dtype=float)
    assert ref.min() < 1e-100
    keep = ref > 1e-300
    fast = chi2_mixture_cdf(x[keep], weights, dof)
    np.testing.assert_allclose(fast, ref[keep], rtol=1e-6)


@pytest.mark.parametrize("weights,dof", [([0.2, 0.16], [2, 10]), ([0.5, 0.3, 0.2], 1)])
def test_right_tail_sf_keeps_relative_accuracy(weights, dof):
    x = np.array([20.0, 40.0, 80.0])
    ref = np.array(chi2_mixture_sf(x, weights, dof, precision=40), dtype=float)
    assert ref.min() < 1e-20
    np.testing.assert_allclose(chi2_mixture_sf(x, weights, dof), ref, rtol=1e-6)


def test_closed_forms():
    x = np.array([0.1, 1.0, 2.0, 7.5])
    # (chi2(1) + chi2(1)) / 2 is Exp(1)
    np.testing.assert_allclose(chi2_mixture_cdf(x, [0.5, 0.5]), -np.expm1(-x), atol=1e-15)
    np.testing.assert_allclose(chi2_mixture_sf(x, [0.5, 0.5]), np.exp(-x), rtol=1e-13)
    # equal weights merge into one chi-square
    np.testing.assert_allclose(chi2_mixture_cdf(x, [0.25] * 4, 3), stats.chi2.cdf(4 * x, 12), atol=1e-15)
    # the hot-path form with lam = 1 is chi2(ik)/(ik)
    np.testing.assert_allclose(two_block_cdf(x, 1.0, 3, 5, 2), special.gammainc(3.0, 3.0 * x), atol=1e-15)


def test_two_block_hot_path_matches_general_function():
    x = np.linspace(0.5, 1.5, 7)
    lam, i, j, k = 0.37, 3, 11, 4
    general = chi2_mixture_cdf(x, [lam / (i * k), (1 - lam) / (j * k)], [i * k, j * k])
    np.testing.assert_allclose(two_block_cdf(x, lam, i, j, k), general, atol=1e-15)


@pytest.mark.parametrize("weights,dof", [([0.3, 0.7], [1, 1]), ([0.71, 0.145, 0.145], 1),
                                         ([0.5, 0.3, 0.2], [1, 2, 5]),
                                         ([1e-6, 1e-3, 1.0], [1000, 2, 3])])  # Ruben too long: contour inversion
def test_monte_carlo_agreement(weights, dof):
    """Empirical CDF of 400k draws within 5 standard errors (each check fails by chance w.p. < 1e-6)."""
    rng = np.random.default_rng(12345)
    n = 400_000
    w = np.asarray(weights, float)
    nu = np.broadcast_to(np.asarray(dof, float), w.shape)
    sample = (w * rng.chisquare(nu, size=(n, w.size))).sum(axis=1)
    x = np.quantile(sample, [0.01, 0.1, 0.5, 0.9, 0.99])
    F = chi2_mixture_cdf(x, weights, dof)
    emp = (sample[:, None] <= x[None, :]).mean(axis=0)
    se = np.sqrt(F * (1 - F) / n)
    assert np.all(np.abs(emp - F) <= 5 * se)


@given(
    w=st.lists(st.floats(0.05, 10.0), min_size=1, max_size=4),
    nu=st.integers(1, 6),
    xs=st.lists(st.floats(1e-3, 60.0), min_size=2, max_size=8),
)
def test_cdf_monotone_in_unit_interval_and_complements_sf(w, nu, xs):
    x = np.sort(np.asarray(xs))
    F = chi2_mixture_cdf(x, w, nu)
    S = chi2_mixture_sf(x, w, nu)
    assert np.all((F >= 0) & (F <= 1)) and np.all((S >= 0) & (S <= 1))
    assert np.all(np.diff(F) >= -1e-14)
    np.testing.assert_allclose(F + S, 1.0, atol=1e-12)
    assert np.all(chi2_mixture_pdf(x, w, nu) >= 0)


@pytest.mark.parametrize("decades", [pytest.param(1, marks=pytest.mark.slow), 4,
                                     pytest.param(8, marks=pytest.mark.slow),
                                     pytest.param(12, marks=pytest.mark.slow)])  # 3-5 s each (mpmath)
def test_spread_weights_match_mpmath(decades):
    """Three blocks spread over 1-12 decades, from the deep left tail to the right tail (cdf, sf, pdf)."""
    w = np.array([1.0, 10.0 ** (-decades / 2), 10.0 ** -decades])
    nu = np.array([1.0, 3.0, 2.0])
    x = np.sum(w * nu) * np.array([1e-3, 1.0, 20.0])
    for fn in (chi2_mixture_cdf, chi2_mixture_sf, chi2_mixture_pdf):
        ref = np.array(fn(x, w, nu, precision=25), dtype=float)
        np.testing.assert_allclose(fn(x, w, nu), ref, rtol=1e-12)


@pytest.mark.slow  # mpmath: 10 s / 90 s
@pytest.mark.parametrize("size", [200, 1000])
def test_hundreds_of_weights_over_twelve_decades_match_mpmath(size):
    w = np.sort(10.0 ** -np.random.default_rng(5).uniform(0, 12, size))
    x = np.sum(w) * (np.array([1.0]) if size < 1000 else np.array([0.5, 1.0, 2.0]))
    ref = np.array(chi2_mixture_cdf(x, w, 1, precision=20), dtype=float)
    np.testing.assert_allclose(chi2_mixture_cdf(x, w, 1), ref, rtol=1e-12)


@pytest.mark.parametrize("kind", ["cdf", pytest.param("sf", marks=pytest.mark.slow),
                                  pytest.param("pdf", marks=pytest.mark.slow)])
def test_contour_inversion_error_bound_holds_and_is_tight(kind):
    """The reported bound is below 1e-13 of the value and above the actual error against mpmath."""
    w = np.array([0.6, 0.3, 0.1, 1e-3, 1e-7])
    nu = np.array([1.0, 2.0, 1.0, 5.0, 3.0])
    x = np.array([0.02, 0.5, 1.0, 2.5, 12.0])
    value, err = contour_inversion(x, w, nu, kind)
    fn = {"cdf": chi2_mixture_cdf, "sf": chi2_mixture_sf, "pdf": chi2_mixture_pdf}[kind]
    ref = np.array(fn(x, w, nu, precision=25), dtype=float)
    assert np.all(err <= 1e-13 * value)
    assert np.all(np.abs(value - ref) <= err + 4e-16 * ref)


def test_left_tail_of_a_spread_mixture_keeps_relative_accuracy():
    w, nu = np.array([1.0, 1e-4, 1e-9]), np.array([2.0, 30.0, 4.0])
    x = np.array([1e-5, 1e-7, 1e-9])
    ref = np.array(chi2_mixture_cdf(x, w, nu, precision=30), dtype=float)
    assert ref.min() < 1e-100
    np.testing.assert_allclose(chi2_mixture_cdf(x, w, nu), ref, rtol=1e-11)


@pytest.mark.parametrize("kwargs,name", [
    (dict(x=0.0, weights=[1.0, 2.0], dof=1), "x"),
    (dict(x=1.0, weights=[0.0, 2.0], dof=1), "weights"),
    (dict(x=1.0, weights=[1.0, 2.0], dof=1, kind="quantile"), "kind"),
])
def test_contour_inversion_bad_input_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        contour_inversion(**kwargs)


def test_negligible_blocks_are_dropped():
    base = chi2_mixture_cdf([0.3, 1.0], [0.5, 0.3, 0.2], 2)
    np.testing.assert_allclose(chi2_mixture_cdf([0.3, 1.0], [1e-30, 0.5, 0.3, 0.2], 2), base, rtol=1e-13)


def test_edges_of_the_support():
    F = chi2_mixture_cdf([-1.0, 0.0, np.inf], [0.3, 0.7])
    np.testing.assert_array_equal(F, [0.0, 0.0, 1.0])
    np.testing.assert_array_equal(chi2_mixture_sf([-1.0, 0.0, np.inf], [0.3, 0.7]), [1.0, 1.0, 0.0])
    np.testing.assert_array_equal(chi2_mixture_pdf([-1.0, 0.0], [0.3, 0.7]), [0.0, 0.0])
    assert float(chi2_mixture_cdf(1.0, [0.0, 0.5, 0.5])) == pytest.approx(1 - np.exp(-1.0), abs=1e-15)


@pytest.mark.parametrize("kwargs,name", [
    (dict(x=np.nan, weights=[1.0]), "x"),
    (dict(x=1.0, weights=[-0.1, 1.0]), "weights"),
    (dict(x=1.0, weights=[0.0, 0.0]), "weights"),
    (dict(x=1.0, weights=[]), "weights"),
    (dict(x=1.0, weights=[1.0, np.nan]), "weights"),
    (dict(x=1.0, weights=[1.0], dof=0), "dof"),
    (dict(x=1.0, weights=[1.0, 2.0], dof=[1, 2, 3]), "dof"),
    (dict(x=1.0, weights=[1.0], precision=5), "precision"),
])
def test_bad_input_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        chi2_mixture_cdf(**kwargs)


@pytest.mark.slow
def test_seven_decades_against_monte_carlo():
    """Weights over 7 orders of magnitude (contour inversion): 400k draws, 5 standard errors."""
    lam = 10.0 ** np.array([-0.6, -0.6, -3.9, -0.4, -1.4, -7.4])
    w = lam / lam.sum() / 32
    x = np.array([0.8, 1.0, 1.3])
    F = chi2_mixture_cdf(x, w, 32)
    rng = np.random.default_rng(99)
    n = 400_000
    emp = ((w * rng.chisquare(32, size=(n, w.size))).sum(axis=1)[:, None] <= x[None, :]).mean(axis=0)
    assert np.all(np.abs(emp - F) <= 5 * np.sqrt(F * (1 - F) / n))


def test_two_blocks_fifteen_decades_apart_match_mpmath():
    """The panel quadrature's mode search resolves (0, x) to ~1e-11 x; a block far lighter than that used to
    misplace the panels (0.53753 instead of 0.53716).  The verify envelope audit found it."""
    w, x = np.array([0.25, 2.0868e-16]), np.array([0.9, 3.0])
    for fn in (chi2_mixture_cdf, chi2_mixture_sf, chi2_mixture_pdf):
        ref = np.array(fn(x, w, 4, precision=25), dtype=float)
        np.testing.assert_allclose(fn(x, w, 4), ref, rtol=1e-12)

"""The RDP accountant: published values, exactness of the fractional-order series, conversions, refusals."""

import functools
import math

import mpmath as mp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from dpmath import Gaussian, HutchEnvelope, PLDAccountant, SubsampledGaussian
from dpmath.conversions import rdp_to_delta, rdp_to_epsilon
from dpmath.rdp import RDPAccountant, subsampled_gaussian_rdp

OPACUS_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def exact_rdp(alpha: float, sigma: float, q: float) -> float:
    """D_alpha(q N(1, s^2) + (1-q) N(0, s^2) || N(0, s^2)) by 30-digit quadrature."""
    mp.mp.dps = 30
    s, qq, a = mp.mpf(sigma), mp.mpf(q), mp.mpf(alpha)

    def f(x):
        return mp.npdf(x, 0, s) * (1 - qq + qq * mp.exp((2 * x - 1) / (2 * s * s))) ** a

    return float(mp.log(mp.quad(f, [-mp.inf, -10 * s, 0, 10 * s, 40 * s, mp.inf])) / (a - 1))


# --------------------------------------------------------------------------- per-step RDP
def test_dp_accounting_integer_orders():
    got = 50 * subsampled_gaussian_rdp(2.5, 0.01, [5, 50, 100])
    np.testing.assert_allclose(got, [2.18075656e-3, 2.38460375e-2, 1.67416308e2], rtol=1e-8)


@pytest.mark.parametrize(("alpha", "sigma", "q"), [(1.5, 2.5, 0.01), (2.5, 2.5, 0.01), (3.7, 1.0, 0.2),
                                                   (1.25, 0.8, 0.05), (7.5, 4.0, 0.001)])
def test_fractional_orders_match_quadrature(alpha, sigma, q):
    # dp_accounting's test expects 6.70579741e-4 / 1.08548710e-3 for (1.5 | 2.5, 2.5, 0.01) x 50 steps;
    # its series stops early.  Quadrature gives 6.500709e-4 / 1.085418e-3, as we do.
    assert float(subsampled_gaussian_rdp(sigma, q, [alpha])[0]) == pytest.approx(exact_rdp(alpha, sigma, q),
                                                                                  rel=1e-9)


def test_autodp_values():
    assert float(subsampled_gaussian_rdp(0.5, 0.01, [2])[0]) == pytest.approx(0.005345502314345245, rel=1e-10)
    assert 100 * float(subsampled_gaussian_rdp(2.0, 0.2, [10])[0]) == pytest.approx(9.784245743693406, rel=1e-10)


@given(sigma=st.floats(0.3, 50.0), alpha=st.floats(1.01, 200.0))
def test_q_one_is_the_gaussian_closed_form(sigma, alpha):
    assert float(subsampled_gaussian_rdp(sigma, 1.0, [alpha])[0]) == pytest.approx(alpha / (2 * sigma**2), rel=1e-12)


@given(sigma=st.floats(0.5, 10.0), q=st.floats(1e-4, 0.5), alpha=st.integers(2, 64))
def test_rdp_is_monotone_in_order_and_between_zero_and_the_gaussian(sigma, q, alpha):
    r = subsampled_gaussian_rdp(sigma, q, [alpha, alpha + 0.5])
    assert 0 <= r[0] <= r[1] * (1 + 1e-12)
    assert r[0] <= alpha / (2 * sigma**2) * (1 + 1e-12)


# --------------------------------------------------------------------------- composed epsilon
def test_opacus_rdp_value():
    acc = RDPAccountant(orders=OPACUS_ORDERS).compose(SubsampledGaussian(1.5, 0.04), 2250)
    assert acc.epsilon(1e-5) == pytest.approx(7.32911117143, rel=1e-9)


@pytest.mark.parametrize(("n", "batch", "sigma", "epochs", "delta", "eps", "order"), [
    (60000, 150, 1.3, 15, 1e-5, 0.7242234026109595, 19),
    (100000, 100, 1.0, 30, 1e-7, 1.4154988495444842, 13),
])
def test_tf_privacy_values(n, batch, sigma, epochs, delta, eps, order):
    steps = math.ceil(epochs * n / batch)
    acc = RDPAccountant(orders=OPACUS_ORDERS).compose(SubsampledGaussian(sigma, batch / n), steps)
    assert acc.epsilon(delta) == pytest.approx(eps, rel=1e-9)
    assert acc.best_order(delta) == order


@pytest.mark.parametrize(("q", "sigma", "epochs", "eps"), [
    (256 / 60000, 1.1, 60, 3.01), (240 / 60000, 1.3, 15, 1.16), (240 / 60000, 1.1, 60, 2.91),
    (240 / 60000, 0.7, 45, 6.86),
])
def test_classic_conversion_tutorial_values(q, sigma, epochs, eps):
    acc = RDPAccountant(orders=OPACUS_ORDERS, conversion="classic").compose(SubsampledGaussian(sigma, q),
                                                                           math.ceil(epochs / q))
    assert acc.epsilon(1e-5) == pytest.approx(eps, abs=0.006)


def test_balle_conversion_is_tighter_and_rdp_is_looser_than_pld():
    m = SubsampledGaussian(1.0, 0.01)
    balle = RDPAccountant().compose(m, 1000).epsilon(1e-6)
    classic = RDPAccountant(conversion="classic").compose(m, 1000).epsilon(1e-6)
    pld = PLDAccountant().compose(m, 1000).epsilon(1e-6)
    assert pld < balle < classic


@functools.cache
def _curve_300_steps() -> np.ndarray:
    return 300 * subsampled_gaussian_rdp(1.2, 0.02, np.array(OPACUS_ORDERS))


@given(eps=st.floats(0.1, 20.0))
def test_delta_and_epsilon_conversions_are_inverse(eps):
    orders = np.array(OPACUS_ORDERS)
    rdp = _curve_300_steps()
    d = rdp_to_delta(rdp, orders, eps)
    if 1e-300 < d < 1:
        assert rdp_to_epsilon(rdp, orders, d)[0] == pytest.approx(eps, rel=1e-9)


def test_rdp_delta_is_sound_for_the_gaussian():
    acc = RDPAccountant().compose(Gaussian(2.0), 10)
    mu = math.sqrt(10) / 2.0
    for eps in (0.5, 2.0, 5.0):
        exact = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
        assert acc.delta(eps) >= exact


def test_rdp_tradeoff_is_below_the_pld_one():
    a = np.array([1e-4, 1e-2, 0.3])
    rdp = RDPAccountant().compose(Gaussian(1.0)).tradeoff(a)
    pld = PLDAccountant().compose(Gaussian(1.0)).tradeoff(a)
    assert (rdp <= pld + 1e-12).all() and (rdp >= 0).all()


# --------------------------------------------------------------------------- randomized clipping: no RDP
def test_randomized_clipping_is_refused_with_the_reason():
    acc = RDPAccountant()
    with pytest.raises(ValueError, match="infinite for every order"):
        acc.compose(SubsampledGaussian(1.0, 0.01, HutchEnvelope(projection_dim=4, dim=8)))
    assert acc.events == ()


@pytest.mark.parametrize("k", [1, 4, 32])
def test_the_renyi_moment_of_a_random_scale_diverges(k):
    # App. B.2 / Prop. B.1: with Z ~ chi2(k), E[exp(t k / Z)] = infinity for every t > 0, because the
    # integrand exp(t k / z) p_k(z) increases without bound as z -> 0 (here t = alpha (alpha - 1) /
    # (2 sigma^2) for alpha = 2, sigma = 4, q = 1): its logarithm, t k / z + log p_k(z), is checked to
    # grow past any level while z shrinks
    t = 2 * 1 / (2 * 16.0)
    z = np.array([1e-2, 1e-3, 1e-4, 1e-5])
    log_integrand = t * k / z + stats.chi2(k).logpdf(z)
    assert (np.diff(log_integrand) > 0).all()
    assert log_integrand[-1] > 300.0   # e^300: no finite moment, and so no finite Renyi divergence


@pytest.mark.parametrize(("call", "name"), [
    (lambda: RDPAccountant(orders=[0.5, 2]), "orders"),
    (lambda: RDPAccountant(conversion="fast"), "conversion"),
    (lambda: RDPAccountant().compose(Gaussian(1.0), 0), "count"),
    (lambda: RDPAccountant().compose(Gaussian(1.0)).epsilon(2.0), "delta"),
    (lambda: RDPAccountant().compose(Gaussian(1.0)).delta(-1.0), "epsilon"),
    (lambda: subsampled_gaussian_rdp(1.0, 0.1, [1.0]), "orders"),
])
def test_bad_input(call, name):
    with pytest.raises(ValueError, match=name):
        call()

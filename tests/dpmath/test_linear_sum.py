"""Random allocation's long epochs in the convex order (:mod:`dpmath.pld.linear_sum`): the upper and lower laws
bracket exact references, agree with the octave bands, and the accountant's bracket is narrow where the bands' was
not."""

import math

import numpy as np
import pytest
from scipy import fft as sfft
from scipy import integrate, special

from dpmath import PLDAccountant, RandomAllocationGaussian
from dpmath.pld import allocation, linear_sum
from dpmath.pld.compose import EXTENDED
from dpmath.pld.linear_sum import fft_bound, linear_law, linear_suits


def _delta(law, eps: float) -> float:
    """``delta(eps)`` of one law read out (upper with its +inf mass)."""
    out = []
    for upper in (False, True):
        s, m, inf = law.read(upper)
        sbar = s / law.steps
        with np.errstate(divide="ignore"):
            if law.relation == "remove":   # P-masses at the loss log s-bar
                out.append(float(np.sum(np.maximum(1.0 - math.exp(eps) / sbar, 0.0) * m)) + inf)
            else:                          # Q-masses at the loss -log s-bar
                out.append(float(np.sum(np.maximum(1.0 - math.exp(eps) * sbar, 0.0) * m)) + inf)
    return out[0], out[1]


def _exact_two(mu: float, relation: str, eps: float) -> float:
    """``delta`` of a two-step epoch by quadrature: ``E_Q (S-bar - e^eps)_+`` or ``E_Q (1 - e^eps S-bar)_+`` with
    ``S-bar = (W1 + W2) / 2``, the expectation over ``W2`` in closed form (a lognormal of mean 1: Black-Scholes)."""
    c = math.exp(eps)

    def inner(z: float) -> float:
        w1 = math.exp(mu * z - 0.5 * mu * mu)
        if relation == "remove":   # E (W2 - k)_+ / 2, k = 2c - w1
            k = 2.0 * c - w1
            if k <= 0:
                return 0.5 * (1.0 - k)
            d1 = (-math.log(k) + 0.5 * mu * mu) / mu
            return 0.5 * (special.ndtr(d1) - k * special.ndtr(d1 - mu))
        k = 2.0 / c - w1            # c/2 E (k - W2)_+
        if k <= 0:
            return 0.0
        d1 = (-math.log(k) + 0.5 * mu * mu) / mu
        return 0.5 * c * (k * special.ndtr(-(d1 - mu)) - special.ndtr(-d1))

    pdf = lambda z: math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)   # noqa: E731
    val, err = integrate.quad(lambda z: pdf(z) * inner(z), -12.0, 12.0, epsabs=1e-15, epsrel=1e-11, limit=400,
                              points=[0.0])
    return val


@pytest.mark.parametrize("relation", ["remove", "add"])
@pytest.mark.parametrize("sigma, rtol", [(2.0, 2e-3), (1.0, 0.1)])
def test_a_two_step_epoch_is_bracketed_around_its_quadrature(sigma, rtol, relation):
    # (two steps are the bands' case, not this path's: the quadrature is exact there; at sigma 1 the grid step is 10 %
    # of a term's deviation, so only soundness is tight)
    mu = 1.0 / sigma
    law = linear_law(mu, 2, relation)
    for eps in (0.05, 0.2, 0.5, 1.0):
        exact = _exact_two(mu, relation, eps)
        lo, hi = _delta(law, eps)
        assert lo <= exact * (1 + 1e-9) and exact <= hi * (1 + 1e-9), (eps, lo, exact, hi)
        if exact > 1e-9:
            assert hi - lo <= rtol * exact, (eps, lo, exact, hi)


@pytest.mark.parametrize("relation", ["remove", "add"])
def test_the_convex_order_and_the_octave_bands_bracket_the_same_delta(relation):
    # both are sound, so their brackets intersect; the convex order's is narrower (second-order in the grid step)
    sigma, t, h = 2.0, 64, 1e-5
    law = linear_law(1.0 / sigma, t, relation)
    upper, lower = allocation.epoch_plds(sigma, t, relation, h, (True, False))
    for eps in (0.1, 0.2, 0.3):
        lo, hi = _delta(law, eps)
        b_lo, b_hi = lower.delta(eps), upper.delta(eps)
        assert lo <= b_hi * (1 + 1e-9) and b_lo <= hi * (1 + 1e-9), (eps, lo, hi, b_lo, b_hi)
        assert hi - lo <= b_hi - b_lo


@pytest.mark.parametrize("t", [pytest.param(1000, marks=pytest.mark.slow), 1023,
                               pytest.param(1025, marks=pytest.mark.slow)])
def test_the_upper_law_has_the_mass_of_a_probability_and_the_lower_at_most(t):
    for relation in ("remove", "add"):
        law = linear_law(0.5, t, relation)
        s, m, inf = law.read(True)
        _, lm, _ = law.read(False)
        assert np.all(np.isfinite(s)) and np.all(m >= 0) and 0 <= inf < 1e-12
        assert 1.0 <= m.sum() + inf <= 1.0 + 1e-4
        assert 1.0 - 1e-6 <= lm.sum() <= 1.0


def test_the_path_is_taken_where_a_linear_grid_resolves_a_term_and_its_body_is_near_the_sum():
    # light: the body's end within 5 deviations of S
    assert linear_suits(1 / 2.0, 100_000) and linear_suits(1 / 1.5, 10_000) and linear_suits(1 / 1.0, 100_000)
    # 9 to 30 deviations: the upper sums' FFTs in extended precision, where the platform has it
    assert linear_suits(1 / 0.8, 4000) == EXTENDED and linear_suits(1 / 0.75, 10_000) == EXTENDED
    # short epochs: the octave bands where they would need extended precision here, this path where float64 serves
    assert not linear_suits(1 / 1.0, 100) and not linear_suits(1 / 1.5, 10)
    assert linear_suits(1 / 2.0, 999) and linear_suits(1 / 2.0, 50)


def test_a_light_tailed_short_epoch_in_the_convex_order_is_tighter_than_on_the_bands():
    # k 4 of 1,000 steps at sigma 2: epochs of 250 steps; on the octave bands the bracket was [0.46858, 0.46977]
    lo, hi = PLDAccountant().compose(RandomAllocationGaussian(2.0, 1000, participations=4), 3).epsilon_bracket(1e-6)
    assert hi - lo <= 1e-3 * hi and lo <= 0.46977 and hi >= 0.46858
    # a term's grid step above 5 % of its deviation (small sigma: the octave bands' relative steps)
    assert not any(linear_suits(1 / s, t) for s, t in ((0.35, 200), (0.45, 500), (0.5, 100_000), (0.3, 100_000)))
    # the cap (a term's 1 - 1e-19 quantile) below the allocated term's mass: at sigma 0.05 it is 2e-9
    assert not linear_suits(1 / 0.05, 10) and not linear_suits(1 / 0.2, 10**6)


def test_random_allocation_over_a_long_epoch_is_within_half_a_percent():
    # the octave bands left [0.0035628, 0.0036286] (1.81 %, 27 s); both are sound, so the brackets intersect
    lo, hi = PLDAccountant().compose(RandomAllocationGaussian(2.0, 100_000), 1).epsilon_bracket(1e-5)
    assert hi <= 1.005 * lo
    assert lo <= 0.0036286 and 0.0035628 <= hi


@pytest.mark.skipif(not EXTENDED, reason="the heavier tail needs extended-precision FFTs")
def test_a_heavier_tail_in_extended_precision_is_within_half_a_percent():
    # (sigma 1, 20000 steps): the octave bands' [0.0251796, 0.025275] (0.38 %, 28 s)
    lo, hi = PLDAccountant().compose(RandomAllocationGaussian(1.0, 20_000), 1).epsilon_bracket(1e-5)
    assert hi <= 1.005 * lo
    assert lo <= 0.025275 and 0.0251796 <= hi


def test_the_fft_error_bound_covers_the_computed_convolution():
    rng = np.random.default_rng(3)
    for n in (100, 4096, 20_000):
        a = rng.random(n) ** 8        # non-negative, spread over many decades
        b = np.exp(-0.5 * ((np.arange(n) - n / 3) / (n / 20)) ** 2)
        a, b = a / a.sum(), b / b.sum()
        nfft = 1 << (2 * n - 2).bit_length()
        z = sfft.irfft(sfft.rfft(a, nfft) * sfft.rfft(b, nfft), nfft)[: 2 * n - 1]
        exact = np.convolve(a.astype(np.longdouble), b.astype(np.longdouble))
        bound = fft_bound(nfft, a.sum(), math.sqrt(a @ a), b.sum(), math.sqrt(b @ b)) + 2 * 1.2e-16 * np.abs(z).max()
        err = float(np.max(np.abs(z - exact)))
        assert err <= bound
        # and it is a 2-norm bound: far below the 1-norm bound of the octave bands and compositions
        assert bound < 0.2 * linear_sum.FFT_ERR * math.log2(nfft) * 4.0


def test_an_epoch_in_the_convex_order_has_no_nan_and_reads_an_infinite_loss_only_where_charged():
    for relation in ("remove", "add"):
        plds = allocation.epoch_plds(2.0, 4096, relation, 1e-5, (True, False))
        for pld in plds:
            assert np.all(np.isfinite(pld.pmf)) and np.all(pld.pmf >= 0)
        assert plds[0].inf < 1e-12 and plds[1].inf == 0.0


@pytest.mark.slow   # 11 to 25 s
@pytest.mark.skipif(not EXTENDED, reason="the heavier tail needs extended-precision FFTs")
def test_a_lower_law_keeps_the_far_tail_of_its_sums():
    # (sigma 0.75, 10^4 steps): float64 FFTs' error bounds, subtracted from every point, emptied the lower law's
    # intermediate tails and its lower end fell to 0.0996 (1.2 % wide); the octave bands give [0.10069, 0.10133]
    lo, hi = PLDAccountant().compose(RandomAllocationGaussian(0.75, 10_000), 1).epsilon_bracket(1e-6)
    assert hi <= 1.005 * lo
    assert lo <= 0.10133 and 0.10069 <= hi

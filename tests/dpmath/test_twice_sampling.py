"""Coordinate-wise and twice sampling, hybrid clipping (paper 002): identities, independent values and the
paper's published numbers."""

import math

import numpy as np
import pytest
from scipy import integrate, stats

from dpmath.rdp import RDPAccountant, subsampled_gaussian_rdp
from dpmath.twice_sampling import (
    CoordinateSampledGaussian,
    HybridTwiceSampledGaussian,
    TwiceSampledGaussian,
    coordinate_sampling_rdp,
    hybrid_noise,
    hypercube_noise,
    twice_sampling_rdp,
)
from verify.claims import table1_ratio

ORDERS = np.arange(2, 257)


def _epsilon(mechanism, steps, delta=1e-5, conversion="classic"):
    return RDPAccountant(orders=ORDERS, conversion=conversion).compose(mechanism, steps).epsilon(delta)


def test_coordinate_sampling_is_a_sum_of_one_dimensional_subsampled_gaussians():
    # d0 = 4 exactly: four coordinates at c_inf = 1/2, each a subsampled Gaussian with mu = c_inf / sigma
    got = coordinate_sampling_rdp(0.8, 0.05, 1.0, 0.5, [2, 5, 9])
    ref = 4 * subsampled_gaussian_rdp(0.8 / 0.5, 0.05, [2, 5, 9])
    assert np.allclose(got, ref, rtol=1e-12)
    # non-integer orders are not covered by the binomial expansion
    assert np.isinf(coordinate_sampling_rdp(0.8, 0.05, 1.0, 0.5, [2.5])).all()


def test_remark_5_1_vertex_for_fractional_d0():
    """d0 = 2.5: the dominating sensitivity is (c_inf, c_inf, c', 0, ...), c'^2 = c2^2 - 2 c_inf^2; it is
    below eq. (7)'s d0 * (one coordinate), and above every other point of the sensitivity set tried."""
    c2, c_inf, sigma, q, a = 1.0, math.sqrt(1 / 2.5), 0.7, 0.1, 6
    vertex = coordinate_sampling_rdp(sigma, q, c2, c_inf, [a])[0]
    one = subsampled_gaussian_rdp(sigma / c_inf, q, [a])[0]
    assert vertex < 2.5 * one
    rng = np.random.default_rng(0)
    for _ in range(200):  # random points of {||s||_2 <= c2, |s_l| <= c_inf} in 6 dimensions
        s = np.minimum(np.abs(rng.standard_normal(6)), c_inf)
        s *= min(1.0, c2 / np.linalg.norm(s))
        total = sum(subsampled_gaussian_rdp(sigma / v, q, [a])[0] for v in s if v > 0)
        assert total <= vertex + 1e-12


def test_coordinate_sampling_rdp_by_quadrature():
    """One coordinate's Renyi divergence (order 3) computed by numerical integration of the mixture."""
    mu, q, a = 1.3, 0.2, 3

    def integrand(x):
        p = stats.norm.pdf(x)
        mix = (1 - q) * p + q * stats.norm.pdf(x - mu)
        return p * (mix / p) ** a
    ref = math.log(integrate.quad(integrand, -30, 30, epsabs=0, epsrel=1e-12)[0]) / (a - 1)
    assert coordinate_sampling_rdp(1.0, q, mu, mu, [a])[0] == pytest.approx(ref, rel=1e-9)


def test_twice_sampling_reduces_to_known_cases():
    # q2 = 1: coordinate sampling is the plain Gaussian mechanism, twice sampling is input-wise sampling
    m = TwiceSampledGaussian(0.9, 0.03, 1.0, 1.0, 0.25)
    assert np.allclose(m.rdp([2, 8, 40]), subsampled_gaussian_rdp(0.9, 0.03, [2, 8, 40]), rtol=1e-10)
    # q1 = 1: twice sampling is coordinate-wise sampling
    m = TwiceSampledGaussian(0.9, 1.0, 0.3, 1.0, 0.25)
    assert np.allclose(m.rdp([2, 8]), coordinate_sampling_rdp(0.9, 0.3, 1.0, 0.25, [2, 8]), rtol=1e-10)
    # twice sampling (q1, q2) is weaker than coordinate-wise sampling at q1 q2 (paper, after Thm 5.4)
    tw = TwiceSampledGaussian(0.6, 0.02, 0.5, 1.0, 0.1).rdp(ORDERS[:30])
    co = coordinate_sampling_rdp(0.6, 0.01, 1.0, 0.1, ORDERS[:30])
    assert np.all(tw >= co - 1e-12)
    h = HybridTwiceSampledGaussian((0.6, 0.6), 0.02, 0.5, (1.0, 1.0), (0.1, 0.1))
    assert np.allclose(h.rdp([4]), twice_sampling_rdp(0.02, lambda o: 2 * coordinate_sampling_rdp(
        0.6, 0.5, 1.0, 0.1, o), [4]))


def test_section_5_3_published_numbers():
    """Paper 002 Sec. 5.3 / Fig. 5: q = 0.005, T = 1e4, delta = 1e-5, c2 = 1, classic conversion (Lemma 2.3).
    sigma = 0.48: input-wise 30.4; twice sampling (0.01, 1/2) at d0 = 64 near 8."""
    inputwise = _epsilon(CoordinateSampledGaussian(0.48, 0.005, 1.0, 1.0), 10_000)
    twice = _epsilon(TwiceSampledGaussian(0.48, 0.01, 0.5, 1.0, 1 / 8), 10_000)
    assert inputwise == pytest.approx(30.4, abs=0.05)
    assert twice == pytest.approx(8.25, abs=0.01)
    # the Balle conversion does not reproduce the published 30.4
    assert _epsilon(CoordinateSampledGaussian(0.48, 0.005, 1.0, 1.0), 10_000, conversion="balle") < 29.1


TABLE1 = {  # paper 002 Table 1: noise-variance ratio (%) twice / input-wise, d0 = 100, delta = 1e-5
    (0.06, 1 / 3): [86.2, 85.4, 82.2, 70.8],
    (0.04, 1 / 2): [89.4, 88.2, 77.4, 75.1],
    (0.03, 1 / 3): [67.4, 65.9, 53.2, 43.3],
    (0.02, 1 / 2): [72.8, 71.6, 61.0, 53.5],
}
BUDGETS = [(2.0, 1500), (2.5, 2000), (4.0, 2500), (8.0, 5000)]


# the first row (with the swapped entries) in the default run, every row with -m slow
@pytest.mark.parametrize("q", [q if i == 0 else pytest.param(q, marks=pytest.mark.slow) for i, q in enumerate(TABLE1)],
                         ids=[str(q) for q in TABLE1])
def test_table1_noise_variance_ratios(q):
    """Within 3 points with the classic conversion, except the eps = 4 entries of the first two rows,
    which are swapped in the published table (each matches the other row's value)."""
    got = [table1_ratio(*q, e, t) for e, t in BUDGETS]
    for col, (g, p) in enumerate(zip(got, TABLE1[q], strict=True)):
        if col == 2 and q in ((0.06, 1 / 3), (0.04, 1 / 2)):
            other = TABLE1[(0.04, 1 / 2) if q == (0.06, 1 / 3) else (0.06, 1 / 3)][2]
            assert abs(g - other) < 1.0 < abs(g - p)
        else:
            assert abs(g - p) <= 3.0, (q, col, g, p)


def test_noise_allocations():
    s = hypercube_noise([4.0, 1.0, 1.0])
    assert np.isclose((s ** 2).sum(), 1) and np.isclose(s[0] / s[1], 2.0)
    h = hybrid_noise([2.5, 1.0], [1000, 290_898])
    r = np.array([1000, 290_898])
    assert np.isclose((h ** 2 * r).sum(), 1)
    # Thm 4.6 against one isotropic ball of the same global budget: the paper's Sec. 6 example says 5.5x
    hybrid_power = (2.5 * math.sqrt(1000) + 1.0 * math.sqrt(290_898)) ** 2
    iso_power = (2.5 ** 2 + 1.0 ** 2) * r.sum()
    assert iso_power / hybrid_power == pytest.approx(5.5, abs=0.1)
    # with r_j = 1 Thm 4.6 is Thm 4.5
    assert np.allclose(hybrid_noise([4.0, 1.0], [1, 1]), hypercube_noise([4.0, 1.0]))


@pytest.mark.parametrize("call, match", [
    (lambda: coordinate_sampling_rdp(0.0, 0.1, 1.0, 0.5, [2]), "noise_std"),
    (lambda: coordinate_sampling_rdp(1.0, 0.1, 1.0, 2.0, [2]), "c_inf must be at most c2"),
    (lambda: coordinate_sampling_rdp(1.0, 1.1, 1.0, 0.5, [2]), "coordinate_rate"),
    (lambda: coordinate_sampling_rdp(1.0, 0.1, 1.0, 0.5, [1.0]), "orders"),
    (lambda: TwiceSampledGaussian(1.0, 0.0, 0.5), "sample_rate"),
    (lambda: HybridTwiceSampledGaussian((1.0, 1.0), 0.1, 0.5, (1.0,), (0.5,)), "same length"),
    (lambda: hypercube_noise([0.0, 0.0]), "sides"),
    (lambda: hybrid_noise([1.0], [0]), "ranks"),
    (lambda: RDPAccountant().compose(object()), "rdp"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()

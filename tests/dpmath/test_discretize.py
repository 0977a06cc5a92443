"""pessimistic_discretization: mass at each bin's smallest y, the tail below the grid reported apart."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpmath import Envelope, HutchEnvelope, HutchPPEnvelope, pessimistic_discretization


class _Uniform01(Envelope):
    """Y ~ U(0, 1): every bin has mass equal to its width, which makes the atoms easy to predict."""

    def cdf(self, x):
        return np.clip(np.asarray(x, float), 0.0, 1.0)

    def sf(self, x):
        return 1.0 - self.cdf(x)


_ENV = HutchEnvelope(4, 16)


def _discrete_cdf(dist, y):
    """P(Y_discrete <= y), with the below-grid mass treated as an atom at 0."""
    y = np.asarray(y, float)
    return dist.below_mass + (dist.weights[None, :] * (dist.y[None, :] <= y[:, None])).sum(axis=1)


def test_mass_sits_at_the_left_end_of_each_bin_never_the_midpoint():
    grid = np.array([0.1, 0.3, 0.6, 0.9])
    dist = pessimistic_discretization(_Uniform01(), grid, cdf_tolerance=0.0)
    np.testing.assert_allclose(dist.y, grid)
    np.testing.assert_allclose(dist.weights, [0.2, 0.3, 0.3, 0.1])  # last atom: P(Y >= 0.9)
    assert dist.below_mass == pytest.approx(0.1)
    np.testing.assert_allclose(dist.scale, 1 / np.sqrt(grid))
    twin = pessimistic_discretization(_Uniform01(), grid, optimistic=True)
    np.testing.assert_allclose(twin.y, [0.1, 0.3, 0.6, 0.9, np.inf])
    np.testing.assert_allclose(twin.weights, [0.1, 0.2, 0.3, 0.3, 0.1])


@pytest.mark.parametrize("env", [HutchEnvelope(32, 2048), HutchEnvelope(2, 6), HutchPPEnvelope(32, 2048)])
def test_pessimistic_dominates_and_optimistic_is_dominated(env):
    lo, hi = env.support_interval(1e-12)
    grid = np.linspace(lo, hi, 300)
    pess = pessimistic_discretization(env, grid)
    opt = pessimistic_discretization(env, grid, optimistic=True)
    assert pess.weights.sum() + pess.below_mass == pytest.approx(1.0, abs=1e-14)
    assert opt.weights.sum() == pytest.approx(1.0, abs=1e-14)
    y = np.concatenate([np.linspace(lo / 2, hi * 1.5, 3001), grid])
    F = env.cdf(y)
    # stochastically smaller: more privacy loss (1e-15: the float sum of the atoms near G = 1)
    assert np.all(_discrete_cdf(pess, y) >= F - 1e-15)
    assert np.all(_discrete_cdf(opt, y) <= F + 1e-15)  # the optimistic twin: a lower bound


@given(cuts=st.lists(st.floats(0.01, 3.0), min_size=2, max_size=30, unique=True))
def test_any_grid_gives_a_dominating_distribution(cuts):
    env = _ENV
    grid = np.sort(np.asarray(cuts))
    dist = pessimistic_discretization(env, grid)
    y = np.linspace(0.005, 3.5, 500)
    assert np.all(_discrete_cdf(dist, y) >= env.cdf(y) - 1e-15)
    assert np.all(dist.weights >= 0) and 0 <= dist.below_mass <= 1


@pytest.mark.parametrize("grid,msg", [([0.5], "at least 2"), ([0.0, 0.5], "positive"), ([0.5, 0.4], "increasing"),
                                      ([0.1, np.nan], "grid"), ([0.1, np.inf], "grid")])
def test_bad_grids(grid, msg):
    with pytest.raises(ValueError, match=msg):
        pessimistic_discretization(HutchPPEnvelope(4, 16), grid)


def test_bad_tolerance():
    with pytest.raises(ValueError, match="cdf_tolerance"):
        pessimistic_discretization(HutchPPEnvelope(4, 16), [0.1, 0.2], cdf_tolerance=-1.0)

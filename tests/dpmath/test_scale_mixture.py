"""One randomized-clipping step in closed form (dpmath.pld.scale_mixture): its Gaussian terms and their error bounds
against mpmath, its bracket against exact sums over a discrete envelope's atoms (both directions) and against the
loss-grid path, and the accountant's use of it."""

import math

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpmath import DiscreteEnvelope, HutchEnvelope, PLDAccountant, PointMassEnvelope, SubsampledGaussian
from dpmath.pld.scale_mixture import ScaleMixtureCurve, gaussian_curve_terms

mpmath.mp.dps = 60


def _gaussian_mp(mu, e):
    mu, e = mpmath.mpf(mu), mpmath.mpf(e)
    return mpmath.ncdf(mu / 2 - e / mu) - mpmath.exp(e) * mpmath.ncdf(-mu / 2 - e / mu)


@settings(max_examples=300, deadline=None)
@given(log_mu=st.floats(-3, 3), e=st.one_of(st.floats(-30, 30), st.floats(30, 1e5)))
def test_a_gaussian_terms_error_bound_holds_the_exact_value(log_mu, e):
    mu = 10.0 ** log_mu
    value, err = gaussian_curve_terms(np.array([mu]), e)
    truth = _gaussian_mp(mu, e)
    assert 0.0 <= value[0] <= 1.0
    assert abs(mpmath.mpf(float(value[0])) - truth) <= mpmath.mpf(float(err[0])), (mu, e, value, err, truth)
    # and the bound is not vacuous where the value is representable
    assert err[0] <= 1e-6 * float(truth) + 1e-290 or float(truth) < 1e-280


def _pair_delta_mp(mu, q, eps):
    """One atom's subsampled-Gaussian hockey stick, worse direction, straight from the pairs' densities."""
    mu, q, eps = mpmath.mpf(mu), mpmath.mpf(q), mpmath.mpf(eps)
    sf = lambda x: mpmath.ncdf(-x)   # noqa: E731
    x = (mpmath.log((mpmath.exp(eps) - 1 + q) / q) + mu ** 2 / 2) / mu   # removing: P > e^eps Q beyond x
    remove = q * sf(x - mu) + (1 - q) * sf(x) - mpmath.exp(eps) * sf(x)
    add = mpmath.mpf(0)
    if mpmath.exp(-eps) > 1 - q:   # adding: P > e^eps Q below x
        x = (mpmath.log((mpmath.exp(-eps) - 1 + q) / q) + mu ** 2 / 2) / mu
        add = mpmath.ncdf(x) - mpmath.exp(eps) * (q * mpmath.ncdf(x - mu) + (1 - q) * mpmath.ncdf(x))
    return remove, add


def _mixture_delta_mp(values, weights, sigma, q, eps):
    parts = [_pair_delta_mp(1 / math.sqrt(y) / sigma, q, eps) for y in values]
    remove = sum(w * r for w, (r, _) in zip(weights, parts, strict=True))
    add = sum(w * a for w, (_, a) in zip(weights, parts, strict=True))
    return max(remove, add)


@settings(max_examples=40, deadline=None)
@given(sigma=st.floats(0.3, 5.0), q=st.floats(1e-4, 1.0), eps=st.floats(0.0, 20.0),
       values=st.lists(st.floats(1e-3, 10.0), min_size=1, max_size=4, unique=True))
def test_a_discrete_envelopes_curve_holds_the_exact_sum_over_its_atoms(sigma, q, eps, values):
    weights = np.full(len(values), 1.0 / len(values))
    curve = ScaleMixtureCurve(SubsampledGaussian(sigma, q, DiscreteEnvelope(values, weights)), 1.0)
    lo, hi = curve.delta_bracket(eps)
    truth = _mixture_delta_mp(values, weights, sigma, q, eps)
    assert mpmath.mpf(lo) <= truth <= mpmath.mpf(hi)
    assert hi - lo <= 1e-6 * hi + 1e-290   # the atoms are exact: the bracket is rounding only


@settings(max_examples=40, deadline=None)
@given(sigma=st.floats(0.3, 5.0), q=st.floats(0.01, 0.999), eps=st.floats(0.0, 3.0))
def test_each_directions_bounds_hold_its_exact_value(sigma, q, eps):
    # adding an example (P = N(0, 1) against the mixture) is bounded apart from removing one, where it is positive
    values, weights = [0.5, 2.0], np.array([0.5, 0.5])
    curve = ScaleMixtureCurve(SubsampledGaussian(sigma, q, DiscreteEnvelope(values, weights)), 1.0)
    exact = [sum(w * _pair_delta_mp(1 / math.sqrt(y) / sigma, q, eps)[j] for y, w in zip(values, weights, strict=True))
             for j in (0, 1)]
    for lo, truth, hi in zip(curve._directions(eps, False), exact, curve._directions(eps, True), strict=True):
        assert mpmath.mpf(lo) <= truth <= mpmath.mpf(hi)


@pytest.mark.parametrize(("sigma", "q", "delta"), [(1.0, 0.01, 1e-5), (0.7, 0.3, 1e-8), (3.0, 1.0, 1e-6)])
def test_a_point_mass_envelope_is_the_subsampled_gaussian_at_its_scale(sigma, q, delta):
    # Y = 4: the scale 1/2, the subsampled Gaussian at noise 2 sigma (its loss-grid bracket; at q = 1 its closed form)
    lo, hi = PLDAccountant().compose(SubsampledGaussian(sigma, q, PointMassEnvelope(4.0))).epsilon_bracket(delta)
    g_lo, g_hi = PLDAccountant().compose(SubsampledGaussian(2 * sigma, q)).epsilon_bracket(delta)
    assert lo <= g_hi and g_lo <= hi
    assert hi - lo <= max(g_hi - g_lo, 1e-9 * hi)


@pytest.mark.parametrize(("envelope", "sigma", "q", "delta"), [
    (HutchEnvelope(8, 200), 0.8, 0.3, 1e-8), (HutchEnvelope(4, 8), 3.0, 0.1, 1e-6),
    (HutchEnvelope(32, 2048), 1.0, 0.05, 1e-6)])
def test_the_closed_form_bracket_meets_the_loss_grids(envelope, sigma, q, delta):
    # both bracket the truth, so they intersect; on the same scale grid the closed form is the narrower
    acc = PLDAccountant(bracket_rtol=None).compose(SubsampledGaussian(sigma, q, envelope))
    lo, hi = acc.epsilon_bracket(delta)
    g_hi = max(c.epsilon(delta) for c in acc._composed(True))
    g_lo = max(c.epsilon(delta) for c in acc._composed(False))
    assert lo <= g_hi and g_lo <= hi
    assert hi - lo <= g_hi - g_lo


def test_mass_no_epsilon_covers_gives_an_infinite_upper_end():
    # HutchEnvelope's scale grid charges its mass below the 1e-20 quantile as an unbounded scale: q of it is never
    # covered
    acc = PLDAccountant().compose(SubsampledGaussian(1.0, 0.5, HutchEnvelope(4, 8)))
    assert acc.epsilon(1e-22) == math.inf
    assert acc.epsilon(1e-6) < math.inf


@pytest.mark.parametrize("delta", [pytest.param(d, marks=pytest.mark.slow) for d in (1e-3, 1e-6)] + [1e-10])
def test_delta_read_back_at_the_closed_forms_epsilon_is_at_most_delta(delta):
    for rtol in ("auto", None, 2e-3):
        acc = PLDAccountant(bracket_rtol=rtol).compose(SubsampledGaussian(0.8, 0.1, HutchEnvelope(4, 16)))
        eps = acc.epsilon(delta)
        assert acc.delta(eps) <= delta
        lo, hi = acc.delta_bracket(eps)
        assert lo <= delta


def test_a_huge_scales_rounding_bound_stays_small_where_its_curve_is_flat():
    # a = mu/2 - e/mu is rounded by about 1e-16 mu, but Phi is flat there: the bound is not 1e-14 mu
    value, err = gaussian_curve_terms(np.array([1e14]), 1.0)
    assert value[0] == 1.0 and err[0] < 1e-12
    acc = PLDAccountant().compose(SubsampledGaussian(1.0, 1.0, DiscreteEnvelope([1e-30, 1.0], [1e-3, 1 - 1e-3])))
    lo, hi = acc.delta_bracket(5.0)
    truth = _mixture_delta_mp([1e-30, 1.0], [1e-3, 1 - 1e-3], 1.0, 1.0, 5.0)
    assert mpmath.mpf(lo) <= truth <= mpmath.mpf(hi) and hi <= lo * (1 + 1e-9)


def test_a_tiny_sample_rate_near_epsilon_700_keeps_its_bracket():
    # e^eps / q passes the float range at eps = 700 + log q: the shifted argument is computed without it
    acc = PLDAccountant().compose(SubsampledGaussian(1.0, 1e-100, PointMassEnvelope(1 / 1600)))
    lo, hi = acc.delta_bracket(699.0)
    truth = _mixture_delta_mp([1 / 1600], [1.0], 1.0, 1e-100, 699.0)
    assert mpmath.mpf(lo) <= truth <= mpmath.mpf(hi) and hi <= lo * (1 + 1e-9)
    lo, hi = acc.epsilon_bracket(1e-101)
    assert lo < hi <= lo * (1 + 1e-9) and 620 < lo < 621


def test_a_delta_near_the_smallest_float_has_a_finite_epsilon():
    lo, hi = PLDAccountant().compose(SubsampledGaussian(1.0, 1.0, PointMassEnvelope(1.0))).epsilon_bracket(1e-300)
    g_lo, g_hi = PLDAccountant().compose(SubsampledGaussian(1.0, 1.0)).epsilon_bracket(1e-300)
    assert lo <= g_hi and g_lo <= hi < math.inf


def test_an_epsilon_past_every_scale_leaves_only_the_unbounded_mass():
    lo, hi = PLDAccountant().compose(SubsampledGaussian(1.0, 0.05, HutchEnvelope(32, 2048))).delta_bracket(1e308)
    assert lo == 0.0 and hi < 1e-20


@pytest.mark.parametrize(("call", "match"), [
    (lambda c: c.epsilon_bracket(math.nan), "delta"), (lambda c: c.epsilon_bracket(-1.0), "delta"),
    (lambda c: c.delta_bracket(math.nan), "eps"), (lambda c: c.delta_bracket(-1.0), "eps"),
    (lambda c: gaussian_curve_terms(np.array([-1.0]), 1.0), "mu"),
    (lambda c: gaussian_curve_terms(np.array([1.0]), math.nan), "e")])
def test_the_curves_public_methods_refuse_bad_input_naming_it(call, match):
    curve = ScaleMixtureCurve(SubsampledGaussian(1.0, 0.1, PointMassEnvelope(1.0)), 1.0)
    with pytest.raises(ValueError, match=match):
        call(curve)

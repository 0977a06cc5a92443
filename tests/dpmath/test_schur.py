"""Majorization orders, T-transforms, and the Schur-convexity checker on functions with known answers."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import integrate, special

from dpmath.chi2mix import chi2_mixture_cdf
from dpmath.majorization import (
    majorization_chain,
    majorizes,
    random_doubly_stochastic,
    t_transform,
    weakly_submajorizes,
    weakly_supermajorizes,
)
from dpmath.schur import check_schur

vectors = st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=8)


@given(vectors, st.integers(0, 2**32 - 1))
def test_doubly_stochastic_images_are_majorized(x, seed):
    x = np.array(x)
    m = random_doubly_stochastic(x.size, rng=seed)
    assert np.allclose(m.sum(0), 1) and np.allclose(m.sum(1), 1) and (m >= 0).all()
    y = m @ x
    assert majorizes(x, y, atol=1e-10)
    assert weakly_submajorizes(x, y, atol=1e-10) and weakly_supermajorizes(x, y, atol=1e-10)


@given(vectors, st.floats(0, 1))
def test_t_transform_is_majorized_and_the_reverse_is_not(x, w):
    x = np.array(x)
    y = t_transform(x, 0, 1, w)
    assert majorizes(x, y, atol=1e-10)
    if abs(x[0] - x[1]) > 1e-3 and 0.01 < w < 0.99:
        assert not majorizes(y, x, atol=1e-10)  # strictly less spread


def test_orders_on_hand_examples():
    assert majorizes([1, 0, 0], [1 / 3, 1 / 3, 1 / 3])
    assert not majorizes([0.6, 0.3, 0.1], [0.5, 0.5, 0.0])  # incomparable both ways
    assert not majorizes([0.5, 0.5, 0.0], [0.6, 0.3, 0.1])
    assert weakly_submajorizes([2, 1], [1.5, 1.0]) and not majorizes([2, 1], [1.5, 1.0])
    assert not weakly_submajorizes([1.5, 1.0], [2, 1])
    # LAP2's majorizer C (sqrt(i) - sqrt(i-1)) weakly submajorizes every |g| with ||g||_2 <= C
    rng = np.random.default_rng(0)
    x = np.sqrt(np.arange(1, 51)) - np.sqrt(np.arange(50))
    for _ in range(200):
        g = rng.standard_normal(50) * rng.exponential(1, 50)
        assert weakly_submajorizes(x, np.abs(g) / np.linalg.norm(g))


def test_chain_runs_from_vertex_to_centre():
    c = majorization_chain(5, 12, rng=3)
    assert np.array_equal(c[0], np.eye(5)[0]) and np.allclose(c[-1], 0.2)
    assert all(majorizes(c[r], c[r + 1]) for r in range(len(c) - 1))
    assert np.allclose(c.sum(1), 1)


@pytest.mark.parametrize("call, match", [
    (lambda: majorizes([1, 2], [1, 2, 3]), "same length"),
    (lambda: majorizes([1, np.nan], [1, 2]), "x must not contain NaN"),
    (lambda: weakly_submajorizes([1, 2], [np.inf, 2]), "y must be finite"),
    (lambda: majorizes([[1, 2]], [[1, 2]]), "1-D"),
    (lambda: majorizes([1, 2], [1, 2], atol=-1), "atol"),
    (lambda: t_transform([1, 2], 0, 0, 0.5), "differ"),
    (lambda: t_transform([1, 2], 0, 2, 0.5), "j must be an integer index"),
    (lambda: t_transform([1, 2], 0, 1, 1.5), "weight"),
    (lambda: random_doubly_stochastic(0), "n must be a positive integer"),
    (lambda: majorization_chain(1, 3), "at least 2"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


KNOWN = [  # (name, f, domain, Schur-convex?, Schur-concave?)
    ("sum of squares", lambda x: np.sum(x ** 2), "simplex", True, False),
    ("sum of logs", lambda x: np.sum(np.log(x)), "orthant", False, True),
    ("max", lambda x: float(np.max(x)), "simplex", True, False),
    ("entropy", lambda x: float(np.sum(special.entr(x))), "simplex", False, True),
    ("product", lambda x: np.prod(x), "orthant", False, True),
]


@pytest.mark.parametrize("name, f, domain, convex, concave", KNOWN, ids=[k[0] for k in KNOWN])
def test_known_verdicts(name, f, domain, convex, concave):
    for kind, expected in (("convex", convex), ("concave", concave)):
        r = check_schur(f, 5, kind, domain=domain)
        assert r.holds == expected, (kind, r)
        if not expected:
            assert r.verdict == "violated" and r.worst_violation > 0 and r.witness


def test_analytic_gradient_and_complex_step_agree_with_central():
    f = lambda x: np.sum(x ** 3)  # noqa: E731
    grad = lambda x: 3 * x ** 2  # noqa: E731
    reports = [check_schur(f, 4, gradient=grad), check_schur(f, 4, derivative="complex-step"),
               check_schur(lambda x: float(np.sum(x ** 3)), 4)]
    assert [r.derivative for r in reports] == ["analytic", "complex-step", "central"]
    assert all(r.holds for r in reports)


def test_non_schur_functions_are_caught_with_a_counterexample():
    # not symmetric
    r = check_schur(lambda x: float(x[0]), 4)
    assert r.verdict == "violated"
    # symmetric, but neither Schur-convex nor Schur-concave
    f = lambda x: float(np.sum(np.sin(10 * x)))  # noqa: E731
    for kind in ("convex", "concave"):
        r = check_schur(f, 4, kind)
        assert r.verdict == "violated" and r.test in ("schur-ostrowski", "pair")
        (x, *rest) = r.witness
        assert x.shape == (4,) and np.isclose(x.sum(), 1)
        if rest:  # a pair: check it really is a majorization pair that breaks the property
            y = rest[0]
            assert majorizes(x, y)
            assert (f(y) - f(x)) * (1 if kind == "convex" else -1) > 0


def test_nan_and_bad_returns_are_reported_not_passed():
    r = check_schur(lambda x: float("nan"), 3)
    assert r.verdict == "invalid" and not r.holds and "nan" in r.message
    r = check_schur(lambda x: x, 3)  # a vector, not a scalar
    assert r.verdict == "invalid"
    r = check_schur(lambda x: np.inf if x[0] > 0.5 else 0.0, 3)
    assert r.verdict == "invalid"
    assert check_schur(lambda x: "big", 3).verdict == "invalid"
    with pytest.raises(ValueError, match="complex"):  # a complex step through float() would read 0
        check_schur(lambda x: float(np.sum(x ** 2).real), 3, derivative="complex-step")


@pytest.mark.parametrize("kwargs, match", [
    (dict(d=1), "d must be at least 2"),
    (dict(kind="linear"), "kind"),
    (dict(domain="cube"), "domain"),
    (dict(points=0), "points"),
    (dict(rtol=-1.0), "rtol"),
    (dict(atol=float("nan")), "atol"),
    (dict(min_entry=0.5), "min_entry"),
    (dict(extra_points=[[0.5, 0.5]]), "extra_points"),
    (dict(extra_points=[[np.nan, 0.5, 0.5]]), "extra_points must not contain NaN"),
])
def test_checker_bad_input(kwargs, match):
    args = dict(f=lambda x: float(np.sum(x ** 2)), d=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        check_schur(**args)


def _gil_pelaez_cdf(x, lam, k):
    """P(sum lam_i chi2_k / k <= x) by Gil-Pelaez inversion: independent of dpmath.chi2mix."""
    w = np.asarray(lam) / k

    def integrand(t):
        return (np.exp(-1j * t * x) * np.prod((1 - 2j * w * t) ** (-k / 2))).imag / t

    val, _ = integrate.quad(integrand, 0, np.inf, limit=2000, epsabs=1e-14, epsrel=1e-12)
    return 0.5 - val / np.pi


@pytest.mark.filterwarnings("ignore::scipy.integrate.IntegrationWarning")
@pytest.mark.parametrize("k", [1, 4, 32])
def test_envelope_cdf_is_not_schur_convex_at_one_for_d3(k):
    """Paper 000, Prop. B.12 says g(lam) = P(X(lam) <= 1) is Schur-convex on the simplex for every d.
    For d = 3 a T-transform pair refutes it: y majorizes x but g(y) < g(x), by two independent methods."""
    x = np.array([0.3, 0.69, 0.01])
    y = np.array([0.31, 0.69, 0.0])
    assert majorizes(y, x)
    ours = float(chi2_mixture_cdf(1.0, y[:2] / k, k)) - float(chi2_mixture_cdf(1.0, x / k, k))
    ref = _gil_pelaez_cdf(1.0, y[:2], k) - _gil_pelaez_cdf(1.0, x, k)
    assert ours < -2e-4 and ref < -2e-4
    # quadrature of the oscillating inversion integral is the less accurate of the two at k = 1
    assert abs(ours - ref) < (1e-5 if k == 1 else 1e-9)


def test_envelope_cdf_is_schur_convex_at_one_for_d2_as_claimed():
    """For d = 2 the claim of Prop. B.12 holds (here: a grid of T-transform pairs, k = 4)."""
    k = 4
    a = np.linspace(0.5, 1.0, 41)
    g = np.array([float(chi2_mixture_cdf(1.0, np.array([v, 1 - v]) / k, k)) for v in a])
    assert np.all(np.diff(g) > 0)  # more spread, larger CDF at 1


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 4, pytest.param(32, marks=pytest.mark.slow)])
def test_vertex_still_dominates_below_one_for_d3(k):
    """Prop. B.12 fails for d = 3, but its consequence used by the envelope (the vertex maximizes
    P(X(lam) <= x) for x < 1) survives on random Dirichlet points, including near the counterexample."""
    rng = np.random.default_rng(k)
    xs = np.array([0.3, 0.6, 0.9, 0.99, 0.999])
    vertex = special.gammainc(k / 2, xs * k / 2)
    lams = [np.array([0.3, 0.69, 0.01]), np.array([0.31, 0.69, 0.0])[:2]]
    lams += [rng.dirichlet(np.full(3, c)) for c in (0.2, 1.0, 5.0) for _ in range(8)]
    for lam in lams:
        lam = np.maximum(lam, 1e-3)
        lam /= lam.sum()
        assert np.all(chi2_mixture_cdf(xs, lam / k, k) <= vertex + 1e-12)

"""Compositions of heavy-tailed steps read with the exact terms of one large loss (dpmath.pld.compose.OneLargeLoss):
both bounds hold the exact composition, the upper within the charge for two or more large losses, and the split
takes the windows from millions of points to thousands on a randomized-clipping step."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpmath import HutchEnvelope, PLDAccountant, SubsampledGaussian
from dpmath.pld.compose import CUT, Composition, LargeLosses, OneLargeLoss, split_tails
from dpmath.pld.distribution import Pld

H = 0.01


def _heavy_step(upper: bool) -> Pld:
    """A step whose losses have a polynomial tail (mass j^-3 at loss j h, up to 60 nats) over a bulk near 0."""
    j = np.arange(-2, 6000)
    pmf = np.zeros(j.size)
    pmf[j > 0] = j[j > 0].astype(float) ** -3.0
    pmf *= 0.02 / pmf.sum()
    pmf[:5] += np.array([0.02, 0.1, 0.4, 0.28, 0.18])   # losses -0.02 to 0.02
    pmf /= pmf.sum()
    assert float(pmf @ np.exp(-j * H)) <= 1.0          # Q's mass: a pair of (sub-)probabilities
    return Pld(H, -2, pmf, 0.0, upper)


def _exact(n: int) -> Pld:
    step = _heavy_step(True)
    pmf = step.pmf
    for _ in range(n - 1):
        pmf = np.convolve(pmf, step.pmf)
    return Pld(H, -2 * n, pmf, 0.0, True)


@pytest.mark.parametrize("n", [2, 5])
def test_the_split_bounds_hold_the_exact_composition_and_the_upper_is_within_the_charge(n):
    exact = _exact(n)
    for delta in (1e-3, 1e-5):
        upper = Composition([(_heavy_step(True), n)], 1e-18, split=True)
        lower = Composition([(_heavy_step(False), n)], 1e-18, split=True)
        split = upper._split(delta)
        assert split is not None and split.tails is not None   # the path under test is taken
        # from 0 to far above every tail's least loss plus the bodies' least (where the terms' (.)_+ first vanish)
        for eps in np.linspace(0.0, 60.0, 31):
            truth = exact.delta(float(eps))
            hi, lo = split.local(0.0).delta(float(eps)), lower._split(delta).local(0.0).delta(float(eps))
            assert lo <= truth * (1 + 1e-9) + 1e-15 and truth <= hi * (1 + 1e-9) + 1e-15
            # two or more large losses are charged whole: at most CUT * delta (plus the FFT's error bounds)
            assert hi - truth <= CUT * delta + 1e-10
            assert truth - lo <= CUT * delta + 1e-10
        e_hi, e_lo = upper.epsilon(delta), lower.epsilon(delta)
        assert e_lo <= exact.epsilon(delta) <= e_hi
        assert e_hi - e_lo <= 2e-3 * e_hi


def _brute(h, t_start, t, b_start, b, eps):
    x = (t_start + np.arange(t.size))[:, None] + (b_start + np.arange(b.size))[None, :]
    w, e = t[:, None] * b[None, :], np.exp(eps - x * h)
    return float(np.sum(w * np.minimum(1.0, e))), float(np.sum(w * np.maximum(0.0, 1.0 - e)))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 30), st.integers(-40, 40), st.integers(-40, 40),
       st.floats(-5.0, 160.0), st.integers(0, 2**31 - 1))
def test_the_one_large_loss_bounds_are_the_discrete_sums_at_every_epsilon(k, m, t_start, b_start, eps, seed):
    # every branch: the tail's points all below, all above and across epsilon minus B's least and largest loss, in
    # one block of the tail's kept sums or several; exact masses given, both bounds are the sums to rounding
    rng = np.random.default_rng(seed)
    h = 0.05
    t, b = rng.random(k), rng.random(m)
    large = LargeLosses(h, [(3, t_start, t, b_start, b, b, float(b.sum()), 0.0, 0.0)])
    g, hs = large.bounds(eps)
    g_exact, h_exact = (3 * v for v in _brute(h, t_start, t, b_start, b, eps))
    scale = 3 * t.sum() * b.sum()
    assert g <= g_exact and g_exact - g <= 1e-9 * scale
    assert hs <= h_exact and h_exact - hs <= 1e-9 * scale


def test_both_bounds_of_the_one_large_loss_terms_hold_for_inexact_compositions():
    # B given as lower and upper values (an FFT pass's, less and plus its error bounds): each bound takes the better
    # of its two forms, and neither passes the truth; a loose lower array alone loses a thousandth of the mass,
    # which the exact mass and the upper array recover where H is near 0
    rng = np.random.default_rng(3)
    h = 0.05
    t, b = rng.random(200) * 1e-3, rng.random(50)
    b /= b.sum()
    err = np.full(b.size, 1e-3 / b.size)
    large = LargeLosses(h, [(2, 40, t, -20, np.maximum(b - err, 0.0), b + err, 1.0 - 1e-12, 0.0, 0.0)])
    for eps in (0.0, 1.0, 2.0, 5.0, 12.0):
        g, hs = large.bounds(eps)
        g_exact, h_exact = (2 * v for v in _brute(h, 40, t, -20, b, eps))
        assert g <= g_exact and hs <= h_exact
    g, _ = large.bounds(14.0)   # above every pair's loss (1 to 13.4): H = 0 and G the whole mass, from the exact mass
    assert g >= 2 * t.sum() * (1 - 1e-9)


def test_the_upper_split_subtracts_only_the_uncounted_part_of_the_one_large_loss_terms():
    # base counts every one-large-loss term at its whole mass; the split takes off G, the part H does not count: at
    # an epsilon far above every loss G is all of it, and below every loss it is the Q-mass times e^eps
    step = _heavy_step(True)
    bodies, tails = split_tails([(step, 3)], 1e-4)
    comp = Composition(bodies, 1e-18)
    comp.tails = tails
    read = comp.local(0.0)
    assert isinstance(read, OneLargeLoss)
    base = read.base
    top = read.large.top + 1.0
    g, h = read.large.bounds(top)
    mass = 3 * float(tails[0][2].sum()) * float(bodies[0][0].pmf.sum()) ** 2
    assert g == pytest.approx(mass, rel=1e-9) and h == 0.0
    assert read.delta(top) == pytest.approx(base.delta(top) - g, rel=1e-9)
    assert read.delta(0.5) < base.delta(0.5)


def test_a_light_tailed_step_is_not_split():
    # a Gaussian's tail holds no mass worth a composition of its own: the grids are the same with or without it
    acc = PLDAccountant().compose(SubsampledGaussian(1.0, 0.01), 100)
    comp = acc._composed(True, 1e-4, 1.0, (0,))[0]
    assert not comp.split and comp._split(1e-6) is None


def test_a_heavy_tailed_randomized_clipping_composition_reads_a_small_window():
    # Hutch k 8: per-step losses reach the grid's cap of 2^22 points; split at the delta's square root they reach a
    # few nats, and the window shrinks from about 5M points to under 100,000
    acc = PLDAccountant().compose(SubsampledGaussian(2.3, 0.0013, HutchEnvelope(8, 1024)), 72)
    comp = acc._composed(True, 1e-4, 0.5, (0,))[0]
    split = comp._split(3.6e-7)
    assert split is not None and split.hi - split.lo < 100_000 < comp.hi - comp.lo
    assert split.tails is not None and math.isfinite(comp.epsilon(3.6e-7))


@pytest.mark.parametrize("k, d, sigma, q, steps, delta", [
    (16, 256, 1.365, 0.0321, 21, 1.3e-5),   # split [1.43224744, 1.43676266], cut [1.43224745, 1.43676266]
    (8, 1024, 1.611, 0.0456, 139, 2.9e-6),  # a heavier tail: the split's bracket well inside the cut's
])
def test_the_split_and_the_cut_of_a_randomized_clipping_composition_bracket_each_other(k, d, sigma, q, steps, delta):
    # two readings of one grid's steps, each a valid bracket: neither lower end may pass the other's upper end, and
    # the split's exact one-large-loss terms keep its bracket about as narrow as the cut's or narrower (17 random
    # settings with both: never wider by more than 3e-6 of the width, up to 42 % narrower)
    acc = PLDAccountant().compose(SubsampledGaussian(sigma, q, HutchEnvelope(k, d)), steps)
    up, lo = (acc._composed(b, 1e-3, 0.5, (0,), (True, False))[0] for b in (True, False))
    split = [c._split(delta) for c in (lo, up)]
    cut = [c._cut(delta) for c in (lo, up)]
    assert all(s is not None for s in split) and all(c is not o for c, o in zip(cut, (lo, up), strict=True))
    (s_lo, s_hi), (c_lo, c_hi) = ([c.epsilon(delta) for c in pair] for pair in (split, cut))
    assert max(s_lo, c_lo) <= min(s_hi, c_hi)
    assert s_hi - s_lo <= (c_hi - c_lo) * (1 + 1e-5)

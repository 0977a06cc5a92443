r"""One epoch of random allocation (balls in bins) as an upper and a lower discrete PLD.

Each example sits in exactly one of an epoch's ``t`` steps, uniformly and independently; every step adds
Gaussian noise of standard deviation ``sigma`` (clipping norm 1).  Chua et al. (AISTATS 2025) show that the
pair

.. math::

    P = \frac1t \sum_{j=1}^{t} N(\mu e_j, I_t), \qquad Q = N(0, I_t), \qquad \mu = 1/\sigma,

dominates the epoch for adaptively chosen gradients (``P``: the example is in the data set).  Its privacy loss
is a function of one statistic,

.. math::

    L = \log \bar S, \qquad \bar S = \frac1t \sum_{j=1}^{t} W_j, \qquad W_j = e^{\mu x_j - \mu^2/2},

with ``W_j`` i.i.d. lognormal ``LN(-mu^2/2, mu^2)`` under ``Q``; under ``P`` one of them (the allocated step's)
is ``LN(mu^2/2, mu^2)`` instead.  Removing the example reads ``L`` under ``P``; adding it reads ``-L`` under
``Q``.  So one epoch's PLD is the law of a sum of ``t`` independent lognormals, in each direction.

**How it is bounded.**  Every ``W`` is rounded *up* (or *down*) to a grid of step ``D``, a coupling under which
the rounded ``S`` is at least (at most) the true one, so the losses of the upper PLD are never below the true
ones, and those of the lower PLD never above (``delta`` of a composition is non-decreasing in every loss).  The
sum of the rounded terms is a composition of discrete laws on one grid (:class:`~dpmath.pld.compose.Composition`,
whose FFT error is bounded and charged; its upper bound's masses are pointwise upper bounds, the lower bound's
pointwise lower bounds).  The two roundings put the same mass on neighbouring points, so the lower law is the
upper one shifted by ``t`` grid steps, with its error bounds subtracted instead of added: one FFT composition
serves both.  A term beyond the grid's cap ``M`` (probability at most ``1e-14`` for the allocated term) is
charged to ``+inf`` (upper) or dropped (lower).

The loss of ``S`` rounds by at most ``D / S-bar`` nats.  A lognormal's heavy tail stretches the grid, so where one
grid of ``2^21`` points would be coarser than ``2e-4`` (``sigma < 1`` or long epochs), **removing** is split at a
cap ``m``: the law of ``S`` on the event ``A`` that every term is at most ``m`` is composed on a fine grid, and on
its complement (where ``S > m``, a large loss) as the difference of the whole law and the law on ``A``, both on a
coarse grid (pointwise upper bound: upper minus lower; lower bound: lower minus upper).  **Adding** has its large
losses where ``S`` is small, so there a term above ``m = t e^3`` is held at ``m`` (upper: a smaller ``S``, a larger
loss) or dropped (lower: its loss is below ``-3``).

The result is checked against an importance-sampled Monte Carlo estimate of ``delta`` and against the RDP of
random allocation (``verify``), and its upper end never exceeds the Gaussian bound without amplification by more
than the grids' rounding.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import special

from .compose import Composition
from .distribution import Pld

__all__ = ["epoch_plds", "sum_laws", "SumLaw"]

_CAP_Z = 7.65            # a term's cap is its lognormal's 1 - 1e-14 quantile (the allocated term's; charged)
_POINTS = 1 << 21        # grid points of one composed sum (a few FFT passes of 2^21 to 2^22 points)
_FINE = 2e-4             # the grid step (in S-bar units: nats of loss near S-bar = 1) removing tries to reach
_FINEST = 1e-4           # no finer grid than this (the default loss grid's step)
_ADD_CAP = 3.0           # adding: a term above at most t e^3 is held there (upper) or dropped (lower)
_WINDOW_TAIL = 1e-18     # mass a composed sum's window leaves out on each side (charged like the cap)
_TRIAL = 1 << 14         # grid points of a term's law when only its sum's window is measured


@dataclass(frozen=True)
class SumLaw:
    """Pointwise upper and lower bounds on the law of the rounded-up (``upper``) and rounded-down (``lower``) sum
    ``S = start * step + j * step``; ``inf``: mass of the upper sum at ``+inf``; ``slack``: what the lower law may
    hold too high (FFT wrap-around), subtracted from every delta."""

    step: float
    start: int
    upper: np.ndarray
    lower_start: int
    lower: np.ndarray
    inf: float
    slack: float


def _term(mu: float, shifted: bool, step: float, k_top: int, up: bool) -> tuple[np.ndarray, float]:
    """Masses of one ``W = exp(N(c, mu^2))`` (``c = +mu^2/2`` for the allocated term, ``-mu^2/2`` otherwise) on
    the grid points ``0 .. K`` (``K = k_top``), rounded up (``up``) or down, and the mass beyond ``K step``."""
    c = 0.5 * mu * mu * (1.0 if shifted else -1.0)
    with np.errstate(divide="ignore"):
        z = (np.log(np.arange(k_top + 1) * step) - c) / mu
    cdf = special.ndtr(z)
    cdf[0] = 0.0
    inter = np.diff(cdf)                       # mass of ((k - 1) step, k step], k = 1..K
    beyond = float(special.ndtr(-z[-1]))
    pmf = np.concatenate([[0.0], inter]) if up else np.concatenate([inter, [0.0]])
    return pmf, beyond


def _sum(mu: float, steps: int, step: float, k_top: int, allocated: bool, negate: bool = False,
         up: bool = True, hold: bool = False, lower_mode: bool = False) -> Composition:
    """The composition of the ``steps`` terms (one of them the allocated one if ``allocated``), each rounded
    (``up``) on the grid ``step`` and restricted to ``W <= k_top step`` (the rest at ``+inf``), or, with ``hold``,
    held there; ``negate``: the law of ``-S``."""
    def pld(shifted: bool) -> Pld:
        pmf, beyond = _term(mu, shifted, step, k_top, up)
        inf = beyond
        if hold:
            pmf[-1] += beyond
            inf = 0.0
        if negate:
            return Pld(step, -(pmf.size - 1), pmf[::-1].copy(), inf, not lower_mode)
        return Pld(step, 0, pmf, inf, not lower_mode)

    events = [(pld(False), steps - 1), (pld(True), 1)] if allocated else [(pld(False), steps)]
    return Composition([(p, n) for p, n in events if n > 0], _WINDOW_TAIL)


def _span(mu: float, steps: int, cap: float, allocated: bool, negate: bool = False) -> float:
    """Width of a composed sum's window, in units of ``S`` (measured on a coarse trial grid: it barely depends on
    the grid)."""
    c = _sum(mu, steps, cap / _TRIAL, _TRIAL, allocated, negate, hold=negate)
    return (c.hi - c.lo + 1) * c.h


def _upper_law(comp: Composition, shift: int, restricted: bool = False) -> SumLaw:
    """Both bounds from one upper-mode composition: the lower law is the upper one shifted down by ``shift``
    grid points (the terms rounded down instead of up), with twice the error bound taken off (the upper pmf has
    it added), and its first point (which holds the mass lumped from below the window) dropped.  ``restricted``:
    the terms beyond the cap are another part's event, not a charge (only the window's cut mass is)."""
    full = comp.full()
    err = full.err if full.err is not None else np.zeros_like(full.pmf)
    lower = np.maximum(full.pmf - 2.0 * err, 0.0)
    lower[0] = 0.0
    inf = comp.over if restricted else full.inf
    return SumLaw(comp.h, full.start, full.pmf, full.start - shift, lower, inf, comp.over + comp.under)


def _difference(whole: SumLaw, part: SumLaw) -> SumLaw:
    """Pointwise bounds on ``whole - part`` (the law on the complement of ``part``'s event): upper minus lower,
    lower minus upper, at least 0."""
    lo = min(whole.start, part.start)
    hi = max(whole.start + whole.upper.size, part.start + part.upper.size)

    def placed(arr: np.ndarray, start: int) -> np.ndarray:
        out = np.zeros(hi - lo)
        out[start - lo:start - lo + arr.size] = arr
        return out

    shift = whole.start - whole.lower_start
    upper = np.maximum(placed(whole.upper, whole.start) - placed(part.lower, part.lower_start + shift), 0.0)
    lower = np.maximum(placed(whole.lower, whole.lower_start + shift) - placed(part.upper, part.start), 0.0)
    return SumLaw(whole.step, lo, upper, lo - shift, lower, whole.inf, whole.slack + part.slack)


@functools.lru_cache(maxsize=8)
def sum_laws(mu: float, steps: int, relation: str) -> tuple[SumLaw, ...]:
    """The laws of ``S`` for one direction (``"remove"``: ``S`` under ``P``; ``"add"``: ``-S`` under ``Q``), as
    parts on disjoint events whose bounds add up (one part, or the fine part on ``A`` and the coarse part on its
    complement)."""
    t = steps
    if relation == "add":
        # a term above m is held at m: S falls by (W - m)_+, whose mean (the upper tail's share of E W = 1,
        # P(N(0, 1) > (log m - mu^2/2) / mu)) is kept at a quarter of the fine step
        cap = min(t * math.exp(_ADD_CAP), math.exp(0.5 * mu * mu - mu * special.ndtri(0.25 * _FINE)))
        step = max(_FINEST, _span(mu, t, cap, False, negate=True) / _POINTS)
        k_top = math.ceil(cap / step)
        up = _sum(mu, t, step, k_top, False, negate=True, up=False, hold=True).full()
        low = _sum(mu, t, step, k_top, False, negate=True, up=True, lower_mode=True).full()
        return (SumLaw(step, up.start, up.pmf, low.start, low.pmf, up.inf, low.slack),)
    cap = math.exp(0.5 * mu * mu + _CAP_Z * mu)
    whole_span = _span(mu, t, cap, True)
    if whole_span / _POINTS <= _FINE:
        step = max(_FINEST, whole_span / _POINTS)
        return (_upper_law(_sum(mu, t, step, math.ceil(cap / step), True), t),)
    # split at the largest cap m (halving, down to t) whose law on A fits the points at the fine step
    m = cap
    while m / 2.0 >= t and _span(mu, t, m, True) / _POINTS > _FINE:
        m /= 2.0
    coarse = whole_span / _POINTS
    # the fine step divides the coarse one and A = {every W <= k coarse} is the same event on both grids, so
    # the parts' events are complementary
    ratio = max(1, math.floor(coarse / max(_FINEST, _span(mu, t, m, True) / _POINTS)))
    fine = coarse / ratio
    k = max(1, math.floor(m / coarse))
    part = _upper_law(_sum(mu, t, fine, k * ratio, True), t, restricted=True)
    whole = _upper_law(_sum(mu, t, coarse, math.ceil(cap / coarse), True), t)
    on_a = _upper_law(_sum(mu, t, coarse, k, True), t)
    return part, _difference(whole, on_a)


def _losses(law: SumLaw, steps: int, relation: str, h: float, upper: bool) -> tuple[np.ndarray, np.ndarray, float]:
    """``(loss grid indices, masses, mass at +inf)`` of one part, its losses rounded toward the bound's side."""
    start, pmf = (law.start, law.upper) if upper else (law.lower_start, law.lower)
    k = np.abs(start + np.arange(pmf.size))
    with np.errstate(divide="ignore"):
        loss = np.log(k * (law.step / steps))
    if relation == "add":
        loss = -loss
    finite = np.isfinite(loss) & (pmf > 0)
    inf = law.inf if upper else 0.0
    if upper:
        inf += float(pmf[np.isposinf(loss)].sum())
    if not finite.any():
        return np.zeros(0, np.int64), np.zeros(0), inf
    # far below every delta a composition reads, losses are lumped at a floor: up to it (upper), or dropped (lower)
    order = np.argsort(loss[finite])
    floor = loss[finite][order][min(order.size - 1, int(np.searchsorted(np.cumsum(pmf[finite][order]), 1e-30)))]
    keep = finite & (loss >= floor) if not upper else finite
    x = np.maximum(loss[keep], floor) / h
    # one part in 1e9 of the quotient covers the rounding of the log and the division
    if upper:
        idx = np.ceil(x + 1e-9 * np.abs(x) + 1e-9).astype(np.int64)
    else:
        idx = np.floor(x - 1e-9 * np.abs(x) - 1e-9).astype(np.int64)
    return idx, pmf[keep], inf


def epoch_plds(noise_multiplier: float, steps: int, relation: str, h: float, bounds: tuple[bool, ...]) -> list[Pld]:
    """One epoch of random allocation in the direction ``relation`` (``"remove"`` or ``"add"``) on the loss grid
    ``h``, as a discrete PLD for each bound in ``bounds`` (``True``: upper)."""
    mu = 1.0 / noise_multiplier
    laws = sum_laws(mu, steps, relation)
    out = []
    for upper in bounds:
        idx, mass, inf, slack = [], [], 0.0, 0.0
        for law in laws:
            i, m, f = _losses(law, steps, relation, h, upper)
            idx.append(i)
            mass.append(m)
            inf += f
            slack += 0.0 if upper else law.slack
        i, m = np.concatenate(idx), np.concatenate(mass)
        lo = int(i.min()) if i.size else 0
        pmf = np.bincount(i - lo, weights=m) if i.size else np.zeros(1)
        out.append(Pld(h, lo, pmf, min(1.0, inf), upper, slack=slack))
    return out

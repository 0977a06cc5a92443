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
grid of ``n = 2^21`` points (``2^20`` for epochs of at most 128 steps) would be coarser than ``2e-4`` (``sigma``
near 1 or below, or long epochs), **removing** is split by the largest term: caps ``m_0 < m_1 < ... < m_L``
(``m_0`` the largest whose sum fits ``n`` points at that step, each next about ``1e-3 n / t`` times the last), and
part ``i`` is the law on the event that the largest term lies in ``(m_{i-1}, m_i]``, where ``S > m_{i-1}``.  Each
part sits on its own grid, of a step about ``m_i / n``, so it rounds ``S`` by at most ``1e-3`` of itself; the
grids are nested and every cap is a point of two neighbouring grids, so the events are exactly complementary.
Part ``i`` is the difference of the laws with caps ``m_i`` and ``m_{i-1}`` on its grid (pointwise: upper minus
lower for the upper bound, lower minus upper for the lower).

**Adding** has its large losses where ``S`` is small, so a term above ``m`` (at most ``t e^3``, and where
``E (W - m)_+`` is ``5e-5``) is held at ``m`` (upper: a smaller ``S``, a larger loss) or dropped (lower: the loss
is below every one that matters).

Where the grids fail (``sigma`` near 0.3, whose terms span 13 decades), one coarse grid is used, and its upper PLD
is replaced by the Gaussian step without amplification (:meth:`dpmath.RandomAllocationGaussian.dominating`) where
that has the smaller epsilon at ``delta = 1e-6``: both are upper bounds, so either choice is sound.

**Cost and width, measured** (``benchmarks/sampling_bench.py`` Table S3, ``delta = 1e-5``, one core, cold):
``sigma = 1`` and 234 steps an epoch, 7 s, then 0.09 % wide after one epoch and 0.20 % after 10; ``sigma = 0.6``
and 100 steps, 13 s, 0.10 % after 10; ``sigma = 2`` and 1000 steps, 0.84 %; ``sigma = 0.8`` and 4000 steps, 4.2 %
after 10 (a long epoch's sum concentrates where its grid is coarse).

The result is checked against an importance-sampled Monte Carlo estimate of ``delta`` and against the Renyi bound
of random allocation (:mod:`verify.allocation`).
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
_POINTS = 1 << 21        # grid points of one composed sum (FFT passes of 2^21 to 2^24 points; about 1.5 GB at peak) ...
_SHORT, _SHORT_POINTS = 128, 1 << 20   # ... half as many for epochs of at most 128 steps, already 0.05 % wide there
_FINE = 2e-4             # the grid step (in S-bar units: nats of loss near S-bar = 1) removing tries to reach
_FINEST = 1e-4           # no finer grid than this (the default loss grid's step)
_ADD_CAP = 3.0           # adding: a term above at most t e^3 is held there (upper) or dropped (lower)
_WINDOW_TAIL = 1e-18     # mass a composed sum's window leaves out on each side (charged like the cap)
_TRIAL = 1 << 14         # grid points of a term's law when only its sum's window is measured
_LEVEL_RTOL = 1e-3       # removing, heavy tails: a level's relative rounding of S, t R / points for caps R apart


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


def _span(mu: float, steps: int, cap: float, allocated: bool, negate: bool = False) -> tuple[float, float]:
    """Width of a composed sum's window and the largest ``S`` in it, in units of ``S`` (measured on a coarse trial
    grid: they barely depend on the grid).  A term above that ``S`` puts the sum outside the window, so no term's
    grid needs to reach beyond it (its mass is the window's cut mass either way)."""
    c = _sum(mu, steps, cap / _TRIAL, _TRIAL, allocated, negate, hold=negate)
    return (c.hi - c.lo + 1) * c.h, max(abs(c.hi), abs(c.lo)) * c.h


def _upper_law(comp: Composition, shift: int, restricted: bool = False) -> SumLaw:
    """Both bounds from one upper-mode composition: the lower law is the upper one shifted down by ``shift``
    grid points (the terms rounded down instead of up), with twice the error bound taken off (the upper pmf has
    it added), and the mass lumped from below the window taken off its first point.  ``restricted``:
    the terms beyond the cap are another part's event, not a charge (only the window's cut mass is)."""
    full = comp.full()
    err = full.err if full.err is not None else np.zeros_like(full.pmf)
    lower = np.maximum(full.pmf - 2.0 * err, 0.0)
    lower[0] = max(0.0, full.pmf[0] - full.lump - 2.0 * err[0])
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


@functools.lru_cache(maxsize=2)   # both directions of one noise level: up to about 150 MB
def sum_laws(mu: float, steps: int, relation: str) -> tuple[SumLaw, ...]:
    """The laws of ``S`` for one direction (``"remove"``: ``S`` under ``P``; ``"add"``: ``-S`` under ``Q``), as
    parts on disjoint events whose bounds add up: one part, or (removing, heavy tails) one per level of the largest
    term, each on its own grid (module docstring)."""
    t = steps
    points = _SHORT_POINTS if t <= _SHORT else _POINTS
    if relation == "add":
        # a term above m is held at m: S falls by (W - m)_+, whose mean (the upper tail's share of E W = 1,
        # P(N(0, 1) > (log m - mu^2/2) / mu)) is kept at a quarter of the fine step
        cap = min(t * math.exp(_ADD_CAP), math.exp(0.5 * mu * mu - mu * special.ndtri(0.25 * _FINE)))
        span, top = _span(mu, t, cap, False, negate=True)
        step = max(_FINEST, span / points)
        k_top = math.ceil(min(cap, top) / step)
        up = _sum(mu, t, step, k_top, False, negate=True, up=False, hold=True).full()
        low = _sum(mu, t, step, k_top, False, negate=True, up=True, lower_mode=True).full()
        return (SumLaw(step, up.start, up.pmf, low.start, low.pmf, up.inf, low.slack),)
    z_cap = math.exp(0.5 * mu * mu + _CAP_Z * mu)
    whole_span, top = _span(mu, t, z_cap, True)
    cap = min(z_cap, top)
    cap_step = whole_span / points

    def one_grid(step: float) -> tuple[SumLaw]:
        return (_upper_law(_sum(mu, t, step, math.ceil(cap / step), True), t),)

    if cap_step <= _FINE:
        return one_grid(max(_FINEST, cap_step))
    # caps m_0 < m_1 < ... < m_L = cap: m_0 the largest (halving, down to 1) whose sum fits the points at the fine
    # step, each next R times the last.  Part i is the law on {the largest term in (m_{i-1}, m_i]}, where S > m_{i-1}
    # and the grid's step is about m_i / points (or the bulk's spread over points, where S is near t anyway), so S
    # rounds by at most t R / points of itself: R is chosen for _LEVEL_RTOL (between 4 and 1024)
    ratio = min(1024.0, max(4.0, _LEVEL_RTOL * points / t))
    m, (span, top) = cap, _span(mu, t, cap, True)
    while m / 2.0 >= 1.0 and span / points > _FINE:
        m /= 2.0
        span, top = _span(mu, t, m, True)
    caps, steps_ = [min(m, top)], [max(_FINEST, span / points)]   # a term above its window's top is above m
    while caps[-1] < cap:
        nxt = min(cap, caps[-1] * ratio)
        caps.append(nxt)
        steps_.append(cap_step if nxt == cap else _span(mu, t, nxt, True)[0] / points)
    # nested grids, coarse to fine: each step divides the next, and each cap is a point of its level's grid and
    # of the next, so the parts' events are complementary
    for i in range(len(steps_) - 2, -1, -1):
        steps_[i] = steps_[i + 1] / max(1, math.floor(steps_[i + 1] / steps_[i]))
    k = [math.floor(c / steps_[i + 1]) * round(steps_[i + 1] / steps_[i]) for i, c in enumerate(caps[:-1])]
    k.append(math.ceil(cap / steps_[-1]))
    if any(j < 1 for j in k) or any(j > 2 * points for j in k):
        # a grid cannot tell one level from the next (tails so heavy, sigma ~ 0.3, that one grid of the whole sum is
        # all there is): one part on a coarse grid (a quarter of the points: its upper end is rarely the one used,
        # see dpmath.pld.steps), valid on both sides and loose
        return one_grid(4.0 * cap_step)
    sums: dict[tuple[float, int], Composition] = {}   # levels sharing a grid share a composition

    def law(step: float, k_top: int, restricted: bool) -> SumLaw:
        if (step, k_top) not in sums:
            sums[(step, k_top)] = _sum(mu, t, step, k_top, True)
        return _upper_law(sums[(step, k_top)], t, restricted)

    last = len(caps) - 1
    parts = [law(steps_[0], k[0], True)]
    for i in range(1, last + 1):
        below = round(k[i - 1] * steps_[i - 1] / steps_[i])   # the previous cap on this level's grid
        parts.append(_difference(law(steps_[i], k[i], i < last), law(steps_[i], below, True)))
    return tuple(parts)


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
    ``h``, as a discrete PLD for each bound in ``bounds`` (``True``: upper).

    Parameters
    ----------
    noise_multiplier : float
        ``sigma``.
    steps : int
        Steps in the epoch, ``t``.
    relation : str
        ``"remove"`` or ``"add"``.
    h : float
        The loss grid's step.
    bounds : tuple of bool
        Which PLDs: ``True`` upper, ``False`` lower.

    Returns
    -------
    list of Pld

    Examples
    --------
    >>> from dpmath.pld.allocation import epoch_plds
    >>> upper, lower = epoch_plds(2.0, 10, "remove", 1e-4, (True, False))
    >>> lower.delta(0.5) <= upper.delta(0.5) <= 1.01 * lower.delta(0.5)
    True
    """
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

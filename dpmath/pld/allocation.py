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

The loss of ``S`` rounds by at most ``D / S-bar`` nats. A lognormal's heavy tail stretches the grid, so where one grid
of ``n = 2^21`` points (``2^20`` for epochs of at most 128 steps) would be coarser than ``2e-4``, or than ``5e-3`` of
the loss's spread ``mu / sqrt(t)`` (``sigma`` near 1 or below, or long epochs: at ``sigma = 2`` with 1000 steps and 10
epochs the one grid left 0.85 %, the bands 0.37 %), ``S`` is put on **octave bands** instead (:class:`BandLaw`): row 0
a linear grid up to a floor, then one row per octave ``[2^(b-1), 2^b] F`` at a step of ``2^-p`` of its lower end
(``p`` from 10 to 17, about ``2^18`` to ``2^21`` points in all: as few as the epochs composed need, measured on a
first build of ``2^18``, :func:`fitted_band_laws`), so a rounding moves ``S`` by at most ``2^-p`` of itself (``2^-p``
nats of loss) wherever it lies, over the 13 decades the terms span at ``sigma = 0.3``. The unshifted terms are summed
by doubling (``X_2k = X_k + X_k'``) along the binary digits of their count, then the allocated term is added; each sum
is split by the row of the larger summand, the smaller rounded onto that row's step, so one FFT of ``3 2^p`` points
holds each row's share, and the result is rounded onto the bands of twice the scale. Each rounding is a coupling (up
for the upper law, down for the lower), and a leaf is rounded once per level of the tree, so ``S`` moves by at most
``2 log2(t) 2^-p`` of itself (the grid of all ``t`` terms at once moved it by ``t D``). The FFT's absolute error
(about ``1e-13`` of a row's mass at every point) is bounded and charged, and where it would swamp a tail sum above
``1e-20`` on the side that is read (large sums removing, small ones adding; the mass surely beyond a row's range
counted in) the row's product is computed again under exponential tilts (:func:`_tilted_conv`); a row's product of
negligible mass is not transformed but put at the end of its range the rounding points to. A term above the top band
(twice its ``1 - 1e-14`` quantile) is charged to ``+inf`` (upper) or held at the top (lower). As a sum concentrates
(long epochs), each doubling is refitted (:func:`_band_fit`): the octaves below its mass merge into the linear row 0,
those above it are dropped (beyond the top: removing charges at most ``1e-3`` of the allocated term's own ``+inf``
mass a doubling there, and only the allocated term, added last, is held on octaves to twice the cap), and the
octaves left share the points, up to ``2^18`` each, a finer relative step; a kept value stays on the finer grid
exactly.

**Adding** has its large losses where ``S`` is small, so a term above ``m`` (at most ``t e^3``, and where
``E (W - m)_+`` is ``5e-5``) is held at ``m`` (upper: a smaller ``S``, a larger loss) or dropped (lower: the loss
is below every one that matters); where one grid is coarse it too goes on octave bands, their floor at ``2^-40``
of a term (``S = 0`` after rounding down is a loss of ``+inf``, charged).

The Gaussian step without amplification (:meth:`dpmath.RandomAllocationGaussian.dominating`) stays a last resort:
:mod:`dpmath.pld.steps` uses its upper PLD where that has the smaller epsilon at ``delta = 1e-6`` (both are upper
bounds, so either choice is sound); with the bands it no longer wins at ``sigma >= 0.3``.

**Lighter tails and long epochs** (:func:`~dpmath.pld.linear_sum.linear_suits`: epochs of 1,000 to 10^5 steps at sigma
0.8, from 1,000 at sigma 1 and above, and shorter ones whose terms' bodies end within 5 deviations of the sum, e.g.
from 50 steps at sigma 2) are bounded in the convex order instead (:mod:`dpmath.pld.linear_sum`): the pair
read under ``Q``, its likelihood ratio's law spread to linear grid points (upper) or contracted to cell means (lower),
whose error is second order in the grid step where a rounding's is first order.

**Cost and width, measured** (``PLDAccountant().compose(RandomAllocationGaussian(sigma, t), epochs)
.epsilon_bracket(delta)``, one core, cold, peak RSS; ``benchmarks/results/dpmath_alloc_bands.md``, on a machine where
the bands on ``2^21`` points took 2.5 times longer than in the run before).  Bands, as fine as the epochs need:
``(sigma, t, epochs, delta) = (0.35, 200, 5, 1e-6)`` [24.261, 24.2639] (was [24.26, 50.03], the unamplified step;
0.0034 % in 24 s on ``2^21`` points), 3 s, 0.3 GB; ``(0.3, 100, 1, 1e-5)`` 0.003 % wide, 3 s; ``(0.3, 1000, 1,
1e-5)`` 0.004 %, 4 s; ``(0.4, 1000, 10, 1e-5)`` 0.03 %, 14 s; ``(0.45, 500, 1, 1e-6)`` 0.006 %, 4 s, each under
0.35 GB; ``(0.5, 100000, 1, 1e-5)`` 0.20 %, 29 s on ``2^20`` points (:func:`finest_band_points`; 0.18 % in 37 s
on ``2^21`` with every doubling's octaves reaching twice the cap).  On the bands the long epochs were
wide: ``(0.8, 4000, 10, 1e-5)`` 0.30 %, 26 s; ``(1, 20000, 1, 1e-5)`` 0.38 %, 27 s; ``(2, 100000, 1, 1e-5)`` 1.8 %, 27 s
(a long epoch's sum concentrates near ``t``, where even the refitted relative rounding of ``2^-18`` per level is
large against its spread); in the convex order they are 0.20 % in 6 s, 0.073 % in 2 s and 0.16 % in 2 s.
The result is checked against an importance-sampled Monte Carlo estimate of ``delta`` and against the Renyi bound
of random allocation (:mod:`verify.allocation`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import fft as sfft
from scipy import special

from .compose import FFT_ERR, Composition
from .distribution import Pld
from .linear_sum import LinearLaw, linear_law, linear_suits

__all__ = ["epoch_plds", "sum_laws", "SumLaw"]

_CAP_Z = 7.65            # a term's cap is its lognormal's 1 - 1e-14 quantile (the allocated term's; charged)
_POINTS = 1 << 21        # grid points of one composed sum (FFT passes of 2^21 to 2^24 points; about 1.5 GB at peak) ...
_SHORT, _SHORT_POINTS = 128, 1 << 20   # ... half as many for epochs of at most 128 steps, already 0.05 % wide there
_FINE = 2e-4             # the grid step (in S-bar units: nats of loss near S-bar = 1) removing tries to reach
_FINEST = 1e-4           # no finer grid than this (the default loss grid's step)
_SPREAD = 5e-3           # ... nor coarser than this of the epoch's loss spread (about mu / sqrt(t)); else bands
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


def _span(mu: float, steps: int, cap: float, allocated: bool, negate: bool = False) -> tuple[float, float]:
    """Width of a composed sum's window and the largest ``S`` in it, in units of ``S`` (measured on a coarse trial
    grid: they barely depend on the grid).  A term above that ``S`` puts the sum outside the window, so no term's
    grid needs to reach beyond it (its mass is the window's cut mass either way)."""
    c = _sum(mu, steps, cap / _TRIAL, _TRIAL, allocated, negate, hold=negate)
    return (c.hi - c.lo + 1) * c.h, max(abs(c.hi), abs(c.lo)) * c.h


def _upper_law(comp: Composition, shift: int) -> SumLaw:
    """Both bounds from one upper-mode composition: the lower law is the upper one shifted down by ``shift``
    grid points (the terms rounded down instead of up), with twice the error bound taken off (the upper pmf has
    it added), and the mass lumped from below the window taken off its first point."""
    full = comp.full()
    err = full.err if full.err is not None else np.zeros_like(full.pmf)
    lower = np.maximum(full.pmf - 2.0 * err, 0.0)
    lower[0] = max(0.0, full.pmf[0] - full.lump - 2.0 * err[0])
    return SumLaw(comp.h, full.start, full.pmf, full.start - shift, lower, full.inf, comp.over + comp.under)


@functools.lru_cache(maxsize=2)   # both directions of one noise level: up to about 150 MB
def sum_laws(mu: float, steps: int, relation: str, epochs: int = 1) -> tuple[SumLaw | BandPair | LinearLaw, ...]:
    """The law of ``S`` for one direction (``"remove"``: ``S`` under ``P``; ``"add"``: ``-S`` under ``Q``) as a
    one-element tuple: on one grid, or (heavy tails or a long epoch) on octave bands (module docstring), as fine as
    ``epochs`` composed epochs need (:func:`fitted_band_laws`)."""
    t = steps
    if linear_suits(mu, t):   # light tails, a long epoch: the convex order (second order, seconds)
        return (linear_law(mu, t, relation),)
    points = _SHORT_POINTS if t <= _SHORT else _POINTS
    # one grid where its step is fine against the epoch's loss: at most _FINE, and at most _SPREAD of the loss's
    # spread, about mu / sqrt(t) (a long epoch at large sigma has a tiny loss, which a step of 1e-4 blurs: at
    # (2, 1000 steps, 10 epochs) the one grid left 0.85 %, the bands 0.37 %)
    fine = min(_FINE, _SPREAD * mu / math.sqrt(t))
    if relation == "add":
        # a term above m is held at m: S falls by (W - m)_+, whose mean (the upper tail's share of E W = 1,
        # P(N(0, 1) > (log m - mu^2/2) / mu)) is kept at a quarter of the fine step
        cap = min(t * math.exp(_ADD_CAP), math.exp(0.5 * mu * mu - mu * special.ndtri(0.25 * _FINE)))
        span, top = _span(mu, t, cap, False, negate=True)
        step = max(_FINEST, span / points)
        if step > fine:   # heavy tails or a long epoch: octave bands, which resolve small sums too
            return (fitted_band_laws(mu, t, "add", cap, epochs),)
        k_top = math.ceil(min(cap, top) / step)
        up = _sum(mu, t, step, k_top, False, negate=True, up=False, hold=True).full()
        low = _sum(mu, t, step, k_top, False, negate=True, up=True, lower_mode=True).full()
        return (SumLaw(step, up.start, up.pmf, low.start, low.pmf, up.inf, low.slack),)
    z_cap = math.exp(0.5 * mu * mu + _CAP_Z * mu)
    whole_span, top = _span(mu, t, z_cap, True)
    cap = min(z_cap, top)
    cap_step = whole_span / points

    if max(_FINEST, cap_step) <= fine:
        return (_upper_law(_sum(mu, t, max(_FINEST, cap_step), math.ceil(cap / max(_FINEST, cap_step)), True), t),)
    # heavy tails or a long epoch: one grid would be coarse, so octave bands (module docstring)
    return (fitted_band_laws(mu, t, "remove", z_cap, epochs),)


# ---------------------------------------------------------------------------------------------- banded sums
_BAND_POINTS = 1 << 21  # banded sums: at most about this many grid points in all (2^p an octave, p up to 17), ...
_BAND_MIN_BITS = 10      # ... and at least 2^10 an octave; ...
_BAND_TRY = 1 << 18     # ... first built on this many points, again on more where the composition would show it
_BAND_SHARE = 5e-4      # (fitted_band_laws): the bands' share of the composed epsilon's relative width ...
_BAND_PROBE = 1e-6      # ... measured at this delta; a direction whose epsilon there is below this fraction of the
_BAND_BELOW = 0.9       # other's keeps the first build
_BAND_WORK = 1 << 25    # a build's points times the doublings of its sum at most this (the cost of the finest)
_BAND_FLOOR = 2.0 ** -8  # ... below this (one term's units, scaled with the sum's size) a linear grid instead; ...
_ADD_FLOOR = 2.0 ** -40  # ... adding, whose large losses are small sums, down to this
_PLACE_BLOCK = 1 << 20   # values rounded onto bands at a time


@dataclass(frozen=True)
class BandLaw:
    """A law of ``S >= 0`` on octave bands: row 0 holds ``j unit`` (``j = 0..n``, ``n = 2^p``), row
    ``b >= 1`` holds ``(n + j) unit 2^(b-1)``, the octave ``[n unit 2^(b-1), n unit 2^b]``, at a step of ``2^-p`` of
    its lower end.  ``up``: a law rounded up (``inf``: mass at ``+inf``), otherwise rounded down (held at the top);
    ``hi``: its masses are pointwise upper bounds (FFT error bounds added), otherwise pointwise lower bounds.
    Removing's upper law is rounded up with upper bounds, its lower one down with lower bounds; adding's upper law
    (small sums are large losses) is rounded down with upper bounds, its lower one up with lower bounds."""

    unit: float
    mass: np.ndarray
    inf: float
    up: bool
    hi: bool

    def values(self, first: int = 0, stop: int | None = None) -> np.ndarray:
        """The points of rows ``first`` to ``stop - 1`` (all by default)."""
        n = self.mass.shape[1] - 1
        rows = np.arange(first, self.mass.shape[0] if stop is None else stop)
        scale = self.unit * np.exp2(np.maximum(rows - 1, 0))
        return (np.where(rows > 0, n, 0)[:, None] + np.arange(n + 1)[None, :]) * scale[:, None]


def _band_index(v: np.ndarray, unit: float, shape: tuple[int, int], up: bool) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices on the bands of ``unit`` of the values ``v`` (exact dyadic floats) rounded up (``up``) or down
    (every value and ``unit`` a power of 2 times an integer: the divisions and ``ceil`` are exact), and which lie
    beyond the top band (their index is the top point's)."""
    rows, n = shape[0], shape[1] - 1
    mant, e = np.frexp(v / (n * unit))             # v / (n unit) = mant 2^e, mant in [0.5, 1)
    if up:   # row c >= 1 holds (2^(c-1), 2^c] in units of n unit
        row = np.where(mant == 0.5, e - 1, e)
        row = np.where(v <= n * unit, 0, row)
    else:    # ... and [2^(c-1), 2^c) rounding down
        row = np.where(v < n * unit, 0, e)
    over = row >= rows
    row = np.minimum(row, rows - 1)
    step = unit * np.exp2(np.maximum(row - 1, 0))
    q = np.where(over, 0.0, v / step)   # beyond the top: no index computed (it can pass int64's range)
    j = (np.ceil(q) if up else np.floor(q)).astype(np.int64) - np.where(row > 0, n, 0)
    j = np.where(over, n, j)
    return row * (n + 1) + j, over


def _band_place(v: np.ndarray, m: np.ndarray, unit: float, shape: tuple[int, int], up: bool,
                out: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Masses ``m`` at the values ``v`` on the bands of ``unit`` (:func:`_band_index`), added to ``out`` (new zeros by
    default); beyond the top band: returned as ``+inf`` mass (up) or held at the top (down).  In blocks of
    :data:`_PLACE_BLOCK` values: at sigma = 0.05 a law has 520 octaves of ``2^14`` points, and the index arithmetic on
    all 8.5M at once held 0.7 GB."""
    out = np.zeros(shape) if out is None else out
    flat = out.reshape(-1)
    beyond = 0.0
    for lo in range(0, v.size, _PLACE_BLOCK):
        vb, mb = v[lo:lo + _PLACE_BLOCK], m[lo:lo + _PLACE_BLOCK]
        idx, over = _band_index(vb, unit, shape, up)
        if up:
            beyond += float(mb[over].sum())
            idx, mb = idx[~over], mb[~over]
        if idx.size:
            first = int(idx.min())
            counts = np.bincount(idx - first, weights=mb)
            flat[first:first + counts.size] += counts
    return out, beyond


def _band_term(mu: float, shifted: bool, unit: float, shape: tuple[int, int], up: bool, hi: bool) -> BandLaw:
    """One lognormal term (as :func:`_term`) on the bands of ``unit``: the mass of ``(u, v]`` between neighbouring
    points at ``v`` (up) or ``u`` (down); above the top: ``+inf`` (up) or the top (down).  Built a block of rows at a
    time (:func:`_band_place`)."""
    c = 0.5 * mu * mu * (1.0 if shifted else -1.0)
    grid = BandLaw(unit, np.zeros(shape), 0.0, up, hi)
    mass = grid.mass
    block = max(1, _PLACE_BLOCK // shape[1])
    last_v, last_cdf = 0.0, 0.0   # the point 0 (row 0's first), where the CDF of a lognormal is 0
    for r0 in range(0, shape[0], block):
        rows = grid.values(r0, min(shape[0], r0 + block))
        # increasing, each point once: a row's first point is the last one's end (row 0's first is 0, last_v's start)
        v = np.concatenate([[last_v], rows[:, 1:].ravel()])
        with np.errstate(divide="ignore"):
            cdf = special.ndtr((np.log(v) - c) / mu)
        cdf[0] = last_cdf
        inter = np.diff(cdf)
        _band_place(v[1:] if up else v[:-1], inter, unit, shape, up, mass)
        last_v, last_cdf = float(v[-1]), float(cdf[-1])
    beyond = float(special.ndtr(-(math.log(last_v) - c) / mu))
    if not up:
        _band_place(np.array([last_v]), np.array([beyond]), unit, shape, up, mass)
    return BandLaw(unit, mass, beyond if up else 0.0, up, hi)


def _band_rebin(law: BandLaw, unit: float, shape: tuple[int, int] | None = None) -> BandLaw:
    """``law`` on the bands of ``unit`` (and ``shape``): one more rounding of each value (a block of rows at a
    time)."""
    shape = law.mass.shape if shape is None else shape
    if unit == law.unit and shape == law.mass.shape:
        return law
    mass, beyond = np.zeros(shape), 0.0
    block = max(1, _PLACE_BLOCK // law.mass.shape[1])
    for r0 in range(0, law.mass.shape[0], block):
        part = law.mass[r0:r0 + block]
        live = part > 0
        beyond += _band_place(law.values(r0, r0 + part.shape[0])[live], part[live], unit, shape, law.up, mass)[1]
    return BandLaw(unit, mass, law.inf + beyond, law.up, law.hi)


_BAND_BITS = 18        # at most 2^18 points an octave (where few octaves hold a sum's mass)
_TRIM_READ = 1e-30     # octaves dropped on the read side (and removing's top: charged to +inf) hold at most this ...
_TRIM_OTHER = 1e-9     # ... on the other side at most this: merged into the linear row 0, or held at the top
_TRIM_CHARGED = 1e-3   # ... and removing's top at most this of the mass the allocated term already puts at +inf


def _band_fit(law: BandLaw, side: str, top_min: float, points: int, charged: float = 0.0) -> BandLaw:
    """``law`` on the octaves that hold its mass, at a finer step where they are fewer.

    The octaves below the first that holds more than a small mass (:data:`_TRIM_OTHER`, or :data:`_TRIM_READ` where
    small sums are read) are merged into the linear row 0 (a rounding up or down onto its step, ``2^-p`` of the new
    floor), those above the last that does (beyond ``top_min``; where large sums are read, the larger of
    :data:`_TRIM_READ` and ``charged``) are dropped: their mass at ``+inf`` (rounded up), held at the top (rounded
    down, upper masses) or left out (lower masses: a lower bound with less mass is one still).  Each octave left gets
    up to ``2^18`` points, the octaves' budget (``points``) shared among fewer rows.  A kept value stays exact: the
    new step divides the old one (both powers of 2 times the floor)."""
    rows, n = law.mass.shape[0], law.mass.shape[1] - 1
    bits = n.bit_length() - 1
    floor = law.unit * n
    r = law.mass.sum(axis=1)
    low = _TRIM_READ if side == "lower" else _TRIM_OTHER
    high = max(_TRIM_READ, charged) if side == "upper" else _TRIM_OTHER
    j = max(0, int(np.count_nonzero(np.cumsum(r) <= low)) - 1)         # rows 0..j become the new row 0
    above = np.append(np.cumsum(r[::-1])[::-1], 0.0)[1:]                # mass above each row
    top = max(int(np.argmax(above <= high)), math.ceil(math.log2(top_min / floor)) if top_min else 0, j + 1)
    top = min(top, rows - 1)
    new_rows = top - j + 1
    new_bits = min(_BAND_BITS, max(bits, int(math.log2(points / new_rows))))
    if new_rows == rows and new_bits == bits:
        return law
    if not law.hi and top < rows - 1:
        law = BandLaw(law.unit, law.mass[: top + 1], law.inf, law.up, law.hi)
    return _band_rebin(law, floor * 2.0 ** j / (1 << new_bits), (new_rows, (1 << new_bits) + 1))


def _band_extend(law: BandLaw, top: float, points: int) -> BandLaw:
    """``law`` with empty octaves added above until its top band reaches ``top``, on at most ``points`` points in all
    (at least ``2^10`` an octave): fewer an octave where the octaves added take them (one more rounding, on the law's
    side)."""
    rows, n = law.mass.shape[0], law.mass.shape[1] - 1
    floor = law.unit * n
    need = max(rows, 1 + math.ceil(math.log2(top / floor)))
    bits = n.bit_length() - 1
    new_bits = max(_BAND_MIN_BITS, min(bits, int(math.log2(points / need))))
    if need == rows and new_bits == bits:
        return law
    return _band_rebin(law, floor / (1 << new_bits), (need, (1 << new_bits) + 1))


def _coarsen(c: np.ndarray, up: bool) -> np.ndarray:
    """A law on ``0..2n`` at step ``D`` onto ``0..n`` at step ``2D``, rounding up or down."""
    out = np.zeros((c.size + 1) // 2)
    if up:   # i -> ceil(i / 2)
        out[0] = c[0]
        out[1:] = c[1::2] + np.append(c[2::2], 0.0)[: out.size - 1]
    else:    # i -> floor(i / 2)
        out[:] = c[0::2]
        out[: c[1::2].size] += c[1::2]
    return out


_BAND_RTOL = 1e-3      # a band's FFT is tilted again where its error bounds exceed this of a tail sum ...
_BAND_TAIL = 1e-20     # ... above this mass (either tail: adding reads small sums)
_BAND_TILTS = 4
_TILT_ROUND = 4000.0 * float(np.finfo(np.float64).eps)   # relative rounding of three tilt factors (arguments <= 1200)


def _tilted_conv(pairs: list[tuple[np.ndarray, np.ndarray]], nfft: int, size: int, side: str, outside: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``sum a * c`` over ``pairs`` (non-negative arrays) at ``0..size-1``, and a pointwise bound on its error.

    An FFT's error is absolute: :data:`FFT_ERR` per unit mass of each factor and ``log2 N`` (as in
    :mod:`dpmath.pld.compose`), about ``1e-13`` of the mass at every point, which swamps a tail's small masses.  So
    where a tail sum on the side that is read (``side``: ``"upper"`` removing, ``"lower"`` adding) above
    :data:`_BAND_TAIL` has error bounds over :data:`_BAND_RTOL` of it, the product is computed again under the tilt
    ``e^{theta i}`` that flattens the decay there (its error bound shrinks by ``e^{-theta i}`` once untilted), and
    each point is read from the tilt with the smallest bound.  A tail sum counts ``outside``, the mass the whole
    sum surely has beyond this product's range on that side (the tilts only tighten: every bound is charged)."""
    scale = FFT_ERR * math.log2(nfft)
    best = np.zeros(size)
    err = np.full(size, np.inf)
    theta, tried = 0.0, set()
    upper = side == "upper"
    for _ in range(_BAND_TILTS):
        tried.add(theta)
        spec, norms = 0.0, 0.0
        # every factor's weights at most 1 (one normalizer per side, shared by the pairs: their products add)
        norm_a = max(0.0, theta * max(a.size - 1 for a, _ in pairs))
        norm_c = max(0.0, theta * max(c.size - 1 for _, c in pairs))
        for a, c in pairs:
            ta = a * np.exp(theta * np.arange(a.size) - norm_a) if theta else a
            tc = c * np.exp(theta * np.arange(c.size) - norm_c) if theta else c
            spec = spec + sfft.rfft(ta, nfft) * sfft.rfft(tc, nfft)
            norms += float(ta.sum()) * float(tc.sum())
        z = sfft.irfft(spec, nfft)[:size]
        e_t = scale * (4.0 * norms + float(np.abs(z).max()))
        if theta:   # untilt: the normalizers put back, then e^{-theta i}
            with np.errstate(over="ignore"):
                back = np.exp(norm_a + norm_c - theta * np.arange(size))
                z_u, e_u = z * back, e_t * back
            # and the tilt's own rounding: each exp's argument (at most 1200 in size) rounds by its size times eps
            e_u += _TILT_ROUND * (np.abs(z_u) + e_u)
            better = e_u < err
            best[better], err[better] = z_u[better], e_u[better]
        else:
            best, err = z, np.full(size, e_t)
        pos = np.maximum(best, 0.0)
        # tail sums on the read side, from each point outward (the outside mass included)
        tail = (np.cumsum(pos[::-1])[::-1] if upper else np.cumsum(pos)) + outside
        with np.errstate(over="ignore", invalid="ignore"):
            etail = np.cumsum(err[::-1])[::-1] if upper else np.cumsum(err)
        bad = (etail > _BAND_RTOL * tail) & (tail > _BAND_TAIL)
        top = int(np.argmax(pos))
        theta = None
        if upper and bad[top + 1:].any():
            s = top + 1 + int(np.argmax(bad[top + 1:]))
        elif not upper and bad[:top].any():
            s = top - 1 - int(np.argmax(bad[:top][::-1]))
        else:
            break
        local = tail[s] - outside
        if local > 0:
            # the decay rate from the peak to s, capped so that no weight leaves float64's range
            th = math.log(pos[top] / max(local, 1e-300)) / (s - top)
            th = max(-600.0 / size, min(600.0 / size, th))
            if th not in tried:
                theta = th
        if theta is None:
            break
    return best, err


_BAND_SKIP = 1e-40     # a band's product below this mass is not transformed: all of it at its largest (up) or
                       # smallest sum, or (lower bounds) dropped; ...
_BAND_SKIP_FAR = 1e-12  # ... nor below this where the read side holds more than this beyond its range (it moves
_BAND_FAR = 1e-3        # every tail sum read by at most 1e-9 of it)


def _band_add(x: BandLaw, y: BandLaw, side: str) -> BandLaw:
    """The law of ``X + Y`` (independent, on the same bands) on the bands of twice the unit.

    Split by the row of the larger: ``{row X = b, row Y <= b}`` and ``{row Y = b, row X < b}``.  On each the sum
    lies in ``[2^(b-1), 2^(b+1)] n unit``, and the smaller is first rounded onto row ``b``'s step ``D`` (a step of
    at most ``2^-p`` of the larger), so one FFT of ``3n + 1`` points at step ``D`` holds it; its values are then
    rounded onto the new bands.  Each FFT's error is bounded (:data:`FFT_ERR` per unit mass of each factor and
    ``log2 N``, as in :mod:`dpmath.pld.compose`) and added to every point (``hi``) or subtracted; ``side``: which
    tail is read (:func:`_tilted_conv`)."""
    rows, n = x.mass.shape[0], x.mass.shape[1] - 1
    up, hi = x.up, x.hi
    unit = 2.0 * x.unit
    same = x is y
    idx, mass = [], []
    inf = x.inf + y.inf   # the union bound: either term at +inf
    nfft = sfft.next_fast_len(3 * n + 1, real=True)
    # the mass of each row's product (max row = b) and what lies surely beyond its range on the read side: the
    # products of rows b + 2 and up (sums above 2^(b+1) n unit), or of rows b - 2 and down (below 2^(b-1) n unit)
    rx, ry = x.mass.sum(axis=1), y.mass.sum(axis=1)
    row_mass = rx * np.cumsum(ry) + ry * (np.cumsum(rx) - rx)
    if side == "upper":
        beyond = np.append(np.cumsum(row_mass[::-1])[::-1], [0.0, 0.0])[2:]
    else:
        beyond = np.concatenate([[0.0, 0.0], np.cumsum(row_mass)])[:rows]
    cx = cy = None   # rows below b, at row b's step (indices 0..n)
    for b in range(rows):
        if b >= 2:
            cx, cy = _coarsen(cx, up), (None if same else _coarsen(cy, up))
        xb, yb = x.mass[b], y.mass[b]
        off = n if b > 0 else 0
        # rows up to b at row b's step: indices 0..2n (0..n for row 0)
        def upto(c, r):
            if c is None:
                return r.copy()
            out = np.zeros(2 * n + 1)
            out[: c.size] += c
            out[n:] += r
            return out
        lex = upto(cx, xb)
        ley = lex if same else upto(cy, yb)
        if xb.any() or yb.any():
            if same:   # X_b * (X_<b + X_<=b)
                both = lex.copy()
                if cx is not None:
                    both[: cx.size] += cx
                pairs = [(xb, both)]
            else:
                pairs = [(xb, ley)] + ([(yb, cx)] if cx is not None and yb.any() else [])
            total = sum(float(a.sum()) * float(c.sum()) for a, c in pairs)
            # no FFT for a negligible product: all of it at the range's end the rounding points to, or dropped
            if total < _BAND_SKIP or (total < _BAND_SKIP_FAR and beyond[b] > _BAND_FAR):
                z = np.zeros(3 * n + 1)
                z[-1 if up else 0] = total * (1.0 + 1e-9) if hi else 0.0
            else:
                z, err = _tilted_conv(pairs, nfft, 3 * n + 1, side, float(beyond[b]))
                z = np.maximum(z, 0.0) + err if hi else np.maximum(z - err, 0.0)
            live = z > 0
            d = x.unit * 2.0 ** max(b - 1, 0)
            v = (off + np.nonzero(live)[0]) * d
            i, over = _band_index(v, unit, x.mass.shape, up)
            if up:
                if hi:
                    inf += float(z[live][over].sum())
                i = i[~over]
            idx.append(i)
            mass.append(z[live][~over] if up else z[live])
        cx = lex if b >= 1 else xb.copy()
        cy = None if same else (ley if b >= 1 else yb.copy())
    flat = np.bincount(np.concatenate(idx), weights=np.concatenate(mass), minlength=rows * (n + 1))
    return BandLaw(unit, flat.reshape(rows, n + 1), min(1.0, inf), up, hi)


@dataclass(frozen=True)
class BandPair:
    """Removing's ``S`` on octave bands (:func:`band_laws`): its upper and lower laws; no slack."""

    upper: BandLaw
    lower: BandLaw
    slack: float = 0.0


@functools.lru_cache(maxsize=4)
def band_laws(mu: float, steps: int, relation: str, cap: float, points: int = _BAND_POINTS) -> BandPair:
    """``S`` on octave bands (module docstring), rounded up and down: the unshifted terms summed by doubling and
    rebinning, then (removing) the allocated term.  Removing: the upper law rounds up (a term above the top at
    ``+inf``), the lower down.  Adding: the upper law rounds down (a term above the top held there, ``S = 0`` a loss
    of ``+inf``), the lower up (``S`` at ``+inf`` dropped: a loss of ``-inf``).  ``cap``: the top band reaches
    twice it (a term's ``1 - 1e-14`` quantile, or adding's ``m``).  ``points``: about this many grid points in all,
    ``2^p`` an octave (``p`` from :data:`_BAND_MIN_BITS` to 17; refitted octaves up to ``2^18``)."""
    floor = _BAND_FLOOR if relation == "remove" else _ADD_FLOOR
    rows = 2 + math.ceil(math.log2(cap / floor))
    bits = min(17, max(_BAND_MIN_BITS, int(math.log2(points / rows))))
    shape = (rows, (1 << bits) + 1)
    unit = floor / (1 << bits)
    side = "upper" if relation == "remove" else "lower"   # the tail that is read: large sums, or small ones
    out = []
    # (rounding up, upper bounds on masses): removing's upper and lower laws, or adding's
    # removing: the doubled sums reach only as high as their mass above the trims (the allocated term, added last,
    # is on bands to twice the cap, whose mass beyond it is at +inf in the upper law: the sums' far octaves charged
    # at a small share of that cost little; at (0.5, 10^5) they were 4 of 13 octaves); adding: twice the cap
    charged = _TRIM_CHARGED * _band_term(mu, True, unit, shape, True, True).inf if relation == "remove" else 0.0
    top_min = 0.0 if relation == "remove" else 2.0 * cap
    for up, hi in ((True, True), (False, False)) if relation == "remove" else ((False, True), (True, False)):
        unshifted = steps - 1 if relation == "remove" else steps
        power, acc, left = _band_term(mu, False, unit, shape, up, hi), None, unshifted
        while left:
            if left & 1:
                acc = power if acc is None else _band_add(power, _band_rebin(acc, power.unit, power.mass.shape), side)
            left >>= 1
            if left:
                power = _band_fit(_band_add(power, power, side), side, top_min, points, charged)
        if relation == "remove":
            one = _band_term(mu, True, unit, shape, up, hi)
            if acc is not None:
                acc = _band_extend(acc, 2.0 * cap, points)
                acc = _band_add(acc, _band_rebin(one, acc.unit, acc.mass.shape), side)
            else:
                acc = one
        out.append(acc)
    if relation == "remove":
        return BandPair(out[0], out[1])
    return BandPair(out[0], BandLaw(out[1].unit, out[1].mass, 0.0, True, False))


def _epoch_loss(s: np.ndarray, steps: int, relation: str) -> np.ndarray:
    """The epoch's loss at the sums ``s``: ``log(S / t)`` removing, minus that adding (``S = 0``: an infinite loss)."""
    with np.errstate(divide="ignore"):
        loss = np.log(s / steps)
    return -loss if relation == "add" else loss


def _band_losses(band: BandLaw, steps: int, relation: str) -> tuple[np.ndarray, np.ndarray]:
    """One epoch's finite losses read from ``band`` (:func:`_epoch_loss`) and their masses."""
    loss = _epoch_loss(band.values().ravel(), steps, relation)
    m = band.mass.ravel()
    keep = np.isfinite(loss) & (m > 0)
    return loss[keep], m[keep]


def _probe_epsilon(loss: np.ndarray, m: np.ndarray, inf: float) -> float:
    """The epsilon at :data:`_BAND_PROBE` of the PLD with the masses ``m`` at ``loss`` and ``inf`` at ``+inf`` (0 where
    delta at 0 is below the probe, ``inf`` where ``inf`` is above it): only for choosing a resolution, never a
    bound."""
    if inf >= _BAND_PROBE:
        return math.inf
    keep = loss > 0
    order = np.argsort(-loss[keep])
    loss, m = loss[keep][order], m[keep][order]
    if not loss.size:
        return 0.0
    a = inf + np.cumsum(m)                         # delta on [loss[k + 1], loss[k]]: a[k] - e^eps b[k]
    b = np.cumsum(m * np.exp(-loss))
    at_next = a - np.exp(np.append(loss[1:], 0.0)) * b   # delta at each segment's lower end
    k = int(np.argmax(at_next >= _BAND_PROBE))
    if at_next[k] < _BAND_PROBE:
        return 0.0
    return float(np.log(max(a[k] - _BAND_PROBE, 1e-300) / b[k]))


def finest_band_points(steps: int) -> int:
    """The most points a banded epoch of ``steps`` steps is built on: :data:`_BAND_POINTS`, and at most
    :data:`_BAND_WORK` over the doublings its sum takes (a build's cost grows with both).  At ``(sigma, t) = (0.5,
    10^5)`` (17 doublings) ``2^20`` points gave [0.201728, 0.20213] (0.20 %) in 29 s, where ``2^21`` had given
    [0.201747, 0.202104] (0.18 %) in 37 s with every doubling's octaves reaching twice the cap
    (``benchmarks/results/dpmath_alloc_trim.md``); with the far octaves trimmed, ``2^21`` gave 0.23 % there, wider
    than ``2^20``: the FFTs' error bounds grow with the points and take what the finer step gives."""
    return min(_BAND_POINTS, 1 << int(math.log2(_BAND_WORK / steps.bit_length())))


def fitted_band_laws(mu: float, steps: int, relation: str, cap: float, epochs: int) -> BandPair:
    """:func:`band_laws` on as few points as ``epochs`` composed epochs need.

    The bands' rounding moves each epoch's losses (the upper law's up, the lower's down) by a relative step of the
    sums, ``2^-p`` per level, so the composed epsilon's two ends move apart by about ``epochs`` times one epoch's
    shift, against an epsilon at least one epoch's.  The laws are built first on :data:`_BAND_TRY` points, and one
    epoch's shift is measured there as the larger of the gap between the two laws' epsilons at :data:`_BAND_PROBE`
    and between their mean losses (the bulk, which many epochs compose, moves more than the far tail: 5 times at
    ``(sigma, t) = (0.4, 1000)``).  Where ``epochs`` times that shift exceeds :data:`_BAND_SHARE` of the upper
    law's epsilon, they are built again on as many times more points (up to :func:`finest_band_points`) as bring it
    within (each doubling adds a bit an octave and halves the shift).  A direction whose epsilon is below
    :data:`_BAND_BELOW` of the other's (read from the same law: a PLD ``w`` of ``P`` against ``Q`` gives that of
    ``Q`` against ``P`` as ``w(-x) e^-x``) keeps the first build: its width does not show in the composition's
    epsilon, the larger direction's.

    Either choice is sound: both laws bound the epoch at any resolution; this chooses the width and the cost.  One
    more epoch can thus read a finer build, whose upper end is lower by up to half the share (2.5e-4 of epsilon):
    the printed epsilon could step down where an epoch adds less than that, past about 2,000 epochs.  At
    ``(sigma, t, epochs) = (0.35, 200, 5)`` the first build serves both directions (0.012 % in 3 s, where
    :data:`_BAND_POINTS` gave 0.0034 % in 24 s: ``benchmarks/results/dpmath_alloc_bands.md``); a long epoch's small
    epsilon takes the finest."""
    finest = finest_band_points(steps)
    pair = band_laws(mu, steps, relation, cap, _BAND_TRY)
    up, m_up = _band_losses(pair.upper, steps, relation)
    down, m_down = _band_losses(pair.lower, steps, relation)
    hi = _probe_epsilon(up, m_up, pair.upper.inf)
    if not math.isfinite(hi):
        return band_laws(mu, steps, relation, cap, finest)
    # the other direction: losses -x, masses e^-x times (capped: only a resolution is chosen here)
    other = _probe_epsilon(-up, m_up * np.exp(np.minimum(-up, 700.0)), 0.0)
    if hi == 0.0 or hi < _BAND_BELOW * other:
        return pair
    shift = max(hi - _probe_epsilon(down, m_down, pair.lower.inf),
                float(np.dot(up, m_up) / m_up.sum() - np.dot(down, m_down) / m_down.sum()))
    need = epochs * shift / (_BAND_SHARE * hi)
    if need <= 1.0:
        return pair
    return band_laws(mu, steps, relation, cap, min(finest, _BAND_TRY << math.ceil(math.log2(need))))


def _losses(law: SumLaw | BandPair | LinearLaw, steps: int, relation: str, h: float, upper: bool
            ) -> tuple[np.ndarray, np.ndarray, float]:
    """``(loss grid indices, masses, mass at +inf)`` of one part, its losses rounded toward the bound's side."""
    if isinstance(law, LinearLaw):
        s, pmf, inf = law.read(upper)
    elif isinstance(law, BandPair):
        band = law.upper if upper else law.lower
        s, pmf = band.values().ravel(), band.mass.ravel()
        inf = band.inf
    else:
        start, pmf = (law.start, law.upper) if upper else (law.lower_start, law.lower)
        s = np.abs(start + np.arange(pmf.size)) * law.step
        inf = law.inf if upper else 0.0
    loss = _epoch_loss(s, steps, relation)
    finite = np.isfinite(loss) & (pmf > 0)
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


def epoch_plds(noise_multiplier: float, steps: int, relation: str, h: float, bounds: tuple[bool, ...],
               epochs: int = 1) -> list[Pld]:
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
    epochs : int
        How many such epochs are composed: octave bands are built as fine as their sum needs
        (:func:`fitted_band_laws`).  Either choice is sound; it moves the bracket's width and the cost.

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
    laws = sum_laws(mu, steps, relation, epochs)
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

r"""A discrete privacy-loss distribution on the grid ``t_j = j h`` and its exact read-out.

A privacy-loss distribution (PLD) of a pair ``(P, Q)`` is the law of ``L = log(dP/dQ)(o)`` for
``o ~ P``.  Its hockey-stick curve is

.. math::

    \delta(\varepsilon) = p_\infty + E_P\big[(1 - e^{\varepsilon - L})_+\big],

increasing in every value of ``L``; composing mechanisms adds independent losses.  Here a PLD lives
on the grid ``t_j = j h`` as masses ``pmf`` from index ``start`` on, plus a mass ``inf`` at ``+inf``.

:class:`Pld` reads out ``delta(eps)``, ``epsilon(delta)`` and the trade-off curve exactly for the discrete
distribution; :data:`MAX_GRID` bounds the grids of every layer above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from scipy import signal

__all__ = ["GridTooLargeError", "HUGE_LOSS", "MAX_GRID", "Pld", "grid_advice", "mean_gap"]


class GridTooLargeError(ValueError):
    """The loss grid would need more points than :data:`MAX_GRID`: the discretization is too fine for the
    losses at hand (a coarser one still gives valid, looser bounds), or the losses are too spread out for any
    grid (tiny noise, or an enormous number of steps), where the message points to :class:`~dpmath.RDPAccountant`."""


_EPS = float(np.finfo(np.float64).eps)
_EPS_SUM = float(np.finfo(np.longdouble).eps)
MAX_GRID = 1 << 25  # ~34M points: 270 MB per float64 array, the most one composition may use
HUGE_LOSS = 1e3     # nats: losses beyond make epsilon huge, where a grid too large is best answered without one


def grid_advice(h: float, needed: float, spread: float, one_step: bool = False) -> str:
    """What to do about a grid over :data:`MAX_GRID` points, for a :class:`GridTooLargeError`: a coarser
    discretization where ``needed`` (the step that would fit; ``one_step``: one step's grid, which a composition
    widens) is at most 1, the accountant's limit, and the RDP accountant, which needs no grid, first where
    ``spread`` (how far the losses reach, in nats) exceeds :data:`HUGE_LOSS`: epsilon is then huge, and a grid
    that holds such losses is slow to compose, if it fits at all."""
    rdp = "dpmath.RDPAccountant where it supports the mechanism (it needs no grid: a looser bound, in milliseconds)"
    coarser = (f"a coarser discretization (now {h:g}), e.g. discretization={needed:.2g}"
               + (" for one step (a composition of many needs a coarser one still)" if one_step else ""))
    if needed > 1.0:
        return (f"the losses reach {spread:.3g} nats, which no discretization up to 1 holds (tiny noise, or very many "
                f"steps): bound epsilon with {rdp}, or use more noise or fewer steps")
    if spread > HUGE_LOSS:
        return (f"the losses reach {spread:.3g} nats (a far tail, whatever little mass it carries, must fit on the "
                f"grid; epsilon itself may be small): {coarser} fits but is slow; or bound epsilon with {rdp}")
    return f"use {coarser}, or bound epsilon with {rdp}"


class _Grid:
    """The grid ``t_j = (start + j) h``, ``j < size``, indexed like the array it stands for (an integer or an integer
    array; the same floats), without holding it: a read-out's cache keeps two arrays, not three."""

    __slots__ = ("start", "h", "size")

    def __init__(self, start: int, h: float, size: int) -> None:
        self.start, self.h, self.size = start, h, size

    def __getitem__(self, j):
        return (self.start + j) * self.h

    def array(self) -> np.ndarray:
        return (self.start + np.arange(self.size)) * self.h


class _Curves(NamedTuple):
    """:meth:`Pld._curves`: the grid ``t_j``, ``delta_j = delta(t_j)``, ``R_j = sum_{i>j} p_i e^{-(t_i - t_j)}``,
    and the total finite mass, each rounded toward the PLD's side."""

    t: _Grid
    dj: np.ndarray
    r: np.ndarray
    total: float


@dataclass
class Pld:
    """A discrete PLD: masses ``pmf`` at losses ``(start + j) h``, ``inf`` at ``+inf``.

    ``upper`` says which bound it is; ``slack`` (lower bounds only) is mass that FFT wrap-around, or a rounding
    residue of the lowered split (:func:`~dpmath.pld.discretize.split`), may have placed too high, subtracted
    from every delta; ``err`` (compositions) is the floating-point error bound per point, already added to
    (upper) or subtracted from (lower) ``pmf``; ``lump`` (upper compositions) is the mass from below the window
    that the first point holds.  The read-out charges its own rounding (:meth:`_curves`).
    """

    h: float
    start: int
    pmf: np.ndarray
    inf: float
    upper: bool
    slack: float = 0.0
    err: np.ndarray | None = None
    lump: float = 0.0

    # ----------------------------------------------------------------------------- read-out
    def _curves(self) -> _Curves:
        """The read-out's arrays (:class:`_Curves`), each moved by its floating-point rounding bound toward this
        bound's side: an upper PLD's ``delta_j`` and ``total`` up and its ``R_j`` and ``head`` down, a lower PLD's
        the reverse, so that the curve read out is never on the wrong side of the discrete PLD's exact one.

        ``R`` is a recursion from the top, ``R_j = c (p_{j+1} + R_{j+1})`` with ``c = e^-h``: three roundings a
        step (``c`` itself, the two products and their sum: the new value is a weighted mean of the inputs' errors
        plus its own), so ``R_j``'s relative error is at most ``3 eps (n - j)``.  ``delta_j`` is ``expm1(h)`` times
        the top-down sum ``sum_{k >= j} R_k`` of positive terms, whose rounding is at most ``eps`` times the
        partial sums, which grow downward: ``eps (n - j)`` relative.  ``5 eps (n - j + 1)`` covers both, the
        product's and ``expm1``'s roundings and the second-order terms.  Near ``delta = 1`` on 1.6M points the
        uncharged sum fell 1.4e-12 below the exact curve (about ``sqrt(n) eps``; the bound is ``n eps``, 1.8e-10
        at the bottom of that grid, 1e-11 relative or less where delta is 1e-5 or smaller)."""
        if not hasattr(self, "_cache"):
            n = self.pmf.size
            side = 1.0 if self.upper else -1.0
            c = math.exp(-self.h)
            # in place where it can be (the same operations in the same order): a read-out of 3.5M points held
            # eight arrays of them at once
            r = signal.lfilter([0.0, c], [1.0, -c], self.pmf[::-1])[::-1]
            d = np.cumsum(r[::-1])[::-1]
            d *= math.expm1(self.h)
            rel = np.arange(n + 1, 1, -1, dtype=np.float64)
            rel *= 5.0 * _EPS
            rel *= side
            d *= 1.0 + rel
            np.subtract(1.0, rel, out=rel)
            r *= rel
            del rel
            # a sum of n positive terms in any order rounds by at most (n - 1) units of it: in extended precision
            # where there is one (x86: 1e-19 a term; the total matters below the grid, 1 - delta cancelling there),
            # summed in buffered chunks, not a copy.  The additions below round by eps each
            total = float(self.pmf.sum(dtype=np.longdouble))
            total *= 1.0 + side * (n * _EPS_SUM + _EPS)
            d += self.inf
            dj = d - self.slack
            d += self.slack
            d *= side * (2.0 * _EPS)
            dj += d
            del d
            np.clip(dj, 0.0, 1.0, out=dj)
            self._cache = _Curves(_Grid(self.start, self.h, n), dj, r, total)
        return self._cache

    def _head(self) -> float:
        """``sum_i p_i e^{-(t_i - t_0)}``, rounded toward this bound's side (down for an upper PLD), for the curve
        below the grid, ``inf + total - e^{eps - t_0} head``, where ``1 - delta`` cancels (``eps = -12 h`` at
        ``q = 1e-3``: 1e-3): so it is summed afresh, in extended precision where there is one, not taken from
        ``R_0``, whose bound grows with the grid (``3 eps n``).  Each term's exponential rounds by ``2 eps`` plus
        ``eps`` times its exponent; the sum as in :meth:`_curves`."""
        if not hasattr(self, "_head_cache"):
            n, block = self.pmf.size, 1 << 20   # in blocks: a 33M-point grid's exponentials would be 270 MB
            head = np.longdouble(0.0)
            for lo in range(0, n, block):
                k = np.arange(lo, min(lo + block, n), dtype=np.float64)
                head += np.sum(self.pmf[lo:lo + block] * np.exp(-self.h * k), dtype=np.longdouble)
            side = 1.0 if self.upper else -1.0
            self._head_cache = float(head) * (1.0 - side * (n * _EPS_SUM + (4.0 + n * self.h) * _EPS))
        return self._head_cache

    def _outward(self, val, error):
        """``val`` moved by its rounding bound ``error`` toward this bound's side."""
        return val + error if self.upper else val - error

    def delta(self, eps: float) -> float:
        """``delta(eps)`` of this PLD (exact for the discrete distribution, up to the rounding bounds charged by
        :meth:`_curves` and to those of this evaluation, charged here)."""
        # the scalar form of :meth:`deltas` (equal to it; a tenth of its cost in the searches that call it)
        t, dj, r, total = self._curves()
        # an eps given as j * h must land on segment j, not j - 1, despite rounding in the division
        j = math.floor(round(eps / self.h, 9)) - self.start
        if j >= self.pmf.size - 1:
            val = self._outward(self.inf - self.slack, 2.0 * _EPS * (self.inf + self.slack))
        elif j < 0:
            far = math.exp(eps - t[0]) * self._head()
            val = self._outward(self.inf + total - far - self.slack,
                                4.0 * _EPS * (self.inf + total + self.slack + far * (2.0 + abs(eps) + abs(t[0]))))
        else:
            em = math.expm1(eps - t[j])
            val = self._outward(dj[j] - r[j] * em,
                                4.0 * _EPS * (dj[j] + r[j] * (em + 2.0 * (1.0 + abs(eps) + abs(t[j])))))
        return float(min(max(val, 0.0), 1.0))

    def deltas(self, eps: np.ndarray) -> np.ndarray:
        """:meth:`delta` at every point of ``eps`` (any real values, ``-inf`` included)."""
        t, dj, r, total = self._curves()
        # an eps given as j * h must land on segment j, not j - 1, despite rounding in the division
        with np.errstate(invalid="ignore"):
            j = np.floor(np.round(eps / self.h, 9)) - self.start
        j = np.clip(np.nan_to_num(j, nan=-1.0, neginf=-1.0), -1, self.pmf.size - 1).astype(np.int64)
        at = np.maximum(j, 0)
        with np.errstate(over="ignore", invalid="ignore"):
            em = np.expm1(eps - t[at])
            val = self._outward(dj[at] - r[at] * em,
                                4.0 * _EPS * (dj[at] + r[at] * (em + 2.0 * (1.0 + np.abs(eps) + np.abs(t[at])))))
            under = j < 0
            if under.any():   # below the grid every mass counts
                far = np.exp(eps[under] - t[0]) * self._head()
                spread = np.where(far > 0, far * (2.0 + np.abs(eps[under]) + abs(t[0])), 0.0)   # 0 at eps = -inf
                val[under] = self._outward(self.inf + total - far - self.slack,
                                           4.0 * _EPS * (self.inf + total + self.slack + spread))
        val[j >= self.pmf.size - 1] = self._outward(self.inf - self.slack, 2.0 * _EPS * (self.inf + self.slack))
        return np.clip(val, 0.0, 1.0)

    def epsilon(self, delta: float) -> float:
        """Smallest ``eps >= 0`` with ``delta(eps) <= delta`` (``inf`` when the mass at ``+inf`` exceeds it),
        rounded outward (up for an upper PLD, down for a lower one).  An upper PLD's answer also satisfies its own
        :meth:`delta` read-out, ``delta(epsilon(d)) <= d``: each rounds outward on its own, so the root is moved up
        by the few units in the last place that their two margins can differ by."""
        eps = self._epsilon(delta)
        if self.upper and 0.0 < eps < math.inf:
            step = 4.0 * _EPS * max(abs(eps), self.h)
            for _ in range(64):
                if self.delta(eps) <= delta:
                    break
                eps, step = eps + step, 2.0 * step
        return eps

    def _epsilon(self, delta: float) -> float:
        t, dj, r, total = self._curves()
        if self.inf - self.slack > delta:
            return math.inf
        below = np.nonzero(dj > delta)[0]
        if below.size == 0:
            num = self._outward(self.inf + total - self.slack - delta,
                                2.0 * _EPS * (self.inf + total + self.slack + delta))
            head = self._head()
            if num <= 0 or head <= 0:
                return 0.0
            log = math.log(num / head)
            return max(0.0, float(self._outward(t[0] + log, 4.0 * _EPS * (1.0 + abs(t[0]) + abs(log)))))
        j = int(below[-1])
        if j >= self.pmf.size - 1 or r[j] <= 0:
            return max(0.0, float(t[j]))
        # dj[j] - delta is exact (two floats); the quotient, log1p and the sum round by an eps of each term
        log = math.log1p((dj[j] - delta) / r[j])
        eps = self._outward(t[j] + log, 4.0 * _EPS * (1.0 + abs(t[j]) + abs(log)))
        # the root lies in [t_j, t_{j+1}]: dj[j] > delta >= dj[j + 1], each on this bound's side
        ends = (t[j] - 4.0 * _EPS * abs(t[j]), t[j] + self.h + 4.0 * _EPS * (abs(t[j]) + self.h))
        return max(0.0, float(min(max(eps, ends[0]), ends[1])))

    def tradeoff(self, alpha: np.ndarray) -> np.ndarray:
        """``beta(alpha) = sup_eps 1 - delta(eps) - e^eps alpha`` (the optimum sits at a grid point), rounded
        outward: down for an upper PLD (a lower bound on the trade-off curve), up for a lower one."""
        t, dj, r, total = self._curves()
        with np.errstate(divide="ignore"):
            log_slope = np.log(r) - t.array()  # log of -d delta / d e^eps on (t_j, t_{j+1}); non-increasing
        with np.errstate(divide="ignore"):
            log_alpha = np.log(alpha)
        # first j whose right-hand slope is below alpha: 1 - delta - x alpha stops increasing there.  Any j gives a
        # bound (delta is on this PLD's side at every point), so the rounding of the slopes only costs tightness
        j = np.searchsorted(-log_slope, -log_alpha, side="left")
        j = np.minimum(j, t.size - 1)
        with np.errstate(over="ignore", invalid="ignore"):
            ex = np.exp(t[j] + log_alpha)
            # the exponent's rounding, relative to its terms (none at alpha = 0, where ex = 0 and log alpha = -inf)
            spread = np.where(ex > 0, ex * (2.0 + np.abs(t[j]) + np.abs(log_alpha)), 0.0)
            vals = -self._outward(-(1.0 - dj[j] - ex), 4.0 * _EPS * (1.0 + dj[j] + spread))
        start_val = -self._outward(-(1.0 - (self.inf + total - self.slack)),
                                   4.0 * _EPS * (1.0 + self.inf + total + self.slack))
        return np.clip(np.maximum(vals, start_val), 0.0, 1.0)


def mean_gap(upper: list[tuple[Pld, int]], lower: list[tuple[Pld, int]]) -> float:
    """``(m_upper - m_lower) / m_upper``: the relative gap between the mean losses of the upper and lower PLDs of the
    same steps with their counts (each step's masses times its losses, times its count, summed; ``inf`` where
    ``m_upper <= 0``).  The loss grid moves a composed epsilon by about this much relative, so it predicts a
    bracket's loss-grid width (at most 1.3 times it on seven subsampled-Gaussian settings from ``q = 1e-3`` to
    ``q = 0.5``).

    Examples
    --------
    >>> import numpy as np
    >>> from dpmath.pld.distribution import Pld, mean_gap
    >>> up, lo = Pld(0.5, 0, np.array([0.5, 0.5]), 0.0, True), Pld(0.5, 0, np.array([0.6, 0.4]), 0.0, False)
    >>> round(mean_gap([(up, 10)], [(lo, 10)]), 3)
    0.2
    """
    means = [math.fsum(n * float(p.pmf @ ((p.start + np.arange(p.pmf.size)) * p.h)) for p, n in steps)
             for steps in (upper, lower)]
    return (means[0] - means[1]) / means[0] if means[0] > 0 else math.inf

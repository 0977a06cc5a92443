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

import numpy as np
from scipy import signal

__all__ = ["GridTooLargeError", "HUGE_LOSS", "MAX_GRID", "Pld", "grid_advice"]


class GridTooLargeError(ValueError):
    """The loss grid would need more points than :data:`MAX_GRID`: the discretization is too fine for the
    losses at hand (a coarser one still gives valid, looser bounds), or the losses are too spread out for any
    grid (tiny noise, or an enormous number of steps), where the message points to :class:`~dpmath.RDPAccountant`."""


MAX_GRID = 1 << 25  # ~34M points: 270 MB per float64 array, the most one composition may use
HUGE_LOSS = 1e3     # nats: losses beyond make epsilon huge, where a grid too large is best answered without one


def grid_advice(h: float, needed: float, spread: float, one_step: bool = False) -> str:
    """What to do about a grid over :data:`MAX_GRID` points, for a :class:`GridTooLargeError`: a coarser
    discretization where ``needed`` (the step that would fit; ``one_step``: one step's grid, which a composition
    widens) is at most 1, the accountant's limit, and the RDP accountant, which needs no grid, first where
    ``spread`` (how far the losses reach, in nats) exceeds :data:`HUGE_LOSS`: epsilon is then huge, and a grid
    that holds such losses is slow to compose, if it fits at all."""
    rdp = "dpmath.RDPAccountant, which needs no grid (a looser bound, in milliseconds)"
    coarser = (f"a coarser discretization (now {h:g}), e.g. discretization={needed:.2g}"
               + (" for one step (a composition of many needs a coarser one still)" if one_step else ""))
    if needed > 1.0:
        return (f"the losses reach {spread:.3g}, so epsilon is huge and no discretization up to 1 holds them: bound "
                f"epsilon with {rdp}, or use more noise or fewer steps")
    if spread > HUGE_LOSS:
        return (f"the losses reach {spread:.3g}, so epsilon is huge: bound it with {rdp}, or use more noise; "
                f"{coarser}, fits too but is slow")
    return f"use {coarser}, or bound epsilon with {rdp}"


@dataclass
class Pld:
    """A discrete PLD: masses ``pmf`` at losses ``(start + j) h``, ``inf`` at ``+inf``.

    ``upper`` says which bound it is; ``slack`` (lower bounds only) is mass that FFT wrap-around may
    have placed too high, subtracted from every delta; ``err`` (compositions) is the floating-point
    error bound per point, already added to (upper) or subtracted from (lower) ``pmf``.
    """

    h: float
    start: int
    pmf: np.ndarray
    inf: float
    upper: bool
    slack: float = 0.0
    err: np.ndarray | None = None

    # ----------------------------------------------------------------------------- read-out
    def _curves(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(t, delta_j, R_j)`` at the grid points, ``R_j = sum_{i>j} p_i e^{-(t_i - t_j)}``."""
        if not hasattr(self, "_cache"):
            c = math.exp(-self.h)
            r = signal.lfilter([0.0, c], [1.0, -c], self.pmf[::-1])[::-1]
            d = math.expm1(self.h) * np.cumsum(r[::-1])[::-1]
            t = (self.start + np.arange(self.pmf.size)) * self.h
            self._cache = (t, np.clip(self.inf + d - self.slack, 0.0, 1.0), r)
        return self._cache

    def delta(self, eps: float) -> float:
        """``delta(eps)`` of this PLD (exact for the discrete distribution)."""
        # the scalar form of :meth:`deltas` (equal to it; a tenth of its cost in the searches that call it)
        t, dj, r = self._curves()
        # an eps given as j * h must land on segment j, not j - 1, despite rounding in the division
        j = math.floor(round(eps / self.h, 9)) - self.start
        if j >= self.pmf.size - 1:
            return float(max(self.inf - self.slack, 0.0))
        if j < 0:
            total = float(self.pmf.sum())
            val = self.inf + total - math.exp(eps - t[0]) * (self.pmf[0] + r[0]) - self.slack
        else:
            val = dj[j] - r[j] * math.expm1(eps - t[j])
        return float(min(max(val, 0.0), 1.0))

    def deltas(self, eps: np.ndarray) -> np.ndarray:
        """:meth:`delta` at every point of ``eps`` (any real values, ``-inf`` included)."""
        t, dj, r = self._curves()
        # an eps given as j * h must land on segment j, not j - 1, despite rounding in the division
        with np.errstate(invalid="ignore"):
            j = np.floor(np.round(eps / self.h, 9)) - self.start
        j = np.clip(np.nan_to_num(j, nan=-1.0, neginf=-1.0), -1, self.pmf.size - 1).astype(np.int64)
        at = np.maximum(j, 0)
        with np.errstate(over="ignore", invalid="ignore"):
            val = dj[at] - r[at] * np.expm1(eps - t[at])
            under = j < 0
            if under.any():   # below the grid every mass counts
                head = self.pmf[0] + r[0]
                val[under] = self.inf + float(self.pmf.sum()) - np.exp(eps[under] - t[0]) * head - self.slack
        val[j >= self.pmf.size - 1] = self.inf - self.slack
        return np.clip(val, 0.0, 1.0)

    def epsilon(self, delta: float) -> float:
        """Smallest ``eps >= 0`` with ``delta(eps) <= delta`` (``inf`` when the mass at ``+inf`` exceeds it)."""
        t, dj, r = self._curves()
        if self.inf - self.slack > delta:
            return math.inf
        below = np.nonzero(dj > delta)[0]
        if below.size == 0:
            total = float(self.pmf.sum())
            head = self.pmf[0] + r[0]
            num = self.inf + total - self.slack - delta
            if num <= 0 or head <= 0:
                return 0.0
            return max(0.0, float(t[0] + math.log(num / head)))
        j = int(below[-1])
        if j >= self.pmf.size - 1 or r[j] <= 0:
            return max(0.0, float(t[j]))
        eps = t[j] + math.log1p((dj[j] - delta) / r[j])
        return max(0.0, float(min(eps, t[j] + self.h)))

    def tradeoff(self, alpha: np.ndarray) -> np.ndarray:
        """``beta(alpha) = sup_eps 1 - delta(eps) - e^eps alpha`` (the optimum sits at a grid point)."""
        t, dj, r = self._curves()
        with np.errstate(divide="ignore"):
            log_slope = np.log(r) - t  # log of -d delta / d e^eps on (t_j, t_{j+1}); non-increasing
        with np.errstate(divide="ignore"):
            log_alpha = np.log(alpha)
        # first j whose right-hand slope is below alpha: 1 - delta - x alpha stops increasing there
        j = np.searchsorted(-log_slope, -log_alpha, side="left")
        j = np.minimum(j, t.size - 1)
        with np.errstate(over="ignore"):
            vals = 1.0 - dj[j] - np.exp(t[j] + log_alpha)
        start_val = 1.0 - (self.inf + float(self.pmf.sum()) - self.slack)
        return np.clip(np.maximum(vals, start_val), 0.0, 1.0)

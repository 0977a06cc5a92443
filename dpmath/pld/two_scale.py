r"""A lower bound on a subsampled Gaussian's composed epsilon when one step's typical loss is far below the
loss grid's step (``q mu << h``, e.g. ``q = 1e-6``).

There the bulk of a step's losses, between ``log(1 - q)`` and a few ``q``, falls inside one or two grid
intervals whose exact curve bends close to a grid point.  A lower curve on the grid must drop below the
bend, so the lowered split rounds that bulk down to ``-h``: at ``sigma = 0.5``, ``q = 1e-6``, ``h = 1e-4`` the
lower step's mean loss is ``-0.84 h`` where the true one is ``3e-11``, and ``10^4`` steps shift the composed
loss by ``-0.84``.  A grid fine enough for the bulk (``h = 1e-6`` resolves it: mean ``1e-16``) cannot hold the
heavy tail's composition (millions of points up to losses of 3 per step).

Split each step's law of ``L`` under ``P`` at a threshold ``tau`` into the bulk ``B`` (``L <= tau``, mass
``1 - p``) and the tail ``T`` (``L > tau``, mass ``p``): sub-probability measures with ``B + T`` the step's law.
The composition's hockey-stick curve is linear in the law of the summed loss, so, exactly,

.. math::

    \delta_n(\varepsilon) = \sum_{k=0}^{n} \binom{n}{k}\, \delta[B^{*(n-k)} * T^{*k}](\varepsilon),
    \qquad \delta[\mu](c) = \int (1 - e^{c - l})_+ \, d\mu(l).

Every term is non-negative, so dropping ``k >= 2`` only lowers it (``n p`` is kept at most ``1e-3``).  And
``delta[mu * nu](c) = int delta[mu](c - b) dnu(b)``, so a measure whose curve lies below ``mu``'s at every
``c`` may replace ``mu`` in any convolution with a non-negative ``nu`` and the result stays below.  Hence

.. math::

    \delta_n(\varepsilon) \ge \delta[\underline{B}_n](\varepsilon)
        + n \int \delta[\underline{T}](\varepsilon - a)\, d\underline{B}_{n-1}(a) - n\, s_{n-1} |\underline{T}|,

with ``T`` lowered on the coarse grid ``h`` (the tail's losses span up to about 3), the bulk lowered on a grid
``h_f`` fine enough for it and composed there (:class:`Composition`, lower bounds: every mass at most the true
one, and ``s`` the mass its window may have misplaced, whose part of the integral is at most ``s |T|``).
Both lowerings are the module's usual lowered splits (:func:`split`), each of a piece of the step.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize

from .compose import Composition
from .discretize import assemble, split
from .distribution import GridTooLargeError, Pld
from .losses import loss_range, mixture_masses, pair_cdfs, step_grid

_TAIL_EVENTS = 1e-3    # n p at most this: the terms with two or more tail steps are dropped
_FINE_LOG = 17         # the bulk's fine grid has 2^17 points between 0 and tau ...
_FINE_TOTAL = 5 << 15   # ... fewer where it would have more than 1.25 times as many in all (at most 1.06 on the
                        # benchmarks' tiny-q cases, 3.25 at q = 0.5, sigma = 1e4) ...
_COARSEST_LOG = 10      # ... and no fewer than 2^10 (else there is no two-scale curve)


def tail_threshold(mu: float, q: float, n: int, h: float) -> float:
    """The smallest ``tau = h 2^j`` whose tail mass per step ``p = P(L > tau)`` has ``n p <= _TAIL_EVENTS``."""
    taus = h * 2.0 ** np.arange(0, 40)
    p = pair_cdfs(taus, mu, q, "remove")[1]
    ok = np.nonzero(n * p <= _TAIL_EVENTS)[0]
    return float(taus[ok[0]]) if ok.size else math.inf


class TwoScaleLower:
    """The lower curve of the module docstring for ``n`` removal steps of the subsampled Gaussian with shift
    ``mu`` and sampling rate ``q``, the tail on the loss grid ``h``; ``tail`` is the windows' cut mass.  Build
    with :meth:`build`, which returns ``None`` where no threshold keeps ``n p`` small, and raises
    :class:`GridTooLargeError` where the bulk's composition needs more than ``max_points`` points."""

    def __init__(self, whole: Pld, rest: Pld, t_low: Pld, n: int) -> None:
        self.whole, self.t_low, self.n = whole, t_low, n
        keep = rest.pmf > 1e-30   # dropping mass only lowers the bound; these points cost time and add nothing
        self.a = ((rest.start + np.arange(rest.pmf.size)) * rest.h)[keep]
        self.weights = rest.pmf[keep]
        # the misplaced mass of the (n-1)-fold bulk meets at most T's whole mass; the dot product's rounding
        # (positive terms: relative error below size * eps) is taken off as well
        self.charge = n * rest.slack * float(t_low.pmf.sum())
        self.shrink = 1.0 - 2.0 * (self.weights.size + 2) * float(np.finfo(np.float64).eps)

    @classmethod
    def build(cls, mu: float, q: float, n: int, h: float, tail: float, max_points: int | None = None
              ) -> TwoScaleLower | None:
        tau = tail_threshold(mu, q, n, h)
        k_top = step_grid(mu, q, "remove", h, 9.0)[1]
        j_tau = round(tau / h) if math.isfinite(tau) else k_top
        if n < 2 or q >= 1.0 or k_top <= j_tau + 1:
            return None
        # the bulk: the fine grid's intervals from 9 standard deviations of the output below (or from below
        # log(1 - q), the least loss, if that is higher; the lower bound drops the mass below its grid, Phi(-9) =
        # 1e-19 a step) up to tau, and nothing above: that is T's.  h_f = tau / 2^m exactly, so both pieces meet
        # at the same loss: m = 17 where the bulk's losses sit mostly above 0 (tiny q), less where they reach far
        # below, so that the grid has at most _FINE_TOTAL points (at q = 0.5, sigma = 1e4, 10 steps log(1 - q)
        # alone was 454M points at m = 17, 12 GB; 9 standard deviations take m = 15), and no curve where m would
        # fall below 10
        t_lo = max(math.log1p(-q), loss_range(mu, q, "remove", 9.0)[0])
        m = min(_FINE_LOG, math.floor(math.log2(_FINE_TOTAL * tau / (tau - t_lo))))
        if m < _COARSEST_LOG:
            return None
        h_f = tau / 2.0 ** m
        k_lo = math.floor(t_lo / h_f) - 1
        one = np.ones((1, 1))
        bulk = mixture_masses(np.array([mu]), one, q, "remove", h_f, (False,), k_lo, 1 << m, None)[0]
        bulk.atoms[-1] = 0.0
        b_low = assemble([split(bulk, h_f, False)], h_f, False)
        # the tail: the coarse grid's intervals above tau (a lower bound drops the mass below its grid) and the
        # mass above it held at its top
        top = mixture_masses(np.array([mu]), one, q, "remove", h, (False,), j_tau, k_top, None)[0]
        t_low = assemble([split(top, h, False)], h, False)
        whole = Composition([(b_low, n)], tail)
        if max_points is not None and whole.hi - whole.lo + 1 > max_points:
            # a budget's limit (the accountant's default): the two compositions read a few passes of this window
            raise GridTooLargeError(f"the two-scale bulk's composition needs {whole.hi - whole.lo + 1:,} points, "
                                    f"more than the {max_points:,} allowed")
        return cls(whole.full(), Composition([(b_low, n - 1)], tail).full(), t_low, n)

    def delta(self, eps: float) -> float:
        """A lower bound on the composition's ``delta(eps)``."""
        spread = float(self.weights @ self.t_low.deltas(eps - self.a)) * self.shrink
        return max(0.0, self.whole.delta(eps) + self.n * spread - self.charge)

    def epsilon(self, delta: float, eps_hi: float, eps_lo: float = 0.0) -> float:
        """A lower bound on ``epsilon(delta)``: an ``eps`` in ``[eps_lo, eps_hi]`` whose lower delta still exceeds
        ``delta``, within ``1e-7`` relative of the largest (Brent's method on the decreasing lower curve), or
        ``eps_lo`` (a lower bound already known) where none does."""
        if self.delta(eps_lo) <= delta:
            return eps_lo
        if self.delta(eps_hi) > delta:
            return eps_hi
        tol = 1e-7 * eps_hi
        root = optimize.brentq(lambda e: self.delta(e) - delta, eps_lo, eps_hi, xtol=tol)
        # only an eps whose lower delta is seen above delta is returned
        for eps in (root - 2.0 * tol, root - 1e3 * tol):
            if eps > eps_lo and self.delta(eps) > delta:
                return eps
        return eps_lo

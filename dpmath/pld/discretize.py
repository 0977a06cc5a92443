r"""One step's interval masses placed on grid points: an upper or a lower discrete privacy-loss distribution.

Two discretizations of one step, both built from the interval masses ``P_k = P(L in (t_k, t_{k+1}])``
and ``Q_k`` of the exact pair:

* **upper** (pessimistic, "connect the dots", Doroshenko et al. 2022): each interval's ``(P_k, Q_k)``
  is split between its two end points so that both masses are preserved.  The discrete curve equals
  the exact one at every grid point and is the chord between them (delta is convex in ``e^eps``), so
  it lies above.  Mass below the grid goes to its first point, mass above to the last point and to
  ``+inf`` (again preserving both masses).
* **lower** (optimistic): a pair whose curve lies below the exact one everywhere is a post-processing
  of it (Blackwell), and composition keeps that order.  Write ``x = e^eps`` and ``D(x)`` for the
  intervals' part of the exact curve, convex in ``x``.  The lower curve takes ``D(x_j) - c_j`` at
  every grid point and is linear in between.  On interval ``k`` it stays below the two tangents of ``D``
  at the interval's ends, hence below ``D``, if and only if ``d_k c_k + l_k c_{k+1} >= l_k d_k``.  Here
  ``l_k = P_k - e^{t_k} Q_k`` and ``d_k = e^{t_{k+1}} Q_k - P_k`` (both ``>= 0``).  The default is
  ``c_j = max(H_{j-1}, H_j)`` with the tangents' gap ``H_k = l_k d_k / (l_k + d_k)``, about ``P_k h / 4``.
  This makes the error second order in ``h``, like the upper bound's (:func:`_lowered`).  The end
  points keep their values, so both masses are preserved; the points stay above the curve's left
  tangent and above 0.  Where the result is not convex (a negative mass), the greatest convex minorant is
  taken; it is lower still.  Atoms already on grid points (the mass above the grid), and any interval
  whose constraint cannot be met, have their losses rounded *down* to the grid.  Mass below the grid is
  dropped.  Rounding down is sound because the delta of a composition, ``E_{P^n}[(1 - e^{eps - sum
  L})_+]``, is non-decreasing in every loss.  With the greedy post-processing split used before, the
  lower end's error was 10 to 100 times the upper end's at ``h = 1e-4``; with this one it is about 2
  times.
"""

from __future__ import annotations

import math

import numpy as np

from .distribution import Pld
from .losses import StepMasses

__all__ = ["split", "assemble"]

_ROUND_UP = 1.0 + 1e-12   # lowerings are raised by this factor so their constraints survive rounding
_EPS = float(np.finfo(np.float64).eps)


def split(m: StepMasses, h: float, upper: bool) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Place every interval's mass on grid points: connect-the-dots (upper) or the lowered curve of
    :func:`_lowered` (lower); see the module docstring.  Returns ``(grid indices, masses, inf, slack)``, the masses
    moved by their rounding bound toward the bound's side; ``slack`` (lower) is what the read-out takes off every
    delta for a rounding residue no point can absorb (:func:`_lowered`)."""
    idx = m.lo + np.arange(m.atoms.size) if m.idx is None else m.idx
    t = idx * h
    width = np.diff(t).astype(np.float64) if m.idx is not None else np.full(max(t.size - 1, 0), h)
    if not upper:
        masses, err, slack = _lowered(m.p_int, m.q_int, t, width)
        return idx, np.maximum(m.atoms + masses - err - _EPS * m.atoms, 0.0), 0.0, slack
    left, _ = _excesses(m.p_int, m.q_int, t)
    # each interval's two shares round by an eps or two of its mass, the sum with the atoms by one: charged upward
    spread = np.zeros(t.size)
    spread[:-1] += m.p_int
    spread[1:] += m.p_int
    return idx, (m.atoms + _connect_the_dots(m.p_int, left, width)) * (1.0 + _EPS) + 4.0 * _EPS * spread, \
        min(m.inf, 1.0), 0.0


def _excesses(p_int: np.ndarray, q_int: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(l_k, d_k) = (P_k - e^{t_k} Q_k, e^{t_{k+1}} Q_k - P_k)``, both ``>= 0`` (rounding clipped)."""
    with np.errstate(divide="ignore", over="ignore"):
        log_q = np.log(q_int)
        left = np.clip(p_int - np.exp(t[:-1] + log_q), 0.0, p_int)
        deficit = np.maximum(np.exp(t[1:] + log_q) - p_int, 0.0)
    return left, deficit


def _connect_the_dots(p_int: np.ndarray, left: np.ndarray, width: np.ndarray) -> np.ndarray:
    """``P``-masses at the grid points that keep each interval's ``P`` and ``Q`` masses (given through its
    left-end excess ``left``, :func:`_excesses`): the curve through the exact one's values at the grid points."""
    right = np.minimum(left / -np.expm1(-width), p_int)
    pmf = np.zeros(p_int.size + 1)
    pmf[:-1] += p_int - right
    pmf[1:] += right
    return pmf


def _lowered(p_int: np.ndarray, q_int: np.ndarray, t: np.ndarray, width: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, float]:
    """``P``-masses at the grid points whose curve lies below the intervals' exact curve (module docstring), a
    bound on their floating-point rounding, to be taken off, and a slack for the read-out.

    The connect-the-dots curve is lowered by ``c_j`` at grid point ``j``; in ``P``-masses that subtracts
    ``x_j`` times the slope change of the piecewise-linear ``c`` at ``x_j = e^{t_j}``.  An interval
    whose constraint cannot be met within the caps, or whose ``Q``-mass underflowed, is rounded down to its
    left end, and the rest is solved again.

    The slope changes enter as two terms of about ``c / h`` each, whose sum is about ``c``: their rounding, a few
    ``eps c / h`` a point, once summed to ``1e-13`` above the masses' total at ``h = 1e-3`` (and the curve above
    the exact one by as much near ``delta = 1``).  The bound is ``8 eps`` times the magnitudes of every term that
    reaches a point and its two neighbours (where the convex minorant moves a negative mass to).  An end point's
    negative residue, which :func:`_convex_minorant` clears to 0, raised the curve below its loss by up to its size
    (9e-14 at the first point, sigma = 0.32, q = 0.003, h = 1e-3): at the first point it is taken off the
    largest masses above, whose removal lowers the curve at least as much everywhere; at the last, where no point
    can take it, it is the slack.
    """
    n = t.size
    rounded = np.zeros(n)
    # an interval whose masses say its loss exceeds t_{k+1} (its Q-mass underflowed to 0 at losses in the
    # hundreds, or rounding in a wide interval's tail) has no usable curve: rounded down
    with np.errstate(divide="ignore", over="ignore"):
        lost = (p_int > 0) & ((q_int <= 0) | (np.exp(t[1:] + np.log(q_int)) < p_int))
    rounded[:-1] += np.where(lost, p_int, 0.0)
    p_int, q_int = np.where(lost, 0.0, p_int), q_int.copy()
    while True:
        if n < 3:   # no interior grid point to lower: the intervals are rounded down
            rounded[:-1] += p_int
            return rounded, _EPS * rounded, 0.0
        left, deficit = _excesses(p_int, q_int, t)
        total = left + deficit
        gap = np.divide(left * deficit, total, out=np.zeros_like(total), where=total > 0)
        with np.errstate(divide="ignore", over="ignore"):
            q_below = np.cumsum(q_int)                             # Q of intervals <= k, and ...
            q_above = np.r_[np.cumsum(q_int[::-1])[::-1][1:], 0.0]  # ... > k, each summed from its own tail
            # caps: every point stays above the curve's left tangent (the first point's mass >= 0) and
            # above 0 (the last point's); the end points are not lowered (both masses preserved).
            # (x_{k+1} - x_k) Q = exp(t_k + log(e^w - 1) + log Q), finite for any width
            log_dx = t[:-1] + width + np.log(-np.expm1(-width))
            cap = np.zeros(n)
            cap[1:] = np.cumsum(deficit + np.exp(log_dx + np.log(np.r_[0.0, q_below[:-1]])))
            above = np.cumsum((left + np.exp(log_dx + np.log(q_above)))[::-1])[::-1]
            cap[:-1] = np.minimum(cap[:-1], above)
        cap[0] = cap[-1] = 0.0
        c = np.zeros(n)
        c[1:-1] = np.maximum(gap[:-1], gap[1:]) * _ROUND_UP
        c = np.minimum(c, cap)
        # near the ends the caps bind: raise the neighbour instead (each constraint is monotone in c)
        need = np.divide(deficit * (left - c[:-1]), left, out=np.zeros_like(left), where=left > 0)
        c[1:] = np.maximum(c[1:], np.minimum(need * _ROUND_UP, cap[1:]))
        need = np.divide(left * (deficit - c[1:]), deficit, out=np.zeros_like(deficit), where=deficit > 0)
        c[:-1] = np.maximum(c[:-1], np.minimum(need * _ROUND_UP, cap[:-1]))
        bad = deficit * c[:-1] + left * c[1:] < left * deficit
        if not bad.any():
            break
        rounded[:-1] += np.where(bad, p_int, 0.0)
        p_int[bad] = 0.0
        q_int[bad] = 0.0
    step = np.diff(c)
    pmf = _connect_the_dots(p_int, left, width)   # left is the last pass's, for these p_int and q_int
    with np.errstate(over="ignore"):   # an interval wider than ~700 in loss: its slope change is 0
        down = step / np.expm1(width)
    up = step / -np.expm1(-width)
    pmf[:-1] -= down
    pmf[1:] += up
    magnitude = rounded.copy()
    magnitude[:-1] += p_int + np.abs(down)
    magnitude[1:] += p_int + np.abs(up)
    minorant = _convex_minorant(pmf, t)
    if minorant is None:   # rounding broke the end points' balance (masses near 1e-27): round every interval down
        rounded[:-1] += p_int
        return rounded, _EPS * rounded, 0.0
    minorant, first, last = minorant
    while first > 0:   # the largest masses above the first point absorb its residue
        j = 1 + int(np.argmax(minorant[1:]))
        taken = min(first, float(minorant[j]))
        if taken <= 0:
            break
        minorant[j] -= taken
        first -= taken
    near = magnitude + np.r_[0.0, magnitude[:-1]] + np.r_[magnitude[1:], 0.0]
    return rounded + minorant, 8.0 * _EPS * near, last + first


def _convex_minorant(pmf: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, float, float] | None:
    """Masses of the greatest convex minorant of the piecewise-linear curve with masses ``pmf``.

    A grid point of negative mass lies above the chord of its neighbours; it is dropped onto that chord,
    its ``Q``-mass shared between the neighbours so that their curve values stay.  Repeated until no mass
    is negative, this gives the greatest convex minorant: every drop lowers the curve, and each result lies
    above it.  The end points are never dropped.  Their masses are ``>= 0`` in exact arithmetic; a
    rounding residue below ``1e-9`` of the largest mass is cleared (and returned, the first and the last point's,
    for :func:`_lowered` to charge), and ``None`` is returned for a larger one.
    """
    n = pmf.size
    todo = (np.nonzero(pmf[1:-1] < 0)[0] + 1).tolist()
    if todo:
        pmf = pmf.copy()
        prev, nxt = list(range(-1, n - 1)), list(range(1, n + 1))
        while todo:
            j = todo.pop()
            if pmf[j] >= 0:   # dropped already (mass 0), or made non-negative by a neighbour's drop
                continue
            i, k = prev[j], nxt[j]
            to_right = math.expm1(t[i] - t[j]) / math.expm1(t[i] - t[k])   # P-mass share at t_k
            pmf[k] += to_right * pmf[j]
            pmf[i] += (1.0 - to_right) * pmf[j]
            pmf[j] = 0.0
            nxt[i], prev[k] = k, i
            todo.extend(m for m in (i, k) if 0 < m < n - 1 and pmf[m] < 0)
    if not np.all(np.isfinite(pmf)):
        raise ArithmeticError("lower-bound split: a mass is not finite")
    scale = float(np.max(np.abs(pmf))) if n else 0.0
    if n and min(pmf[0], pmf[-1]) < -1e-9 * scale:   # the pinned masses are differences of terms ~ P / h
        return None
    return np.maximum(pmf, 0.0), max(-float(pmf[0]), 0.0), max(-float(pmf[-1]), 0.0) if n > 1 else 0.0


def assemble(pieces: list[tuple[np.ndarray, np.ndarray, float, float]], h: float, upper: bool) -> Pld:
    """One PLD from split pieces (a mixture: masses, infinite masses and slacks add)."""
    lo = min(int(i[0]) for i, _, _, _ in pieces)
    hi = max(int(i[-1]) for i, _, _, _ in pieces)
    pmf = np.zeros(hi - lo + 1)
    for i, m, _, _ in pieces:
        np.add.at(pmf, i - lo, m)
    return Pld(h, lo, pmf, min(1.0, sum(f for _, _, f, _ in pieces)), upper,
               slack=sum(s for _, _, _, s in pieces))

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


def split(m: StepMasses, h: float, upper: bool) -> tuple[np.ndarray, np.ndarray, float]:
    """Place every interval's mass on grid points: connect-the-dots (upper) or the lowered curve of
    :func:`_lowered` (lower); see the module docstring.  Returns ``(grid indices, masses, inf)``."""
    idx = m.lo + np.arange(m.atoms.size) if m.idx is None else m.idx
    t = idx * h
    width = np.diff(t).astype(np.float64) if m.idx is not None else np.full(max(t.size - 1, 0), h)
    if not upper:
        return idx, m.atoms + _lowered(m.p_int, m.q_int, t, width), 0.0
    left, _ = _excesses(m.p_int, m.q_int, t)
    return idx, m.atoms + _connect_the_dots(m.p_int, left, width), min(m.inf, 1.0)


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


def _lowered(p_int: np.ndarray, q_int: np.ndarray, t: np.ndarray, width: np.ndarray) -> np.ndarray:
    """``P``-masses at the grid points whose curve lies below the intervals' exact curve (module docstring).

    The connect-the-dots curve is lowered by ``c_j`` at grid point ``j``; in ``P``-masses that subtracts
    ``x_j`` times the slope change of the piecewise-linear ``c`` at ``x_j = e^{t_j}``.  An interval
    whose constraint cannot be met within the caps, or whose ``Q``-mass underflowed, is rounded down to its
    left end, and the rest is solved again.
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
            return rounded
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
        pmf[:-1] -= step / np.expm1(width)
    pmf[1:] += step / -np.expm1(-width)
    minorant = _convex_minorant(pmf, t)
    if minorant is None:   # rounding broke the end points' balance (masses near 1e-27): round every interval down
        rounded[:-1] += p_int
        return rounded
    return rounded + minorant


def _convex_minorant(pmf: np.ndarray, t: np.ndarray) -> np.ndarray | None:
    """Masses of the greatest convex minorant of the piecewise-linear curve with masses ``pmf``.

    A grid point of negative mass lies above the chord of its neighbours; it is dropped onto that chord,
    its ``Q``-mass shared between the neighbours so that their curve values stay.  Repeated until no mass
    is negative, this gives the greatest convex minorant: every drop lowers the curve, and each result lies
    above it.  The end points are never dropped.  Their masses are ``>= 0`` in exact arithmetic; a
    rounding residue below ``1e-9`` of the largest mass is cleared, and ``None`` is returned for a larger one.
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
    return np.maximum(pmf, 0.0)


def assemble(pieces: list[tuple[np.ndarray, np.ndarray, float]], h: float, upper: bool) -> Pld:
    """One PLD from split pieces (a mixture: masses add)."""
    lo = min(int(i[0]) for i, _, _ in pieces)
    hi = max(int(i[-1]) for i, _, _ in pieces)
    pmf = np.zeros(hi - lo + 1)
    for i, m, _ in pieces:
        np.add.at(pmf, i - lo, m)
    return Pld(h, lo, pmf, min(1.0, sum(f for _, _, f in pieces)), upper)

r"""Discrete privacy-loss distributions: construction, FFT composition, and read-out.

A privacy-loss distribution (PLD) of a pair ``(P, Q)`` is the law of ``L = log(dP/dQ)(o)`` for
``o ~ P``.  Its hockey-stick curve is

.. math::

    \delta(\varepsilon) = p_\infty + E_P\big[(1 - e^{\varepsilon - L})_+\big],

increasing in every value of ``L``; composing mechanisms adds independent losses.  Here a PLD lives
on the grid ``t_j = j h`` as masses ``pmf`` from index ``start`` on, plus a mass ``inf`` at ``+inf``.

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

Composition (:class:`Composition`) multiplies the Fourier transforms of all steps at once, on a window
chosen by a Chernoff bound: the mass beyond it is charged to ``inf`` (upper) and the mass that can
wrap around is subtracted from delta (``slack``, lower).  Floating-point error is bounded, not
ignored.  A plain FFT has an absolute error near ``n eps log N`` times the peak mass, which swamps
the ``1e-12`` tails a small delta depends on, so the product is also computed under exponential
tilts ``p_j e^{lambda t_j}``, each centred where the previous ones left an upper tail sum
``P(L >= t) > 1e-15`` with a relative error bound above ``1e-3``; each output point is taken from
the tilt with the smallest error bound, and that bound is added to it (upper) or subtracted (lower).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import fft as sfft
from scipy import signal, special


class GridTooLargeError(ValueError):
    """The loss grid would need more points than :data:`MAX_GRID`: the discretization is too fine for the
    losses at hand (a coarser one still gives valid, looser bounds)."""


MAX_GRID = 1 << 25  # ~34M points: 270 MB per float64 array, the most one composition may use
_F64_EPS = float(np.finfo(np.float64).eps)
_FFT_ERR = 5.0 * _F64_EPS  # |error| of an FFT coefficient per unit mass, per log2 N (scaled by eps in extended)
# extended precision helps only where long double is wider than double (x86: 80 bits; not on every platform)
_EXTENDED = float(np.finfo(np.longdouble).eps) < _F64_EPS
_EXTEND_AT = 1e-2      # ... and is used where a float64 pass's rounding moves delta by more than this of it
_TILT_TAIL = 1e-20     # tilted mass left outside a tilted window (it may alias anywhere; far below the FFT rounding)
_TILT_RTOL = 1e-3      # relative accuracy wanted for every upper tail sum ...
_TILT_FLOOR = 1e-15    # ... that exceeds this mass (delta is supported down to 1e-12)
_MAX_TILTS = 64
_LOG_TINY = -700.0     # log of the smallest spectrum modulus worth a complex power (exp(-700) ~ 1e-304)
_MAX_CUT = 1e-12      # most mass a composition window may cut (charged to delta) before it is an error
_ROUND_UP = 1.0 + 1e-12   # lowerings are raised by this factor so their constraints survive rounding


def _ndtr_pair(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(Phi(x), Phi(-x))``, each accurate in its own tail, from one ``ndtr`` call."""
    small = special.ndtr(-np.abs(x))
    big = 1.0 - small
    neg = x < 0
    return np.where(neg, small, big), np.where(neg, big, small)


def _shift(t: np.ndarray, q: float) -> np.ndarray:
    """``log((e^t - (1-q)) / q)`` for ``t > log(1-q)`` (``-inf`` at or below), without cancellation."""
    if q == 1.0:
        return t.astype(np.float64)
    out = np.full(t.shape, -np.inf)
    pos = t >= 0
    out[pos] = t[pos] - math.log(q) + np.log1p(-(1.0 - q) * np.exp(-t[pos]))
    neg = ~pos
    with np.errstate(divide="ignore", invalid="ignore"):
        inner = np.expm1(t[neg]) + q
        out[neg] = np.where(inner > 0, np.log(np.where(inner > 0, inner, 1.0)) - math.log(q), -np.inf)
    return out


def _mix_loss(x: np.ndarray, mu: float, q: float) -> np.ndarray:
    """``log(q exp(mu x - mu^2/2) + 1 - q)``: the remove-direction loss at output ``x``."""
    z = mu * x - 0.5 * mu * mu
    if q == 1.0:
        return z
    return np.logaddexp(math.log(q) + z, math.log1p(-q))


def _replace_threshold(t: np.ndarray, mu: float, q: float, lo: float, hi: float) -> np.ndarray:
    """Solve ``L(x) = t`` for the decreasing replace-one loss ``L(x) = l(-x) - l(x)`` by bisection."""
    a = np.full(t.shape, lo)
    b = np.full(t.shape, hi)
    for _ in range(80):
        m = 0.5 * (a + b)
        above = (_mix_loss(-m, mu, q) - _mix_loss(m, mu, q)) > t
        a = np.where(above, m, a)
        b = np.where(above, b, m)
    return 0.5 * (a + b)


def loss_range(mu: float, q: float, relation: str, z: float) -> tuple[float, float]:
    """Losses at the ``z``-standard-deviation ends of the output under ``P``."""
    if relation == "remove":
        return float(_mix_loss(np.array(-z), mu, q)), float(_mix_loss(np.array(mu + z), mu, q))
    if relation == "add":
        return float(-_mix_loss(np.array(z), mu, q)), float(-_mix_loss(np.array(-z), mu, q))
    lo = np.array([z, -mu - z])
    vals = _mix_loss(-lo, mu, q) - _mix_loss(lo, mu, q)
    return float(vals[0]), float(vals[1])


def pair_cdfs(t: np.ndarray, mu, q: float, relation: str, shift: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """``P(L <= t), P(L > t), Q(L <= t), Q(L > t)`` for the subsampled-Gaussian pair.

    ``relation`` is "remove" (``P = q N(mu) + (1-q) N(0)``, ``Q = N(0)``), "add" (the swap) or "replace"
    (``P = q N(-mu) + (1-q) N(0)``, ``Q = q N(mu) + (1-q) N(0)``, ``q < 1``).  ``q = 1`` is the
    Gaussian mechanism.  For "remove" and "add", ``mu`` may be an array that broadcasts against ``t``
    (a column of shifts gives one row per shift), and ``shift`` the precomputed ``_shift(t, q)``
    ("remove") or ``_shift(-t, q)`` ("add").
    """
    if relation == "remove":
        x = (_shift(t, q) if shift is None else shift) / mu + 0.5 * mu
        pa, pa_c = _ndtr_pair(x - mu)
        pb, pb_c = _ndtr_pair(x)
        return q * pa + (1 - q) * pb, q * pa_c + (1 - q) * pb_c, pb, pb_c
    if relation == "add":
        x = (_shift(-t, q) if shift is None else shift) / mu + 0.5 * mu  # L <= t  iff  X >= x
        pb, pb_c = _ndtr_pair(x)
        pa, pa_c = _ndtr_pair(x - mu)
        return pb_c, pb, q * pa_c + (1 - q) * pb_c, q * pa + (1 - q) * pb
    span = mu + 60.0 + abs(float(np.max(np.abs(t)))) / max(mu, 1e-300)
    x = _replace_threshold(t, mu, q, -span, span)  # L <= t  iff  X >= x
    pp, pp_c = _ndtr_pair(x + mu)
    pb, pb_c = _ndtr_pair(x)
    pq, pq_c = _ndtr_pair(x - mu)
    return q * pp_c + (1 - q) * pb_c, q * pp + (1 - q) * pb, q * pq_c + (1 - q) * pb_c, q * pq + (1 - q) * pb


@dataclass
class StepMasses:
    """Interval masses of one step on the grid ``t_j = j h``, ready to be split onto grid points.

    ``p_int[i], q_int[i]`` are ``P, Q(L in (t_{lo+i}, t_{lo+i+1}])``; ``atoms`` are ``P``-masses already on
    grid points, whose loss is at least ``t_j`` (the upper bound's are exactly ``t_j``); ``inf`` is mass at
    ``+inf``.  Adding two of them is mixing the pairs (with the label revealed).
    """

    lo: int
    p_int: np.ndarray
    q_int: np.ndarray
    atoms: np.ndarray
    inf: float
    idx: np.ndarray | None = None


def step_grid(mu: float, q: float, relation: str, h: float, z: float, t_cap: float = math.inf,
              max_points: int = MAX_GRID, t_floor: float = -math.inf, shared: bool = False
              ) -> tuple[int, int, int | None]:
    """``(k_lo, k_hi, sparse)``: the grid indices on which a subsampled-Gaussian step with shift ``mu > 0`` is
    resolved: ``z`` standard deviations of the output under ``P``, losses in ``[t_floor, t_cap]``, at most
    about ``max_points`` points.  ``sparse`` is ``None`` for every index in ``[k_lo, k_hi]``; a longer range
    uses ``sparse_points(k_lo, k_hi, sparse)``: every grid point near zero loss and geometrically spaced
    ones beyond (connect-the-dots on a coarser partition is still an upper bound, and the greedy split on it
    still a lower bound, only less tight).  ``shared``: a dense range's ends are rounded outward too, so
    that the scales of a mixture whose ranges are close share one dense grid as well."""
    t_lo, t_hi = loss_range(mu, q, relation, z)
    t_lo = max(t_lo, t_floor)
    t_hi = min(t_hi, max(t_cap, t_lo + h))
    k_lo = math.floor(t_lo / h)
    k_hi = max(math.ceil(t_hi / h), k_lo + 1)
    if k_hi - k_lo + 1 > MAX_GRID:
        raise GridTooLargeError(
            f"one step's privacy loss spans {k_hi - k_lo + 1:,} grid points (limit {MAX_GRID:,}); use a coarser "
            f"discretization (now {h:g}), e.g. discretization={h * 2 * (k_hi - k_lo) / MAX_GRID:.2g}")
    if k_hi - k_lo + 1 <= max_points:
        return (-_bucket(-k_lo), _bucket(k_hi), None) if shared else (k_lo, k_hi, None)
    # round the sparse grid's ends outward and its size up to one of a few buckets: the scales of a
    # randomized-clipping step that land in one bucket share the grid, so they are computed as one array,
    # mixed and split once (a wider range and more points only make the bounds tighter)
    return -_bucket(-k_lo), _bucket(k_hi), 1 << (max_points - 1).bit_length()


_MIX_BLOCK = 1 << 21   # scales times grid points evaluated per block of :func:`mixture_masses`


def _components(t: np.ndarray, mu, q: float, relation: str, shift: np.ndarray | None
                ) -> list[tuple[np.ndarray, float, float]]:
    """The normal laws whose mixtures are the pair's ``P`` and ``Q``, seen through the loss: ``(u, a, b)`` with
    ``P(L <= t) = sum a Phi(u)`` and ``Q(L <= t) = sum b Phi(u)``, each ``u`` non-decreasing in ``t`` along its
    last axis ("remove" and "replace": the pairs and arguments of :func:`pair_cdfs`)."""
    if relation == "remove":
        x = (_shift(t, q) if shift is None else shift) / mu + 0.5 * mu
        return [(x - mu, q, 0.0), (x, 1.0 - q, 1.0)]
    span = mu + 60.0 + abs(float(np.max(np.abs(t)))) / max(mu, 1e-300)
    x = _replace_threshold(t, mu, q, -span, span)  # L <= t  iff  X >= x
    return [(-x - mu, q, 0.0), (-x, 1.0 - q, 1.0 - q), (mu - x, 0.0, q)]


def _interval_masses(u: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``Phi(u_{j+1}) - Phi(u_j)`` along the last axis of a non-decreasing ``u``, each from the tail it lies
    in (relative accuracy in both tails), with ``Phi`` at the first and ``1 - Phi`` at the last point.

    One ``ndtr`` per point: ``s = Phi(-|u|)`` is the smaller tail, so an interval on one side of 0 is
    ``|s_{j+1} - s_j|`` and the one that straddles 0 (at most one per row, since ``u`` is monotone; any
    sign change is handled) is ``1 - s_j - s_{j+1}``."""
    neg = u < 0
    s = special.ndtr(-np.abs(u))
    m = np.abs(s[..., 1:] - s[..., :-1])
    cross = np.nonzero(neg[..., 1:] != neg[..., :-1])
    if cross[0].size:
        left = s[..., :-1][cross]
        m[cross] = np.maximum(1.0 - left - s[..., 1:][cross], 0.0)
    first = np.where(neg[..., 0], s[..., 0], 1.0 - s[..., 0])
    last_sf = np.where(neg[..., -1], 1.0 - s[..., -1], s[..., -1])
    return m, first, last_sf


@dataclass(frozen=True)
class MixtureSums:
    """Weighted mixtures over scales of one pair ``(P, Q)`` on one loss grid, reduced to what their masses need.

    ``P`` and ``Q`` are mixtures, with coefficients ``p_coef`` and ``q_coef``, of normal laws seen through
    the loss (:func:`_components`).  ``sums[r, c, j]`` is law ``c``'s mass in ``(t_j, t_{j+1}]`` summed over
    the scales with the weights ``weights[r]``; ``first[c, i]`` and ``last_sf[c, i]`` are law ``c``'s mass at or
    below the first grid point and above the last at scale ``i``.  The grid is ``k_lo .. k_hi`` (``idx`` None)
    or ``idx``, times ``h``.
    """

    k_lo: int
    k_hi: int
    idx: np.ndarray | None
    h: float
    sums: np.ndarray
    first: np.ndarray
    last_sf: np.ndarray
    weights: np.ndarray
    p_coef: tuple[float, ...]
    q_coef: tuple[float, ...]

    def swapped(self) -> MixtureSums:
        """The pair ``(Q, P)``, whose loss is ``-L``: the same laws on the negated grid, read in reverse.

        Adding an example is removing it with the pair swapped, so the "add" direction's masses on the
        mirror of a "remove" grid are this, from the same normal CDFs."""
        return MixtureSums(-self.k_hi, -self.k_lo, None if self.idx is None else -self.idx[::-1], self.h,
                           self.sums[..., ::-1], self.last_sf, self.first, self.weights, self.q_coef, self.p_coef)

    def masses(self, uppers: tuple[bool, ...]) -> list[StepMasses]:
        """Interval masses for each row of the weights, for the bound ``uppers[r]``.

        Mass beyond the resolved range is still accounted for: below it, at the first grid point (upper
        bound) or dropped (lower bound); above it, split between the last grid point and ``+inf`` with both
        masses preserved (upper) or rounded down to the last grid point (lower)."""
        t_top = (self.k_hi if self.idx is None else int(self.idx[-1])) * self.h
        p_first = sum(a * f for a, f in zip(self.p_coef, self.first, strict=True))
        p_above = sum(a * f for a, f in zip(self.p_coef, self.last_sf, strict=True))
        q_above = sum(b * f for b, f in zip(self.q_coef, self.last_sf, strict=True))
        with np.errstate(divide="ignore"):
            eq_top = np.where(q_above > 0, np.exp(t_top + np.log(q_above)), 0.0)
        kept = np.minimum(p_above, eq_top)
        n = self.sums.shape[-1] + 1
        out = []
        for r, upper in enumerate(uppers):
            row = self.weights[r]
            p_int = sum(a * self.sums[r, c] for c, a in enumerate(self.p_coef) if a)
            q_int = sum(b * self.sums[r, c] for c, b in enumerate(self.q_coef) if b)
            atoms = np.zeros(n)
            atoms[-1] = float((row * kept).sum()) if upper else float((row * p_above).sum())
            if upper:
                atoms[0] = float((row * p_first).sum())
            inf = float((row * (p_above - kept)).sum()) if upper else 0.0
            out.append(StepMasses(self.k_lo, p_int, q_int, atoms, inf, self.idx))
        return out


def mixture_sums(mus: np.ndarray, weights: np.ndarray, q: float, relation: str, h: float, k_lo: int, k_hi: int,
                 idx: np.ndarray | None) -> MixtureSums:
    """:class:`MixtureSums` of ``weights``-mixtures (one per row, shape ``(rows, mus.size)``) of subsampled-
    Gaussian steps with shifts ``mus`` (all ``> 0``) on the grid of :func:`step_grid`, for ``relation``
    "remove" or "replace" (a single shift); "add" is the swapped "remove" pair (:meth:`MixtureSums.swapped`).

    The normal CDFs dominate the cost: one per point, scale and law, each interval mass taken from the tail
    it lies in (:func:`_interval_masses`), so every mass keeps relative accuracy.  Every row and both
    directions share them: a randomized-clipping step's upper and lower bounds put their bins' masses on
    nearly the same scales, so both cost about what one did.
    """
    t = (np.arange(k_lo, k_hi + 1) if idx is None else idx) * h
    single = mus.size == 1   # the replace relation's bisection, and DP-SGD's grids of up to MAX_GRID points
    shift = None if single else _shift(t, q)
    weights = np.atleast_2d(weights)
    sums, first, last_sf, laws = None, [], [], []
    block = max(1, _MIX_BLOCK // t.size)
    for b in range(0, mus.size, block):
        mu = float(mus[0]) if single else mus[b:b + block, None]
        laws = _components(t, mu, q, relation, shift)
        parts = [_interval_masses(np.atleast_2d(u)) for u, _, _ in laws]
        # each row summed over the scales in a fixed order (a BLAS product's order depends on memory
        # alignment), so that a bound's masses are the same whichever other bounds are computed with it
        part = np.stack([np.stack([(row[:, None] * m).sum(axis=0) for m, _, _ in parts])
                         for row in weights[:, b:b + block]])
        sums = part if sums is None else sums + part
        first.append(np.stack([f for _, f, _ in parts]))
        last_sf.append(np.stack([g for _, _, g in parts]))
    arrays = (idx, sums, np.concatenate(first, axis=1), np.concatenate(last_sf, axis=1), weights.copy())
    for a in arrays[1:] if idx is None else arrays:
        a.setflags(write=False)   # the sums are cached and shared by both directions
    return MixtureSums(k_lo, k_hi, *arrays[:1], h, *arrays[1:], tuple(a for _, a, _ in laws),
                       tuple(c for _, _, c in laws))


def mixture_masses(mus: np.ndarray, weights: np.ndarray, q: float, relation: str, h: float,
                   uppers: tuple[bool, ...], k_lo: int, k_hi: int, idx: np.ndarray | None) -> list[StepMasses]:
    """Interval masses of ``weights``-mixtures of subsampled-Gaussian steps with shifts ``mus`` (all ``> 0``)
    on the grid of :func:`step_grid`, one per row of ``weights`` (shape ``(len(uppers), mus.size)``), for the
    bound ``uppers[r]`` (:func:`mixture_sums`, :meth:`MixtureSums.masses`)."""
    if relation != "add":
        return mixture_sums(mus, weights, q, relation, h, k_lo, k_hi, idx).masses(uppers)
    mirror = None if idx is None else -idx[::-1]
    return mixture_sums(mus, weights, q, "remove", h, -k_hi, -k_lo, mirror).swapped().masses(uppers)


def _bucket(k: int) -> int:
    """``k`` rounded away from zero to the next ``round(2^(j/4))`` (``|k| >= 1``; 0 stays 0)."""
    if k == 0:
        return 0
    m = abs(k)
    j = math.ceil(4 * math.log2(m) - 1e-9)
    b = round(2.0 ** (j / 4))
    while b < m:
        j += 1
        b = round(2.0 ** (j / 4))
    return b if k > 0 else -b


def sparse_points(k_lo: int, k_hi: int, max_points: int) -> np.ndarray:
    """About ``max_points`` grid indices in ``[k_lo, k_hi]``: every one within ``max_points / 4`` of zero
    loss (where a subsampled step's mass sits) and geometrically spaced ones beyond, on each side."""
    core = max_points // 4
    steps = np.arange(1, core + 1)
    # the pieces are built in ascending order, so duplicates (from rounding) are adjacent: dropping them
    # costs one pass, where np.unique's hash took 1 ms per call (5 s of a randomized-clipping calibration)
    pieces = [np.array([k_lo])]
    if -k_lo > core:
        pieces.append(-np.round(core * (-k_lo / core) ** (steps[::-1] / core)))
    pieces.append(np.arange(max(k_lo, -core), min(k_hi, core) + 1))
    if k_hi > core:
        pieces.append(np.round(core * (k_hi / core) ** (steps / core)))
    pieces.append(np.array([k_hi]))
    points = np.clip(np.concatenate(pieces), k_lo, k_hi).astype(np.int64)
    return points[np.r_[True, points[1:] != points[:-1]]]


def mix(parts: list[StepMasses]) -> StepMasses:
    """Sum of (already weighted) step masses on the dense grid."""
    lo = min(p.lo for p in parts)
    hi = max(p.lo + p.atoms.size for p in parts)
    out = StepMasses(lo, np.zeros(hi - lo - 1), np.zeros(hi - lo - 1), np.zeros(hi - lo), 0.0)
    for p in parts:
        a = p.lo - lo
        out.p_int[a:a + p.p_int.size] += p.p_int
        out.q_int[a:a + p.q_int.size] += p.q_int
        out.atoms[a:a + p.atoms.size] += p.atoms
        out.inf += p.inf
    return out


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


class _Factor:
    """One step PLD raised to the power ``n``, with the tilted moments the composition needs."""

    def __init__(self, pld: Pld, n: int) -> None:
        idx = np.nonzero(pld.pmf > 0)[0]
        self.n = n
        self.k = pld.start + idx
        self.t = self.k * pld.h
        self.logp = np.log(pld.pmf[idx])
        self._cache: dict[float, tuple[np.ndarray, float, float, float]] = {}

    def tilted(self, lam: float) -> tuple[np.ndarray, float, float, float]:
        """``(weights, log normalizer, mean, variance)`` of the law tilted by ``e^{lam t}`` (last 4 cached)."""
        if lam in self._cache:
            return self._cache[lam]
        if len(self._cache) >= 4:
            self._cache.pop(next(iter(self._cache)))
        self._cache[lam] = self._tilt(lam)
        return self._cache[lam]

    def _tilt(self, lam: float) -> tuple[np.ndarray, float, float, float]:
        logw = self.logp + lam * self.t
        log_norm = float(special.logsumexp(logw))
        w = np.exp(logw - log_norm)
        mean = float(w @ self.t)
        var = float(w @ (self.t - mean) ** 2)
        return w, log_norm, mean, var


def _cumulant_terms(parts: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], theta: float
                    ) -> tuple[float, float, float]:
    """``K(theta), K'(theta), K''(theta)`` of ``sum_f n_f log E exp(theta c)`` over ``parts`` of
    ``(n_f, log weights, values c, c^2)``; ``K`` is evaluated exactly (the Chernoff bounds rest on it),
    the derivatives only steer the search."""
    k0 = k1 = k2 = 0.0
    for n, logw, c, c2 in parts:
        x = theta * c
        x += logw
        top = float(x.max())
        x -= top
        np.exp(x, out=x)
        s0 = float(x.sum())
        m1, m2 = float(x @ c) / s0, float(x @ c2) / s0
        k0 += n * (math.log(s0) + top)
        k1 += n * m1
        k2 += n * max(m2 - m1 * m1, 0.0)
    return k0, k1, k2


def _chernoff(parts: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], var: float, sd: float,
              level: float | None = None, dist: float | None = None) -> tuple[float, float]:
    """The best Chernoff exponent over ``theta`` in ``[1e-4, 300] / sd``: ``(theta, K(theta))`` minimizing
    ``(K(theta) + level) / theta`` (the distance the mass ``e^-level`` lies beyond) or, with ``dist``,
    ``K(theta) - theta dist`` (the log of the mass beyond ``dist``).

    Both objectives are unimodal (``phi = theta K' - K - level``, resp. ``K' - dist``, increases), so a
    safeguarded Newton search on ``phi`` finds the optimum in a few evaluations.  Every evaluated ``theta``
    gives a valid bound; the best one evaluated is returned, so the search only affects tightness.
    """
    lo_b, hi_b = 1e-4 / sd, 300.0 / sd

    def evaluate(theta: float) -> tuple[float, float, float, float]:
        k0, k1, k2 = _cumulant_terms(parts, theta)
        if dist is None:
            return (k0 + level) / theta, theta * k1 - k0 - level, theta * k2, k0
        return k0 - theta * dist, k1 - dist, k2, k0

    guess = math.sqrt(2.0 * level / var) if dist is None else dist / var   # the Gaussian's optimum
    theta = min(max(guess, lo_b), hi_b)
    lo, hi = lo_b, hi_b
    best = (math.inf, theta, 0.0)
    for _ in range(40):
        g, phi, dphi, k0 = evaluate(theta)
        if g < best[0]:
            best = (g, theta, k0)
        if phi > 0:
            hi = theta
        else:
            lo = theta
        if (phi > 0 and theta <= lo_b) or (phi <= 0 and theta >= hi_b):
            break   # the optimum is at an end of the searched range
        nxt = theta - phi / dphi if dphi > 0 else (math.inf if phi <= 0 else 0.0)
        if not lo < nxt < hi:
            # past an end of the range not yet tried: try that end, else bisect the bracket
            nxt = hi_b if nxt >= hi == hi_b else lo_b if nxt <= lo == lo_b else math.sqrt(lo * hi)
        if abs(nxt - theta) <= 1e-3 * theta:
            break
        theta = nxt
    return best[1], best[2]


def _grid_tilt(parts: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], sd: float, level: float) -> float:
    """The starting tilt of :meth:`Composition.epsilon`: the best Chernoff tilt for the mass ``e^-level`` on
    a grid of 22 values, each twice the last, on ``[1e-4, 300] / sd``.

    Deliberately not the exact optimum: with heavy tails (randomized clipping) the tilted law's spread, and
    so the FFT window, grows fast with the tilt.  At sigma = 0.8, q = 1e-3, 50000 steps (Hutch, k = 32,
    d = 2048) the exact optimum, 1.32, needs a pass of 5.9M points; this grid's 0.96 needs 1.7M, and both
    passes resolve the answer.  The pass it gives is checked, and the tilt moved if needed.
    """
    thetas = np.geomspace(1e-4, 300.0, 22) / sd
    cum = np.array([_cumulant_terms(parts, float(theta))[0] for theta in thetas])
    return float(thetas[int(np.argmin((cum + level) / thetas))])


def _tilted_stats(factors: list[_Factor], lam: float) -> tuple[float, float]:
    mean = var = 0.0
    for f in factors:
        _, _, m, v = f.tilted(lam)
        mean += f.n * m
        var += f.n * v
    return mean, var


def _window(factors: list[_Factor], lam: float, tail: float, h: float, half_width: int = MAX_GRID,
            keep: dict | None = None) -> tuple[int, int, float, float]:
    """Grid-index window ``(lo, hi, mass above, mass below)`` of the tilted sum (Chernoff bounds).

    It holds all but ``tail`` on each side, unless that needs more than ``half_width`` points on a
    side of the mean (heavy tails, where Chernoff bounds are loose): the side is then cut there and the
    returned mass beyond it is the Chernoff bound at the cut.  ``keep`` receives the upper-tail
    cumulant values for reuse.
    """
    mean, var = _tilted_stats(factors, lam)
    sd = max(math.sqrt(var), h)
    var = sd * sd
    level = -math.log(tail)
    ends, masses = [], []
    for sign in (1.0, -1.0):
        parts = []
        for f in factors:
            _, log_norm, m, _ = f.tilted(lam)
            c = sign * (f.t - m)   # centred losses
            parts.append((f.n, f.logp + lam * f.t - log_norm, c, c * c))
        if keep is not None and sign > 0:
            keep.update(parts=parts, sd=sd, mean=mean)
        theta, k0 = _chernoff(parts, var, sd, level=level)
        dist = (k0 + level) / theta
        if dist <= half_width * h:
            ends.append(dist)
            masses.append(tail)
        else:
            dist = half_width * h
            ends.append(dist)
            theta, k0 = _chernoff(parts, var, sd, dist=dist)
            masses.append(math.exp(min(0.0, k0 - theta * dist)))
    k_max = sum(f.n * int(f.k[-1]) for f in factors)
    k_min = sum(f.n * int(f.k[0]) for f in factors)
    hi = math.ceil((mean + ends[0]) / h)
    lo = math.floor((mean - ends[1]) / h)
    return max(k_min, lo), min(k_max, hi), masses[0] if hi < k_max else 0.0, masses[1] if lo > k_min else 0.0


def _tilt_for_mean(factors: list[_Factor], target: float, lam0: float, direction: float) -> float | None:
    """The tilt whose tilted mean is ``target`` (searching away from ``lam0``), or None if out of reach.

    Newton steps on the mean (its derivative in the tilt is the tilted variance), kept inside the bracket
    found so far; growing steps until the target is passed, bisection where a step would leave the bracket.
    Returns a tilt whose mean has reached the target (to rounding).  Only a choice of tilt: every pass is
    checked by its caller.
    """
    lam = lo = lam0
    mean, var = _tilted_stats(factors, lam)
    hi = None
    step = 1e-3 / max(math.sqrt(var), 1e-12)
    for _ in range(300):
        if (mean - target) * direction >= 0:
            hi = lam
        else:
            lo = lam
        # a tilt is only a choice (each pass is checked), so the mean need not hit the target exactly
        if hi is not None and (abs(hi - lo) <= 1e-9 * max(1.0, abs(hi))
                               or abs(mean - target) <= 1e-6 * max(1.0, abs(target))):
            return hi
        nxt = lam + (target - mean) / var if var > 0 else math.nan
        if hi is None:
            if not (nxt - lo) * direction > 0:   # not a step toward the target: grow the last step
                nxt = lo + direction * step
            step = max(2.0 * step, abs(nxt - lo))
        elif not min(lo, hi) < nxt < max(lo, hi):
            nxt = 0.5 * (lo + hi)
        lam = nxt
        mean, var = _tilted_stats(factors, lam)
    return hi


def _tilted_product(factors: list[_Factor], lam: float, w_lo: int, w_hi: int, a: int, b: int, h: float,
                    extended: bool = False, trim: bool = False) -> tuple[int, np.ndarray, np.ndarray]:
    """``(first index, values, error bounds)`` at grid indices ``first..b`` of the composition, computed on
    the FFT window ``w_lo..w_hi`` under the tilt ``e^{lam t}`` and untilted; ``first = a``, or with ``trim``
    the first index whose value is not noise (error bound at most half the value; the error and the value
    scale alike when untilted, so this is read before untilting the rest).

    ``extended``: the FFTs and the power in ``np.longdouble`` (x86's 80-bit format: rounding error about
    2000 times smaller, at about 7 times the cost).  The FFT's error is absolute, a multiple of the whole
    tilted mass at every point, so where most of a step's mass sits on a few grid points (``q mu`` far below
    the grid step: the spectrum stays near modulus 1 and its power amplifies rounding by the step count)
    it swamps a small delta; extended precision shrinks it in proportion.  Each value also carries a
    relative error from rounding, charged too: at most ``n (4 + max |log w|) eps`` from ``n`` steps of
    float64 tilted weights ``w`` (a composition is a sum of products of ``n`` inputs, all ``>= 0``), and
    ``(4 + 2 (|log c| + |lam| max |t|)) eps`` from untilting by ``c e^{-lam t}`` (the rounding of the exponent's
    two terms, then of ``exp``).  Overflowing values and bounds are ``inf`` (or NaN where ``0 * inf``)."""
    nfft = sfft.next_fast_len(w_hi - w_lo + 1, real=True)
    dtype = np.longdouble if extended else np.float64
    eps = float(np.finfo(dtype).eps)
    xs, log_abs = [], []
    log_spec = np.zeros(nfft // 2 + 1)
    log_scale = 0.0
    offset = 0
    rel = 0.0   # relative error of each value from the inputs' rounding
    for f in factors:
        w, log_norm, _, _ = f.tilted(lam)
        x = sfft.rfft(np.bincount((f.k - f.k[0]) % nfft, weights=w, minlength=nfft).astype(dtype, copy=False))
        rel += f.n * (4.0 + float(np.max(np.abs(f.logp + lam * f.t - log_norm)))) * _F64_EPS
        with np.errstate(divide="ignore"):
            la = np.log(np.abs(x)).astype(np.float64)
        xs.append(x)
        log_abs.append(la)
        log_spec += f.n * la
        log_scale += f.n * log_norm
        offset += f.n * int(f.k[0])
    # the power is taken only where the product's modulus is representable (after many steps, few
    # frequencies); the others are left at 0 and their moduli are charged to the error below
    keep = log_spec > _LOG_TINY
    cdtype = np.clongdouble if extended else np.complex128
    spec = np.zeros(nfft // 2 + 1, dtype=cdtype)
    part = np.ones(int(keep.sum()), dtype=cdtype)
    for x, f in zip(xs, factors, strict=True):
        part *= x[keep] ** f.n
    spec[keep] = part
    dropped = float(spec.size - part.size) * math.exp(_LOG_TINY)   # each dropped modulus is below this
    # |d prod X_i^n_i| <= sum_i n_i |dX_i| |X_i|^(n_i - 1) prod_{j != i} |X_j|^n_j, |dX| <= _FFT_ERR log2 N
    sens = 0.0
    for i, f in enumerate(factors):
        log_term = (f.n - 1) * log_abs[i] if f.n > 1 else np.zeros(spec.size)
        for j, g in enumerate(factors):
            if j != i:
                log_term = log_term + g.n * log_abs[j]
        # exp underflows to exactly 0 below -746: only the other terms are summed (the same sum, faster)
        sens += f.n * float(np.exp(log_term[log_term > -746.0]).sum())
    circ = sfft.irfft(spec, nfft)
    scale = _FFT_ERR * (eps / _F64_EPS) * math.log2(nfft)
    peak = max(float(circ.max()), -float(circ.min()))
    err_t = scale * ((2.0 / nfft) * (sens + float(np.sum(np.abs(part)))) + peak)
    err_t += (2.0 / nfft) * dropped   # each output moves by at most 2/N times the dropped moduli
    if lam != 0.0:
        err_t += 2.0 * _TILT_TAIL  # tilted mass outside the window may alias onto any point
    start = (a - offset) % nfft   # indices a..b of the composition, a contiguous run of the circle
    run = circ[start:start + b - a + 1]
    if run.size < b - a + 1:
        run = np.concatenate([run, circ[:b - a + 1 - run.size]])
    rel += (4.0 + 2.0 * (abs(log_scale) + abs(lam) * max(abs(a), abs(b)) * h)) * _F64_EPS
    if trim:
        # far below a tilt's centre the values are noise, which the caller lumps: only the rest is untilted
        floor = err_t * (1.0 + rel) / (0.5 - rel)
        good = (run >= floor) | (run <= -floor)
        a += int(np.argmax(good)) if good.any() else run.size - 1
        run = run[a - b - 1:]
    run = run.astype(np.float64, copy=False)   # changed in place below: ``circ`` is not read again
    # the untilting factor, values and bounds computed in place: these runs hold millions of points, and a
    # fresh array costs about as much as the arithmetic on it
    fac = np.arange(a, b + 1, dtype=np.float64)
    fac *= -lam * h
    fac += log_scale
    err = np.abs(run)
    err += err_t
    err *= rel
    err += err_t
    with np.errstate(over="ignore", invalid="ignore"):
        np.exp(fac, out=fac)
        err *= fac
        run *= fac
    return a, run, err


class Composition:
    """The composition of ``n_i`` copies of each step PLD, evaluated on demand by tilted FFT products.

    :meth:`epsilon` and :meth:`delta` need only the upper tail near the answer: they run one tilted
    pass centred there (the Chernoff-optimal tilt), check that the answer lies in the accurately
    resolved region with an error contribution below ``_TILT_RTOL`` of delta, and otherwise move the
    tilt and try again.  Everything below that pass's window is lumped at its bottom (upper bound) or
    dropped (lower bound).  :meth:`full` resolves the whole range (for the trade-off curve).

    Parameters
    ----------
    events : list of (Pld, int)
        Step PLDs (all upper or all lower bounds, one grid) and their counts.
    tail : float
        Mass left outside the untilted window on each side (charged to ``inf`` / ``slack``).
    """

    def __init__(self, events: list[tuple[Pld, int]], tail: float) -> None:
        first = events[0][0]
        self.h, self.upper = first.h, first.upper
        self.single = first if (len(events) == 1 and events[0][1] == 1) else None
        self._full: Pld | None = None
        self._local: dict[tuple[float, bool], Pld] = {}
        if self.single is not None:
            return
        self.factors = [_Factor(p, n) for p, n in events]
        self.inf = 1.0 - math.prod((1.0 - p.inf) ** n for p, n in events)
        self._cumulants: dict = {}
        self.lo, self.hi, self.over, self.under = _window(self.factors, 0.0, tail, self.h, MAX_GRID // 2,
                                                          self._cumulants)
        self.slack = sum(p.slack * n for p, n in events)
        if max(self.over, self.under) > _MAX_CUT:
            raise GridTooLargeError(
                f"the composed privacy loss needs more than {MAX_GRID:,} grid points (that many leave a mass of "
                f"{max(self.over, self.under):.1e} outside); use a coarser discretization (now {self.h:g}), "
                f"e.g. discretization={10 * self.h:g}")

    def _pass(self, lam: float, extended: bool = False, trim: bool = False
              ) -> tuple[int, np.ndarray, np.ndarray] | None:
        """``(first index, values, error bounds)`` of one tilted pass, inside the untilted window (``trim``: from
        the first value that is not noise)."""
        w_lo, w_hi = (self.lo, self.hi) if lam == 0.0 else _window(self.factors, lam, _TILT_TAIL, self.h)[:2]
        a, b = max(self.lo, w_lo), min(self.hi, w_hi)
        if a > b or w_hi - w_lo + 1 > MAX_GRID:
            return None
        return _tilted_product(self.factors, lam, w_lo, w_hi, a, b, self.h, extended, trim)

    def _finish(self, start: int, value: np.ndarray, err: np.ndarray, lam: float) -> Pld:
        if self.upper:
            pmf = np.maximum(value, 0.0)
            pmf += err
            # mass below the pass moves up to its first point: at most what the pass does not hold
            pmf[0] += max(0.0, 1.0 - self.inf - float(np.maximum(value - err, 0.0).sum()))
            return Pld(self.h, start, pmf, min(1.0, self.inf + self.over), True, err=err)
        # the untilted pass's window can alias its cut mass anywhere; a tilted pass's aliasing is in err
        slack = self.slack + (self.under + self.over if lam == 0.0 else 0.0)
        pmf = np.maximum(value - err, 0.0)
        return Pld(self.h, start, pmf, self.inf, False, slack, err=err)

    def local(self, lam: float, extended: bool = False) -> Pld:
        """One pass under the tilt ``lam``, in extended precision if asked (cached)."""
        key = (lam, extended)
        if key not in self._local:
            res = self._pass(lam, extended, trim=True)
            if res is None:
                self._local[key] = self.full()
            else:
                start, val, err = res
                with np.errstate(invalid="ignore"):
                    # far below the tilt's centre the untilted values are noise: lump them instead
                    ok = np.nonzero(np.isfinite(val) & (err <= 0.5 * np.abs(val)))[0]
                first = int(ok[0]) if ok.size else val.size - 1
                self._local[key] = self._finish(start + first, val[first:], err[first:], lam)
        return self._local[key]

    def full(self) -> Pld:
        """Every point of the window, each from the tilt with the smallest error bound (cached)."""
        if self._full is not None:
            return self._full
        size = self.hi - self.lo + 1
        value = np.zeros(size)
        error = np.full(size, np.inf)
        t_out = np.arange(self.lo, self.hi + 1) * self.h

        def run(lam: float) -> None:
            res = self._pass(lam)
            if res is None:
                return
            a, val, err = res
            sl = slice(a - self.lo, a - self.lo + val.size)
            better = err < error[sl]
            value[sl] = np.where(better, val, value[sl])
            error[sl] = np.where(better, err, error[sl])

        run(0.0)
        # more tilts while the error bound of an upper tail sum P(L >= t) above _TILT_FLOOR exceeds
        # _TILT_RTOL of it: these sums are what delta(eps) reads
        lam = 0.0
        centre, var = _tilted_stats(self.factors, 0.0)
        for _ in range(_MAX_TILTS):
            with np.errstate(over="ignore"):
                err_tail = np.cumsum(error[::-1])[::-1]
            tail_mass = np.cumsum(np.abs(value)[::-1])[::-1]
            bad = (err_tail > _TILT_RTOL * tail_mass) & (tail_mass > _TILT_FLOOR) & (t_out > centre)
            if not bad.any():
                break
            # at least two tilted standard deviations per tilt, so the search ends after a few passes
            target = max(float(t_out[np.argmax(bad)]), centre + 2.0 * math.sqrt(var))
            nxt = _tilt_for_mean(self.factors, target, lam, 1.0)
            if nxt is None or nxt <= lam:
                break
            lam = nxt
            run(lam)
            new_centre, var = _tilted_stats(self.factors, lam)
            if new_centre <= centre:
                break
            centre = new_centre
        self._full = self._finish(self.lo, value, error, 0.0)
        return self._full

    def _good(self, pld: Pld, eps: float, delta: float) -> bool:
        """``eps`` lies above the lumped first point and the error bounds move delta(eps) by little."""
        if pld is self._full:
            return True
        if eps < pld.start * self.h:
            return False
        return self._error_above(pld, eps) <= _TILT_RTOL * max(delta, _TILT_FLOOR)

    def _error_above(self, pld: Pld, eps: float) -> float:
        """The pass's error bounds summed from ``eps`` up: how far they can move ``delta(eps)``."""
        j = max(0, math.floor(eps / self.h) - pld.start)
        return float(pld.err[j:].sum())

    def _rounding_bound(self, pld: Pld, eps: float, delta: float) -> bool:
        """The pass resolves ``eps`` but its rounding error moves ``delta`` by over ``_EXTEND_AT`` of it, and
        extended precision is available: worth the same pass in extended precision (about 7 times its
        cost).  Below that the float64 pass's answer is kept or the tilt moved, as before."""
        if not _EXTENDED or pld.err is None or eps < pld.start * self.h:
            return False
        return self._error_above(pld, eps) > _EXTEND_AT * max(delta, _TILT_FLOOR)

    def delta_bound(self, eps: float) -> float:
        r"""An upper bound on ``delta(eps)`` of the exact composition of these steps, without an FFT: the mass
        at ``+inf`` plus the Chernoff bound ``min_theta c(theta) E[e^{theta (L - eps)}]``, with
        ``c(theta) = theta^theta / (theta + 1)^(theta + 1)`` (``(1 - e^{eps - L})_+ <= c e^{theta (L - eps)}``)
        and the finite part's MGF at most its normalized one.  Lets a query skip a direction that cannot
        be the larger."""
        if self.single is not None:
            return self.single.delta(eps)
        c = self._cumulants
        dist = eps - c["mean"]
        if not (dist > 0 and math.isfinite(dist)):
            return 1.0
        theta = _chernoff(c["parts"], c["sd"] ** 2, c["sd"], dist=dist)[0]
        k0 = _cumulant_terms(c["parts"], theta)[0]     # K at the returned theta, whatever the search did
        if not math.isfinite(k0):
            return 1.0
        log_c = theta * math.log(theta) - (theta + 1.0) * math.log1p(theta)
        return min(1.0, self.inf + math.exp(min(0.0, k0 - theta * dist + log_c)))

    def epsilon(self, delta: float) -> float:
        if self.single is not None:
            return self.single.epsilon(delta)
        c = self._cumulants
        mean = c["mean"]
        # the tilt that minimises the Chernoff bound exp(K(theta) - theta u) at its delta quantile
        lam = _grid_tilt(c["parts"], c["sd"], -math.log(delta))
        extended = False
        tried = []   # every pass's answer is a valid bound, only not always a tight one
        for _ in range(5):
            pld = self.local(lam, extended)
            eps = pld.epsilon(delta)
            if eps == math.inf or self._good(pld, eps, delta):
                return eps
            tried.append(eps)
            if not extended and self._rounding_bound(pld, eps, delta):
                extended = True   # resolved, but rounding moves delta by over 1 %: the same pass, extended
                continue
            nxt = _tilt_for_mean(self.factors, eps, 0.0, 1.0) if eps > mean else 0.0
            if nxt is None or nxt == lam:
                break
            lam = nxt
        return self._tightest([self.full().epsilon(delta), *tried])

    def delta(self, eps: float) -> float:
        if self.single is not None:
            return self.single.delta(eps)
        lam = _tilt_for_mean(self.factors, eps, 0.0, 1.0) if eps > self._cumulants["mean"] else 0.0
        tried = []
        if lam is not None:
            for extended in (False, True) if _EXTENDED else (False,):
                pld = self.local(lam, extended)
                d = pld.delta(eps)
                if self._good(pld, eps, d):
                    return d
                tried.append(d)
                if not self._rounding_bound(pld, eps, d):
                    break
        return self._tightest([self.full().delta(eps), *tried])

    def _tightest(self, values: list[float]) -> float:
        """The tightest of several valid bounds (the smallest upper, the largest lower)."""
        return min(values) if self.upper else max(values)

    def tradeoff(self, alpha: np.ndarray) -> np.ndarray:
        return (self.single if self.single is not None else self.full()).tradeoff(alpha)

    @property
    def inf_mass(self) -> float:
        return self.single.inf if self.single is not None else min(1.0, self.inf + self.over)

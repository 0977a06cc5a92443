r"""The privacy-loss distributions of the subsampled-Gaussian pairs, as interval masses on a loss grid.

One step of DP-SGD in one neighbouring direction is a pair ``(P, Q)`` of (mixtures of) normal laws: "remove"
(``P = q N(mu, 1) + (1-q) N(0, 1)``, ``Q = N(0, 1)``), "add" (the swap) or "replace".  :func:`pair_cdfs` gives
the CDFs of its privacy loss ``L = log(dP/dQ)`` under both laws; :func:`step_grid` chooses the grid indices on
which a step is resolved; :func:`mixture_masses` gives the exact masses ``P_k, Q_k`` of ``L`` in each grid
interval ``(t_k, t_{k+1}]`` (:class:`StepMasses`), for a mixture over scales ``mu`` too (randomized
clipping), each normal law's part from the tail it lies in.  :mod:`dpmath.pld.discretize` places these masses on
grid points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import special

from .distribution import MAX_GRID, GridTooLargeError, grid_advice

__all__ = ["loss_range", "pair_cdfs", "StepMasses", "step_grid", "interval_masses", "MixtureSums", "mixture_sums",
           "mixture_masses", "sparse_points", "band_start", "mix"]


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
    still a lower bound, only less tight), with a band over the example's own losses where
    :func:`band_start` puts them far out.  ``shared``: a dense range's ends are rounded outward too, so
    that the scales of a mixture whose ranges are close share one dense grid as well.

    Examples
    --------
    >>> step_grid(1.0, 0.01, "remove", 1e-3, 9.0)
    (-11, 4903, None)
    >>> step_grid(40.0, 0.01, "remove", 1e-3, 4.0, max_points=5000, shared=True)
    (-11, 1048576, 8192)
    """
    with np.errstate(over="ignore", invalid="ignore"):
        t_lo, t_hi = loss_range(mu, q, relation, z)
    if not (math.isfinite(t_lo) and math.isfinite(t_hi)):   # a shift near 1e154 or more: mu^2 overflows
        raise GridTooLargeError(f"one step's privacy loss passes the largest float (shift mu = {mu:.3g} noise "
                                f"standard deviations); " + grid_advice(h, math.inf, math.inf, one_step=True))
    t_lo = max(t_lo, t_floor)
    t_hi = min(t_hi, max(t_cap, t_lo + h))
    k_lo = math.floor(t_lo / h)
    k_hi = max(math.ceil(t_hi / h), k_lo + 1)
    if k_hi - k_lo + 1 > MAX_GRID:
        raise GridTooLargeError(
            f"one step's privacy loss spans {k_hi - k_lo + 1:,} grid points (limit {MAX_GRID:,}); "
            + grid_advice(h, h * 2 * (k_hi - k_lo) / MAX_GRID, max(t_hi, -t_lo), one_step=True))
    if k_hi - k_lo + 1 <= max_points:
        return (-_bucket(-k_lo), _bucket(k_hi), None) if shared else (k_lo, k_hi, None)
    # round the sparse grid's ends outward and its size up to one of a few buckets: the scales of a
    # randomized-clipping step that land in one bucket share the grid, so they are computed as one array,
    # mixed and split once (a wider range and more points only make the bounds tighter)
    return -_bucket(-k_lo), _bucket(k_hi), 1 << (max_points - 1).bit_length()


def band_start(mu: float, q: float, h: float, z: float) -> float:
    """The grid index (a float) from which a removing step with shift ``mu > 0`` puts the example's own outputs
    ``x >= mu - z`` (all of its component but the ``z``-tail below): where it lies beyond twice a sparse grid's
    points, :func:`sparse_points` resolves the losses above it on a band of evenly spaced points.

    Examples
    --------
    >>> round(band_start(40.0, 0.01, 1e-3, 4.0))
    635395
    """
    with np.errstate(over="ignore"):
        return float(_mix_loss(np.array(mu - z), mu, q)) / h


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


def interval_masses(u: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
    it lies in (:func:`interval_masses`), so every mass keeps relative accuracy.  Every row and both
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
        parts = [interval_masses(np.atleast_2d(u)) for u, _, _ in laws]
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


def sparse_points(k_lo: int, k_hi: int, max_points: int, band: int | None = None) -> np.ndarray:
    """About ``max_points`` grid indices in ``[k_lo, k_hi]``: every one within ``max_points / 4`` of zero
    loss (where a subsampled step's mass sits) and geometrically spaced ones beyond, on each side.

    With ``band`` (``max_points / 2 < band < k_hi``), the indices from ``band`` to ``k_hi`` are instead
    ``max_points / 4`` evenly spaced ones, and only ``max_points / 16`` geometric ones lead up to it: a removing
    step with a large shift ``mu`` puts the example's mass (about ``q``) on losses ``mu^2/2 +- z mu``, where the
    geometric spacing, about ``log(k_hi / core) / core`` of the loss, rounded them by 0.5 % (``mu`` 73 at
    ``h = 6.4e-3``), which set a randomized-clipping bracket at epsilon 2,600 however fine the scale grid; evenly
    spaced, the band rounds them by under ``8 z / (mu max_points)`` of themselves, about 1e-4.

    Examples
    --------
    >>> sparse_points(-2, 100, 16).tolist()
    [-2, -1, 0, 1, 2, 3, 4, 9, 20, 45, 100]
    >>> sparse_points(-2, 100, 16, band=60).tolist()
    [-2, -1, 0, 1, 2, 3, 4, 60, 70, 80, 90, 100]
    """
    core = max_points // 4
    steps = np.arange(1, core + 1)
    # the pieces are built in ascending order, so duplicates (from rounding) are adjacent: dropping them
    # costs one pass, where np.unique's hash took 1 ms per call (5 s of a randomized-clipping calibration)
    pieces = [np.array([k_lo])]
    if -k_lo > core:
        pieces.append(-np.round(core * (-k_lo / core) ** (steps[::-1] / core)))
    pieces.append(np.arange(max(k_lo, -core), min(k_hi, core) + 1))
    if band is not None:
        lead = steps[:max(core // 4, 1)]
        pieces.append(np.round(core * (band / core) ** (lead / lead.size)))   # ends at band, where the band starts
        pieces.append(np.round(np.linspace(band, k_hi, core + 1)))
    elif k_hi > core:
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

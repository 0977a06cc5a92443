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
* **lower** (optimistic): merging all outputs in an interval is post-processing, and so is splitting
  an atom and merging its pieces.  Each interval's atom sends a fraction ``r_k <= 1/2`` right and the
  rest left, with ``r_k`` small enough that the merged atom at every grid point has loss ``>= t_j``;
  its loss is then rounded *down* to ``t_j``.  Mass below the grid is dropped.

Composition uses the FFT.  A self-composition keeps a window chosen by a Chernoff bound; mass that
can wrap around from above the window is charged to ``inf`` (upper) and mass that can wrap from
below is subtracted from delta (``slack``, lower), so the circular convolution never turns an upper
bound into a guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import fft as sfft
from scipy import signal, special

MAX_GRID = 1 << 25  # ~34M points: 270 MB per float64 array, the most one composition may use


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


def pair_cdfs(t: np.ndarray, mu: float, q: float, relation: str) -> tuple[np.ndarray, ...]:
    """``P(L <= t), P(L > t), Q(L <= t), Q(L > t)`` for the subsampled-Gaussian pair.

    ``relation`` is "remove" (``P = q N(mu) + (1-q) N(0)``, ``Q = N(0)``), "add" (the swap) or "replace"
    (``P = q N(-mu) + (1-q) N(0)``, ``Q = q N(mu) + (1-q) N(0)``, ``q < 1``).  ``q = 1`` is the
    Gaussian mechanism.
    """
    if relation == "remove":
        x = _shift(t, q) / mu + 0.5 * mu
        pa, pa_c = _ndtr_pair(x - mu)
        pb, pb_c = _ndtr_pair(x)
        return q * pa + (1 - q) * pb, q * pa_c + (1 - q) * pb_c, pb, pb_c
    if relation == "add":
        x = _shift(-t, q) / mu + 0.5 * mu  # L <= t  iff  X >= x
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

    ``p_int[i], q_int[i]`` are ``P, Q(L in (t_{lo+i}, t_{lo+i+1}])``; ``atoms`` are masses already on
    grid points with ``excess`` ``E_P[(1 - e^{t_j - L}); atom] >= 0`` (their loss is at least ``t_j``);
    ``inf`` is mass at ``+inf``.  Adding two of them is mixing the pairs (with the label revealed).
    """

    lo: int
    p_int: np.ndarray
    q_int: np.ndarray
    atoms: np.ndarray
    excess: np.ndarray
    inf: float

    def scaled(self, w: float) -> StepMasses:
        return StepMasses(self.lo, w * self.p_int, w * self.q_int, w * self.atoms, w * self.excess, w * self.inf)


def step_masses(mu: float, q: float, relation: str, h: float, upper: bool, z: float) -> StepMasses:
    """One subsampled-Gaussian step, resolved on ``z`` standard deviations of the output under ``P``.

    Mass beyond the resolved range is still accounted for: below it, at the first grid point (upper
    bound) or dropped (lower bound); above it, split between the last grid point and ``+inf`` with both
    masses preserved (upper) or rounded down to the last grid point (lower).
    """
    if mu == 0.0:
        return StepMasses(0, np.zeros(0), np.zeros(0), np.ones(1), np.zeros(1), 0.0)
    t_lo, t_hi = loss_range(mu, q, relation, z)
    k_lo = math.floor(t_lo / h)
    k_hi = max(math.ceil(t_hi / h), k_lo + 1)
    t = np.arange(k_lo, k_hi + 1) * h
    p_cdf, p_sf, q_cdf, q_sf = pair_cdfs(t, mu, q, relation)
    # interval masses from whichever side of the distribution is small, so tails keep relative accuracy
    p_int = np.maximum(np.where(p_cdf[1:] <= 0.5, p_cdf[1:] - p_cdf[:-1], p_sf[:-1] - p_sf[1:]), 0.0)
    q_int = np.maximum(np.where(q_cdf[1:] <= 0.5, q_cdf[1:] - q_cdf[:-1], q_sf[:-1] - q_sf[1:]), 0.0)
    atoms = np.zeros(t.size)
    excess = np.zeros(t.size)
    p_above = float(p_sf[-1])
    eq_top = math.exp(t[-1] + math.log(q_sf[-1])) if q_sf[-1] > 0 else 0.0
    inf = 0.0
    if upper:
        atoms[0] = p_cdf[0]
        atoms[-1] = min(p_above, eq_top)
        inf = p_above - atoms[-1]
    else:
        atoms[-1] = p_above
        excess[-1] = max(p_above - eq_top, 0.0)
    return StepMasses(k_lo, p_int, q_int, atoms, excess, inf)


def mix(parts: list[StepMasses]) -> StepMasses:
    """Sum of (already weighted) step masses on a common grid."""
    lo = min(p.lo for p in parts)
    hi = max(p.lo + p.atoms.size for p in parts)
    out = StepMasses(lo, np.zeros(hi - lo - 1), np.zeros(hi - lo - 1), np.zeros(hi - lo), np.zeros(hi - lo), 0.0)
    for p in parts:
        a = p.lo - lo
        out.p_int[a:a + p.p_int.size] += p.p_int
        out.q_int[a:a + p.q_int.size] += p.q_int
        out.atoms[a:a + p.atoms.size] += p.atoms
        out.excess[a:a + p.excess.size] += p.excess
        out.inf += p.inf
    return out


def split(m: StepMasses, h: float, upper: bool) -> Pld:
    """Place every interval's mass on its two end points: connect-the-dots (upper) or the greedy
    post-processing split (lower); see the module docstring."""
    t = (m.lo + np.arange(m.atoms.size)) * h
    p_int, q_int = m.p_int, m.q_int
    with np.errstate(divide="ignore", over="ignore"):
        log_q = np.log(q_int)
        left = np.clip(p_int - np.exp(t[:-1] + log_q), 0.0, p_int)      # excess at the left end, >= 0
    pmf = m.atoms.copy()
    if upper:
        right = np.minimum(left / -math.expm1(-h), p_int)
        pmf[:-1] += p_int - right
        pmf[1:] += right
        return Pld(h, m.lo, pmf, min(m.inf, 1.0), True)
    with np.errstate(over="ignore"):
        deficit = (-np.minimum(p_int - np.exp(t[1:] + log_q), 0.0)).tolist()  # -(excess at the right end)
    frac = _greedy_fractions(left.tolist(), deficit, m.excess.tolist())
    pmf[:-1] += (1.0 - frac) * p_int
    pmf[1:] += frac * p_int
    return Pld(h, m.lo, pmf, 0.0, False)


def _greedy_fractions(left: list[float], deficit: list[float], extra: list[float]) -> np.ndarray:
    """Fractions ``r_k`` of interval ``k`` sent to its right end, as large as possible from the bottom up,
    such that every grid point's merged atom keeps a non-negative excess (loss ``>= t_j``).

    Label ``j`` receives ``r_{j-1}`` of interval ``j-1`` (excess ``-r_{j-1} deficit_{j-1} <= 0``),
    ``1 - r_j`` of interval ``j`` (excess ``(1 - r_j) left_j >= 0``) and its own atoms (``extra_j``).
    Where the incoming deficit cannot be covered, ``r_{j-1}`` is lowered until it can.
    """
    n = len(left)
    r = [0.0] * n
    owed = 0.0
    for k in range(n):
        avail = left[k] + extra[k]
        if owed > avail:
            r[k - 1] = avail / deficit[k - 1]
            owed = avail
        rk = 1.0 if left[k] <= 0.0 else min(1.0, (avail - owed) / left[k])
        r[k] = rk
        owed = rk * deficit[k]
    if n and owed > extra[n]:
        r[n - 1] = extra[n] / deficit[n - 1]
    return np.asarray(r)


@dataclass
class Pld:
    """A discrete PLD: masses ``pmf`` at losses ``(start + j) h``, ``inf`` at ``+inf``.

    ``upper`` says which bound it is; ``slack`` (lower bounds only) is mass that FFT wrap-around may
    have placed too high, subtracted from every delta.
    """

    h: float
    start: int
    pmf: np.ndarray
    inf: float
    upper: bool
    slack: float = 0.0

    @classmethod
    def identity(cls, h: float, upper: bool) -> Pld:
        return cls(h, 0, np.ones(1), 0.0, upper)

    # ----------------------------------------------------------------------------- composition
    def _chernoff_window(self, n: int, tail: float) -> tuple[int, int, float, float]:
        """Index window ``[lo, hi]`` of the ``n``-fold sum holding all but ``tail`` mass on each side."""
        p = self.pmf
        idx = np.nonzero(p > 0)[0]
        k_min, k_max = self.start + int(idx[0]), self.start + int(idx[-1])
        if n * (k_max - k_min) + 1 <= 4096:
            return n * k_min, n * k_max, 0.0, 0.0
        logp = np.log(p[idx])
        t = (self.start + idx) * self.h
        mass = float(np.exp(logp).sum())
        mean = float(np.exp(logp) @ t) / mass
        sd = math.sqrt(max(float(np.exp(logp) @ (t - mean) ** 2) / mass, self.h * self.h))
        lams = np.geomspace(1e-4, 1e3, 64) / (sd * math.sqrt(n))
        log_tail = math.log(tail)
        bounds = []
        for sign in (1.0, -1.0):
            lm = np.array([special.logsumexp(logp + sign * lam * (t - mean)) for lam in lams])
            # P(sign (S - n mean) >= u) <= exp(n log M(lam) - lam u)
            u = (n * lm - log_tail) / lams
            best = int(np.argmin(u))
            bounds.append(float(u[best]))
        hi = min(n * k_max, math.ceil((n * mean + bounds[0]) / self.h))
        lo = max(n * k_min, math.floor((n * mean - bounds[1]) / self.h))
        over = tail if hi < n * k_max else 0.0
        under = tail if lo > n * k_min else 0.0
        return lo, hi, over, under

    def self_compose(self, n: int, tail: float) -> Pld:
        """The ``n``-fold composition, by one FFT power on a Chernoff window."""
        if n == 1:
            return self
        lo, hi, over, under = self._chernoff_window(n, tail)
        size = hi - lo + 1
        if size > MAX_GRID:
            raise ValueError(
                f"the composed privacy loss spans {size:,} grid points (limit {MAX_GRID:,}); use a coarser "
                f"discretization (now {self.h:g}), e.g. discretization={self.h * 2 * size / MAX_GRID:.2g}")
        nfft = sfft.next_fast_len(size, real=True)
        base = np.bincount(np.arange(self.pmf.size) % nfft, weights=self.pmf, minlength=nfft)
        spec = sfft.rfft(base) ** n
        circ = sfft.irfft(spec, nfft)
        # absolute index a sits at circular position (a - n start) mod nfft
        pos = (np.arange(lo, hi + 1) - n * self.start) % nfft
        out = np.maximum(circ[pos], 0.0)
        inf = -math.expm1(n * math.log1p(-self.inf)) if self.inf < 1 else 1.0
        if self.upper:
            return Pld(self.h, lo, out, min(1.0, inf + over), True)
        return Pld(self.h, lo, out, inf, False, self.slack * n + under)

    def convolve(self, other: Pld, tail: float) -> Pld:
        """Composition with another PLD on the same grid; tails beyond ``tail`` mass are cut soundly."""
        out = np.maximum(signal.fftconvolve(self.pmf, other.pmf), 0.0) if min(self.pmf.size, other.pmf.size) > 64 \
            else np.convolve(self.pmf, other.pmf)
        inf = 1.0 - (1.0 - self.inf) * (1.0 - other.inf)
        res = Pld(self.h, self.start + other.start, out, inf, self.upper, self.slack + other.slack)
        return res.truncate(tail)

    def truncate(self, tail: float) -> Pld:
        """Drop the outer ``tail`` mass on each side: up to ``inf`` or down to the edge (upper), the
        other way round (lower)."""
        p = self.pmf
        from_top = np.cumsum(p[::-1])[::-1]
        from_bottom = np.cumsum(p)
        keep_hi = int(np.nonzero(from_top > tail)[0][-1]) if (from_top > tail).any() else p.size - 1
        keep_lo = int(np.nonzero(from_bottom > tail)[0][0]) if (from_bottom > tail).any() else 0
        keep_lo = min(keep_lo, keep_hi)
        cut_hi = float(from_top[keep_hi + 1]) if keep_hi + 1 < p.size else 0.0
        cut_lo = float(from_bottom[keep_lo - 1]) if keep_lo > 0 else 0.0
        new = p[keep_lo:keep_hi + 1].copy()
        inf = self.inf
        if self.upper:
            new[0] += cut_lo
            inf = min(1.0, inf + cut_hi)
        else:
            new[-1] += cut_hi
        return Pld(self.h, self.start + keep_lo, new, inf, self.upper, self.slack)

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
        t, dj, r = self._curves()
        j = math.floor(round(eps / self.h, 9)) - self.start
        if j >= self.pmf.size - 1:
            return float(max(self.inf - self.slack, 0.0))
        if j < 0:
            total = float(self.pmf.sum())
            val = self.inf + total - math.exp(eps - t[0]) * (self.pmf[0] + r[0]) - self.slack
        else:
            val = dj[j] - r[j] * math.expm1(eps - t[j])
        return float(min(max(val, 0.0), 1.0))

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

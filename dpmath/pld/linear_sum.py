r"""An epoch of random allocation bounded in the convex order: its likelihood ratio on linear grids, error second order.

Random allocation's pair (:mod:`dpmath.pld.allocation`) has the likelihood ratio ``S-bar = S / t``, the mean of
``t`` i.i.d. lognormals ``W ~ LN(-mu^2/2, mu^2)`` under ``Q``, and both of its hockey-stick curves are expectations
under ``Q`` of convex functions of it:

.. math::

    \delta_{\mathrm{remove}}(\varepsilon) = E_Q\,(\bar S - e^\varepsilon)_+, \qquad
    \delta_{\mathrm{add}}(\varepsilon) = E_Q\,(1 - e^\varepsilon \bar S)_+ .

So a law ``U`` of ``S`` that dominates the true one in the **convex order** (``E f(U) >= E f(S)`` for every convex
``f``: a mean-preserving spread; by Blackwell's theorem, a more informative experiment) gives upper curves in both
directions, and one it dominates (a contraction: a garbling) lower ones.  As PLDs (removing: the losses ``log s-bar``
weighted ``s-bar U(ds)``; adding: ``-log s-bar`` under ``U``) they compose over epochs too: each coordinate of
``(prod s_i - e^eps)_+`` and of ``(1 - e^eps prod s_i)_+`` is convex and monotone.  A spread or a contraction by a
step ``D`` moves ``E f`` by ``O(D^2)`` (the variance it adds or removes) where a rounding up or down (first-order
stochastic dominance: :mod:`dpmath.pld.allocation`'s bands) moves it by ``O(D)``: the bands' relative rounding of
``2^-18`` per doubling left 1.8 % of epsilon at ``(sigma 2, 10^5 steps, delta 1e-5)``, where this path's ``delta``
bracket is ``3e-5`` wide and the accountant's epsilon bracket 0.16 % (its loss grid's).  Mass added anywhere, and
moves up (removing, where the curve's ``f`` increases) or down (adding), only raise an upper curve, so the FFTs'
error bounds and the rounding of the cells' means are put that way: one upper and one lower law per direction.

**A term's body and its large values.**  A lognormal's tail would stretch one grid over decades (at ``sigma = 0.8``
the cap, the ``1 - 1e-19`` quantile, is 35,000 times the mean), so a term is cut at ``b``, the least value at which
three or more of the ``t`` terms exceed it with probability at most :data:`_THREE`: the sum is the mixture of ``t``
bodies (terms at most ``b``), ``t`` ways of ``t - 1`` bodies and one large term (in ``(b, cap]``), and ``C(t, 2)``
ways of ``t - 2`` bodies and two, each on its own grid; three large terms and a term above the cap are charged to
``+inf`` (removing: their ``P``-mass, the allocated term's law size-biased).  At ``sigma = 0.8`` and ``10^5``
steps ``b`` is 1,808 (a 20 times finer grid for the body).

**Upper law.**  A term's body is put on the grid ``j D`` by splitting each cell's mass between the cell's two ends in
proportion to its mean (its partial expectation, the size-biased lognormal's CDF).  Sums of laws on one grid are on
that grid, exactly (an FFT); where a sum outgrows :data:`POINTS`, the
grid is coarsened by splitting each odd point's mass half to each neighbour: again a spread.  Bodies are summed by
doubling along the binary digits of ``t``, ``t - 1`` and ``t - 2`` (the doublings shared), then the large terms are
added, on the sum's grid.  Each FFT's error is bounded pointwise by ``gamma (|a|_1 |b|_2 + |a|_2 |b|_1)``
(:func:`fft_bound`: ``gamma = FFT_ERR log2 N`` the relative 2-norm error of a computed FFT, the product's and the
inverse's errors in 2-norm, which bounds every point) and added to every point; the sums are computed under
exponential tilts ``e^{theta S}`` too (a tilt commutes with convolution and, point by point, with the split), and a
point's bound is the least of the tilts' (an untilted bound is ``1e-16`` of the mass at every point, which would
swamp ``delta`` in a tail).  Where the body's end is more than :data:`_LIGHT` deviations of ``S`` from its mean the
FFTs are in extended precision (x86's 80-bit long double: about ``1e-19``), the lower law's too: at ``(sigma 1, 100
steps, 3 epochs, delta 1e-6)`` float64's bounds left 0.096 %, extended ones 0.026 %.  Each sum is restricted to a
window outside which a Chernoff bound on its untrimmed law (moment generating functions on a grid of ``lambda``, a
split's factor ``cosh(lambda D)``) leaves at most :data:`CUT` a side, charged (removing: times the largest ``S-bar``
of the untrimmed sum).

**Lower law.**  The true law is contracted: each cell keeps its mass and its mean (first moment), so a sum's cell
holds the conditional mean of the atoms whose indices add up to it (a conditional expectation: dominated in the
convex order), a mean past the cell's end moves one cell up and merges there, and coarsening merges pairs of cells.
The FFTs' errors lower the masses and move the means toward the side that lowers the curve (down removing, up
adding); a bound subtracted from every point empties a sum's tail below it, which later sums would have carried into
the read tail (at ``(sigma 0.75, 10^4 steps)`` float64's left a lower end of 0.0996 where the bands give 0.1007;
extended precision: 0.10078).  A lower law may drop mass: at most :data:`_LOWER_TAIL` a side of each sum.

**Where it is used** (:func:`linear_suits`, decided once for both directions and every loss grid): where the cap
holds all but :data:`_CAP_P` of the allocated term's mass, the body's grid of :data:`POINTS` has a step of at most
:data:`_RESOLUTION` of a term's deviation, and the body's end is within :data:`_HEAVY` (float64: :data:`_LIGHT`)
deviations of ``S``, in epochs of at least 1,000 steps: with extended precision, sigma 0.75 at 1,000 to 10^4 steps,
0.8 at 1,000 to 10^5, 1 and above from 1,000 (shorter epochs stay on the bands: as tight, and cheaper).
Elsewhere the octave bands, whose steps are relative (sigma 0.6 to 0.7 took 40 s and 2 GB here,
on finer grids).  The tests
check it against a two-step epoch's quadrature and against the bands; :mod:`verify.allocation` against a Monte Carlo
``delta``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import fft as sfft
from scipy import special

from .compose import EXTENDED, FFT_ERR, fft_plan

__all__ = ["POINTS", "CUT", "fft_bound", "LinearLaw", "linear_law", "linear_suits"]

#: grid points of a term's body and of every sum (at most)
POINTS = 1 << 16
#: Chernoff bound on a sum's mass left outside its window, each side (charged)
CUT = 1e-40
_CAP_Z = 9.0             # a term is truncated at its lognormal's 1 - 1e-19 quantile (at most t 1e-19 charged)
_LOWER_TAIL = 1e-30      # a lower law drops at most this from each side of a sum (a lower bound may drop mass)
_TILTS = (0.0, 3.0, 6.0, 10.0, 15.0)   # tilts of the upper sums, in standard deviations of S (Gaussian saddle)
_MAX_TILT = 600.0        # ... each at most this over a term's range (e^600: within float64)
_U = float(np.finfo(np.float64).eps) / 2
_RESOLUTION = 0.02       # where this path is used (linear_suits): a term's step at most this of its deviation, ...
_LIGHT = 5.0             # ... its body's end at most this many deviations of S (FFTs in float64), ...
_HEAVY = 30.0            # ... or this many, the FFTs in extended precision
_MIN_STEPS = 1000         # epochs shorter than this stay on the octave bands unless float64 serves (_LIGHT): the
                          # test suite's random allocation ran at twice its time with them here
_CAP_P = 1e-12           # the allocated term above the cap (its P-mass, charged) at most this where the path is used
_THREE = 1e-18           # three or more large terms (above a term's body) are charged: at most this
_MARGIN = 1e-12          # relative margin on products of exponentials (arguments at most a few hundred: 1e-13)


@dataclass(frozen=True)
class LinearLaw:
    """One direction's bounds on the law of ``S`` (``relation`` ``"remove"`` or ``"add"``): the upper law's points
    ``upper_values`` with masses ``upper_mass`` (pointwise upper bounds) and the mass ``upper_inf`` charged to an
    infinite loss, read under ``P`` (removing: ``s-bar`` times the ``Q``-mass) or ``Q`` (adding); the lower law's
    atoms ``lower_values`` with ``Q``-masses ``lower_mass``."""

    relation: str
    steps: int
    upper_values: np.ndarray
    upper_mass: np.ndarray
    upper_inf: float
    lower_values: np.ndarray
    lower_mass: np.ndarray
    slack: float = 0.0   # the lower law's masses are lower bounds already (no wrap-around to take off)

    def read(self, upper: bool) -> tuple[np.ndarray, np.ndarray, float]:
        """``(S, masses, mass at +inf)`` of the upper or lower law, under ``P`` removing and ``Q`` adding."""
        s, m = (self.upper_values, self.upper_mass) if upper else (self.lower_values, self.lower_mass)
        if self.relation == "remove":
            m = m * (s / self.steps) * (1.0 + _MARGIN if upper else 1.0 - _MARGIN)
        return s, m, self.upper_inf if upper else 0.0


def _cells(mu: float, edges: np.ndarray, size_biased: bool) -> tuple[np.ndarray, np.ndarray]:
    """Masses of the cells ``(edges[i], edges[i + 1]]`` of ``LN(-mu^2/2, mu^2)`` (or, ``size_biased``, of
    ``LN(mu^2/2, mu^2)``: the partial expectations ``E[W; cell]``) and a bound on each one's rounding.  Differences of
    the CDF below the median, of the survival function above it."""
    c = 0.5 * mu * mu * (1.0 if size_biased else -1.0)
    with np.errstate(divide="ignore"):
        z = (np.log(edges) - c) / mu
    lo, hi = z[:-1], z[1:]
    below = hi <= 0
    a = np.where(below, special.ndtr(hi), special.ndtr(-lo))
    b = np.where(below, special.ndtr(lo), special.ndtr(-hi))
    # each value within a few ulp (ndtr), the arguments' rounding (|z| ulp, times the density): 64 u of the larger
    err = 64.0 * _U * (a + b) * (1.0 + np.abs(np.where(np.isfinite(lo), lo, 0.0)) + np.abs(hi))
    return np.maximum(a - b, 0.0), err


def _term(mu: float, step: float, first: int, lo: float, hi: float
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A term restricted to ``(lo, hi]`` on the cells ``(j step, (j + 1) step]`` from ``j = first`` (``lo`` in the
    first cell, ``hi`` in the last): masses and their rounding bound, first moments ``E[(W - j step) / step; cell]``
    (in ``[0, mass]``) and their bound."""
    n = max(1, math.ceil(hi / step) - first)
    j = first + np.arange(n, dtype=float)
    edges = np.clip(np.append(j, first + n) * step, lo, hi)
    m, em = _cells(mu, edges, False)
    pe, epe = _cells(mu, edges, True)
    o = pe / step - j * m
    eo = epe / step + j * em + 4.0 * _U * (pe / step + j * m)
    return m, em, o, eo


def fft_bound(nfft: int, a1: float, a2: float, b1: float, b2: float, u: float = _U) -> float:
    """A bound on every point's error of ``a * b`` computed by FFTs of ``nfft`` points, from the factors' 1- and
    2-norms: ``gamma (|a|_1 |b|_2 + |a|_2 |b|_1)`` (each transform's 2-norm error at most ``gamma`` of it,
    ``|A|_inf <= |a|_1``, Parseval), the product's rounding and the second-order term."""
    g = FFT_ERR * (u / _U) * math.log2(nfft)
    return (g + 4.0 * u) * (a1 * b2 + a2 * b1) * (1.0 + 1e-6) + g * g * math.sqrt(nfft) * a2 * b2


def _norms(a: np.ndarray) -> tuple[float, float]:
    return float(np.abs(a).sum()), float(math.sqrt(float(a @ a)))


@dataclass
class _Tilted:
    """An upper sum under the tilt ``theta``: the mass at ``(start + j) step`` is ``m[j] exp(log_z - theta x)``."""

    m: np.ndarray
    start: int
    step: float
    log_z: float


def _normalized(m: np.ndarray, start: int, step: float, log_z: float) -> _Tilted:
    s = float(m.max())
    if not s > 0:
        return _Tilted(m, start, step, log_z)
    return _Tilted(m / s, start, step, log_z + math.log(s))


def _tilt_add(x: _Tilted, y: _Tilted, extended: bool) -> _Tilted:
    """``X + Y`` (one step), the FFT in extended precision if ``extended`` (its rounding, about ``1e-19`` of the
    norms, is the upper law's extra mass at every point; in float64 it swamped ``delta`` in heavy tails)."""
    n = x.m.size + y.m.size - 1
    nfft = 1 << (n - 1).bit_length()
    dtype = np.longdouble if extended else np.float64
    fft_plan(nfft, dtype)
    fx = sfft.rfft(x.m.astype(dtype), nfft)
    fy = fx if y is x else sfft.rfft(y.m.astype(dtype), nfft)
    z = sfft.irfft(fx * fy, nfft)[:n]
    u = float(np.finfo(dtype).eps) / 2
    e = fft_bound(nfft, *_norms(x.m), *_norms(y.m), u) + 2.0 * u * float(np.abs(z).max())
    # the float64 result rounded up: one more ulp of each point
    z = (np.maximum(z, 0.0) + e).astype(np.float64) * (1.0 + 2.0 * _U)
    return _normalized(z, x.start + y.start, x.step, x.log_z + y.log_z)


def _tilt_coarsen(x: _Tilted, theta: float) -> _Tilted:
    """Onto the grid of twice the step: an odd point's mass half to each neighbour (under the tilt, times
    ``e^{-theta step}`` and ``e^{theta step}``)."""
    m, start = x.m, x.start
    if start % 2:
        m, start = np.concatenate([[0.0], m]), start - 1
    if m.size % 2 == 0:
        m = np.append(m, 0.0)
    out = m[0::2].copy()
    out[:-1] += 0.5 * math.exp(-theta * x.step) * m[1::2]
    out[1:] += 0.5 * math.exp(theta * x.step) * m[1::2]
    return _normalized(out * (1.0 + 4.0 * _U), start // 2, 2.0 * x.step, x.log_z)


def _keep(x: _Tilted, lo: int, hi: int) -> _Tilted:
    """``x`` on the grid points ``lo..hi`` (absolute indices)."""
    a, b = max(lo - x.start, 0), min(hi - x.start + 1, x.m.size)
    b = max(b, a + 1)
    return _Tilted(x.m[a:b].copy(), x.start + a, x.step, x.log_z)


class _Upper:
    """The upper sums under every tilt, on one schedule of grids and windows, and the Chernoff bounds on their
    untrimmed laws (log moment generating functions on a grid of ``lam``)."""

    def __init__(self, g: np.ndarray, start: int, step: float, thetas: list[float], lam: np.ndarray, extended: bool):
        x = (start + np.arange(g.size)) * step
        self.thetas, self.lam, self.extended = thetas, lam, extended
        self.log_mgf = np.array([special.logsumexp(v * x, b=g) for v in lam]) + 1e-9   # + the summation's rounding
        self.top = float(x[-1])   # the largest value of the exact (untrimmed) sum: cut events' S is at most this
        self.sums = []
        for th in thetas:
            arg = th * x
            peak = float(arg.max())
            self.sums.append(_normalized(g * np.exp(arg - peak) * (1.0 + _MARGIN), start, step, peak))

    @property
    def step(self) -> float:
        return self.sums[0].step

    @property
    def size(self) -> int:
        return self.sums[0].m.size

    def coarsen(self) -> _Upper:
        out = object.__new__(_Upper)
        out.thetas, out.lam, out.extended = self.thetas, self.lam, self.extended
        out.top = self.top + self.step
        # a split by +-step multiplies a point's MGF by at most cosh(lam step)
        a = np.abs(self.lam * self.step)
        out.log_mgf = self.log_mgf + a + np.log1p(np.exp(-2.0 * a)) - math.log(2.0)
        out.sums = [_tilt_coarsen(s, th) for s, th in zip(self.sums, self.thetas, strict=True)]
        return out

    def add(self, other: _Upper) -> tuple[_Upper, float]:
        """The sum (both on one step), restricted to its Chernoff window; and the mass bound cut."""
        out = object.__new__(_Upper)
        out.thetas, out.lam, out.extended = self.thetas, self.lam, self.extended
        out.top = self.top + other.top
        out.log_mgf = self.log_mgf + other.log_mgf
        sums = [_tilt_add(a, b if other is not self else a, self.extended)
                for a, b in zip(self.sums, other.sums, strict=True)]
        log_cut = math.log(CUT)
        pos, neg = self.lam > 0, self.lam < 0
        hi = float(np.min((out.log_mgf[pos] - log_cut) / self.lam[pos]))
        lo = float(np.max((out.log_mgf[neg] - log_cut) / self.lam[neg]))
        out.sums = [_keep(s, math.floor(lo / s.step), math.ceil(hi / s.step)) for s in sums]
        return out, 2.0 * CUT

    def masses(self) -> tuple[np.ndarray, np.ndarray]:
        """The points and, at each, the least of the tilts' untilted bounds."""
        first = self.sums[0]
        x = (first.start + np.arange(first.m.size)) * first.step
        best = np.full(x.size, np.inf)
        for s, th in zip(self.sums, self.thetas, strict=True):
            with np.errstate(over="ignore", invalid="ignore"):
                bound = np.where(s.m > 0, s.m * np.exp(s.log_z - th * x), 0.0)
            best = np.minimum(best, bound)
        return x, best * (1.0 + _MARGIN)


@dataclass
class _Moments:
    """A lower law: atoms of mass ``m[j]`` at ``(start + j + o[j] / m[j]) step`` (``0 <= o <= m``)."""

    m: np.ndarray
    o: np.ndarray
    start: int
    step: float


def _moment_add(x: _Moments, y: _Moments, down: bool, extended: bool) -> _Moments:
    """The contraction of ``X + Y`` onto cells (atoms grouped by the sum of their cells' indices, each group at its
    mean), masses lowered by the FFTs' error bounds and means moved down (``down``) or up by theirs; the FFTs in
    extended precision if ``extended`` (a lower law loses the mass its bounds exceed, deep in a sum's tails)."""
    n = x.m.size + y.m.size - 1
    nfft = 1 << (n - 1).bit_length()
    dtype = np.longdouble if extended else np.float64
    fft_plan(nfft, dtype)
    u = float(np.finfo(dtype).eps) / 2
    fmx, fox = sfft.rfft(x.m.astype(dtype), nfft), sfft.rfft(x.o.astype(dtype), nfft)
    fmy, foy = (fmx, fox) if y is x else (sfft.rfft(y.m.astype(dtype), nfft), sfft.rfft(y.o.astype(dtype), nfft))
    zm = sfft.irfft(fmx * fmy, nfft)[:n]
    zo = sfft.irfft(fox * fmy + fmx * foy, nfft)[:n]
    nmx, nox, nmy, noy = _norms(x.m), _norms(x.o), _norms(y.m), _norms(y.o)
    em = fft_bound(nfft, *nmx, *nmy, u) + 2.0 * u * float(np.abs(zm).max())
    eo = fft_bound(nfft, *nox, *nmy, u) + fft_bound(nfft, *nmx, *noy, u) + 4.0 * u * float(np.abs(zo).max())
    # to float64, the masses rounded down and the moments toward the curve's low side (an ulp each)
    zm_hi = (np.maximum(zm, 0.0) + em).astype(np.float64) * (1.0 + 2.0 * _U)
    zo_lo = (zo - eo).astype(np.float64) * (1.0 - 2.0 * _U) - 1e-300
    zo_hi = (np.maximum(zo, 0.0) + eo).astype(np.float64) * (1.0 + 2.0 * _U)
    zm = (zm - em).astype(np.float64) * (1.0 - 2.0 * _U) - 1e-300
    m = np.maximum(zm, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        if down:   # a mean at most the true one: the moment low, the mass high
            p = np.clip(zo_lo / zm_hi, 0.0, 2.0)
        else:      # ... at least: the moment high, the mass low
            p = np.where(m > 0, np.minimum(2.0, zo_hi / np.where(m > 0, m, 1.0)), 0.0)
    p = np.where(m > 0, p, 0.0)
    # a mean past its cell's end (p >= 1) moves one cell up and merges with that cell's atom: a contraction again
    up = (p >= 1.0).astype(np.int64)
    idx = np.arange(n) + up
    mm = np.bincount(idx, weights=m, minlength=n + 1) * (1.0 - 2.0 * _U)
    oo = np.bincount(idx, weights=m * (p - up), minlength=n + 1) * (1.0 - 4.0 * _U if down else 1.0 + 4.0 * _U)
    oo = np.minimum(oo, mm)
    return _moment_trim(_Moments(mm, oo, x.start + y.start, x.step))


def _moment_trim(x: _Moments) -> _Moments:
    """Drop at most :data:`_LOWER_TAIL` of mass from each side."""
    lo = int(np.searchsorted(np.cumsum(x.m), _LOWER_TAIL))
    hi = x.m.size - int(np.searchsorted(np.cumsum(x.m[::-1]), _LOWER_TAIL))
    lo = min(lo, max(hi - 1, 0))
    return _Moments(x.m[lo:hi].copy(), x.o[lo:hi].copy(), x.start + lo, x.step)


def _moment_coarsen(x: _Moments, down: bool) -> _Moments:
    """Pairs of cells merged (a contraction); the sums' rounding taken off the masses and put on the means toward
    the curve's low side (``down``: removing)."""
    m, o, start = x.m, x.o, x.start
    if start % 2:
        m, o, start = np.concatenate([[0.0], m]), np.concatenate([[0.0], o]), start - 1
    if m.size % 2:
        m, o = np.append(m, 0.0), np.append(o, 0.0)
    mm = (m[0::2] + m[1::2]) * (1.0 - 2.0 * _U)
    oo = 0.5 * (o[0::2] + o[1::2] + m[1::2]) * (1.0 - 4.0 * _U if down else 1.0 + 4.0 * _U)
    return _Moments(mm, np.minimum(oo, mm), start // 2, 2.0 * x.step)


def _binary_sums(power, counts: tuple[int, ...], add, coarsen, size, points: int) -> list[tuple[object, float]]:
    """For each count ``c``, the sum of ``c`` i.i.d. copies of ``power`` (by doubling along the binary digits of
    ``c``, the doublings shared) and the mass its windows cut (union bound: each sum's cut times how often it occurs
    in the whole).  ``add(a, b)`` sums two laws on one step and says the mass it cut; ``coarsen`` doubles a law's
    step; ``size`` is its point count, kept within ``points``."""
    def fit(x):
        while size(x) > points:
            x = coarsen(x)
        return x

    def same_step(a, b):
        while a.step < b.step:
            a = coarsen(a)
        while b.step < a.step:
            b = coarsen(b)
        return a, b

    powers, cuts = [power], [0.0]
    while (1 << len(powers)) <= max(counts):
        doubled, cut = add(powers[-1], powers[-1])
        powers.append(fit(doubled))
        cuts.append(cut)
    out = []
    for c in counts:
        acc, cut = None, 0.0
        for k, (pk, ck) in enumerate(zip(powers, cuts, strict=True)):
            cut += ck * (c >> k)          # the 2^k-sum occurs floor(c / 2^k) times in the c-sum
            if c >> k & 1:
                if acc is None:
                    acc = pk
                else:
                    acc, ca = add(*same_step(acc, pk))
                    acc, cut = fit(acc), cut + ca
        out.append((acc, cut))
    return out


def _body(mu: float, steps: int) -> float:
    """Where a term's body ends and its large values begin (module docstring): the least ``z`` on a grid of 1/8
    whose tail ``q = P(Z > z)`` leaves three or more large terms of ``steps`` at most :data:`_THREE` (both
    directions), as ``W = exp(mu z - mu^2/2)``; the cap if none below it does."""
    t = steps
    for z in np.arange(4.0, _CAP_Z, 0.125):
        q, p = float(special.ndtr(-z)), float(special.ndtr(mu - z))
        three_q = math.comb(t, 3) * q ** 3
        three_p = p * math.comb(t - 1, 2) * q * q + math.comb(t - 1, 3) * q ** 3
        if max(three_q, three_p) <= _THREE:
            return math.exp(mu * z - 0.5 * mu * mu)
    return math.exp(mu * _CAP_Z - 0.5 * mu * mu)


def _grid(mu: float, steps: int) -> tuple[float, float, float, int]:
    """A term's cap, its body's end ``b`` (rounded up to the grid), the body's grid step (a power of 2, at least
    ``b / POINTS``) and its number of cells."""
    cap = math.exp(-0.5 * mu * mu + _CAP_Z * mu)
    b = _body(mu, steps) if steps >= 3 else cap
    step = 2.0 ** math.ceil(math.log2(b / POINTS))
    n = math.ceil(b / step)
    return cap, min(cap, n * step), step, n


def _heavy(mu: float, steps: int) -> float:
    """A term's body's end over the standard deviation of ``S``: how far the tilts' and Chernoff bounds' weight sits
    from the sum's mass."""
    return _grid(mu, steps)[1] / math.sqrt(math.expm1(mu * mu) * steps)


def linear_suits(mu: float, steps: int) -> bool:
    """Whether an epoch's sum is bounded here rather than on octave bands: where the allocated term lies below the cap
    but for at most :data:`_CAP_P` of its mass (sigma above 0.5), a term's grid step is at most
    :data:`_RESOLUTION` of its standard deviation (the bounds move ``E f`` by about its square) and its body's end at
    most :data:`_LIGHT` standard deviations of ``S`` (:data:`_HEAVY` with extended precision, for epochs of
    :data:`_MIN_STEPS` steps or more).  A heavier tail puts
    the tilts' and Chernoff bounds' weight on the cap, and the FFTs' error bounds then swamp ``delta`` far into the
    sum's tail."""
    if special.ndtr(mu - _CAP_Z) > _CAP_P:   # the cap must hold the mean: at sigma 0.05 it is 2e-9, all the mass
        return False                          # of P beyond it
    _, _, step, _ = _grid(mu, steps)
    if step > _RESOLUTION * math.sqrt(math.expm1(mu * mu)):
        return False
    heavy = _heavy(mu, steps)
    # short heavy-tailed epochs: the bands are as tight, and cheaper (no extended precision); a light-tailed one is
    # cheap here too, and tighter (k 4 of 1,000 steps, sigma 2: epochs of 250, 0.064 % against 0.25 %)
    return heavy <= (_LIGHT if steps < _MIN_STEPS or not EXTENDED else _HEAVY)


def linear_law(mu: float, steps: int, relation: str) -> LinearLaw:
    """The upper and lower laws of ``S`` for one direction of an epoch of ``steps`` steps at ``mu = 1 / sigma``
    (module docstring).

    Examples
    --------
    >>> from dpmath.pld.linear_sum import linear_law
    >>> law = linear_law(0.5, 1000, "remove")
    >>> s, m, inf = law.read(True)
    >>> bool(abs(m.sum() - 1.0) < 1e-6)
    True
    """
    t = steps
    cap, b, step, n = _grid(mu, t)
    split = b < cap    # large terms (above b) apart: the sums of t - j bodies and j large terms, j <= 2
    counts = (t, t - 1, t - 2) if split else (t,)
    down = relation == "remove"    # which side the curve grows toward: S up removing, down adding
    points = max(POINTS, n + 1)
    sd_w = math.sqrt(math.expm1(mu * mu))
    spread = sd_w * math.sqrt(t)        # standard deviation of S
    thetas = sorted({(1.0 if down else -1.0) * min(z / spread, _MAX_TILT / cap) for z in _TILTS}, key=abs)
    lam = np.geomspace(1e-4, 100.0, 96) / sd_w
    lam = np.concatenate([-lam, lam])
    lam = lam[np.abs(lam) * (cap + step) < 700.0]
    extended = EXTENDED and _heavy(mu, t) > _LIGHT

    def split_law(m, em, o, eo) -> np.ndarray:
        """Cells split between their ends: masses at least the true ones, the right end's share at least the true
        one removing (a move up: larger E f for increasing f) and at most it adding."""
        m_hi = m + em
        right = np.clip(o + eo if down else o - eo, 0.0, m_hi)
        g = np.zeros(m.size + 1)
        g[:-1] += m_hi - right
        g[1:] += right
        return g

    def atoms(m, em, o, eo, first, at) -> _Moments:
        """Cells as atoms at their means: masses at most the true ones, positions toward the curve's low side."""
        lm = np.maximum(m - em, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            p = (o - eo) / (m + em) if down else (o + eo) / np.where(lm > 0, lm, 1.0)
        p = np.where(lm > 0, np.clip(p, 0.0, 1.0), 0.0)
        return _Moments(lm, p * lm, first, at)

    def add_upper(a: _Upper, c: _Upper) -> tuple[_Upper, float]:
        return a.add(c)

    def add_lower(a: _Moments, c: _Moments) -> tuple[_Moments, float]:
        return _moment_add(a, c, down, extended), 0.0

    def coarsen_lower(a: _Moments) -> _Moments:
        return _moment_coarsen(a, down)

    body = _term(mu, step, 0, 0.0, b)
    uppers = _binary_sums(_Upper(split_law(*body), 0, step, thetas, lam, extended), counts, add_upper,
                          _Upper.coarsen, lambda u: u.size, points)
    lowers = _binary_sums(_moment_trim(atoms(*body, 0, step)), counts, add_lower, coarsen_lower,
                          lambda u: u.m.size, points)

    # the components: t bodies; t - 1 bodies and a large term (t ways); t - 2 and two (t (t - 1) / 2 ways)
    up_parts, low_parts, cut_q, cut_p = [], [], 0.0, 0.0
    for j, ((u, cut), (lo, _)) in enumerate(zip(uppers, lowers, strict=True)):
        weight = float(math.comb(t, j))
        for _ in range(j):   # a large term's law on the sum's grid, from the cell that holds b
            first = math.floor(b / u.step)
            u, c = u.add(_Upper(split_law(*_term(mu, u.step, first, b, cap)), first, u.step, thetas, lam, extended))
            cut += c
            first = math.floor(b / lo.step)
            lo = _moment_add(lo, _moment_trim(atoms(*_term(mu, lo.step, first, b, cap), first, lo.step)), down,
                             extended)
        values, mass = u.masses()
        up_parts.append((values, mass * weight * (1.0 + _MARGIN)))
        frac = np.where(lo.m > 0, lo.o / np.where(lo.m > 0, lo.m, 1.0), 0.0)
        # the atoms' positions rounded toward the lower curve's side (down removing, up adding)
        at = (lo.start + np.arange(lo.m.size) + frac) * lo.step * (1.0 - 4.0 * _U if down else 1.0 + 4.0 * _U)
        low_parts.append((at, lo.m * weight * (1.0 - _MARGIN)))
        cut_q += weight * cut * (1.0 + 1e-6)
        cut_p += weight * cut * (1.0 + 1e-6) * u.top / t   # a cut event's P-mass: its Q-mass times S-bar
    q_cap, p_cap = float(special.ndtr(-_CAP_Z)), float(special.ndtr(mu - _CAP_Z))
    z_b = (math.log(b) + 0.5 * mu * mu) / mu
    q_b, p_b = (float(special.ndtr(-z_b)), float(special.ndtr(mu - z_b))) if split else (0.0, 0.0)
    if down:   # P-masses: a term above the cap (the allocated one, or another), three large terms, a cut event
        inf = p_cap + (t - 1) * q_cap + p_b * math.comb(t - 1, 2) * q_b ** 2 + math.comb(t - 1, 3) * q_b ** 3 + cut_p
    else:
        inf = t * q_cap + math.comb(t, 3) * q_b ** 3 + cut_q
    return LinearLaw(relation, t, np.concatenate([v for v, _ in up_parts]), np.concatenate([m for _, m in up_parts]),
                     min(1.0, inf), np.concatenate([v for v, _ in low_parts]),
                     np.concatenate([m for _, m in low_parts]))

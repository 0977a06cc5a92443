r"""Composition of discrete privacy-loss distributions by FFT, with its floating-point error bounded.

Composition (:class:`Composition`) multiplies the Fourier transforms of all steps at once, on a window
chosen by a Chernoff bound: the mass beyond it is charged to ``inf`` (upper) and the mass that can
wrap around is subtracted from delta (``slack``, lower).  Floating-point error is bounded, not
ignored.  A plain FFT has an absolute error near ``n eps log N`` times the peak mass, which swamps
the ``1e-12`` tails a small delta depends on, so the product is also computed under exponential
tilts ``p_j e^{lambda t_j}``, each centred where the previous ones left an upper tail sum
``P(L >= t) > 1e-15`` with a relative error bound above ``1e-3``; each output point is taken from
the tilt with the smallest error bound, and that bound is added to it (upper) or subtracted (lower).

A query cuts each step's largest losses first (:meth:`Composition.epsilon`): up to ``CUT delta`` of mass, charged
to ``+inf``.  Heavy-tailed steps (randomized clipping, whose losses have a polynomial tail) are split instead at
about ``sqrt(2 CUT delta)`` (:class:`OneLargeLoss`): the terms with exactly one large loss are exact at every
epsilon, each tail against the composition of the other steps' bodies (:class:`LargeLosses`), and only those with
two or more are charged, at most ``CUT delta``.  The windows then hold losses up to a few nats rather than the loss
cap: at Hutch ``k = 8``, ``d = 1024``, 72 steps, 3.6e-7, 40,000 points instead of 5M, and the bracket's refinement
reaches a finer scale grid within its budget (1.76 % to 0.42 %, 2.9 GB to 0.7 GB); at 1495 steps and 6.1e-9, where
epsilon (23) lies far out in the tail, 8.7 % to 0.51 %.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import fft as sfft
from scipy import signal, special

from .distribution import MAX_GRID, GridTooLargeError, Pld, grid_advice

__all__ = ["CUT", "Composition", "Factor", "EXTENDED", "LargeLosses", "OneLargeLoss", "Spectra", "chernoff",
           "split_tails", "tilted_product", "truncated"]

_MAX_TILT = 1e12   # the largest tilt tried: beyond it lam * t leaves what a float64 exponent can mean

_F64_EPS = float(np.finfo(np.float64).eps)
#: The absolute error of an FFT coefficient per unit mass of its input, per ``log2 N``, in float64 (scaled by the
#: working precision's epsilon in extended precision): the bound every FFT-composed law here is charged with.
FFT_ERR = 5.0 * _F64_EPS
# extended precision helps only where long double is wider than double (x86: 80 bits; not on every platform)
EXTENDED = float(np.finfo(np.longdouble).eps) < _F64_EPS
_EXTEND_AT = 1e-2      # ... and is used where a float64 pass's rounding moves delta by more than this of it
_TILT_TAIL = 1e-20     # tilted mass left outside a tilted window (it may alias anywhere; far below the FFT rounding)
_TILT_RTOL = 1e-3      # relative accuracy wanted for every upper tail sum ...
_TILT_FLOOR = 1e-15    # ... that exceeds this mass (delta is supported down to 1e-12)
_MAX_TILTS = 64
_LOG_TINY = -700.0     # log of the smallest spectrum modulus worth a complex power (exp(-700) ~ 1e-304)
_MAX_CUT = 1e-12      # most mass a composition window may cut (charged to delta) before it is an error
#: The largest losses an ``epsilon(delta)`` query cuts from the steps it composes: up to this fraction of ``delta``
#: over all steps (:func:`truncated`; charged to delta as mass at ``+inf``, so it moves epsilon by about
#: ``1e-6 / |d log delta / d epsilon|`` relative).  A heavy-tailed step (randomized clipping) keeps losses up to
#: where its tail is ``1e-15``: under the tilt near epsilon those tails carry most of the mass, and the FFT window
#: that holds them grows to millions of points; cut, it shrinks about four-fold (6.6M to 1.6M points at Hutch
#: ``k = 16``, ``D = 24``, q = 0.05, 60 steps).
CUT = 1e-6
_SPLIT_TRIES = 4      # levels a delta query's split tries, each at the delta the last one read (Composition.delta)
_DELTA_LEVELS = 3     # a delta read's rounds of an epsilon query's passes, each at the level the last one read
_SPECTRA_MAX = 1 << 23   # largest FFT whose steps' transforms :class:`Spectra` keeps (8M points: 200 MB a step)
#: What one extended-precision point costs in :attr:`Composition.work`, in float64 points (the docs' "about 7
#: times", rounded up: its FFT is also slower per point on large windows).
EXTENDED_COST = 8
#: What one point of a single step (a composition of one step, no FFT) costs in :attr:`Composition.work`: building
#: it (normal CDFs, the split) takes about 4 float64 FFT points' time per point and bound.
STEP_COST = 4


class Factor:
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


def chernoff(parts: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], var: float, sd: float,
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


def _tilted_stats(factors: list[Factor], lam: float) -> tuple[float, float]:
    mean = var = 0.0
    for f in factors:
        _, _, m, v = f.tilted(lam)
        mean += f.n * m
        var += f.n * v
    return mean, var


def _window(factors: list[Factor], lam: float, tail: float, h: float, half_width: int = MAX_GRID,
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
        theta, k0 = chernoff(parts, var, sd, level=level)
        dist = (k0 + level) / theta
        if dist <= half_width * h:
            ends.append(dist)
            masses.append(tail)
        else:
            dist = half_width * h
            ends.append(dist)
            theta, k0 = chernoff(parts, var, sd, dist=dist)
            masses.append(math.exp(min(0.0, k0 - theta * dist)))
    k_max = sum(f.n * int(f.k[-1]) for f in factors)
    k_min = sum(f.n * int(f.k[0]) for f in factors)
    hi = math.ceil((mean + ends[0]) / h)
    lo = math.floor((mean - ends[1]) / h)
    return max(k_min, lo), min(k_max, hi), masses[0] if hi < k_max else 0.0, masses[1] if lo > k_min else 0.0


#: Tilts, and the epsilons a delta read is centred at, are rounded to bins of ``1 / TILT_BINS`` of an octave
#: (:func:`tilt_bin`), so that nearby queries (an epsilon, and the delta read back at it) share one cached pass.
TILT_BINS = 32


def tilt_bin(x: float) -> int:
    """The bin of a positive ``x``: ``round(TILT_BINS log2 x)``."""
    return round(TILT_BINS * math.log2(x))


def _binned(lam: float) -> float:
    """A positive tilt rounded to its bin's centre (a tilt is only a choice: every pass is checked)."""
    return 2.0 ** (tilt_bin(lam) / TILT_BINS) if lam > 0 else lam


def _tilt_for_mean(factors: list[Factor], target: float, lam0: float, direction: float) -> float | None:
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
            if abs(nxt) > _MAX_TILT:   # a target past every loss: no tilt reaches it, and lam * t would overflow
                return lo
        elif not min(lo, hi) < nxt < max(lo, hi):
            nxt = 0.5 * (lo + hi)
        lam = nxt
        mean, var = _tilted_stats(factors, lam)
    return hi


class Spectra:
    r"""The steps' Fourier transforms for the untilted pass, kept across compositions of the same step PLDs at
    different counts.

    An untilted pass of ``n_i`` copies of the steps ``p_i`` is ``irfft(prod_i rfft(p_i)^{n_i})`` on ``N`` points,
    any ``N`` at least its window's width (wider only leaves more room before mass wraps around, and the mass
    beyond the window is charged as before).  That width never grows when a count shrinks: each side of the
    window is a Chernoff distance from the mean, ``min_theta (n K(theta) + level) / theta`` with the centred
    cumulant ``K >= 0`` (Jensen), so it is non-decreasing in ``n``, and so are the clips to the support
    ``[n k_min, n k_max]``.  So the window of the largest counts fixes one ``N`` (:attr:`size`) for every smaller
    count, and each step's transform at that size is computed once (the first pass) and reused: a later pass
    costs the power, one inverse FFT and the error bound.  Float64 passes only; tilted ones (whose window and
    weights change with the tilt) and windows wider than :attr:`size` are computed afresh.

    Parameters
    ----------
    size : int
        Width of the widest untilted window the compositions may have (that of the largest counts); the FFT
        size is the next fast length.  Above ``2^23`` points nothing is kept (each transform would take
        about 200 MB) and every pass is computed afresh.

    Examples
    --------
    >>> import math
    >>> from dpmath import SubsampledGaussian
    >>> from dpmath.pld.compose import Composition, Spectra
    >>> from dpmath.pld.steps import step_plds
    >>> step, = step_plds(SubsampledGaussian(1.0, 0.01), "remove", 1e-4, (True,))
    >>> largest = Composition([(step, 1000)], 1e-18)
    >>> shared = Spectra(largest.hi - largest.lo + 1)
    >>> eps = [Composition([(step, n)], 1e-18, spectra=shared).pass_epsilon(1e-6)[0] for n in (10, 100, 1000)]
    >>> [round(e, 4) for e in eps]
    [0.5924, 0.9542, 2.1245]
    """

    def __init__(self, size: int) -> None:
        self.size = sfft.next_fast_len(int(size), real=True)
        self.transforms: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}   # step index -> X, log|X|, rel

    def transform(self, i: int, f: Factor) -> tuple[np.ndarray, np.ndarray, float] | None:
        """``(rfft, log |rfft|, relative rounding per copy)`` of step ``i`` (the factor ``f``) at :attr:`size`,
        untilted; ``None`` where the size is over the limit."""
        if self.size > _SPECTRA_MAX:
            return None
        if i not in self.transforms:
            self.transforms[i] = _transform(f, 0.0, self.size, np.float64)
        return self.transforms[i]


_PLAN_LARGE = 1 << 20   # FFT lengths from which at most one plan a precision is kept (:func:`fft_plan`)
_PLAN_CACHE = 64         # more than the plans scipy's pocketfft keeps a precision (16, least recently used first)
_large_plans: dict[str, int] = {}   # precision -> the large length last planned


def fft_plan(nfft: int, dtype) -> None:
    """Make room for an FFT of ``nfft`` points in ``dtype``: where it is large and not the large length last used in
    that precision, pocketfft's cache of plans is emptied first.

    scipy's pocketfft keeps the plans (twiddle factors, 8 to 16 bytes a point) of the last 16 lengths used in each
    precision.  A query on a fine grid runs passes of many different lengths of millions of points: at ``sigma``
    0.5, ``q`` 1e-6, 10^4 steps, ``bracket_rtol=1e-4`` the kept plans held about 1 GB of the 1.6 GB peak, and the
    process still held 1.5 GB once every array was freed.  Emptying the cache (tiny transforms of other lengths,
    each replacing the least recent) frees them; a pass reusing the last large length keeps its plan, and one of a
    new length plans again (8 to 40 % of one transform, measured at 1.2M to 4.5M points)."""
    if nfft < _PLAN_LARGE:
        return
    key = np.dtype(dtype).name
    if _large_plans.get(key) == nfft:
        return
    if key in _large_plans:
        for m in range(2, 2 + _PLAN_CACHE):
            sfft.rfft(np.zeros(m, dtype=dtype))
    _large_plans[key] = nfft


def _transform(f: Factor, lam: float, nfft: int, dtype) -> tuple[np.ndarray, np.ndarray, float]:
    """The tilted step's ``rfft`` on ``nfft`` points, its ``log |.|`` and the inputs' relative rounding per copy
    (:func:`tilted_product`)."""
    w, log_norm, _, _ = f.tilted(lam)
    x = sfft.rfft(np.bincount((f.k - f.k[0]) % nfft, weights=w, minlength=nfft).astype(dtype, copy=False),
                  overwrite_x=True)
    rel = (4.0 + float(np.max(np.abs(f.logp + lam * f.t - log_norm)))) * _F64_EPS
    with np.errstate(divide="ignore"):
        la = np.log(np.abs(x)).astype(np.float64)
    return x, la, rel


def tilted_product(factors: list[Factor], lam: float, w_lo: int, w_hi: int, a: int, b: int, h: float,
                    extended: bool = False, trim: bool = False, spectra: Spectra | None = None
                    ) -> tuple[int, np.ndarray, np.ndarray]:
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
    two terms, then of ``exp``).  Overflowing values and bounds are ``inf`` (or NaN where ``0 * inf``).

    ``spectra``: an untilted float64 pass whose window fits :attr:`Spectra.size` runs on that many points, with
    the steps' transforms kept there (the same numbers as computed here, at that size)."""
    nfft = sfft.next_fast_len(w_hi - w_lo + 1, real=True)
    shared = (spectra is not None and lam == 0.0 and not extended and w_hi - w_lo + 1 <= spectra.size
              and spectra.size <= _SPECTRA_MAX)
    if shared:
        nfft = spectra.size
    dtype = np.longdouble if extended else np.float64
    fft_plan(nfft, dtype)
    eps = float(np.finfo(dtype).eps)
    xs, log_abs = [], []
    log_spec = np.zeros(nfft // 2 + 1)
    log_scale = 0.0
    offset = 0
    rel = 0.0   # relative error of each value from the inputs' rounding
    for i, f in enumerate(factors):
        _, log_norm, _, _ = f.tilted(lam)
        x, la, rel_one = spectra.transform(i, f) if shared else _transform(f, lam, nfft, dtype)
        rel += f.n * rel_one
        xs.append(x)
        log_abs.append(la)
        log_spec += f.n * la
        log_scale += f.n * log_norm
        offset += f.n * int(f.k[0])
    # the power is taken only where the product's modulus is representable (after many steps, few
    # frequencies); the others are left at 0 and their moduli are charged to the error below
    scale = FFT_ERR * (eps / _F64_EPS) * math.log2(nfft)
    tiny = _LOG_TINY
    if shared and nfft > 1:   # (one point: its rounding bound is 0, and nothing to drop)
        # a shared transform is reused at many counts, where the power of every frequency would cost about as
        # much as the inverse FFT: it also drops the moduli below 1e-3 of the rounding bound's least value,
        # scale / nfft (the largest output is at least the mean, 1 / nfft: the tilted masses sum to 1), so the
        # charge for them is at most 0.1 % of the bound's
        tiny = max(tiny, math.log(1e-3 * scale / nfft))
    keep = log_spec > tiny
    whole = bool(keep.all())
    # the powers taken in place, on the transforms themselves where every frequency is kept and they are this
    # pass's own (a shared one is reused), and each freed once used: an extended pass of 4M points held four
    # spectra at once here (0.24 GB)
    part = None
    for i, f in enumerate(factors):
        x = xs[i] if whole and not shared else xs[i][keep]
        xs[i] = None
        x **= f.n
        if part is None:
            part = x
        else:
            part *= x
        del x
    if whole:
        spec = part
    else:
        spec = np.zeros(nfft // 2 + 1, dtype=part.dtype)
        spec[keep] = part
    dropped = float(spec.size - part.size) * math.exp(tiny)   # each dropped modulus is below this
    part_norm = float(np.sum(np.abs(part)))
    del part
    # |d prod X_i^n_i| <= sum_i n_i |dX_i| |X_i|^(n_i - 1) prod_{j != i} |X_j|^n_j, |dX| <= FFT_ERR log2 N
    sens = 0.0
    for i, f in enumerate(factors):
        log_term = (f.n - 1) * log_abs[i] if f.n > 1 else np.zeros(spec.size)
        for j, g in enumerate(factors):
            if j != i:
                log_term = log_term + g.n * log_abs[j]
        # exp underflows to exactly 0 below -746: only the other terms are summed (the same sum, faster)
        sens += f.n * float(np.exp(log_term[log_term > -746.0]).sum())
    circ = sfft.irfft(spec, nfft, overwrite_x=True)
    peak = max(float(circ.max()), -float(circ.min()))
    err_t = scale * ((2.0 / nfft) * (sens + part_norm) + peak)
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


def _cut_index(pld: Pld, mass: float) -> int:
    """The first point of ``pld``'s largest losses holding at most ``mass`` (at least one point stays; the size
    where none is cut)."""
    tail = np.cumsum(pld.pmf[::-1])[::-1]   # tail[j]: the mass from point j up (summed from the top)
    fits = np.nonzero(tail <= mass)[0]
    return max(int(fits[0]), 1) if fits.size else pld.pmf.size


def truncated(pld: Pld, mass: float) -> Pld:
    """``pld`` without its largest losses, at most ``mass`` of them: moved to ``+inf`` (upper bound: the losses
    only grow) or to the last point kept (lower bound: they only shrink).  At least one point stays.

    Examples
    --------
    >>> import numpy as np
    >>> from dpmath.pld.compose import truncated
    >>> from dpmath.pld.distribution import Pld
    >>> cut = truncated(Pld(0.1, 0, np.array([0.5, 0.5 - 1e-9, 1e-9]), 0.0, True), 1e-8)
    >>> cut.pmf.size, bool(cut.inf >= 1e-9)
    (2, True)
    """
    j = _cut_index(pld, mass)
    if j == pld.pmf.size:
        return pld
    # the moved mass summed afresh, and rounded toward the bound's side (a sum of positive terms: n eps of it)
    moved = float(pld.pmf[j:].sum(dtype=np.longdouble))
    side = 1.0 if pld.upper else -1.0
    moved *= 1.0 + side * (pld.pmf.size - j + 2) * _F64_EPS   # and the addition below
    pmf = pld.pmf[:j].copy()
    if pld.upper:
        return Pld(pld.h, pld.start, pmf, min(1.0, pld.inf + moved), True)
    pmf[-1] += moved
    return Pld(pld.h, pld.start, pmf, pld.inf, False, pld.slack)


def _decayed_suffix(x: np.ndarray, c: float) -> np.ndarray:
    """``R_k = sum_{k' >= k} x_{k'} c^{k' - k}`` for ``k = 0..n``, ``R_n = 0`` (a recursion from the top,
    ``R_k = x_k + c R_{k+1}`` with ``c <= 1``: every term at most its own ``x``, so nothing overflows; relative
    rounding at most ``3 eps (n - k)``, as in :meth:`Pld._curves`)."""
    out = np.zeros(x.size + 1)
    out[:-1] = signal.lfilter([1.0], [1.0, -c], x[::-1])[::-1]
    return out


_BLOCK = 1024   # a tail's points per block of LargeLosses's sums: sums kept at block starts, the rest summed per query


class _Tail:
    """A tail's masses ``t_k`` with its prefix sums ``P_k = sum_{k' < k} t_{k'}`` and decayed suffix sums
    ``R_k = sum_{k' >= k} t_{k'} e^{(k - k') h}`` at any ``k`` in ``O(_BLOCK)``: kept at block starts only, since a
    tail can hold the grid's 4M points (three full arrays of them, in every cached split, took 2 GB)."""

    def __init__(self, t: np.ndarray, h: float) -> None:
        self.t, self.h, self.size = t, h, t.size
        nb = -(-t.size // _BLOCK)
        blocks = np.zeros(nb * _BLOCK)
        blocks[:t.size] = t
        blocks = blocks.reshape(nb, _BLOCK)
        self.decay = np.exp(-h * np.arange(_BLOCK))
        self.p = np.concatenate(([0.0], np.cumsum(blocks.sum(axis=1))))
        self.r = _decayed_suffix(blocks @ self.decay, math.exp(-h * _BLOCK))
        self.mass = float(self.p[-1])

    def prefix(self, k: int) -> float:
        b = k // _BLOCK
        return float(self.p[b] + self.t[b * _BLOCK:k].sum())

    def suffix(self, k: int) -> float:
        b = k // _BLOCK
        end = min((b + 1) * _BLOCK, self.size)
        head = float(self.t[k:end] @ self.decay[:end - k]) if k < end else 0.0
        return head + math.exp(-self.h * ((b + 1) * _BLOCK - k)) * float(self.r[b + 1]) if b + 1 < self.r.size else head


class LargeLosses:
    r"""The large losses of split steps, each against the composition of everything else: what
    :class:`OneLargeLoss` adds to (lower bound) or takes from (upper) the composition of the steps' bodies.

    For a step ``i`` with ``n_i`` copies, tail ``t_i`` and ``B_i`` the composition of the bodies with one copy of
    ``b_i`` fewer, the terms of the composition with exactly one large loss hold

    .. math::

        \sum_i n_i H(t_i * B_i)(\varepsilon) = \sum_i n_i \big(M_{t_i} M_{B_i} - G(t_i * B_i)(\varepsilon)\big),
        \qquad G(\mu)(\varepsilon) = \sum_x \mu(x) \min(1, e^{\varepsilon - x}),

    with ``H(mu)(e) = sum_x mu(x) (1 - e^{e - x})_+`` and ``M`` a measure's mass.  :meth:`sums` evaluates ``G`` at
    one ``epsilon`` exactly for the discrete measures, in ``O(size of B_i)``: the tail's points below ``eps`` minus
    ``B_i``'s least loss weigh ``min = e^{eps - x}`` against all of ``B_i`` (a decayed suffix sum of the tail), those
    above ``eps`` minus its largest loss weigh ``1`` (a prefix sum), and only the points in between meet ``B_i``'s
    points one by one (two dot products with ``B_i``'s prefix and decayed suffix sums).

    Each ``B_i`` comes as two point-wise bounds from one FFT pass (its values less and plus their error bounds) and
    its exact mass, and each sum is bounded both ways, the tighter kept: ``G`` from below by ``G`` of the lower values
    or by ``M_t M_B - H`` of the upper ones, ``H`` likewise.  An FFT pass of ``10^6`` steps bounds each value's error
    near ``1e-9``: summed over a window, the lower values alone lose ``1e-3`` of ``B``'s mass, which would cost that
    much of ``M_t`` in the bound, where ``M_t M_B - H`` loses nothing near ``H = 0``.

    Parameters
    ----------
    h : float
        The grid step shared by the tails and the compositions.
    parts : list of (int, int, ndarray, int, ndarray, ndarray, float, float, float)
        ``(n_i, start of t_i, t_i, start of B_i, lower B_i, upper B_i, M_{B_i}, alias_i, outside_i)``: counts, grid
        indices of the first points, masses (the lower values at most ``B_i``'s point by point but for up to
        ``alias_i`` that the FFT window may have wrapped onto any point; the upper at least, on the window, which
        leaves out up to ``outside_i``) and a lower bound of ``B_i``'s whole mass.
    """

    def __init__(self, h: float, parts: list[tuple[int, int, np.ndarray, int, np.ndarray, np.ndarray, float, float,
                                                   float]]) -> None:
        self.h = h
        self.parts = []
        top = -math.inf
        size = 0
        for n, t_start, t, b_start, b_low, b_up, mass, alias, outside in parts:
            tail = _Tail(t, h)
            sums = [(np.concatenate(([0.0], np.cumsum(b))), _decayed_suffix(b, math.exp(-h))) for b in (b_low, b_up)]
            self.parts.append((n, t_start + b_start, tail, sums, mass, alias, outside))
            top = max(top, (t_start + t.size - 1 + b_start + b_low.size - 1) * h)
            size = max(size, t.size + b_low.size)
        #: the largest loss of any one-large-loss term: above it ``H`` is 0 and ``G`` every mass
        self.top = top
        #: relative rounding of a sum: prefix, suffix and dot-product sums of positive terms, each at most ``3 eps`` a
        #: term (the decayed suffixes' bound), and the products of their results
        self.rel = 8.0 * (size + 8) * _F64_EPS

    def bounds(self, eps: float) -> tuple[float, float]:
        """Lower bounds of ``(sum_i n_i G(t_i * B_i)(eps), sum_i n_i H(t_i * B_i)(eps))``, their rounding included
        (``eps / h`` rounds by ``|eps| / h`` ulps, which moves ``G`` by at most ``|eps| eps_64`` relative)."""
        rel = self.rel + 4.0 * (1.0 + abs(eps)) * _F64_EPS
        g_total = h_total = 0.0
        for n, offset, tail, sums, mass, alias, outside in self.parts:
            (g_lo, m_lo), (g_up, m_up) = (self._g(eps, offset, tail, cb, rb) for cb, rb in sums)
            whole = tail.mass * mass * (1.0 - rel)   # M_t M_B, from below
            charge_lo, charge_up = tail.mass * alias * (1.0 + rel), tail.mass * outside * (1.0 + rel)
            g = max(g_lo * (1.0 - rel) - charge_lo, whole - (m_up * (1.0 + rel) - g_up * (1.0 - rel)) - charge_up)
            h = max(m_lo * (1.0 - rel) - g_lo * (1.0 + rel) - charge_lo, whole - g_up * (1.0 + rel) - charge_up)
            g_total += n * max(g, 0.0)
            h_total += n * max(h, 0.0)
        return g_total * (1.0 - 2.0 * _F64_EPS), h_total * (1.0 - 2.0 * _F64_EPS)

    def _g(self, eps: float, offset: int, tail: _Tail, cb: np.ndarray, rb: np.ndarray) -> tuple[float, float]:
        """``(G(t * B)(eps), M_t M_B)`` for one tail and one array of ``B``'s masses (prefix sums ``cb``, decayed
        suffix sums ``rb``)."""
        # the pair (tail point k, B's point j) lies at (offset + k + j) h; it weighs 1 below eps and e^{eps - x}
        # from eps up, i.e. from B's point j0 - k up, where it weighs phi e^{(j0 - k - j) h}
        u = eps / self.h - offset
        j0 = math.ceil(u)
        phi = math.exp(min(0.0, (u - j0) * self.h))   # in (e^-h, 1]
        size_t, size_b = tail.size, cb.size - 1
        # tail points k >= j0 lie at or above eps minus B's least loss: every point of B weighs e^{eps - x}
        far = tail.suffix(0) * math.exp(j0 * self.h) if j0 < 0 else tail.suffix(min(j0, size_t))
        s = far * phi * rb[0]
        # tail points k <= j0 - size_b lie at or below eps minus B's largest loss: all of B weighs 1
        near = j0 - size_b + 1
        if near > 0:
            s += tail.prefix(min(near, size_t)) * cb[size_b]
        # the rest, B's point j = j0 - k for 0 < j < size_b: C_j + phi R_j
        lo, hi = max(0, near), min(size_t, j0)
        if lo < hi:
            seg, at = tail.t[lo:hi], slice(j0 - hi + 1, j0 - lo + 1)
            s += float(seg @ cb[at][::-1]) + phi * float(seg @ rb[at][::-1])
        return s, tail.mass * float(cb[size_b])


class OneLargeLoss:
    r"""A composition of steps split at their large losses, read with the exact terms where one step's loss is
    large.

    Each step ``p_i`` (``n_i`` copies) is split into a body ``b_i`` (losses below ``T_i``), a tail ``t_i`` (the
    largest losses) and its mass at ``+inf``.  With ``H(mu)(e) = sum_x mu(x) (1 - e^{e - x})_+`` (linear in the
    measure ``mu``; ``delta = H`` of the composed law), expand the composition multinomially: the terms without a
    tail loss are the bodies' composition, those with exactly one are ``sum_i n_i H(t_i * B_i)`` with ``B_i`` the
    bodies' composition less one copy of ``b_i`` (:class:`LargeLosses`), and those with two or more hold at most
    ``(sum_i n_i M_{t_i})^2 / 2`` of mass.

    * **Upper bound** (``base``: the bodies' composition with every tail moved to ``+inf``, which counts every term
      with a tail loss at its whole mass): ``base`` less ``sum_i n_i G(t_i * B_i)``, the part of the one-tail terms'
      mass that ``H`` does not count (``G = M - H``), evaluated for a lower bound of ``B_i`` (``G`` grows with
      mass, and falls as losses grow: the upper steps' losses are rounded up).
    * **Lower bound** (``base``: the bodies' composition, the tails dropped): ``base`` plus
      ``sum_i n_i H(t_i * B_i)`` for a lower bound of ``B_i`` (``H`` grows with mass, and with losses: the lower
      steps' are rounded down).

    Both are exact in the one-tail terms at every ``epsilon``; only the terms with two or more tail losses are
    charged whole (upper) or dropped (lower).  Split at a per-step tail of about ``sqrt(2 CUT delta) / n``, those
    hold at most ``CUT delta``, the same charge as the cut (:func:`truncated`), while the windows hold losses only up
    to where a step's tail is about ``sqrt(delta)`` rather than ``delta``.
    """

    def __init__(self, base: Pld, large: LargeLosses) -> None:
        self.base, self.large = base, large
        self.h, self.start, self.err, self.upper = base.h, base.start, base.err, base.upper
        self.pmf, self.inf = base.pmf, base.inf

    def delta(self, eps: float) -> float:
        d = self.base.delta(eps)
        g, h = self.large.bounds(eps)
        if self.upper:   # the difference rounded up
            return max(0.0, (d - g) * (1.0 + 2.0 * _F64_EPS))
        return min(1.0, (d + h) * (1.0 - 2.0 * _F64_EPS))

    def epsilon(self, delta: float) -> float:
        """The least ``eps >= 0`` with ``delta(eps) <= delta``, by bisection: the bracket's end on this bound's side
        (upper: a point where the upper curve is at most ``delta``; lower: the last where the lower one exceeds it,
        so the truth, non-increasing, exceeds it there too).  Above every loss of ``base`` and of the one-tail terms
        the curve is ``base``'s mass at ``+inf`` less, for the upper bound, the one-tail terms' whole mass."""
        if self.delta(0.0) <= delta:
            return 0.0
        hi = max(self.large.top, (self.base.start + self.base.pmf.size) * self.h) + self.h
        if self.delta(hi) > delta:   # the mass at +inf exceeds delta (a lower curve is 0 there: hi, not inf, if not)
            return math.inf if self.upper else hi
        lo = 0.0
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:
                break
            if self.delta(mid) > delta:
                lo = mid
            else:
                hi = mid
        return hi if self.upper else lo

    def tradeoff(self, alpha: np.ndarray) -> np.ndarray:
        raise NotImplementedError("a split composition answers epsilon and delta queries only")


def split_tails(events: list[tuple[Pld, int]], mass: float
                ) -> tuple[list[tuple[Pld, int]], list[tuple[int, int, np.ndarray]]] | None:
    """Each step cut at its largest losses, at most ``mass`` of P-mass per step, for :class:`OneLargeLoss`:
    ``(bodies, tails)``, the bodies with their counts (an upper body holds its tail at ``+inf``) and
    ``(event index, first grid index, masses)`` of each tail that holds any mass; ``None`` where no step has a
    tail that large, or a lower step has mass at ``+inf``."""
    upper = events[0][0].upper
    bodies, tails, any_tail = [], [], False
    for i, (p, n) in enumerate(events):
        j = _cut_index(p, mass)
        if (not upper and p.inf > 0) or not (p.pmf[:j] > 0).any():
            return None
        if j < p.pmf.size:
            tails.append((i, p.start + j, p.pmf[j:]))   # a view: the step itself is kept anyway
        m_t = float(p.pmf[j:].sum(dtype=np.longdouble))
        any_tail = any_tail or m_t > 0
        bodies.append((Pld(p.h, p.start, p.pmf[:j].copy(), min(1.0, p.inf + m_t * (1.0 + (p.pmf.size + 2) * _F64_EPS)),
                           True) if upper else Pld(p.h, p.start, p.pmf[:j].copy(), 0.0, False, p.slack), n))
    return (bodies, tails) if any_tail else None


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
    spectra : Spectra, optional
        The steps' transforms for the untilted pass, shared with compositions of the same steps (in the same
        order) at other counts (:class:`Spectra`).
    split : bool, optional
        Whether :meth:`epsilon` and :meth:`delta` first read the steps split at their large losses
        (:class:`OneLargeLoss`): for heavy-tailed steps (randomized clipping), whose cut windows otherwise hold
        millions of points.
    """

    def __init__(self, events: list[tuple[Pld, int]], tail: float, *, spectra: Spectra | None = None,
                 split: bool = False) -> None:
        first = events[0][0]
        self.h, self.upper = first.h, first.upper
        self.spectra = spectra
        self.single = first if (len(events) == 1 and events[0][1] == 1) else None
        self._full: Pld | None = None
        self._local: dict[tuple[float, bool], Pld] = {}
        self._tilts: dict[int | None, float | None] = {}   # delta read-outs' tilts (:meth:`_delta_tilt`)
        #: The FFT points of the passes read since the caller last set it to 0, cached or not, an extended-precision
        #: point counted EXTENDED_COST times (a single step: STEP_COST per point): a cost measure that, unlike a
        #: clock, is the same on every machine and in every order of queries (the accountant's refinement budget).
        self.work = 0 if self.single is None else STEP_COST * first.pmf.size
        self._spent = 0                                          # FFT points actually run (same units)
        self._costs: dict[tuple[float, bool] | None, int] = {}   # each cached pass's (None: full()'s) cost
        self.events, self._tail = events, tail   # the steps and their counts
        self.split = split   # queries read the steps split at their large losses first (:meth:`_split`)
        #: a composition of split steps: their tails (:func:`split_tails`), read into every pass (:class:`OneLargeLoss`)
        self.tails: list[tuple[int, int, np.ndarray]] | None = None
        self._large: LargeLosses | None = None
        self._large_cost = 0
        if self.single is not None:
            return
        self._cuts: dict[float, Composition] | None = {}   # compositions cut for epsilon queries (:meth:`_cut`)
        self._splits: dict[float, Composition | None] = {}   # ... and split (:meth:`_split`)
        self.factors = [Factor(p, n) for p, n in events]
        # 1 - prod (1 - inf_i)^n_i, in logs: 1 - inf rounds away all but a few digits of an inf near 1e-15 (at 10^6
        # steps 1e-14 each came out 0.07 % high, and 1e-21 each, 1e-15 in all, came out 0), rounded to the bound's side
        whole = -math.expm1(math.fsum(n * math.log1p(-p.inf) for p, n in events))
        self.inf = min(1.0, max(0.0, whole * (1.0 + (1e-12 if self.upper else -1e-12))))
        self._cumulants: dict = {}
        self.lo, self.hi, self.over, self.under = _window(self.factors, 0.0, tail, self.h, MAX_GRID // 2,
                                                          self._cumulants)
        self.slack = sum(p.slack * n for p, n in events)
        if max(self.over, self.under) > _MAX_CUT:
            # the step that would fit: the window's wider side, uncut, on half the points (its losses barely move
            # with the step, which only rounds them)
            mean = _tilted_stats(self.factors, 0.0)[0]
            lo, hi = _window(self.factors, 0.0, tail, self.h, 1 << 62)[:2]
            side = max(hi * self.h - mean, mean - lo * self.h)
            cut = max(self.over, self.under)
            # a Chernoff bound of 1 or more bounds nothing: say what it means, not "a mass of 1.0e+00"
            left = (f"that many leave a mass of up to {cut:.1e} outside" if cut < 0.1 else
                    "the Chernoff bound on the mass outside that many is no bound at all")
            raise GridTooLargeError(
                f"the composed privacy loss needs more than {MAX_GRID:,} grid points ({left}); "
                + grid_advice(self.h, 1.25 * side / (MAX_GRID // 2), max(abs(hi), abs(lo)) * self.h))

    def _pass(self, lam: float, extended: bool = False, trim: bool = False
              ) -> tuple[int, np.ndarray, np.ndarray] | None:
        """``(first index, values, error bounds)`` of one tilted pass, inside the untilted window (``trim``: from
        the first value that is not noise)."""
        w_lo, w_hi = (self.lo, self.hi) if lam == 0.0 else _window(self.factors, lam, _TILT_TAIL, self.h)[:2]
        a, b = max(self.lo, w_lo), min(self.hi, w_hi)
        if a > b or w_hi - w_lo + 1 > MAX_GRID:
            return None
        self._spent += (w_hi - w_lo + 1) * (EXTENDED_COST if extended else 1) * len(self.factors)
        return tilted_product(self.factors, lam, w_lo, w_hi, a, b, self.h, extended, trim, self.spectra)

    def _finish(self, start: int, value: np.ndarray, err: np.ndarray, lam: float) -> Pld | OneLargeLoss:
        pld = self._finished(start, value, err, lam)
        return pld if self.tails is None else OneLargeLoss(pld, self.large_losses())

    def large_losses(self) -> LargeLosses:
        """The tails of these (split) steps, each against the untilted composition of the bodies with one copy of its
        own fewer (built once; its points counted in :attr:`work` at every pass read, like a pass's own)."""
        if self._large is None:
            spent = self._spent
            parts = []
            for i, t_start, t in self.tails:
                rest = [(p, n - (j == i)) for j, (p, n) in enumerate(self.events) if n - (j == i) > 0]
                # B's finite mass, the product of the bodies' (in logs: up to 10^6 factors), from below
                log_mass = math.fsum(n * math.log(float(p.pmf.sum(dtype=np.longdouble))) for p, n in rest)
                mass = math.exp(log_mass) * (1.0 - 1e-9)
                alias = outside = 0.0
                if not rest:
                    b_start, b_low = 0, np.ones(1)
                    b_up = b_low
                elif len(rest) == 1 and rest[0][1] == 1:
                    b_start, b_low = rest[0][0].start, rest[0][0].pmf
                    b_up = b_low
                else:
                    comp = Composition(rest, self._tail)
                    # never None: its window is no wider than this composition's, which fits
                    b_start, val, err = comp._pass(0.0)
                    self._spent += comp._spent
                    b_low, b_up = np.maximum(val - err, 0.0), np.maximum(val, 0.0) + err
                    alias = outside = comp.under + comp.over   # an untilted window wraps its cut mass anywhere
                parts.append((self.events[i][1], t_start, t, b_start, b_low, b_up, mass, alias, outside))
            self._large = LargeLosses(self.h, parts)
            self._large_cost = self._spent - spent
        return self._large

    def _finished(self, start: int, value: np.ndarray, err: np.ndarray, lam: float) -> Pld:
        if self.upper:
            pmf = np.maximum(value, 0.0)
            pmf += err
            # mass below the pass moves up to its first point: at most what the pass does not hold
            lump = max(0.0, 1.0 - self.inf - float(np.maximum(value - err, 0.0).sum()))
            pmf[0] += lump
            return Pld(self.h, start, pmf, min(1.0, self.inf + self.over), True, err=err, lump=lump)
        # the untilted pass's window can alias its cut mass anywhere; a tilted pass's aliasing is in err
        slack = self.slack + (self.under + self.over if lam == 0.0 else 0.0)
        pmf = np.maximum(value - err, 0.0)
        return Pld(self.h, start, pmf, self.inf, False, slack, err=err)

    def _counted(self, key: tuple[float, bool] | None, build) -> None:
        """Run ``build`` (which caches its result) once for ``key``, and add its cost to :attr:`work` at every call,
        whether it ran now or earlier (the passes it ran itself, nested calls included, counted once); a split
        composition's :meth:`large_losses` pass is counted at every call too, like a pass of its own."""
        if self.tails is not None:
            self.large_losses()
            self.work += self._large_cost
        if key not in self._costs:
            spent, work = self._spent, self.work
            build()
            self._costs[key] = self._spent - spent
            self.work = work
        self.work += self._costs[key]

    def local(self, lam: float, extended: bool = False) -> Pld:
        """One pass under the tilt ``lam``, in extended precision if asked (cached)."""
        key = (lam, extended)
        self._counted(key, lambda: self._local_pass(lam, extended))
        return self._local[key]

    def _local_pass(self, lam: float, extended: bool) -> None:
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

    def full(self) -> Pld:
        """Every point of the window, each from the tilt with the smallest error bound (cached); a single step is its
        own PLD."""
        if self.single is not None:
            return self.single
        self._counted(None, self._full_pass)
        return self._full

    def _full_pass(self) -> None:
        if self._full is not None:
            return
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
        if not EXTENDED or pld.err is None or eps < pld.start * self.h:
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
        theta = chernoff(c["parts"], c["sd"] ** 2, c["sd"], dist=dist)[0]
        k0 = _cumulant_terms(c["parts"], theta)[0]     # K at the returned theta, whatever the search did
        if not math.isfinite(k0):
            return 1.0
        log_c = theta * math.log(theta) - (theta + 1.0) * math.log1p(theta)
        return min(1.0, self.inf + math.exp(min(0.0, k0 - theta * dist + log_c)))

    def pass_epsilon(self, delta: float, lam: float = 0.0) -> tuple[float, bool]:
        """``(epsilon, resolved)``: ``epsilon(delta)`` read from the one pass under the tilt ``lam`` (default: the
        untilted pass), a bound on this composition's side like every pass's, and whether that pass resolves it
        as :meth:`epsilon` asks of its passes (above the lumped first point, the error bounds above it at most
        ``_TILT_RTOL`` of ``delta``).  Where it does not, the bound may be loose and :meth:`epsilon` searches the
        tilts."""
        if self.single is not None:
            return self.single.epsilon(delta), True
        pld = self.local(lam)
        eps = pld.epsilon(delta)
        return eps, eps == math.inf or self._good(pld, eps, delta)

    def epsilon(self, delta: float) -> float:
        """``epsilon(delta)``: a bound on this composition's side, read from the composition of its steps cut for
        ``delta`` (:meth:`_cut`), by tilted passes centred near the answer."""
        if self.single is not None:
            return self.single.epsilon(delta)
        if self.upper and self.tails is None and self.inf > delta:
            return math.inf   # every pass holds the steps' mass at +inf: none reads a finite epsilon
        split = self._split(delta)
        if split is not None:
            return self._read_from(split, delta)
        cut = self._cut(delta)
        if cut is not self:
            return self._read_from(cut, delta)
        c = self._cumulants
        mean = c["mean"]
        # the tilt that minimises the Chernoff bound exp(K(theta) - theta u) at its delta quantile
        lam = _binned(_grid_tilt(c["parts"], c["sd"], -math.log(delta)))
        extended = False
        tried = []   # every pass's answer is a valid bound, only not always a tight one
        for _ in range(5):
            pld = self.local(lam, extended)
            eps = pld.epsilon(delta)
            if eps == math.inf or self._good(pld, eps, delta):
                # the tightest of every pass read: a pass whose tilted window would pass MAX_GRID falls back to
                # the untilted composition, whose FFT error floor puts a heavy-tailed composition's epsilon far
                # out (Hutch k = 8, d = 2048, sigma 4, q 1e-3, 10^4 steps, delta 1e-9: 58.29, where the first
                # tilt's pass, unresolved at 1.5 % of delta, read 13.71)
                return self._tightest([eps, *tried])
            tried.append(eps)
            if not extended and self._rounding_bound(pld, eps, delta):
                extended = True   # resolved, but rounding moves delta by over 1 %: the same pass, extended
                continue
            nxt = self._delta_tilt(eps) if eps > mean else 0.0
            if nxt is None or nxt == lam:
                break
            lam = nxt
        return self._tightest([self.full().epsilon(delta), *tried])

    def _read_from(self, cut: Composition, delta: float) -> float:
        """``cut.epsilon(delta)``, its passes counted as this query's cost."""
        work, spent = cut.work, cut._spent
        eps = cut.epsilon(delta)
        self.work += cut.work - work
        self._spent += cut._spent - spent
        return eps

    def _split(self, delta: float) -> Composition | None:
        """These steps split at their large losses for ``delta`` (:func:`split_tails`, read as :class:`OneLargeLoss`):
        up to ``sqrt(2 CUT delta)`` of P-mass over all steps, rounded down to a power of 10 (cached), so that the terms
        with two or more large losses, charged whole, hold at most ``CUT delta``; ``None`` where nothing is split."""
        level = math.sqrt(2.0 * CUT * delta)
        if not self.split or self._cuts is None or not level > 1e-300:
            return None
        mass = 10.0 ** math.floor(math.log10(level))
        if mass not in self._splits:
            split = split_tails(self.events, mass / sum(n for _, n in self.events))
            comp = None
            # worth a composition of its own only where it cuts the steps' grids to an eighth or less: heavy tails
            # (Hutch k 8 to 32: 0.4 to 7 % of the points kept); a Gaussian tail's keeps a quarter, Hutch k 64's a sixth
            kept = sum(p.pmf.size for p, _ in split[0]) if split is not None else 0
            if split is not None and 8 * kept <= sum(p.pmf.size for p, _ in self.events):
                comp = Composition(split[0], self._tail)
                comp._cuts, comp.tails = None, split[1]
            if len(self._splits) >= 4:
                self._splits.pop(next(iter(self._splits)))
            self._splits[mass] = comp
        return self._splits[mass]

    def _cut(self, delta: float) -> Composition:
        """These steps with their largest losses cut for ``delta`` (:func:`truncated`: at most :data:`CUT` times
        ``delta`` over all steps, rounded down to a power of 10 so that nearby deltas share one, cached), or this
        composition where nothing is cut.  The cut mass is charged at ``+inf`` (upper bound) or moved down (lower),
        so the answer is a bound on the same side; where it is small against ``delta`` the answer barely moves,
        while the tilted passes' windows need no longer hold the steps' farthest losses."""
        level = CUT * delta
        if self._cuts is None or not level > 1e-300:   # a cut composition is not cut again
            return self
        mass = 10.0 ** math.floor(math.log10(level))
        if mass not in self._cuts:
            total = sum(n for _, n in self.events)
            events = [(truncated(p, mass / total), n) for p, n in self.events]
            cut = self
            if any(c is not p for (c, _), (p, _) in zip(events, self.events, strict=True)):
                # no shared spectra: they hold the transforms of the steps before the cut
                cut = Composition(events, self._tail)
                cut._cuts = None
            if len(self._cuts) >= 4:
                self._cuts.pop(next(iter(self._cuts)))
            self._cuts[mass] = cut
        return self._cuts[mass]

    def delta(self, eps: float) -> float:
        """``delta(eps)``: a bound on this composition's side, the tightest of the tilted passes read (each pass's
        value is a bound; a pass is enough once its error bounds move delta by at most ``_TILT_RTOL`` of it).

        The passes, in order: float64 under the binned tilt centred at ``eps`` (:meth:`_delta_tilt`); then the
        passes an epsilon query at about this delta reads (the steps cut for it, :meth:`_cut`; the binned Chernoff
        tilt at its level, then the binned tilt centred at its answer; float64, then extended precision), so that a
        delta read back at an epsilon meets the pass that epsilon came from (cached) and the two agree; then the
        first tilt in extended precision; then the untilted composition of every point."""
        if self.single is not None:
            return self.single.delta(eps)
        # split steps first (cheap: their windows hold losses up to where a step's tail is about sqrt(delta)), at the
        # level the last read gave, from the Chernoff bound on, until that level's split is the one read
        level = min(1.0, self.delta_bound(eps)) if self.split else 0.0
        tried: list[float] = []
        for _ in range(_SPLIT_TRIES):
            split = self._split(level)
            if split is None:
                break
            d = split.delta(eps)
            tried.append(d)
            if self._split(d) is split or not d > 0:
                return self._tightest(tried)
            level = d
        if self.upper and tried and self.inf >= 0.5 * min(tried):
            # the steps' mass at +inf (beyond the loss cap) holds half the split's reading or more: no pass reads below
            # it, and the accountant leaves such a grid for a coarser one (its ``capped``), so the costly unsplit
            # passes are not run (Hutch k 4, 51 steps, epsilon 2,600: two 11M-point passes, 6 s and 2 GB)
            return min(tried)

        def good(comp: Composition, lam: float, extended: bool) -> bool | None:
            """Read one pass into ``tried``: whether it is enough (``None``: it does not resolve ``eps``)."""
            pld = comp.local(lam, extended)
            d = pld.delta(eps)
            tried.append(d)
            # a tilt whose pass falls back to the untilted composition is not enough: that pass's FFT error floor
            # (1e-8 at 7.8M points) is what the tilts are for
            return None if eps < pld.start * self.h else (comp._good(pld, eps, d) and pld is not comp._full)

        lam = self._delta_tilt(eps) if eps > self._cumulants["mean"] else 0.0
        if lam is not None and good(self, lam, False):
            return self._tightest(tried)
        # the passes an epsilon query at this delta reads; where they bring delta down by more than half, again at
        # the new level (a flat curve, e.g. a heavy-tailed scale, read 1e-8 on the first pass where epsilon's own
        # pass at 1e-9 was resolved: the Chernoff tilt depends on the level)
        seen: set[tuple[int, float]] = set()
        for _ in range(_DELTA_LEVELS):
            if not tried:
                break
            read = max(tried) if not self.upper else min(tried)
            cut = self._split(read)
            if cut is None:
                cut = self._cut(read)
            c = cut._cumulants
            level = -math.log(max(min(tried), 1e-300))
            tilts = [t for t in dict.fromkeys((_binned(_grid_tilt(c["parts"], c["sd"], level)),
                                               cut._delta_tilt(eps) if eps > c["mean"] else None))
                     if t and (id(cut), t) not in seen]
            if not tilts:
                break
            for tilt in tilts:
                seen.add((id(cut), tilt))
                for extended in (False, True) if EXTENDED else (False,):
                    ok = good(cut, tilt, extended)
                    if ok:
                        return self._tightest(tried)
                    if ok is None:
                        break
            if not self._tightest(tried) < 0.5 * read:
                break
        if tried and (cut := self._cut(max(tried) if not self.upper else min(tried))) is not self:
            # where no tilt is enough, an epsilon query at this delta ends on the cut steps' untilted composition (its
            # cut mass charged, at most CUT of the level read): so does this read, before the uncut steps' passes
            # (SubsampledGaussian(0.5, 1e-6), 10^4 steps, h 1.25e-5: their extended pass at epsilon's answer took
            # 3.4 s and 45M points a bound, 2.2 GB; the cut's, 1.6 s and 9M, already built by that epsilon query)
            return self._tightest([cut.full().delta(eps), *tried])
        if lam is not None and EXTENDED and good(self, lam, True):
            return self._tightest(tried)
        return self._tightest([self.full().delta(eps), *tried])

    def _delta_tilt(self, eps: float) -> float | None:
        """The tilt centred at ``eps`` for a delta read-out, ``eps`` and the tilt both rounded to their bins
        (:func:`tilt_bin`; a tilt is only a choice, and every pass is checked): nearby epsilons (an epsilon, then the
        delta read back at it and nudged) share one search and one pass."""
        key = tilt_bin(eps) if eps > 0 else None
        if key not in self._tilts:
            lam = _tilt_for_mean(self.factors, eps if key is None else 2.0 ** (key / TILT_BINS), 0.0, 1.0)
            self._tilts[key] = _binned(lam) if lam else lam
        return self._tilts[key]

    def _tightest(self, values: list[float]) -> float:
        """The tightest of several valid bounds (the smallest upper, the largest lower)."""
        return min(values) if self.upper else max(values)

    def tradeoff(self, alpha: np.ndarray) -> np.ndarray:
        return (self.single if self.single is not None else self.full()).tradeoff(alpha)

    @property
    def inf_mass(self) -> float:
        return self.single.inf if self.single is not None else min(1.0, self.inf + self.over)

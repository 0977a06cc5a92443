r"""Distribution functions of non-negative mixtures of chi-square variables.

The object of study is

.. math::

    Q = \sum_{j=1}^{m} w_j\,\chi^2(\nu_j), \qquad w_j \ge 0,\ \nu_j > 0,

with independent summands.  Equal weights are merged first (``w chi2(a) + w chi2(b) = w chi2(a+b)``),
so the number of *distinct* weights, the number of blocks, decides the method:

* **one block**: the regularized incomplete gamma function (scipy / mpmath);
* **two blocks** (the hot path of the randomized-clipping envelope): a one-dimensional convolution
  ``P(V + W <= x) = int_0^x f_V(v) F_W(x - v) dv`` of two gamma laws, integrated by Gauss-Legendre on
  panels that are placed around the integrand's mode (found by golden-section search on the
  log-integrand) and its ``exp(-48)`` level set (found by bisection).  Because the panels follow the
  mass wherever it is, the same routine is accurate in the bulk and keeps *relative* accuracy deep in
  the left tail, where a fixed-node rule or Imhof's inversion would return only absolute accuracy;
* **three or more blocks**: Ruben's (1962) series, a mixture of central chi-square laws with
  non-negative coefficients, truncated with an explicit bound on the discarded mass, while it is
  short (at most 1000 terms: its recursion costs the square of its length).  Otherwise, and in the
  right tail of sf and pdf where the series' truncation is only an absolute bound,
  :func:`~dpmath.contour.contour_inversion` (:mod:`dpmath.contour`): the moment generating function inverted on
  a hyperbola through the saddle point, with an error bound, for weights over any number of decades (~0.1 ms per point
  for a few blocks, 3-10 ms for 2000 distinct weights).  Blocks too light to move the sum by
  ``1e-14 x`` are dropped first (:func:`_drop_negligible` states the bound).

Error: the panel quadrature agrees with the mpmath reference to about ``1e-14`` absolute in the bulk and
``1e-10`` relative in the left tail (see ``tests/dpmath/test_chi2mix.py``); Ruben's series is truncated when the
discarded coefficient mass is below ``1e-17``; the contour inversion targets ``1e-14`` relative and
returns its bound.  The arbitrary-precision path (``precision=`` digits, :mod:`dpmath.chi2mix_mpmath`) evaluates
Ruben's series term by term in mpmath, or, when that series is too long, mpmath's tanh-sinh quadrature of the
convolution integral (two blocks) or of the contour integral on a different hyperbola (three or more); it is the
reference the tests compare against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike
from scipy import special

from .chi2mix_mpmath import mpmath_evaluate
from .contour import contour_inversion
from .validation import real_array

__all__ = [
    "chi2_mixture_cdf",
    "chi2_mixture_sf",
    "chi2_mixture_pdf",
    "two_block_cdf",
]

_LEVEL_DROP = 48.0  # panels cover the set where the integrand exceeds exp(-48) of its maximum
_GOLDEN_ITERS = 52
_BISECT_ITERS = 40
_GL_ORDER = 40
_RUBEN_TAIL = 1e-17
_RUBEN_MAX_TERMS = 1000  # beyond this the O(terms^2) recursion costs more than the contour inversion
_GOLD = (np.sqrt(5.0) - 1.0) / 2.0

_gl_t, _gl_w = np.polynomial.legendre.leggauss(_GL_ORDER)
_GL_T = (_gl_t + 1.0) / 2.0  # nodes on (0, 1)
_GL_W = _gl_w / 2.0
_SS_T = _GL_T * _GL_T * (3.0 - 2.0 * _GL_T)
_SS_W = _GL_W * 6.0 * _GL_T * (1.0 - _GL_T)


# ----------------------------------------------------------------------------------------------
# log-densities and log-distribution functions of Gamma(shape, scale), accurate in both tails


def _stirling_tail(a: np.ndarray) -> np.ndarray:
    """``gammaln(a) - [(a - 1/2) log a - a + log(2 pi) / 2]``, without cancellation for large a."""
    a = np.asarray(a, dtype=np.float64)
    big = a >= 15.0
    safe = np.where(big, a, 15.0)
    r = 1.0 / (safe * safe)
    series = (1.0 / 12.0 - r * (1.0 / 360.0 - r * (1.0 / 1260.0 - r / 1680.0))) / safe
    small = np.where(big, 1.0, a)
    direct = special.gammaln(small) - ((small - 0.5) * np.log(small) - small + 0.5 * np.log(2.0 * np.pi))
    return np.where(big, series, direct)


def _gamma_log_norm(shape: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The part of :func:`_gamma_logpdf` that does not depend on ``w`` (computed once per quadrature)."""
    return 0.5 * np.log(shape) - 0.5 * np.log(2.0 * np.pi) - _stirling_tail(shape) - np.log(scale)


def _gamma_logpdf(w: np.ndarray, shape: np.ndarray, scale: np.ndarray, norm: np.ndarray | None = None
                  ) -> np.ndarray:
    # log of z^(a-1) e^-z / Gamma(a) / scale written as -a (u - log1p(u)) + ... with z = a (1 + u):
    # the naive form subtracts terms of size a log a and loses ~a * 1e-16 (1e-11 at a = 3e4)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = w / scale
        t = z / shape
        u = t - 1.0
        # u - log1p(u) near t = 1; t - 1 - log(t) elsewhere (1 + u rounds to 0 when t < 1e-16)
        dev = np.where(np.abs(u) < 0.5, u - np.log1p(u), u - np.log(t))
        out = -shape * dev + (_gamma_log_norm(shape, scale) if norm is None else norm) - np.log(z)
    return np.where(w > 0, out, -np.inf)


def _gamma_logcdf(w: np.ndarray, shape: np.ndarray, scale: np.ndarray) -> np.ndarray:
    z = np.where(w > 0, w / scale, 0.0)
    p = special.gammainc(shape, z)
    with np.errstate(divide="ignore"):
        out = np.log(p)
    tiny = (p < 1e-280) & (z > 0)
    if not tiny.any():   # the usual case, in the quadrature's inner loop: no broadcast copies
        return np.where(w > 0, out, -np.inf)
    shape, z = np.broadcast_to(shape, out.shape), np.broadcast_to(z, out.shape)
    # below 1e-280 gammainc loses digits. P(a, z) = z^a e^-z / Gamma(a+1) * M(1, a+1, z), but
    # hyp1f1 sums ~sqrt(a) terms there (0.03 s per 5000 values at a = 1.6e10): large shapes take
    # Temme's uniform expansion instead
    small = tiny & (shape <= _TEMME_SHAPE)
    if small.any():
        a, zt = shape[small], z[small]
        out[small] = a * np.log(zt) - zt - special.gammaln(a + 1.0) + np.log(special.hyp1f1(1.0, a + 1.0, zt))
    large = tiny & (shape > _TEMME_SHAPE)
    if large.any():
        out[large] = _log_p_temme(shape[large], z[large])
    return np.where(w > 0, out, -np.inf)


_TEMME_SHAPE = 1e5


def _log_p_temme(a: np.ndarray, z: np.ndarray) -> np.ndarray:
    """``log P(a, z)`` for large a and z < a (the lower tail) by Temme's uniform expansion
    (DLMF 8.12.3-8.12.8): ``P = erfc(-eta sqrt(a/2))/2 - R_a(eta)``,
    ``R_a ~ e^{-a eta^2/2} / sqrt(2 pi a) (c_0 + c_1 / a)``; the dropped ``c_2 / a^2`` is below
    ``1e-10`` relative for ``a > 1e5``.  Written as ``e^{-a eta^2/2} [erfcx(t)/2 - (c_0 + c_1/a)/sqrt(2 pi a)]``
    with ``t = -eta sqrt(a/2)`` so that nothing underflows."""
    u = z / a - 1.0                                # lambda - 1 in DLMF's notation
    eta = -np.sqrt(2.0 * (u - np.log1p(u)))        # z < a: eta < 0
    c0 = 1.0 / u - 1.0 / eta
    c1 = 1.0 / eta**3 - 1.0 / u**3 - 1.0 / u**2 - 1.0 / (12.0 * u)
    t = -eta * np.sqrt(a / 2.0)
    bracket = 0.5 * special.erfcx(t) - (c0 + c1 / a) / np.sqrt(2.0 * np.pi * a)
    return -t * t + np.log(bracket)


def _gamma_logsf(w: np.ndarray, shape: np.ndarray, scale: np.ndarray) -> np.ndarray:
    z = np.where(w > 0, w / scale, 0.0)
    q = special.gammaincc(shape, z)
    with np.errstate(divide="ignore"):
        out = np.log(q)
    tiny = q < 1e-280
    if tiny.any():
        shape, z = np.broadcast_to(shape, out.shape), np.broadcast_to(z, out.shape)
        # Q(a, z) = z^a e^-z U(1, 1+a, z) / Gamma(a)
        a, zt = shape[tiny], z[tiny]
        out[tiny] = a * np.log(zt) - zt - special.gammaln(a) + np.log(special.hyperu(1.0, 1.0 + a, zt))
    return np.where(w > 0, out, 0.0)


# ----------------------------------------------------------------------------------------------
# the panel quadrature of int_0^x f_V(v) g(x - v) dv


def _argmax_unimodal(f: Callable[[np.ndarray], np.ndarray], hi: np.ndarray) -> np.ndarray:
    """Golden-section search for the maximiser of ``f`` on ``(0, hi)``, elementwise."""
    a = np.zeros_like(hi)
    b = hi.copy()
    c = b - _GOLD * (b - a)
    d = a + _GOLD * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(_GOLDEN_ITERS):
        left = fc >= fd  # keep [a, d]
        b = np.where(left, d, b)
        a = np.where(left, a, c)
        new_c = np.where(left, b - _GOLD * (b - a), d)
        new_d = np.where(left, c, a + _GOLD * (b - a))
        fnew = f(np.where(left, new_c, new_d))
        fc, fd = np.where(left, fnew, fd), np.where(left, fc, fnew)
        c, d = new_c, new_d
    # a maximiser that never left an end of the interval is that end: snapping it there lets the
    # smoothstep panels absorb a power-law singularity (v^(-1/2) for one degree of freedom) exactly
    return np.where(a == 0.0, 0.0, np.where(b == hi, hi, (a + b) / 2.0))


def _level_point(f: Callable[[np.ndarray], np.ndarray], inside: np.ndarray, outside: np.ndarray,
                 level: np.ndarray) -> np.ndarray:
    """Bisection for the point between ``inside`` (f >= level) and ``outside`` where f crosses level."""
    inside, outside = inside.copy(), outside.copy()
    for _ in range(_BISECT_ITERS):
        mid = (inside + outside) / 2.0
        above = f(mid) >= level
        inside = np.where(above, mid, inside)
        outside = np.where(above, outside, mid)
    return outside


def _panel_sum(log_h: Callable[[np.ndarray], np.ndarray], lo: np.ndarray, hi: np.ndarray,
               peak: np.ndarray) -> np.ndarray:
    t, w = _SS_T, _SS_W
    width = (hi - lo)[..., None]
    nodes = lo[..., None] + width * t
    vals = np.exp(log_h(nodes) - peak[..., None])
    return np.sum(vals * w, axis=-1) * width[..., 0]


def _convolve(x: np.ndarray, log_f: Callable[[np.ndarray, bool], np.ndarray],
              log_g: Callable[[np.ndarray, bool], np.ndarray]) -> np.ndarray:
    r"""``int_0^x f(v) g(x - v) dv`` elementwise over x > 0, from ``log f`` and ``log g``.

    ``log_f(v, nodes)`` and ``log_g(w, nodes)`` return logs; their argument carries a trailing
    quadrature-node axis when ``nodes`` is True.  The integrand is unimodal for every case used
    here (a log-concave density times a log-concave distribution function, or a product of two
    decreasing factors), so the mode and the
    two ``exp(-48)`` level points split ``(0, x)`` into four panels: the two inner ones carry the
    mass, the two outer ones catch what is left.  Every panel uses Gauss-Legendre after the
    smoothstep map ``t -> 3t^2 - 2t^3``, which turns power-law endpoint behaviour (``v^(-1/2)`` for
    one degree of freedom) into a smooth integrand.
    """
    x = np.asarray(x, dtype=np.float64)

    def log_h(v: np.ndarray) -> np.ndarray:
        if v.ndim > x.ndim:
            return log_f(v, True) + log_g(x[..., None] - v, True)
        return log_f(v, False) + log_g(x - v, False)

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        mode = _argmax_unimodal(log_h, x)
        peak = log_h(mode)
        peak = np.where(np.isfinite(peak), peak, 0.0)
        level = peak - _LEVEL_DROP
        # both level points in one bisection, stacked on a trailing axis (as quadrature nodes are): half the
        # calls, whose fixed cost dominates for the few points an envelope search evaluates at a time
        left, right = np.moveaxis(_level_point(log_h, np.stack([mode, mode], axis=-1),
                                               np.stack([np.zeros_like(x), x], axis=-1), level[..., None]), -1, 0)
        zero = np.zeros_like(x)
        total = (_panel_sum(log_h, zero, left, peak)
                 + _panel_sum(log_h, left, mode, peak)
                 + _panel_sum(log_h, mode, right, peak)
                 + _panel_sum(log_h, right, x, peak))
        out = total * np.exp(peak)
    return np.where(np.isfinite(out), out, 0.0)


# ----------------------------------------------------------------------------------------------
# blocks: (weights, dof) merged by equal weight


def _blocks(weights: ArrayLike, dof: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    w = real_array(weights, "weights", allow_inf=False).ravel()
    if w.size == 0:
        raise ValueError("weights must contain at least one entry")
    if (w < 0).any():
        raise ValueError("weights must be non-negative (>= 0)")
    nu = real_array(dof, "dof", allow_inf=False)
    nu = np.broadcast_to(nu, w.shape).astype(np.float64) if nu.ndim == 0 else nu.ravel()
    if nu.shape != w.shape:
        raise ValueError(f"dof must be a scalar or have the length of weights ({w.size}), got {nu.size}")
    if (nu <= 0).any():
        raise ValueError("dof must be positive (> 0)")
    keep = w > 0
    if not keep.any():
        raise ValueError("weights must have at least one positive entry")
    uniq, inv = np.unique(w[keep], return_inverse=True)
    return uniq, np.bincount(inv, weights=nu[keep])


@functools.lru_cache(maxsize=64)
def _ruben_coefficients(w_key: tuple[float, ...], nu_key: tuple[float, ...], tail: float,
                        max_terms: int) -> np.ndarray | None:
    """Coefficients c_m of Ruben's series (beta = min w), up to a discarded mass below ``tail``
    (None: more than ``max_terms`` needed).  Cached: the group split evaluates one mixture at many
    points, one batch at a time.

    ``c_m = (1/m) sum_{l=1..m} g_l c_{m-l}`` with ``g_l = sum_j (nu_j / 2) q_j^l``, ``q_j = 1 - beta/w_j``.
    """
    w, nu = np.asarray(w_key), np.asarray(nu_key)
    beta = float(w.min())
    q = 1.0 - beta / w
    c0 = np.exp(float(np.sum(0.5 * nu * np.log(beta / w))))
    if c0 == 0.0:
        return None
    size = 256
    c = np.zeros(size)
    g = np.zeros(size)
    c[0] = c0
    total = c0
    m = 0
    q_max = float(q.max())
    while True:
        m += 1
        if m >= max_terms:
            return None
        if m >= size:
            size *= 2
            c = np.concatenate([c, np.zeros(size - c.size)])
            g = np.concatenate([g, np.zeros(size - g.size)])
        g[m] = float(np.sum(0.5 * nu * q**m))
        # sum_{l=1..m} g_l c_{m-l}: g[1..m] against c[m-1..0]
        c[m] = float(np.dot(g[1:m + 1], c[m - 1::-1])) / m
        total += c[m]
        if 1.0 - total <= tail:
            break
        # past the mode the ratios c_{m+1}/c_m decrease to q_max (log-concave coefficients) or rise
        # to it (chi2(1) blocks): the rest is at most c_m rho / (1 - rho), rho = max(c_m/c_{m-1}, q_max)
        if 0.0 < c[m] < c[m - 1]:
            rho = max(c[m] / c[m - 1], q_max)
            if c[m] * rho / (1.0 - rho) <= tail:
                break
    return c[: m + 1]


def _ruben(x: np.ndarray, w: np.ndarray, nu: np.ndarray, kind: str):
    beta = float(w[0])
    c = _ruben_coefficients(tuple(w.tolist()), tuple(nu.tolist()), _RUBEN_TAIL, _RUBEN_MAX_TERMS)
    if c is None:
        return None
    n = nu.sum() + 2.0 * np.arange(c.size)
    y = (x / beta)[..., None]
    shape = n / 2.0
    if kind == "cdf":
        terms = special.gammainc(shape, y / 2.0)
    elif kind == "sf":
        terms = special.gammaincc(shape, y / 2.0)
    else:
        terms = np.exp(_gamma_logpdf(y, shape, 2.0)) / beta
    return terms @ c


def _mixture(x: np.ndarray, w: np.ndarray, nu: np.ndarray, kind: str) -> np.ndarray:
    """cdf / sf / pdf at x > 0 for merged blocks (ascending weights)."""
    w, nu = _drop_negligible(float(np.min(x)), w, nu)
    if w.size == 1:
        shape, scale = nu[0] / 2.0, 2.0 * w[0]
        if kind == "cdf":
            return special.gammainc(shape, x / scale)
        if kind == "sf":
            return special.gammaincc(shape, x / scale)
        return np.exp(_gamma_logpdf(x, shape, scale))
    if w.size == 2:
        return _two_block(x, w[1], nu[1], w[0], nu[0], kind)
    out = _ruben(x, w, nu, kind)
    if out is None:
        return contour_inversion(x, w, nu, kind)[0]
    # the discarded coefficient mass (< 1e-17) bounds the sf and pdf errors only absolutely: in the
    # right tail invert instead, which keeps relative accuracy
    scale = 1.0 if kind == "sf" else float(np.sqrt(2.0 * np.sum(nu * w * w)))
    tail = (kind != "cdf") & (x > np.sum(nu * w)) & (out * scale < 1e-9)
    if np.any(tail):
        out[tail] = contour_inversion(x[tail], w, nu, kind)[0]
    return out


def _drop_negligible(x_min: float, w: np.ndarray, nu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop the lightest blocks while they can move the sum by less than ``1e-14 x`` (w.p. 1 - 1e-15).

    ``T = sum_j w_j chi2(nu_j)`` over dropped blocks satisfies ``P(T > t) < 1e-15`` for
    ``t = sum_j w_j (nu_j + 12 sqrt(nu_j) + 60)`` (a chi-square Chernoff bound per block), and
    ``F(x - t) <= F_with(x) <= F(x)``, so the relative change of the cdf is at most about
    ``(N/2) t / x``: below ``1e-12`` for N < 200 degrees of freedom.
    """
    reach = np.cumsum(w * (nu + 12.0 * np.sqrt(nu) + 60.0))
    keep_from = int(np.searchsorted(reach, 1e-14 * x_min, side="right"))
    keep_from = min(keep_from, w.size - 1)
    return w[keep_from:], nu[keep_from:]


# ----------------------------------------------------------------------------------------------
# two blocks: the panel quadrature of the convolution of two gamma laws


def _two_block(x: np.ndarray, a: ArrayLike, n1: ArrayLike, b: ArrayLike, n2: ArrayLike,
               kind: str) -> np.ndarray:
    """P(a chi2(n1) + b chi2(n2) <= x) (or sf / pdf) for a, b > 0, broadcast over every argument."""
    x, a, n1, b, n2 = np.broadcast_arrays(*(np.asarray(t, dtype=np.float64) for t in (x, a, n1, b, n2)))
    # integrate over the block with the smaller spread: the other one's cdf is then smooth across
    # the panels, and the panels only have to follow one bump
    swap = a * a * n1 < b * b * n2
    shape_v = np.where(swap, n1, n2) / 2.0
    scale_v = 2.0 * np.where(swap, a, b)
    shape_w = np.where(swap, n2, n1) / 2.0
    scale_w = 2.0 * np.where(swap, b, a)
    fn = {"cdf": _gamma_logcdf, "sf": _gamma_logsf, "pdf": _gamma_logpdf}[kind]

    norm_v = _gamma_log_norm(shape_v, scale_v)   # the same at every node: computed once

    def log_f(v: np.ndarray, nodes: bool) -> np.ndarray:
        if nodes:
            return _gamma_logpdf(v, shape_v[..., None], scale_v[..., None], norm_v[..., None])
        return _gamma_logpdf(v, shape_v, scale_v, norm_v)

    def log_g(u: np.ndarray, nodes: bool) -> np.ndarray:
        if nodes:
            return fn(u, shape_w[..., None], scale_w[..., None])
        return fn(u, shape_w, scale_w)

    out = _convolve(x, log_f, log_g)
    if kind == "sf":
        out = out + special.gammaincc(shape_v, x / scale_v)
    # the golden-section search for the integrand's mode resolves (0, x) to ~1e-11 x: a block whose mass
    # sits far below that (weights 1e15 apart) is missed and the panels land in the wrong place (0.53753
    # instead of 0.53716 for weights (1/4, 2e-16), 4 dof each, at x = 0.9); invert those instead
    tiny = scale_v * (shape_v + 20.0 * np.sqrt(shape_v) + 50.0) < 1e-8 * x
    for idx in zip(*np.nonzero(tiny), strict=True):
        out[idx] = contour_inversion(x[idx], [scale_v[idx] / 2.0, scale_w[idx] / 2.0],
                                     [2.0 * shape_v[idx], 2.0 * shape_w[idx]], kind)[0]
    return out


# ----------------------------------------------------------------------------------------------
# public API


def _evaluate(x: ArrayLike, weights: ArrayLike, dof: ArrayLike, kind: str,
              precision: int | None) -> np.ndarray:
    w, nu = _blocks(weights, dof)
    xs = real_array(x, "x")
    if precision is not None:
        return mpmath_evaluate(xs, w, nu, kind, precision)
    out = np.empty(xs.shape, dtype=np.float64)
    pos = (xs > 0) & np.isfinite(xs)
    if kind == "cdf":
        out[...] = np.where(xs > 0, 1.0, 0.0)
    elif kind == "sf":
        out[...] = np.where(xs > 0, 0.0, 1.0)
    else:
        out[...] = 0.0
    if pos.any():
        out[pos] = _mixture(xs[pos], w, nu, kind)
    if kind != "pdf":
        np.clip(out, 0.0, 1.0, out=out)
    return out[()] if out.ndim == 0 else out


def chi2_mixture_cdf(x: ArrayLike, weights: ArrayLike, dof: ArrayLike = 1,
                     *, precision: int | None = None) -> np.ndarray:
    r"""Distribution function of a non-negative mixture of independent chi-square variables.

    .. math::

        F(x) = P\Big(\sum_j w_j\, \chi^2(\nu_j) \le x\Big),\qquad w_j \ge 0,\ \nu_j > 0 .

    Parameters
    ----------
    x : array_like
        Points (same units as the weights times a chi-square); ``x <= 0`` gives 0 and ``+inf``
        gives 1. NaN raises ``ValueError``.
    weights : array_like
        Non-negative weights ``w_j``, at least one positive. Zero weights drop out.
    dof : array_like, optional
        Degrees of freedom ``nu_j > 0`` (real values allowed), a scalar or one per weight.
    precision : int, optional
        If given, the number of decimal digits of an mpmath evaluation; the result is then an object
        array of ``mpmath.mpf``. This is the reference path the tests compare the float64 path with.

    Returns
    -------
    ndarray
        ``F(x)`` in [0, 1], shaped like ``x``.

    Notes
    -----
    Equal weights are merged first. One block is a scaled chi-square; two blocks use the panel
    quadrature of the convolution integral (accurate to ~1e-14 absolute, and relatively in the left
    tail); three or more use Ruben's positive series when it is short and otherwise
    :func:`~dpmath.contour.contour_inversion` (relative error ~1e-14 with a bound, for weights over any spread).

    Examples
    --------
    >>> from dpmath import chi2_mixture_cdf
    >>> round(float(chi2_mixture_cdf(1.5, [1/3, 1/3, 1/3])), 4)   # P(chi2(3) <= 4.5)
    0.7877
    >>> float(chi2_mixture_cdf(2.0, [0.5, 0.5], dof=[1, 1]))      # 1 - exp(-2)
    0.8646647167633873
    """
    return _evaluate(x, weights, dof, "cdf", precision)


def chi2_mixture_sf(x: ArrayLike, weights: ArrayLike, dof: ArrayLike = 1,
                    *, precision: int | None = None) -> np.ndarray:
    r"""Survival function ``P(sum_j w_j chi2(nu_j) > x)`` of a chi-square mixture.

    Computed directly (not as ``1 - cdf``), so it keeps relative accuracy in the right tail:
    for two blocks ``S(x) = S_V(x) + int_0^x f_V(v) S_W(x - v) dv``.  Arguments as in
    :func:`chi2_mixture_cdf`.

    Examples
    --------
    >>> from dpmath import chi2_mixture_sf
    >>> float(chi2_mixture_sf(2.0, [0.5, 0.5]))   # exp(-2)
    0.1353352832366127
    """
    return _evaluate(x, weights, dof, "sf", precision)


def chi2_mixture_pdf(x: ArrayLike, weights: ArrayLike, dof: ArrayLike = 1,
                     *, precision: int | None = None) -> np.ndarray:
    r"""Density of a chi-square mixture, ``d/dx P(sum_j w_j chi2(nu_j) <= x)``.

    For two blocks, ``f(x) = int_0^x f_V(v) f_W(x - v) dv``. Arguments as in
    :func:`chi2_mixture_cdf`; ``x <= 0`` gives 0.

    Examples
    --------
    >>> from dpmath import chi2_mixture_pdf
    >>> round(float(chi2_mixture_pdf(1.0, [0.5, 0.5])), 12)   # exp(-1)
    0.367879441171
    """
    return _evaluate(x, weights, dof, "pdf", precision)


def two_block_cdf(x: ArrayLike, lam: ArrayLike, i: ArrayLike, j: ArrayLike, k: int) -> np.ndarray:
    r"""Hot-path CDF of the two-block form ``S(i, j, lam)`` of the randomized-clipping envelope.

    .. math::

        S(i, j, \lambda) = \frac{\lambda}{ik}\chi^2(ik) + \frac{1-\lambda}{jk}\chi^2(jk),

    the mean-one mixture that puts weight ``lam / i`` on ``i`` coordinates and ``(1 - lam) / j`` on
    ``j`` others (each coordinate a ``chi2(k)/k``). All arguments broadcast; ``lam`` in [0, 1],
    ``i, j >= 0`` with ``j = 0`` only where ``lam = 1`` (and ``i = 0`` only where ``lam = 0``).
    No validation: this is the inner loop of :class:`dpmath.HutchEnvelope`.

    Examples
    --------
    >>> from dpmath import two_block_cdf
    >>> round(float(two_block_cdf(1.5, 1.0, 3, 0, 1)), 4)   # all weight on 3 coordinates
    0.7877
    """
    x, lam, i, j = np.broadcast_arrays(*(np.asarray(t, dtype=np.float64) for t in (x, lam, i, j)))
    out = np.empty(x.shape)
    only_a = (lam >= 1.0) | (j <= 0)
    only_b = (lam <= 0.0) | (i <= 0)
    both = ~(only_a | only_b)
    safe_x = np.maximum(x, 0.0)
    if only_a.any():
        n = i[only_a] * k
        out[only_a] = special.gammainc(n / 2.0, safe_x[only_a] * n / 2.0)
    sel = only_b & ~only_a
    if sel.any():
        n = j[sel] * k
        out[sel] = special.gammainc(n / 2.0, safe_x[sel] * n / 2.0)
    if both.any():
        n1, n2 = i[both] * k, j[both] * k
        out[both] = _two_block(safe_x[both], lam[both] / n1, n1, (1.0 - lam[both]) / n2, n2, "cdf")
    out = np.where(x > 0, out, 0.0)
    return np.clip(out, 0.0, 1.0)

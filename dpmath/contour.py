r"""Contour inversion of a chi-square mixture's moment generating function: its cdf, sf or pdf with an error
bound, for weights over any number of decades (:func:`contour_inversion`).

:mod:`dpmath.chi2mix` uses it where Ruben's series would be too long, in the right tail of sf and pdf, and for two
blocks too far apart for the panel quadrature; the tests and benchmarks use it as a check independent of both.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from .validation import real_array

__all__ = ["contour_inversion"]


_ALPHA = 0.4        # the hyperbola's asymptotes make angle pi/2 - alpha with the real axis
_STRIP = 0.3        # half-width d of the strip |Im u| < d in which the integrand is analytic
_EDGE_RIGHT = np.sin(_ALPHA + _STRIP) - np.sin(_ALPHA)   # s(0) moves right by mu * this on Im u = -d
_EDGE_LEFT = np.sin(_ALPHA) - np.sin(_ALPHA - _STRIP)    # ... and left by mu * this on Im u = +d
_INV_TOL = 1e-14    # target relative error of the inversion
_INV_CHUNK = 16     # nodes added at a time until the integrand has died out
_BULK = 1.0         # s_0 stays at least _BULK / sd away from the pole at 0
_POLE_SHARE = 0.5   # the strip's edges come at most this share of the way to the pole or a branch point
_INV_MAX_NODES = 6000


_SERIES_RADIUS = 0.05  # blocks with |2 w s| <= this enter K(s) through a power series ...
_SERIES_TERMS = 20     # ... of this many terms (remainder below 0.05^20 of their part of K)


class _Cumulant:
    """``K(s) = log E exp(s Q) = -sum_j (nu_j / 2) log(1 - 2 w_j s)`` (principal branch) for many s.

    The light blocks, those with ``|2 w_j s| <= 0.05`` at every s of a call, are summed as
    ``sum_k P_k s^k / (2k)`` with ``P_k = sum_j nu_j (2 w_j)^k`` over them (``k <= 20``; the remainder
    is below ``0.05^20`` of their contribution); only the heavy ones take a complex logarithm each.
    With weights over many decades most blocks are light, and a call costs ~20 operations per
    node for them instead of one logarithm per block and node.
    """

    def __init__(self, w: np.ndarray, nu: np.ndarray) -> None:
        self.w, self.nu = w, nu  # ascending w
        powers = (2.0 * w)[None, :] ** np.arange(1, _SERIES_TERMS + 1)[:, None] * nu
        self.prefix = np.cumsum(powers, axis=1)  # prefix[k-1, j] = P_k over blocks 0..j

    def __call__(self, s: np.ndarray) -> np.ndarray:
        light = int(np.searchsorted(self.w, _SERIES_RADIUS / (2.0 * float(np.abs(s).max())), side="right"))
        out = -0.5 * (np.log1p(-2.0 * s[..., None] * self.w[light:]) @ self.nu[light:])
        if light:
            p = self.prefix[:, light - 1]
            acc = np.zeros_like(s)
            for k in range(_SERIES_TERMS, 0, -1):  # Horner in s
                acc = (acc + p[k - 1] / (2.0 * k)) * s
            out = out + acc
        return out


def _saddle(x: np.ndarray, w: np.ndarray, nu: np.ndarray) -> np.ndarray:
    """The root of ``K'(s) = sum_j nu_j w_j / (1 - 2 w_j s) = x`` on ``s < 1 / (2 w_max)``, elementwise.

    ``K'`` increases from 0 (at -inf) to +inf (at ``1/(2 w_max)``); ``K'(-N/(2x)) < x`` with
    ``N = sum nu``, and ``K'(s) > x`` once ``1/(2 w_max) - s < nu_max / (2x)``.  Bisection on
    ``log(1/(2 w_max) - s)`` takes 64 steps whatever the spread; the root only has to be close,
    since any point of the half-line gives a valid contour.
    """
    s_max = 0.5 / w[-1]
    far = np.log(s_max + nu.sum() / (2.0 * x))
    near = np.minimum(np.log(nu[-1] / (4.0 * x)), far)
    for _ in range(64):
        mid = 0.5 * (far + near)
        above = (nu * w / (1.0 - 2.0 * w * (s_max - np.exp(mid))[:, None])).sum(-1) > x
        near = np.where(above, mid, near)
        far = np.where(above, far, mid)
    return s_max - np.exp(0.5 * (far + near))


def contour_inversion(x: ArrayLike, weights: ArrayLike, dof: ArrayLike,
                      kind: str = "cdf") -> tuple[np.ndarray, np.ndarray]:
    r"""cdf, sf or pdf of a chi-square mixture by inverting its moment generating function on a
    hyperbolic contour through the saddle point; returns ``(value, error)`` with an error bound.

    With ``K(s) = -\sum_j (\nu_j/2)\log(1 - 2 w_j s)`` and ``s_0`` on the real axis left of
    ``1/(2 w_{max})``,

    .. math::

        F(x) = \frac{1}{2\pi i}\int_{\Gamma} \frac{e^{K(s) - s x}}{-s}\,ds \ (s_0 < 0),\quad
        S(x) = \frac{1}{2\pi i}\int_{\Gamma} \frac{e^{K(s) - s x}}{s}\,ds \ (s_0 > 0),\quad
        f(x) = \frac{1}{2\pi i}\int_{\Gamma} e^{K(s) - s x}\,ds,

    on ``s(u) = s_0 + \mu(\sin\alpha(\cosh u - 1) + i\cos\alpha\sinh u)``, a hyperbola that
    leaves the real axis vertically at ``s_0`` and bends to the right, between the branch cuts
    ``[1/(2 w_j), \infty)``, so that ``e^{-sx}`` decays double-exponentially in ``u`` whatever the
    spread of the weights (on a vertical line it would only decay like a power of ``v``, and
    weights over 12 decades would need ~1e12 nodes).  ``s_0`` is the saddle point of
    ``K(s) - sx``, moved at least ``1/sd`` away from the pole at 0 (in the bulk), which keeps
    *relative* accuracy in both tails; the side of the pole decides whether F or S is computed (the
    other one is ``1 -`` it, then at least ~0.4).  ``\mu`` keeps the strip ``|Im u| < d`` clear of
    the pole and the branch points, and within ``2/\sqrt{K''(s_0)}`` of the saddle.

    The trapezoid rule with step ``h`` over ``u`` has error at most ``2 M / (e^{2\pi d/h} - 1)``,
    ``M = \int |g(u \pm i d)| du`` (Trefethen & Weideman 2014, Thm 5.1; the integral means are
    log-convex in ``Im u``, so the edges are the sup).  ``h`` starts at ``2\pi d / 40`` and is
    shrunk until that bound is below ``1e-14`` of the value; the nodes run until the terms are below
    ``1e-18`` of the value and falling (what is left is bounded by the last term times a geometric
    factor); ``M`` is a trapezoid sum on the edges at step ``4h``, doubled.  The returned error adds these
    three and a rounding term ``4 eps h \sum |g|``.  ``M`` and the tail are computed on grids, so the
    bound is a numerical estimate of a rigorous one, not interval arithmetic.

    Parameters
    ----------
    x : array_like
        Positive finite points.
    weights, dof : array_like
        Positive weights and degrees of freedom, as in :func:`chi2_mixture_cdf` (no merging here).
    kind : {"cdf", "sf", "pdf"}

    Returns
    -------
    (value, error) : tuple of ndarray
        Shaped like ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> w = np.logspace(0, -12, 200)                    # twelve decades
    >>> F, err = contour_inversion([0.5, 2.0], w, 1)
    >>> bool(np.all(err < 1e-13 * F))
    True
    """
    xs = real_array(x, "x").astype(np.float64)
    if np.any(~np.isfinite(xs) | (xs <= 0)):
        raise ValueError("x must be positive and finite")
    w = real_array(weights, "weights", allow_inf=False).ravel()
    nu = np.broadcast_to(real_array(dof, "dof", allow_inf=False), w.shape).astype(np.float64)
    if np.any(w <= 0) or np.any(nu <= 0):
        raise ValueError("weights and dof must be positive (> 0)")
    if kind not in ("cdf", "sf", "pdf"):
        raise ValueError(f"kind must be 'cdf', 'sf' or 'pdf', got {kind!r}")
    order = np.argsort(w)
    w, nu = w[order], nu[order]
    flat = xs.ravel()
    value, error = np.empty_like(flat), np.empty_like(flat)
    # batches of points share the nodes; a (points x nodes x heavy blocks) block is the memory
    step = max(1, 4096 // w.size)
    for lo in range(0, flat.size, step):
        value[lo:lo + step], error[lo:lo + step] = _invert(flat[lo:lo + step], w, nu, kind)
    return value.reshape(xs.shape), error.reshape(xs.shape)


def _invert(x: np.ndarray, w: np.ndarray, nu: np.ndarray, kind: str,
            h: float = 2.0 * np.pi * _STRIP / 40.0) -> tuple[np.ndarray, np.ndarray]:
    """:func:`contour_inversion` at the points ``x`` (1-D) with trapezoid step ``h``; points whose
    discretization bound misses the target are done again with the step that bound asks for."""
    s_max = 0.5 / w[-1]
    sd = float(np.sqrt(2.0 * np.sum(nu * w * w)))
    s_hat = _saddle(x, w, nu)
    if kind == "pdf":
        s0, pole = s_hat, np.zeros_like(x)
    else:
        left = s_hat < 0.0
        # F with the pole at 0 to the right of s0, or S with it to the left
        s0 = np.where(left, np.minimum(s_hat, -_BULK / sd),
                      np.minimum(np.maximum(s_hat, _BULK / sd), 0.5 * (s_hat + s_max)))
        pole = np.where(left, -1.0, 1.0)
    curvature = (2.0 * nu * w * w / (1.0 - 2.0 * w * s0[:, None]) ** 2).sum(-1)
    mu = np.minimum(_POLE_SHARE * (s_max - s0) / _EDGE_RIGHT, 2.0 / np.sqrt(curvature))
    mu = np.where(pole < 0, np.minimum(mu, _POLE_SHARE * -s0 / _EDGE_RIGHT), mu)
    mu = np.where(pole > 0, np.minimum(mu, _POLE_SHARE * s0 / _EDGE_LEFT), mu)
    sa, ca = np.sin(_ALPHA), np.cos(_ALPHA)
    cumulant = _Cumulant(w, nu)

    def g(u: np.ndarray) -> np.ndarray:
        # the integrand (1/2 pi i) e^{K(s) - s x} s'(u) [/ (-s) | / s], points x nodes
        s = s0[:, None] + mu[:, None] * (sa * (np.cosh(u) - 1.0) + 1j * ca * np.sinh(u))
        ds = mu[:, None] * (sa * np.sinh(u) + 1j * ca * np.cosh(u))
        with np.errstate(over="ignore", under="ignore"):
            out = np.exp(cumulant(s) - s * x[:, None]) * ds / (2j * np.pi)
        return out if kind == "pdf" else out / (pole[:, None] * s)

    vals = g(h * np.arange(_INV_CHUNK) + 0j)
    while True:
        total = h * (vals[:, 0].real + 2.0 * vals[:, 1:].real.sum(1))
        last = np.abs(vals[:, -3:])
        done = (last[:, -1] <= 1e-18 * np.abs(total)) & (last[:, -1] <= last[:, -2]) & (last[:, -2] <= last[:, -3])
        if done.all() or vals.shape[1] >= _INV_MAX_NODES:
            break
        vals = np.concatenate([vals, g(h * np.arange(vals.shape[1], vals.shape[1] + _INV_CHUNK) + 0j)], axis=1)
    u = h * np.arange(vals.shape[1])
    # M: |g(-u + i delta)| = |g(u + i delta)|, so each edge's integral is twice its half-line
    # part; trapezoid at step 4h (|g| is smooth and positive there), doubled for safety
    u4 = u[::4]
    m_edge = np.zeros_like(x)
    for delta in (_STRIP, -_STRIP):
        edge = np.abs(g(u4 + 1j * delta))
        m_edge = np.maximum(m_edge, 2.0 * 2.0 * 4.0 * h * (edge.sum(1) - 0.5 * edge[:, 0]))
    alias = 2.0 * m_edge / np.expm1(2.0 * np.pi * _STRIP / h)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(last[:, -2] > 0, last[:, -1] / last[:, -2], 0.0)
        tail = np.where(ratio < 1.0, 2.0 * h * last[:, -1] * ratio / (1.0 - ratio), np.inf)
    rounding = 4.0 * np.finfo(float).eps * h * 2.0 * np.abs(vals).sum(1)
    error = alias + tail + rounding
    redo = (alias > _INV_TOL * np.abs(total)) & (total != 0.0)
    need = np.log1p(2.0 * m_edge[redo] / (_INV_TOL * np.maximum(np.abs(total[redo]), 1e-300)))
    flip = ((kind == "cdf") & (pole > 0)) | ((kind == "sf") & (pole < 0))
    total = np.where(flip, 1.0 - total, total)
    if redo.any() and h > 1e-3:
        # the bound falls like exp(-2 pi d / h): aim straight for the target
        total[redo], error[redo] = _invert(x[redo], w, nu, kind,
                                           min(h / 2.0, 2.0 * np.pi * _STRIP / float(need.max())))
    return total, error

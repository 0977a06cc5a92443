"""The arbitrary-precision path of :mod:`dpmath.chi2mix` (its functions' ``precision=`` digits), in mpmath: the
reference the tests compare the float64 path with.

:func:`mpmath_evaluate` evaluates Ruben's series term by term or, when that series is too long, mpmath's tanh-sinh
quadrature of the convolution integral (two blocks) or of the contour integral on a different hyperbola than
:func:`~dpmath.contour.contour_inversion`'s (three or more).
"""

from __future__ import annotations

import mpmath
import numpy as np

__all__ = ["mpmath_evaluate"]


def mpmath_evaluate(xs: np.ndarray, w: np.ndarray, nu: np.ndarray, kind: str, precision: int) -> np.ndarray:
    """``kind`` ("cdf", "sf" or "pdf") at the points ``xs`` of the mixture of merged blocks ``w`` (ascending) with
    ``nu`` degrees of freedom, to ``precision`` decimal digits (an integer >= 15): an object array of
    ``mpmath.mpf``."""
    if isinstance(precision, bool) or not isinstance(precision, int) or precision < 15:
        raise ValueError(f"precision must be an integer number of digits >= 15, got {precision!r}")
    out = np.empty(xs.shape, dtype=object)
    with mpmath.workdps(precision + 10):  # guard digits for the quadrature path and the conversions
        ws = [mpmath.mpf(float(v)) for v in w]
        nus = [mpmath.mpf(float(v)) for v in nu]
        for idx, xv in np.ndenumerate(xs):
            out[idx] = _mp_point(mpmath.mpf(float(xv)), ws, nus, kind, precision)
    return out


def _mp_point(x, ws, nus, kind: str, precision: int):
    if x <= 0:
        return mpmath.mpf(0) if kind != "sf" else mpmath.mpf(1)
    if mpmath.isinf(x):
        return mpmath.mpf(1) if kind == "cdf" else mpmath.mpf(0)
    if len(ws) == 1:
        a, z = nus[0] / 2, x / (2 * ws[0])
        if kind == "cdf":
            return mpmath.gammainc(a, 0, z, regularized=True)
        if kind == "sf":
            return mpmath.gammainc(a, z, mpmath.inf, regularized=True)
        return _mp_gamma_pdf(x, a, 2 * ws[0])
    # Ruben's coefficients are a convolution of negative binomial laws (mean r (ratio - 1), variance
    # r (ratio - 1) ratio each); when that is long, quadrature is faster
    ratios = [w / ws[0] for w in ws]
    mean = mpmath.fsum(nu / 2 * (q - 1) for nu, q in zip(nus, ratios, strict=True))
    var = mpmath.fsum(nu / 2 * (q - 1) * q for nu, q in zip(nus, ratios, strict=True))
    if mean + 20 * mpmath.sqrt(var) + 50 > (5000 if len(ws) == 2 else 1500):
        return _mp_quad_two_block(x, ws, nus, kind) if len(ws) == 2 else _mp_contour(x, ws, nus, kind, precision)
    digits = precision
    while True:
        with mpmath.workdps(digits + 10):
            series = _mp_ruben(x, ws, nus, kind, digits)
        if series is None:
            if len(ws) == 2:
                return _mp_quad_two_block(x, ws, nus, kind)
            return _mp_contour(x, ws, nus, kind, precision)
        # the series drops a coefficient mass below 10^-digits: fine for the cdf (its terms shrink
        # along the series) but only an absolute bound for sf and pdf, so a tiny one needs more digits
        size = series if kind == "sf" else series * x
        if kind == "cdf" or size > mpmath.mpf(10) ** (-digits + 12):
            return series
        if len(ws) == 2:
            return _mp_quad_two_block(x, ws, nus, kind)
        digits *= 2
        if digits > 2000:
            raise ValueError("precision=: sf below 1e-2000 is out of reach of the mpmath path")


def _mp_gamma_pdf(x, a, s):
    return mpmath.exp((a - 1) * mpmath.log(x) - x / s - mpmath.loggamma(a) - a * mpmath.log(s))


def _mp_ruben(x, ws, nus, kind: str, precision: int):
    """Ruben's series sum_m c_m F_{N+2m}(x/beta), all terms non-negative, in mpmath."""
    beta = ws[0]
    qs = [1 - beta / w for w in ws]
    n_total = mpmath.fsum(nus)
    tail = mpmath.mpf(10) ** (-precision)
    c = [mpmath.exp(mpmath.fsum(nu / 2 * mpmath.log(beta / w) for w, nu in zip(ws, nus, strict=True)))]
    two = len(ws) == 2
    cap = 200000 if two else 4000
    g = []
    total = c[0]
    m = 0
    while 1 - total > tail:
        m += 1
        if m > cap:
            return None
        if two:  # a single negative binomial: c_m = c_{m-1} (r + m - 1) / m * q
            r = nus[1] / 2
            c.append(c[-1] * (r + m - 1) / m * qs[1])
        else:
            g.append(mpmath.fsum(nu / 2 * q**m for nu, q in zip(nus, qs, strict=True)))
            c.append(mpmath.fsum(g[m - 1 - r] * c[r] for r in range(m)) / m)
        total += c[-1]
    y = x / beta
    # t_n = e^{-y/2} (y/2)^{n/2} / Gamma(n/2 + 1); F_n(y) = sum_{l>=0} t_{n+2l}; f_n(y) = t_n n / (2y)
    t = mpmath.exp(-y / 2 + n_total / 2 * mpmath.log(y / 2) - mpmath.loggamma(n_total / 2 + 1))
    if kind == "pdf":
        acc = mpmath.mpf(0)
        for mm, cm in enumerate(c):
            n = n_total + 2 * mm
            acc += cm * t * n / (2 * y)
            t = t * (y / 2) / (n / 2 + 1)
        return acc / beta
    if kind == "cdf":
        # sum_m c_m F_{N+2m} = sum_n C_n t_{N+2n} with C_n = c_0 + ... + c_n; beyond the last
        # coefficient C is constant and the remaining sum is C_M * F_{N+2M+2}(y)
        acc = mpmath.mpf(0)
        cum = mpmath.mpf(0)
        for mm, cm in enumerate(c):
            n = n_total + 2 * mm
            cum += cm
            acc += cum * t
            t = t * (y / 2) / (n / 2 + 1)
        n_next = n_total + 2 * len(c)
        return acc + cum * mpmath.gammainc(n_next / 2, 0, y / 2, regularized=True)
    # sf: S_{n+2} = S_n + t_n  =>  sum_m c_m S_{N+2m} = C S_N + sum_l t_{N+2l} (C - C_l)
    big_c = total
    acc = big_c * mpmath.gammainc(n_total / 2, y / 2, mpmath.inf, regularized=True)
    cum = mpmath.mpf(0)
    for mm, cm in enumerate(c):
        n = n_total + 2 * mm
        cum += cm
        acc += t * (big_c - cum)
        t = t * (y / 2) / (n / 2 + 1)
    return acc


def _mp_quad_two_block(x, ws, nus, kind: str):
    """Tanh-sinh quadrature of the convolution integral, split where the float64 panels put the mass."""
    b, a = ws  # ascending
    n2, n1 = nus
    sv, av = 2 * b, n2 / 2
    sw, aw = 2 * a, n1 / 2

    def g(u):
        if u <= 0:
            return mpmath.mpf(0) if kind != "sf" else mpmath.mpf(1)
        z = u / sw
        if kind == "cdf":
            return mpmath.gammainc(aw, 0, z, regularized=True)
        if kind == "sf":
            return mpmath.gammainc(aw, z, mpmath.inf, regularized=True)
        return _mp_gamma_pdf(u, aw, sw)

    xf = float(x)
    points = {0.0, xf}
    mean_v = float(av * sv)
    sd_v = float(mpmath.sqrt(av) * sv)
    for s in (-30, -10, -4, -1, 0, 1, 4, 10, 30):
        p = mean_v + s * sd_v
        if 0 < p < xf:
            points.add(p)
    mean_w, sd_w = float(aw * sw), float(mpmath.sqrt(aw) * sw)
    for s in (-30, -10, -4, -1, 0, 1, 4, 10, 30):
        p = xf - (mean_w + s * sd_w)
        if 0 < p < xf:
            points.add(p)
    pts = [mpmath.mpf(p) for p in sorted(points)]
    val = mpmath.quad(lambda v: _mp_gamma_pdf(v, av, sv) * g(x - v), pts)
    if 0 < val < mpmath.mpf(10) ** -8:
        # mpmath.quad stops on an absolute error estimate: integrate again relative to the first value
        val = val * mpmath.quad(lambda v: _mp_gamma_pdf(v, av, sv) * g(x - v) / val, pts)
    if kind == "sf":
        val += mpmath.gammainc(av, x / sv, mpmath.inf, regularized=True)
    return val


def _mp_contour(x, ws, nus, kind: str, precision: int):
    """The contour integral of :func:`~dpmath.contour.contour_inversion` by mpmath's tanh-sinh quadrature at
    ``precision`` digits, on a different hyperbola (alpha = 0.5, the exact saddle point, mu = 1/sqrt(K''))
    than the float64 path: a reference for mixtures whose Ruben series is too long."""
    s_max = 1 / (2 * max(ws))

    def k1(s):
        return mpmath.fsum(nu * w / (1 - 2 * w * s) for w, nu in zip(ws, nus, strict=True))

    # bisection on log(s_max - s), as in dpmath.contour's saddle point: K'(s_max - e^far) < x < K'(s_max - e^near)
    far = mpmath.log(s_max + mpmath.fsum(nus) / (2 * x))
    near = min(mpmath.log(nus[ws.index(max(ws))] / (4 * x)), far)
    for _ in range(3 * precision + 60):
        mid = (far + near) / 2
        if k1(s_max - mpmath.exp(mid)) > x:
            near = mid
        else:
            far = mid
    s_hat = s_max - mpmath.exp((far + near) / 2)
    sd = mpmath.sqrt(2 * mpmath.fsum(nu * w * w for w, nu in zip(ws, nus, strict=True)))
    if kind == "pdf":
        s0, pole = s_hat, 0
    elif s_hat < 0:
        s0, pole = min(s_hat, -1 / sd), -1
    else:
        s0, pole = min(max(s_hat, 1 / sd), (s_hat + s_max) / 2), 1
    curv = mpmath.fsum(2 * nu * w * w / (1 - 2 * w * s0) ** 2 for w, nu in zip(ws, nus, strict=True))
    mu = min(1 / mpmath.sqrt(curv), (s_max - s0) / 2)
    if pole:
        mu = min(mu, abs(s0) / 2)
    alpha = mpmath.mpf(1) / 2
    sa, ca = mpmath.sin(alpha), mpmath.cos(alpha)

    def exponent(s):
        return -mpmath.fsum(nu / 2 * mpmath.log(1 - 2 * w * s) for w, nu in zip(ws, nus, strict=True)) - s * x

    # mpmath.quad stops on an *absolute* error estimate: integrate the integrand relative to its
    # size at the saddle, or a value of 1e-90 is returned after one round
    shift = exponent(s0)

    def g(u):
        s = s0 + mu * (sa * (mpmath.cosh(u) - 1) + 1j * ca * mpmath.sinh(u))
        ds = mu * (sa * mpmath.sinh(u) + 1j * ca * mpmath.cosh(u))
        val = mpmath.exp(exponent(s) - shift) * ds / (2j * mpmath.pi)
        return (val if pole == 0 else val / (pole * s)).real

    ends = [mpmath.mpf(0)] + [mpmath.mpf(t) for t in (0.5, 1, 2, 3, 4, 6, 8, 12)]
    total = 2 * mpmath.quad(g, ends) * mpmath.exp(shift)
    if (kind == "cdf" and pole > 0) or (kind == "sf" and pole < 0):
        total = 1 - total
    return total

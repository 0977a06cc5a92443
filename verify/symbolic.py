r"""Symbolic checks with sympy where a closed form exists, and this library's numbers against them.

* **Hutchinson's variance.**  For symmetric ``S`` (generic ``3 x 3``) and ``w ~ N(0, I)``, Isserlis' theorem gives
  ``E[(w^T S w)^2] - (tr S)^2 = 2 tr(S^2)``; so ``k`` probes with ``N(0, 1/k)`` entries have variance
  ``2 ||M^T M||_F^2 / k``, the value :mod:`verify.estimators` tests against.  Also the chi-square mixture's
  fourth cumulant ``48 k w^4`` of ``w chi2(k)`` used there (fourth derivative of ``-k/2 log(1 - 2 w t)``).
* **The Gaussian trade-off curve.**  The Neyman-Pearson test of ``N(0,1)`` against ``N(mu,1)`` at threshold
  ``tau`` has ``alpha = 1 - Phi(tau)`` and ``beta = Phi(tau - mu)``, so ``G_mu(alpha) = Phi(Phi^{-1}(1 - alpha) - mu)``
  and ``G_mu'(alpha) = -exp(mu z - mu^2/2)`` with ``z = Phi^{-1}(1 - alpha)``; sympy verifies the derivative, and
  :meth:`dpmath.PLDAccountant.tradeoff` for :class:`dpmath.Gaussian` must match the formula, evaluated by sympy
  at 30 digits.
* **LAP2's F(u, eta)** (paper 003, eq. III.5): sympy integrates ``E_{Lap(0,1)}[exp(eta(|z| - |z - u|))]`` piecewise
  for ``eta = 2..6`` and symbolic ``u > 0``; the result must equal the closed form
  ``(eta e^{(eta-1)u} + (eta-1) e^{-eta u}) / (2 eta - 1)``, :func:`dpmath.lap2.laplace_moment` must match it to
  ``1e-13`` relative, and its first two ``u``-derivatives (increasing, convex: what Thm III.5 needs) must
  match central differences of the implementation.
"""

from __future__ import annotations

import numpy as np

from .result import AuditResult, skipped_without

__all__ = ["symbolic_audit"]


def symbolic_audit() -> AuditResult:
    """Closed forms derived with sympy, and this library's implementations against them (a check).

    Returns
    -------
    AuditResult
        A failed row means a derivation did not simplify to zero or an implementation disagrees.

    Examples
    --------
    >>> from verify.symbolic import symbolic_audit
    >>> symbolic_audit().holds
    True
    """
    if (missing := skipped_without("sympy", "symbolic")) is not None:
        return missing
    import sympy as sp

    from dpmath import Gaussian, PLDAccountant
    from dpmath.lap2 import laplace_moment

    rows = []
    # Hutchinson: Isserlis on a generic symmetric 3 x 3 matrix
    n = 3
    s = sp.Matrix(n, n, lambda i, j: sp.Symbol(f"s{min(i, j)}{max(i, j)}"))

    def isserlis(i, j, k, m):
        return int(i == j and k == m) + int(i == k and j == m) + int(i == m and j == k)
    second = sum(s[i, j] * s[k, m] * isserlis(i, j, k, m)
                 for i in range(n) for j in range(n) for k in range(n) for m in range(n))
    diff = sp.expand(second - s.trace() ** 2 - 2 * (s * s).trace())
    rows.append({"identity": "E[(w^T S w)^2] - (tr S)^2 = 2 tr(S^2), S symmetric 3 x 3", "result": str(diff),
                 "holds": diff == 0})
    w, t, k = sp.symbols("w t k", positive=True)
    kappa4 = sp.diff(-k / 2 * sp.log(1 - 2 * w * t), t, 4).subs(t, 0)
    rows.append({"identity": "4th cumulant of w chi2(k) = 48 k w^4", "result": str(sp.simplify(kappa4)),
                 "holds": sp.simplify(kappa4 - 48 * k * w**4) == 0})

    # Gaussian trade-off
    mu, z = sp.symbols("mu z", real=True)
    phi = lambda v: sp.exp(-v**2 / 2) / sp.sqrt(2 * sp.pi)  # noqa: E731
    ratio = sp.simplify(phi(z - mu) / phi(z) - sp.exp(mu * z - mu**2 / 2))
    rows.append({"identity": "G_mu'(alpha) = -phi(z - mu)/phi(z) = -exp(mu z - mu^2/2)", "result": str(ratio),
                 "holds": ratio == 0})
    big_phi = lambda v: (1 + sp.erf(v / sp.sqrt(2))) / 2  # noqa: E731
    worst = 0.0
    for sigma in (0.5, 1.0, 2.0):
        alphas = np.array([1e-6, 1e-3, 0.05, 0.3, 0.7])
        ours = PLDAccountant().compose(Gaussian(sigma)).tradeoff(alphas)
        for a, o in zip(alphas, ours, strict=True):
            zq = sp.sqrt(2) * sp.erfinv(1 - 2 * sp.Float(a, 30))  # Phi^{-1}(1 - a)
            ref = float(big_phi(zq - sp.Float(1 / sigma, 30)).evalf(30))
            worst = max(worst, abs(o - ref))
    rows.append({"identity": "PLDAccountant(Gaussian).tradeoff = Phi(Phi^-1(1 - alpha) - 1/sigma), 15 points",
                 "result": f"max abs difference {worst:.1e}", "holds": bool(worst <= 1e-6)})

    # LAP2 F(u, eta)
    u = sp.Symbol("u", positive=True)
    zr = sp.Symbol("zr", real=True)
    worst_val = worst_d1 = worst_d2 = 0.0
    ok = True
    for eta in range(2, 7):
        # |z| - |z - u| on z < 0, 0 < z < u and z > u, times the Laplace density e^{-|z|}/2
        pieces = (sp.integrate(sp.exp(zr) / 2 * sp.exp(eta * (-zr - (u - zr))), (zr, -sp.oo, 0))
                  + sp.integrate(sp.exp(-zr) / 2 * sp.exp(eta * (zr - (u - zr))), (zr, 0, u))
                  + sp.integrate(sp.exp(-zr) / 2 * sp.exp(eta * (zr - (zr - u))), (zr, u, sp.oo)))
        closed = (eta * sp.exp((eta - 1) * u) + (eta - 1) * sp.exp(-eta * u)) / (2 * eta - 1)
        ok &= sp.simplify(pieces - closed) == 0
        f = sp.lambdify(u, closed, "mpmath")
        d1 = sp.lambdify(u, sp.diff(closed, u), "mpmath")
        d2 = sp.lambdify(u, sp.diff(closed, u, 2), "mpmath")
        for uv in (0.05, 0.5, 1.0, 2.0):
            ours = float(laplace_moment(uv, eta))
            worst_val = max(worst_val, abs(ours / float(f(uv)) - 1))
            h = 1e-4
            fd1 = (float(laplace_moment(uv + h, eta)) - float(laplace_moment(uv - h, eta))) / (2 * h)
            fd2 = (float(laplace_moment(uv + h, eta)) - 2 * ours + float(laplace_moment(uv - h, eta))) / h**2
            worst_d1 = max(worst_d1, abs(fd1 / float(d1(uv)) - 1))
            worst_d2 = max(worst_d2, abs(fd2 / float(d2(uv)) - 1))
            ok &= float(d1(uv)) > 0 and float(d2(uv)) > 0
    rows.append({"identity": "F(u, eta) by piecewise integration = closed form (eta = 2..6); increasing, convex in u",
                 "result": "simplifies to 0" if ok else "mismatch", "holds": bool(ok)})
    rows.append({"identity": "dpmath.lap2.laplace_moment against the closed form (20 points)",
                 "result": f"max rel. error {worst_val:.1e}", "holds": bool(worst_val <= 1e-13)})
    rows.append({"identity": "its u-derivatives against central differences (20 points, h = 1e-4)",
                 "result": f"max rel. error {worst_d1:.1e} (first), {worst_d2:.1e} (second)",
                 "holds": bool(worst_d1 <= 1e-6 and worst_d2 <= 1e-3)})
    holds = all(r["holds"] for r in rows)
    return AuditResult("symbolic", "check", holds,
                       f"{sum(r['holds'] for r in rows)} of {len(rows)} symbolic identities and implementation "
                       "comparisons hold", rows)

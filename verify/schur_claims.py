r"""Schur audits of published claims with :func:`dpmath.schur.check_schur` (findings).

* Paper 000, Prop. B.12: ``g_1(lam) = P(X(lam) <= 1)`` is Schur-convex on the simplex.
* Paper 000, Prop. B.11: ``g_t`` is Schur-concave for ``t >= 2``.
* Paper 003, Thm III.5: ``sum_i alpha(x_i)`` (the univariate subsampled-Laplace log-moment summed over
  coordinates) is Schur-convex in ``|g|`` on the orthant.
* Paper 003, Thm III.7: ``sum_i alpha(x_i)`` at the majorizer bounds LAP2's log-moment for every ``||g||_2 <= C``
  (checked against the exact joint moment over gradients spread over ``m`` coordinates).

``X(lam) = sum_i lam_i chi2_i(k)/k``.  ``check_schur`` is a falsifier: "consistent" is evidence, a
violation comes with its witness, which is re-evaluated and printed.
"""

from __future__ import annotations

import numpy as np

from dpmath.validation import positive_int

from .result import AuditResult, progress

__all__ = ["schur_audit"]

_KW = {"points": 20, "pairs": 20, "symmetry": 3, "coordinate_pairs": 3, "rtol": 1e-8, "atol": 1e-10,
       "min_entry": 0.02}


def _fmt(v: np.ndarray) -> str:
    return "(" + ", ".join(f"{x:.4g}" for x in v) + ")"


def schur_audit(cases: tuple[tuple[int, int, float], ...] = ((4, 2, 1.0), (4, 3, 1.0), (32, 3, 1.0), (4, 3, 2.0),
                                                             (32, 3, 2.5)), seed: int = 0) -> AuditResult:
    r"""Run the Schur toolkit on Props. B.11/B.12 (paper 000) and Thms III.5/III.7 (paper 003).

    Parameters
    ----------
    cases : tuple of tuple
        ``(k, d, t)`` triples:
        ``g_t`` on the simplex of dimension ``d - 1`` with ``k`` probes; ``t <= 1`` tests B.12 (convex),
        ``t >= 2`` tests B.11 (concave).
    seed : int

    Returns
    -------
    AuditResult
        A finding; each row says whether the claim survived, with the witness when it did not.

    Examples
    --------
    >>> from verify.schur_claims import schur_audit
    >>> r = schur_audit(cases=((4, 3, 1.0),))
    >>> r.rows[0]["holds"], r.kind
    (False, 'finding')
    """
    from dpmath.chi2mix import chi2_mixture_cdf
    from dpmath.lap2 import joint_log_moment, majorizer, published_log_moment, univariate_log_moment
    from dpmath.schur import check_schur

    rows = []
    for k, d, t in progress(cases, "schur"):
        k, d = positive_int(k, "k"), positive_int(d, "d")
        if not (t <= 1 or t >= 2):
            raise ValueError(f"t must be <= 1 (Prop. B.12) or >= 2 (Prop. B.11), got {t!r}")
        kind, prop = ("convex", "B.12") if t <= 1 else ("concave", "B.11")

        def g(lam, t=t, k=k):
            return float(chi2_mixture_cdf(t, lam / k, k))
        rep = check_schur(g, d, kind, seed=seed, **_KW)
        numbers = f"{rep.n_points} Schur-Ostrowski tests, {rep.n_pairs} pairs: {rep.verdict}"
        if rep.verdict == "violated" and rep.test == "pair":
            x, y = rep.witness
            numbers += (f"; x = {_fmt(x)} majorizes y = {_fmt(y)} but g(y) - g(x) = {g(y) - g(x):+.2e}"
                        if kind == "convex" else
                        f"; x = {_fmt(x)} majorizes y = {_fmt(y)} but g(x) - g(y) = {g(x) - g(y):+.2e}")
        elif rep.verdict == "violated":
            numbers += f"; Schur-Ostrowski fails at {_fmt(rep.witness[0])} by {rep.worst_violation:.2e}"
        rows.append({"claim": f"paper 000 Prop. {prop}: g_{t:g} Schur-{kind} (k = {k}, d = {d})",
                     "holds": rep.verdict == "consistent", "numbers": numbers})

    def alpha_sum(x):
        return float(univariate_log_moment(x, 6, 0.05, 0.5).sum())
    rep = check_schur(alpha_sum, 5, "convex", domain="orthant", seed=seed)
    rows.append({"claim": "paper 003 Thm III.5: sum_i alpha(x_i) Schur-convex (lambda 6, q 0.05, b 0.5, n 5)",
                 "holds": rep.verdict == "consistent",
                 "numbers": f"{rep.n_points} Schur-Ostrowski tests, {rep.n_pairs} pairs: {rep.verdict}"})
    worst = None
    for m in (1, 2, 10, 100):
        g = np.full(m, 1 / np.sqrt(m))
        gap = joint_log_moment(g, 8, 0.01, 0.5) - published_log_moment(8, 0.01, 0.5, 1.0, 1000)
        if worst is None or gap > worst[1]:
            worst = (m, gap)
    bound = published_log_moment(8, 0.01, 0.5, 1.0, 1000)
    rows.append({"claim": "paper 003 Thm III.7: sum_i alpha(x_i), x the majorizer, bounds LAP2's log-moment",
                 "holds": worst[1] <= 0,
                 "numbers": f"q 0.01, C/b 2, n 1000, lambda 8: bound {bound:.4f}; g with {worst[0]} equal entries "
                            f"has exact log-moment {bound + worst[1]:.3f}; majorizer head "
                            f"{_fmt(majorizer(3))}"})
    refuted = sum(not r["holds"] for r in rows)
    return AuditResult("schur", "finding", refuted == 0, f"{refuted} of {len(rows)} Schur-type claims refuted", rows)

r"""Audits: each a function returning an :class:`AuditResult`, registered in :data:`AUDITS`.

Two kinds, kept apart: **checks** of this library's own guarantees (a failure makes ``python -m verify``
exit non-zero) and **findings** about published claims (``holds=False`` means the claim is refuted; the run
still succeeds and the report shows the counterexample).

So far (the rest of the issue "verify: Monte Carlo and property audits ..." is to come):

* ``estimators`` (check): bias of ``dpsgd.estimators.hutch`` and ``hutchpp`` on random and adversarial
  ``(A, G)`` (Gaussian, low rank, one dominant direction, flat spectrum, bf16 inputs): a two-sided z-test of
  the mean of ``draws`` estimates against the exact norm per example, at family-wise level ``alpha`` with a
  Bonferroni correction over all examples tested.
* ``envelope`` (check): ``P(X(lam) <= x) <= envelope(x)`` for ``lam`` drawn from Dirichlet laws of
  concentrations 0.1, 1, 10, sparse and two-block vectors, at a grid of ``x``, with exact CDFs.
* ``privacy`` (check): DP-SGD (one step at q = 1 and 0.5, ten steps at q = 0.5) and one step of
  DP-SGD-RC (Hutch, vertex spectrum) simulated on worst-case neighbours; a threshold test's Clopper-Pearson
  error bounds give an epsilon lower bound that must not exceed the PLD accountant's upper bound.  It flags
  noise at half the stated scale, an accountant that ignores the envelope's left tail, and one that
  under-counts the composition.
* ``claims`` (findings): paper 000's ``x_+ = 1 + 2/(dk)`` and Prop. B.12, paper 003's Thm III.7,
  paper 002's Table 1 (the swapped ``eps = 4`` entries), each with numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy import special, stats

from dpmath._validation import open_probability, positive_int

__all__ = ["AuditResult", "AUDITS", "estimator_audit", "envelope_audit", "claims_audit", "privacy_audit",
           "epsilon_lower_bound"]


@dataclass
class AuditResult:
    """The outcome of one audit.

    Attributes
    ----------
    name : str
    kind : str
        ``"check"`` (this library's guarantee) or ``"finding"`` (a published claim).
    holds : bool
        The check passed / the claim survived.
    summary : str
        One line.
    rows : list of dict
        The numbers behind it (one per test or claim).
    """

    name: str
    kind: str
    holds: bool
    summary: str
    rows: list[dict] = field(default_factory=list)


def _families(gen, b: int = 2, t: int = 12, d: int = 6, p: int = 10):
    import torch

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    a, g = randn(b, t, d), randn(b, t, p)
    yield "gaussian", a, g
    yield "low rank", randn(b, t, 1) @ randn(b, 1, d), g
    yield "dominant direction", 30 * randn(b, t, 1) @ randn(b, 1, d) + 0.1 * randn(b, t, d), g
    q = torch.linalg.qr(randn(b, t, d)).Q
    yield "flat spectrum", q, torch.linalg.qr(randn(b, t, p)).Q
    yield "bf16 inputs", a.to(torch.bfloat16), g.to(torch.bfloat16)


def estimator_audit(draws: int = 2000, k: int = 4, alpha: float = 1e-3, seed: int = 0,
                    estimators: dict[str, Callable] | None = None) -> AuditResult:
    r"""Unbiasedness of Hutch and Hutch++ against exact norms, with a Bonferroni-corrected z-test.

    For each family and example, ``z = (mean - exact) / (sd / sqrt(draws))``; the check fails if any
    ``|z|`` exceeds ``Phi^{-1}(1 - alpha / (2 m))`` with ``m`` the number of tests (family-wise error
    ``<= alpha`` under the null, by the normal approximation of the mean of ``draws`` estimates).  The
    standard error is floored at ``1e-5 |exact| / crit`` so that an estimate exact up to rounding passes.

    Parameters
    ----------
    draws : int
        Estimates per example (``>= 2``).
    k : int
        Projection dimension.
    alpha : float
        Family-wise level in ``(0, 1)``.
    seed : int
        Seed of the data and projections.
    estimators : dict, optional
        ``name -> fn(A, G, k, generator)`` to audit instead of ``dpsgd``'s ``hutch`` and ``hutchpp``
        (e.g. your own, or a deliberately broken one to see the audit fail).

    Returns
    -------
    AuditResult

    Examples
    --------
    >>> from verify.audits import estimator_audit
    >>> estimator_audit(draws=300).holds
    True
    """
    import torch

    from dpsgd.estimators import exact, hutch, hutchpp

    estimators = {"hutch": hutch, "hutchpp": hutchpp} if estimators is None else dict(estimators)

    draws = positive_int(draws, "draws")
    if draws < 2:
        raise ValueError(f"draws must be at least 2, got {draws}")
    k = positive_int(k, "k")
    alpha = open_probability(alpha, "alpha")
    gen = torch.Generator().manual_seed(int(seed))
    cases = list(_families(gen))
    m = len(cases) * len(estimators) * cases[0][1].shape[0]
    crit = float(stats.norm.isf(alpha / (2 * m)))
    rows, worst = [], 0.0
    for name, a, g in cases:
        truth = exact(a, g).double()
        for est_name, est in estimators.items():
            x = torch.stack([est(a, g, k, gen) for _ in range(draws)]).double()
            # an estimate that is exact up to rounding (Hutch++ on low rank) has no sampling error to test;
            # the floating-point floor keeps z from dividing rounding by rounding
            se = torch.maximum(x.std(0) / math.sqrt(draws), 1e-5 * truth.abs() / crit)
            z = (x.mean(0) - truth) / se
            worst = max(worst, float(z.abs().max()))
            rows.append({"family": name, "estimator": est_name, "max |z|": round(float(z.abs().max()), 3),
                         "rel. bias": float(((x.mean(0) - truth) / truth).abs().max())})
    holds = worst <= crit
    return AuditResult("estimators", "check", holds,
                       f"max |z| = {worst:.2f} over {m} tests (Bonferroni critical value {crit:.2f} at "
                       f"alpha {alpha:g})", rows)


def _lambdas(d: int, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for r in range(count):
        kind = r % 5
        if kind < 3:
            lam = rng.dirichlet(np.full(d, (0.1, 1.0, 10.0)[kind]))
        elif kind == 3:  # sparse
            lam = np.zeros(d)
            idx = rng.choice(d, size=int(rng.integers(1, min(d, 3) + 1)), replace=False)
            lam[idx] = rng.dirichlet(np.ones(idx.size))
        else:  # two blocks
            m = int(rng.integers(1, d))
            a = rng.uniform(1.0 / d, 1.0 / m)
            lam = np.full(d, (1.0 - m * a) / (d - m))
            lam[:m] = a
        lam = lam[lam > 1e-3]  # negligible weights only slow the exact CDF down
        out.append(lam / lam.sum())
    return out


def envelope_audit(cases: tuple[tuple[int, int], ...] = ((4, 6), (32, 8)), lambdas: int = 30,
                   seed: int = 0) -> AuditResult:
    r"""``P(X(lam) <= x) <= envelope(x)`` for many ``lam`` and ``x``, with exact CDFs.

    Parameters
    ----------
    cases : tuple of (k, d)
        Envelopes :class:`dpmath.HutchEnvelope` ``(k, d)`` to audit.
    lambdas : int
        Points of the simplex per case.
    seed : int

    Returns
    -------
    AuditResult

    Examples
    --------
    >>> from verify.audits import envelope_audit
    >>> envelope_audit(cases=((4, 3),), lambdas=10).holds
    True
    """
    from dpmath import HutchEnvelope
    from dpmath.chi2mix import chi2_mixture_cdf

    lambdas = positive_int(lambdas, "lambdas")
    rng = np.random.default_rng(seed)
    rows, worst = [], -np.inf
    for k, d in cases:
        env = HutchEnvelope(k, d)  # validates k and d
        xs = np.concatenate([np.linspace(0.2, 0.99, 8), env.x_plus + np.array([-1e-4, 0.0, 1e-4]),
                             np.linspace(1.01, 3.0, 8)])
        bound = env.cdf(xs)
        excess = -np.inf
        for lam in _lambdas(d, lambdas, rng):
            excess = max(excess, float(np.max(chi2_mixture_cdf(xs, lam / k, k) - bound)))
        worst = max(worst, excess)
        rows.append({"k": k, "d": d, "x points": xs.size, "lambdas": lambdas, "max excess": excess})
    holds = worst <= 1e-12
    return AuditResult("envelope", "check", holds,
                       f"largest P(X(lam) <= x) - envelope(x) = {worst:.3g} (tolerance 1e-12)", rows)


def claims_audit() -> AuditResult:
    """Published claims re-checked with numbers (each row says whether the claim holds).

    Examples
    --------
    >>> from verify.audits import claims_audit
    >>> r = claims_audit()
    >>> r.kind, [row["holds"] for row in r.rows]
    ('finding', [True, False, False, False, False])
    """
    from dpmath import HutchEnvelope
    from dpmath.chi2mix import chi2_mixture_cdf
    from dpmath.lap2 import joint_log_moment, published_log_moment

    rows = []
    e2 = HutchEnvelope(32, 2)
    rows.append({"claim": "paper 000 Prop 5.2: x_+ = 1 + 2/(dk), d = 2, k = 32", "holds": True,
                 "numbers": f"x_+ = {e2.x_plus:.9f}, formula {1 + 2 / 64:.9f}"})
    e8 = HutchEnvelope(32, 8)
    rows.append({"claim": "paper 000 Prop 5.2: x_+ = 1 + 2/(dk), d = 8, k = 32",
                 "holds": bool(abs(e8.x_plus - (1 + 2 / 256)) < 1e-4),
                 "numbers": f"x_+ = {e8.x_plus:.9f}, formula {1 + 2 / 256:.9f}"})
    x, y = np.array([0.3, 0.69, 0.01]), np.array([0.31, 0.69])
    diff = float(chi2_mixture_cdf(1.0, y / 32, 32) - chi2_mixture_cdf(1.0, x / 32, 32))
    rows.append({"claim": "paper 000 Prop B.12: P(X(lam) <= 1) Schur-convex (d = 3, k = 32)", "holds": diff >= 0,
                 "numbers": f"y = (0.31, 0.69, 0) majorizes x = (0.3, 0.69, 0.01); g(y) - g(x) = {diff:.3g}"})
    g = np.full(10, 1 / math.sqrt(10))
    exact, pub = joint_log_moment(g, 8, 0.01, 0.5), published_log_moment(8, 0.01, 0.5, 1.0, 1000)
    rows.append({"claim": "paper 003 Thm III.7: sum_i alpha(x_i) bounds LAP2's moment", "holds": exact <= pub,
                 "numbers": f"q 0.01, C/b 2, n 1000, lambda 8, ten equal entries: {exact:.3f} > {pub:.4f}"})
    vertex = float(special.gammainc(16, 16.0))
    rows.append({"claim": "paper 000 Thm 5.1 display: uniform below 1, vertex above x_+", "holds": False,
                 "numbers": f"at x = 1 the vertex gives {vertex:.4f} > uniform {float(e8.uniform_cdf(1.0)):.4f}"})
    return AuditResult("claims", "finding", all(r["holds"] for r in rows),
                       f"{sum(not r['holds'] for r in rows)} of {len(rows)} published claims refuted", rows)


def epsilon_lower_bound(false_positives: int, false_negatives: int, n: int, delta: float, confidence: float) -> float:
    r"""Epsilon certified by a test's error counts on ``n`` samples of each hypothesis (Clopper-Pearson).

    With upper confidence bounds ``a`` on the type I and ``b`` on the type II error (each at level
    ``(1 - confidence) / 2``), any ``(eps, delta)``-DP mechanism has ``a >= e^{-eps} (1 - delta - b)``
    (and the symmetric inequality), so ``eps >= log((1 - delta - b) / a)``, with the larger of the two.

    Examples
    --------
    >>> from verify.audits import epsilon_lower_bound
    >>> round(epsilon_lower_bound(100, 50_000, 100_000, 1e-5, 0.95), 2)
    6.01
    """
    if n < 1 or not 0 <= false_positives <= n or not 0 <= false_negatives <= n:
        raise ValueError("counts must lie in [0, n] with n >= 1")
    tail = (1 - confidence) / 2
    a = stats.beta.ppf(1 - tail, false_positives + 1, n - false_positives) if false_positives < n else 1.0
    b = stats.beta.ppf(1 - tail, false_negatives + 1, n - false_negatives) if false_negatives < n else 1.0
    best = 0.0
    for x, y in ((a, b), (b, a)):
        if 1 - delta - y > 0 and x > 0:
            best = max(best, math.log((1 - delta - y) / x))
    return best


def _sample_outputs(mech: dict, n: int, rng: np.random.Generator, with_example: bool) -> np.ndarray:
    """The test statistic of ``n`` runs: the output along the differing example's direction (in noise
    standard deviations) for one step; for ``steps > 1`` the sum over steps of the per-step log-likelihood
    ratio of the stated (subsampled-Gaussian) pair, the Neyman-Pearson statistic of the composition."""
    steps = int(mech.get("steps", 1))
    x = rng.standard_normal((n, steps))
    if with_example:
        included = rng.random((n, steps)) < mech["q"]
        scale = np.ones((n, steps))
        if mech.get("k"):  # randomized clipping: the clipped norm is 1 / sqrt(Y), Y ~ chi2(k)/k at the vertex
            scale = 1.0 / np.sqrt(rng.chisquare(mech["k"], (n, steps)) / mech["k"])
        x = x + included * scale / (mech["sigma"] * mech.get("noise_factor", 1.0))
    if steps == 1:
        return x[:, 0]
    mu, q = 1.0 / mech["sigma"], mech["q"]
    return np.logaddexp(math.log(q) + mu * x - mu * mu / 2, math.log1p(-q) if q < 1 else -np.inf).sum(axis=1)


def privacy_audit(samples: int = 400_000, delta: float = 1e-5, confidence: float = 0.95, seed: int = 0,
                  mechanisms: list[dict] | None = None) -> AuditResult:
    r"""Simulate one step of each mechanism on worst-case neighbours and lower-bound its epsilon.

    The statistic is the output along the differing example's gradient (a threshold test: optimal for the
    Gaussian, valid for every mechanism).  The threshold is chosen on one half of the samples and the
    errors are counted on the other half, so the Clopper-Pearson bounds (:func:`epsilon_lower_bound`,
    level ``confidence`` after a Bonferroni split over mechanisms) stay valid.  The check fails when the
    lower bound exceeds the accountant's upper bound (:class:`dpmath.PLDAccountant`, one step).

    Mechanisms are dicts: ``sigma``, ``q``, optional ``k`` and ``d`` (randomized clipping with Hutch: the
    differing example sits at the envelope's vertex, the worst case for small estimates) and
    ``steps`` (compose this many steps, DP-SGD only; the statistic is then the summed log-likelihood
    ratio), ``account_steps`` (let the accountant count fewer steps: a broken composition),
    ``noise_factor`` (simulate noise ``noise_factor`` times the stated one: a broken mechanism) or
    ``account_as_dpsgd`` (account a randomized-clipping mechanism as if its norms were exact: an envelope
    without its left tail).

    Examples
    --------
    >>> from verify.audits import privacy_audit
    >>> r = privacy_audit(samples=100_000)
    >>> r.holds, r.kind
    (True, 'check')
    """
    from dpmath import HutchEnvelope, PLDAccountant, RandomizedClipGaussian, SubsampledGaussian

    samples = positive_int(samples, "samples")
    if mechanisms is None:
        mechanisms = [{"name": "DP-SGD", "sigma": 0.6, "q": 1.0},
                      {"name": "DP-SGD, q = 0.5", "sigma": 0.6, "q": 0.5},
                      {"name": "DP-SGD-RC Hutch k=32 d=8", "sigma": 1.0, "q": 1.0, "k": 32, "d": 8},
                      {"name": "DP-SGD, 10 steps, q = 0.5", "sigma": 1.0, "q": 0.5, "steps": 10}]
    rng = np.random.default_rng(seed)
    level = 1 - (1 - confidence) / len(mechanisms)
    rows, holds = [], True
    for mech in mechanisms:
        if not (mech["sigma"] > 0 and 0 < mech["q"] <= 1):
            raise ValueError(f"mechanism {mech.get('name')!r}: sigma must be > 0 and q in (0, 1]")
        if mech.get("k") and not mech.get("account_as_dpsgd"):
            claimed = RandomizedClipGaussian(mech["sigma"], mech["q"], HutchEnvelope(mech["k"], mech["d"]))
        else:  # account_as_dpsgd: a broken accountant that ignores the estimate's left tail
            claimed = SubsampledGaussian(mech["sigma"], mech["q"])
        steps = int(mech.get("steps", 1))
        if steps > 1 and mech.get("k"):
            raise ValueError(f"mechanism {mech.get('name')!r}: multi-step audits cover DP-SGD only so far")
        # account_steps: a broken accountant that under-counts the composition
        upper = PLDAccountant().compose(claimed, int(mech.get("account_steps", steps))).epsilon(delta)
        half = samples // 2
        p_sel, q_sel = _sample_outputs(mech, half, rng, True), _sample_outputs(mech, half, rng, False)
        p_eval, q_eval = _sample_outputs(mech, half, rng, True), _sample_outputs(mech, half, rng, False)
        taus = np.quantile(q_sel, 1 - np.geomspace(min(1e-5, 10 / half), 0.5, 40))
        best_tau = max(taus, key=lambda t: epsilon_lower_bound(int((q_sel > t).sum()), int((p_sel <= t).sum()),
                                                               half, delta, 0.5))
        lower = epsilon_lower_bound(int((q_eval > best_tau).sum()), int((p_eval <= best_tau).sum()), half, delta,
                                    level)
        ok = lower <= upper
        holds &= ok
        rows.append({"mechanism": mech.get("name", str(mech)), "eps lower (audit)": round(lower, 4),
                     "eps upper (accountant)": round(upper, 4), "holds": ok})
    return AuditResult("privacy", "check", holds,
                       f"{sum(r['holds'] for r in rows)} of {len(rows)} mechanisms: audited lower bound <= accountant "
                       f"upper bound ({samples:,} samples, confidence {confidence:g}, delta {delta:g})", rows)


AUDITS: dict[str, tuple[Callable[..., AuditResult], dict, dict]] = {
    # name: (function, quick arguments, full arguments)
    "estimators": (estimator_audit, {"draws": 1000}, {"draws": 20000}),
    "envelope": (envelope_audit, {"lambdas": 20}, {"cases": ((4, 6), (32, 8), (32, 64), (1, 5)), "lambdas": 200}),
    "privacy": (privacy_audit, {"samples": 400_000}, {"samples": 4_000_000}),
    "claims": (claims_audit, {}, {}),
}
"""Registered audits: ``name -> (function, quick kwargs, full kwargs)``."""

r"""Audit of the per-sample norm estimators of :mod:`dpsgd.estimators` and of whole-model norms.

Three kinds of test, all at one family-wise level ``alpha`` with a Bonferroni correction over every test
run:

* **bias** of ``hutch`` and ``hutchpp``: ``z = (mean - exact) / se`` over ``draws`` estimates per example;
* **distribution** of ``hutch``: with Gaussian probes the estimate of ``||M||_F^2`` *is* the chi-square
  mixture ``sum_i s_i^2 chi2(k)/k`` over the squared singular values ``s_i^2`` of ``M = A^T G`` (the law the
  envelope is built on), so a Kolmogorov-Smirnov test against :func:`dpmath.chi2_mixture_cdf`, and a
  z-test of the sample variance against ``2 sum_i s_i^4 / k`` (its standard error from the mixture's
  fourth cumulant ``48 k sum_i (s_i^2/k)^4``), check more than the mean;
* **whole model**: ``dpsgd.per_sample_sq_norms`` with ``exact`` and ``ghost`` against per-example
  gradients from ``torch.func`` (vmap of grad, float64) on a small decoder with an embedding, attention,
  RMSNorm and an MLP; and the mean of ``hutch`` / ``hutchpp`` over draws against those norms.

Inputs: random and adversarial ``(A, G)``: Gaussian, low rank, one dominant direction, flat spectrum
(orthonormal columns) and bf16 inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy import stats

from dpmath.validation import open_probability, positive_int

from .result import AuditResult, Figure, progress, skipped_without, slug
from .stats import bonferroni_z

__all__ = ["estimator_audit"]


def _families(gen, b: int = 2, t: int = 12, d: int = 6, p: int = 10):
    import torch

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    a, g = randn(b, t, d), randn(b, t, p)
    yield "gaussian", a, g
    yield "low rank", randn(b, t, 1) @ randn(b, 1, d), g
    yield "dominant direction", 30 * randn(b, t, 1) @ randn(b, 1, d) + 0.1 * randn(b, t, d), g
    yield "flat spectrum", torch.linalg.qr(randn(b, t, d)).Q, torch.linalg.qr(randn(b, t, p)).Q
    yield "bf16 inputs", a.to(torch.bfloat16), g.to(torch.bfloat16)


def _mixture_weights(a, g) -> list[np.ndarray]:
    """Squared singular values of each example's ``A^T G`` (float64, from the same values the estimator sees)."""
    import torch

    m = a.double().transpose(1, 2) @ g.double()
    return [s.numpy() ** 2 for s in torch.linalg.svdvals(m)]


def _law(w: np.ndarray, k: int, kind: str = "cdf") -> Callable[[np.ndarray], np.ndarray]:
    """CDF (or pdf) of ``sum_i w_i chi2(k)/k``, exact for every weight however spread (no lumping)."""
    from dpmath import chi2_mixture_cdf, chi2_mixture_pdf

    fn = chi2_mixture_cdf if kind == "cdf" else chi2_mixture_pdf
    return lambda t: fn(t, w / k, k)


def _model_and_reference(seed: int):
    import warnings

    import torch
    import torch.nn.functional as F

    from dpsgd.demo import TinyLlama

    torch.manual_seed(seed)
    model = TinyLlama(vocab=13, seq_len=6, dim=8, heads=2, layers=1).double()
    gen = torch.Generator().manual_seed(seed)
    idx, y = torch.randint(0, 13, (3, 6), generator=gen), torch.randint(0, 4, (3,), generator=gen)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss_one(p, i, t):
        return F.cross_entropy(torch.func.functional_call(model, p, (i.unsqueeze(0),)), t.unsqueeze(0))
    with warnings.catch_warnings():  # torch.func has no batching rule for CPU attention yet: slow, not wrong
        warnings.simplefilter("ignore", UserWarning)
        grads = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(params, idx, y)
    ref = sum(gr.reshape(gr.shape[0], -1).square().sum(1) for gr in grads.values())
    return model, (lambda m: F.cross_entropy(m(idx), y, reduction="none")), ref


def estimator_audit(draws: int = 2000, k: int = 4, alpha: float = 1e-3, seed: int = 0,
                    estimators: dict[str, Callable] | None = None, model_draws: int | None = None) -> AuditResult:
    r"""Bias, distribution and variance of the randomized estimators, and whole-model norms.

    The check fails if any test rejects at family-wise level ``alpha`` (Bonferroni over all tests: under
    the null, i.e. correct estimators, the probability of a false failure is at most ``alpha`` up to the
    normal approximation of means and variances over ``draws`` samples), or if an exact whole-model norm
    differs from ``torch.func``'s by more than ``1e-6`` relative.  The bias z-test floors the standard error at
    ``1e-5 |exact| / crit`` so that an estimate exact up to rounding (Hutch++ at low rank) passes.

    Parameters
    ----------
    draws : int
        Estimates per example (``>= 20``).
    k : int
        Projection dimension.
    alpha : float
        Family-wise level in ``(0, 1)``.
    seed : int
        Seed of the data and projections.
    estimators : dict, optional
        ``name -> fn(A, G, k, generator)`` to audit instead of ``dpsgd``'s ``hutch`` and ``hutchpp`` (your
        own, or a broken one to see the audit fail).  Only an estimator named ``"hutch"`` gets the
        distribution and variance tests (its law is known); custom estimators skip the whole-model tests.
    model_draws : int, optional
        Draws of the whole-model randomized norms (default ``draws // 4``).

    Returns
    -------
    AuditResult

    Examples
    --------
    >>> from verify.estimators import estimator_audit
    >>> estimator_audit(draws=300).holds
    True
    """
    draws = positive_int(draws, "draws")
    if draws < 20:
        raise ValueError(f"draws must be at least 20, got {draws}")
    k = positive_int(k, "k")
    alpha = open_probability(alpha, "alpha")
    if (missing := skipped_without("torch", "estimators")) is not None:
        return missing
    import torch

    from dpsgd.clipping import per_sample_sq_norms
    from dpsgd.estimators import exact, hutch, hutchpp

    custom = estimators is not None
    estimators = {"hutch": hutch, "hutchpp": hutchpp} if estimators is None else dict(estimators)
    model_draws = positive_int(model_draws if model_draws is not None else max(draws // 4, 20), "model_draws")
    gen = torch.Generator().manual_seed(int(seed))
    cases = list(_families(gen))
    batch = cases[0][1].shape[0]
    m = len(cases) * batch * (len(estimators) + 2 * ("hutch" in estimators)) + (0 if custom else 3 * 2)
    crit = bonferroni_z(alpha, m)
    p_min = alpha / m
    rows, samples = [], {}
    for name, a, g in progress(cases, "estimators"):
        truth = exact(a, g).double()
        weights = _mixture_weights(a, g)
        for est_name, est in estimators.items():
            x = torch.stack([est(a, g, k, gen) for _ in range(draws)]).double()
            samples[(name, est_name)] = (x[:, 0] / truth[0]).numpy()
            se = torch.maximum(x.std(0) / math.sqrt(draws), 1e-5 * truth.abs() / crit)
            z = float(((x.mean(0) - truth) / se).abs().max())
            rows.append({"test": "bias", "family": name, "estimator": est_name, "statistic": f"max |z| = {z:.2f}",
                         "threshold": f"{crit:.2f}", "holds": z <= crit})
            if est_name != "hutch":
                continue
            ks_p, var_z = 1.0, 0.0
            for i, w in enumerate(weights):
                xi = x[:, i].numpy()
                ks_p = min(ks_p, stats.kstest(xi, _law(w, k)).pvalue)
                kappa2, kappa4 = 2 * np.sum(w**2) / k, 48 * np.sum(w**4) / k**3
                var_z = max(var_z, abs(xi.var(ddof=1) - kappa2) / math.sqrt((kappa4 + 2 * kappa2**2) / draws))
            rows.append({"test": "law = chi2 mixture (KS)", "family": name, "estimator": est_name,
                         "statistic": f"min p = {ks_p:.3g}", "threshold": f"{p_min:.2g}", "holds": bool(ks_p >= p_min)})
            rows.append({"test": "variance = 2 sum s^4 / k", "family": name, "estimator": est_name,
                         "statistic": f"max |z| = {var_z:.2f}", "threshold": f"{crit:.2f}",
                         "holds": bool(var_z <= crit)})
    if not custom:
        model, loss_fn, ref = _model_and_reference(int(seed))
        for est_name in ("exact", "ghost"):
            got = per_sample_sq_norms(model, loss_fn, est_name).double()
            err = float(((got - ref).abs() / ref).max())
            rows.append({"test": "whole model vs torch.func", "family": "TinyLlama", "estimator": est_name,
                         "statistic": f"max rel. error {err:.1e}", "threshold": "1e-06", "holds": err <= 1e-6})
        for est_name in ("hutch", "hutchpp"):
            x = torch.stack([per_sample_sq_norms(model, loss_fn, est_name, k=k, generator=gen)
                             for _ in progress(range(model_draws), f"model {est_name}")]).double()
            se = torch.maximum(x.std(0) / math.sqrt(model_draws), 1e-5 * ref / crit)  # exact at this size: Hutch++
            z = float(((x.mean(0) - ref) / se).abs().max())
            rows.append({"test": "whole model bias", "family": "TinyLlama", "estimator": est_name,
                         "statistic": f"max |z| = {z:.2f}", "threshold": f"{crit:.2f}", "holds": z <= crit})
    holds = all(r["holds"] for r in rows)
    summary = (f"{sum(r['holds'] for r in rows)} of {len(rows)} test groups pass ({m} tests, Bonferroni at "
               f"family-wise alpha {alpha:g}: |z| <= {crit:.2f}, p >= {p_min:.2g}; {draws} draws, k = {k})")
    return AuditResult("estimators", "check", holds, summary, rows, _figures(samples, cases, k))


def _figures(samples: dict, cases: list, k: int) -> list[Figure]:
    figs = []
    for name, a, g in cases[:3]:
        if (name, "hutch") not in samples:
            continue
        w = _mixture_weights(a, g)[0]
        w = w / w.sum()

        def draw(ax, name=name, w=w):
            grid = np.linspace(0.0, 3.0, 300)
            for est_name, color in (("hutch", "C0"), ("hutchpp", "C1")):
                if (name, est_name) in samples:
                    ax.hist(samples[(name, est_name)], bins=60, range=(0, 3), density=True, alpha=0.5, color=color,
                            label=f"{est_name} / exact (sampled)")
            ax.plot(grid, _law(w, k, "pdf")(grid), "k-", lw=1.2, label="chi-square mixture law")
            ax.set_xlabel("estimate / exact squared norm")
            ax.set_ylabel("density")
            ax.set_title(f"{name} (A, G), k = {k}")
            ax.legend(fontsize=7)
        figs.append(Figure(f"estimator-{slug(name)}",
                           f"Estimator error distribution, {name} inputs: sampled Hutchinson and Hutch++ ratios "
                           "against the chi-square mixture Hutchinson must follow.", draw))
    return figs

r"""Monte Carlo privacy audits: simulate mechanisms on worst-case neighbours and lower-bound their epsilon.

For each mechanism the audit draws the output of ``steps`` steps with and without the differing example
and reduces it to one statistic ``s`` (larger means "the example is in").  A threshold test ``s > tau``
has false-positive rate ``a`` (without) and false-negative rate ``b`` (with); any ``(eps, delta)``-DP
mechanism has ``a >= e^{-eps}(1 - delta - b)`` and the symmetric inequality.  The threshold is chosen on
one half of the samples and the errors are counted on the other half, so the one-sided Clopper-Pearson
bounds (:func:`verify.stats.epsilon_lower_bound`, confidence split over the mechanisms by Bonferroni) hold
and the certified lower bound is valid with probability ``>= confidence`` for all mechanisms together.
A *check* fails when a lower bound exceeds this library's accountant's upper bound for the same
mechanism; a lower bound above a *published* accountant's number refutes that number (a finding).

The mechanisms (``kind`` of a mechanism dict), each with its worst-case neighbour and statistic:

``"gaussian"`` (DP-SGD): the differing example's clipped gradient has norm ``C``; the output along it,
in noise units, is ``N(0, 1)`` or ``N(1/sigma, 1)`` when sampled (rate ``q``).  One step: the output (the
Neyman-Pearson statistic); several: the summed per-step log-likelihood ratio.  Accountant:
:class:`dpmath.PLDAccountant` on :class:`dpmath.SubsampledGaussian`.

``"rc"`` (DP-SGD-RC): as above, but the example's norm is *estimated* by the real ``dpsgd.estimators``
``hutch`` or ``hutchpp`` on a constructed ``(A, G)`` whose ``A^T G`` has the chosen spectrum, and a
gradient far above ``C`` is clipped to ``C / sqrt(Y)`` with ``Y = estimate / exact`` (the worst case
of Lemma B.2).  The spectrum is chosen adversarially among candidates (vertex, the envelope's
heavy-light maximizer, centre; for Hutch++ also flat spectra of rank ``k + 1`` and ``2k``) by the
numerical hockey-stick divergence (summed at eps = 0.5, 1, 2) of a pilot sample.  ``Y`` is drawn from
``y_pool`` real estimator calls (resampled when more are needed).  Several steps use the summed
log-likelihood ratio with the pilot's law.  Accountant: :class:`dpmath.SubsampledGaussian` with
:class:`dpmath.HutchEnvelope` or :class:`dpmath.HutchPPEnvelope`.

``"lap2"`` (paper 003): Laplace noise of scale ``b = scale * C`` on each coordinate; the differing gradient
spreads ``C`` evenly over ``m`` coordinates, ``m`` chosen adversarially among ``1, 4, 16, 64`` on the
selection half.  Statistic: ``sum_t log(1 - q + q exp(sum_i (|y_i| - |y_i - g_i|)/b))``.  Accountant:
:class:`dpmath.SubsampledL2Laplace`; also compared with paper 003's published Thm III.7
(:func:`dpmath.lap2.published_epsilon`).

``"twice"`` (paper 002): example sampling ``q1``, then each coordinate with ``q2``; the gradient sits
at the vertex of the l2/l-infinity ball (``floor(d0)`` coordinates at ``c_inf``, one at the rest).
Statistic: the exact log-likelihood ratio ``log(1 - q1 + q1 prod_l (1 - q2 + q2 L_l))``, summed over
steps.  Accountant: :class:`dpmath.RDPAccountant` on :class:`dpmath.twice_sampling.TwiceSampledGaussian`.

``"allocation"`` (balls in bins): each of ``steps`` epochs has ``t`` steps and puts the differing example (norm
``C``) in one uniformly random step; the other steps' outputs along it are ``N(0, 1)``.  Statistic: the exact
log-likelihood ratio, ``sum_epochs log mean_j exp(x_j / sigma - 1 / (2 sigma^2))``.  Accountant:
:class:`dpmath.RandomAllocationGaussian` (the epoch's own PLD, :mod:`dpmath.pld.allocation`).

Deliberately broken variants show the audit's power: ``noise_factor`` (simulate noise that many times
the stated one), ``account_steps`` (the accountant counts fewer steps) and, for ``"rc"``,
``account_as_dpsgd`` (an accountant that ignores the estimate's left tail).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import special, stats

from dpmath.validation import open_probability, positive_int, positive_real, sample_rate

from .result import AuditResult, Figure, progress, skipped_without, slug
from .stats import epsilon_lower_bound

__all__ = ["privacy_audit", "DEFAULT_MECHANISMS", "QUICK_MECHANISMS", "hockey_stick_on_grid", "twice_log_ratio",
           "twice_vertex"]

DEFAULT_MECHANISMS: list[dict] = [
    {"name": "DP-SGD, q = 1", "kind": "gaussian", "sigma": 0.6, "q": 1.0},
    {"name": "DP-SGD, q = 0.5", "kind": "gaussian", "sigma": 0.6, "q": 0.5},
    {"name": "DP-SGD, 10 steps, q = 0.5", "kind": "gaussian", "sigma": 1.0, "q": 0.5, "steps": 10},
    {"name": "DP-SGD-RC Hutch k = 32, d = 8", "kind": "rc", "estimator": "hutch", "sigma": 1.0, "q": 1.0, "k": 32,
     "d": 8},
    {"name": "DP-SGD-RC Hutch k = 16, d = 8, 5 steps, q = 0.5", "kind": "rc", "estimator": "hutch", "sigma": 1.5,
     "q": 0.5, "k": 16, "d": 8, "steps": 5},
    {"name": "DP-SGD-RC Hutch++ k = 16, d = 64", "kind": "rc", "estimator": "hutchpp", "sigma": 1.0, "q": 1.0,
     "k": 16, "d": 64},
    {"name": "LAP2 b = C/4, q = 0.05", "kind": "lap2", "scale": 0.25, "q": 0.05, "dim": 1000},
    {"name": "twice sampling q1 = 0.5, q2 = 0.5, d0 = 4", "kind": "twice", "sigma": 0.5, "q1": 0.5, "q2": 0.5,
     "c_inf": 0.5},
    {"name": "balls in bins, 3 epochs of 10 steps", "kind": "allocation", "sigma": 0.8, "t": 10, "steps": 3},
]
"""The mechanisms :func:`privacy_audit` simulates by default (the full run)."""

QUICK_MECHANISMS: list[dict] = [DEFAULT_MECHANISMS[i] for i in (0, 2, 3, 5, 6, 7, 8)]
"""The quick run's subset: every kind, one or two of each (DP-SGD at q = 1 and over 10 steps, DP-SGD-RC with
Hutch and Hutch++, LAP2, twice sampling, balls in bins)."""

@dataclass(frozen=True)
class _Simulation:
    name: str
    sample: Callable[[np.random.Generator, int, bool], np.ndarray]
    upper: float
    accountant: str
    published: float | None = None
    detail: str = ""
    tradeoff: Callable[[np.ndarray], np.ndarray] | None = None


def _steps(spec: dict) -> int:
    return positive_int(spec.get("steps", 1), "steps")


def _broken(spec: dict) -> tuple[float, int]:
    factor = positive_real(spec.get("noise_factor", 1.0), "noise_factor")
    return factor, positive_int(spec.get("account_steps", _steps(spec)), "account_steps")


def _log_mix(q: float, log_ratio: np.ndarray) -> np.ndarray:
    """``log(1 - q + q e^{log_ratio})``: the log-likelihood ratio after Poisson sampling at rate ``q``."""
    return np.logaddexp(math.log(q) + log_ratio, math.log1p(-q) if q < 1 else -np.inf)


def _subsampled_llr(x: np.ndarray, shifts: np.ndarray, weights: np.ndarray, q: float) -> np.ndarray:
    r"""``log(1 - q + q sum_j w_j exp(mu_j x - mu_j^2 / 2))``: the log-likelihood ratio of one step."""
    return _log_mix(q, special.logsumexp(np.log(weights) + shifts * x[..., None] - shifts**2 / 2, axis=-1))


def hockey_stick_on_grid(p: np.ndarray, q: np.ndarray, dx: float, eps: float) -> float:
    """``max(H(P||Q), H(Q||P))`` at ``e^eps`` from densities on a uniform grid."""
    e = math.exp(eps)
    return max(float(np.maximum(p - e * q, 0).sum() * dx), float(np.maximum(q - e * p, 0).sum() * dx))


def twice_vertex(c_inf: float) -> np.ndarray:
    """The worst-case gradient of twice sampling (``c2 = 1``): ``floor(d0)`` coordinates at ``c_inf``, one at the
    rest."""
    from dpmath.twice_sampling import split_d0

    full, rest = split_d0(1.0, c_inf)
    return np.r_[np.full(full, c_inf), [math.sqrt(rest)] if rest > 1e-12 else []]


def twice_log_ratio(y: np.ndarray, g: np.ndarray, sigma: float, q1: float, q2: float) -> np.ndarray:
    """``log P/Q`` of one twice-sampling step at output ``y`` (rows) for the gradient ``g``."""
    return _log_mix(q1, _log_mix(q2, (g * y - g * g / 2) / sigma**2).sum(1))


def _gaussian_like(spec: dict, scale_sampler, shifts: np.ndarray, weights: np.ndarray, upper_mech, name, detail):
    """Simulation of a subsampled Gaussian whose shift is ``a / sigma`` with ``a`` from ``scale_sampler``."""
    from dpmath import PLDAccountant

    sigma = positive_real(spec["sigma"], "sigma")
    q = sample_rate(spec["q"], "q")
    steps = _steps(spec)
    factor, account_steps = _broken(spec)

    def sample(rng, n, with_example):
        x = rng.standard_normal((n, steps))
        if with_example:
            a = scale_sampler(rng, (n, steps))
            x = x + (rng.random((n, steps)) < q) * a / (sigma * factor)
        if steps == 1:
            return x[:, 0]  # the likelihood ratio is increasing in x: x is the Neyman-Pearson statistic
        return _subsampled_llr(x, shifts / sigma, weights, q).sum(axis=1)
    acc = PLDAccountant().compose(upper_mech, account_steps)
    return _Simulation(name, sample, acc.epsilon(spec["delta"]), "PLD", detail=detail, tradeoff=acc.tradeoff)


def _gaussian(spec: dict, rng: np.random.Generator, pilot: int) -> _Simulation:
    from dpmath import SubsampledGaussian

    mech = SubsampledGaussian(spec["sigma"], spec["q"])
    return _gaussian_like(spec, lambda r, shape: 1.0, np.array([1.0]), np.array([1.0]), mech, spec["name"],
                          "clipped gradient of norm C")


def _estimator_ratios(estimator: str, spectrum: np.ndarray, k: int, n: int, seed: int) -> np.ndarray:
    """``n`` draws of ``Y = estimate / exact`` from the real estimator on ``A = I``, ``G = diag(sqrt(spectrum))``."""
    import torch

    from dpsgd.estimators import ESTIMATORS

    fn = ESTIMATORS[estimator]
    d = spectrum.size
    a = torch.eye(d, dtype=torch.float64).unsqueeze(0)
    g = torch.diag(torch.as_tensor(np.sqrt(spectrum), dtype=torch.float64)).unsqueeze(0)
    gen = torch.Generator().manual_seed(seed)
    # the projection is shared by a batch, so each call gives one independent draw
    return np.array([float(fn(a, g, k, gen)) for _ in range(n)]) / float(spectrum.sum())


def _candidates(estimator: str, k: int, d: int) -> dict[str, np.ndarray]:
    from dpmath import HutchEnvelope

    from .envelope import envelope_member

    out = {"vertex": np.r_[1.0, np.zeros(d - 1)], "centre": np.full(d, 1.0 / d)}
    if estimator == "hutch" and d > 1:
        env = HutchEnvelope(k, d)
        out["heavy-light maximizer"] = envelope_member(env, 1 + (env.x_plus - 1) / 2)
    if estimator == "hutchpp":
        for r in (k + 1, 2 * k):
            if r <= d:
                out[f"flat rank {r}"] = np.r_[np.full(r, 1.0 / r), np.zeros(d - r)]
    return {name: np.maximum(lam, 1e-300) for name, lam in out.items()}


def _hockey_stick(scales: np.ndarray, sigma: float, q: float, eps: float) -> float:
    """Both directions' hockey-stick divergence of one step whose shift is ``a/sigma``, ``a`` uniform over
    ``scales`` (quadrature on a grid; used to pick the worst spectrum, not as a bound)."""
    hist, edges = np.histogram(1.0 / np.sqrt(scales), bins=200)
    mu = (edges[:-1] + edges[1:]) / 2 / sigma
    w = hist / hist.sum()
    x = np.linspace(-10, mu.max() + 10, 4000)
    p = (1 - q) * stats.norm.pdf(x) + q * (w * stats.norm.pdf(x[:, None] - mu)).sum(1)
    return hockey_stick_on_grid(p, stats.norm.pdf(x), float(x[1] - x[0]), eps)


def _rc(spec: dict, rng: np.random.Generator, pilot: int) -> _Simulation:
    from dpmath import HutchEnvelope, HutchPPEnvelope, SubsampledGaussian

    estimator = spec.get("estimator", "hutch")
    if estimator not in ("hutch", "hutchpp"):
        raise ValueError(f"estimator must be 'hutch' or 'hutchpp', got {estimator!r}")
    k, d = positive_int(spec["k"], "k"), positive_int(spec["d"], "d")
    sigma, q = positive_real(spec["sigma"], "sigma"), sample_rate(spec["q"], "q")
    env = (HutchEnvelope if estimator == "hutch" else HutchPPEnvelope)(k, d)
    honest = SubsampledGaussian(sigma, q, env)
    seed = int(rng.integers(2**31))
    candidates = _candidates(estimator, k, d)
    pilots = {name: _estimator_ratios(estimator, lam, k, pilot, seed + i)
              for i, (name, lam) in enumerate(candidates.items())}
    worst = max(pilots, key=lambda name: sum(_hockey_stick(pilots[name], sigma, q, e) for e in (0.5, 1.0, 2.0)))
    pool = _estimator_ratios(estimator, candidates[worst], k, spec["y_pool"], seed + 99)
    scale_pool = 1.0 / np.sqrt(np.maximum(pool, 1e-300))

    hist, edges = np.histogram(1.0 / np.sqrt(pilots[worst]), bins=64)
    keep = hist > 0
    shifts, weights = ((edges[:-1] + edges[1:]) / 2)[keep], (hist / hist.sum())[keep]
    mech = SubsampledGaussian(sigma, q) if spec.get("account_as_dpsgd") else honest
    return _gaussian_like(spec, lambda r, shape: r.choice(scale_pool, size=shape), shifts, weights, mech,
                          spec["name"], f"{estimator} on the {worst} spectrum (of {len(pilots)} candidates), Y from "
                                        f"{spec['y_pool']:,} real estimator calls")


def _lap2(spec: dict, rng: np.random.Generator, pilot: int) -> _Simulation:
    from dpmath import PLDAccountant, SubsampledL2Laplace
    from dpmath.lap2 import published_epsilon

    scale, q = positive_real(spec["scale"], "scale"), sample_rate(spec["q"], "q")
    dim, steps = positive_int(spec["dim"], "dim"), _steps(spec)
    factor, account_steps = _broken(spec)

    def sampler(m):
        g = 1.0 / math.sqrt(m)  # C = 1: m coordinates of g / b shift each

        def sample(r, n, with_example):
            stat = np.zeros(n)
            for _ in range(steps):
                y = r.laplace(0.0, scale * factor, (n, m))
                if with_example:
                    y = y + (r.random((n, 1)) < q) * g
                s = (np.abs(y) - np.abs(y - g)).sum(1) / scale
                stat += _log_mix(q, s)
            return stat
        return sample
    spreads = [m for m in (1, 4, 16, 64) if m <= dim]
    scores = {}
    for m in spreads:
        s = sampler(m)
        scores[m] = _best_split(s(rng, pilot, True), s(rng, pilot, False), spec["delta"])[1]
    m = max(scores, key=scores.get)
    acc = PLDAccountant().compose(SubsampledL2Laplace(scale, q), account_steps)
    published = published_epsilon(spec["delta"], q, steps, scale, 1.0, dim)
    return _Simulation(spec["name"], sampler(m), acc.epsilon(spec["delta"]), "PLD (Gaussian domination)", published,
                       f"g spread evenly over m = {m} of {dim} coordinates (of m in {spreads})", acc.tradeoff)


def _twice(spec: dict, rng: np.random.Generator, pilot: int) -> _Simulation:
    from dpmath.rdp import RDPAccountant
    from dpmath.twice_sampling import TwiceSampledGaussian

    sigma = positive_real(spec["sigma"], "sigma")
    q1, q2 = sample_rate(spec["q1"], "q1"), sample_rate(spec["q2"], "q2")
    c_inf = positive_real(spec["c_inf"], "c_inf")
    steps = _steps(spec)
    factor, account_steps = _broken(spec)
    g = twice_vertex(c_inf)

    def sample(r, n, with_example):
        stat = np.zeros(n)
        for _ in range(steps):
            y = r.standard_normal((n, g.size)) * sigma * factor
            if with_example:
                y = y + (r.random((n, 1)) < q1) * (r.random((n, g.size)) < q2) * g
            stat += twice_log_ratio(y, g, sigma, q1, q2)
        return stat
    acc = RDPAccountant(orders=range(2, 257)).compose(TwiceSampledGaussian(sigma, q1, q2, 1.0, c_inf), account_steps)
    return _Simulation(spec["name"], sample, acc.epsilon(spec["delta"]), "RDP (eq. 8)",
                       detail=f"gradient at the vertex: {int((g == c_inf).sum())} coordinates at c_inf = {c_inf:g}"
                              + (f", one at {g[-1]:.3g}" if g[-1] != c_inf else ""))


def _allocation(spec: dict, rng: np.random.Generator, pilot: int) -> _Simulation:
    from dpmath import PLDAccountant, RandomAllocationGaussian

    sigma = positive_real(spec["sigma"], "sigma")
    t = positive_int(spec["t"], "t")
    epochs = _steps(spec)
    factor, account_epochs = _broken(spec)
    mu = 1.0 / sigma

    def sample(rng, n, with_example):
        x = rng.standard_normal((n, epochs, t))
        if with_example:   # the example's step in each epoch, uniformly at random
            x[np.arange(n)[:, None], np.arange(epochs)[None, :], rng.integers(0, t, (n, epochs))] += mu / factor
        # the Neyman-Pearson statistic: the pair's log-likelihood ratio, summed over epochs
        return (special.logsumexp(mu * x - mu * mu / 2, axis=2) - math.log(t)).sum(axis=1)

    acc = PLDAccountant().compose(RandomAllocationGaussian(sigma, t), account_epochs)
    return _Simulation(spec["name"], sample, acc.epsilon(spec["delta"]), "PLD",
                       detail="clipped gradient of norm C in one step of each epoch", tradeoff=acc.tradeoff)


_KINDS = {"gaussian": _gaussian, "rc": _rc, "lap2": _lap2, "twice": _twice, "allocation": _allocation}


def _draw(sim: _Simulation, rng: np.random.Generator, n: int, with_example: bool, chunk: int = 50_000) -> np.ndarray:
    """``n`` statistics in chunks, so that memory stays bounded for many samples and steps."""
    return np.concatenate([sim.sample(rng, min(chunk, n - i), with_example) for i in range(0, n, chunk)])


def _best_split(with_s: np.ndarray, without_s: np.ndarray, delta: float) -> tuple[float, float]:
    """The threshold whose point estimate of epsilon is largest on these samples: ``(tau, eps)``."""
    n = with_s.size
    taus = np.quantile(without_s, 1 - np.geomspace(min(1e-5, 10 / n), 0.5, 48))
    best = (taus[0], -1.0)
    srt_w, srt_wo = np.sort(with_s), np.sort(without_s)
    for t in taus:
        fp = n - np.searchsorted(srt_wo, t, side="right")
        fn = np.searchsorted(srt_w, t, side="right")
        e = epsilon_lower_bound(int(fp), int(fn), n, delta, 0.5)
        if e > best[1]:
            best = (t, e)
    return best


def privacy_audit(samples: int = 400_000, delta: float = 1e-5, confidence: float = 0.95, seed: int = 0,
                  mechanisms: list[dict] | None = None, y_pool: int = 100_000, pilot: int = 5_000) -> AuditResult:
    r"""Simulate mechanisms on worst-case neighbours; their certified epsilon lower bounds must not exceed
    the accountant's upper bounds (module docstring for the mechanisms, statistics and bounds).

    Parameters
    ----------
    samples : int
        Runs per hypothesis (half select the threshold, half count errors), ``>= 1000``.
    delta : float
        In ``(0, 1)``.
    confidence : float
        Joint confidence of all lower bounds, in ``(0, 1)``.
    seed : int
    mechanisms : list of dict, optional
        Defaults to :data:`DEFAULT_MECHANISMS`.  Keys: ``name``, ``kind`` (``"gaussian"``, ``"rc"``, ``"lap2"``,
        ``"twice"``, ``"allocation"``) and the kind's parameters (module docstring); broken variants: ``noise_factor``,
        ``account_steps``, ``account_as_dpsgd``.  Without torch the ``"rc"`` mechanisms are left out (they
        draw the real estimator), which the summary says.
    y_pool : int
        Real estimator calls per randomized-clipping mechanism.
    pilot : int
        Samples per candidate when choosing the worst-case neighbour.

    Returns
    -------
    AuditResult
        A check; LAP2 rows also carry paper 003's published epsilon (``eps published``), which
        :func:`verify.claims.claims_audit` turns into a finding.

    Examples
    --------
    >>> from verify.privacy import privacy_audit
    >>> r = privacy_audit(samples=20_000, mechanisms=[{"name": "DP-SGD", "kind": "gaussian", "sigma": 1.0, "q": 1.0}])
    >>> r.holds, r.rows[0]["eps lower (audit)"] <= r.rows[0]["eps upper (ours)"]
    (True, True)
    """
    samples = positive_int(samples, "samples")
    if samples < 1000:
        raise ValueError(f"samples must be at least 1000, got {samples}")
    delta = open_probability(delta, "delta")
    confidence = open_probability(confidence, "confidence")
    y_pool, pilot = positive_int(y_pool, "y_pool"), positive_int(pilot, "pilot")
    specs = [dict(m) for m in (DEFAULT_MECHANISMS if mechanisms is None else mechanisms)]
    for spec in specs:
        if spec.get("kind", "gaussian") not in _KINDS:
            raise ValueError(f"mechanism kind must be one of {sorted(_KINDS)}, got {spec.get('kind')!r}")
        spec.setdefault("kind", "gaussian")
        spec.setdefault("name", f"{spec['kind']} mechanism")
        spec.update(delta=delta, y_pool=y_pool)
    left_out = []
    if (missing := skipped_without("torch", "privacy")) is not None:
        # a randomized-clipping mechanism draws the real estimator (torch); the other mechanisms need none
        left_out = [spec["name"] for spec in specs if spec["kind"] == "rc"]
        specs = [spec for spec in specs if spec["kind"] != "rc"]
        if not specs:
            return missing
    rng = np.random.default_rng(seed)
    level = 1 - (1 - confidence) / len(specs)
    half = samples // 2
    rows, figures, plotted = [], [], set()
    for spec in progress(specs, "privacy"):
        sim = _KINDS[spec["kind"]](spec, rng, pilot)
        p_sel, q_sel = _draw(sim, rng, half, True), _draw(sim, rng, half, False)
        tau, _ = _best_split(p_sel, q_sel, delta)
        p_eval, q_eval = _draw(sim, rng, half, True), _draw(sim, rng, half, False)
        lower = epsilon_lower_bound(int((q_eval > tau).sum()), int((p_eval <= tau).sum()), half, delta, level)
        row = {"mechanism": sim.name, "worst case": sim.detail, "eps lower (audit)": round(lower, 4),
               "eps upper (ours)": round(sim.upper, 4), "accountant": sim.accountant,
               "holds": bool(lower <= sim.upper)}
        if sim.published is not None:
            row["eps published"] = round(sim.published, 4)
        rows.append(row)
        honest = not spec.get("noise_factor") and "account_steps" not in spec and not spec.get("account_as_dpsgd")
        if sim.tradeoff is not None and honest and spec["kind"] not in plotted:
            plotted.add(spec["kind"])
            figures.append(_tradeoff_figure(sim, p_eval, q_eval))
    holds = all(r["holds"] for r in rows)
    summary = (f"{sum(r['holds'] for r in rows)} of {len(rows)} mechanisms: audited lower bound <= our upper bound "
               f"({samples:,} samples, joint confidence {confidence:g}, delta {delta:g})")
    if left_out:
        summary += f"; SKIPPED the randomized-clipping mechanisms ({', '.join(left_out)}): {missing.skipped}"
    return AuditResult("privacy", "check", holds, summary, rows, figures)


def _tradeoff_figure(sim: _Simulation, with_s: np.ndarray, without_s: np.ndarray) -> Figure:
    taus = np.quantile(without_s, 1 - np.geomspace(1e-4, 1, 80))
    srt_w, srt_wo = np.sort(with_s), np.sort(without_s)
    alpha = 1 - np.searchsorted(srt_wo, taus, side="right") / srt_wo.size
    beta = np.searchsorted(srt_w, taus, side="right") / srt_w.size
    grid = np.geomspace(1e-4, 1, 200)
    theory = sim.tradeoff(grid)
    margin = beta - sim.tradeoff(np.clip(alpha, 1e-12, 1))

    def draw(ax):
        ax.plot(grid, theory, "k-", label="accountant's lower bound on the trade-off")
        ax.plot(alpha, beta, "C1.", ms=3, label="empirical (threshold tests)")
        ax.set_xscale("log")
        ax.set_xlabel("type I error (alpha)")
        ax.set_ylabel("type II error (beta)")
        ax.set_title(sim.name, fontsize=9)
        ax.legend(fontsize=7, loc="lower left")
        inset = ax.inset_axes([0.52, 0.52, 0.45, 0.42])   # the margin: must stay >= 0 (up to sampling error)
        inset.axhline(0, color="k", lw=0.8)
        inset.plot(alpha, margin, "C1.", ms=2)
        inset.set_xscale("log")
        inset.set_title("margin: empirical - bound (>= 0)", fontsize=7)
        inset.tick_params(labelsize=6)
    return Figure(f"tradeoff-{slug(sim.name)}", f"Trade-off of {sim.name}: every empirical point must lie above the "
                  "accountant's curve; the inset shows the margin.", draw)

r"""Balls in bins (random allocation) against two computations that share nothing with its PLD.

:class:`dpmath.RandomAllocationGaussian` accounts an epoch of ``t`` steps, each example in one of them, by the
dominating pair ``P = (1/t) sum_j N(e_j / sigma, I_t)``, ``Q = N(0, I_t)`` (Chua et al. 2025), whose loss is the log
of ``S = (1/t) sum_j W_j``, a mean of lognormal terms (:mod:`dpmath.pld.allocation`).  Two referees:

* :func:`allocation_delta_estimate`: Monte Carlo ``delta(eps)`` of one epoch, the larger direction.  Removing
  the example, ``E_P[(1 - e^eps / S)_+]`` with the example's step drawn uniformly (sampling under ``P`` keeps the
  integrand in ``[0, 1]``, so the tail ``E_Q[(S - e^eps)_+]`` needs no heavy-tailed draws); adding it,
  ``E_Q[(1 - e^eps S)_+]``.  Bounded integrands: the standard error is estimated, and a normal quantile over
  all points (Bonferroni) gives the stated joint confidence.
* :func:`allocation_rdp_epsilon`: the Renyi divergence of the pair for removing, at integer orders
  ``a``, is ``log E_Q[S^a] / (a - 1)``, and ``E (sum_j W_j)^a`` is ``a!`` times the ``z^a`` coefficient of
  ``(sum_k E W^k z^k / k!)^t`` with ``E W^k = exp(k (k - 1) / (2 sigma^2))``: exact moments, composed over epochs and
  converted with ``log(1/delta) / (a - 1)``.  An upper bound on removing's epsilon: the accountant's bracket
  must start below it (and in practice ends below it too, RDP being the looser conversion).

:func:`allocation_audit` (``python -m verify --only allocation``) checks the accountant's one-epoch ``delta``
bracket against the Monte Carlo estimate at several ``eps``, and its several-epoch ``epsilon`` bracket against
the Renyi bound.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from dpmath.validation import open_probability, positive_int, positive_real

from .result import AuditResult, progress

__all__ = ["ALLOCATION_CONFIGS", "allocation_audit", "allocation_delta_estimate", "allocation_rdp_epsilon"]

ALLOCATION_CONFIGS = [(0.8, 10, 3), (1.5, 20, 9), (1.0, 100, 3), (2.0, 50, 9), (0.35, 20, 2), (1.5, 12, 3, 3)]
"""``(sigma, steps per epoch, epochs[, participations])`` audited by :func:`allocation_audit`; the quick run takes
the first."""


def allocation_delta_estimate(noise_multiplier: float, steps: int, epsilons: np.ndarray, draws: int, seed: int = 0,
                              chunk: int = 50_000, participations: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Monte Carlo ``delta(eps)`` of one epoch of random allocation, the larger of the two directions at each
    ``eps``, and its standard error (module docstring).

    With ``k = participations > 1`` the pair is the epoch's own, not the composition the accountant bounds it by:
    ``P`` the average over ``k``-subsets ``A`` of ``N(1_A / sigma, I_t)``, whose likelihood ratio to ``Q`` is
    ``e_k(W) / C(t, k)``, the elementary symmetric polynomial of the ``W_j = exp(x_j / sigma - 1 / (2 sigma^2))``
    over its number of terms (plain draws under ``P``: the example's ``k`` steps drawn uniformly).

    Parameters
    ----------
    noise_multiplier : float
        ``sigma > 0``.
    steps : int
        Steps in the epoch, ``t >= 1``.
    epsilons : array_like
        Where to estimate ``delta``.
    draws : int
        Draws of the pair, ``>= 100``.
    seed : int
    chunk : int
        Draws held in memory at once (``chunk * steps`` normals).
    participations : int
        Steps each example is in, ``k`` in ``[1, steps]``.

    Returns
    -------
    (estimate, standard error) : tuple of ndarray

    Examples
    --------
    >>> from verify.allocation import allocation_delta_estimate
    >>> est, se = allocation_delta_estimate(2.0, 1, [0.0], 100_000)   # one step: the Gaussian, delta(0) = 0.197
    >>> bool(abs(est[0] - 0.19741) < 5 * se[0])
    True
    """
    sigma = positive_real(noise_multiplier, "noise_multiplier")
    t = positive_int(steps, "steps")
    n = positive_int(draws, "draws")
    if n < 100:
        raise ValueError(f"draws must be at least 100, got {n}")
    k = positive_int(participations, "participations")
    if k > t:
        raise ValueError(f"participations must lie in [1, steps={t}], got {k}")
    e = np.exp(np.asarray(epsilons, dtype=np.float64).ravel())
    mu = 1.0 / sigma
    rng = np.random.default_rng(seed)
    sums = np.zeros((2, 2, e.size))   # direction, (sum, sum of squares), eps
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        x = rng.standard_normal((m, t))
        s_q = _subset_mean(np.exp(mu * x - mu * mu / 2), k)
        if k == 1:
            x[np.arange(m), rng.integers(0, t, m)] += mu
        else:   # the k smallest of t uniforms: a uniformly random k-subset
            x[np.arange(m)[:, None], np.argpartition(rng.random((m, t)), k - 1, axis=1)[:, :k]] += mu
        s_p = _subset_mean(np.exp(mu * x - mu * mu / 2), k)
        for d, values in enumerate((np.maximum(1.0 - e[None, :] / s_p[:, None], 0.0),
                                    np.maximum(1.0 - e[None, :] * s_q[:, None], 0.0))):
            sums[d, 0] += values.sum(axis=0)
            sums[d, 1] += (values * values).sum(axis=0)
    mean = sums[:, 0] / n
    se = np.sqrt(np.maximum(sums[:, 1] / n - mean * mean, 0.0) / n)
    pick = mean[0] >= mean[1]
    return np.where(pick, mean[0], mean[1]), np.where(pick, se[0], se[1])


def _subset_mean(w: np.ndarray, k: int) -> np.ndarray:
    """``e_k(w) / C(t, k)`` along each row: the mean over ``k``-subsets of the product of their terms (the
    recursion ``e_i <- e_i + w_j e_{i-1}`` over the ``t`` columns; all terms positive, so no cancellation)."""
    if k == 1:
        return w.mean(axis=1)
    e = np.zeros((k + 1, w.shape[0]))
    e[0] = 1.0
    for j in range(w.shape[1]):
        e[1:] += w[:, j] * e[:-1]   # the right side is evaluated first: e_{i-1} before this column
    return e[k] / math.comb(w.shape[1], k)


def allocation_rdp_epsilon(noise_multiplier: float, steps: int, epochs: int, delta: float,
                           orders: range = range(2, 64)) -> float:
    """The Renyi bound on removing's epsilon after ``epochs`` epochs of random allocation (module docstring).

    Examples
    --------
    >>> from verify.allocation import allocation_rdp_epsilon
    >>> round(allocation_rdp_epsilon(2.0, 50, 9, 1e-6), 4)
    1.2206
    """
    sigma = positive_real(noise_multiplier, "noise_multiplier")
    t = positive_int(steps, "steps")
    n = positive_int(epochs, "epochs")
    d = open_probability(delta, "delta")
    mu2 = 1.0 / (sigma * sigma)
    best = math.inf
    for a in orders:
        # log of E W^k / k!, then the polynomial power in logs (terms are positive: logsumexp keeps them exact)
        log_terms = np.array([mu2 * k * (k - 1) / 2 - math.lgamma(k + 1) for k in range(a + 1)])
        power = np.full(a + 1, -np.inf)
        power[0] = 0.0
        base, exp_t = log_terms, t
        while exp_t:   # square and multiply, truncated at degree a
            if exp_t & 1:
                power = _log_product(power, base, a)
            base = _log_product(base, base, a)
            exp_t >>= 1
        log_moment = float(power[a]) + math.lgamma(a + 1) - a * math.log(t)
        best = min(best, n * log_moment / (a - 1) + math.log(1.0 / d) / (a - 1))
    return best


def _log_product(a: np.ndarray, b: np.ndarray, degree: int) -> np.ndarray:
    """The coefficients (in logs) of the product of two polynomials given in logs, up to ``degree``."""
    out = np.full(degree + 1, -np.inf)
    for k in range(degree + 1):
        out[k] = special.logsumexp(a[:k + 1] + b[k::-1])
    return out


def allocation_audit(configs: list[tuple[float, int, int]] | None = None, *, draws: int = 400_000,
                     epsilons: tuple[float, ...] = (0.1, 0.3, 0.6, 1.0), delta: float = 1e-6,
                     confidence: float = 0.95, seed: int = 0) -> AuditResult:
    r"""The balls-in-bins accountant against the Monte Carlo ``delta`` and the Renyi bound (a check).

    Parameters
    ----------
    configs : list of tuple, optional
        ``(sigma, steps per epoch, epochs)``, or with a fourth entry ``k``, the participations of an epoch of k of T
        steps; defaults to the first of :data:`ALLOCATION_CONFIGS`.  With ``k > 1`` the Monte Carlo is of the epoch's
        own pair and the bracket is the composition that bounds it, so only its upper end is checked (the epoch is
        more private than the bracket's lower end), and there is no Renyi bound.
    draws : int
        Monte Carlo draws of the pair per configuration.
    epsilons : tuple of float
        Where one epoch's ``delta`` bracket is checked.
    delta : float
        Where the several-epoch ``epsilon`` is compared with the Renyi bound.
    confidence : float
        Joint confidence of the Monte Carlo comparisons (a normal quantile, Bonferroni over all points).
    seed : int

    Returns
    -------
    AuditResult
        One row per configuration: the largest distance of an estimate outside the bracket in standard errors,
        the bracket's width, the several-epoch bracket beside the Renyi bound, and the time.

    Examples
    --------
    >>> from verify.allocation import allocation_audit
    >>> allocation_audit([(2.0, 10, 1)], draws=20_000).holds   # sigma 2, one epoch of 10 steps: a few seconds
    True
    """
    from dpmath import PLDAccountant, RandomAllocationGaussian

    configs = [ALLOCATION_CONFIGS[0]] if configs is None else configs
    conf = open_probability(confidence, "confidence")
    z = float(-special.ndtri((1.0 - conf) / (2 * len(configs) * len(epsilons))))
    rows = []
    for i, (sigma, t, epochs, *rest) in enumerate(progress(configs, "allocation")):
        k = rest[0] if rest else 1
        mech = RandomAllocationGaussian(sigma, t, participations=k)
        est, se = allocation_delta_estimate(sigma, t, np.array(epsilons), draws, seed + i, participations=k)
        one = PLDAccountant().compose(mech)
        outside, widths = 0.0, []
        for e, m, s in zip(epsilons, est, se, strict=True):
            lo, hi = one.delta_bracket(e)
            widths.append((hi - lo) / hi if hi > 0 else 0.0)
            if s > 0:
                miss = max(lo - m if k == 1 else 0.0, m - hi, 0.0)
                outside = max(outside, float(miss / s))
            elif (k == 1 and lo > m + 3.0 / draws) or m > hi:
                # no draw reached eps (a delta far below 1 / draws): the estimate only says delta < 3 / draws (the
                # rule of three, 95 %), which a lower end above it contradicts
                outside = math.inf
        lo, hi = PLDAccountant().compose(mech, epochs).epsilon_bracket(delta)
        rdp = allocation_rdp_epsilon(sigma, t, epochs, delta) if k == 1 else math.inf
        rows.append({"sigma, steps per epoch, epochs": f"{sigma:g}, {t}, {epochs}" + (f", k {k}" if k > 1 else ""),
                     "one epoch: MC outside the delta bracket (s.e.)": round(outside, 2),
                     "delta bracket width": f"{max(widths):.2%}",
                     f"epsilon at {delta:g} [lower, upper]": f"[{lo:.4f}, {hi:.4f}]",
                     "Renyi bound": round(rdp, 4) if k == 1 else "-", "holds": bool(outside <= z and lo <= rdp)})
    holds = all(r["holds"] for r in rows)
    summary = (f"{sum(r['holds'] for r in rows)} of {len(rows)} balls-in-bins configurations: Monte Carlo delta "
               f"within the bracket ({draws:,} draws, joint confidence {conf:g}) and the lower end below the Renyi "
               f"bound")
    return AuditResult("allocation", "check", holds, summary, rows)

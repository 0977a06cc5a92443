r"""Banded matrix factorization under cyclic Poisson sampling against a Monte Carlo of the mechanism itself.

:class:`dpmath.correlated.BandedMatrixFactorization` accounts a run of ``n`` steps of :math:`y = Cx + z` (``C``
lower-triangular ``b``-banded Toeplitz, :math:`z \sim N(0, \sigma^2 I_n)`) as ``ceil(n / b)`` subsampled-Gaussian
steps at :math:`\sigma / \|c\|`, because an example's participations are ``b`` steps apart and each moves only its
own band of rows.  The referee shares nothing with that argument: it draws the whole mechanism for one example
eligible at steps ``j, j + b, ...`` with a unit gradient at each (one coordinate), each participation included with
probability ``q``, and computes the exact privacy loss

.. math::

    L(y) = \log \sum_{S} q^{|S|} (1-q)^{k-|S|} \exp\Big(\frac{y \cdot m_S}{\sigma^2} - \frac{\|m_S\|^2}{2\sigma^2}\Big),
    \qquad m_S = \sum_{t \in S} C_{:,t},

over all ``2^k`` subsets of the ``k`` eligible steps.  :func:`banded_delta_estimate` estimates
:math:`\delta(\varepsilon)` of the larger direction with bounded integrands (removing: :math:`E_P[(1 - e^{\varepsilon
- L})_+]`; adding: :math:`E_Q[(1 - e^{\varepsilon + L})_+]`), and :func:`correlated_audit` checks that no estimate
lies above the accountant's upper ``delta`` by more than the stated confidence allows.  Where every participation
has a whole column (``C``'s columns cut by the end of the run have smaller norms) the windows are exactly
independent subsampled Gaussians, so the estimate also lies within the bracket.

With randomized clipping each participation's contribution has the norm :math:`a = 1/\sqrt{Y}`, ``Y`` drawn from
the estimator's envelope afresh at each participation (the scales revealed with the output, as the dominating pair
of :class:`~dpmath.mechanisms.SubsampledGaussian` with an envelope reveals them): the referee draws them and sums the
loss over the subsets at the drawn scales; the accountant composes ``ceil(n / b)`` randomized-clipping steps at
:math:`\sigma / \|c\|`.

A negative control runs the same referee with the example eligible every ``b / 2`` steps (two participations in
one band) against the accountant's ``ceil(n / b)``-step value as if the sampling were cyclic: its estimate must
exceed that value, which shows the check can fail.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from scipy import special

from dpmath.validation import open_probability, positive_int, positive_real

from .result import AuditResult, progress

__all__ = ["CORRELATED_CONFIGS", "banded_delta_estimate", "correlated_audit"]

CORRELATED_CONFIGS = [((1.0, 0.5, 0.375), 12, 0.3, 1.0), ((1.0, -0.4, 0.3), 12, 0.5, 0.8),
                      ((1.0, 0.7, 0.6, 0.5), 16, 0.2, 1.2), ((1.0,), 4, 0.4, 1.0)]
"""``(coefficients, steps, q, sigma)`` audited; the quick run takes the first two."""


def banded_delta_estimate(coefficients: tuple[float, ...], steps: int, sample_rate: float, noise_multiplier: float,
                          epsilons: np.ndarray, draws: int, *, separation: int | None = None, first: int = 0,
                          envelope=None, seed: int = 0, chunk: int = 20_000) -> tuple[np.ndarray, np.ndarray]:
    """Monte Carlo ``delta(eps)`` of the whole banded mechanism for one example, the larger of the two directions at
    each ``eps``, and its standard error (module docstring).

    Parameters
    ----------
    coefficients : tuple of float
        The strategy's ``c_0 .. c_{b-1}``.
    steps : int
        ``n``.
    sample_rate : float
        ``q``, each eligible step's inclusion probability.
    noise_multiplier : float
        ``sigma`` of ``z``.
    epsilons : array_like
    draws : int
    separation : int, optional
        Steps between the example's eligible steps (default ``b``: cyclic Poisson sampling).
    first : int
        The first eligible step.
    envelope : dpmath.Envelope, optional
        Randomized clipping: each participation's contribution has the norm ``a = 1 / sqrt(Y)``, ``Y`` drawn from
        the envelope (by its ``ppf``) afresh for each participation and revealed with the output (it cancels from
        the loss's ratio but sets its means).
    seed, chunk : int
    """
    from dpmath.correlated import BandedStrategy

    n, q, sigma = positive_int(steps, "steps"), open_probability(sample_rate, "sample_rate"), positive_real(
        noise_multiplier, "noise_multiplier")
    strategy = BandedStrategy(coefficients)
    sep = strategy.bands if separation is None else positive_int(separation, "separation")
    eligible = list(range(first, n, sep))
    k = len(eligible)
    cols = strategy.matrix(n)[:, eligible]                            # (n, k)
    subsets = np.array(list(itertools.product((0.0, 1.0), repeat=k)))  # (2^k, k)
    log_w = subsets.sum(1) * math.log(q) + (k - subsets.sum(1)) * math.log1p(-q)
    eps = np.asarray(epsilons, dtype=np.float64)
    rng = np.random.default_rng(seed)
    if envelope is not None:
        # the envelope's CDF on a fine grid of Y over its support: a draw's uniform u maps to the largest grid point
        # whose CDF is below u, which lies below the exact quantile, so its scale is never smaller than the exact
        # draw's (a pessimistic referee, whose delta is at least the mechanism's); one vectorized CDF call
        lo, hi = envelope.support_interval()
        grid = np.linspace(lo, hi, 40_001)
        cdf = np.asarray(envelope.cdf(grid), dtype=np.float64)
    sums = np.zeros((2, eps.size))
    squares = np.zeros((2, eps.size))
    done = 0
    while done < draws:
        m = min(chunk, draws - done)
        z = rng.standard_normal((m, n)) * sigma
        pick = rng.random((m, k)) < q
        if envelope is None:
            scale = np.ones((m, k))
        else:   # Y rounded down to the grid point below its quantile: scales at least the true ones
            at = np.searchsorted(cdf, rng.random((m, k)), side="left") - 1
            scale = 1.0 / np.sqrt(grid[np.maximum(at, 0)])
        shift = (pick * scale) @ cols.T
        # each subset's mean at this draw's scales: (m, 2^k, n)
        means_m = (subsets[None, :, :] * scale[:, None, :]) @ cols.T
        half_m = 0.5 * (means_m * means_m).sum(2) / sigma ** 2
        for direction, y in enumerate((shift + z, z)):   # removing: y ~ P; adding: y ~ Q
            loss = special.logsumexp(log_w + np.einsum("mn,msn->ms", y, means_m) / sigma ** 2 - half_m, axis=1)
            arg = eps[None, :] - loss[:, None] if direction == 0 else eps[None, :] + loss[:, None]
            value = np.maximum(0.0, -np.expm1(np.minimum(arg, 0.0)))
            sums[direction] += value.sum(0)
            squares[direction] += (value * value).sum(0)
        done += m
    mean = sums / draws
    se = np.sqrt(np.maximum(squares / draws - mean ** 2, 0.0) / draws)
    larger = np.argmax(mean, axis=0)
    cols_ = np.arange(eps.size)
    return mean[larger, cols_], se[larger, cols_]


def correlated_audit(configs: list | None = None, *, epsilons: tuple[float, ...] = (0.5, 1.0, 2.0),
                     draws: int = 100_000, confidence: float = 0.99, seed: int = 0) -> AuditResult:
    """Check :class:`~dpmath.correlated.BandedMatrixFactorization`'s delta against :func:`banded_delta_estimate` on
    ``configs`` (``(coefficients, steps, q, sigma)``; default the first two of :data:`CORRELATED_CONFIGS`), and run
    the negative control (module docstring).

    Returns
    -------
    AuditResult
        One row per configuration: the largest excess of an estimate over the accountant's upper delta in standard
        errors (must be below the Bonferroni quantile), the largest distance outside the bracket, and the control.

    Examples
    --------
    >>> from verify.correlated import CORRELATED_CONFIGS, correlated_audit
    >>> correlated_audit(CORRELATED_CONFIGS[:1], draws=20_000).holds   # one configuration: a few seconds
    True
    """
    from dpmath import PLDAccountant
    from dpmath.correlated import BandedMatrixFactorization, BandedStrategy

    configs = CORRELATED_CONFIGS[:2] if configs is None else configs
    conf = open_probability(confidence, "confidence")
    z = float(-special.ndtri((1.0 - conf) / (2 * (len(configs) + 2) * len(epsilons))))
    rows = []
    for i, (c, n, q, sigma) in enumerate(progress(configs, "correlated")):
        run = BandedMatrixFactorization(sigma, BandedStrategy(c), n, q)
        acc = PLDAccountant().compose(run.step(), run.participations)
        est, se = banded_delta_estimate(c, n, q, sigma, np.array(epsilons), draws, seed=seed + i)
        above, outside = 0.0, 0.0
        for e, m, s in zip(epsilons, est, se, strict=True):
            lo, hi = acc.delta_bracket(e)
            above = max(above, (m - hi) / s if s > 0 else 0.0)
            outside = max(outside, max(lo - m, m - hi, 0.0) / s if s > 0 else 0.0)
        rows.append({"coefficients": str(tuple(round(v, 3) for v in c)), "steps, q, sigma": f"{n}, {q:g}, {sigma:g}",
                     "participations": run.participations,
                     "MC above the upper delta (s.e.)": round(float(above), 2),
                     "MC outside the bracket (s.e.)": round(float(outside), 2), "holds": bool(above <= z)})
    # randomized clipping: the envelope's random scale at each participation, against SubsampledGaussian steps with it
    from dpmath import HutchEnvelope

    env = HutchEnvelope(16, 64)
    c, n, q, sigma = (1.0, 0.5, 0.375), 9, 0.4, 1.0
    run = BandedMatrixFactorization(sigma, BandedStrategy(c), n, q, env)
    acc = PLDAccountant().compose(run.step(), run.participations)
    est, se = banded_delta_estimate(c, n, q, sigma, np.array(epsilons), draws, envelope=env, seed=seed + 50)
    above = max(((m - acc.delta_bracket(e)[1]) / s if s > 0 else 0.0) for e, m, s in zip(epsilons, est, se,
                                                                                        strict=True))
    rows.append({"coefficients": str(c), "steps, q, sigma": f"{n}, {q:g}, {sigma:g}, {env!r}",
                 "participations": run.participations, "MC above the upper delta (s.e.)": round(float(above), 2),
                 "MC outside the bracket (s.e.)": "upper only", "holds": bool(above <= z)})
    # negative control: eligible every b/2 steps, charged as if a band apart
    c, n, q, sigma = (1.0, 0.9, 0.9, 0.9), 8, 0.5, 1.0
    run = BandedMatrixFactorization(sigma, BandedStrategy(c), n, q)
    acc = PLDAccountant().compose(run.step(), run.participations)
    est, se = banded_delta_estimate(c, n, q, sigma, np.array([1.0]), draws, separation=2, seed=seed + 99)
    hi = acc.delta_bracket(1.0)[1]
    caught = bool((est[0] - hi) / se[0] > z) if se[0] > 0 else False
    rows.append({"coefficients": str(c), "steps, q, sigma": f"{n}, {q:g}, {sigma:g} (eligible every 2 steps)",
                 "participations": 4, "MC above the upper delta (s.e.)": round(float((est[0] - hi) / se[0]), 2),
                 "MC outside the bracket (s.e.)": "control", "holds": caught})
    holds = all(r["holds"] for r in rows)
    summary = (f"{sum(r['holds'] for r in rows[:-1])} of {len(rows) - 1} banded configurations (one with randomized "
               f"clipping): Monte Carlo delta of the whole mechanism at or below the accountant's ({draws:,} draws, "
               f"joint confidence {conf:g}); the "
               f"control (two participations in one band) {'caught' if caught else 'NOT caught'}")
    return AuditResult("correlated", "check", holds, summary, rows)

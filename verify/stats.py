r"""Confidence bounds shared by the audits: Clopper-Pearson intervals, Bonferroni critical values, and the
epsilon lower bound that a test's error counts certify."""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

from dpmath.validation import open_probability

__all__ = ["clopper_pearson", "bonferroni_z", "epsilon_lower_bound"]


def clopper_pearson(successes: ArrayLike, n: int, tail: float) -> tuple[np.ndarray, np.ndarray]:
    r"""One-sided exact binomial bounds: ``P(p < lower) <= tail`` and ``P(p > upper) <= tail``.

    ``lower = Beta^{-1}(tail; s, n - s + 1)``, ``upper = Beta^{-1}(1 - tail; s + 1, n - s)`` (0 and 1 at the
    ends).

    Parameters
    ----------
    successes : array_like of int
        Counts in ``[0, n]``.
    n : int
        Trials, ``>= 1``.
    tail : float
        Error probability of each one-sided bound, in ``(0, 1)``.

    Returns
    -------
    lower, upper : ndarray

    Examples
    --------
    >>> from verify.stats import clopper_pearson
    >>> lo, hi = clopper_pearson(0, 1000, 0.025)
    >>> float(lo), round(float(hi), 5)
    (0.0, 0.00368)
    """
    s = np.asarray(successes)
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if s.size and (not np.issubdtype(s.dtype, np.integer) or s.min() < 0 or s.max() > n):
        raise ValueError(f"successes must be integer counts in [0, n = {n}], got {successes!r}")
    tail = open_probability(tail, "tail")
    s = s.astype(float)
    with np.errstate(invalid="ignore"):
        lower = np.where(s > 0, stats.beta.ppf(tail, s, n - s + 1), 0.0)
        upper = np.where(s < n, stats.beta.ppf(1 - tail, s + 1, n - s), 1.0)
    return lower, upper


def bonferroni_z(alpha: float, tests: int) -> float:
    r"""Two-sided normal critical value at family-wise level ``alpha`` over ``tests`` tests:
    ``Phi^{-1}(1 - alpha / (2 m))``.

    Examples
    --------
    >>> from verify.stats import bonferroni_z
    >>> round(bonferroni_z(0.05, 1), 3)
    1.96
    """
    alpha = open_probability(alpha, "alpha")
    if tests < 1:
        raise ValueError(f"tests must be >= 1, got {tests!r}")
    return float(stats.norm.isf(alpha / (2 * tests)))


def epsilon_lower_bound(false_positives: int, false_negatives: int, n: int, delta: float, confidence: float) -> float:
    r"""Epsilon certified by a test's error counts on ``n`` samples of each hypothesis (Clopper-Pearson).

    With upper confidence bounds ``a`` on the type I and ``b`` on the type II error (each at level
    ``(1 - confidence) / 2``), every ``(eps, delta)``-DP mechanism has ``a >= e^{-eps} (1 - delta - b)``
    (and the symmetric inequality), so ``eps >= log((1 - delta - b) / a)``; the larger of the two is returned
    (0 when neither is positive).  The bound holds with probability ``>= confidence`` over the samples.

    Parameters
    ----------
    false_positives, false_negatives : int
        Errors counted among ``n`` samples under the null (without the example) and the alternative.
    n : int
        Samples per hypothesis.
    delta : float
        In ``[0, 1)``.
    confidence : float
        In ``(0, 1)``.

    Examples
    --------
    >>> from verify.stats import epsilon_lower_bound
    >>> round(epsilon_lower_bound(100, 50_000, 100_000, 1e-5, 0.95), 2)
    6.01
    """
    if not isinstance(n, (int, np.integer)) or n < 1 or not 0 <= false_positives <= n or not 0 <= false_negatives <= n:
        raise ValueError(f"counts must lie in [0, n] with n >= 1, got {false_positives}, {false_negatives}, n = {n}")
    if not 0 <= delta < 1:
        raise ValueError(f"delta must lie in [0, 1), got {delta!r}")
    confidence = open_probability(confidence, "confidence")
    tail = (1 - confidence) / 2
    _, (a, b) = clopper_pearson(np.array([false_positives, false_negatives]), int(n), tail)
    best = 0.0
    for x, y in ((a, b), (b, a)):
        if 1 - delta - y > 0 and x > 0:
            best = max(best, math.log((1 - delta - y) / x))
    return best

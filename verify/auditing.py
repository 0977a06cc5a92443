r"""Score-based privacy auditing: attack scores of canaries in, epsilon lower bounds out, for any trainer.

A *canary* is an example the auditor controls; a *score* is any statistic of what the mechanism released
(the final model, or every noisy update) that tends to be larger when the canary was in the training data
(a loss, a likelihood ratio, a projection of the update).  An :math:`(\varepsilon, \delta)`-DP mechanism
bounds every test between "in" and "out": for every event :math:`S`,
:math:`P_\text{in}(S) \le e^\varepsilon P_\text{out}(S) + \delta` and the same with in and out swapped.
Given scores of canaries that were in (``in_scores``) and out (``out_scores``), :class:`CanaryScoreAuditor`
turns the counts of a threshold test into a lower bound on :math:`\varepsilon` that holds with the stated
confidence over the randomness of the runs:

* :meth:`~CanaryScoreAuditor.epsilon_clopper_pearson`: many independent runs (or independent canaries),
  one threshold; exact one-sided Clopper-Pearson bounds on the test's TPR and FPR (each at
  ``(1 - confidence) / 2``) give :math:`\varepsilon \ge \log((\mathrm{TPR}_{lo} - \delta) / \mathrm{FPR}_{hi})`
  (or the same for the complementary test).  The threshold is chosen on a random part of the scores and the
  bound computed on the rest, so choosing it costs no confidence;
* :meth:`~CanaryScoreAuditor.epsilon_one_run`: one training run with ``m`` canaries, each included
  independently with probability 1/2 (Steinke, Nasr and Jagielski 2023): the auditor guesses "in" for the
  ``k`` highest and "out" for the ``k`` lowest scores; under :math:`(\varepsilon, \delta)`-DP the number of
  correct guesses among the ``r = 2k`` is stochastically dominated by
  :math:`\mathrm{Binomial}(r, e^\varepsilon / (1 + e^\varepsilon))` up to a :math:`\delta` term; the bound is
  the largest :math:`\varepsilon` that this p-value rejects (Bonferroni over the tried ``k``).

Pitfalls (each is a way to print a lower bound that is not one):

* choosing the threshold, the direction or ``k`` on the same scores that the bound is computed from,
  without correction (this module splits, or corrects with Bonferroni);
* dependent samples: Clopper-Pearson needs independent scores (independent runs, or canaries whose
  scores cannot influence each other); the one-run bound needs each canary's inclusion to be an
  independent fair coin, decided before training;
* comparing a lower bound at one :math:`\delta` with a reported :math:`\varepsilon` at another;
* reading a small lower bound as evidence of privacy: a weak attack proves nothing; only a lower bound
  *above* the reported :math:`\varepsilon` means something (the accounting or the implementation is wrong).

Examples
--------
>>> import numpy as np
>>> from verify.auditing import CanaryScoreAuditor
>>> rng = np.random.default_rng(0)
>>> auditor = CanaryScoreAuditor(rng.normal(2.0, 1.0, 20_000), rng.normal(0.0, 1.0, 20_000))
>>> bound = auditor.epsilon_clopper_pearson(delta=1e-5, confidence=0.95)
>>> 1.5 < bound.epsilon < 6.5       # 2-GDP: epsilon(1e-5) is about 6.3
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize, special, stats

from .stats import clopper_pearson

__all__ = ["CanaryScoreAuditor", "EpsilonLowerBound"]


@dataclass(frozen=True)
class EpsilonLowerBound:
    """An audited lower bound on epsilon and what it rests on.

    Attributes
    ----------
    epsilon : float
        The lower bound (0 when the scores prove nothing).
    method : str
        ``"clopper-pearson"`` or ``"one-run"``.
    confidence : float
        Probability (over the runs) that the bound holds.
    delta : float
        The delta it is a bound at.
    threshold : float or None
        The test's threshold (Clopper-Pearson).
    counts : dict
        The counts behind it (true/false positives and sample sizes, or guesses and correct guesses).
    """

    epsilon: float
    method: str
    confidence: float
    delta: float
    threshold: float | None = None
    counts: dict = field(default_factory=dict)


def _scores(x: ArrayLike, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=float)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of scores, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite (no NaN or infinity)")
    return a


def _probability(x: object, name: str, *, closed_low: bool = False) -> float:
    v = float(x)
    if not ((0 <= v if closed_low else 0 < v) and v < 1):
        raise ValueError(f"{name} must lie in {'[0, 1)' if closed_low else '(0, 1)'}, got {x!r}")
    return v


def _threshold_bounds(ins: np.ndarray, outs: np.ndarray, delta: float, tail: float,
                      thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per threshold ``t``: the certified epsilon of "in iff score >= t" and of its complement."""
    n_in, n_out = ins.size, outs.size
    tp = n_in - np.searchsorted(np.sort(ins), thresholds, side="left")     # in-scores >= t
    fp = n_out - np.searchsorted(np.sort(outs), thresholds, side="left")   # out-scores >= t
    tpr_lo, _ = clopper_pearson(tp, n_in, tail)
    _, fpr_hi = clopper_pearson(fp, n_out, tail)
    tnr_lo, _ = clopper_pearson(n_out - fp, n_out, tail)
    _, fnr_hi = clopper_pearson(n_in - tp, n_in, tail)
    with np.errstate(divide="ignore", invalid="ignore"):
        high = np.where((tpr_lo > delta) & (fpr_hi > 0), np.log((tpr_lo - delta) / fpr_hi), 0.0)
        low = np.where((tnr_lo > delta) & (fnr_hi > 0), np.log((tnr_lo - delta) / fnr_hi), 0.0)
    return np.maximum(high, 0.0), np.maximum(low, 0.0)


def _one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    r"""P-value of ``v`` or more correct guesses among ``r`` under :math:`(\varepsilon, \delta)`-DP with ``m``
    canaries (Steinke, Nasr, Jagielski 2023, Thm. 3.1 with its delta term, Prop. 5.2)."""
    p = special.expit(eps)
    beta = stats.binom.sf(v - 1, r, p)
    if delta == 0 or v == 0:
        return float(beta)
    i = np.arange(1, v + 1)
    alpha = float(np.max((stats.binom.sf(v - i - 1, r, p) - beta) / i))
    return float(min(1.0, beta + 2 * m * delta * alpha))


class CanaryScoreAuditor:
    """Epsilon lower bounds and attack power from the scores of included and excluded canaries.

    Parameters
    ----------
    in_scores, out_scores : array_like
        Scores of canaries that were in the training data, and of canaries that were not (higher means
        "more likely in").  Finite, non-empty.

    See the module docstring for the methods, their assumptions and pitfalls.
    """

    def __init__(self, in_scores: ArrayLike, out_scores: ArrayLike) -> None:
        self.in_scores = _scores(in_scores, "in_scores")
        self.out_scores = _scores(out_scores, "out_scores")

    def tpr_at_fpr(self, fpr: float) -> float:
        """The largest empirical true-positive rate of a threshold test whose false-positive rate is
        ``<= fpr`` (a point estimate, no confidence)."""
        fpr = float(fpr)
        if not 0 <= fpr <= 1:
            raise ValueError(f"fpr must lie in [0, 1], got {fpr!r}")
        ts = np.concatenate([np.unique(np.concatenate([self.in_scores, self.out_scores])), [np.inf]])
        fp = 1 - np.searchsorted(np.sort(self.out_scores), ts, side="left") / self.out_scores.size
        tp = 1 - np.searchsorted(np.sort(self.in_scores), ts, side="left") / self.in_scores.size
        ok = fp <= fpr + 1e-15
        return float(tp[ok].max()) if ok.any() else 0.0

    def epsilon_clopper_pearson(self, delta: float = 0.0, confidence: float = 0.95, *,
                                threshold: float | None = None, split: float = 0.5,
                                seed: int = 0) -> EpsilonLowerBound:
        r"""Lower bound from one threshold test, with exact binomial confidence bounds.

        Parameters
        ----------
        delta : float
            The :math:`\delta` the bound is at, in ``[0, 1)``.
        confidence : float
            In ``(0, 1)``; each of the test's two rates gets ``(1 - confidence) / 2``.
        threshold : float, optional
            Use this threshold (both directions are tried, each at half the error budget, i.e. a
            Bonferroni correction), on all the scores.  Default: choose threshold and direction on a random
            fraction ``split`` of the scores and compute the bound on the rest.
        split : float
            Fraction of each score set used to choose the threshold, in ``(0, 1)``.
        seed : int
            Seed of the split.

        Returns
        -------
        EpsilonLowerBound
        """
        delta = _probability(delta, "delta", closed_low=True)
        confidence = _probability(confidence, "confidence")
        alpha = 1 - confidence
        ins, outs = self.in_scores, self.out_scores
        if threshold is not None:
            t = np.array([float(threshold)])
            high, low = _threshold_bounds(ins, outs, delta, alpha / 4, t)
            direction = "high" if high[0] >= low[0] else "low"
            eps = float(max(high[0], low[0]))
            chosen, ev_in, ev_out = float(threshold), ins, outs
        else:
            split = _probability(split, "split")
            rng = np.random.default_rng(seed)
            pin, pout = rng.permutation(ins), rng.permutation(outs)
            a, b = int(round(split * pin.size)), int(round(split * pout.size))
            if not (0 < a < pin.size and 0 < b < pout.size):
                raise ValueError(f"too few scores to split ({ins.size} in, {outs.size} out at split={split}): give "
                                 f"a threshold, or more scores")
            sel_in, ev_in, sel_out, ev_out = pin[:a], pin[a:], pout[:b], pout[b:]
            cand = np.unique(np.concatenate([sel_in, sel_out]))
            high, low = _threshold_bounds(sel_in, sel_out, delta, alpha / 2, cand)
            i, j = int(np.argmax(high)), int(np.argmax(low))
            direction, chosen = ("high", float(cand[i])) if high[i] >= low[j] else ("low", float(cand[j]))
            h, lo = _threshold_bounds(ev_in, ev_out, delta, alpha / 2, np.array([chosen]))
            eps = float(h[0] if direction == "high" else lo[0])
        tp = int((ev_in >= chosen).sum())
        fp = int((ev_out >= chosen).sum())
        return EpsilonLowerBound(eps, "clopper-pearson", confidence, delta, chosen,
                                 {"direction": direction, "true_positives": tp, "false_positives": fp,
                                  "n_in": int(ev_in.size), "n_out": int(ev_out.size)})

    def epsilon_one_run(self, delta: float = 0.0, confidence: float = 0.95,
                        guess_fractions: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)) -> EpsilonLowerBound:
        r"""Lower bound from one run with ``m`` canaries (Steinke, Nasr and Jagielski 2023).

        Requires each canary to have been included independently with probability 1/2.  For each
        fraction ``f`` the auditor guesses "in" for the ``k = f m / 2`` highest scores and "out" for the
        ``k`` lowest; the bound is the best over the fractions, each tested at ``(1 - confidence) /
        len(guess_fractions)``.

        Parameters
        ----------
        delta : float
            In ``[0, 1)``.
        confidence : float
            In ``(0, 1)``.
        guess_fractions : tuple of float
            Fractions of the ``m`` canaries guessed (half "in", half "out"), each in ``(0, 1]``.

        Returns
        -------
        EpsilonLowerBound
        """
        delta = _probability(delta, "delta", closed_low=True)
        confidence = _probability(confidence, "confidence")
        if not guess_fractions or any(not 0 < f <= 1 for f in guess_fractions):
            raise ValueError(f"guess_fractions must be fractions in (0, 1], got {guess_fractions!r}")
        scores = np.concatenate([self.in_scores, self.out_scores])
        truth = np.concatenate([np.ones(self.in_scores.size, bool), np.zeros(self.out_scores.size, bool)])
        order = np.argsort(scores, kind="stable")
        m = scores.size
        level = (1 - confidence) / len(guess_fractions)
        best = EpsilonLowerBound(0.0, "one-run", confidence, delta, None, {"m": m, "guesses": 0, "correct": 0})
        for f in guess_fractions:
            k = max(1, int(f * m / 2))
            if 2 * k > m:
                continue
            correct = int(truth[order[-k:]].sum() + (~truth[order[:k]]).sum())
            eps = self._one_run_epsilon(m, 2 * k, correct, delta, level)
            if eps > best.epsilon:
                best = EpsilonLowerBound(eps, "one-run", confidence, delta, None,
                                         {"m": m, "guesses": 2 * k, "correct": correct})
        return best

    @staticmethod
    def _one_run_epsilon(m: int, r: int, v: int, delta: float, level: float) -> float:
        """The largest epsilon whose p-value for ``v`` correct of ``r`` is ``<= level`` (0 if none)."""
        def gap(eps: float) -> float:
            return level - _one_run_p_value(m, r, v, eps, delta)
        if gap(0.0) <= 0:
            return 0.0
        hi = 1.0
        while gap(hi) > 0:
            if hi > 1e3:
                return math.inf
            hi *= 2
        return float(optimize.brentq(gap, 0.0 if hi == 1.0 else hi / 2, hi, xtol=1e-6))

"""The score-based auditor gives lower bounds that hold (below the true epsilon of a known mechanism, at fixed
seeds), has power, refuses bad input by name; the end-to-end trainer audit passes on the trainer as shipped and
fails on deliberately broken steps."""

import numpy as np
import pytest

from dpmath import PLDAccountant, SubsampledGaussian
from verify.auditing import CanaryScoreAuditor, _one_run_p_value
from verify.training import BREAKS, CONFIGS, audit_config, trainer_audit


def gaussian_epsilon(mu: float, delta: float) -> float:
    acc = PLDAccountant()
    acc.compose(SubsampledGaussian(1 / mu, 1.0), 1)
    return acc.epsilon(delta)


def scores(mu, n, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("delta", [0.0, 1e-5, 0.05])
def test_clopper_pearson_bound_stays_below_the_true_epsilon_of_a_gaussian_mechanism(seed, delta):
    """mu = 1.5 GDP scores (the optimal test's statistic); 95% confidence, so at most about 1 in 20 seeds
    could exceed; these fixed seeds do not."""
    ins, outs = scores(1.5, 4000, seed)
    bound = CanaryScoreAuditor(ins, outs).epsilon_clopper_pearson(delta, 0.95, seed=seed)
    true = gaussian_epsilon(1.5, delta) if delta > 0 else float("inf")
    assert 0 < bound.epsilon <= true
    assert bound.method == "clopper-pearson" and bound.counts["n_in"] == 2000


def test_clopper_pearson_has_power_close_to_the_curve_at_a_large_delta():
    ins, outs = scores(1.5, 20_000, 0)
    bound = CanaryScoreAuditor(ins, outs).epsilon_clopper_pearson(0.05, 0.95)
    assert bound.epsilon > 0.75 * gaussian_epsilon(1.5, 0.05)


@pytest.mark.parametrize("seed", range(5))
def test_identical_score_distributions_prove_nothing(seed):
    ins, outs = scores(0.0, 2000, seed)
    auditor = CanaryScoreAuditor(ins, outs)
    assert auditor.epsilon_clopper_pearson(0.0, seed=seed).epsilon < 0.35
    assert auditor.epsilon_one_run().epsilon == 0.0


def test_an_explicit_threshold_uses_every_score_and_both_directions():
    ins, outs = scores(2.0, 2000, 1)
    b = CanaryScoreAuditor(ins, outs).epsilon_clopper_pearson(1e-5, threshold=2.5)
    assert b.threshold == 2.5 and b.counts["n_in"] == 2000 and b.counts["direction"] == "high"
    assert 0 < b.epsilon <= gaussian_epsilon(2.0, 1e-5)


def test_one_run_bound_with_many_canaries():
    rng = np.random.default_rng(0)
    included = rng.random(4000) < 0.5
    s = rng.normal(0, 1, 4000) + 3.0 * included
    b = CanaryScoreAuditor(s[included], s[~included]).epsilon_one_run(1e-5)
    assert 1.0 < b.epsilon <= gaussian_epsilon(3.0, 1e-5)
    assert b.counts["correct"] <= b.counts["guesses"] <= 4000


def test_one_run_p_value_grows_with_delta_and_falls_with_epsilon():
    assert _one_run_p_value(1000, 100, 90, 1.0, 1e-4) > _one_run_p_value(1000, 100, 90, 1.0, 0.0)
    assert _one_run_p_value(1000, 100, 90, 2.0, 0.0) > _one_run_p_value(1000, 100, 90, 1.0, 0.0)


def test_tpr_at_fpr_is_the_best_threshold_test():
    auditor = CanaryScoreAuditor([3.0, 2.0, 1.0, 0.5], [0.0, 1.5, -1.0, -2.0])
    assert auditor.tpr_at_fpr(0.0) == 0.5       # threshold 2: two of four in-scores, no out-score
    assert auditor.tpr_at_fpr(0.25) == 1.0       # threshold 0.5: every in-score, and the out-score 1.5


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [[1.0, 2.0]]])
def test_bad_scores_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="in_scores"):
        CanaryScoreAuditor(bad, [0.0])


@pytest.mark.parametrize("kw, name", [({"delta": 1.0}, "delta"), ({"delta": -0.1}, "delta"),
                                      ({"confidence": 1.0}, "confidence"), ({"split": 0.0}, "split")])
def test_bad_settings_are_refused_by_name(kw, name):
    with pytest.raises(ValueError, match=name):
        CanaryScoreAuditor([1.0, 2.0, 3.0], [0.0, 0.5, 1.0]).epsilon_clopper_pearson(**kw)


def test_trainer_audit_passes_as_shipped_and_catches_every_broken_step():
    """The tiny decoder with exact clipping, 4000 canary slots, q = 0.5, 2 steps, sigma = 1: the audited bound
    (95% confidence) is below the reported epsilon at delta = 0.05; each broken step lands above it."""
    result = trainer_audit((), breaks=BREAKS, break_config=CONFIGS[2])
    assert result.holds, result.rows
    rows = {r["step"]: r for r in result.rows}
    assert rows["as shipped"]["lower bound (Clopper-Pearson)"] <= rows["as shipped"]["reported epsilon"]
    for b in BREAKS:
        assert rows[f"BROKEN: {b}"]["lower bound (Clopper-Pearson)"] > rows[f"BROKEN: {b}"]["reported epsilon"]


def test_a_caught_break_fails_the_audit(monkeypatch):
    """If a broken step were not caught (here: its check inverted by reporting an epsilon of 100), the audit
    result fails."""
    import verify.training as training

    original = training.audit_config

    def lenient(*a, **kw):
        r = original(*a, **kw)
        if kw.get("broken"):
            r["reported"] = 100.0
        return r
    monkeypatch.setattr(training, "audit_config", lenient)
    result = training.trainer_audit((), breaks=("half-noise",), break_config=CONFIGS[2])
    assert not result.holds


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_trainer_configuration_passes_its_audit(config):
    r = audit_config(config)
    assert r["clopper_pearson"].epsilon <= r["reported"]

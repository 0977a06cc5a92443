"""The verify audits: they pass on this library, have power against broken inputs, and reject bad arguments."""

import pytest

from verify.__main__ import main
from verify.audits import claims_audit, envelope_audit, estimator_audit


def test_quick_run_passes_and_writes_a_report(tmp_path, capsys):
    assert main(["--quick", "--report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "verdict: PASS" in out and "refuted: paper 003 Thm III.7" in out
    report = (tmp_path / "report.md").read_text()
    assert "## Checks of this library's guarantees" in report and "## Findings about published claims" in report


def test_estimator_audit_flags_a_biased_estimator():
    """A Hutchinson estimate scaled by 1.3 must fail the Bonferroni z-test at quick settings."""
    from dpsgd.estimators import hutch

    def biased(a, g, k, gen):
        return 1.3 * hutch(a, g, k, gen)
    r = estimator_audit(draws=1000, estimators={"biased": biased})
    assert not r.holds and "max |z|" in r.summary


def test_envelope_audit_flags_an_envelope_without_its_left_tail(monkeypatch):
    """Shift the vertex's mass: an envelope that drops its left tail (cdf 0 below 1) is caught."""
    import numpy as np

    from dpmath import HutchEnvelope

    real = HutchEnvelope.cdf
    monkeypatch.setattr(HutchEnvelope, "cdf", lambda self, x: np.where(np.asarray(x) < 1.0, 0.0, real(self, x)))
    assert not envelope_audit(cases=((4, 3),), lambdas=5).holds


def test_claims_are_findings_not_failures():
    r = claims_audit()
    assert r.kind == "finding" and not r.holds
    assert sum(not row["holds"] for row in r.rows) == 4


@pytest.mark.parametrize("call, match", [
    (lambda: estimator_audit(draws=-5), "draws"),
    (lambda: estimator_audit(draws=1), "at least 2"),
    (lambda: estimator_audit(alpha=float("nan")), "alpha"),
    (lambda: envelope_audit(lambdas=0), "lambdas"),
    (lambda: envelope_audit(cases=((0, 3),)), "k must be"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_privacy_audit_passes_and_has_power():
    from verify.audits import epsilon_lower_bound, privacy_audit

    assert privacy_audit(samples=200_000).holds
    half_noise = privacy_audit(samples=200_000, mechanisms=[{"name": "half", "sigma": 0.6, "q": 1.0,
                                                             "noise_factor": 0.5}])
    assert not half_noise.holds
    no_tail = privacy_audit(samples=200_000, mechanisms=[{"name": "rc as dpsgd", "sigma": 1.5, "q": 1.0, "k": 4,
                                                          "d": 8, "account_as_dpsgd": True}])
    assert not no_tail.holds
    undercount = privacy_audit(samples=200_000, mechanisms=[{"name": "composition", "sigma": 1.0, "q": 0.5,
                                                             "steps": 10, "account_steps": 2}])
    assert not undercount.holds
    with pytest.raises(ValueError, match="counts"):
        epsilon_lower_bound(5, -1, 10, 1e-5, 0.95)
    with pytest.raises(ValueError, match="sigma"):
        privacy_audit(samples=1000, mechanisms=[{"name": "nan", "sigma": float("nan"), "q": 0.5}])

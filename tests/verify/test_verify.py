"""The verify audits: the quick run passes on this library, every audit has power against a deliberately
broken input, and bad arguments get clear errors."""

import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from verify.__main__ import main
from verify.claims import claims_audit
from verify.divergences import divergence_audit
from verify.envelope import envelope_audit, envelope_claims
from verify.estimators import estimator_audit
from verify.privacy import privacy_audit
from verify.schur_claims import schur_audit
from verify.stats import clopper_pearson, epsilon_lower_bound
from verify.symbolic import symbolic_audit


@pytest.mark.slow
def test_quick_run_passes_and_writes_a_report_with_plots(tmp_path, capsys):
    """The README's main job, whole (about 75 s; the default run does a subset below)."""
    assert main(["--quick", "--report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "verdict: PASS" in out and "REFUTED published claims" in out and "paper 003 Thm III.7" in out
    report = (tmp_path / "report.md").read_text()
    assert "## Checks of this library's guarantees" in report and "## Findings about published claims" in report
    pngs = {p.name for p in tmp_path.glob("*.png")}
    assert {"x-plus-grid.png", "envelope-k4-d6.png", "estimator-gaussian.png", "trainer-canary-audit.png"} <= pngs
    assert any(p.startswith("tradeoff-dp-sgd-rc") for p in pngs)
    assert not any("__" in p or "--" in p for p in pngs)
    for png in pngs:
        assert f"({png})" in report


def test_a_quick_run_of_some_audits_writes_the_verdict_and_a_report_with_plots(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="verify")
    args = ["--quick", "--report", str(tmp_path)]
    for name in ("symbolic", "trainer", "claims"):
        args += ["--only", name]
    assert main(args) == 0
    out = capsys.readouterr().out
    # each audit's start and end (with its seconds) are log records, which the command shows on stderr
    progress = [r.getMessage() for r in caplog.records if r.name == "verify" and r.getMessage().startswith("[")]
    assert progress[0] == "[1/3] symbolic ..." and progress[2] == "[2/3] trainer ..."
    assert re.fullmatch(r"\[1/3\] symbolic \(check\): PASS - .* \([0-9.]+ s\)", progress[1])
    assert len(progress) == 6 and "[1/3]" not in out
    assert "verdict: PASS" in out and "REFUTED published claims" in out and "paper 003 Thm III.7" in out
    report = (tmp_path / "report.md").read_text()
    assert "## Checks of this library's guarantees" in report and "## Findings about published claims" in report
    pngs = {p.name for p in tmp_path.glob("*.png")}
    assert "trainer-canary-audit.png" in pngs
    assert not any("__" in p or "--" in p for p in pngs)
    for png in pngs:
        assert f"({png})" in report


def test_estimator_audit_flags_a_biased_estimator():
    """A Hutchinson estimate scaled by 1.3 must fail the Bonferroni z-test at quick settings."""
    from dpsgd.estimators import hutch

    def biased(a, g, k, gen):
        return 1.3 * hutch(a, g, k, gen)
    r = estimator_audit(draws=1000, estimators={"biased": biased})
    assert not r.holds and any(row["test"] == "bias" and not row["holds"] for row in r.rows)


def test_estimator_audit_flags_an_unbiased_estimator_with_the_wrong_law():
    """Rademacher probes are unbiased but their law is not the chi-square mixture the envelope assumes: the
    law and variance tests catch it where the bias test cannot."""
    import torch

    def rademacher(a, g, k, gen):
        a, g = a.double(), g.double()
        m = a.transpose(1, 2) @ g
        p = (torch.randint(0, 2, (m.shape[-1], k), generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(k)
        return (m @ p).square().sum((1, 2))
    r = estimator_audit(draws=1000, estimators={"hutch": rademacher})
    assert not r.holds
    assert all(row["holds"] for row in r.rows if row["test"] == "bias")
    assert any(not row["holds"] for row in r.rows if row["test"] != "bias")


def test_envelope_audit_flags_an_envelope_without_its_left_tail(monkeypatch):
    from dpmath import HutchEnvelope

    real = HutchEnvelope.cdf
    monkeypatch.setattr(HutchEnvelope, "cdf", lambda self, x: np.where(np.asarray(x) < 1.0, 0.0, real(self, x)))
    r = envelope_audit(cases=((4, 3),), lambdas=5, draws=20_000, starts=1)
    assert not r.holds
    assert all(not row["holds"] for row in r.rows)  # exact, adversarial and Monte Carlo all see it


@pytest.mark.slow  # 26-35 s: kept out of the README's 10-minute run
def test_divergence_audit_flags_an_optimistic_accountant(monkeypatch):
    """An accountant that reports its optimistic discretization as the upper bound misses closed forms."""
    from dpmath import PLDAccountant

    real = PLDAccountant.delta_bracket
    monkeypatch.setattr(PLDAccountant, "delta_bracket", lambda self, eps, lower=True: (real(self, eps)[0],) * 2)
    r = divergence_audit(quad_points=20_001, mc_draws=20_000)
    assert not r.holds and any("subsampled Gaussian" in row["mechanism"] for row in r.failures)


def test_privacy_audit_has_power():
    half_noise = privacy_audit(samples=200_000, mechanisms=[
        {"name": "half", "kind": "gaussian", "sigma": 0.6, "q": 1.0, "noise_factor": 0.5}])
    assert not half_noise.holds
    no_tail = privacy_audit(samples=200_000, y_pool=20_000, mechanisms=[
        {"name": "rc as dpsgd", "kind": "rc", "sigma": 1.5, "q": 1.0, "k": 4, "d": 8, "account_as_dpsgd": True}])
    assert not no_tail.holds
    undercount = privacy_audit(samples=200_000, mechanisms=[
        {"name": "composition", "kind": "gaussian", "sigma": 1.0, "q": 0.5, "steps": 10, "account_steps": 2}])
    assert not undercount.holds
    lap2 = privacy_audit(samples=100_000, mechanisms=[
        {"name": "lap2 quarter noise", "kind": "lap2", "scale": 2.0, "q": 1.0, "dim": 100, "noise_factor": 0.25}])
    assert not lap2.holds


def test_symbolic_audit_flags_a_wrong_implementation(monkeypatch):
    import dpmath.lap2

    real = dpmath.lap2.laplace_moment
    monkeypatch.setattr(dpmath.lap2, "laplace_moment", lambda u, eta, scale=1.0: real(u, eta, scale) * (1 + 1e-9))
    r = symbolic_audit()
    assert not r.holds and len(r.failures) == 1


@pytest.mark.slow  # 10-20 s: kept out of the README's 10-minute run
def test_findings_report_refuted_claims_without_failing():
    r = envelope_claims(ks=(32,), ds=(2, 8))
    assert r.kind == "finding" and not r.holds
    assert [row["holds"] for row in r.rows] == [True, True, True, True, False, False]
    s = schur_audit(cases=((4, 2, 1.0), (4, 3, 1.0)))
    assert [row["holds"] for row in s.rows] == [True, False, True, False]
    c = claims_audit(samples=100_000)
    assert [row["holds"] for row in c.rows] == [True, True, False, False, False]


def test_clopper_pearson_and_epsilon_bound():
    lo, hi = clopper_pearson(np.array([0, 5, 10]), 10, 0.05)
    assert lo[0] == 0 and hi[-1] == 1 and 0 < lo[1] < 0.5 < hi[1] < 1
    # the exact binomial tail at the bound is the level
    from scipy import stats
    assert stats.binom.cdf(5, 10, hi[1]) == pytest.approx(0.05, rel=1e-8)
    assert epsilon_lower_bound(0, 0, 10, 0.0, 0.95) > 0
    assert epsilon_lower_bound(5, 5, 10, 0.0, 0.95) == 0.0


@pytest.mark.parametrize("call, match", [
    (lambda: estimator_audit(draws=-5), "draws"),
    (lambda: estimator_audit(draws=5), "at least 20"),
    (lambda: estimator_audit(alpha=float("nan")), "alpha"),
    (lambda: envelope_audit(lambdas=0), "lambdas"),
    (lambda: envelope_audit(draws=10), "draws"),
    (lambda: envelope_audit(cases=((0, 3),)), "projection_dim must be"),
    (lambda: envelope_claims(ks=(-1,)), "ks"),
    (lambda: divergence_audit(quad_points=5), "quad_points"),
    (lambda: divergence_audit(mc_draws=-1), "mc_draws"),
    (lambda: privacy_audit(samples=-1), "samples"),
    (lambda: privacy_audit(samples=10), "at least 1000"),
    (lambda: privacy_audit(delta=float("nan")), "delta"),
    (lambda: privacy_audit(confidence=1.5), "confidence"),
    (lambda: privacy_audit(samples=1000, mechanisms=[{"kind": "gaussian", "sigma": float("nan"), "q": 0.5}]),
     "noise_multiplier"),
    (lambda: privacy_audit(samples=1000, mechanisms=[{"kind": "gaussian", "sigma": 1.0, "q": 1.5}]), "sample_rate"),
    (lambda: privacy_audit(samples=1000, mechanisms=[{"kind": "gaussian", "sigma": 1.0, "q": 0.5, "steps": 0}]),
     "steps"),
    (lambda: privacy_audit(samples=1000, mechanisms=[{"kind": "laplace?", "sigma": 1.0, "q": 0.5}]), "kind"),
    (lambda: privacy_audit(samples=1000, mechanisms=[{"kind": "rc", "estimator": "exact", "sigma": 1.0, "q": 0.5,
                                                      "k": 4, "d": 8}]), "estimator"),
    (lambda: schur_audit(cases=((4, 3, 1.5),)), "t must be"),
    (lambda: clopper_pearson(np.array([3]), 2, 0.05), "successes"),
    (lambda: clopper_pearson(np.array([1]), 0, 0.05), "n must be"),
    (lambda: epsilon_lower_bound(5, -1, 10, 1e-5, 0.95), "counts"),
    (lambda: epsilon_lower_bound(5, 1, 10, 1e-5, 1.0), "confidence"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_an_audit_whose_dependencies_are_absent_is_skipped_not_passed(monkeypatch):
    import importlib.util

    from verify.peers import peer_audit

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("dp_accounting", "prv_accountant") else real(name, *a))
    r = peer_audit()
    assert r.verdict == "SKIPPED" and "pip install" in r.skipped and r.holds


def test_verify_runs_on_the_core_install_and_skips_what_needs_torch(tmp_path):
    """``pip install -e .`` alone (numpy, scipy, mpmath; no torch, sympy or peers): ``python -m verify --quick``
    runs, and each audit that needs a missing package says SKIPPED with the install line instead of raising.

    The core install is simulated faithfully: ``python -S`` (no site-packages) with only numpy, scipy and mpmath
    linked onto its path, so ``import torch`` fails and ``importlib.util.find_spec("torch")`` is ``None``, as on
    a machine without torch."""
    site = Path(np.__file__).resolve().parents[1]
    core = tmp_path / "site-packages"
    core.mkdir()
    for entry in site.iterdir():
        if entry.name.split("-")[0].split(".")[0] in ("numpy", "scipy", "mpmath"):
            (core / entry.name).symlink_to(entry)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(core)])}
    audits = [arg for name in ("estimators", "privacy", "symbolic", "trainer", "peers") for arg in ("--only", name)]
    run = subprocess.run([sys.executable, "-S", "-m", "verify", "--quick", "--report", str(tmp_path / "report"),
                          *audits], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    install = 'pip install torch==2.13.0 && pip install -e ".[verify]"'
    for name, module in (("estimators", "torch"), ("symbolic", "sympy"), ("trainer", "torch")):
        assert f"SKIPPED {name}: needs {module}, which is not installed: {install}" in run.stdout
    assert f"SKIPPED peers: needs dp_accounting or prv_accountant, neither of which is installed: {install}" \
        in run.stdout
    assert "verdict: PASS (4 skipped: estimators, symbolic, trainer, peers)" in run.stdout
    # the privacy audit runs its mechanisms that need no torch and names the ones it left out
    assert re.search(r"privacy \(check\): PASS - 5 of 5 mechanisms.*SKIPPED the randomized-clipping mechanisms "
                     r"\(DP-SGD-RC Hutch k = 32, d = 8, DP-SGD-RC Hutch\+\+ k = 16, d = 64\): needs torch", run.stderr)
    assert "Traceback" not in run.stderr and "[1/5] estimators ..." in run.stderr


def test_an_audit_called_from_python_without_logging_shows_its_progress_on_stderr(monkeypatch, capsys):
    import verify.result as result

    monkeypatch.setattr(result, "QUIET_FOR", 0.0)
    monkeypatch.setattr(logging.getLogger("verify"), "handlers", [])
    monkeypatch.setattr(logging.getLogger("verify"), "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger("verify"), "propagate", False)
    assert list(result.progress(range(8), "demo")) == list(range(8))
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in err] == [f"verify: [demo] {i}/8" for i in (2, 4, 6, 8)]


def test_an_audit_whose_progress_is_logged_prints_nothing_else(monkeypatch, capsys, caplog):
    import verify.result as result

    monkeypatch.setattr(result, "QUIET_FOR", 0.0)
    with caplog.at_level(logging.INFO, logger="verify"):
        list(result.progress(range(4), "demo"))
    assert not capsys.readouterr().err
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [f"  [demo] {i}/4" for i in (1, 2, 3, 4)]


def test_the_correlated_audit_holds_and_fails_an_accounting_that_halves_the_strategys_column_norm(monkeypatch):
    """The banded accounting's noise multiplier is sigma / ||c||; with ||c|| read as half its value the accountant
    under-charges, and the Monte Carlo of the whole mechanism lands above its delta."""
    from dpmath.correlated import BandedStrategy
    from verify.correlated import correlated_audit

    result = correlated_audit(draws=30_000)
    assert result.holds and result.rows[-1]["holds"]   # the control is caught
    true_norm = BandedStrategy.column_norm
    monkeypatch.setattr(BandedStrategy, "column_norm", property(lambda s: 0.5 * true_norm.fget(s)))
    broken = correlated_audit(draws=30_000)
    assert not broken.holds


def test_the_banded_canary_statistic_is_the_exact_log_likelihood_ratio_of_the_released_updates():
    """Under banded noise the probe's normalized updates are ``x = 1[drawn] / sigma + C^{-1} z``: the whitened
    window statistic summed over the canary's group's steps equals the likelihood ratio of ``x`` in against out,
    a mixture over the subsets of its eligible steps (drawn at ``q`` each) of correlated Gaussians."""
    import itertools

    from scipy import stats

    from dpmath.correlated import BandedStrategy
    from verify.training import _banded_llr

    strategy, sigma, steps, groups = BandedStrategy.sqrt_prefix_sum(2), 0.8, 7, 2
    c_matrix = strategy.matrix(steps)
    inv = np.linalg.inv(c_matrix)
    cov = inv @ inv.T
    rng = np.random.default_rng(0)
    group = np.array([0, 1, 0, 1])
    drawn = np.zeros((steps, 4))
    drawn[::2, 0] = drawn[1::2, 1] = 1.0   # canaries 0 and 1 in at each of their steps; 2 and 3 never
    x = drawn / sigma + inv @ rng.normal(size=(steps, 4))
    for q in (1.0, 0.5):
        ours = _banded_llr(x, strategy.coefficients, sigma, q, group, groups).sum(0)
        for j in range(4):
            eligible = [t for t in range(steps) if t % groups == group[j]]
            out = stats.multivariate_normal(np.zeros(steps), cov).logpdf(x[:, j])
            terms = []
            for subset in itertools.product((0, 1), repeat=len(eligible)):
                if q == 1.0 and not all(subset):
                    continue
                mean = np.zeros(steps)
                mean[[t for t, s in zip(eligible, subset, strict=True) if s]] = 1 / sigma
                weight = q ** sum(subset) * (1 - q) ** (len(subset) - sum(subset))
                terms.append(np.log(weight) + stats.multivariate_normal(mean, cov).logpdf(x[:, j]))
            assert ours[j] == pytest.approx(np.logaddexp.reduce(terms) - out, abs=1e-9)


def test_the_banded_noise_trainer_audit_holds_and_catches_the_run_charged_as_one_cycle():
    """The samplers audit's banded configuration (BandedNoise b = 2 under CyclicPoisson(2), 16 steps at q = 1/2):
    its lower bound stays below the reported epsilon and lands above the epsilon of one cycle."""
    from verify.training import SAMPLER_BREAKS, SAMPLER_CONFIGS, sampler_audit

    config = SAMPLER_CONFIGS[-1]
    assert (config.noise, config.batch_sampling, config.groups) == ("banded", "cyclic_poisson", 2)
    assert set(SAMPLER_BREAKS) == {c.batch_sampling for c in SAMPLER_CONFIGS}
    result = sampler_audit((config,))
    assert result.holds, result.rows
    shipped, broken = result.rows
    assert broken["step"] == "BROKEN: one-cycle"
    assert broken["reported epsilon"] < shipped["lower bound (Clopper-Pearson)"] < shipped["reported epsilon"]

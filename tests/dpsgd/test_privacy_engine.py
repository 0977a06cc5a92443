"""make_private end to end: training steps, calibration, the ledger, checkpoints, atomicity, sampling."""

import logging
import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpmath import EpsilonSchedule, HutchEnvelope, HutchPPEnvelope, PLDAccountant, SubsampledGaussian
from dpsgd import NormPlan, PrivacyEngine, per_sample_sq_norms
from dpsgd.strategies import TwiceSampling

from ..helpers import assert_holds_no_generator_state, engine_generators


def _setup(estimator="hutch", seed=0, n=120, batch=12, ledger_path=None, **kw):
    torch.manual_seed(0)  # the same data and initial model for every engine seed
    x = torch.randn(n, 5)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine(ledger_path=ledger_path)
    args = dict(module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
                criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0, estimator=estimator, projection_dim=32, seed=seed)
    args.update(kw if any(k_ in kw for k_ in ("noise_multiplier", "target_epsilon")) else
                {"noise_multiplier": 1.5, **kw})
    return engine, *engine.make_private(**args)


def _epoch(model, opt, crit, loader):
    for xb, yb in loader:
        crit(model(xb), yb).backward()
        opt.step()


def test_training_runs_and_the_ledger_counts_steps():
    engine, model, opt, crit, loader = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    _epoch(model, opt, crit, loader)
    assert engine.steps == len(loader) == 10
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    eps = engine.get_epsilon(1e-5)
    assert engine.envelope.dim == (5 + 1) + (2 + 1) and isinstance(engine.envelope, HutchEnvelope)
    ref = PLDAccountant().compose(SubsampledGaussian(1.5, 0.1, HutchEnvelope(32, 9)), 10)
    assert engine.accountant().events == ref.events
    assert ref.epsilon_bracket(1e-5)[0] <= eps <= ref.epsilon(1e-5 * (1 - 2e-3))   # tests/dpmath/test_schedule.py
    _epoch(model, opt, crit, loader)
    assert engine.get_epsilon(1e-5) > eps


def test_frequent_get_epsilon_calls_meet_a_fresh_accountant_at_the_same_step_count():
    """A logging loop asks between steps and at every step, at two deltas: each answer is the same number however
    often it is asked, and within a fresh accountant's bracket (tests/dpmath/test_schedule.py: the tolerance)."""
    engine, model, opt, crit, loader = _setup(n=36)
    mechanism = SubsampledGaussian(1.5, 12 / 36, HutchEnvelope(32, 9))
    for xb, yb in loader:
        crit(model(xb), yb).backward()
        opt.step()
        for delta in (1e-5, 1e-6, 1e-5):
            fresh = PLDAccountant().compose(mechanism, engine.steps)
            logged = engine.get_epsilon(delta)
            assert fresh.epsilon_bracket(delta)[0] <= logged <= fresh.epsilon(delta * (1 - 2e-3))
            assert engine.get_epsilon(delta) == logged
    assert engine.steps == 3


def test_overcount_charges_the_next_grid_count_and_computes_once_per_grid_count(monkeypatch):
    """``overcount`` is pessimistic: the epsilon of the first grid count at or above the steps taken, computed
    once for every step count up to it; the steps taken on the grid and at the calibrated count."""
    engine, model, opt, crit, loader = _setup("exact", n=400, batch=10)   # 40 steps an epoch
    computed = []
    epsilon = EpsilonSchedule.epsilon
    monkeypatch.setattr(EpsilonSchedule, "epsilon", lambda s, count, delta: computed.append(count) or
                        epsilon(s, count, delta))
    logged = {}
    for xb, yb in loader:
        crit(model(xb), yb).backward()
        opt.step()
        logged[engine.steps] = engine.get_epsilon(1e-5, overcount=0.25)
    grid = [1, 2, 3, 4, 5, 7, 9, 12, 15, 19, 24, 30, 38, 48]   # each ceil(1.25 x) the one before
    assert computed == grid   # 14 values for 40 logs
    # the engine's schedule: a run of unknown length builds the step for 64 steps, a power of two (at least 64)
    schedule = EpsilonSchedule(engine.accountant().events[0][0], 64)
    for steps, eps in logged.items():
        charged = next(g for g in grid if g >= steps)
        assert charged <= -(-5 * steps // 4)   # ceil(1.25 steps)
        exact = schedule.epsilon(steps, 1e-5)
        assert eps == schedule.epsilon(charged, 1e-5) >= exact
        if steps in grid:
            assert eps == exact
    with pytest.raises(ValueError, match="overcount"):
        engine.get_epsilon(1e-5, overcount=-0.1)
    calibrated, model, opt, crit, loader = _setup("exact", target_epsilon=2.0, target_delta=1e-5, steps=6)
    for xb, yb in loader:
        crit(model(xb), yb).backward()
        opt.step()
        if calibrated.steps == 6:
            break
    # 6 is not on the grid (5, 7) but is the calibrated count: charged exactly, by a fresh accountant
    assert calibrated.get_epsilon(1e-5, overcount=0.25) == calibrated.get_epsilon(1e-5) == \
        calibrated.accountant().epsilon(1e-5) <= 2.0


@pytest.mark.slow
def test_calibrated_sigma_meets_the_target():
    engine, model, opt, crit, loader = _setup(target_epsilon=3.0, target_delta=1e-5, epochs=2)
    for _ in range(2):
        _epoch(model, opt, crit, loader)
    assert engine.steps == 20
    assert 2.9 < engine.get_epsilon(1e-5) <= 3.0


def test_envelope_choice():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3), nn.LayerNorm(3))
    assert NormPlan.build(model, "hutch").envelope_dimension() == (4 + 3 + 1, True)
    assert NormPlan.build(model, "hutchpp").envelope_dimension() == (3 + 1, True)
    engine, *_ = _setup("hutchpp", projection_dim=1)
    assert isinstance(engine.envelope, HutchPPEnvelope)
    engine, *_ = _setup("hutchpp")         # k = 32 >= every matrix's rank: Hutch++ is exact
    assert engine.envelope is None
    engine, *_ = _setup("exact")
    assert engine.envelope is None


def test_a_checkpoint_keeps_the_ledger_and_refuses_other_settings():
    engine, model, opt, crit, loader = _setup(seed=3)
    _epoch(model, opt, crit, loader)
    ckpt = {"engine": engine.state_dict(), "model": {k: v.clone() for k, v in model.state_dict().items()}}
    _epoch(model, opt, crit, loader)
    eps = engine.get_epsilon(1e-5)
    engine2, model2, opt2, crit2, loader2 = _setup(seed=99)
    model2.load_state_dict(ckpt["model"])
    engine2.load_state_dict(ckpt["engine"])
    assert engine2.steps == 10
    _epoch(model2, opt2, crit2, loader2)
    assert engine2.steps == engine.steps == 20 and engine2.get_epsilon(1e-5) == eps
    engine3, *_ = _setup(noise_multiplier=1.2)
    with pytest.raises(ValueError, match="different privacy settings"):
        engine3.load_state_dict(ckpt["engine"])


@pytest.mark.parametrize("kw", [{"estimator": "hutch"},
                                {"estimator": "exact", "clipping": TwiceSampling(0.5, 0.3)}],
                         ids=["hutch", "twice_sampling"])
def test_a_state_dict_holds_nothing_that_predicts_batches_projections_masks_or_noise(kw):
    """The issue's measurement: a state_dict held the noise generator's state, from which the next step's noise,
    and so the un-noised clipped sum, was recovered to 1e-14.  Now it holds the settings and counts only."""
    engine, model, opt, crit, loader = _setup(seed=None, **kw)
    _epoch(model, opt, crit, loader)
    state = engine.state_dict()
    assert set(state) <= {"settings", "steps", "epochs"}
    assert_holds_no_generator_state(state, engine)


def test_a_resume_draws_fresh_batches_projections_and_noise_even_with_the_seed():
    """Two resumes of one checkpoint, with the run's own seed, take different noisy steps, and neither takes the
    step the interrupted run took next: nothing saved, and not the seed either, predicts a resumed run's draws.
    The ledger continues."""
    from ..helpers import one_step_change

    engine, model, opt, crit, loader = _setup(seed=3)
    _epoch(model, opt, crit, loader)
    state, weights = engine.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    changes = [one_step_change(model, opt, crit, loader)]   # the interrupted run's next step
    for _ in range(2):
        resumed, model2, opt2, crit2, loader2 = _setup(seed=3)
        model2.load_state_dict(weights)
        resumed.load_state_dict(state)
        assert resumed.steps == 10
        changes.append(one_step_change(model2, opt2, crit2, loader2))
        assert resumed.steps == 11
    for i in range(3):
        for j in range(i):
            assert not torch.allclose(changes[i], changes[j])


def test_a_state_dict_of_an_earlier_version_loads_without_its_generator_states():
    """Earlier versions saved the generators' states: such a checkpoint still resumes the ledger, with a warning
    that its generator states are ignored (the resumed run draws fresh ones)."""
    engine, model, opt, crit, loader = _setup(seed=None)
    _epoch(model, opt, crit, loader)
    cpu = torch.Generator().manual_seed(1).get_state()
    old = {**engine.state_dict(), "sampling_rng": cpu, "projection_rngs": {"cpu": cpu}, "mask_rngs": {},
           "noise_rngs": {"cpu": cpu}}
    resumed, *_ = _setup(seed=None)
    with pytest.warns(UserWarning, match="generator states .* ignored"):
        resumed.load_state_dict(old)
    assert resumed.steps == 10
    assert all(not torch.equal(g.get_state(), cpu) for g in engine_generators(resumed))


def test_a_seed_warns_that_the_run_is_reproducible_and_not_private_against_its_holder():
    with pytest.warns(UserWarning, match=r"seed=3\b.*reproducible.*no privacy against whoever holds the seed"):
        _setup(seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _setup(seed=None)
    assert not [w for w in caught if "seed" in str(w.message)]
    batches = []
    for _ in range(2):   # reproducible: the same seed, the same batches
        with pytest.warns(UserWarning, match="seed"):
            engine, model, opt, crit, loader = _setup(seed=3)
        batches.append([b for b in loader.logical_sampler])
    assert batches[0] == batches[1]


def test_non_finite_loss_does_not_step_or_count():
    engine, model, opt, crit, loader = _setup()
    _epoch(model, opt, crit, loader)
    steps, params = engine.steps, [p.detach().clone() for p in model.parameters()]
    xb, yb = next(iter(loader))
    loss = crit(model(xb * float("nan")), yb)
    with pytest.raises(FloatingPointError):
        loss.backward()
    with pytest.raises(RuntimeError, match="no private backward consumed it"):
        opt.step()
    assert engine.steps == steps
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))


def test_sampling_modes_and_bad_arguments():
    engine, model, opt, crit, loader = _setup()
    sizes = [len(b) for b in loader.logical_sampler]   # (the loader itself refuses a draw before each step)
    assert len(set(sizes)) > 1  # Poisson: variable batch sizes
    for bad, match in [(dict(noise_multiplier=-1.0), "noise_multiplier"), (dict(max_grad_norm=0.0), "max_grad_norm"),
                       (dict(projection_dim=0, noise_multiplier=1.0), "projection_dim"),
                       (dict(target_epsilon=1.0), "one of epochs or steps are required")]:
        with pytest.raises(ValueError, match=match):
            _setup(**bad)
    frozen = nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        PrivacyEngine().make_private(module=frozen, optimizer=torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1),
                                     data_loader=DataLoader(TensorDataset(torch.ones(4, 3)), batch_size=2),
                                     criterion=nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=1.0)


def test_empty_poisson_batch_takes_a_noise_only_step_without_a_forward():
    """Empty Poisson batches never reach the user's forward; each still takes a noisy, counted step."""
    engine, model, opt, crit, loader = _setup(n=200, batch=1, noise_multiplier=1.0)
    seen = 0
    for xb, yb in loader:
        assert xb.shape[0] > 0
        seen += 1
        crit(model(xb), yb).backward()
        opt.step()
    assert seen < len(loader) and engine.steps == len(loader)


def test_modules_without_a_handler_train_through_the_wrapper():
    """LayerNorm goes through torch.func inside the wrapped model (its hook must not fire again)."""
    torch.manual_seed(0)
    x, y = torch.randn(60, 4), torch.randint(0, 2, (60,))
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2))
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=10), criterion=nn.CrossEntropyLoss(),
        max_grad_norm=1.0, noise_multiplier=1.0, estimator="hutch", projection_dim=8, seed=1)
    _epoch(model, opt, crit, loader)
    assert engine.steps == 6 and isinstance(engine.envelope, HutchPPEnvelope)  # exact parts: the d -> inf limit


@pytest.mark.slow
def test_demo_runs_within_budget(capsys):
    from dpsgd.demo import main
    acc = main(["--train", "512", "--batch-size", "128", "--epochs", "1", "--seq-len", "32"])
    out = capsys.readouterr().out
    assert 0.0 <= acc <= 1.0 and "epsilon" in out
    spent = float(out.split("epsilon ")[-1].split(" <=")[0])
    assert spent <= 8.0


def test_calibration_and_the_demo_epochs_are_logged_on_the_dpsgd_logger(caplog, monkeypatch):
    """Library code only emits records: the calibration's start and seconds, the demo's epochs and, in an epoch
    longer than PROGRESS_SECONDS (here 0), its batches."""
    import dpsgd.demo

    caplog.set_level(logging.INFO, logger="dpsgd")
    monkeypatch.setattr(dpsgd.demo, "PROGRESS_SECONDS", 0.0)
    dpsgd.demo.main(["--train", "64", "--batch-size", "32", "--epochs", "1", "--seq-len", "8", "--estimator",
                     "ghost"])
    messages = [r.getMessage() for r in caplog.records if r.name == "dpsgd"]
    assert messages[0].startswith("calibrating noise_multiplier for target_epsilon=8 at target_delta=1e-05 over 2 "
                                  "steps at sample rate 0.5 (estimator ghost")
    assert re.fullmatch(r"noise_multiplier [0-9.]+ calibrated in [0-9.]+ s", messages[1])
    assert any(re.fullmatch(r"epoch 1/1: batch 1/2, mean loss [0-9.]+ \([0-9]+ s\)", m) for m in messages)
    assert re.fullmatch(r"epoch 1/1: training loss [0-9.]+, test accuracy [0-9.]+, epsilon spent [0-9.]+ "
                        r"\([0-9]+ s\)", messages[-1])


def test_ledger_file_survives_a_crash(tmp_path):
    """Steps taken after the last checkpoint are still charged after a crash and a resume."""
    path = tmp_path / "ledger.jsonl"
    engine, model, opt, crit, loader = _setup(seed=5, ledger_path=path)
    _epoch(model, opt, crit, loader)                # 10 steps
    ckpt = engine.state_dict()
    _epoch(model, opt, crit, loader)                # 10 more, then the process "crashes"
    assert len(path.read_text().splitlines()) == 20
    engine2, model2, opt2, crit2, loader2 = _setup(seed=5, ledger_path=path)
    engine2.load_state_dict(ckpt)
    assert engine2.steps == 10 and engine2.spent_steps == 20
    _epoch(model2, opt2, crit2, loader2)            # redo 10 steps: 30 charged in all
    assert engine2.spent_steps == 30 and len(path.read_text().splitlines()) == 30
    with pytest.raises(ValueError, match="different privacy settings"):
        _setup(seed=5, ledger_path=path, noise_multiplier=2.0)


def _secure_run(**kw):
    torch.manual_seed(0)   # torch's global generator is not where secure mode draws from
    model = nn.Linear(5, 2)
    engine = PrivacyEngine(secure_mode=True)
    data = TensorDataset(torch.randn(40, 5), torch.randint(0, 2, (40,)))
    return engine, *engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=10), criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0,
        noise_multiplier=1.0, **{"estimator": "exact", **kw})


def test_secure_mode_refuses_a_seed():
    with pytest.raises(ValueError, match=r"seed=4 with secure_mode=True"):
        _secure_run(seed=4)


def test_secure_mode_draws_batches_projections_and_noise_from_the_os():
    """Two secure runs set up alike (torch's global seed included): different batches, projections and noise,
    and a state_dict without any of their generators."""
    batches, finals, probes = [], [], []
    for _ in range(2):
        engine, model, opt, crit, loader = _secure_run(estimator="hutch", projection_dim=4)
        batches.append([b for b in loader.logical_sampler])
        _epoch(model, opt, crit, loader)
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        probes.append(torch.randn(8, generator=engine.private_step._projection_rngs("cpu")))
        assert_holds_no_generator_state(engine.state_dict(), engine)
    assert batches[0] != batches[1]
    assert not torch.allclose(finals[0], finals[1])
    assert not torch.equal(probes[0], probes[1])


def test_hutchpp_on_matrices_of_rank_at_most_k_is_accounted_as_exact_dp_sgd():
    """Hutch++'s k-column sketch spans a per-example gradient of rank <= k, so the norm is exact: the plan counts
    no chi-square terms, the engine accounts DP-SGD (no envelope), and the norms equal brute force."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 8), nn.Tanh(), nn.Linear(8, 40), nn.Tanh(), nn.Linear(40, 2))
    plan = NormPlan.build(model, "hutchpp", k=8)
    assert all(t is None for t in plan.terms.values())
    assert NormPlan.build(model, "hutchpp", k=1).terms["0.weight"] == 8    # rank 8 > k = 1: estimated
    assert NormPlan.build(model, "hutchpp").terms["0.weight"] == 8         # no k given: counted as before
    x, y = torch.randn(6, 40, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    model = model.double()
    loss_fn = lambda m: ((m(x) - y) ** 2).sum(1)   # noqa: E731
    got = per_sample_sq_norms(model, loss_fn, "hutchpp", k=8, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(got, per_sample_sq_norms(model, loss_fn, "exact"), rtol=1e-12, atol=0)
    x, y = torch.randn(100, 40), torch.randint(0, 2, (100,))
    engine, small = PrivacyEngine(), nn.Sequential(nn.Linear(40, 8), nn.Tanh(), nn.Linear(8, 2))
    engine.make_private(module=small, optimizer=torch.optim.SGD(small.parameters(), lr=0.1),
                        data_loader=DataLoader(TensorDataset(x, y), batch_size=10), criterion=nn.CrossEntropyLoss(),
                        max_grad_norm=1.0, noise_multiplier=1.0, estimator="hutchpp", projection_dim=8, seed=0)
    assert engine.envelope is None


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_setting_under_an_unknown_name_is_refused_naming_the_settings(where):
    """``engine.check_rows_every_step = True`` (a former name) was accepted and did nothing: an attribute the engine
    does not have raises, naming the settings it does have; the real ones still work."""
    engine = PrivacyEngine()
    if where == "after":
        engine, model, opt, crit, loader = _setup(estimator="exact")
    with pytest.raises(AttributeError, match=r"check_rows_every_step.*check_every_step.*check_rate"):
        engine.check_rows_every_step = True
    assert not hasattr(engine, "check_rows_every_step")
    engine.check_every_step, engine.check_rate = True, 0.5
    assert engine.check_every_step and engine.check_rate == 0.5
    if where == "after":
        with pytest.raises(AttributeError, match=r"loss_reduction.*max_grad_norm"):
            opt.loss_reduction = "sum"   # an Opacus optimizer setting that would do nothing here
        opt.param_groups[0]["lr"] = 0.1   # the wrapped optimizer's state stays as torch's
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)   # schedulers patch the optimizer's step
        _epoch(model, opt, crit, loader)
        sched.step()
        assert engine.steps == 10

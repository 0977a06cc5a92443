"""The step's noise as a trainer option: LAP2 (paper 003, Laplace noise on the l2-clipped sum, accounted soundly), the
user's own noise, and banded matrix-factorization noise (correlated across steps, amplified by cyclic Poisson
sampling, never resumed)."""

import math

import numpy as np
import pytest
import torch

from dpmath import (
    Gaussian,
    PLDAccountant,
    SubsampledGaussian,
    SubsampledL2Laplace,
    calibrate_noise_multiplier,
    estimator_envelope,
)
from dpmath.correlated import BandedMatrixFactorization, BandedStrategy, BLTStrategy
from dpsgd import PrivacyEngine
from dpsgd import noise as noise_module
from dpsgd.noise import BandedNoise, BLTNoise, GaussianNoise, LaplaceNoise, StepNoise, as_noise, noisy_gradients
from dpsgd.samplers import CyclicPoisson
from dpsgd.strategies import TwiceSampling

from ..helpers import assert_holds_no_generator_state, one_step_change, private_classifier


def test_laplace_noise_has_the_stated_scale():
    # 400,000 coordinates of Laplace(b): E|X| = b and E X^2 = 2 b^2; 5 standard errors (fixed seed)
    b, n = 0.7, 400_000
    gen = torch.Generator().manual_seed(0)
    (x,) = noisy_gradients([torch.zeros(n, dtype=torch.float64)], b, 1.0, gen, noise=LaplaceNoise())
    se_abs = b / math.sqrt(n)                      # sd of |X| is b
    se_sq = math.sqrt(20 * b ** 4 / n)            # var X^2 = E X^4 - (E X^2)^2 = 24 b^4 - 4 b^4
    assert abs(float(x.abs().mean()) - b) < 5 * se_abs
    assert abs(float((x ** 2).mean()) - 2 * b * b) < 5 * se_sq
    assert abs(float(x.mean())) < 5 * math.sqrt(2) * b / math.sqrt(n)
    # heavier tails than a Gaussian of the same variance: P(|X| > 4 b) = e^-4
    assert abs(float((x.abs() > 4 * b).double().mean()) - math.exp(-4)) < 5 * math.sqrt(math.exp(-4) / n)


def _setup(**kw):
    return private_classifier(**{"noise": "laplace", **kw})


def test_laplace_training_is_accounted_as_subsampled_l2_laplace_and_meets_its_target():
    engine, m, opt, crit, loader = _setup(target_epsilon=4.0, target_delta=1e-5, epochs=2)
    sigma = calibrate_noise_multiplier(4.0, 1e-5, 0.1, 20)
    assert engine.noise_multiplier == pytest.approx(sigma * math.sqrt(math.pi / 2), rel=1e-12)
    for x, y in loader:                                        # one epoch: 10 steps
        opt.zero_grad()
        crit(m(x), y).backward()
        opt.step()
    ((mech, steps),) = engine.accountant().events
    assert isinstance(mech, SubsampledL2Laplace) and steps == 10 and mech.scale == engine.noise_multiplier
    eps = engine.get_epsilon(1e-5)
    fresh = PLDAccountant().compose(SubsampledL2Laplace(mech.scale, 0.1), 10)
    # within a fresh accountant's bracket (tests/dpmath/test_schedule.py: the tolerance)
    assert fresh.epsilon_bracket(1e-5)[0] <= eps <= min(4.0, fresh.epsilon(1e-5 * (1 - 2e-3)))
    # the noise and the accounted mechanism cannot be switched apart after make_private
    with pytest.raises(AttributeError):
        engine.noise = GaussianNoise()
    assert engine.noise == LaplaceNoise()


def test_laplace_step_adds_noise_of_scale_b_over_the_batch():
    # zero learning signal: the update is the noise alone, (lr / B) Laplace(b = noise_multiplier C) per coordinate
    engine, m, opt, crit, loader = _setup(noise_multiplier=2e6, max_grad_norm=1e-6)   # b = 2, signal <= 1e-6
    step = one_step_change(m, opt, crit, loader)
    noise = step / (-0.1) * engine.expected_batch_size        # back to the noise on the summed gradient
    assert 1.0 < float(noise.abs().mean()) < 3.0              # E|X| = b = 2 (48 coordinates)


@pytest.mark.parametrize(("kw", "match"), [
    (dict(estimator="hutch", noise_multiplier=1.0), "needs exact norms"),
    (dict(estimator="hutchpp", noise=LaplaceNoise(), noise_multiplier=1.0), "needs exact norms"),
    (dict(noise="uniform", noise_multiplier=1.0), "noise must be"),
    (dict(noise=torch.distributions.Laplace(0.0, 1.0), noise_multiplier=1.0), "noise must be"),
    (dict(noise=type("Unnamed", (GaussianNoise,), {"name": ""})(), noise_multiplier=1.0), "must set a class attr"),
])
def test_unsupported_noise_combinations_are_refused_with_the_reason(kw, match):
    with pytest.raises(ValueError, match=match):
        _setup(**kw)


def test_gaussian_noise_has_the_stated_scale():
    # 400,000 coordinates of N(0, s^2): mean square s^2 within 5 standard errors (sd of X^2 is sqrt(2) s^2)
    s, n = 0.7, 400_000
    (x,) = noisy_gradients([torch.zeros(n, dtype=torch.float64)], s, 1.0, torch.Generator().manual_seed(1))
    assert abs(float((x ** 2).mean()) - s * s) < 5 * math.sqrt(2) * s * s / math.sqrt(n)
    assert abs(float((x.abs() > 4 * s).double().mean()) - math.erfc(4 / math.sqrt(2))) < 5 * math.sqrt(6.3e-5 / n)


def test_each_noise_object_pairs_its_draws_with_its_mechanism_and_refusals():
    env = estimator_envelope("hutch", 8, 100)
    assert as_noise("gaussian") == GaussianNoise() and as_noise("laplace") == LaplaceNoise()
    assert GaussianNoise().mechanism(1.5, 0.01) == SubsampledGaussian(1.5, 0.01)
    assert GaussianNoise().mechanism(1.5, 0.01, env) == SubsampledGaussian(1.5, 0.01, env)
    assert LaplaceNoise().mechanism(1.5, 0.01) == SubsampledL2Laplace(1.5, 0.01)
    with pytest.raises(ValueError, match="estimated norms"):
        LaplaceNoise().mechanism(1.5, 0.01, env)
    assert GaussianNoise().refusal("hutch") is None   # covers every estimator
    # calibration: the Laplace scale is the one whose dominating Gaussian meets the target
    b = LaplaceNoise().calibrate(2.0, 1e-5, 0.05, 100)
    assert b == pytest.approx(math.sqrt(math.pi / 2) * GaussianNoise().calibrate(2.0, 1e-5, 0.05, 100), rel=1e-12)
    assert PLDAccountant().compose(SubsampledL2Laplace(b, 0.05), 100).epsilon(1e-5) <= 2.0


def test_make_private_takes_a_noise_object_like_its_name():
    by_name = _setup(noise_multiplier=1.3)[0]
    by_object = private_classifier(noise=LaplaceNoise(), noise_multiplier=1.3)[0]
    assert by_name.noise == by_object.noise == LaplaceNoise()
    assert by_name.state_dict()["settings"] == by_object.state_dict()["settings"]
    assert private_classifier(noise_multiplier=1.3)[0].noise == GaussianNoise()


def test_a_noise_of_the_users_own_is_drawn_and_accounted_as_it_says():
    class HalfGaussian(GaussianNoise):   # draws and claims N(0, (sigma C / 2)^2): accounted at sigma / 2
        name = "half-gaussian"

        def sample(self, shape, generator, device, dtype):
            return super().sample(shape, generator, device, dtype) / 2

        def mechanism(self, noise_multiplier, sample_rate, envelope=None):
            return super().mechanism(noise_multiplier / 2, sample_rate, envelope)

    assert isinstance(HalfGaussian(), StepNoise)
    engine, m, opt, crit, loader = private_classifier(noise=HalfGaussian(), noise_multiplier=2.0)
    for x, y in loader:
        opt.zero_grad()
        crit(m(x), y).backward()
        opt.step()
        break
    ((mech, steps),) = engine.accountant().events
    assert mech == SubsampledGaussian(1.0, engine.sample_rate) and steps == 1
    assert engine.state_dict()["settings"]["noise"] == "half-gaussian"   # a resumed run must use it too
    # twice sampling accounts its own Gaussian mechanism, so it refuses any other noise, subclasses included
    with pytest.raises(ValueError, match="Gaussian noise only"):
        private_classifier(noise=HalfGaussian(), noise_multiplier=2.0, clipping=TwiceSampling(0.5, 0.1))


def test_without_noise_lap2_takes_dp_sgds_clipped_step():
    laplace = one_step_change(*_setup(noise_multiplier=0.0)[1:])
    gaussian = one_step_change(*private_classifier(noise_multiplier=0.0)[1:])
    assert torch.equal(laplace, gaussian) and float(laplace.abs().max()) > 0


def test_the_noise_multiplier_cannot_be_changed_mid_run():
    # a schedule that raised sigma mid-run would have the accountant charge the steps already taken at a sigma
    # they did not have: refused, and the step and the accountant keep the value make_private set
    engine, m, opt, crit, loader = private_classifier(noise_multiplier=0.5)
    one_step_change(m, opt, crit, loader)
    with pytest.raises(AttributeError, match="fixed by make_private"):
        engine.noise_multiplier = 5.0
    assert engine.noise_multiplier == 0.5
    ((mech, steps),) = engine.accountant().events
    assert mech == SubsampledGaussian(0.5, engine.sample_rate) and steps == 1


def _banded_engine(model, data, strategy, groups=4, batch_size=10, **kw):
    noise = BandedNoise(strategy) if isinstance(strategy, BandedStrategy) else BLTNoise(strategy)
    engine = PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    options = dict(noise_multiplier=1.5) if "target_epsilon" not in kw else {}
    model, opt, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=torch.utils.data.DataLoader(data, batch_size=batch_size),
        max_grad_norm=1.0, noise=noise, batch_sampling=CyclicPoisson(groups), **options, **kw)
    return engine, model, opt, loader


def test_noisy_gradients_with_a_stream_add_the_strategys_inverse_of_the_draws_across_steps_and_chunks(monkeypatch):
    """Five steps of three tensors (one cut into chunks of 8): the noise added equals C^{-1} applied along the steps
    to the Gaussian draws of the same generator, tensor by tensor and chunk by chunk."""

    monkeypatch.setattr(noise_module, "NOISE_CHUNK", 8)
    strategy = BandedStrategy((1.0, 0.6, -0.3))
    shapes = [(3, 4), (20,), (5,)]
    noise, stream = BandedNoise(strategy), BandedNoise(strategy).stream()
    g_banded, g_plain = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    banded, plain = [], []
    for _ in range(5):
        zeros = [torch.zeros(s, dtype=torch.float64) for s in shapes]
        banded.append(noisy_gradients(zeros, 1.0, 1.0, g_banded, noise=noise, stream=stream))
        plain.append(noisy_gradients([z.clone() for z in zeros], 1.0, 1.0, g_plain))
    for i in range(len(shapes)):
        z = torch.stack([step[i].reshape(-1) for step in plain]).numpy()
        w = torch.stack([step[i].reshape(-1) for step in banded]).numpy()
        assert torch.allclose(torch.from_numpy(w), torch.from_numpy(strategy.correlate(z)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strategy", [BandedStrategy.sqrt_prefix_sum(4), BLTStrategy((0.4, 0.2), (0.8, 0.3))],
                         ids=["banded", "blt"])
def test_the_trainers_correlated_noise_has_the_strategys_covariance_across_steps(strategy):
    """Zero data: every update is the step's noise alone.  Six steps of 5,000 parameters: the unit noise's
    covariance of steps s and t across parameters is (C^{-1} C^{-T})_{st}, each entry within 5 standard errors (a false
    failure has probability below 1e-5 for the 21 entries; fixed seeds)."""

    torch.manual_seed(0)
    model = torch.nn.Linear(1000, 5, bias=False)
    data = torch.utils.data.TensorDataset(torch.zeros(200, 1000))
    engine, model, opt, loader = _banded_engine(model, data, strategy)
    updates, before = [], model.weight.detach().clone()
    batches = iter(loader)
    for _ in range(6):
        (x,) = next(batches)
        opt.zero_grad()
        engine.private_loss(model(x).sum(1)).backward()
        opt.step()
        updates.append((before - model.weight.detach()).reshape(-1).double())
        before = model.weight.detach().clone()
    w = torch.stack(updates) * 10 / 1.5   # expected batch 10, sigma C = 1.5: the unit noise w_t
    emp = (w @ w.T / w.shape[1]).numpy()
    inv = np.linalg.inv(strategy.matrix(6))
    cov = inv @ inv.T
    se = np.sqrt((np.outer(np.diag(cov), np.diag(cov)) + cov ** 2) / w.shape[1])
    assert np.all(np.abs(emp - cov) <= 5 * se), (emp, cov)


def test_a_banded_run_is_accounted_as_banded_matrix_factorization_and_cannot_be_resumed():

    torch.manual_seed(0)
    strategy = BandedStrategy.optimized(4, 40)
    x = torch.randn(200, 6)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    engine, model, opt, loader = _banded_engine(model, data, strategy, target_epsilon=3.0, target_delta=1e-5,
                                                steps=40)
    criterion = torch.nn.CrossEntropyLoss(reduction="none")
    steps = 0
    while steps < 40:
        for xb, yb in loader:
            opt.zero_grad()
            engine.private_loss(criterion(model(xb), yb)).backward()
            opt.step()
            steps += 1
            if steps == 40:
                break
    run = BandedMatrixFactorization(engine.noise_multiplier, strategy, 40, sample_rate=0.2)
    assert engine.get_epsilon(1e-5) == run.epsilon(1e-5) <= 3.0
    state = engine.state_dict()
    assert_holds_no_generator_state(state, engine)
    assert state["settings"]["noise"] == {"name": "banded", "coefficients": list(strategy.coefficients)}
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    again, *_ = _banded_engine(fresh, data, strategy, target_epsilon=3.0, target_delta=1e-5, steps=40)
    with pytest.raises(ValueError, match="cannot be resumed"):
        again.load_state_dict(state)


@pytest.mark.parametrize("sampling,match", [("poisson", "CyclicPoisson"), ("fixed_size", "CyclicPoisson"),
                                            (2, "at least as many groups as bands")])
def test_banded_noise_without_cyclic_poisson_of_enough_groups_is_refused(sampling, match):

    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(100, 4))
    scheme = CyclicPoisson(sampling) if isinstance(sampling, int) else sampling
    with pytest.raises(ValueError, match=match):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=torch.utils.data.DataLoader(data, batch_size=5), max_grad_norm=1.0,
                                     noise_multiplier=1.0, noise=BandedNoise(BandedStrategy.sqrt_prefix_sum(4)),
                                     batch_sampling=scheme)


def test_freezing_a_parameter_mid_run_is_refused_under_banded_noise():
    """Each parameter's noise continues its own last steps': a parameter frozen and later unfrozen would resume it
    after a gap, putting two participations a band apart within one band of its noise."""
    x = torch.randn(200, 6)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    engine, model, opt, loader = _banded_engine(model, torch.utils.data.TensorDataset(x), BandedStrategy((1.0, 0.5)))
    batches = iter(loader)
    (xb,) = next(batches)
    engine.private_loss(model(xb).sum(1)).backward()
    opt.step()
    model[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="correlates each parameter's noise"):
        opt.zero_grad()
        model(next(batches)[0])


def test_a_blt_run_is_charged_one_gaussian_step_per_cycle_at_its_sensitivity_and_refuses_estimates():
    """No amplification: each cycle a Gaussian step at sigma / sqrt(per), per the strategy's sensitivity per
    participation at separation ``groups``; composed, one Gaussian of sensitivity sqrt(k per)."""
    strategy = BLTStrategy((0.4,), (0.7,))
    x = torch.randn(200, 6)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    engine, model, opt, loader = _banded_engine(model, torch.utils.data.TensorDataset(x), strategy, groups=4,
                                                estimator="exact")
    batches = iter(loader)
    for _ in range(10):
        (xb,) = next(batches)
        opt.zero_grad()
        engine.private_loss(model(xb).sum(1)).backward()
        opt.step()
    per = strategy.sensitivity_per_participation(4)
    expected = PLDAccountant().compose(Gaussian(1.5 / math.sqrt(per)), 3).epsilon(1e-5)   # cycles 1-3 begun
    assert engine.get_epsilon(1e-5) == expected
    assert engine.get_epsilon(1e-5) == pytest.approx(PLDAccountant().compose(
        Gaussian(1.5 / math.sqrt(3 * per))).epsilon(1e-5), rel=1e-3)
    with pytest.raises(ValueError, match="BLTNoise needs exact norms"):
        _banded_engine(torch.nn.Linear(6, 2), torch.utils.data.TensorDataset(x), strategy, estimator="hutch")
    with pytest.raises(ValueError, match="cyclic Poisson sampling only"):
        PrivacyEngine().make_private(module=torch.nn.Linear(6, 2),
                                     optimizer=torch.optim.SGD(torch.nn.Linear(6, 2).parameters(), lr=0.1),
                                     data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x),
                                                                             batch_size=5),
                                     max_grad_norm=1.0, noise_multiplier=1.0, noise=BLTNoise(strategy))


def test_correlated_noise_refuses_batches_drawn_and_never_stepped_workers_and_a_mid_run_load():
    """Each noise step must follow its draw: a batch drawn and never stepped would put the noise stream a step behind
    the draws (two participations a band apart in the draws, closer in the noise); worker processes draw ahead;
    loading any state into a run that has drawn would restart its cycles mid-stream."""
    x = torch.randn(200, 6)
    data = torch.utils.data.TensorDataset(x)
    strategy = BandedStrategy.sqrt_prefix_sum(4)
    model = torch.nn.Linear(6, 2)
    engine, model, opt, loader = _banded_engine(model, data, strategy)
    state = engine.state_dict()
    batches = iter(loader)
    for _ in range(2):
        (xb,) = next(batches)
        opt.zero_grad()
        engine.private_loss(model(xb).sum(1)).backward()
        opt.step()
    opt.zero_grad()   # a noise-only step: the stream runs ahead of the draws, which is safe
    opt.step()
    with pytest.raises(ValueError, match="cannot be resumed"):
        engine.load_state_dict(state)   # a state of 0 steps, into a run that has stepped
    (xb,) = next(batches)
    opt.zero_grad()   # this batch is dropped: drawing the next one first is refused (a noise-only step is owed) ...
    with pytest.raises(RuntimeError, match="drawn from the private data loader before optimizer.step"):
        next(batches)
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="1 batch.* never stepped"):   # ... and the refused draw is never stepped
        opt.step()
    # a draw around the loader, never stepped
    engine, model, opt, loader = _banded_engine(torch.nn.Linear(6, 2), data, strategy)
    next(iter(loader.logical_sampler))
    (xb,) = next(iter(loader))
    engine.private_loss(model(xb).sum(1)).backward()
    with pytest.raises(RuntimeError, match="never stepped"):
        opt.step()
    with pytest.raises(ValueError, match="num_workers=2 is refused"):
        PrivacyEngine().make_private(
            module=torch.nn.Linear(6, 2), optimizer=torch.optim.SGD(torch.nn.Linear(6, 2).parameters(), lr=0.1),
            data_loader=torch.utils.data.DataLoader(data, batch_size=10, num_workers=2), max_grad_norm=1.0,
            noise_multiplier=1.0, noise=BandedNoise(strategy), batch_sampling=CyclicPoisson(4))

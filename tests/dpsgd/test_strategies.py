"""Twice sampling (paper 002, Alg. 2) in the trainer: masks, both clipping bounds, the update, the accounting."""

import dataclasses
import math

import pytest
import torch

from dpmath import PLDAccountant, RDPAccountant, SubsampledGaussian, SubsampledL2Laplace
from dpmath.twice_sampling import HybridTwiceSampledGaussian, TwiceSampledGaussian, hybrid_noise
from dpsgd.accounting import Combination, check_combination
from dpsgd.capture import Capture
from dpsgd.clipping import clipped_backward
from dpsgd.noise import GaussianNoise, LaplaceNoise
from dpsgd.plan import NormPlan
from dpsgd.samplers import Poisson
from dpsgd.strategies import HybridClipping, L2Clipping, TwiceSampling, masked_clipped_sum
from verify.workloads import VOCAB, gpt2, lm_losses

from ..helpers import one_step_change, private_classifier


def _sums(model, losses_of, twice, seed=0, estimator="exact"):
    capture = Capture(NormPlan.build(model, estimator))
    try:
        losses = losses_of(model)
        result = clipped_backward(capture, losses, 1.0, 1, None, twice=twice,
                                  mask_generator=torch.Generator().manual_seed(seed))
    finally:
        capture.remove()
    return {name: result.sums[id(p)] for name, p in model.named_parameters() if id(p) in result.sums}


@pytest.mark.parametrize("estimator", ["exact", "ghost"])
def test_rate_one_and_a_loose_coordinate_bound_give_the_plain_clipped_sums(estimator):
    # the per-example gradients are formed per parameter from every call that used it (GPT-2's tied embedding is
    # used by wte and lm_head): with q2 = 1 and c_inf above C, the sums are plain l2 clipping's
    torch.manual_seed(0)
    model = gpt2(tied=True)
    ids = torch.randint(0, VOCAB, (6, 8), generator=torch.Generator().manual_seed(1))
    plain = _sums(model, lambda m: lm_losses(m, ids), None, estimator=estimator)
    twice = _sums(model, lambda m: lm_losses(m, ids), TwiceSampling(1.0, 10.0), estimator=estimator)
    assert plain.keys() == twice.keys() and len(plain) == len([p for p in model.parameters() if p.requires_grad])
    for name in plain:
        torch.testing.assert_close(twice[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_each_example_coordinate_enters_with_probability_q2():
    q2, b, m = 0.3, 40, 25_000
    counts = masked_clipped_sum(torch.ones(b, m), torch.ones(b), 10.0, q2, torch.Generator().manual_seed(3))
    # counts ~ Binomial(b, q2) per coordinate: mean and variance within 5 standard errors (fixed seed)
    mean, var = float(counts.mean()), float(counts.var())
    assert abs(mean - b * q2) < 5 * math.sqrt(b * q2 * (1 - q2) / m)
    assert abs(var / (b * q2 * (1 - q2)) - 1) < 5 * math.sqrt(2 / m)
    assert set(counts.unique().tolist()) <= set(range(b + 1))


@pytest.mark.parametrize("seed", range(4))
def test_every_clipped_contribution_obeys_the_l2_and_the_coordinate_bound(seed):
    # one example per batch: its sum is its clipped contribution, whatever the masks kept
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(10, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4))
    x, y = 5 * torch.randn(1, 10, generator=gen), torch.randint(0, 4, (1,), generator=gen)
    twice = TwiceSampling(0.5, 0.05)
    sums = _sums(model, lambda m: torch.nn.functional.cross_entropy(m(x), y, reduction="none"), twice, seed)
    flat = torch.cat([s.reshape(-1) for s in sums.values()])
    assert float(flat.norm()) <= 1.0 and float(flat.abs().max()) <= 0.05
    assert 0 < int((flat != 0).sum()) < flat.numel()       # the masks dropped some coordinates, kept others


def _setup(**kw):
    return private_classifier(**{"clipping": TwiceSampling(0.5, 0.2), **kw})


def test_without_noise_and_at_rate_one_the_step_is_the_doubly_clipped_gradient_step():
    engine, m, opt, crit, loader = _setup(noise_multiplier=0.0, clipping=TwiceSampling(1.0, 0.2))
    params = list(m.parameters())
    before = [p.detach().clone() for p in params]
    x, y = next(iter(loader))
    opt.zero_grad()
    crit(m(x), y).backward()
    opt.step()
    total = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):   # brute force: each example's gradient, l2-clipped to C, then clamped to c_inf
        reference = [b.clone().requires_grad_(True) for b in before]
        h = torch.tanh(x[i:i + 1] @ reference[0].T + reference[1])
        loss = torch.nn.functional.cross_entropy(h @ reference[2].T + reference[3], y[i:i + 1])
        grads = torch.autograd.grad(loss, reference)
        scale = min(1.0, 1.0 / float(torch.cat([g.reshape(-1) for g in grads]).norm()))
        total = [t + (g * scale).clamp(-0.2, 0.2) for t, g in zip(total, grads, strict=True)]
    for p, b, t in zip(params, before, total, strict=True):
        torch.testing.assert_close(p.detach(), b - 0.1 * t / engine.expected_batch_size, rtol=1e-4, atol=1e-6)


def test_the_step_divides_by_q2_times_the_expected_batch_size():
    # zero learning signal (C tiny): the update is the noise alone, lr sigma C / (q2 B) per coordinate
    engine, m, opt, crit, loader = _setup(noise_multiplier=1e6, max_grad_norm=1e-6, clipping=TwiceSampling(0.25, 1.0))
    step = one_step_change(m, opt, crit, loader)
    expected = 0.1 * 1.0 / (0.25 * engine.expected_batch_size)
    assert abs(float(step.std()) / expected - 1) < 0.3        # 48 coordinates: the sample sd is within 30 %


def test_twice_sampling_is_accounted_by_its_rdp_bound_and_meets_a_target():
    engine, m, opt, crit, loader = _setup(target_epsilon=3.0, target_delta=1e-5, epochs=2)
    for x, y in loader:                                        # one epoch: 10 steps
        opt.zero_grad()
        crit(m(x), y).backward()
        opt.step()
    acc = engine.accountant()
    assert isinstance(acc, RDPAccountant)
    ((mech, steps),) = acc.events
    assert mech == TwiceSampledGaussian(engine.noise_multiplier, 0.1, 0.5, 1.0, 0.2) and steps == 10
    assert engine.get_epsilon(1e-5) == RDPAccountant().compose(mech, 10).epsilon(1e-5) < 3.0
    # the target holds over the two epochs it was calibrated for, and only just
    full = RDPAccountant().compose(mech, 20).epsilon(1e-5)
    assert 3.0 * 0.99 < full <= 3.0
    with pytest.raises(AttributeError):
        engine.clipping = None


@pytest.mark.parametrize(("kw", "match"), [
    (dict(estimator="hutch"), "needs exact norms"),
    (dict(noise="laplace"), "Gaussian noise only"),
    (dict(clipping_pass="two-pass"), "bookkeeping"),
    (dict(gradient_projection=torch.eye(48)[:, :4]), "gradient_projection"),
    (dict(clipping="twice"), "TwiceSampling"),
])
def test_unsupported_twice_sampling_combinations_are_refused_with_the_reason(kw, match):
    with pytest.raises(ValueError, match=match):
        _setup(noise_multiplier=1.0, **kw)


@pytest.mark.parametrize(("args", "match"), [
    ((0.0, 0.1), "coordinate_rate"), ((1.5, 0.1), "coordinate_rate"), ((True, 0.1), "coordinate_rate"),
    ((0.5, 0.0), "max_grad_coordinate"), ((0.5, math.inf), "max_grad_coordinate"), ((0.5, "1"), "max_grad_coordinate"),
])
def test_bad_twice_sampling_parameters_name_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        TwiceSampling(*args)


# hybrid clipping (paper 002, Thm 5.6): groups "0." (the first layer, 35 coordinates) and the rest (18)
HYBRID = {"0.": (0.6, 0.1), "": (0.8, 0.05)}


def test_hybrid_clipping_bounds_each_groups_part_of_every_contribution():
    gen = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    hybrid = HybridClipping(HYBRID, coordinate_rate=1.0)
    for _ in range(4):   # one example per batch: its sum is its clipped contribution
        x, y = 5 * torch.randn(1, 6, generator=gen), torch.randint(0, 3, (1,), generator=gen)
        sums = _sums(model, lambda m, x=x, y=y: torch.nn.functional.cross_entropy(m(x), y, reduction="none"), hybrid)
        for prefix, (c2, c_inf) in (("0.", (0.6, 0.1)), ("2.", (0.8, 0.05))):
            part = torch.cat([v.reshape(-1) for k, v in sums.items() if k.startswith(prefix)])
            assert float(part.norm()) <= c2 and float(part.abs().max()) <= c_inf


def test_hybrid_clipping_with_one_group_is_twice_sampling():
    one = _setup(noise_multiplier=1.0, clipping=HybridClipping({"": (1.0, 0.2)}, coordinate_rate=0.5))
    two = _setup(noise_multiplier=1.0, clipping=TwiceSampling(0.5, 0.2))
    torch.testing.assert_close(one_step_change(*one[1:]), one_step_change(*two[1:]), rtol=0, atol=0)
    assert one[0].get_epsilon(1e-5) == pytest.approx(two[0].get_epsilon(1e-5), rel=1e-12)


def test_hybrid_clipping_adds_each_groups_noise_and_is_accounted_by_thm_5_6():
    c = math.hypot(0.6, 0.8)
    engine, m, opt, crit, loader = _setup(noise_multiplier=1.0, max_grad_norm=c, clipping=HybridClipping(HYBRID))
    shape = hybrid_noise([0.6, 0.8], [35, 18])
    sigmas = 1.0 * c * math.sqrt(53) * shape
    assert float((shape ** 2 * [35, 18]).sum()) == pytest.approx(1.0)
    assert engine.accountant().events == ()   # no step yet
    step = one_step_change(m, opt, crit, loader)
    ((mech, steps),) = engine.accountant().events
    assert mech == HybridTwiceSampledGaussian(tuple(sigmas), 0.1, 1.0, (0.6, 0.8), (0.1, 0.05)) and steps == 1
    # the signal is at most B * c2_j / B per group; the noise is lr sigma_j / B with sigma_j = 8.4 and 11.5
    for part, sigma in ((step[:35], sigmas[0]), (step[35:], sigmas[1])):
        assert abs(float(part.std()) / (0.1 * sigma / engine.expected_batch_size) - 1) < 0.35


@pytest.mark.parametrize(("kw", "match"), [
    (dict(clipping=HybridClipping(HYBRID)), "overall bound"),
    (dict(max_grad_norm=1.0, clipping=HybridClipping({"0.": (0.6, 0.1), "2.": (0.8, 0.05), "9.": (0.1, 0.1)})),
     "hold no trainable"),
    (dict(max_grad_norm=0.6, clipping=HybridClipping({"0.": (0.6, 0.1)})), "matches no prefix"),
])
def test_hybrid_clipping_refuses_groups_that_do_not_cover_the_model(kw, match):
    with pytest.raises(ValueError, match=match):
        _setup(noise_multiplier=1.0, **{"max_grad_norm": 1.5, **kw})


@pytest.mark.parametrize(("groups", "match"), [
    ({}, "non-empty"), ({"": (0.0, 0.1)}, "c2"), ({"": (1.0, math.nan)}, "c_inf"), ({"": 1.0}, "pair"),
    ({1: (1.0, 0.1)}, "prefixes"),
])
def test_bad_hybrid_groups_name_the_argument(groups, match):
    with pytest.raises(ValueError, match=match):
        HybridClipping(groups)


def test_micro_batches_take_the_same_doubly_clipped_step():
    # BatchMemoryManager splits each Poisson batch into physical batches of 3: each example is still clipped once
    # per group in l2 and l-infinity, and the one noisy step per logical batch is the unsplit one (q2 = 1, no noise)
    from dpsgd import BatchMemoryManager

    def epoch(m, opt, crit, batches):
        for x, y in batches:
            opt.zero_grad()
            crit(m(x), y).backward()
            opt.step()

    changes = []
    for physical in (None, 3):
        engine, m, opt, crit, loader = _setup(noise_multiplier=0.0, clipping=HybridClipping(HYBRID, 1.0),
                                              max_grad_norm=1.0)
        before = torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()])
        if physical is None:
            epoch(m, opt, crit, loader)
        else:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=opt) as mem:
                epoch(m, opt, crit, mem)
        assert engine.steps == len(loader)
        changes.append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]) - before)
    torch.testing.assert_close(changes[0], changes[1], rtol=1e-5, atol=1e-7)


def test_poisson_sampling_is_the_default_part_and_hands_the_mechanism_to_the_noise():
    default = _setup(noise_multiplier=1.0, clipping=None)[0]
    explicit = _setup(noise_multiplier=1.0, clipping=L2Clipping())[0]
    assert default.clipping == explicit.clipping == L2Clipping()
    assert default.state_dict()["settings"] == explicit.state_dict()["settings"]   # ledgers stay compatible
    assert "sampling" not in default.state_dict()["settings"]
    assert default.accounting.mechanism(1.0) == SubsampledGaussian(1.0, default.sample_rate)
    laplace = dataclasses.replace(default.accounting, noise=LaplaceNoise())
    assert laplace.mechanism(1.0) == SubsampledL2Laplace(1.0, default.sample_rate)
    assert isinstance(default.accounting.accountant(), PLDAccountant)
    # twice sampling's mechanism is Gaussian with exact norms: the table refuses another noise or an estimate
    with pytest.raises(ValueError, match="Gaussian noise only"):
        check_combination(Combination("exact", LaplaceNoise(), TwiceSampling(0.5, 0.1), Poisson()))
    with pytest.raises(ValueError, match="needs exact norms"):
        check_combination(Combination("hutch", GaussianNoise(), TwiceSampling(0.5, 0.1), Poisson()))


def test_freezing_a_parameter_under_twice_sampling_is_refused_it_would_change_the_accounted_groups():
    """Twice sampling's noise and accounting depend on the coordinates per group, fixed at make_private: a plan
    with fewer trainable coordinates is refused where the engine follows the change (here zero_grad), naming both
    counts, and nothing is re-planned."""
    engine, model, opt, crit, loader = private_classifier(clipping=TwiceSampling(0.5, 0.2), noise_multiplier=1.0)
    one_step_change(model, opt, crit, loader)
    model[0].bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"coordinates per group \(\[53\] to \[48\]\)"):
        opt.zero_grad()
    assert len(engine.plan.params) == 4

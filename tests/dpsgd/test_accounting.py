"""One home for what a run is accounted as (dpsgd.accounting): the refusal table, ``auto``'s fallback, the
versioned ledger record, and a new batch-sampling scheme that needs nothing but its sampler and mechanism."""

import dataclasses
import json
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpmath import PLDAccountant, SubsampledGaussian
from dpmath.correlated import BandedStrategy, BLTStrategy
from dpsgd import PrivacyEngine
from dpsgd.accounting import (
    LEDGER_FORMAT,
    REFUSED,
    Combination,
    RunAccounting,
    auto_estimator,
    check_combination,
    read_record,
)
from dpsgd.data import PoissonBatchSampler
from dpsgd.noise import BandedNoise, BLTNoise, GaussianNoise, LaplaceNoise
from dpsgd.samplers import (
    BatchSampling,
    BoundSampling,
    CyclicPoisson,
    FixedSize,
    Poisson,
    Shuffling,
    TruncatedPoisson,
)
from dpsgd.strategies import HybridClipping, L2Clipping, TwiceSampling

TWICE = TwiceSampling(0.5, 0.1)

# one combination per entry of REFUSED, in its order, each refused by that entry and by no earlier one
BANDED = BandedNoise(BandedStrategy.sqrt_prefix_sum(4))
REFUSED_CASES = [
    (Combination("hutch", GaussianNoise(), TWICE, Poisson()), "needs exact norms"),
    (Combination("exact", LaplaceNoise(), TWICE, Poisson()), "Gaussian noise only"),
    (Combination("exact", GaussianNoise(), TWICE, Poisson(), clipping_pass="two-pass"), "clipping_pass='bookkeeping'"),
    (Combination("exact", GaussianNoise(), TWICE, Poisson(), projected=True), "gradient_projection"),
    (Combination("exact", GaussianNoise(), HybridClipping({"": (1.0, 0.1)}), Poisson(), processes=2),
     "single process"),
    (Combination("hutch", LaplaceNoise(), L2Clipping(), Poisson()), "LaplaceNoise needs exact norms"),
    (Combination("exact", GaussianNoise(), TWICE, Poisson(), users=True), "privacy_unit='user' cannot"),
    (Combination("hutch", BANDED, L2Clipping(), CyclicPoisson(2)), "at least as many groups as bands"),
    (Combination("hutch", BANDED, L2Clipping(), CyclicPoisson(4), workers=2), "num_workers=2 is refused"),
    (Combination("exact", BLTNoise(BLTStrategy((0.5,), (0.5,))), L2Clipping(), Poisson()),
     "cyclic Poisson sampling only"),
    (Combination("exact", GaussianNoise(), TWICE, FixedSize()), "twice sampling is accounted for Poisson"),
    (Combination("hutch", GaussianNoise(), L2Clipping(), FixedSize(), users=True), "users are Poisson-sampled"),
    (Combination("hutch", GaussianNoise(), L2Clipping(), TruncatedPoisson(8, pad=True), processes=2),
     "padded global batch"),
    (Combination("hutch", GaussianNoise(), L2Clipping(), Shuffling(), ledger=True), "ledger_path"),
    (Combination("exact", LaplaceNoise(), L2Clipping(), FixedSize()), "Gaussian noise only"),
]


def test_every_entry_of_the_refusal_table_is_reached_in_its_order():
    assert len(REFUSED_CASES) == len(REFUSED)
    for i, (combination, match) in enumerate(REFUSED_CASES):
        applies = [j for j, r in enumerate(REFUSED) if r.applies(combination)]
        assert applies and applies[0] == i, (i, applies)
        with pytest.raises(ValueError, match=match):
            check_combination(combination)


def test_banded_noise_passes_under_cyclic_poisson_of_enough_groups_only():
    for scheme in (CyclicPoisson(4), CyclicPoisson(6)):
        check_combination(Combination("hutch", BANDED, L2Clipping(), scheme))
        check_combination(Combination("hutch", GaussianNoise(), L2Clipping(), scheme))
    for scheme in (Poisson(), FixedSize(), CyclicPoisson(3)):
        with pytest.raises(ValueError, match="CyclicPoisson"):
            check_combination(Combination("hutch", BANDED, L2Clipping(), scheme))


@pytest.mark.parametrize("clipping", [L2Clipping(), TWICE])
@pytest.mark.parametrize("scheme", [Poisson(), FixedSize(), Shuffling()])
def test_what_the_table_does_not_refuse_passes(clipping, scheme):
    estimator = "exact" if clipping.per_coordinate else "hutch"
    combination = Combination(estimator, GaussianNoise(), clipping, scheme)
    if clipping.per_coordinate and type(scheme) is not Poisson:
        with pytest.raises(ValueError):
            check_combination(combination)
    else:
        check_combination(combination)


def test_auto_means_exact_norms_where_an_estimate_is_refused():
    assert auto_estimator(Combination("auto", GaussianNoise(), L2Clipping(), Poisson())) == "auto"
    assert auto_estimator(Combination("auto", LaplaceNoise(), L2Clipping(), Poisson())) == "ghost"
    assert auto_estimator(Combination("auto", GaussianNoise(), TWICE, Poisson())) == "ghost"


def _run(tmp_path=None, batch_sampling="poisson", seed=0):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(60, 4, generator=gen), torch.randint(0, 2, (60,), generator=gen))
    engine = PrivacyEngine(ledger_path=None if tmp_path is None else tmp_path / "ledger.jsonl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the seed's warning
        model, opt, crit, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=6), max_grad_norm=1.0, noise_multiplier=1.2, estimator="exact",
            batch_sampling=batch_sampling, seed=seed, criterion=nn.CrossEntropyLoss())
    return engine, model, opt, crit, loader


def _train(engine, model, opt, crit, loader, steps):
    for x, y in loader:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        if engine.steps == steps:
            return


def test_the_record_is_format_1s_settings_with_the_format_and_without_the_poisson_flag():
    engine = _run()[0]
    record = engine.state_dict()["settings"]
    assert record.pop("format") == LEDGER_FORMAT == 2
    assert record == {"estimator": "exact", "k": 32, "max_grad_norm": 1.0, "noise_multiplier": 1.2,
                      "sample_rate": 0.1}
    assert engine.accounting.record(1.2) == engine.state_dict()["settings"]


def test_a_ledger_written_in_format_1_is_read_and_its_steps_counted(tmp_path):
    engine, *rest = _run(tmp_path)
    _train(engine, *rest, steps=3)
    path = tmp_path / "ledger.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for rec in lines:
        del rec["settings"]["format"]   # as format 1 wrote them
        rec["settings"]["poisson"] = True
    path.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    again = _run(tmp_path)[0]
    assert again.spent_steps == 3


def test_a_checkpoint_of_format_1_resumes_and_a_later_format_is_refused_by_name():
    engine = _run()[0]
    state = engine.state_dict()
    del state["settings"]["format"]
    state["settings"]["poisson"] = True   # format 1's flag of Poisson batches
    resumed = _run()[0]
    resumed.load_state_dict(state)
    assert resumed.steps == 0
    with pytest.raises(ValueError, match="shuffled batches that no accountant covered"):
        resumed.load_state_dict({**state, "settings": {**state["settings"], "poisson": False}})
    with pytest.raises(ValueError, match="ledger format 3, which this version of dpsgd does not read"):
        read_record({**state["settings"], "format": 3}, "this checkpoint")
    with pytest.raises(ValueError, match="ledger format 3"):
        _run()[0].load_state_dict({**state, "settings": {**state["settings"], "format": 3}})


class HalfRate(BatchSampling):
    """A scheme of the test's own: Poisson at half the loader's rate, ``q = B / (2 N)``."""

    name = "half_rate"

    def bind(self, num_samples, batch_size):
        q = batch_size / (2 * num_samples)
        return BoundSampling(self, num_samples, batch_size, q, max(1, round(1 / q)))

    def make_sampler(self, bound, generator):
        return PoissonBatchSampler(bound.num_samples, bound.sample_rate, generator=generator)

    def make_mechanism(self, bound, noise_multiplier, noise, envelope):
        return noise.mechanism(noise_multiplier, bound.sample_rate, envelope)


def test_a_new_batch_sampling_scheme_needs_only_its_sampler_and_mechanism():
    """Defined here, outside the library: the engine binds it, draws with its sampler, records it in the ledger,
    and charges its mechanism, with nothing else to register."""
    engine, model, opt, crit, loader = _run(batch_sampling=HalfRate())
    _train(engine, model, opt, crit, loader, steps=4)
    assert engine.sample_rate == 0.05 and engine.batch_sampling == engine.accounting.sampling.scheme
    assert engine.accounting.mechanism(1.2) == SubsampledGaussian(1.2, 0.05)
    assert engine.state_dict()["settings"]["batch_sampling"] == {"name": "half_rate"}
    expected = PLDAccountant().compose(SubsampledGaussian(1.2, 0.05), 4).epsilon(1e-5)
    assert engine.get_epsilon(1e-5) == expected


def test_the_run_accounting_is_immutable_and_its_exact_twin_drops_only_the_envelope():
    run = RunAccounting(sampling=Poisson().bind(1000, 10), noise=GaussianNoise(), clipping=L2Clipping(),
                        max_grad_norm=1.0, envelope=None, estimator="hutch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.max_grad_norm = 2.0
    assert run.exact() == run and run.poisson_batches and run.sample_rate == 0.01


def test_noisy_gradients_made_outside_the_optimizer_are_charged():
    """Whoever makes the noisy gradients (the public PrivateStep, bypassing DPOptimizer.step) has a charged step."""
    engine, model, opt, crit, loader = _run()
    x, y = next(iter(loader))
    crit(model(x), y).backward()
    step = engine.private_step
    assert step.begin_step()
    step.noisy_gradients()
    assert engine.steps == 1 and all(p.grad is not None for p in model.parameters())
    opt.original_optimizer.step()
    step.end_step()
    assert engine.get_epsilon(1e-5) > 0


def test_reloading_an_earlier_state_never_lowers_the_spent_steps():
    """A checkpoint older than steps this engine took (or a save and reload with a ledger of an earlier run)
    moves this run's count, never the spent one: epsilon keeps every step taken."""
    engine, *rest = _run()
    early = engine.state_dict()
    _train(engine, *rest, steps=6)
    engine.load_state_dict(early)
    assert engine.spent_steps == 6
    _train(engine, *rest, steps=2)
    assert engine.spent_steps == 8


def test_a_group_added_to_the_wrapped_optimizer_is_refused_at_the_step():
    engine, model, opt, crit, loader = _run()
    outside = nn.Parameter(torch.ones(()))
    opt.original_optimizer.add_param_group({"params": [outside]})
    x, y = next(iter(loader))
    crit(model(x), y).backward()
    with pytest.raises(ValueError, match="param_groups holds a trainable parameter that is not in the private"):
        opt.step()


def test_the_step_hands_none_of_the_engines_controls_to_its_users():
    """A batch registered by hand, a chosen seed, a drawn batch forgotten: none is a public method of the step, and
    closing a step is refused until its charged noisy gradients exist."""
    engine, model, opt, crit, loader = _run()
    step = engine.private_step
    for name in ("on_batch", "check_empty", "reseed", "reset", "set_checks", "generators"):
        assert not hasattr(step, name), name
    x, y = next(iter(loader))
    crit(model(x), y).backward()
    with pytest.raises(RuntimeError, match="end_step\\(\\) without noisy_gradients"):
        step.end_step()
    assert not hasattr(engine, "track_examples")


def test_a_batch_dropped_by_zero_grad_can_be_backpropagated_again():
    engine, model, opt, crit, loader = _run()
    x, y = next(iter(loader))
    crit(model(x), y).backward()
    opt.zero_grad()
    crit(model(x), y).backward()   # the same batch again, after the first backward was dropped
    opt.step()
    assert engine.steps == 1

"""Each row of docs/opacus.md: an Opacus habit, what happens here, and the one-line change."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpmath import PLDAccountant
from dpsgd import BatchMemoryManager, ModuleValidator, PrivacyEngine


def _data(n=60):
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=gen), torch.randint(0, 2, (n,), generator=gen))


def _private(engine=None, loader_kw=None, **kw):
    torch.manual_seed(0)
    engine = engine or PrivacyEngine()
    model = nn.Linear(4, 2)
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(_data(), batch_size=6, **(loader_kw or {})), max_grad_norm=1.0,
                noise_multiplier=1.0, seed=0, criterion=nn.CrossEntropyLoss())
    args.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the seed's warning
        return engine, *engine.make_private(**args)


def _one_step(engine, model, opt, crit, loader):
    x, y = next(iter(loader))
    opt.zero_grad()
    crit(model(x), y).backward()
    opt.step()


def test_make_private_returns_opacus_three_tuple_without_a_criterion_and_four_with_one():
    assert len(_private()) == 5   # the engine, then (model, optimizer, criterion, loader)
    engine, model, opt, loader = _private(criterion=None)
    x, y = next(iter(loader))
    opt.zero_grad()
    engine.private_loss(nn.functional.cross_entropy(model(x), y, reduction="none")).backward()
    opt.step()
    assert engine.steps == 1


def test_a_loss_of_your_own_with_a_plain_backward_is_refused_at_the_step():
    engine, model, opt, crit, loader = _private()
    x, y = next(iter(loader))
    nn.CrossEntropyLoss()(model(x), y).backward()
    with pytest.raises(RuntimeError, match="plain loss.backward"):
        opt.step()


def test_make_private_with_epsilon_calibrates_for_the_target():
    engine = PrivacyEngine()
    model, opt, crit, loader = _with_epsilon(engine)
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
    assert engine.steps == engine.planned_steps == 20 and engine.get_epsilon(1e-5) <= 3.0


def _with_epsilon(engine):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=6), criterion=nn.CrossEntropyLoss(), target_epsilon=3.0,
        target_delta=1e-5, epochs=2, max_grad_norm=1.0)


@pytest.mark.parametrize("mode, estimator", [("hooks", "exact"), ("functorch", "exact"), ("ew", "exact"),
                                             ("ghost", "ghost"), ("hutch", "hutch")])
def test_grad_sample_mode_is_mapped_onto_the_estimator(mode, estimator):
    engine = _private(grad_sample_mode=mode)[0]
    assert engine.estimator == estimator


def test_grad_sample_mode_and_estimator_together_or_unknown_are_refused_by_name():
    with pytest.raises(ValueError, match="give estimator or grad_sample_mode, not both"):
        _private(grad_sample_mode="ghost", estimator="hutch")
    with pytest.raises(ValueError, match="grad_sample_mode must be one of"):
        _private(grad_sample_mode="ghost_fsdp")


def test_poisson_sampling_false_is_a_type_error_and_fixed_size_is_accounted():
    with pytest.raises(TypeError, match="poisson_sampling"):
        _private(poisson_sampling=False)
    engine, model, opt, crit, loader = _private(batch_sampling="fixed_size")
    _one_step(engine, model, opt, crit, loader)
    assert engine.get_epsilon(1e-5) > 0


def test_a_shuffled_loader_is_accepted_as_poisson_batches_of_the_dataset():
    engine, model, opt, crit, loader = _private(loader_kw={"shuffle": True})
    assert engine.sample_rate == pytest.approx(0.1) and len({len(b) for b in loader.logical_sampler}) > 1


def test_scaling_the_loss_for_accumulation_is_refused():
    engine, model, opt, crit, loader = _private()
    x, y = next(iter(loader))
    with pytest.raises(TypeError, match="arithmetic on a private loss"):
        crit(model(x), y) / 4


def test_batch_memory_manager_takes_opacus_arguments():
    engine, model, opt, crit, loader = _private()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as batches:
        for x, y in batches:
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
    assert engine.steps == len(loader)


def test_a_noise_scheduler_setting_the_optimizers_noise_multiplier_is_refused():
    engine, model, opt, crit, loader = _private()
    with pytest.raises(AttributeError, match="noise_multiplier is fixed by make_private"):
        opt.noise_multiplier = 0.5


def test_the_accountant_is_a_method_returning_a_fresh_accountant():
    engine, model, opt, crit, loader = _private()
    _one_step(engine, model, opt, crit, loader)
    acc = engine.accountant()
    assert isinstance(acc, PLDAccountant) and acc.epsilon(1e-5) >= engine.get_epsilon(1e-5) * (1 - 1e-3)


def test_an_accountant_argument_and_save_checkpoint_are_not_there():
    with pytest.raises(TypeError):
        PrivacyEngine(accountant="rdp")
    engine = _private()[0]
    assert not hasattr(engine, "save_checkpoint") and engine.state_dict()["steps"] == 0


def test_module_validator_fix_replaces_batch_norm():
    model = ModuleValidator.fix(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))
    assert isinstance(model[1], nn.GroupNorm) and ModuleValidator.is_valid(model)


def test_secure_mode_refuses_a_seed():
    with pytest.raises(ValueError, match="secure_mode=True"):
        _private(PrivacyEngine(secure_mode=True))

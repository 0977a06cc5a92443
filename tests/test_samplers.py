"""What make_private does with the data loader's sampling: the samplers it keeps (by Poisson sampling of the same
dataset), the ones it refuses rather than drop, and poisson_sampling=False, which trains but has no epsilon."""

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from dpsgd import PrivacyEngine, UnaccountedSamplingError, UnsupportedSamplerError

N, B = 100, 10


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _private(loader: DataLoader, model: nn.Module | None = None, **kw):
    model = model if model is not None else nn.Linear(4, 2)
    engine = PrivacyEngine()
    args = dict(noise_multiplier=1.0, **kw) if "target_epsilon" not in kw else kw
    return engine, *engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0, estimator="exact", seed=0, **args)


def _epoch(model, opt, crit, loader) -> list[int]:
    sizes = []
    for x, y in loader:
        sizes.append(len(x))
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    return sizes


class _EveryOther(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self) -> int:
        return self.n // 2


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(_data())

    def __len__(self) -> int:
        return N


REFUSED = {
    "weighted": (lambda d: DataLoader(d, batch_size=B, sampler=WeightedRandomSampler(torch.ones(N), N)),
                 ["sampler (WeightedRandomSampler)", "weight their losses"]),
    "distributed": (lambda d: DataLoader(d, batch_size=B, sampler=DistributedSampler(d, num_replicas=2, rank=0)),
                    ["sampler (DistributedSampler)", "torch.distributed", "its own shard"]),
    "batch_sampler": (lambda d: DataLoader(d, batch_sampler=BatchSampler(SequentialSampler(d), B, False)),
                      ["batch_sampler (BatchSampler)", "chooses the batches itself"]),
    "drop_last": (lambda d: DataLoader(d, batch_size=B, shuffle=True, drop_last=True),
                  ["drop_last=True", "drop_last=False"]),
    "subset": (lambda d: DataLoader(d, batch_size=B, sampler=SubsetRandomSampler(range(50))),
               ["sampler (SubsetRandomSampler)", "torch.utils.data.Subset(dataset, indices)"]),
    "replacement": (lambda d: DataLoader(d, batch_size=B, sampler=RandomSampler(d, replacement=True)),
                    ["sampler (RandomSampler)", "replacement=True"]),
    "num_samples": (lambda d: DataLoader(d, batch_size=B, sampler=RandomSampler(d, num_samples=50)),
                    ["sampler (RandomSampler)", "num_samples=50 of the 100 examples"]),
    "other_source": (lambda d: DataLoader(d, batch_size=B, sampler=SequentialSampler(range(50))),
                     ["sampler (SequentialSampler)", "data_source other than the loader's dataset"]),
    "custom": (lambda d: DataLoader(d, batch_size=B, sampler=_EveryOther(N)),
               ["sampler (_EveryOther)", "not one the engine knows"]),
    "iterable": (lambda d: DataLoader(_Stream(), batch_size=B), ["IterableDataset (_Stream)", "map-style"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_loader_that_chooses_its_own_examples_is_refused_naming_its_choice_and_the_fix(case):
    build, phrases = REFUSED[case]
    model = nn.Linear(4, 2)
    with pytest.raises(UnsupportedSamplerError) as caught:
        _private(build(_data()), model)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    for phrase in [*phrases, "DataLoader(dataset, batch_size=B)", "Poisson"]:
        assert phrase in message, (phrase, message)
    # refused before the model was hooked: another engine takes it
    _private(DataLoader(_data(), batch_size=B), model)


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_default_and_shuffled_loaders_are_kept_as_poisson_batches_of_the_same_dataset(shuffle):
    data = _data()
    engine, model, opt, crit, loader = _private(DataLoader(data, batch_size=B, shuffle=shuffle))
    assert loader.dataset is data and engine.sample_rate == B / N and engine.poisson_sampling
    sizes = _epoch(model, opt, crit, loader)
    assert engine.steps == len(loader) == N // B
    assert len(set(sizes)) > 1   # Poisson: the batch size varies
    assert engine.get_epsilon(1e-5) > 0


def test_the_loader_make_private_returned_is_not_made_private_again():
    _, _, _, _, loader = _private(DataLoader(_data(), batch_size=B))
    with pytest.raises(UnsupportedSamplerError, match="already a private loader"):
        _private(loader)


def test_shuffled_fixed_size_batches_train_but_every_epsilon_is_refused():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, model, opt, crit, loader = _private(DataLoader(_data(), batch_size=B), poisson_sampling=False)
    shuffled = [w for w in caught if "poisson_sampling=False" in str(w.message)]
    assert len(shuffled) == 1 and shuffled[0].category is UserWarning
    assert "UnaccountedSamplingError" in str(shuffled[0].message)
    assert shuffled[0].filename == __file__   # it points at the make_private call
    assert engine.poisson_sampling is False
    with pytest.raises(AttributeError):
        engine.poisson_sampling = True
    with pytest.raises(UnaccountedSamplingError, match="poisson_sampling=True"):
        engine.get_epsilon(1e-5)   # even before the first step: the run is not one any accountant covers
    before = [p.detach().clone() for p in model.parameters()]
    sizes = _epoch(model, opt, crit, loader)
    assert sizes == [B] * (N // B) and engine.steps == N // B
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    for ask in (lambda: engine.get_epsilon(1e-5), lambda: engine.get_epsilon(1e-5, overcount=0.25),
                engine.accountant):
        with pytest.raises(UnaccountedSamplingError, match="no accountant here covers") as refused:
            ask()
        assert isinstance(refused.value, ValueError)


def test_shuffled_batches_with_a_target_epsilon_are_refused_before_anything_is_built():
    model = nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # refused before the warning of a run that trains
        with pytest.raises(UnaccountedSamplingError, match="target_epsilon with poisson_sampling=False"):
            _private(DataLoader(_data(), batch_size=B), model, poisson_sampling=False, target_epsilon=3.0,
                     target_delta=1e-5, epochs=1)
    _private(DataLoader(_data(), batch_size=B), model)   # the model was not hooked


def test_poisson_sampling_must_be_a_bool():
    with pytest.raises(ValueError, match="poisson_sampling must be True or False, got 'no'"):
        _private(DataLoader(_data(), batch_size=B), poisson_sampling="no")


def test_a_calibrated_poisson_run_still_reports_its_target():
    engine, model, opt, crit, loader = _private(DataLoader(_data(), batch_size=B, shuffle=True), target_epsilon=3.0,
                                                target_delta=1e-5, epochs=1)
    _epoch(model, opt, crit, loader)
    eps = engine.get_epsilon(1e-5)
    assert math.isfinite(eps) and eps <= 3.0

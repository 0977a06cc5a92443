"""What make_private does with the data loader's sampling: the samplers it keeps (by Poisson sampling of the same
dataset) and the ones it refuses rather than drop."""

import math

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

from dpsgd import PrivacyEngine, UnsupportedSamplerError

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
    assert loader.dataset is data and engine.sample_rate == B / N
    sizes = _epoch(model, opt, crit, loader)
    assert engine.steps == len(loader) == N // B
    assert len(set(sizes)) > 1   # Poisson: the batch size varies
    assert engine.get_epsilon(1e-5) > 0


def test_the_loader_make_private_returned_is_not_made_private_again():
    _, _, _, _, loader = _private(DataLoader(_data(), batch_size=B))
    with pytest.raises(UnsupportedSamplerError, match="already a private loader"):
        _private(loader)


def test_make_private_has_no_unaccounted_sampling():
    """Fixed-size batches are accounted schemes (batch_sampling="fixed_size" or "shuffling"); there is no switch for
    batches no accountant covers."""
    with pytest.raises(TypeError, match="poisson_sampling"):
        _private(DataLoader(_data(), batch_size=B), poisson_sampling=False)


def test_a_calibrated_poisson_run_still_reports_its_target():
    engine, model, opt, crit, loader = _private(DataLoader(_data(), batch_size=B, shuffle=True), target_epsilon=3.0,
                                                target_delta=1e-5, epochs=1)
    _epoch(model, opt, crit, loader)
    eps = engine.get_epsilon(1e-5)
    assert math.isfinite(eps) and eps <= 3.0

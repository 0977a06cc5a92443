r"""Batch sampling for DP-SGD: Poisson sampling (what the accountant assumes) and a fixed-size fallback.

With Poisson sampling each example joins each batch independently with probability ``q``; batch sizes
vary (an empty batch is possible and still takes a noisy step), and gradients are normalized by the
expected batch size ``q N``.  :func:`private_data_loader` rebuilds a ``DataLoader`` around
:class:`PoissonBatchSampler`; ``poisson=False`` keeps fixed-size shuffled batches and warns that the
accounting then does not match the sampling.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

__all__ = ["PoissonBatchSampler", "private_data_loader"]


class PoissonBatchSampler(Sampler[list[int]]):
    r"""Index batches in which each of ``num_samples`` examples appears independently with probability ``q``.

    Parameters
    ----------
    num_samples : int
        Dataset size ``N >= 1``.
    sample_rate : float
        ``q`` in ``(0, 1]``.
    steps : int, optional
        Batches per epoch (default ``round(1/q)``, one pass in expectation).
    generator : torch.Generator, optional
        Source of the sampling; its state is what a checkpoint saves.

    Examples
    --------
    >>> import torch
    >>> from dpsgd.data import PoissonBatchSampler
    >>> s = PoissonBatchSampler(1000, 0.01, generator=torch.Generator().manual_seed(0))
    >>> len(s), 5 < sum(len(b) for b in s) / len(s) < 15
    (100, True)
    """

    def __init__(self, num_samples: int, sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
        q = float(sample_rate)
        if not 0 < q <= 1:
            raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate!r}")
        self.num_samples, self.sample_rate = num_samples, q
        self.steps = max(1, round(1 / q)) if steps is None else int(steps)
        if self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        self.generator = generator

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield mask.nonzero().flatten().tolist()


def _empty_aware(collate, dataset):
    """A collate function that turns an empty batch into zero-length tensors shaped like one example."""
    def collate_fn(batch):
        if batch:
            return collate(batch)
        one = collate([dataset[0]])
        return torch.utils.data._utils.collate.default_convert(
            [x[:0] for x in one] if isinstance(one, (list, tuple)) else one[:0])
    return collate_fn


def private_data_loader(data_loader: DataLoader, *, poisson: bool = True,
                        generator: torch.Generator | None = None) -> DataLoader:
    r"""The same dataset and collate function, batched by Poisson sampling at ``q = batch_size / N``.

    Parameters
    ----------
    data_loader : torch.utils.data.DataLoader
        A loader with a fixed ``batch_size`` over a sized dataset.
    poisson : bool
        ``False`` keeps fixed-size shuffled batches and emits a ``UserWarning``: the accountant assumes
        Poisson sampling, so the reported epsilon is then not a proven bound for the sampling used.
    generator : torch.Generator, optional
        Source of the sampling.

    Returns
    -------
    torch.utils.data.DataLoader

    Examples
    --------
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from dpsgd.data import private_data_loader
    >>> dl = DataLoader(TensorDataset(torch.arange(100.0)), batch_size=10)
    >>> pl = private_data_loader(dl, generator=torch.Generator().manual_seed(1))
    >>> len(pl), pl.batch_sampler.sample_rate
    (10, 0.1)
    """
    if not isinstance(data_loader, DataLoader):
        raise ValueError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
    if data_loader.batch_size is None:
        raise ValueError("data_loader must have a fixed batch_size (its expected batch size under Poisson sampling)")
    n = len(data_loader.dataset)
    q = data_loader.batch_size / n
    if poisson:
        sampler = PoissonBatchSampler(n, min(q, 1.0), generator=generator)
    else:
        warnings.warn("fixed-size batches: the privacy accounting assumes Poisson sampling, so the reported epsilon "
                      "is not a proven bound for this sampling", UserWarning, stacklevel=2)
        shuffled = torch.utils.data.RandomSampler(data_loader.dataset, generator=generator)
        sampler = torch.utils.data.BatchSampler(shuffled, data_loader.batch_size, drop_last=False)
    return DataLoader(data_loader.dataset, batch_sampler=sampler,
                      collate_fn=_empty_aware(data_loader.collate_fn, data_loader.dataset),
                      num_workers=data_loader.num_workers, pin_memory=data_loader.pin_memory)


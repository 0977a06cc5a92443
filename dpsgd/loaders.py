r"""One builder of the private loader, for every batch sampling: Poisson batches of examples (the default), Poisson
batches of users (``privacy_unit="user"``), and the other :mod:`dpsgd.samplers` schemes, each bound to the data
set the same way (:class:`~dpsgd.samplers.BoundSampling`: the sampler the loader draws with and the mechanism
the accountant composes come from the same numbers).

Under torch.distributed, Poisson sampling draws each rank's shard at one global rate
``q = (batch sizes over ranks) / (examples over ranks)`` (independent draws per shard are a Poisson sample of the
union), while another scheme is bound to the global data set, the ranks' shards concatenated in rank order, and
every rank draws the same stream of global batches and keeps its shard's part (:class:`~dpsgd.samplers.ShardOf`).
Users are sampled in one process only.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Sampler

from .data import DPDataLoader, loader_size, private_data_loader
from .distributed import all_sum, check_same_on_ranks, rank_world
from .samplers import BatchSampling, BoundSampling, Poisson
from .users import UserLevel, user_data_loader

__all__ = ["PrivateLoader", "private_loader"]


@dataclass(frozen=True)
class PrivateLoader:
    """A private loader and what it was bound to.

    Attributes
    ----------
    loader : DPDataLoader
    sampling : BoundSampling
        The batch sampling bound to the data (its ``sample_rate`` is the ``q`` charged: of examples, or of users).
    expected_batch_size : float
        The step's divisor: ``q N`` examples, or ``q_u U`` users.
    stream : Sampler or None
        A non-Poisson scheme's sampler (an epoch sampler's position decides the epochs charged); ``None`` for
        Poisson batches.
    """

    loader: DPDataLoader
    sampling: BoundSampling
    expected_batch_size: float
    stream: Sampler | None = None


def private_loader(data_loader: DataLoader, scheme: BatchSampling, users: UserLevel | None,
                   generator: torch.Generator, *, stream_seed: int, on_batch: Callable,
                   on_empty: Callable) -> PrivateLoader:
    """The private loader of ``data_loader``'s dataset and ``collate_fn`` for ``scheme`` (or ``users``), drawing
    from ``generator`` (a scheme's global stream from ``stream_seed``, the same on every rank), with the engine's
    callbacks; the rates and sizes every rank must agree on are checked equal.

    Examples
    --------
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from dpsgd.loaders import private_loader
    >>> from dpsgd.samplers import FixedSize
    >>> built = private_loader(DataLoader(TensorDataset(torch.arange(100.0)), batch_size=10), FixedSize(), None,
    ...                        torch.Generator(), stream_seed=0, on_batch=None, on_empty=None)
    >>> built.sampling.sample_rate, built.expected_batch_size, len(built.loader)
    (0.1, 10.0, 10)
    """
    rank, world = rank_world()
    if users is not None:
        if world > 1:
            raise ValueError("privacy_unit='user' is supported in a single process only: under torch.distributed a "
                             "user's examples on different ranks would be clipped separately")
        loader = user_data_loader(data_loader, users, generator=generator, on_batch=on_batch, on_empty=on_empty)
        q = loader.sample_rate
        return PrivateLoader(loader, Poisson().at_rate(q, users.num_users), q * users.num_users)
    n, batch = loader_size(data_loader)
    if type(scheme) is Poisson:
        total = all_sum(float(n))
        q = all_sum(float(batch)) / total if world > 1 else None
        if q is not None and q > 1:
            raise ValueError(f"the batch sizes over all ranks add up to more than the {int(total)} examples over all "
                             f"ranks: the sampling rate must be at most 1")
        loader = private_data_loader(data_loader, generator=generator, on_batch=on_batch, on_empty=on_empty,
                                     sample_rate=q)
        check_same_on_ranks(loader.sample_rate, "the sampling rate")
        check_same_on_ranks(len(loader), "the number of batches per epoch")
        return PrivateLoader(loader, Poisson().at_rate(loader.sample_rate, round(total)), loader.sample_rate * total)
    # every rank's shard size, in rank order (one all-reduce per rank, once per run)
    sizes = [n] if world == 1 else [round(all_sum(float(n) if r == rank else 0.0)) for r in range(world)]
    total, offset = sum(sizes), sum(sizes[:rank])
    batch = round(all_sum(float(batch)))
    over = " over ranks" if world > 1 else ""
    if batch > total:
        raise ValueError(f"data_loader's batch_size ({batch}{over}) exceeds the dataset size ({total}{over})")
    # before bind, which may refuse the scheme: a refusal on some ranks only would leave the others waiting
    check_same_on_ranks(zlib.crc32(json.dumps(scheme.settings(), sort_keys=True).encode()),
                        f"the batch sampling ({scheme!r} on this rank)")
    bound = scheme.bind(total, batch)
    # rank 0's sampling seed on every rank, derived from the seed all ranks share: one stream of global batches, the
    # same as a single-process run with this seed draws (a rank-local seed would give each rank other batches than
    # the one charged)
    generator.manual_seed(stream_seed)
    sampler = bound.sampler(generator, offset=offset, size=n if world > 1 else None)
    loader = DPDataLoader(data_loader.dataset, sampler, data_loader.collate_fn, sample_rate=bound.sample_rate,
                          on_batch=on_batch, on_empty=on_empty, num_workers=data_loader.num_workers,
                          pin_memory=data_loader.pin_memory)
    check_same_on_ranks(total, "the number of examples over ranks")
    check_same_on_ranks(batch, "the batch size over ranks")
    check_same_on_ranks(bound.sample_rate, "the sampling rate")
    check_same_on_ranks(len(loader), "the number of batches per epoch")
    return PrivateLoader(loader, bound, bound.expected_batch_size, sampler)

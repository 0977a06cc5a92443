r"""How examples are chosen for each step, and the dpmath mechanism that accounts each choice.

``make_private(batch_sampling=...)`` takes one of these; each *is* its accounting, so the sampler that draws the
batches and the mechanism the accountant composes come from one object and cannot disagree:

* :class:`Poisson` (default): each example independently at ``q = B / N``; accounted as
  ``SubsampledGaussian`` (with the estimator's envelope where norms are estimated).
* :class:`TruncatedPoisson`: Poisson with at most ``max_batch_size`` examples a step (static memory; an
  overflowing draw keeps a random ``max_batch_size`` of it); ``TruncatedSubsampledGaussian``, the overflow's
  probability charged to delta.
* :class:`FixedSize`: exactly ``B`` examples without replacement, afresh each step (static shapes);
  ``FixedSizeSubsampledGaussian``, for **replacing** one example.
* :class:`BallsInBins`: each epoch, every example in one uniformly random of its ``T = round(N / B)`` steps (or
  in ``k`` distinct ones of ``round(k N / B)``); ``RandomAllocationGaussian``, the epoch's own PLD with exact
  norms (about Poisson's epsilon at ``k/T``), ``k`` Gaussian steps per epoch with randomized clipping.
* :class:`Shuffling`: each epoch, a permutation cut into batches of ``B``; ``ShuffledGaussian``, one Gaussian
  step per epoch for **replacing** one example (``sigma / 2``).
* :class:`CyclicPoisson`: the examples split into ``b`` groups; step ``t`` Poisson-samples group ``t mod b``;
  one subsampled-Gaussian step per cycle of ``b`` steps (the sampling of banded matrix-factorization noise).

``B`` is the loader's ``batch_size`` and ``N`` its dataset's size.  Fixed-size batches and shuffling keep ``N``
fixed, so their epsilon is for **replacing** one example (``neighboring="replace_one"``), which costs more than
adding or removing one.  Every scheme covers randomized clipping (``hutch``, ``hutchpp``): a replaced example
moves the sum by two examples' random scales together (:class:`dpmath.ReplacementEnvelope`, a union bound that
costs about three times the exact-norm epsilon of fixed-size batches).

Balls in bins and shuffling are accounted per **epoch**: the samplers below keep their epoch across loops over
the loader (a loop stopped early resumes the same epoch's remaining batches), and the engine charges
``ceil(batches drawn / T)`` epochs, every batch drawn counted whether or not it was stepped on, so no example can
be in two charged steps of one charged epoch.

Under torch.distributed a scheme is bound to the global data set (the ranks' shards concatenated in rank order,
``N`` and ``B`` summed over ranks): every rank draws the same stream of global batches from a generator seeded
alike, and keeps its shard's part (:class:`ShardOf`); the union of the ranks' parts is the batch charged.

Examples
--------
>>> import torch
>>> from dpsgd.samplers import FixedSize
>>> bound = FixedSize().bind(num_samples=100, batch_size=10)
>>> bound.sample_rate, bound.steps_per_epoch
(0.1, 10)
>>> batches = list(bound.sampler(torch.Generator().manual_seed(0)))
>>> {len(b) for b in batches}
{10}
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.utils.data import Sampler

from dpmath import (
    Envelope,
    FixedSizeSubsampledGaussian,
    PLDAccountant,
    RandomAllocationGaussian,
    ShuffledGaussian,
    TruncatedSubsampledGaussian,
)
from dpmath.validation import positive_int

from .data import DPDataLoader, KeepsRowOrder, PoissonBatchSampler
from .distributed import MIN_ROWS
from .noise import BandedNoise, BLTNoise, GaussianNoise, StepNoise

__all__ = ["BatchSampling", "Poisson", "TruncatedPoisson", "FixedSize", "BallsInBins", "Shuffling", "CyclicPoisson",
           "BoundSampling", "CyclicBatchSampler",
           "WrappedBatchSampler",
           "TruncatedPoissonBatchSampler", "PaddedBatch", "FixedSizeBatchSampler", "EpochBatchSampler", "ShardOf",
           "as_batch_sampling", "check_sizes", "FilledParts", "filled_loader"]


class PaddedBatch(list):
    """A batch of ``real`` drawn indices followed by filler indices up to a fixed size: the rows after the first
    ``real`` carry no example (the engine gives them weight 0).

    The private loader (:class:`~dpsgd.data.DPDataLoader`) collates the ``real`` drawn examples by one call and
    makes the filler rows as copies of that call's rows, placed after them, so the filler stays after the drawn rows
    whatever order the ``collate_fn`` returns them in; the filler indices are collated only for an empty draw (all
    rows filler) or a :class:`~dpsgd.data.KeepsRowOrder` collate function."""

    def __init__(self, indices: list[int], real: int) -> None:
        super().__init__(indices)
        self.real = real

    def padding(self) -> torch.Tensor:
        """``(len,)`` bool: which rows are filler."""
        return torch.arange(len(self)) >= self.real


class TruncatedPoissonBatchSampler(PoissonBatchSampler):
    """Poisson batches at rate ``q`` with at most ``max_batch_size`` examples: a larger draw keeps a uniformly random
    ``max_batch_size`` of its examples.  With ``pad``, every batch is a :class:`PaddedBatch` of exactly
    ``max_batch_size`` rows, the drawn ones first, then filler rows (drawn indices repeated, or index 0 for an empty
    draw) that carry no example.

    Examples
    --------
    >>> import torch
    >>> s = TruncatedPoissonBatchSampler(1000, 0.5, 300, generator=torch.Generator().manual_seed(0))
    >>> max(len(b) for b in s)
    300
    """

    def __init__(self, num_samples: int, sample_rate: float, max_batch_size: int, steps: int | None = None,
                 generator: torch.Generator | None = None, pad: bool = False) -> None:
        super().__init__(num_samples, sample_rate, steps, generator)
        self.max_batch_size, self.pad = max_batch_size, pad

    def __iter__(self) -> Iterator[list[int]]:
        for batch in super().__iter__():
            if len(batch) > self.max_batch_size:
                keep = torch.randperm(len(batch), generator=self.generator)[:self.max_batch_size]
                batch = sorted(batch[i] for i in keep.tolist())
            if self.pad:
                filler = [batch[j % len(batch)] if batch else 0 for j in range(self.max_batch_size - len(batch))]
                batch = PaddedBatch(batch + filler, len(batch))
            yield batch


class FixedSizeBatchSampler(Sampler[list[int]]):
    """``steps`` batches per epoch, each ``batch_size`` examples drawn uniformly without replacement, independently
    of the other steps.

    Examples
    --------
    >>> import torch
    >>> s = FixedSizeBatchSampler(50, 5, generator=torch.Generator().manual_seed(0))
    >>> len(s), {len(b) for b in s}
    (10, {5})
    """

    def __init__(self, num_samples: int, batch_size: int, steps: int | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.num_samples, self.batch_size, self.generator = num_samples, batch_size, generator
        self.steps = max(1, round(num_samples / batch_size)) if steps is None else steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            yield sorted(torch.randperm(self.num_samples, generator=self.generator)[:self.batch_size].tolist())


class EpochBatchSampler(Sampler[list[int]]):
    """The batches of epochs in which every example is in a fixed number of steps: balls in bins (``"allocate"``:
    each example in ``participations`` distinct steps, a uniformly random subset of the ``steps``) or shuffling
    (``"shuffle"``: a permutation cut into batches of ``batch_size``, each example once).

    The epoch is kept across loops: a loop that stops early leaves the rest of the epoch to the next one, so the
    batches drawn form one stream of whole epochs, and :attr:`drawn` (batches drawn so far) says how many epochs
    the stream has begun: ``ceil(drawn / steps)``.

    Examples
    --------
    >>> import torch
    >>> s = EpochBatchSampler(20, "shuffle", batch_size=5, generator=torch.Generator().manual_seed(0))
    >>> sorted(i for b in s for i in b) == list(range(20)), s.drawn
    (True, 4)
    """

    def __init__(self, num_samples: int, kind: str, *, batch_size: int | None = None, steps: int | None = None,
                 generator: torch.Generator | None = None, participations: int = 1) -> None:
        self.num_samples, self.kind, self.generator = num_samples, kind, generator
        self.participations = positive_int(participations, "participations")
        if kind == "allocate" and self.participations > steps:
            raise ValueError(f"participations must lie in [1, steps={steps}], got {self.participations}")
        if kind == "shuffle":
            self.batch_size = batch_size
            self.steps = math.ceil(num_samples / batch_size)
        else:
            self.steps = steps
        self.drawn = 0
        self._epoch: list[list[int]] = []

    def __len__(self) -> int:
        return self.steps

    def resume(self, epochs: int) -> None:
        """Continue a run that has charged ``epochs`` epochs: the next batch begins epoch ``epochs + 1`` (the last
        one, perhaps partial, is not resumed: it was charged whole)."""
        self._epoch = []
        self.drawn = epochs * self.steps

    def _new_epoch(self) -> list[list[int]]:
        if self.kind == "shuffle":
            order = torch.randperm(self.num_samples, generator=self.generator)
            return [sorted(order[i:i + self.batch_size].tolist()) for i in range(0, self.num_samples, self.batch_size)]
        k = self.participations
        if k == 1:
            bins = torch.randint(self.steps, (self.num_samples,), generator=self.generator)
        else:   # the k smallest of T uniforms: a uniformly random k-subset, in chunks of ~4M draws
            chunk = max(1, (1 << 22) // self.steps)
            bins = torch.cat([torch.rand(min(chunk, self.num_samples - i), self.steps, generator=self.generator)
                              .topk(k, dim=1, largest=False).indices for i in range(0, self.num_samples, chunk)])
        owner = torch.arange(self.num_samples).repeat_interleave(k)
        flat = bins.flatten()
        order = torch.argsort(flat * self.num_samples + owner)   # by step, then by example
        counts = torch.bincount(flat, minlength=self.steps).tolist()
        return [part.tolist() for part in torch.split(owner[order], counts)]

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            if not self._epoch:
                self._epoch = self._new_epoch()[::-1]   # popped from the end: in step order
            self.drawn += 1
            yield self._epoch.pop()


class WrappedBatchSampler(Sampler[list[int]]):
    """A batch sampler that reads another's batches: its length, the batches its stream has drawn and its resumption
    are the wrapped sampler's (:class:`ShardOf`, :class:`dpsgd.distributed.FilledParts`)."""

    def __init__(self, sampler: Sampler[list[int]]) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def drawn(self) -> int:
        """Batches the wrapped stream has drawn (an epoch sampler's count; 0 for a per-step sampler)."""
        return getattr(self.sampler, "drawn", 0)

    def resume(self, epochs: int) -> None:
        """The wrapped stream's :meth:`EpochBatchSampler.resume` (an epoch sampler continuing a run)."""
        self.sampler.resume(epochs)


class ShardOf(WrappedBatchSampler):
    """The part of each batch of ``sampler`` (over a global index set) that falls in the shard
    ``[offset, offset + size)``, renumbered from 0: one rank's share of a stream that every rank draws alike.

    Under torch.distributed every rank runs the same sampler over the global indices (the ranks' shards
    concatenated in rank order) from a generator seeded alike on all ranks, and keeps its shard's part; the
    union of the ranks' batches is then exactly the global batch the accountant charges.  A rank's part may
    be empty (the private loader takes a noise-only step for it).  :attr:`drawn` is the global sampler's, the
    same on every rank.

    Examples
    --------
    >>> import torch
    >>> from dpsgd.samplers import FixedSize
    >>> bound = FixedSize().bind(num_samples=10, batch_size=4)
    >>> whole = list(bound.sampler(torch.Generator().manual_seed(0)))
    >>> low = list(bound.sampler(torch.Generator().manual_seed(0), offset=0, size=6))
    >>> high = list(bound.sampler(torch.Generator().manual_seed(0), offset=6, size=4))
    >>> all(w == a + [6 + i for i in b] for w, a, b in zip(whole, low, high))
    True
    """

    def __init__(self, sampler: Sampler[list[int]], offset: int, size: int) -> None:
        super().__init__(sampler)
        self.offset, self.size = offset, size

    def __iter__(self) -> Iterator[list[int]]:
        lo, hi = self.offset, self.offset + self.size
        for batch in self.sampler:
            if isinstance(batch, PaddedBatch):   # its filler rows would pass for examples
                raise ValueError("a padded batch (TruncatedPoisson(pad=True)) cannot be sharded over ranks")
            yield [i - lo for i in batch if lo <= i < hi]


def check_sizes(num_samples: object, batch_size: object) -> None:
    """``ValueError`` unless ``1 <= batch_size <= num_samples`` (both integers): what every :meth:`BatchSampling.bind`
    needs."""
    for value, name in ((num_samples, "num_samples"), (batch_size, "batch_size")):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if batch_size > num_samples:
        raise ValueError(f"batch_size ({batch_size}) must be at most the number of examples ({num_samples})")


@dataclass(frozen=True)
class BoundSampling:
    """A :class:`BatchSampling` for a data set of ``num_samples`` examples and loader batch size ``batch_size``:
    the sampler the loader draws with and the mechanism the accountant composes, from the same numbers."""

    scheme: BatchSampling
    num_samples: int
    batch_size: int
    sample_rate: float
    steps_per_epoch: int

    def sampler(self, generator: torch.Generator | None, *, offset: int = 0,
                size: int | None = None) -> Sampler[list[int]]:
        """A fresh sampler of index batches (one per run: an epoch sampler carries its position).

        With ``size``, the batches are drawn over all ``num_samples`` indices and only their part in the shard
        ``[offset, offset + size)`` is yielded, renumbered from 0 (:class:`ShardOf`): a rank's share of the global
        stream when every rank passes a generator seeded alike."""
        sampler = self.scheme.make_sampler(self, generator)
        if size is None:
            if offset != 0:
                raise ValueError(f"offset={offset!r} needs the shard's size")
            return sampler
        for value, name in ((offset, "offset"), (size, "size")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if offset + size > self.num_samples:
            raise ValueError(f"the shard [{offset}, {offset + size}) exceeds the {self.num_samples} indices sampled")
        return ShardOf(sampler, offset, size)

    @property
    def expected_batch_size(self) -> float:
        """The expected number of examples in a step's batch: the step's divisor."""
        return self.scheme.expected_batch_size(self)

    def mechanism(self, noise_multiplier: float, noise: StepNoise, envelope: Envelope | None):
        """The dpmath mechanism of one accounted event (a step, or an epoch for epoch samplers)."""
        return self.scheme.make_mechanism(self, noise_multiplier, noise, envelope)

    def events(self, steps: int, sampler: Sampler | None = None) -> int:
        """How many events ``steps`` steps charge: ``steps``, or for an epoch sampler the epochs its stream has begun
        (``ceil(drawn / T)``, at least ``ceil(steps / T)``)."""
        if not self.scheme.per_epoch:
            return steps
        drawn = max(steps, getattr(sampler, "drawn", 0))
        return math.ceil(drawn / self.steps_per_epoch)

    def accountant(self) -> PLDAccountant:
        """A fresh accountant of the scheme's neighbouring relation."""
        return PLDAccountant(neighboring=self.scheme.neighboring)


class BatchSampling:
    """How the private loader chooses each step's examples (see the module docstring)."""

    name: ClassVar[str] = ""
    #: the relation its epsilon is for: ``"add_or_remove"`` or ``"replace_one"``
    neighboring: ClassVar[str] = "add_or_remove"
    #: the accounted event is an epoch, not a step
    per_epoch: ClassVar[bool] = False

    def bind(self, num_samples: int, batch_size: int) -> BoundSampling:
        """The scheme for ``num_samples`` examples, ``batch_size`` a step (``1 <= batch_size <= num_samples``)."""
        check_sizes(num_samples, batch_size)
        q = batch_size / num_samples
        return BoundSampling(self, num_samples, batch_size, q, max(1, round(1 / q)))

    def make_sampler(self, bound: BoundSampling, generator: torch.Generator | None) -> Sampler[list[int]]:
        raise NotImplementedError

    def expected_batch_size(self, bound: BoundSampling) -> float:
        """``q N``: each example is drawn at the rate ``q`` at every step."""
        return bound.sample_rate * bound.num_samples

    def covers(self, noise: StepNoise) -> bool:
        """Whether the scheme's accounting covers ``noise`` (Gaussian noise; :class:`Poisson` any noise)."""
        return type(noise) is GaussianNoise

    def make_mechanism(self, bound: BoundSampling, noise_multiplier: float, noise: StepNoise,
                       envelope: Envelope | None):
        raise NotImplementedError

    def settings(self) -> dict:
        """What the ledger records (a resumed run must match)."""
        return {"name": self.name}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Poisson(BatchSampling):
    """Poisson sampling (the default): each example in each step independently at ``q = B / N``.

    Examples
    --------
    >>> from dpsgd.noise import GaussianNoise
    >>> Poisson().bind(1000, 10).mechanism(1.0, GaussianNoise(), None)
    SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.01)
    """

    name = "poisson"

    def at_rate(self, sample_rate: float, num_samples: int) -> BoundSampling:
        """Poisson sampling of ``num_samples`` examples (or users) at ``sample_rate`` itself: the rate the loader
        fixed (over ranks, ``sum B / sum N``), not one recomputed from a batch size."""
        return BoundSampling(self, num_samples, round(sample_rate * num_samples), sample_rate,
                             max(1, round(1 / sample_rate)))

    def make_sampler(self, bound, generator):
        return PoissonBatchSampler(bound.num_samples, bound.sample_rate, generator=generator)

    def make_mechanism(self, bound, noise_multiplier, noise, envelope):
        return noise.mechanism(noise_multiplier, bound.sample_rate, envelope)


@dataclass(frozen=True, repr=True)
class TruncatedPoisson(BatchSampling):
    """Poisson sampling with at most ``max_batch_size`` examples a step: memory bounded, and with ``pad=True``
    shapes static (every batch exactly ``max_batch_size`` rows, the rows beyond the draw filler that the engine
    weights 0: a compiled graph sees one shape).

    The probability that a step's draw overflows is charged to delta as ``eta (1 + e^epsilon)``
    (:class:`dpmath.TruncatedSubsampledGaussian`); :meth:`dpmath.TruncatedSubsampledGaussian.max_batch_size_for`
    gives the smallest ``max_batch_size`` that keeps the charge below a budget (a few binomial standard deviations
    above ``B``).

    Parameters
    ----------
    max_batch_size : int
        ``>= 1``; at least the loader's ``batch_size``.
    pad : bool
        Pad every batch to ``max_batch_size`` rows (default ``False``); each batch must then be backpropagated by one
        backward of all its rows (no :class:`~dpsgd.BatchMemoryManager`), single process.  The loader collates the
        drawn examples by one call of its ``collate_fn`` and appends copies of that call's rows as the filler, so
        the filler rows follow the drawn ones whatever order ``collate_fn`` returns them in (a result that is not
        tensors with one row per example raises :class:`~dpsgd.data.RowOrderError`).

    Examples
    --------
    >>> from dpsgd.noise import GaussianNoise
    >>> TruncatedPoisson(40).bind(1000, 10).mechanism(1.0, GaussianNoise(), None)
    TruncatedSubsampledGaussian(noise_multiplier=1.0, sample_rate=0.01, max_batch_size=40, dataset_size=1000,
                                envelope=None)
    """

    max_batch_size: int
    pad: bool = False
    name: ClassVar[str] = "truncated_poisson"

    def __post_init__(self) -> None:
        b = self.max_batch_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {b!r}")
        if not isinstance(self.pad, bool):
            raise ValueError(f"pad must be True or False, got {self.pad!r}")

    def bind(self, num_samples, batch_size):
        check_sizes(num_samples, batch_size)
        if self.max_batch_size < batch_size:
            raise ValueError(f"TruncatedPoisson(max_batch_size={self.max_batch_size}) is below the loader's "
                             f"batch_size {batch_size} (the expected batch): most steps would overflow")
        return super().bind(num_samples, batch_size)

    def make_sampler(self, bound, generator):
        return TruncatedPoissonBatchSampler(bound.num_samples, bound.sample_rate, self.max_batch_size,
                                            generator=generator, pad=self.pad)

    def make_mechanism(self, bound, noise_multiplier, noise, envelope):
        return TruncatedSubsampledGaussian(noise_multiplier, bound.sample_rate, self.max_batch_size,
                                           bound.num_samples, envelope)

    def settings(self):
        return {"name": self.name, "max_batch_size": self.max_batch_size, **({"pad": True} if self.pad else {})}


class FixedSize(BatchSampling):
    """Batches of exactly ``B`` examples, drawn without replacement afresh each step (static shapes, no empty
    batch).  Its epsilon is for **replacing** one example (with randomized clipping, two examples' random scales:
    :class:`dpmath.ReplacementEnvelope`); Gaussian noise only.

    Examples
    --------
    >>> from dpsgd.noise import GaussianNoise
    >>> FixedSize().bind(1000, 10).mechanism(2.0, GaussianNoise(), None)
    FixedSizeSubsampledGaussian(noise_multiplier=2.0, batch_size=10, dataset_size=1000, envelope=None)
    """

    name = "fixed_size"
    neighboring = "replace_one"

    def bind(self, num_samples, batch_size):
        b = super().bind(num_samples, batch_size)
        return BoundSampling(self, num_samples, batch_size, b.sample_rate, max(1, round(num_samples / batch_size)))

    def make_sampler(self, bound, generator):
        return FixedSizeBatchSampler(bound.num_samples, bound.batch_size, generator=generator)

    def make_mechanism(self, bound, noise_multiplier, noise, envelope):
        return FixedSizeSubsampledGaussian(noise_multiplier, bound.batch_size, bound.num_samples, envelope)


@dataclass(frozen=True, repr=True)
class BallsInBins(BatchSampling):
    """Balls in bins (random allocation): each epoch puts every example in ``k = participations`` distinct steps, a
    uniformly random subset of its ``T = round(k N / B)`` steps (one step by default).  Accounted per epoch: with
    exact norms by the PLD of random allocation (about as much epsilon as Poisson sampling at rate ``k / T``, often
    less; ``k > 1`` as ``k`` epochs of one participation in ``floor(T / k)`` steps:
    :class:`dpmath.RandomAllocationGaussian`), with randomized clipping by ``k`` Gaussian steps (a certified bound
    without amplification).

    Parameters
    ----------
    participations : int
        Steps each example is in per epoch, ``>= 1`` (default 1).

    Examples
    --------
    >>> from dpsgd.noise import GaussianNoise
    >>> BallsInBins().bind(1000, 10).mechanism(1.0, GaussianNoise(), None)
    RandomAllocationGaussian(noise_multiplier=1.0, steps=100, envelope=None, participations=1)
    >>> BallsInBins(participations=2).bind(1000, 10).steps_per_epoch
    200
    """

    participations: int = 1

    name: ClassVar[str] = "balls_in_bins"
    per_epoch: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "participations", positive_int(self.participations, "participations"))

    def bind(self, num_samples, batch_size):
        check_sizes(num_samples, batch_size)
        k = self.participations
        steps = max(k, round(k * num_samples / batch_size))
        return BoundSampling(self, num_samples, batch_size, k / steps, steps)

    def make_sampler(self, bound, generator):
        return EpochBatchSampler(bound.num_samples, "allocate", steps=bound.steps_per_epoch, generator=generator,
                                 participations=self.participations)

    def make_mechanism(self, bound, noise_multiplier, noise, envelope):
        return RandomAllocationGaussian(noise_multiplier, bound.steps_per_epoch, envelope,
                                        participations=self.participations)

    def settings(self):
        return {"name": self.name, "participations": self.participations}


class Shuffling(BatchSampling):
    """Shuffled fixed-size batches: each epoch a permutation of the examples cut into batches of ``B`` (the last
    one shorter when ``B`` does not divide ``N``).  Accounted per epoch by the only bound known to hold for it, one
    Gaussian step for **replacing** one example (``sigma / 2`` adding or removing one): no amplification, so far
    more epsilon than Poisson sampling at the same noise.  Gaussian noise only.

    Examples
    --------
    >>> from dpsgd.noise import GaussianNoise
    >>> Shuffling().bind(1000, 10).mechanism(1.0, GaussianNoise(), None)
    ShuffledGaussian(noise_multiplier=1.0, steps=100, envelope=None)
    """

    name = "shuffling"
    neighboring = "replace_one"
    per_epoch = True

    def bind(self, num_samples, batch_size):
        check_sizes(num_samples, batch_size)
        return BoundSampling(self, num_samples, batch_size, batch_size / num_samples,
                             math.ceil(num_samples / batch_size))

    def make_sampler(self, bound, generator):
        return EpochBatchSampler(bound.num_samples, "shuffle", batch_size=bound.batch_size, generator=generator)

    def make_mechanism(self, bound, noise_multiplier, noise, envelope):
        return ShuffledGaussian(noise_multiplier, bound.steps_per_epoch, envelope)


class CyclicBatchSampler(Sampler[list[int]]):
    """Cyclic Poisson batches: each example put once in one of ``groups`` groups, uniformly and independently (drawn
    from ``generator`` at the first batch); the ``t``-th batch drawn is a Poisson sample at ``sample_rate`` of group
    ``t mod groups``.  An example is eligible once in each cycle of ``groups`` batches, ``groups`` batches apart.

    The position is kept across loops (:attr:`drawn`: batches drawn so far), as an epoch sampler's, and a loop
    yields ``groups x cycles`` batches.

    Examples
    --------
    >>> import torch
    >>> s = CyclicBatchSampler(12, 3, 1.0, cycles=1, generator=torch.Generator().manual_seed(0))
    >>> batches = list(s)
    >>> sorted(i for b in batches for i in b) == list(range(12)), s.drawn
    (True, 3)
    """

    def __init__(self, num_samples: int, groups: int, sample_rate: float, *, cycles: int = 1,
                 generator: torch.Generator | None = None) -> None:
        self.num_samples, self.groups, self.sample_rate, self.cycles = num_samples, groups, sample_rate, cycles
        self.generator = generator
        self.drawn = 0
        self._groups: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.groups * self.cycles

    @property
    def members(self) -> tuple[torch.Tensor, ...] | None:
        """Each group's example indices (``None`` before the first batch): the partition, not the steps' coins.  The
        accounting holds given the partition, so an auditor (:mod:`verify.training`) may read it."""
        return None if self._groups is None else tuple(self._groups)

    def resume(self, epochs: int) -> None:
        """Continue a run that has charged ``epochs`` cycles: the next batch begins cycle ``epochs + 1`` (group 0;
        the partition is drawn afresh, so an example may be drawn one step after the charged cycles end: each cycle
        is one event whatever its partition)."""
        self._groups = None
        self.drawn = epochs * self.groups

    def __iter__(self) -> Iterator[list[int]]:
        if self._groups is None:
            # each example's group drawn independently (not a permutation cut into equal groups): adding or
            # removing an example then leaves every other example's group as it was, which the add-or-remove
            # analysis needs
            group = torch.randint(self.groups, (self.num_samples,), generator=self.generator)
            self._groups = [(group == j).nonzero().flatten() for j in range(self.groups)]
        for _ in range(len(self)):
            group = self._groups[self.drawn % self.groups]
            self.drawn += 1
            keep = torch.rand(group.numel(), generator=self.generator) < self.sample_rate
            yield sorted(group[keep].tolist())


@dataclass(frozen=True, repr=True)
class CyclicPoisson(BatchSampling):
    r"""Cyclic Poisson sampling: each example put once in one of ``groups`` groups, uniformly and independently (so
    adding or removing an example moves no other example's group); step ``t`` draws each example of group
    ``t mod groups`` independently at ``q = B groups / N`` (so ``B`` examples are expected a step), and no other
    example.  Each example is eligible once per cycle of ``groups`` steps, ``groups`` steps apart.

    Accounted per cycle: one subsampled-Gaussian step at ``q`` for every cycle begun (a randomized-clipping step
    with estimated norms), whatever the noise's correlations within the cycle.  It is the sampling that banded
    matrix-factorization noise (:class:`dpsgd.noise.BandedNoise` with at most ``groups`` bands) is amplified
    under (:mod:`dpmath.correlated`); with independent Gaussian noise it costs as many subsampled-Gaussian steps
    as cycles.  A loop over the loader is ``round(1 / q)`` cycles, about ``N / B`` steps, as a Poisson epoch.

    Parameters
    ----------
    groups : int
        ``b >= 1``, at most ``N / B`` (``q <= 1``).

    Examples
    --------
    >>> from dpsgd.noise import GaussianNoise
    >>> bound = CyclicPoisson(4).bind(1000, 10)
    >>> bound.sample_rate, bound.steps_per_epoch, bound.expected_batch_size
    (0.04, 4, 10.0)
    >>> bound.mechanism(1.0, GaussianNoise(), None)
    SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.04)
    """

    groups: int

    name = "cyclic_poisson"
    per_epoch = True

    def __post_init__(self) -> None:
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"groups must be an integer >= 1, got {self.groups!r}")

    def bind(self, num_samples, batch_size):
        check_sizes(num_samples, batch_size)
        q = batch_size * self.groups / num_samples
        if q > 1:
            raise ValueError(f"CyclicPoisson(groups={self.groups}) with batch_size {batch_size} of {num_samples} "
                             f"examples needs a rate q = batch_size x groups / examples = {q:.4g} <= 1: use at most "
                             f"{num_samples // batch_size} groups or a smaller batch_size")
        return BoundSampling(self, num_samples, batch_size, q, self.groups)

    def make_sampler(self, bound, generator):
        return CyclicBatchSampler(bound.num_samples, self.groups, bound.sample_rate,
                                  cycles=max(1, round(1 / bound.sample_rate)), generator=generator)

    def make_mechanism(self, bound, noise_multiplier, noise, envelope):
        return noise.cycle_mechanism(noise_multiplier, bound.sample_rate, envelope, self.groups)

    def expected_batch_size(self, bound):
        return bound.sample_rate * bound.num_samples / self.groups

    def covers(self, noise):
        return type(noise) in (GaussianNoise, BLTNoise) or (isinstance(noise, BandedNoise)
                                                            and noise.strategy.bands <= self.groups)

    def settings(self):
        return {"name": self.name, "groups": self.groups}


_BY_NAME = {"poisson": Poisson, "fixed_size": FixedSize, "balls_in_bins": BallsInBins, "shuffling": Shuffling}


def as_batch_sampling(value: object) -> BatchSampling:
    """``make_private``'s ``batch_sampling``: a :class:`BatchSampling`, or the name of one without arguments
    (``"poisson"``, ``"fixed_size"``, ``"balls_in_bins"``, ``"shuffling"``).

    Examples
    --------
    >>> as_batch_sampling("fixed_size")
    FixedSize()
    >>> as_batch_sampling("truncated_poisson")
    Traceback (most recent call last):
    ...
    ValueError: batch_sampling='truncated_poisson' needs its max_batch_size: pass TruncatedPoisson(max_batch_size=...)
    """
    if isinstance(value, BatchSampling):
        return value
    if value == "cyclic_poisson":
        raise ValueError("batch_sampling='cyclic_poisson' needs its number of groups: pass CyclicPoisson(groups)")
    if value == "truncated_poisson":
        raise ValueError("batch_sampling='truncated_poisson' needs its max_batch_size: pass "
                         "TruncatedPoisson(max_batch_size=...)")
    if isinstance(value, str) and value in _BY_NAME:
        return _BY_NAME[value]()
    raise ValueError(f"batch_sampling must be a dpsgd.samplers.BatchSampling or one of {sorted(_BY_NAME)}, "
                     f"got {value!r}")



class FilledParts(WrappedBatchSampler):
    """A rank's batches under FSDP2, each with at least :data:`MIN_ROWS` rows: a part of fewer examples (none, or
    one) is completed with filler rows, so that this rank runs the same forward, row check and backward, and
    therefore gathers the sharded parameters as many times, as the ranks whose parts are larger.

    Every batch is a :class:`~dpsgd.samplers.PaddedBatch`: its first ``real`` rows are the part's examples, the
    rest filler, which the private step weights exactly 0 (their clipped contribution is zero, so the step and its
    accounting are those of the part alone).  A filler row repeats the part's example, or is example 0 of this
    rank's shard for an empty part: rows of the data set itself, which every forward that takes the data takes.

    Because every batch is padded, each must be backpropagated whole (one loss per row), and splitting it is
    refused on every rank alike before the first batch: by ``BatchMemoryManager``
    (:meth:`check_physical_batch_size`, whose error says why) and by ``in_chunks`` (``pad``).  ``len``, ``drawn``
    and ``resume`` are the wrapped sampler's.

    Parameters
    ----------
    sampler : torch.utils.data.Sampler
        This rank's batches of indices into its own shard (possibly empty).

    Examples
    --------
    >>> parts = FilledParts([[3, 5, 6], [4], []])
    >>> [(list(b), b.real) for b in parts]
    [([3, 5, 6], 3), ([4, 4], 1), ([0, 0], 0)]
    """

    #: refuses splitting each batch into micro-batches or pieces (the private loader checks this attribute)
    pad = True

    @staticmethod
    def check_physical_batch_size(max_physical_batch_size: int) -> None:
        """Refuse micro-batches: the ranks' parts of a step differ in size, so they would split into different
        numbers of micro-batches, whose forwards gather the sharded parameters different numbers of times."""
        raise ValueError(f"max_physical_batch_size={max_physical_batch_size} (BatchMemoryManager) is refused under "
                         f"FSDP2: the ranks' parts of a step differ in size and would split into different numbers "
                         f"of micro-batches, while every rank's forwards must gather the sharded parameters "
                         f"together. Give each rank a loader batch_size whose part fits one forward, or train "
                         f"replicated (DDP-style, without fully_shard), where micro-batches are supported")

    def __iter__(self) -> Iterator[PaddedBatch]:
        for batch in self.sampler:
            batch = list(batch)
            filler = [batch[0] if batch else 0] * (MIN_ROWS - len(batch))
            yield PaddedBatch(batch + filler, len(batch))


def filled_loader(loader: DPDataLoader, collate_fn: Callable[[list], Any]) -> DPDataLoader:
    """``loader``'s batches, and callbacks, with every part of fewer than :data:`MIN_ROWS` examples completed by filler
    rows (:class:`FilledParts`): the private loader of a rank under FSDP2.

    Each batch is collated by one call of ``collate_fn``, declared order-keeping (:class:`~dpsgd.data.KeepsRowOrder`)
    without trusting it: a batch with filler rows is either all filler (all weighted 0) or one example followed by
    copies of it, so whichever order ``collate_fn`` gives the rows, the row weighted 1 is that example.  So no
    ``collate_fn`` is refused for the order or the kind of what it returns.

    Parameters
    ----------
    loader : DPDataLoader
        The private loader of this rank's part of each step (Poisson or a :mod:`dpsgd.samplers` scheme), unsplit.
    collate_fn : callable
        The user's loader's ``collate_fn``.

    Returns
    -------
    DPDataLoader
        The same sampler, sampling rate, callbacks and workers; ``len`` unchanged.
    """
    return DPDataLoader(loader.dataset, FilledParts(loader.logical_sampler), KeepsRowOrder(collate_fn),
                        sample_rate=loader.sample_rate, on_batch=loader.on_batch, on_empty=loader.on_empty,
                        num_workers=loader.num_workers, pin_memory=loader.pin_memory)

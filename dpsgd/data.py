r"""Batch sampling for DP-SGD: Poisson sampling (what the accountant assumes) and a fixed-size fallback.

With Poisson sampling each example joins each batch independently with probability ``q``; batch sizes
vary (an empty batch is possible and still takes a noise-only step), and gradients are normalized by the
expected batch size ``q N``.  :func:`private_data_loader` rebuilds a ``DataLoader`` around
:class:`PoissonBatchSampler` (a :class:`DPDataLoader`; fixed-size batches, accounted as such, are
:mod:`dpsgd.samplers`' schemes).  It keeps the loader's dataset and ``collate_fn`` only, so it accepts only a
loader whose batching means "this dataset, batched by ``batch_size``" (the default sequential sampler or
``shuffle=True``, ``drop_last=False``) and refuses any other sampler, batch sampler or ``drop_last`` with
:class:`UnsupportedSamplerError` rather than drop it.  :class:`BatchMemoryManager` splits each
logical batch into physical micro-batches (gradient accumulation with one noise draw per logical batch).

Where the engine treats the rows of a batch unequally (a padded batch's filler rows weighted 0, a user's rows
clipped together), the loader never relies on the order in which ``collate_fn`` returns the rows: it collates each
set of rows the engine treats alike by its own call (a padded batch's drawn rows, each user's rows), and joins the
results itself (:class:`DPDataLoader`), so a ``collate_fn`` that sorts or shuffles its rows only permutes rows of
equal treatment.  A result it cannot join is refused with :class:`RowOrderError`; :class:`KeepsRowOrder` declares a
``collate_fn`` that keeps the rows in the order given, which is then called once per batch.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

__all__ = ["PoissonBatchSampler", "DPDataLoader", "BatchMemoryManager", "EmptyBatch", "private_data_loader",
           "loader_size", "UnsupportedSamplerError", "KeepsRowOrder", "RowOrderError"]


class UnsupportedSamplerError(ValueError):
    """A data loader whose choice of examples the private loader would not keep: a sampler other than the default
    or ``shuffle=True``, a ``batch_sampler``, ``drop_last=True`` or an iterable dataset.

    The private loader keeps only the loader's dataset and ``collate_fn`` and draws Poisson batches of expected
    size ``batch_size`` from the whole dataset, which is what the accountant charges.  Any other choice of
    examples (weights, a rank's shard, a subset, fixed batches) would be dropped without a word, or charged as
    Poisson sampling when it is not, so it is refused, naming what was found and what to pass instead.
    """


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
        Source of the sampling (the engine seeds it from ``os.urandom``; a checkpoint never saves its state).

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
        self.num_samples, self._q = num_samples, q
        self.steps = max(1, round(1 / q)) if steps is None else int(steps)
        if self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        self.generator = generator

    @property
    def sample_rate(self) -> float:
        """``q``, read-only: the accountant charges the rate the sampler was made with."""
        return self._q

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            mask = torch.rand(self.num_samples, generator=self.generator) < self._q
            yield mask.nonzero().flatten().tolist()


class EmptyBatch(dict):
    """What the loader's collate function makes of an empty Poisson batch (an empty dict, so code that looks
    up keys in a batch sees none); yielded only by a loader with a fixed number of chunks per logical batch."""


def _empty_aware(collate):
    def collate_fn(batch):
        return collate(batch) if batch else EmptyBatch()
    return collate_fn


class RowOrderError(ValueError):
    """A ``collate_fn`` whose batches the private loader cannot assemble without trusting the order of its rows.

    A padded batch's filler rows (weighted 0) and a user's rows (clipped together) are told apart by the loader, not
    by their place in what ``collate_fn`` returns: it collates a padded batch's drawn examples by one call and
    appends copies of that call's rows as filler, and collates each user's examples by a call of its own and joins
    the calls user after user.  That needs tensors with one row per example along the first dimension (in tuples,
    lists and mappings), and, to join users, the same shape past the first dimension in every call.  Anything else
    is refused, naming what was found and the way out: return such tensors (pad to a fixed length), or declare a
    ``collate_fn`` that keeps the rows in the order given with :class:`KeepsRowOrder`.
    """


class KeepsRowOrder:
    """A ``collate_fn`` declared to keep the rows in the order it is given: row ``i`` of every tensor it returns is
    made from the ``i``-th item of its input, and from it alone.

    Wrap a loader's ``collate_fn`` in it (``DataLoader(dataset, batch_size=B, collate_fn=KeepsRowOrder(fn))``) where
    the private loader cannot assemble a padded batch or a batch of users from separate calls
    (:class:`RowOrderError`, e.g. a collator that pads each call to its longest row, for users).  The loader then
    collates each batch by one call and takes each row's role (filler, user) from its place: the declaration is
    trusted, not checked, and a ``collate_fn`` that sorted or shuffled its rows would then weight a filler row or
    clip a user's rows apart.  Torch's ``default_collate`` and Hugging Face's padding collators keep the order.

    Parameters
    ----------
    collate_fn : callable
        The collate function, called with a list of dataset items.

    Examples
    --------
    >>> import torch
    >>> from dpsgd.data import KeepsRowOrder
    >>> collate = KeepsRowOrder(torch.utils.data.default_collate)
    >>> collate([torch.tensor(1.0), torch.tensor(2.0)])
    tensor([1., 2.])
    """

    def __init__(self, collate_fn: Callable[[list], Any]) -> None:
        if not callable(collate_fn):
            raise ValueError(f"KeepsRowOrder needs a callable collate_fn, got {type(collate_fn).__name__}")
        self.collate_fn = collate_fn.collate_fn if isinstance(collate_fn, KeepsRowOrder) else collate_fn

    def __call__(self, batch: list) -> Any:
        return self.collate_fn(batch)

    def __repr__(self) -> str:
        return f"KeepsRowOrder({self.collate_fn!r})"


class _Unjoinable(Exception):
    """Where (``batch['input_ids']``) and why the results of collate calls cannot be joined by rows."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{reason} at {where}")
        self.where, self.reason = where, reason


def _joined(parts: list, where: str, leaf: Callable[[list[torch.Tensor], str], torch.Tensor]) -> Any:
    """``parts`` (the results of collate calls) walked together through their tuples, lists and mappings, the
    tensors at each place replaced by ``leaf(tensors, where)``; :class:`_Unjoinable` at anything but a tensor
    there, or where the parts differ in structure."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(p, torch.Tensor) for p in parts):
            raise _Unjoinable(where, "a tensor from one call and something else from another")
        return leaf(parts, where)
    if isinstance(first, Mapping):
        keys = list(first)
        if not all(isinstance(p, Mapping) and set(p) == set(keys) for p in parts):
            raise _Unjoinable(where, "mappings with different keys from different calls")
        joined = {k: _joined([p[k] for p in parts], f"{where}[{k!r}]", leaf) for k in keys}
        try:   # the collator's own mapping type (a BatchEncoding), as default_collate rebuilds it
            return type(first)(joined)
        except TypeError:
            return joined
    if isinstance(first, (tuple, list)):
        if not all(type(p) is type(first) and len(p) == len(first) for p in parts):
            raise _Unjoinable(where, f"{type(first).__name__}s of different lengths from different calls")
        items = [_joined([p[i] for p in parts], f"{where}[{i}]", leaf) for i in range(len(first))]
        if hasattr(first, "_fields"):   # a namedtuple
            return type(first)(*items)
        try:
            return type(first)(items)
        except TypeError:
            return list(items) if isinstance(first, list) else tuple(items)
    # a string, a number or an object: nothing says which of its parts belongs to which row
    raise _Unjoinable(where, f"a {type(first).__name__}, not a tensor with one row per example")


def _per_row(t: torch.Tensor, rows: int, where: str) -> None:
    """:class:`_Unjoinable` unless ``t`` has one row per example of its call (``rows``) along dimension 0."""
    if t.dim() == 0 or t.shape[0] != rows:
        raise _Unjoinable(where, f"a tensor of shape {tuple(t.shape)} from a call on {rows} examples (one row per "
                                 f"example along the first dimension is needed)")


def _concatenated(rows: list[int]) -> Callable[[list[torch.Tensor], str], torch.Tensor]:
    """The leaf of :func:`_joined` that stacks the calls' tensors (``rows[j]`` rows each) in call order."""
    def leaf(tensors: list[torch.Tensor], where: str) -> torch.Tensor:
        for t, n in zip(tensors, rows, strict=True):
            _per_row(t, n, where)
        shapes = sorted({tuple(t.shape[1:]) for t in tensors})
        if len(shapes) > 1:
            raise _Unjoinable(where, f"tensors whose shapes past the first dimension differ between calls "
                                     f"({', '.join(map(str, shapes[:3]))}: each call padded to its own longest row?)")
        if len({t.dtype for t in tensors}) > 1:
            raise _Unjoinable(where, f"tensors of different dtypes ({sorted({str(t.dtype) for t in tensors})})")
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    return leaf


def _taken(rows: int, index: list[int]) -> Callable[[list[torch.Tensor], str], torch.Tensor]:
    """The leaf of :func:`_joined` that takes the rows ``index`` of one call's tensor of ``rows`` rows."""
    def leaf(tensors: list[torch.Tensor], where: str) -> torch.Tensor:
        (t,) = tensors
        _per_row(t, rows, where)
        return t.index_select(0, torch.tensor(index, dtype=torch.long, device=t.device))
    return leaf


# a padded batch's filler rows are marked for one backward of the whole batch: refused, as the loader is made (and
# as a padded batch reaches a splitting sampler), where it would be split
_UNSPLIT = ("a padded batch (TruncatedPoisson(pad=True), or a rank's part under FSDP2, which filler rows complete) "
            "cannot be split into micro-batches or pieces: backpropagate each whole batch (or use pad=False)")

# one number per logical batch drawn by any private loader: a step may use examples of one logical batch only
_LOGICAL_IDS = itertools.count()


@dataclass
class _Chunk:
    """One batch the private loader yields: ``size`` rows, ``last`` (it ends its logical batch), ``logical`` (its
    logical batch's number), and how it is made.  Without ``rows``, one collate call is the batch as it is; with
    ``rows``, ``len(rows)`` calls of ``rows[j]`` examples each, whose results must be tensors of one row per
    example, joined in call order, or with ``take`` the one call's rows ``take`` (a padded batch: its drawn rows,
    then copies of them as filler).  ``groups`` (each row's user) and ``padding`` (which rows are filler) are what
    the engine is told."""

    size: int
    last: bool
    logical: int
    rows: list[int] | None = None
    take: list[int] | None = None
    groups: torch.Tensor | None = None
    padding: torch.Tensor | None = None

    @property
    def calls(self) -> int:
        """The collate calls (batches of the underlying ``DataLoader``) that make it."""
        return len(self.rows) if self.rows else 1

    def reported(self) -> tuple:
        """``on_batch``'s arguments."""
        if self.padding is not None:
            return self.size, self.last, self.logical, None, self.padding
        if self.groups is not None:
            return self.size, self.last, self.logical, self.groups
        return self.size, self.last, self.logical


class _ChunkSampler(Sampler[list[int]]):
    """Logical batches from ``logical``, split into physical chunks of at most ``max_size``, each yielded as the
    index lists of its collate calls; the :class:`_Chunk` of each is queued in ``fifo`` before its first call
    (the loader pops it when the chunk's calls reach it).

    Unless ``ordered`` (a :class:`KeepsRowOrder` collate function), rows the engine treats differently never share
    a call: a padded batch's drawn examples are one call (the filler is made of copies of its rows), and each user
    of a batch of users is a call of its own, so a collate function that reorders the rows of a call can only
    permute rows the engine treats alike."""

    def __init__(self, logical: Sampler, max_size: int | None, fifo: deque, chunks: int | None = None,
                 ordered: bool = False) -> None:
        self.logical, self.max_size, self.fifo, self.chunks = logical, max_size, fifo, chunks
        self.ordered = ordered

    def __len__(self) -> int:
        return len(self.logical) * (self.chunks or 1)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.logical:
            split = getattr(batch, "split_rows", None)
            if split is not None:   # a batch of users (dpsgd.users): whole users per chunk, with each row's user
                logical = next(_LOGICAL_IDS)
                for piece, groups, last in split(self.max_size, self.chunks):
                    if self.ordered or not piece:
                        self.fifo.append(_Chunk(len(piece), last, logical, groups=groups))
                        yield piece
                        continue
                    # one call per user, users in order of their number: each row's user is its call's, whatever
                    # order the collate function gives the rows of a call
                    order = torch.argsort(groups, stable=True).tolist()
                    counts = torch.bincount(groups).tolist()
                    self.fifo.append(_Chunk(len(piece), last, logical, rows=counts,
                                            groups=torch.repeat_interleave(torch.arange(len(counts)),
                                                                           torch.tensor(counts))))
                    start = 0
                    for n in counts:
                        yield [piece[i] for i in order[start:start + n]]
                        start += n
                continue
            real = getattr(batch, "real", None)
            if real is not None:   # a fixed size (dpsgd.samplers.PaddedBatch): one chunk, with its filler rows
                if self.chunks or self.max_size:
                    raise ValueError(_UNSPLIT)
                size, padding = len(batch), batch.padding()
                if self.ordered:   # declared: one call, the filler known by its place
                    self.fifo.append(_Chunk(size, True, next(_LOGICAL_IDS), padding=padding))
                    yield list(batch)
                elif 0 < real < size:
                    # the drawn examples by one call; the filler rows, copies of its rows, follow them whatever order
                    # the call gave them (in the call, a filler row could be sorted among the drawn rows)
                    take = list(range(real)) + [j % real for j in range(size - real)]
                    self.fifo.append(_Chunk(size, True, next(_LOGICAL_IDS), rows=[real], take=take, padding=padding))
                    yield list(batch[:real])
                else:   # all rows alike (an empty draw: all filler; a full one: none), its result checked all the same
                    self.fifo.append(_Chunk(size, True, next(_LOGICAL_IDS), rows=[size], padding=padding))
                    yield list(batch)
                continue
            batch = list(batch)
            logical = next(_LOGICAL_IDS)
            if self.chunks:  # exactly `chunks` pieces (some possibly empty), every one ends a step's share
                n = len(batch)
                for j in range(self.chunks):
                    piece = batch[j * n // self.chunks:(j + 1) * n // self.chunks]
                    self.fifo.append(_Chunk(len(piece), True, logical))
                    yield piece
                continue
            if not batch:
                self.fifo.append(_Chunk(0, True, logical))
                yield []
                continue
            size = self.max_size or len(batch)
            chunks = [batch[i:i + size] for i in range(0, len(batch), size)]
            for j, chunk in enumerate(chunks):
                self.fifo.append(_Chunk(len(chunk), j == len(chunks) - 1, logical))
                yield chunk


def _collate_name(collate_fn: object) -> str:
    return getattr(collate_fn, "__qualname__", None) or type(collate_fn).__name__


class DPDataLoader(DataLoader):
    r"""A ``DataLoader`` whose batches are drawn as the accountant assumes (Poisson by default).

    Each batch is reported to ``on_batch(size, last, logical)`` as it reaches the user (``last`` is false for
    all but the final physical chunk of a logical batch split by ``max_physical_batch_size``; ``logical``
    identifies the logical batch it belongs to; a sampler of users, :mod:`dpsgd.users`, adds ``groups``, each
    row's user within the chunk, and chunks hold whole users; a padded batch, :class:`dpsgd.samplers.PaddedBatch`,
    adds ``None, padding``, which rows are filler); an empty
    Poisson batch is not yielded: ``on_empty()`` takes its noise-only step, so the user's forward never sees
    an empty tensor.  ``len(loader)`` counts logical batches, empty ones included.

    ``groups`` and ``padding`` hold whatever order ``collate_fn`` gives the rows it is called with: a padded batch's
    drawn examples are collated by one call, and its filler rows are copies of that call's rows placed after them;
    each user's examples are collated by a call of their own, and the calls joined along the first dimension, user
    after user.  A call's result that cannot be joined so (anything but tensors with one row per example in tuples,
    lists and mappings; for users, tensors whose shapes past the first dimension differ between calls) raises
    :class:`RowOrderError` as it is drawn.  A ``collate_fn`` wrapped in :class:`KeepsRowOrder` is instead called
    once per batch, and rows are told apart by their places, as it declares.
    """

    def __init__(self, dataset, logical: Sampler, collate_fn, *, sample_rate: float,
                 max_physical_batch_size: int | None = None, chunks: int | None = None, on_batch=None,
                 on_empty=None, num_workers: int = 0, pin_memory: bool = False) -> None:
        if (max_physical_batch_size or chunks) and getattr(logical, "pad", False):
            raise ValueError(_UNSPLIT)
        self._fifo: deque = deque()
        self.logical_sampler = logical
        self._q = sample_rate
        self.max_physical_batch_size = max_physical_batch_size
        self.chunks = chunks
        self.on_batch, self.on_empty = on_batch, on_empty
        self._collate = collate_fn
        sampler = _ChunkSampler(logical, max_physical_batch_size, self._fifo, chunks,
                                ordered=isinstance(collate_fn, KeepsRowOrder))
        super().__init__(dataset, batch_sampler=sampler, collate_fn=_empty_aware(collate_fn),
                         num_workers=num_workers, pin_memory=pin_memory)

    @property
    def sample_rate(self) -> float:
        """``q = batch_size / N``, read-only: the accountant charges the rate the loader was made with."""
        return self._q

    def __iter__(self):
        self._fifo.clear()
        calls = super().__iter__()
        for batch in calls:
            chunk = self._fifo.popleft()
            if chunk.rows is not None:   # the rest of its calls, then one batch of them
                batch = self._assembled(chunk, [batch, *itertools.islice(calls, chunk.calls - 1)])
            if chunk.size == 0 and not self.chunks:
                if self.on_empty is not None:
                    self.on_empty()
                continue
            if self.on_batch is not None:   # users, or a padded batch's filler, with the rows they belong to
                self.on_batch(*chunk.reported(), batch=batch)
            yield batch

    def _assembled(self, chunk: _Chunk, parts: list) -> Any:
        """The batch of ``chunk`` from its collate calls' results (:class:`RowOrderError` if they cannot be)."""
        try:
            if len(parts) != chunk.calls:
                raise RuntimeError(f"{len(parts)} collate calls reached the loader for a batch of {chunk.calls}")
            if chunk.take is not None:
                batch = _joined(parts, "batch", _taken(chunk.rows[0], chunk.take))
            else:
                batch = _joined(parts, "batch", _concatenated(chunk.rows))
        except _Unjoinable as err:
            raise RowOrderError(self._refusal(chunk, err)) from None
        if self.pin_memory and torch.cuda.is_available():   # new tensors: pinned as the DataLoader pinned its calls
            batch = _joined([batch], "batch", lambda tensors, where: tensors[0].pin_memory())
        return batch

    def _refusal(self, chunk: _Chunk, err: _Unjoinable) -> str:
        if chunk.padding is not None:
            how = ("a padded batch (TruncatedPoisson(pad=True)): the loader collates the drawn examples by one call "
                   "and appends copies of its rows as the filler rows the engine weights 0, so that no filler row "
                   "can take a drawn row's place whatever order collate_fn returns the rows in")
            fix = "Make collate_fn return tensors with one row per example (in tuples, lists or dicts)"
        else:
            how = ("a batch of users (privacy_unit='user'): the loader collates each user's examples by a call of "
                   "its own and joins the calls user after user, so that the engine clips each user's rows together "
                   "whatever order collate_fn returns the rows in")
            fix = ("Make collate_fn return tensors with one row per example (in tuples, lists or dicts) and the same "
                   "shape past the first dimension in every call, e.g. pad to a fixed length "
                   "(DataCollatorWithPadding(tokenizer, padding='max_length', max_length=L))")
        return (f"data_loader's collate_fn ({_collate_name(self._collate)}) returned, at {err.where}, {err.reason}, "
                f"which the private loader cannot join by rows for {how}. {fix}; or, if collate_fn keeps the rows "
                f"in the order it is given, declare it: DataLoader(dataset, batch_size=B, "
                f"collate_fn=dpsgd.data.KeepsRowOrder(collate_fn)), and the batch is collated by one call")

    def in_chunks(self, chunks: int) -> DPDataLoader:
        """The same logical batches, each as exactly ``chunks`` pieces (empty ones as :class:`EmptyBatch`) for
        a training loop that steps after a fixed number of micro-batches (Hugging Face's gradient
        accumulation); ``len`` counts pieces."""
        return DPDataLoader(self.dataset, self.logical_sampler, self._collate, sample_rate=self.sample_rate,
                            chunks=chunks, on_batch=self.on_batch, on_empty=self.on_empty,
                            num_workers=self.num_workers, pin_memory=self.pin_memory)

    def with_physical_batch_size(self, max_physical_batch_size: int) -> DPDataLoader:
        """The same logical batches (same sampler and generator), split into chunks of at most this size."""
        if isinstance(max_physical_batch_size, bool) or not isinstance(max_physical_batch_size, int) \
                or max_physical_batch_size < 1:
            raise ValueError(f"max_physical_batch_size must be a positive integer, got {max_physical_batch_size!r}")
        check = getattr(self.logical_sampler, "check_physical_batch_size", None)
        if check is not None:   # a sampler of users: a user's rows must fit one physical batch
            check(max_physical_batch_size)
        return DPDataLoader(self.dataset, self.logical_sampler, self._collate, sample_rate=self.sample_rate,
                            max_physical_batch_size=max_physical_batch_size, on_batch=self.on_batch,
                            on_empty=self.on_empty, num_workers=self.num_workers, pin_memory=self.pin_memory)


# the way out every UnsupportedSamplerError names
_POISSON_HINT = ("Pass DataLoader(dataset, batch_size=B) (shuffle=True is accepted too): the engine draws Poisson "
                 "batches of expected size B from the whole dataset, each example independently at rate q = B / N, "
                 "which is what the accountant charges")


def _sampler_refusal(sampler: Sampler, dataset) -> str | None:
    """Why the private loader cannot keep ``sampler`` (what it draws that Poisson sampling of ``dataset`` would
    not), or ``None`` for the two samplers that mean "every example of ``dataset``": the default sequential one
    and ``shuffle=True``'s permutation (exact types: a subclass may draw otherwise)."""
    if type(sampler) is SequentialSampler and sampler.data_source is dataset:
        return None
    if type(sampler) is RandomSampler and sampler.data_source is dataset and not sampler.replacement \
            and sampler.num_samples == len(dataset):
        return None
    if isinstance(sampler, WeightedRandomSampler):
        return ("draws examples with the probabilities of its weights, while the engine draws every example at "
                "one rate q: the weights would be dropped, and no accountant here charges per-example rates. To "
                "weight examples or classes, weight their losses instead (nn.CrossEntropyLoss(weight=...), or "
                "PrivacyEngine.private_loss(w * losses)): each example's clipped gradient stays within "
                "max_grad_norm, so the accounting holds")
    if isinstance(sampler, DistributedSampler):
        return ("gives this rank a shard of the dataset, while the engine would sample the whole dataset on every "
                "rank. Under torch.distributed give each rank a plain loader over its own shard, e.g. "
                "DataLoader(torch.utils.data.Subset(dataset, range(rank, N, world_size)), batch_size=B_rank): the "
                "engine samples every rank's shard at one global rate q = (sum of the batch sizes) / (sum of the "
                "shard sizes) and checks that it is the same on all ranks")
    if isinstance(sampler, SubsetRandomSampler):
        return ("draws from a subset of the dataset, while the engine would sample all of it; to train on a subset, "
                "pass DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=B)")
    if type(sampler) in (RandomSampler, SequentialSampler):
        if sampler.data_source is not dataset:
            return "orders a data_source other than the loader's dataset, which the engine would sample instead"
        if sampler.replacement:
            return "draws with replacement (replacement=True), which the engine would replace by Poisson sampling"
        return (f"draws num_samples={sampler.num_samples} of the {len(dataset)} examples, while the engine would "
                f"sample all of them")
    return ("is not one the engine knows: it can neither keep it (the accountant charges Poisson sampling of the "
            "whole dataset) nor drop it silently")


def _check_batching(data_loader: DataLoader) -> None:
    """:class:`UnsupportedSamplerError` unless ``data_loader``'s batches are ``batch_size`` examples at a time of
    its whole dataset (the only batching the private loader replaces by Poisson sampling without losing a
    choice the user made)."""
    dataset = data_loader.dataset
    if isinstance(data_loader, DPDataLoader):
        raise UnsupportedSamplerError("data_loader is already a private loader (a DPDataLoader that make_private "
                                      "returned): its batches are drawn for that engine's accountant. Pass the "
                                      "original DataLoader(dataset, batch_size=B) to a new engine")
    if isinstance(dataset, IterableDataset):
        raise UnsupportedSamplerError(f"data_loader's dataset is an IterableDataset ({type(dataset).__name__}): "
                                      f"Poisson sampling draws examples by index, so it needs a map-style dataset "
                                      f"(__getitem__ and __len__). {_POISSON_HINT}")
    batch_sampler = data_loader.batch_sampler
    if data_loader.batch_size is None and batch_sampler is not None:
        raise UnsupportedSamplerError(f"data_loader's batch_sampler ({type(batch_sampler).__name__}) is not "
                                      f"supported: it chooses the batches itself, and the engine, which draws "
                                      f"Poisson batches, would drop it. {_POISSON_HINT}")
    if data_loader.drop_last:
        raise UnsupportedSamplerError(f"data_loader's drop_last=True is not supported: Poisson batches have random "
                                      f"sizes and every one is a step (an empty one a noise-only step), so none is "
                                      f"dropped (drop_last=False, the default). {_POISSON_HINT}")
    reason = _sampler_refusal(data_loader.sampler, dataset)
    if reason is not None:
        raise UnsupportedSamplerError(f"data_loader's sampler ({type(data_loader.sampler).__name__}) is not "
                                      f"supported: it {reason}. {_POISSON_HINT}")


def loader_size(data_loader: DataLoader) -> tuple[int, int]:
    """``(N, batch_size)`` of a loader the private loader can be built from, or ``ValueError`` saying why not
    (:class:`UnsupportedSamplerError` for a sampler, batch sampler or ``drop_last`` it would not keep)."""
    if not isinstance(data_loader, DataLoader):
        raise ValueError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
    _check_batching(data_loader)
    if data_loader.batch_size is None:
        raise ValueError("data_loader must have a fixed batch_size (its expected batch size under Poisson sampling)")
    try:
        n = len(data_loader.dataset)
    except TypeError as err:
        raise ValueError("data_loader's dataset must have a length (Poisson sampling draws from N examples)") from err
    if n == 0:
        raise ValueError("data_loader's dataset is empty: there is nothing to train on")
    return n, data_loader.batch_size


def private_data_loader(data_loader: DataLoader, *, generator: torch.Generator | None = None,
                        on_batch=None, on_empty=None, sample_rate: float | None = None) -> DPDataLoader:
    r"""The same dataset and collate function, batched by Poisson sampling at ``q = batch_size / N``.

    Parameters
    ----------
    data_loader : torch.utils.data.DataLoader
        A loader with a fixed ``batch_size`` (at most the dataset size) over a sized, non-empty, map-style
        dataset, with the default sampler or ``shuffle=True`` and ``drop_last=False``; any other sampler, a
        ``batch_sampler`` or ``drop_last=True`` raises :class:`UnsupportedSamplerError` (it would be dropped).
    generator : torch.Generator, optional
        Source of the sampling.
    on_batch, on_empty : callable, optional
        See :class:`DPDataLoader` (the privacy engine passes its own).
    sample_rate : float, optional
        ``q`` in ``(0, 1]`` instead of ``batch_size / N``: under torch.distributed, the global rate
        (expected batch over all ranks / examples over all ranks) at which every rank samples its shard.

    Returns
    -------
    DPDataLoader

    Raises
    ------
    UnsupportedSamplerError
        For a loader whose sampler, batch sampler or ``drop_last`` the Poisson loader would drop.
    ValueError
        For a loader without a fixed ``batch_size`` or over an unsized or empty dataset, or a rate outside
        ``(0, 1]``.

    Examples
    --------
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler
    >>> from dpsgd.data import private_data_loader
    >>> dl = DataLoader(TensorDataset(torch.arange(100.0)), batch_size=10)
    >>> pl = private_data_loader(dl, generator=torch.Generator().manual_seed(1))
    >>> len(pl), pl.sample_rate
    (10, 0.1)
    >>> private_data_loader(DataLoader(TensorDataset(torch.arange(100.0)), batch_size=10,
    ...                                sampler=WeightedRandomSampler(torch.ones(100), 100)))
    Traceback (most recent call last):
    ...
    dpsgd.data.UnsupportedSamplerError: data_loader's sampler (WeightedRandomSampler) is not supported: ...
    """
    n, batch = loader_size(data_loader)
    if sample_rate is None and batch > n:
        raise ValueError(f"data_loader's batch_size ({batch}) exceeds the dataset size ({n}): the "
                         f"sampling rate q = batch_size / N must be at most 1")
    q = batch / n if sample_rate is None else float(sample_rate)
    if not 0 < q <= 1:
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate!r}")
    sampler = PoissonBatchSampler(n, q, generator=generator)
    return DPDataLoader(data_loader.dataset, sampler, data_loader.collate_fn, sample_rate=q, on_batch=on_batch,
                        on_empty=on_empty, num_workers=data_loader.num_workers, pin_memory=data_loader.pin_memory)


class BatchMemoryManager:
    r"""Split each logical (Poisson) batch into physical micro-batches of at most ``max_physical_batch_size``.

    Opacus' contract: call ``optimizer.step()`` after every micro-batch; it only accumulates the clipped
    sums until the logical batch's last micro-batch, where the one noise draw and the one accountant step
    happen.  Memory is bounded by the micro-batch.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from dpsgd import BatchMemoryManager, PrivacyEngine
    >>> data = TensorDataset(torch.randn(64, 3), torch.randint(0, 2, (64,)))
    >>> model = nn.Linear(3, 2)
    >>> engine = PrivacyEngine()
    >>> model, opt, crit, loader = engine.make_private(module=model,
    ...     optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=32),
    ...     criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=1.0)
    >>> with BatchMemoryManager(data_loader=loader, max_physical_batch_size=8, optimizer=opt) as small:
    ...     for x, y in small:
    ...         assert len(x) <= 8
    ...         crit(model(x), y).backward()
    ...         opt.step()
    >>> engine.steps
    2
    """

    def __init__(self, *, data_loader: DPDataLoader, max_physical_batch_size: int, optimizer=None) -> None:
        if not isinstance(data_loader, DPDataLoader):
            raise ValueError("data_loader must be the loader make_private returned (a DPDataLoader)")
        self._loader = data_loader.with_physical_batch_size(max_physical_batch_size)
        self.optimizer = optimizer

    def __enter__(self) -> DPDataLoader:
        return self._loader

    def __exit__(self, *exc) -> None:
        return None

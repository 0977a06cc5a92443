r"""User-level privacy: Poisson sampling of users, and which rows of each physical batch belong to which user.

When one person writes many examples, the unit of privacy is the person.  With
``make_private(privacy_unit="user", user_ids=...)``:

* :class:`UserPoissonSampler` draws each **user** independently with probability ``q_u = batch_size / U``
  (``U`` users; the loader's ``batch_size`` is then the expected number of users per batch).  A drawn user
  brings all of its examples, or a uniformly random subset of ``max_examples_per_user`` of them (drawn from the
  sampler's generator), as consecutive rows of the batch (a :class:`UserBatch`);
* a physical batch (a chunk of :class:`~dpsgd.data.BatchMemoryManager`, a piece of ``in_chunks``) holds whole
  users only: :meth:`UserBatch.split_rows` splits on user boundaries and refuses a user with more rows than the
  physical batch;
* the loader hands the engine each chunk's ``groups`` (row ``i`` belongs to the chunk's user ``groups[i]``), by
  construction: it collates each user's examples by a call of the loader's ``collate_fn`` of their own and joins
  the calls user after user (:class:`~dpsgd.data.DPDataLoader`), so a ``collate_fn`` that reorders its rows
  cannot move a row to another user (a result it cannot join raises :class:`~dpsgd.data.RowOrderError`; a
  ``collate_fn`` declared with :class:`~dpsgd.data.KeepsRowOrder` is called once per chunk instead);
  :class:`UserRows` gives them to the one backward of that chunk, and :func:`dpsgd.clipping.clipped_backward`
  clips each user's **summed** gradient once: ``w_u = min(1, C / ||sum_{i in u} g_i||)`` (the unit's norm:
  :func:`dpsgd.clipping.unit_sq_norms`).

One user then changes a step's clipped sum by at most ``C`` and joins a batch with probability ``q_u``: the
accountant charges ``SubsampledGaussian(sigma, q_u)`` (with the plan's envelope under ``hutch`` / ``hutchpp``),
and ``get_epsilon`` is an epsilon per user.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from .data import DPDataLoader, KeepsRowOrder, RowOrderError, loader_size

__all__ = ["PRIVACY_UNITS", "UserLevel", "user_level", "UserPoissonSampler", "UserBatch", "UserRows",
           "user_data_loader"]

PRIVACY_UNITS = ("example", "user")
"""The units ``make_private(privacy_unit=...)`` accepts."""


@dataclass(frozen=True)
class UserLevel:
    """``make_private``'s user-level arguments, checked: each example's user (as ``0 .. U-1`` in order of first
    appearance) and the cap on a drawn user's examples (``None``: all of them)."""

    users: torch.Tensor
    num_users: int
    max_examples_per_user: int | None

    def settings(self) -> dict:
        """What the ledger and checkpoints record (a resumed run must match)."""
        return {"privacy_unit": "user", "max_examples_per_user": self.max_examples_per_user}


def _user_labels(user_ids: object) -> list:
    """``user_ids`` as a list of one label per example (a tensor's, an array's or a Series' values; a sequence's
    items as given), ``TypeError`` or ``ValueError`` naming ``user_ids`` for anything else."""
    if not isinstance(user_ids, (torch.Tensor, np.ndarray)) and callable(getattr(user_ids, "to_numpy", None)):
        user_ids = user_ids.to_numpy()   # a pandas Series or Index (pandas is not needed here)
    if isinstance(user_ids, (torch.Tensor, np.ndarray)):
        if user_ids.ndim != 1:
            raise ValueError(f"user_ids must be a sequence or a 1-D tensor or array (one user label per example), "
                             f"got shape {tuple(user_ids.shape)}")
        if isinstance(user_ids, torch.Tensor):
            if user_ids.is_floating_point() or user_ids.is_complex() or user_ids.dtype == torch.bool:
                raise TypeError(f"user_ids must hold integer (or string) labels, got a {user_ids.dtype} tensor: "
                                f"{_NOT_FLOAT}")
        elif user_ids.dtype.kind in "fcb":
            raise TypeError(f"user_ids must hold integer (or string) labels, got a {user_ids.dtype} array: "
                            f"{_NOT_FLOAT}")
        return user_ids.tolist() if user_ids.dtype != object else list(user_ids)
    if isinstance(user_ids, (str, bytes)) or not isinstance(user_ids, Sequence):
        raise TypeError(f"user_ids must be a sequence, a 1-D tensor or array, or a pandas Series (one user label per "
                        f"example), got {type(user_ids).__name__}")
    return list(user_ids)


_NOT_FLOAT = ("a floating-point id is refused (is 3.0 the user 3? a rounding would merge or split users); convert "
              "the ids to integers or strings")


def _label(value: object, i: int) -> int | str:
    """One example's user label by value: an ``int`` (from a Python, numpy or 0-d tensor integer) or a ``str``;
    ``TypeError`` naming ``user_ids`` for anything else (a 0-d tensor hashes by identity, so it is read here)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise TypeError(f"user_ids[{i}] is a tensor of shape {tuple(value.shape)}: each example has one label "
                            f"(an integer, a string or a 0-d integer tensor)")
        if value.is_floating_point() or value.is_complex():
            raise TypeError(f"user_ids[{i}] is a {value.dtype} tensor: {_NOT_FLOAT}")
        value = value.item()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool):
        raise TypeError(f"user_ids[{i}] is {value!r}: user labels are integers or strings, not booleans")
    if isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        raise TypeError(f"user_ids[{i}] is the float {value!r}: {_NOT_FLOAT}")
    raise TypeError(f"user_ids[{i}] is a {type(value).__name__}: user labels are integers or strings (Python, numpy "
                    f"or 0-d tensor integers are the same user when equal)")


def _user_index(user_ids: object) -> tuple[torch.Tensor, int]:
    """Each example's user as ``0 .. U-1`` (first appearance order), and ``U``: labels are compared by value, so
    ``3``, ``numpy.int64(3)`` and ``torch.tensor(3)`` are one user.  ``TypeError`` for labels that are neither all
    integers nor all strings; ``ValueError`` for a tensor or array that is not 1-D."""
    labels = [_label(v, i) for i, v in enumerate(_user_labels(user_ids))]
    kinds = {type(v) for v in labels}
    if len(kinds) > 1:
        first = {t: next(i for i, v in enumerate(labels) if type(v) is t) for t in kinds}
        raise TypeError(f"user_ids mixes integer and string labels (user_ids[{first[int]}] = {labels[first[int]]!r}, "
                        f"user_ids[{first[str]}] = {labels[first[str]]!r}): is 3 the user '3'? Give one kind")
    index: dict[int | str, int] = {}
    users = [index.setdefault(label, len(index)) for label in labels]
    return torch.tensor(users, dtype=torch.long), len(index)


def user_level(privacy_unit: object, user_ids: object, max_examples_per_user: object) -> UserLevel | None:
    """``make_private``'s user-level arguments checked before anything is built: a :class:`UserLevel` for
    ``privacy_unit="user"``, ``None`` for ``"example"``; ``ValueError`` naming the argument otherwise
    (``TypeError`` for ``user_ids`` that are not integer or string labels, see :func:`_user_index`).  What
    user-level privacy cannot be combined with is refused with the rest of the run's choices
    (:data:`dpsgd.accounting.REFUSED`).

    Examples
    --------
    >>> from dpsgd.users import user_level
    >>> u = user_level("user", ["ann", "bob", "ann"], 2)
    >>> u.users.tolist(), u.num_users, u.settings()
    ([0, 1, 0], 2, {'privacy_unit': 'user', 'max_examples_per_user': 2})
    >>> import torch
    >>> user_level("user", list(torch.tensor([7, 8, 7])), None).num_users
    2
    >>> user_level("example", [0, 1], None)
    Traceback (most recent call last):
    ...
    ValueError: user_ids is given but privacy_unit='example': ...
    """
    if privacy_unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy_unit must be one of {list(PRIVACY_UNITS)}, got {privacy_unit!r}")
    if privacy_unit == "example":
        if user_ids is not None or max_examples_per_user is not None:
            raise ValueError(f"{'user_ids' if user_ids is not None else 'max_examples_per_user'} is given but "
                             f"privacy_unit='example': pass privacy_unit='user' for an epsilon per user")
        return None
    if user_ids is None:
        raise ValueError("privacy_unit='user' needs user_ids: one user label per example of the dataset")
    if max_examples_per_user is not None and (isinstance(max_examples_per_user, bool)
                                              or not isinstance(max_examples_per_user, int)
                                              or max_examples_per_user < 1):
        raise ValueError(f"max_examples_per_user must be a positive integer or None, got {max_examples_per_user!r}")
    users, num_users = _user_index(user_ids)
    return UserLevel(users, num_users, max_examples_per_user)


class UserBatch(list):
    """A logical batch of dataset indices, user after user (``sizes[j]`` rows of the ``j``-th drawn user)."""

    def __init__(self, indices: list[int], sizes: list[int]) -> None:
        super().__init__(indices)
        self.sizes = sizes

    def split_rows(self, max_size: int | None, chunks: int | None
                   ) -> Iterator[tuple[list[int], torch.Tensor, bool]]:
        """``(indices, groups, last)`` of each physical piece, every piece made of whole users: ``groups[i]`` is
        row ``i``'s user numbered within the piece, ``last`` whether the piece ends the logical batch.

        ``chunks``: exactly that many pieces (users spread evenly, some pieces possibly empty), each ending a
        step's share, as :meth:`dpsgd.data.DPDataLoader.in_chunks` does for examples.  ``max_size``: pieces of
        at most that many rows; a user with more rows raises ``ValueError``.  Neither: the whole batch.

        Examples
        --------
        >>> from dpsgd.users import UserBatch
        >>> b = UserBatch([7, 8, 3, 5, 6], [2, 1, 2])
        >>> [(i, g.tolist(), last) for i, g, last in b.split_rows(3, None)]
        [([7, 8, 3], [0, 0, 1], False), ([5, 6], [0, 0], True)]
        """
        starts = [0]
        for s in self.sizes:
            starts.append(starts[-1] + s)

        def piece(first: int, stop: int) -> tuple[list[int], torch.Tensor]:   # users first .. stop-1
            groups = torch.repeat_interleave(torch.arange(stop - first), torch.tensor(self.sizes[first:stop],
                                                                                      dtype=torch.long))
            return list(self[starts[first]:starts[stop]]), groups

        u = len(self.sizes)
        if chunks:
            for j in range(chunks):
                yield (*piece(j * u // chunks, (j + 1) * u // chunks), True)
            return
        if max_size is None or not u:
            yield (*piece(0, u), True)
            return
        if max(self.sizes) > max_size:
            raise ValueError(_too_large(max(self.sizes), max_size))
        first = 0
        for j in range(1, u + 1):
            if j == u or starts[j + 1] - starts[first] > max_size:
                yield (*piece(first, j), j == u)
                first = j


def _too_large(rows: int, max_size: int) -> str:
    return (f"a user with {rows} examples does not fit a physical batch of max_physical_batch_size={max_size}: a "
            f"user's examples are clipped together, so they must be in one physical batch. Raise "
            f"max_physical_batch_size, or cap each user's examples with make_private(max_examples_per_user=...)")


class UserPoissonSampler(Sampler[list[int]]):
    r"""Logical batches of users: each of ``U`` users joins independently with probability ``q``, and brings all
    its examples (or a uniformly random ``max_examples_per_user`` of them) as consecutive rows.

    Parameters
    ----------
    users : torch.Tensor
        Each example's user as ``0 .. U-1``.
    sample_rate : float
        ``q`` in ``(0, 1]``, the rate per user.
    max_examples_per_user : int, optional
        Cap on a drawn user's examples (a uniformly random subset, drawn from ``generator``).
    steps : int, optional
        Batches per epoch (default ``round(1/q)``, every user once in expectation).
    generator : torch.Generator, optional
        Source of the sampling.

    Examples
    --------
    >>> import torch
    >>> from dpsgd.users import UserPoissonSampler
    >>> s = UserPoissonSampler(torch.tensor([0, 0, 0, 1, 2, 2]), 0.5, max_examples_per_user=2,
    ...                        generator=torch.Generator().manual_seed(0))
    >>> len(s), all(max(b.sizes, default=0) <= 2 for b in s)
    (2, True)
    """

    def __init__(self, users: torch.Tensor, sample_rate: float, *, max_examples_per_user: int | None = None,
                 steps: int | None = None, generator: torch.Generator | None = None) -> None:
        q = float(sample_rate)
        if not 0 < q <= 1:
            raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate!r}")
        order = torch.argsort(users, stable=True)
        counts = torch.bincount(users)
        self.members = list(torch.split(order, counts.tolist()))   # each user's dataset indices, ascending
        self.max_examples_per_user = max_examples_per_user
        self._q = q
        self.steps = max(1, round(1 / q)) if steps is None else int(steps)
        self.generator = generator

    @property
    def sample_rate(self) -> float:
        """``q`` per user, read-only: the accountant charges the rate the sampler was made with."""
        return self._q

    @property
    def num_users(self) -> int:
        return len(self.members)

    @property
    def largest_user(self) -> int:
        """The most rows one drawn user can bring (its examples, or the cap)."""
        most = max(len(m) for m in self.members)
        return most if self.max_examples_per_user is None else min(most, self.max_examples_per_user)

    def check_physical_batch_size(self, max_size: int) -> None:
        """``ValueError`` if a drawn user could have more rows than a physical batch of ``max_size``."""
        if self.largest_user > max_size:
            raise ValueError(_too_large(self.largest_user, max_size))

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[UserBatch]:
        cap = self.max_examples_per_user
        for _ in range(self.steps):
            drawn = (torch.rand(len(self.members), generator=self.generator) < self._q).nonzero().flatten()
            indices, sizes = [], []
            for u in drawn.tolist():
                rows = self.members[u]
                if cap is not None and len(rows) > cap:
                    keep = torch.randperm(len(rows), generator=self.generator)[:cap]
                    rows = rows[keep.sort().values]
                indices.extend(rows.tolist())
                sizes.append(len(rows))
            yield UserBatch(indices, sizes)


class UserRows:
    """The engine's record of which user each row of the drawn physical batch belongs to: each chunk the private
    loader yields is given to exactly one backward, whole (so the rows the engine groups are the rows the loader
    drew, never a regrouping of another batch's rows)."""

    def __init__(self) -> None:
        self._groups: torch.Tensor | None = None

    def drawn(self, groups: torch.Tensor | None) -> None:
        """A chunk was yielded with these ``groups``."""
        if groups is None:
            raise RuntimeError("a batch without its users reached a user-level engine: batches must come from the "
                               "loader make_private(privacy_unit='user') returned")
        if not groups.numel():   # an empty piece of a fixed number of chunks: nothing to backpropagate
            return
        if self._groups is not None:
            raise RuntimeError("a batch was drawn from the user-level loader before the previous one was "
                               "backpropagated: each physical batch (whole users) must be backpropagated by one "
                               "backward before the next is drawn, so that every row is clipped with its own user")
        self._groups = groups

    def take(self, losses: torch.Tensor) -> torch.Tensor:
        """The drawn chunk's groups for a backward of these per-example ``losses`` (``RuntimeError`` unless they
        are its rows, one loss each)."""
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
            raise ValueError("the per-example losses must be a 1-D tensor (one loss per row)")
        rows = losses.shape[0]
        if self._groups is None and rows == 0:
            return torch.zeros(0, dtype=torch.long)
        if self._groups is None:
            raise RuntimeError("a private backward without a batch drawn from the user-level loader since the last "
                               "backward: each backward must be of one physical batch the loader yielded")
        if rows != self._groups.shape[0]:
            raise RuntimeError(f"{rows} per-example losses were backpropagated for a batch of "
                               f"{self._groups.shape[0]} rows: with privacy_unit='user' each backward must be of one "
                               f"whole physical batch, one loss per row, so that each user's rows are clipped "
                               f"together")
        groups, self._groups = self._groups, None
        return groups

    def clear(self) -> None:
        """The step was taken (or dropped): no chunk is pending."""
        self._groups = None


def _check_collate(collate_fn: object) -> None:
    """:class:`~dpsgd.data.RowOrderError` at once for a Hugging Face collator known to pad each call to its longest
    row (every one with a tokenizer, unless ``padding="max_length"``): users collated apart could not be joined, and
    the loader would refuse the first batch of two users of different lengths.  Other collate functions are
    checked on each batch as its users are joined."""
    if isinstance(collate_fn, KeepsRowOrder) or not (getattr(collate_fn, "__module__", None) or "").startswith(
            "transformers") or not hasattr(collate_fn, "tokenizer"):
        return
    padding = getattr(collate_fn, "padding", None)
    if padding == "max_length":   # a str enum in transformers: every call padded to one length
        return
    name = type(collate_fn).__name__
    raise RowOrderError(
        f"data_loader's collate_fn ({name}) pads each call to its longest row, so the private loader, which collates "
        f"each user's examples by a call of their own and joins the calls user after user (so that the engine "
        f"clips each user's rows together whatever order collate_fn returns the rows in), could not join users of "
        f"different lengths. Pad to a fixed length ({name}(tokenizer, padding='max_length', max_length=L), where "
        f"the collator takes padding); or, as {name} keeps the rows in the order it is given, declare it: "
        f"DataLoader(dataset, batch_size=B, collate_fn=dpsgd.data.KeepsRowOrder(collator)), and each batch is "
        f"collated by one call")


def user_data_loader(data_loader: DataLoader, users: UserLevel, *, generator: torch.Generator | None = None,
                     on_batch=None, on_empty=None) -> DPDataLoader:
    r"""The same dataset and collate function, batched by Poisson sampling of users at ``q_u = batch_size / U``.

    Parameters
    ----------
    data_loader : torch.utils.data.DataLoader
        As for :func:`dpsgd.data.private_data_loader`; ``batch_size`` is the expected number of users per batch.
    users : UserLevel
        From :func:`user_level`; ``users.users`` must have one entry per example of the dataset.
    generator, on_batch, on_empty
        As for :func:`dpsgd.data.private_data_loader`.

    Returns
    -------
    DPDataLoader
        Its ``sample_rate`` is ``q_u``; it collates each user's examples by a call of ``collate_fn`` of their own
        (once per chunk for a :class:`~dpsgd.data.KeepsRowOrder` collate function).

    Raises
    ------
    dpsgd.data.RowOrderError
        For a Hugging Face collator that pads each call to its longest row (users collated apart could not be
        joined), unless declared with :class:`~dpsgd.data.KeepsRowOrder`.
    ValueError
        For ``user_ids`` of the wrong length, or a ``batch_size`` above the number of users.

    Examples
    --------
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from dpsgd.users import user_data_loader, user_level
    >>> users = user_level("user", [i // 4 for i in range(40)], None)
    >>> loader = user_data_loader(DataLoader(TensorDataset(torch.arange(40.0)), batch_size=2), users)
    >>> loader.sample_rate, len(loader)
    (0.2, 5)
    """
    n, batch = loader_size(data_loader)
    if users.users.shape[0] != n:
        raise ValueError(f"user_ids has {users.users.shape[0]} labels but the dataset has {n} examples: give one "
                         f"user label per example")
    if batch > users.num_users:
        raise ValueError(f"data_loader's batch_size ({batch}), the expected number of users per batch, exceeds the "
                         f"{users.num_users} users: the user sampling rate q = batch_size / users must be at most 1")
    _check_collate(data_loader.collate_fn)
    sampler = UserPoissonSampler(users.users, batch / users.num_users,
                                 max_examples_per_user=users.max_examples_per_user, generator=generator)
    return DPDataLoader(data_loader.dataset, sampler, data_loader.collate_fn, sample_rate=sampler.sample_rate,
                        on_batch=on_batch, on_empty=on_empty, num_workers=data_loader.num_workers,
                        pin_memory=data_loader.pin_memory)

r"""Example isolation by structure: which examples every tensor of a private step was computed from.

Handlers read row ``i`` of a recorded call as example ``i``, and the clipped sum is bounded by ``C`` only if
example ``i``'s loss is a function of example ``i``'s data and the parameters alone.  This module proves that
for the step being taken, on every step, from the operations that actually ran: an
:class:`ExampleTracker` (a ``TorchDispatchMode``) is active from the moment the private loader yields a batch
until its private backward.  Every tensor of the batch (in a dict, a list, kwargs, wherever it goes) is
registered with the examples its rows belong to, and every ATen operation that reads a registered tensor
registers its outputs by a rule that follows the operation's semantics (:mod:`dpsgd.rules`):

* an element-wise operation keeps the example axis where broadcasting puts it;
* a view, reshape, permutation, slice, concatenation or index maps the axis (and its example ids) to
  the output's dimension that carries it (flattening ``(B, T)`` to ``B T`` rows keeps one id per row);
* a reduction, scan, sort or softmax over the example axis, a matrix product that contracts it, attention
  whose keys carry other examples, and every operation without a rule mark the output **mixed**;
* data from an earlier batch (state kept on an attribute, a buffer, a closure) carries other example ids,
  so combining it with this batch is mixing too; writing example data into a parameter or buffer of the
  model in place is refused at once.

This follows data through ``torch.no_grad()``, ``detach()``, integer operations (token ids, routing
indices), submodule calls and the user's own code between the loader and the loss, because it sees
operations, not modules or gradients.  Nothing is sampled: there is no miss probability.  A mixed tensor
is allowed to exist (Hugging Face checks ``attention_mask.all()`` to pick an attention kernel); it is
refused where it matters: as a per-example loss, as an input or output of a recorded module call, or as
state written by the forward (:class:`ExampleMixingError` naming the first operation that mixed).

What it cannot see is host data: a value taken out of a tensor into Python (``.item()``, ``.tolist()``,
``.numpy()``, ``bool()``) and used to build a new tensor or to branch (Hugging Face checks
``attention_mask.all()`` to pick an attention kernel; a loop logs ``losses.mean().item()``).  Such reads are
recorded (``ExampleTracker.host_reads``); that none of them feeds back into the losses is what
:func:`audit_isolation` checks: each example's loss in the batch must equal its loss computed alone.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from .rows import (
    INPLACE_TAG,
    Rows,
    inplace_rule,
    local_scalar_rule,
    merge_axes,
    mixed_rows,
    op_name,
    pointwise_rule,
    same_examples,
)
from .rules import RULES

__all__ = ["ExampleMixingError", "ExampleTracker", "IncompleteGradientError", "StateChangedError",
           "audit_isolation", "call_examples", "check_backward_functions"]

aten = torch.ops.aten


class IncompleteGradientError(RuntimeError):
    """A parameter received gradient that the per-example norms did not count; the step was not taken."""


class ExampleMixingError(IncompleteGradientError):
    """One example's loss, or a recorded module call, depends on another example's data (a batch statistic,
    softmax or attention over the batch, a loss that reads other rows, state kept from an earlier batch):
    adding one example would move the others' clipped contributions, so no bound by ``C`` holds.  The step
    was not taken."""


class StateChangedError(RuntimeError):
    """A parameter or buffer changed during a training forward (running statistics, ``Embedding(max_norm)``'s
    renormalization, example data written in place): the model would carry un-noised information about the
    batch."""


#: the attribute under which a tensor carries its Rows: on the tensor itself, so that it lives exactly as long
#: as the data (state kept between steps keeps its batch's ids) and costs one attribute read per operation
_ATTR = "_dpsgd_rows"

#: per operation: (name, rule, positions and names of the arguments it writes)
_META: dict = {}


def _op_meta(func) -> tuple:
    name = func.overloadpacket.__name__
    rule = RULES.get(name)
    if rule is None and torch.Tag.pointwise in func.tags:
        rule = inplace_rule if INPLACE_TAG in func.tags or name.endswith("_") else pointwise_rule
    if name in ("is_nonzero", "item"):
        rule = local_scalar_rule
    mutated = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
    return name, rule, mutated


#: one tensor per distinct list of example ids (by content), so that rows are compared by identity and the
#: reshape rules' cache hits across layers; ids of earlier batches are dropped as the table fills
_CANONICAL: dict[bytes, torch.Tensor] = {}
_KNOWN: dict[int, torch.Tensor] = {}


def _canonical(ids: torch.Tensor) -> torch.Tensor:
    if id(ids) in _KNOWN:
        return ids
    key = ids.numpy().tobytes()
    canon = _CANONICAL.get(key)
    if canon is None:
        if len(_CANONICAL) > 4096:
            _CANONICAL.clear()
            _KNOWN.clear()
        canon = _CANONICAL[key] = ids
        _KNOWN[id(ids)] = ids
    return canon


def _storage(t: torch.Tensor) -> int | None:
    """Where ``t``'s data lives, or ``None`` for an empty tensor or one without readable storage (an FSDP shard
    that was freed, a tensor subclass)."""
    if not t.numel():
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _view_rows(t: torch.Tensor) -> Rows | None:
    """Rows of a view taken while no tracker was active (a micro-batch sliced from the batch between two
    backwards): rows of the base along dimension 0 when the view is a slice of them, mixed for any other view of
    example data (its layout is not followed)."""
    base = t._base
    r = getattr(base, _ATTR, None)
    if r is None:
        return None
    if r.mixed:
        return r
    ids = r.axis(0)
    if ids is not None and len(r.axes) == 1 and t.dim() == base.dim() and t.shape[1:] == base.shape[1:] \
            and t.stride() == base.stride() and base.stride(0) > 0:
        offset = t.storage_offset() - base.storage_offset()
        if offset % base.stride(0) == 0:
            start = offset // base.stride(0)
            rows = Rows(((0, ids[start:start + t.shape[0]]),))
            _set(t, rows)
            return getattr(t, _ATTR)
    return mixed_rows("a view of example data taken outside the tracked step")


def _set(t: torch.Tensor, r: Rows) -> None:
    """Record ``r`` on ``t``."""
    if not r.axes and not r.mixed:
        if getattr(t, _ATTR, None) is not None:
            setattr(t, _ATTR, None)
        return
    if r.axes and any(id(ids) not in _KNOWN for _, ids in r.axes):
        r = Rows(tuple((d, _canonical(ids)) for d, ids in r.axes), r.mixed)
    setattr(t, _ATTR, r)


def _write(t: torch.Tensor, r: Rows) -> None:
    """Record ``r`` on ``t``, written in place: example data written through a view reaches its base (and so
    every other view of it).  The base's dimension that the view's example axis runs along (same stride, same
    extent) becomes an example axis of the base; any other layout marks the base mixed."""
    _set(t, r)
    base = t._base
    if base is None or not (r.axes or r.mixed):
        return
    old = getattr(base, _ATTR, None) or Rows()
    if old.mixed:
        return
    if r.mixed:
        setattr(base, _ATTR, r)
        return
    parts = list(old.axes)
    for d, ids in r.axes:
        match = [e for e in range(base.dim()) if base.stride(e) == t.stride(d) and base.shape[e] == t.shape[d]]
        if len(match) != 1:
            setattr(base, _ATTR, mixed_rows("example data written into a view of another tensor"))
            return
        parts.append((match[0], ids))
    _set(base, merge_axes(parts, "example data of other examples written into a view of a tensor"))


class ExampleTracker(TorchDispatchMode):
    """Follows every tensor computed from registered example data through the ATen operations that run.

    Parameters
    ----------
    state : callable, optional
        Returns the named tensors that outlive a step (the model's parameters and buffers); writing example
        data into one of them in place raises :class:`StateChangedError` at once, naming it.

    Examples
    --------
    >>> import torch
    >>> tracker = ExampleTracker()
    >>> x = torch.randn(4, 3)
    >>> with tracker:
    ...     ids = tracker.register(x)
    ...     per_example = (x * 2).sum(1)
    ...     batch_wide = x - x.mean(0)
    >>> torch.equal(tracker.rows(per_example).axis(0), ids)   # row i is example i's alone
    True
    >>> tracker.rows(batch_wide).mixed
    'aten.mean reduces over the examples'
    """

    _counter = itertools.count()

    def __init__(self, state: Callable[[], dict[str, torch.Tensor]] | None = None) -> None:
        super().__init__()
        self._state = state
        self._state_ids: dict[int, str] | None = None
        self.unknown: set[str] = set()
        self.host_reads: list[str] = []
        #: set when the tracker refused an operation: the step is over, and the tracker stays inert until popped
        self.failed = False
        #: hold refusals until the backward instead of raising inside the forward (ranks under FSDP2 must refuse
        #: together, at the same collective); the first one held
        self.defer = False
        self.deferred: Exception | None = None
        self._paused = False

    # -- activation across calls (the engine's loader yields, the private backward ends) -------------------------
    @property
    def active(self) -> bool:
        """Whether this tracker is on the dispatch-mode stack."""
        n = torch._C._len_torch_dispatch_stack()
        return any(torch._C._get_dispatch_stack_at(i) is self for i in range(n))

    def push(self) -> None:
        """Make the tracker active until :meth:`pop` (``with tracker:`` for a block).  A tracker left active by a
        step that raised (the user caught the error and went on) is popped first: only one follows a step."""
        n = torch._C._len_torch_dispatch_stack()
        while n and isinstance(torch._C._get_dispatch_stack_at(n - 1), ExampleTracker) \
                and torch._C._get_dispatch_stack_at(n - 1) is not self:
            stale = torch._C._get_dispatch_stack_at(n - 1)
            stale.failed = True
            stale.__exit__(None, None, None)
            n = torch._C._len_torch_dispatch_stack()
        self.failed = False
        self.deferred = None
        self.__enter__()

    def refuse(self, error: Exception) -> None:
        """Raise ``error``, or hold it for the backward when :attr:`defer` is set (then the tracker is inert)."""
        if self.defer:
            self.failed = True
            if self.deferred is None:
                self.deferred = error
            return
        raise error

    def abandon(self) -> None:
        """Stop checking after a refusal: inert from now on.  It stays on the stack (a refusal raised inside the
        user's forward, perhaps inside a compiled region, is no place to change the mode stack) until the engine
        pops it: at the next batch drawn, step or detach, or the next tracker's :meth:`push`."""
        self.failed = True

    def pop(self) -> None:
        """Deactivate the tracker (nothing when it is not active).  What it followed is kept while those tensors
        live: example data kept between steps (an attribute, a closure) still carries its batch's example ids.

        Raises ``RuntimeError`` when another dispatch mode entered after it is still active: popping would
        remove that one instead."""
        n = torch._C._len_torch_dispatch_stack()
        if not self.active:
            return
        if torch._C._get_dispatch_stack_at(n - 1) is not self:
            raise RuntimeError("a TorchDispatchMode entered during the private step is still active at its "
                               "backward; exit it before the backward")
        self.__exit__(None, None, None)

    @contextlib.contextmanager
    def suspended(self):
        """A block of the engine's own bookkeeping that the step's losses never read (the mean loss it reports
        for logging): its operations are not followed, and their results are data of no example."""
        old, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = old

    # -- registration and queries -------------------------------------------------------------------------------
    def register(self, batch: object, dim: int = 0) -> torch.Tensor | None:
        """Register every tensor in ``batch`` (nested dicts, lists, tuples, mappings) as example rows along
        ``dim``: row ``i`` of each is example ``i`` of a new batch.  Returns the example ids (distinct from every
        earlier batch's)."""
        tensors = [t for t in _tensors(batch) if t.dim() > dim]
        if not tensors:
            return None
        b = tensors[0].shape[dim]
        self._state_ids = None   # parameters may have moved (FSDP gathers, a new device)
        start = next(self._counter) << 32
        ids = torch.arange(start, start + b, dtype=torch.long)
        self._batch_ids = ids
        for t in tensors:
            if t.shape[dim] == b:
                _set(t, Rows(((dim, ids),)))
            else:
                _set(t, mixed_rows(f"a tensor of the batch with {t.shape[dim]} rows for {b} examples"))
        return ids

    def rows(self, t: torch.Tensor) -> Rows:
        """The examples ``t`` was computed from (``Rows()`` for data of no example: parameters, constants)."""
        r = getattr(t, _ATTR, None)
        if r is None and t._base is not None:
            r = _view_rows(t)
        return r or Rows()

    def check_rows(self, t: torch.Tensor, ids: torch.Tensor, what: str) -> torch.Tensor:
        """Raise :class:`ExampleMixingError` unless each row of ``t`` along dimension 0 is computed from one
        example of ``ids`` alone, every row from another example; returns the examples of the rows.  (A
        micro-batch cut from the batch by hand holds some of its examples.)  ``what`` names ``t``."""
        r = self.rows(t)
        if r.mixed:
            raise ExampleMixingError(f"{what} depend on rows of other examples: {r.mixed}. Each example's loss must "
                                     f"be a function of its own data and the parameters only, or one example could "
                                     f"move the update by more than max_grad_norm")
        if any(a != 0 for a, _ in r.axes):
            raise ExampleMixingError(f"{what} pair examples along another dimension than their rows")
        got = r.axis(0)
        if got is None:
            raise ExampleMixingError(f"{what} were not computed from a batch of the private data loader (its "
                                     f"batches are followed from the moment it yields them): a batch made by hand "
                                     f"is not charged by the accountant")
        if got.numel() != torch.unique(got).numel() or not bool(torch.isin(got, ids).all()):
            raise ExampleMixingError(f"{what} are not one row per example of the batch drawn (rows repeated, or from "
                                     f"another batch)")
        return got

    # -- the mode -----------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        if self.failed or self._paused:   # refused already (inert until popped), or the engine's own bookkeeping
            return out
        # the fast path: most operations of a forward read a tracked tensor, but finding none must cost little
        rows = []
        for a in args:
            if isinstance(a, torch.Tensor):
                r = getattr(a, _ATTR, None)
                if r is None and a._base is not None:
                    r = _view_rows(a)
                if r is not None:
                    rows.append((a, r))
            elif isinstance(a, (list, tuple)):
                for x in a:
                    if isinstance(x, torch.Tensor):
                        r = getattr(x, _ATTR, None)
                        if r is not None:
                            rows.append((x, r))
        if kwargs:
            for x in kwargs.values():
                if isinstance(x, torch.Tensor):
                    r = getattr(x, _ATTR, None)
                    if r is not None:
                        rows.append((x, r))
        if not rows:
            return out
        meta = _META.get(func)
        if meta is None:
            meta = _META[func] = _op_meta(func)
        name, rule, mutated_at = meta
        if rule is local_scalar_rule:
            self._host_read(rows)
            return out
        if isinstance(out, torch.Tensor):
            outs = [out]
        elif isinstance(out, (list, tuple)):
            outs = [o for o in out if isinstance(o, torch.Tensor)]
        else:
            outs = []
        if rule is None:
            self.unknown.add(name)
            results = [mixed_rows(f"aten.{name} (no isolation rule: treated as mixing)")] * len(outs)
        else:
            try:
                results = rule(func, args, kwargs or {}, out, rows)
            except Exception as e:   # a rule that cannot read its arguments: conservative
                results = [mixed_rows(f"aten.{name} (its isolation rule failed: {type(e).__name__}: {e})")] * len(outs)
        for o, r in zip(outs, results, strict=False):
            _set(o, r)
        if mutated_at:
            mutated = [args[i] if i < len(args) else (kwargs or {}).get(n) for i, n in mutated_at]
            for t in mutated:
                if isinstance(t, torch.Tensor):
                    before = next((r for src, r in rows if src is t), None)
                    after = getattr(t, _ATTR, None) if outs and t is outs[0] else \
                        (results[0] if results else mixed_rows(f"aten.{name}"))
                    if after is before:
                        # rows unchanged (a constant written, an operation within each row): nothing new
                        # reaches the base
                        continue
                    _write(t, after or Rows())
                    self._guard_state(t, func)
        return out

    def _guard_state(self, t: torch.Tensor, func) -> None:
        r = getattr(t, _ATTR, None)
        if r is None or not (r.axes or r.mixed):
            return
        if self._state is None:
            return
        if self._state_ids is None:
            self._state_ids = {p: n for n, s in self._state().items() if (p := _storage(s)) is not None}
        p = _storage(t)
        name = None if p is None else self._state_ids.get(p)
        if name is not None:
            self.failed = True
            self.refuse(StateChangedError(f"{name} changed during a training forward ({op_name(func)} wrote example "
                                    f"data into it in place), so the model would carry un-noised information about the "
                                    f"batch into later steps. Private training here offers no privatized running "
                                    f"statistics: remove the update, or freeze the statistics before training"))

    def _host_read(self, rows) -> None:
        """A value of example data read into Python (``.item()``, ``.tolist()``, ``bool()``): the tracker cannot
        follow it from there.  Recorded in ``host_reads``; whether such a value feeds back into the losses is
        what :func:`audit_isolation` checks."""
        for _, r in rows:
            self.host_reads.append(r.mixed or "a per-example value")
            if len(self.host_reads) > 64:
                del self.host_reads[:32]


#: custom autograd Functions whose backward is the true gradient of their forward (torch's own, and dpsgd's)
TRUSTED_FUNCTION_MODULES = ("torch.", "dpsgd.")


def check_backward_functions(losses: torch.Tensor) -> None:
    """Refuse a custom ``torch.autograd.Function`` between the losses and anything that trains: its backward
    runs code the tracker never saw (it may normalize over the batch), so the per-example gradients it
    returns need not be those of the forward that was checked.  Functions defined in ``torch`` and
    ``dpsgd`` are trusted."""
    seen: set = set()
    stack = [losses.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and not cls.__module__.startswith(TRUSTED_FUNCTION_MODULES):
            raise ExampleMixingError(
                f"the losses were computed through the custom autograd.Function {cls.__module__}."
                f"{cls.__qualname__}, whose backward the isolation check cannot see: it could mix examples in the "
                f"gradient (normalize over the batch) while its forward keeps them apart. Write it with "
                f"differentiable torch operations")
        stack.extend(n for n, _ in node.next_functions)


def call_examples(tracker: ExampleTracker, where: str, tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The examples of a recorded module call's rows: ``None`` when no tensor of the call holds example data
    (positions, a bias table); else every tensor that does must hold one example per row (or per block of
    rows: ``(B T, d)``), the same examples in the same order, along its first dimension (or, for a
    sequence-first layout such as ``nn.LSTM``'s, one other dimension).  Raises :class:`ExampleMixingError`
    otherwise (the tracker is then abandoned: the step is over)."""
    try:
        return _call_examples(tracker, where, tensors)
    except ExampleMixingError as e:
        tracker.abandon()
        tracker.refuse(e)
        return None


_EXAMPLES: dict[int, tuple] = {}


def _per_example(ids: torch.Tensor) -> torch.Tensor | None:
    """``ids`` as consecutive equal blocks of one size, one block per example: the examples; else ``None``."""
    hit = _EXAMPLES.get(id(ids))
    if hit is not None and hit[0] is ids:
        return hit[1]
    seq, counts = torch.unique_consecutive(ids, return_counts=True)
    ok = counts.numel() and bool((counts == counts[0]).all()) and seq.numel() == torch.unique(seq).numel()
    result = seq if ok else None
    if len(_EXAMPLES) > 4096:
        _EXAMPLES.clear()
    _EXAMPLES[id(ids)] = (ids, result)
    return result


def _call_examples(tracker: ExampleTracker, where: str, tensors: list[torch.Tensor]) -> torch.Tensor | None:
    found = None
    for t in tensors:
        r = tracker.rows(t)
        if r.mixed:
            raise ExampleMixingError(f"the inputs or outputs of {where} depend on rows of other examples: {r.mixed}. "
                                     f"Its per-example gradients would mix examples, and one example could move the "
                                     f"update by more than max_grad_norm")
        if not r.axes:
            continue
        every = torch.cat([ids for _, ids in r.axes])
        if every.numel() and bool((every == every[0]).all()):
            # wholly one example's, whatever its layout (a batch of one, its rows merged with time steps or heads)
            examples = every[:1]
        elif len(r.axes) > 1:
            raise ExampleMixingError(f"{where} pairs rows of different examples (two example dimensions)")
        else:
            dim, ids = r.axes[0]
            examples = _per_example(ids) if dim == 0 else (ids if ids.numel() == torch.unique(ids).numel() else None)
        if examples is None or (found is not None and not same_examples(examples, found)):
            raise ExampleMixingError(f"{where} runs on rows that are not examples in order (a permuted, gathered or "
                                     f"transposed batch): its rows cannot be attributed to examples")
        found = examples
    return found


def _tensors(batch: object) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(x):
        if isinstance(x, torch.Tensor):
            if id(x) not in seen:
                seen.add(id(x))
                out.append(x)
        elif isinstance(x, dict) or hasattr(x, "items") and hasattr(x, "keys"):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif hasattr(x, "__dataclass_fields__"):
            for f in x.__dataclass_fields__:
                walk(getattr(x, f))
    walk(batch)
    return out


def audit_isolation(model: torch.nn.Module, batch: object, losses: Callable[[torch.nn.Module, object], torch.Tensor],
                    atol: float = 0.0, collate_fn: Callable[[list], object] | None = None) -> None:
    """Check that each example's loss is the loss of that example computed alone.

    Runs ``losses(model, batch)`` on the whole batch (under an :class:`ExampleTracker`, which refuses mixing
    of tensor data), then once per example on a batch of that example alone, and compares: a code path chosen
    by a batch-wide condition (``mask.all()``), or a value read into Python and used for every example, shows
    as a difference.  With ``collate_fn``, ``batch`` is a list of raw examples, collated together and one by
    one: this checks the collation too (rows padded to the batch's longest example whose pads reach the loss).
    Dropout must be off (``model.eval()``) for the comparison to be meaningful.

    Parameters
    ----------
    model : torch.nn.Module
        The model, usually in ``eval()`` mode for this check.
    batch : object
        A batch as the private loader yields it (tensors with the examples along dimension 0, in dicts or
        lists), or with ``collate_fn`` a list of examples as the data set holds them.
    losses : callable
        ``losses(model, batch) -> (B,)`` per-example losses.
    atol : float
        Allowed absolute difference (kernels chosen by batch size round differently; default exact).
    collate_fn : callable, optional
        The loader's ``collate_fn``.

    Raises
    ------
    ExampleMixingError
        If a loss depends on other examples, with the first mixing operation or the example that differs.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Linear(3, 1).eval()
    >>> audit_isolation(model, torch.randn(4, 3), lambda m, x: m(x).squeeze(1), atol=1e-6)
    """
    examples = list(batch) if collate_fn is not None else None
    whole_batch = collate_fn(examples) if collate_fn is not None else batch
    tracker = ExampleTracker()
    with torch.no_grad():
        with tracker:
            ids = tracker.register(whole_batch)
            whole = losses(model, whole_batch)
        if ids is None:
            raise ValueError("batch holds no tensor with the examples along its first dimension")
        tracker.check_rows(whole, ids, "the per-example losses")
        b = ids.numel()
        for i in range(b):
            if collate_fn is not None:
                one = collate_fn([examples[i]])
            else:
                one = tree_map_only(torch.Tensor, lambda t, i=i: t[i:i + 1] if t.dim() and t.shape[0] == b else t,
                                    batch)
            alone = losses(model, one).reshape(-1)
            diff = float((alone[0] - whole[i]).abs())
            if not diff <= atol:
                raise ExampleMixingError(f"example {i}'s loss is {float(whole[i])!r} in the batch and "
                                         f"{float(alone[0])!r} alone (difference {diff:.3g} > atol {atol}): the "
                                         f"forward (or the collation) takes another path for it depending on the "
                                         f"other examples")

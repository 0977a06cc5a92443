r"""Which examples a tensor's elements were computed from (:class:`Rows`), and what the rules of
:data:`dpsgd.rules.RULES` share: combining the axes of several inputs (:func:`merge_axes`), following a reshape
(:func:`reshaped`), and the rules of element-wise operations (:func:`pointwise_rule`, :func:`inplace_rule`).

:class:`Rows` holds pairs of a dimension and the example id of each index along it, or the first operation after
which some element depends on several examples (*mixed*).  The isolation tracker
(:class:`dpsgd.isolation.ExampleTracker`) carries one per tensor of the batch; the rules
(:mod:`dpsgd.layout_rules`, :mod:`dpsgd.mixing_rules`) compute the outputs' from the inputs'.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["Rows", "mixed_rows", "same_examples", "merge_axes", "norm_dim", "dims_arg", "reshaped", "op_name",
           "pointwise_rule", "inplace_rule", "local_scalar_rule", "INPLACE_TAG"]


class Rows(NamedTuple):
    """The examples a tensor's elements were computed from.

    ``axes`` pairs a dimension with the example id of each index along it (a CPU ``int64`` tensor); an
    element depends on the examples of its indices along the axes and on nothing else of the batch.
    ``mixed`` names the first operation after which some element depends on several examples (then
    ``axes`` is empty).
    """

    axes: tuple[tuple[int, torch.Tensor], ...] = ()
    mixed: str | None = None

    def axis(self, dim: int) -> torch.Tensor | None:
        for d, ids in self.axes:
            if d == dim:
                return ids
        return None


def mixed_rows(why: str) -> Rows:
    return Rows((), why)


def same_examples(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and bool(torch.equal(a, b)))


def merge_axes(parts: list[tuple[int, torch.Tensor]], why: str) -> Rows:
    """Axes gathered from several inputs, keyed by output dimension: the same dimension must carry the same
    examples in the same order, or the output combines rows of different examples."""
    axes: dict[int, torch.Tensor] = {}
    for d, ids in parts:
        seen = axes.get(d)
        if seen is None:
            axes[d] = ids
        elif not same_examples(seen, ids):
            return mixed_rows(why)
    return Rows(tuple(sorted(axes.items(), key=lambda x: x[0])))


def norm_dim(d: int, n: int) -> int:
    """Dimension ``d`` of a tensor of ``n`` dimensions, a negative one counted from the end."""
    return d + n if d < 0 else d


def dims_arg(dims: object, n: int) -> list[int]:
    """The dimensions an operation's ``dim`` argument names (an int, a list, or none: all ``n``), made
    non-negative."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(n))
    if isinstance(dims, int):
        return [norm_dim(dims, max(n, 1))]
    return [norm_dim(int(d), max(n, 1)) for d in dims]


# ---------------------------------------------------------------------------------------------------------------
# rules: (func, args, kwargs, out, rows of the tensor arguments by position) -> Rows for each output tensor


def pointwise_rule(func, args, kwargs, out, rows):
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    if not outs:
        return []
    shape = outs[0].shape
    n = len(shape)
    parts = []
    for t, r in rows:
        if r.mixed:
            return [r] * len(outs)
        shift = n - t.dim()
        for d, ids in r.axes:
            e = d + shift
            if e < 0:
                return [mixed_rows(f"{op_name(func)} broadcasts one example's rows over several")] * len(outs)
            if shape[e] != ids.numel():
                if ids.numel() != 1:
                    return [mixed_rows(f"{op_name(func)} broadcasts one example's rows over several")] * len(outs)
                ids = ids.expand(shape[e])   # one example's data spread along the dimension: all of it its own
            parts.append((e, ids))
    merged = merge_axes(parts, f"{op_name(func)} combines rows of different examples")
    return [merged if o.shape == shape else reshaped(merged, shape, o.shape, func) for o in outs]


def op_name(func) -> str:
    return f"aten.{func.overloadpacket.__name__}"


_RESHAPES: dict = {}


def reshaped(r: Rows, old: torch.Size, new: torch.Size, func) -> Rows:
    """Rows after a row-major reshape from ``old`` to ``new``: each axis lands on the one output dimension its
    ids vary along (repeated where the axis is merged with the dimensions after it, tiled where merged with
    those before it); an axis whose ids vary along two output dimensions is split, and mixes."""
    if r.mixed or not r.axes:
        return r
    axes = []
    for d, ids in r.axes:
        key = (tuple(old), tuple(new), d, id(ids))
        hit = _RESHAPES.get(key)
        if hit is None:
            hit = (ids, _reshape_axis(ids, list(old), list(new), d))
            if len(_RESHAPES) > 4096:
                _RESHAPES.clear()
            _RESHAPES[key] = hit   # the entry holds ids, so id(ids) is not reused while it is cached
        found = hit[1]
        if found is None:
            return mixed_rows(f"{op_name(func)} splits the example axis")
        axes.append(found)
    return merge_axes(axes, f"{op_name(func)} merges two example axes")


def _reshape_axis(ids: torch.Tensor, old: list[int], new: list[int], d: int) -> tuple[int, torch.Tensor] | None:
    if old[:d + 1] == new[:d + 1]:
        # the dimensions up to the axis are kept (a split or merge of the ones after it, e.g. heads): index i along
        # it spans the same flat range before and after, so it stays index i
        return d, ids
    if new and bool((ids == ids[0]).all()):   # one example: every element is its own, whatever the shape
        return 0, ids[:1].expand(new[0])
    # the layout with distinct examples, found once per shape (each step's batch has new ids): where it lands on
    # one output dimension, along which the labels vary and nowhere else, the labels of any ids are ids[those] (they
    # are constant wherever the distinct ones are, and not all equal, since every label appears along it)
    plan = _reshape_plan(tuple(old), tuple(new), d)
    if plan is not None:
        k, labels = plan
        return k, ids[labels]
    return _axis_layout(ids, old, new, d)


_PLANS: dict[tuple, tuple[int, torch.Tensor] | None] = {}


def _reshape_plan(old: tuple[int, ...], new: tuple[int, ...], d: int) -> tuple[int, torch.Tensor] | None:
    """``_axis_layout`` of distinct ids ``0 .. old[d] - 1`` (cached by shape): ``(output dimension, labels)``, or
    ``None`` where it is not one dimension (the caller then reads its own ids)."""
    key = (old, new, d)
    if key not in _PLANS:
        if len(_PLANS) > 4096:
            _PLANS.clear()
        found = _axis_layout(torch.arange(old[d]), list(old), list(new), d) if old[d] > 1 else None
        _PLANS[key] = found
    return _PLANS[key]


def _axis_layout(ids: torch.Tensor, old: list[int], new: list[int], d: int) -> tuple[int, torch.Tensor] | None:
    """Where the example axis ``d`` (labelled ``ids``) of a row-major reshape from ``old`` to ``new`` lands: the
    output dimension along which the labels vary, and nowhere else, with its labels; ``None`` where none does."""
    size = old[d]
    inner = 1
    for s in old[d + 1:]:
        inner *= s
    acc = [1] * len(new)
    for k in range(len(new) - 2, -1, -1):
        acc[k] = acc[k + 1] * new[k + 1]
    # the output dimensions whose index ranges overlap the axis's span [inner, inner * size) of the flat index
    K = [k for k in range(len(new)) if new[k] > 1 and acc[k] * new[k] > inner and acc[k] < inner * size]
    if not K:
        one = [k for k in range(len(new)) if new[k] == 1 and acc[k] == inner]
        return (one[0], ids) if one and size == 1 else None
    if inner % acc[K[-1]]:
        return None
    flat = torch.zeros((), dtype=torch.long)
    for j, k in enumerate(K):
        shape = [1] * len(K)
        shape[j] = new[k]
        flat = flat + torch.arange(new[k]).view(shape) * acc[k]
    labels = ids[(flat // inner) % size]
    along = []
    for j, k in enumerate(K):
        lj = labels.movedim(j, 0).reshape(new[k], -1)
        if bool((lj == lj[:, :1]).all()):
            along.append((k, lj[:, 0].contiguous()))
    varying = [(k, x) for k, x in along if bool((x != x[0]).any())]
    if len(varying) == 1:
        return varying[0]
    return along[0] if along and not varying else None


def inplace_rule(func, args, kwargs, out, rows):
    """An in-place element-wise operation: ``self``'s rows and the others' combine like the out-of-place one."""
    return pointwise_rule(func, args, kwargs, args[0], rows)


def local_scalar_rule(func, args, kwargs, out, rows):
    return []


#: torch's tag for in-place operations (absent from older torch, where the trailing underscore says it)
INPLACE_TAG = getattr(torch.Tag, "inplace", None)

r"""How each ATen operation carries the examples' rows: the rules the isolation tracker
(:class:`dpsgd.isolation.ExampleTracker`) applies to every operation that reads a tensor of the batch.

:class:`Rows` says which examples a tensor's elements were computed from: pairs of a dimension and the example
id of each index along it, or the first operation after which some element depends on several examples
(*mixed*).  :data:`RULES` maps each operation to its rule, ``rule(func, args, kwargs, out, rows) -> [Rows]``,
one per tensor output, following the operation's semantics:

* an element-wise operation keeps the example axis where broadcasting puts it;
* a view, reshape, permutation, slice, concatenation or index maps the axis (and its example ids) to the output's
  dimension that carries it (flattening ``(B, T)`` to ``B T`` rows keeps one id per row);
* a reduction, scan, sort or softmax over the example axis, a matrix product that contracts it, and attention
  whose keys carry other examples mark the output mixed.

An operation without a rule is the tracker's to refuse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["Rows", "RULES", "mixed_rows", "same_examples", "merge_axes", "op_name", "pointwise_rule", "inplace_rule",
           "local_scalar_rule", "INPLACE_TAG"]

aten = torch.ops.aten


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


def _norm_dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _dims_arg(dims: object, n: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(n))
    if isinstance(dims, int):
        return [_norm_dim(dims, max(n, 1))]
    return [_norm_dim(int(d), max(n, 1)) for d in dims]


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
    return [merged if o.shape == shape else _reshaped(merged, shape, o.shape, func) for o in outs]


def op_name(func) -> str:
    return f"aten.{func.overloadpacket.__name__}"


_RESHAPES: dict = {}


def _reshaped(r: Rows, old: torch.Size, new: torch.Size, func) -> Rows:
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


def _view(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    return [_reshaped(r, t.shape, out.shape, func)]


def _permute(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    n = t.dim()
    name = func.overloadpacket
    if name is aten.permute:
        order = [_norm_dim(d, n) for d in args[1]]
    elif name is aten.t:
        order = [1, 0] if n == 2 else list(range(n))
    else:   # transpose
        a, b = _norm_dim(args[1], n), _norm_dim(args[2], n)
        order = list(range(n))
        order[a], order[b] = order[b], order[a]
    where = {src: dst for dst, src in enumerate(order)}
    return [Rows(tuple(sorted((where[d], ids) for d, ids in r.axes)), r.mixed)]


def _unsqueeze(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    d = _norm_dim(args[1], t.dim() + 1)
    return [Rows(tuple((a + (a >= d), ids) for a, ids in r.axes), r.mixed)]


def _squeeze(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    if r.mixed:
        return [r]
    dims = [d for d in range(t.dim()) if t.shape[d] == 1] if len(args) < 2 else \
        [d for d in _dims_arg(args[1], t.dim()) if t.shape[d] == 1]
    return [Rows(tuple((a - sum(1 for d in dims if d < a), ids) for a, ids in r.axes if a not in dims))]


def _expand(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    shift = out.dim() - t.dim()
    axes = []
    for a, ids in r.axes:
        if out.shape[a + shift] != ids.numel():
            if ids.numel() != 1:
                return [mixed_rows(f"{op_name(func)} broadcasts one example over several rows")]
            ids = ids.expand(out.shape[a + shift])
        axes.append((a + shift, ids))
    return [Rows(tuple(axes), r.mixed)]


def _slice(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    n = t.dim()
    dim = _norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), n)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    ids = r.axis(dim)
    if ids is None:
        return [r]
    taken = ids[slice(start, end, step)]
    return [Rows(tuple((a, taken if a == dim else x) for a, x in r.axes), r.mixed)]


def _narrow(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    dim = _norm_dim(args[1], t.dim())
    start = int(args[2]) if not isinstance(args[2], torch.Tensor) else int(args[2].item())
    ids = r.axis(dim)
    if ids is None:
        return [r]
    if start < 0:
        start += t.shape[dim]
    taken = ids[start:start + int(args[3])]
    return [Rows(tuple((a, taken if a == dim else x) for a, x in r.axes), r.mixed)]


def _one_example(r: Rows, out: torch.Tensor) -> Rows | None:
    """The rows of a piece of a tensor every element of which is one example's (all of ``r``'s ids the same: a batch
    of one example whose rows were merged with time steps, as a recurrent kernel does): the piece is wholly that
    example's, which is said on its first axis of size 1; ``None`` if the ids differ or there is no such axis."""
    ids = torch.cat([x for _, x in r.axes]) if r.axes else None
    if ids is None or r.mixed or not bool((ids == ids[0]).all()):
        return None
    axis = next((d for d, n in enumerate(out.shape) if n == 1), None)
    return None if axis is None else Rows(((axis, ids[:1]),))


def _select(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    dim = _norm_dim(args[1], t.dim())
    if r.mixed:
        return [r]
    if r.axis(dim) is not None:
        whole = _one_example(r, out)
        return [whole if whole is not None else mixed_rows(f"{op_name(func)} takes one example's row out of the batch")]
    return [Rows(tuple((a - (a > dim), x) for a, x in r.axes))]


def _split(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    n = t.dim()
    dim = _norm_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), n)
    ids = r.axis(dim)
    results, start = [], 0
    for o in out:
        size = o.shape[dim]
        if ids is None:
            results.append(r)
        else:
            taken = ids[start:start + size]
            results.append(Rows(tuple((a, taken if a == dim else x) for a, x in r.axes), r.mixed))
        start += size
    return results


def _unbind(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    dim = _norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), t.dim())
    if r.axis(dim) is not None:
        pieces = [_one_example(r, o) for o in out]
        if all(p is not None for p in pieces):
            return pieces
        return [mixed_rows(f"{op_name(func)} takes examples' rows out of the batch")] * len(out)
    return [Rows(tuple((a - (a > dim), x) for a, x in r.axes if a != dim), r.mixed)] * len(out)


def _diagonal(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    n = t.dim()
    offset = args[1] if len(args) > 1 else kwargs.get("offset", 0)
    d1 = _norm_dim(args[2] if len(args) > 2 else kwargs.get("dim1", 0), n)
    d2 = _norm_dim(args[3] if len(args) > 3 else kwargs.get("dim2", 1), n)
    if r.mixed:
        return [r]
    rest = [d for d in range(n) if d not in (d1, d2)]
    axes = [(rest.index(a), ids) for a, ids in r.axes if a in rest]
    i1, i2 = r.axis(d1), r.axis(d2)
    length = out.shape[-1]
    rows1 = torch.arange(length) + max(-offset, 0)
    rows2 = torch.arange(length) + max(offset, 0)
    along = [x for x in (None if i1 is None else i1[rows1], None if i2 is None else i2[rows2]) if x is not None]
    axes += [(n - 2, x) for x in along]
    return [merge_axes(axes, f"{op_name(func)} pairs rows of different examples")]


def _cat(func, args, kwargs, out, rows):
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    n = out.dim()
    dim = _norm_dim(dim, n)
    by_id = {id(t): r for t, r in rows}
    parts, along = [], []
    for t in tensors:
        if t.dim() == 1 and t.numel() == 0:   # the legacy empty tensor, skipped by cat
            continue
        r = by_id.get(id(t), Rows())
        if r.mixed:
            return [r]
        ids = r.axis(dim)
        along.append(ids if ids is not None else torch.full((t.shape[dim],), -1, dtype=torch.long))
        parts += [(a, x) for a, x in r.axes if a != dim]
    merged = merge_axes(parts, f"{op_name(func)} joins rows of different examples")
    if merged.mixed:
        return [merged]
    joined = torch.cat(along)
    if (joined >= 0).any():
        if (joined < 0).any():
            # rows of no example beside example rows along the axis: a public row is a row of no example
            pass
        merged = merge_axes([*merged.axes, (dim, joined)], f"{op_name(func)} joins rows of different examples")
    return [merged]


def _stack(func, args, kwargs, out, rows):
    tensors = args[0]
    n = out.dim()
    dim = _norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), n)
    by_id = {id(t): r for t, r in rows}
    parts = []
    for t in tensors:
        r = by_id.get(id(t), Rows())
        if r.mixed:
            return [r]
        parts += [(a + (a >= dim), x) for a, x in r.axes]
    return [merge_axes(parts, f"{op_name(func)} stacks rows of different examples")]


def _reduction(dims_at: int | None, keep_at: int | None, scan: bool = False):
    """A reduction over ``args[dims_at]`` (all dimensions when absent); ``scan`` keeps the shape (cumsum,
    softmax, sort): the reduced dimension stays but each element reads the whole of it."""
    def rule(func, args, kwargs, out, rows):
        (t, r), = rows[:1]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        n = t.dim()
        if dims_at is None:
            dims = list(range(n))
        else:
            raw = args[dims_at] if len(args) > dims_at else kwargs.get("dim")
            dims = _dims_arg(raw, n)
        if r.mixed:
            return [r] * len(outs)
        if any(r.axis(d) is not None for d in dims):
            return [mixed_rows(f"{op_name(func)} reduces over the examples")] * len(outs)
        if scan:
            return [r if o.dim() == n else Rows() for o in outs]
        keep = bool(args[keep_at]) if keep_at is not None and len(args) > keep_at else bool(kwargs.get("keepdim"))
        results = []
        for o in outs:
            if o.dim() == n:   # keepdim
                results.append(Rows(tuple((a, x) for a, x in r.axes if a not in dims)))
            elif keep or o.dim() == 0 and n > 0 and not r.axes:
                results.append(Rows())
            else:
                results.append(Rows(tuple((a - sum(1 for d in dims if d < a), x) for a, x in r.axes
                                          if a not in dims)))
        return results
    return rule


def _layer_norm(func, args, kwargs, out, rows):
    """Normalization over the last ``len(normalized_shape)`` dimensions (layer norm, RMS norm)."""
    t, r = next((t, r) for t, r in rows if t is args[0])
    k = len(args[1])
    dims = list(range(t.dim() - k, t.dim()))
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    if r.mixed:
        return [r] * len(outs)
    if any(r.axis(d) is not None for d in dims) or any(rr.axes or rr.mixed for tt, rr in rows if tt is not t):
        return [mixed_rows(f"{op_name(func)} normalizes over the examples")] * len(outs)
    return [r if o.dim() == t.dim() else Rows(tuple((a, x) for a, x in r.axes if a < o.dim())) for o in outs]


def _group_norm(func, args, kwargs, out, rows):
    t, r = next((t, r) for t, r in rows if t is args[0])
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    if r.mixed:
        return [r] * len(outs)
    if any(a != 0 for a, _ in r.axes) or any(rr.axes or rr.mixed for tt, rr in rows if tt is not t):
        return [mixed_rows(f"{op_name(func)} normalizes over the examples")] * len(outs)
    return [r if o.dim() >= 1 and o.shape[0] == t.shape[0] else Rows() for o in outs]


def _batch_norm(func, args, kwargs, out, rows):
    """Batch norm in training mode reduces over the batch; in eval mode it is element-wise."""
    training = args[5] if func.overloadpacket is aten.native_batch_norm else args[5]
    t, r = next((t, r) for t, r in rows if t is args[0])
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    if training and (r.axes or r.mixed):
        return [mixed_rows(f"{op_name(func)} in training mode normalizes over the batch")] * len(outs)
    if any(rr.axes or rr.mixed for tt, rr in rows if tt is not t):
        return [mixed_rows(f"{op_name(func)} normalizes with statistics of examples")] * len(outs)
    return [r if o.shape == t.shape else Rows() for o in outs]


def _matmul(func, args, kwargs, out, rows):
    """``mm``, ``bmm``, ``addmm``, ``baddbmm``: ``[..., M, K] @ [..., K, N]``; the contracted ``K`` must carry no
    example axis; batch dimensions align; ``M`` of the first and ``N`` of the second carry through."""
    name = func.overloadpacket
    bias = None
    if name in (aten.addmm, aten.baddbmm, aten.addbmm):
        bias, a, b = args[0], args[1], args[2]
    else:
        a, b = args[0], args[1]
    by_id = {id(t): r for t, r in rows}
    ra, rb = by_id.get(id(a), Rows()), by_id.get(id(b), Rows())
    for r in (ra, rb):
        if r.mixed:
            return [r]
    n = out.dim()
    parts = []
    for d, ids in ra.axes:
        if d == a.dim() - 1:
            return [mixed_rows(f"{op_name(func)} contracts the example axis")]
        parts.append((d, ids))
    for d, ids in rb.axes:
        if d == b.dim() - 2:
            return [mixed_rows(f"{op_name(func)} contracts the example axis")]
        parts.append((d if d < b.dim() - 2 else n - 1, ids))
    merged = merge_axes(parts, f"{op_name(func)} multiplies rows of different examples")
    if bias is not None and bias in by_id:
        merged = pointwise_rule(func, (), {}, out, [(bias, by_id[id(bias)])] if merged.mixed else
                            [(bias, by_id[id(bias)]), (out, merged)])[0]
    return [merged]


def _attention(func, args, kwargs, out, rows):
    """Scaled dot-product attention: query ``[..., L, E]``, key and value ``[..., S, E]``; the key/value length
    ``S`` and the embedding ``E`` are contracted, the leading dimensions align."""
    q, k, v = args[0], args[1], args[2]
    by_id = {id(t): r for t, r in rows}
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    n = q.dim()
    parts = []
    named = [(q, "query"), (k, "key"), (v, "value")]
    mask = kwargs.get("attn_mask")
    if mask is None and len(args) > 3 and isinstance(args[3], torch.Tensor):
        mask = args[3]
    for t, what in named + ([(mask, "mask")] if isinstance(mask, torch.Tensor) else []):
        r = by_id.get(id(t), Rows())
        if r.mixed:
            return [r] * len(outs)
        shift = n - t.dim()
        for d, ids in r.axes:
            e = d + shift
            if what == "query" and e == n - 1 or what in ("key", "value") and e >= n - 2 \
                    or what == "mask" and e == n - 1:
                return [mixed_rows(f"{op_name(func)} attends across examples")] * len(outs)
            parts.append((e, ids))
    merged = merge_axes(parts, f"{op_name(func)} attends across examples")
    results = []
    for o in outs:
        if merged.mixed:
            results.append(merged)
        elif o.dim() >= n - 1 and tuple(o.shape[:n - 1]) == tuple(q.shape[:n - 1]):
            results.append(Rows(tuple((a, x) for a, x in merged.axes if a < o.dim())))
        elif o.dim() == 0 or not merged.axes:
            results.append(Rows())
        else:
            results.append(mixed_rows(f"{op_name(func)}: an output without the query's layout"))
    return results


def _convolution(func, args, kwargs, out, rows):
    """Convolution: the batch dimension 0 carries through; channels and the sliding window are contracted."""
    x = args[0]
    by_id = {id(t): r for t, r in rows}
    rx = by_id.get(id(x), Rows())
    if rx.mixed:
        return [rx]
    if any(by_id.get(id(t), Rows()).axes or by_id.get(id(t), Rows()).mixed for t in args[1:3]
           if isinstance(t, torch.Tensor)):
        return [mixed_rows(f"{op_name(func)} with example data in its weight")]
    if any(a != 0 for a, _ in rx.axes):
        return [mixed_rows(f"{op_name(func)} slides over the example axis")]
    return [rx]


def _embedding(func, args, kwargs, out, rows):
    w, idx = args[0], args[1]
    by_id = {id(t): r for t, r in rows}
    if w in by_id and (by_id[id(w)].axes or by_id[id(w)].mixed):
        return [mixed_rows(f"{op_name(func)} looks up rows of a table built from examples")]
    return [by_id.get(id(idx), Rows())]


def _index(func, args, kwargs, out, rows):
    """``x[i0, i1, ...]`` with index tensors (``None`` keeps a dimension): the indexed dimensions are replaced by
    the indices' broadcast shape (in place when they are adjacent, in front otherwise).  An indexed example axis
    maps its ids through 1-D indices; the index tensors' own axes must agree with those ids."""
    x, indices = args[0], list(args[1])
    by_id = {id(t): r for t, r in rows}
    rx = by_id.get(id(x), Rows())
    if rx.mixed:
        return [rx]
    n = x.dim()
    idx = indices + [None] * (n - len(indices))
    # boolean masks index several dimensions: refuse if they touch an axis, else expand them
    if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
        if rx.axes or any(isinstance(i, torch.Tensor) and id(i) in by_id for i in idx):
            return [mixed_rows(f"{op_name(func)} with a boolean mask over example data")]
        return [Rows()]
    where = [d for d, i in enumerate(idx) if i is not None]
    tensors = [idx[d] for d in where]
    shape = torch.broadcast_shapes(*[t.shape for t in tensors])
    m = len(shape)
    adjacent = where == list(range(where[0], where[-1] + 1))
    front = where[0] if adjacent else 0
    kept = [d for d in range(n) if d not in where]

    def out_dim(d):   # a kept input dimension's place in the output
        before = sum(1 for k in kept if k < d)
        return before + (m if (not adjacent or d > where[0]) else 0)

    parts = []
    for d, ids in rx.axes:
        if d in where:
            # the index along the example axis must vary along one of its dimensions at most (an arange shaped
            # (B, 1, 1, 1), as attention-mask builders index a padding mask): the output's rows along that
            # dimension are then the indexed examples' rows, as with a 1-D index
            i = idx[d]
            spread = [j for j in range(i.dim()) if i.shape[j] > 1]
            if i.dim() == 0 or len(spread) > 1:
                return [mixed_rows(f"{op_name(func)} gathers example rows with a multi-dimensional index")]
            j = spread[0] if spread else 0
            parts.append((front + m - i.dim() + j, ids[i.reshape(-1).to("cpu", torch.long)]))
        else:
            parts.append((out_dim(d), ids))
    for t in tensors:
        r = by_id.get(id(t), Rows())
        if r.mixed:
            return [r]
        shift = m - t.dim()
        parts += [(front + d + shift, ids) for d, ids in r.axes]
    return [merge_axes(parts, f"{op_name(func)} gathers rows of other examples")]


def _gather(func, args, kwargs, out, rows):
    x, dim, index = args[0], args[1], args[2]
    by_id = {id(t): r for t, r in rows}
    rx, ri = by_id.get(id(x), Rows()), by_id.get(id(index), Rows())
    for r in (rx, ri):
        if r.mixed:
            return [r]
    dim = _norm_dim(dim, x.dim())
    if rx.axis(dim) is not None:
        return [mixed_rows(f"{op_name(func)} gathers along the example axis")]
    return [merge_axes([*rx.axes, *ri.axes], f"{op_name(func)} gathers rows of other examples")]


def _index_put(func, args, kwargs, out, rows):
    """``x[i] = v`` (in place): every element written must come from the example of the row it lands in.
    Index tensors with example axes, or values placed along an example axis of ``x``, align like an
    element-wise operation; anything else marks ``x`` mixed."""
    x, indices, v = args[0], list(args[1]), args[2]
    by_id = {id(t): r for t, r in rows}
    rx, rv = by_id.get(id(x), Rows()), by_id.get(id(v), Rows())
    ris = [by_id.get(id(i), Rows()) for i in indices if isinstance(i, torch.Tensor)]
    if rx.mixed or rv.mixed or any(r.mixed for r in ris):
        return [next(r for r in (rx, rv, *ris) if r.mixed)]
    if not rv.axes and not any(r.axes for r in ris):
        return [rx]   # public values at public places
    if all(i is None for i in indices[:1]) is False and len(indices) == 1 and rx.axis(0) is not None \
            and isinstance(indices[0], torch.Tensor) and indices[0].dtype == torch.bool \
            and (not rv.axes and by_id.get(id(indices[0]), Rows()).axis(0) is not None):
        return [rx]   # x[mask] = scalar, the mask per example row
    return [mixed_rows(f"{op_name(func)} writes values into rows of other examples")]


def _index_add(func, args, kwargs, out, rows):
    """``x.index_add_(dim, index, src)``: row ``index[j]`` of ``x`` receives row ``j`` of ``src``; each
    destination row must receive rows of its own example only."""
    x, dim, index, src = args[0], args[1], args[2], args[3]
    by_id = {id(t): r for t, r in rows}
    rx, ri, rs = (by_id.get(id(t), Rows()) for t in (x, index, src))
    for r in (rx, ri, rs):
        if r.mixed:
            return [r]
    dim = _norm_dim(dim, x.dim())
    src_ids = rs.axis(dim)
    if any(a != dim for a, _ in rs.axes) or ri.axes:
        return [mixed_rows(f"{op_name(func)} adds rows of other examples")]
    if src_ids is None:
        return [rx]
    size = x.shape[dim]
    i = index.to("cpu", torch.long)
    dest = rx.axis(dim)
    if dest is None:
        dest = torch.full((size,), -1, dtype=torch.long)
    lo = torch.full((size,), 2**62, dtype=torch.long).scatter_reduce(0, i, src_ids, "amin")
    hi = torch.full((size,), -1, dtype=torch.long).scatter_reduce(0, i, src_ids, "amax")
    written = hi >= 0
    if bool(((lo != hi) & written).any()) or bool(((dest >= 0) & written & (dest != hi)).any()):
        return [mixed_rows(f"{op_name(func)} adds rows of different examples into one row")]
    new = torch.where(written, hi, dest)
    others = [(a, x_) for a, x_ in rx.axes if a != dim]
    return [merge_axes([*others, (dim, new)], f"{op_name(func)} adds rows of different examples into one row")]


def _public(func, args, kwargs, out, rows):
    """Outputs that hold none of the inputs' values (``empty_like``, ``zeros_like``, shapes)."""
    return [Rows() for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]


def _first_like(func, args, kwargs, out, rows):
    """Outputs laid out like the first input (``clone``, ``_to_copy``, ``detach``, ``contiguous``)."""
    (t, r), = rows[:1]
    return [r if o.shape == t.shape else _reshaped(r, t.shape, o.shape, func)
            for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]


def _nll_loss(func, args, kwargs, out, rows):
    x, target, weight, reduction = args[0], args[1], args[2], args[3]
    by_id = {id(t): r for t, r in rows}
    rx, rt = by_id.get(id(x), Rows()), by_id.get(id(target), Rows())
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    if weight is not None and id(weight) in by_id:   # class weights from the batch (its class frequencies)
        return [mixed_rows(f"{op_name(func)} with class weights computed from examples")] * len(outs)
    if rx.mixed or rt.mixed:
        return [rx if rx.mixed else rt] * len(outs)
    if reduction != 0 and (rx.axes or rt.axes):
        return [mixed_rows(f"{op_name(func)} with reduction='{'mean' if reduction == 1 else 'sum'}' averages over the "
                       f"examples")] * len(outs)
    if rx.axis(1) is not None:
        return [mixed_rows(f"{op_name(func)} over classes that are examples")] * len(outs)
    # input (N, C, d...) or (C,): the output drops the class dimension
    parts = [(a - (a > 1), ids) for a, ids in rx.axes] if x.dim() > 1 else []
    parts += list(rt.axes)
    merged = merge_axes(parts, f"{op_name(func)} pairs predictions and targets of different examples")
    return [merged, Rows()][:len(outs)]


def _copy(func, args, kwargs, out, rows):
    """``dst.copy_(src)``: ``dst``'s elements become ``src``'s (broadcast)."""
    dst, src = args[0], args[1]
    by_id = {id(t): r for t, r in rows}
    rs = by_id.get(id(src), Rows())
    if rs.mixed:
        return [rs]
    shift = dst.dim() - src.dim()
    for a, ids in rs.axes:
        if dst.shape[a + shift] != ids.numel():
            return [mixed_rows(f"{op_name(func)} broadcasts one example over several rows")]
    return [Rows(tuple((a + shift, ids) for a, ids in rs.axes))]


def inplace_rule(func, args, kwargs, out, rows):
    """An in-place element-wise operation: ``self``'s rows and the others' combine like the out-of-place one."""
    return pointwise_rule(func, args, kwargs, args[0], rows)


def _topk(func, args, kwargs, out, rows):
    """``topk``/``sort``/``argsort``/``kthvalue`` along a dimension: the dimension's elements are compared with
    each other, so an example axis there mixes; elsewhere the axes stay."""
    (t, r), = rows[:1]
    n = t.dim()
    name = func.overloadpacket
    if name is aten.topk:
        raw = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    elif name is aten.kthvalue:
        raw = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    else:
        raw = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else -1)
    dim = _norm_dim(raw, max(n, 1))
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    if r.mixed:
        return [r] * len(outs)
    if r.axis(dim) is not None:
        return [mixed_rows(f"{op_name(func)} compares the examples with each other")] * len(outs)
    res = []
    for o in outs:
        res.append(Rows(tuple((a, x) for a, x in r.axes if a < o.dim())) if o.dim() == n else
                   Rows(tuple((a - (a > dim), x) for a, x in r.axes)))
    return res


def _repeat_interleave(func, args, kwargs, out, rows):
    """``x.repeat_interleave(r, dim)``: each index along ``dim`` repeated ``r`` times (``dim=None`` flattens)."""
    (t, r), = rows[:1]
    if r.mixed or not r.axes:
        return [r]
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if dim is None or isinstance(repeats, torch.Tensor) and repeats.numel() > 1:
        return [mixed_rows(f"{op_name(func)} without one repeat count along one dimension")]
    dim = _norm_dim(dim, t.dim())
    k = int(repeats)
    return [Rows(tuple((a, x.repeat_interleave(k) if a == dim else x) for a, x in r.axes))]


def _repeat(func, args, kwargs, out, rows):
    """``x.repeat(sizes)``: tiles; a tiled example axis would put an example's rows among others'."""
    (t, r), = rows[:1]
    sizes = list(args[1])
    shift = len(sizes) - t.dim()
    if r.mixed:
        return [r]
    axes = []
    for a, x in r.axes:
        k = sizes[a + shift]
        axes.append((a + shift, x.repeat(k) if k > 1 else x))
    return [Rows(tuple(axes))]


def _one_hot(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    return [r]


def _elementwise_loss(func, args, kwargs, out, rows):
    """``mse_loss``, ``l1_loss``, ``binary_cross_entropy`` and the like: element-wise with ``reduction='none'``
    (0), a reduction over every element otherwise."""
    names = [a.name for a in func._schema.arguments]
    at = names.index("reduction") if "reduction" in names else None
    reduction = (args[at] if at is not None and len(args) > at else kwargs.get("reduction", 1)) if at is not None \
        else 1
    if int(reduction) == 0:
        return pointwise_rule(func, args, kwargs, out, rows)
    return _reduction(None, None)(func, args, kwargs, out, rows)


def _pad(func, args, kwargs, out, rows):
    """Padding of the last ``len(pad) // 2`` dimensions (constant, reflection, replication, circular): an
    example axis there would put other examples' rows (or none) beside its rows."""
    (t, r), = rows[:1]
    pad = args[1] if len(args) > 1 else kwargs.get("pad", kwargs.get("padding"))
    k = len(pad) // 2 if isinstance(pad, (list, tuple)) else 1
    padded = range(t.dim() - k, t.dim())
    if r.mixed:
        return [r]
    if any(a in padded for a, _ in r.axes):
        return [mixed_rows(f"{op_name(func)} pads along the example axis")]
    return [r]


def _rnn(func, args, kwargs, out, rows):
    """Recurrent layers (``lstm``, ``gru``, ``rnn_*``, ``mkldnn_rnn_layer``): the input's batch dimension is 0
    with ``batch_first`` and 1 otherwise (always 1 for the fused kernels), the states' is 1 (0 for a state
    of one layer); time steps of one example are combined, examples never.  The outputs carry the input's
    examples."""
    names = [a.name for a in func._schema.arguments]
    # the fused kernels take time-major input whatever their batch_first flag says; lstm/gru/rnn_* honour it
    batch_first = bool(args[names.index("batch_first")]) if "batch_first" in names and \
        names.index("batch_first") < len(args) and func.overloadpacket.__name__ in ("lstm", "gru", "rnn_tanh",
                                                                                     "rnn_relu") else False
    x = args[0]
    found = None
    for t, r in rows:
        if r.mixed:
            return [r] * len([o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)])
        # states: (layers, B, H), or (B, H) inside the fused kernels
        want = (0 if batch_first else 1) if t is x else (1 if t.dim() == 3 else 0)
        for a, ids in r.axes:
            if a != want or (found is not None and not same_examples(found, ids)):
                return [mixed_rows(f"{op_name(func)} runs over the examples (not along its batch dimension)")] * len(
                    [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)])
            found = ids
    results = []
    for i, o in enumerate(o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)):
        if found is None:
            results.append(Rows())
        elif i == 0 and o.dim() >= 2 and o.shape[0 if batch_first else 1] == found.numel():
            results.append(Rows(((0 if batch_first else 1, found),)))
        elif i > 0 and o.dim() == 3 and o.shape[1] == found.numel():
            results.append(Rows(((1, found),)))
        elif i > 0 and o.dim() == 2 and o.shape[0] == found.numel():
            results.append(Rows(((0, found),)))
        else:
            results.append(mixed_rows(f"{op_name(func)}: an output without the batch's layout"))
    return results


def _packed(func, args, kwargs, out, rows):
    """``pack_padded_sequence`` interleaves the examples by time step: no row is one example's."""
    return [mixed_rows("a PackedSequence interleaves the examples by time step (pad the sequences instead, and read "
                   "out[arange(B), lengths - 1])")] * len([o for o in tree_flatten(out)[0]
                                                           if isinstance(o, torch.Tensor)])


def _pool(func, args, kwargs, out, rows):
    """Pooling over the last 1, 2 or 3 dimensions (``avg_pool2d``, ``max_pool2d_with_indices``,
    ``adaptive_avg_pool1d``, ...): an example axis there would be pooled across examples."""
    (t, r), = rows[:1]
    name = func.overloadpacket.__name__
    k = 3 if "3d" in name else 2 if "2d" in name else 1
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    if r.mixed:
        return [r] * len(outs)
    if any(a >= t.dim() - k for a, _ in r.axes):
        return [mixed_rows(f"{op_name(func)} pools over the example axis")] * len(outs)
    return [r] * len(outs)


def local_scalar_rule(func, args, kwargs, out, rows):
    return []


_VIEW_LIKE = ("view", "_unsafe_view", "reshape", "_reshape_alias", "view_copy", "flatten", "unflatten")
_PERMUTE = ("permute", "transpose", "t", "transpose_", "t_")
_REDUCE = {  # name: (position of the dims argument or None for all, position of keepdim)
    "sum": (1, 2), "mean": (1, 2), "nansum": (1, 2), "nanmean": (1, 2), "prod": (1, 2), "amax": (1, 2),
    "amin": (1, 2), "any": (1, 2), "all": (1, 2), "std": (1, 3), "var": (1, 3), "var_mean": (1, 3),
    "std_mean": (1, 3), "logsumexp": (1, 2), "linalg_vector_norm": (2, 3), "norm": (2, 3), "max": (1, 2),
    "min": (1, 2), "argmax": (1, 2), "argmin": (1, 2), "count_nonzero": (1, None), "median": (1, 2),
    "mode": (1, 2), "aminmax": (None, None), "histc": (None, None), "bincount": (None, None),
    "_unique2": (None, None), "unique_dim": (None, None), "unique_consecutive": (None, None),
    "nonzero": (None, None), "masked_select": (None, None), "dist": (None, None), "trace": (None, None),
    "cov": (None, None), "corrcoef": (None, None), "equal": (None, None), "allclose": (None, None),
}
_SCAN = ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "_softmax", "_log_softmax", "_safe_softmax",
         "softmax", "log_softmax", "flip", "roll", "cumsum_")
_SCAN_DIM = {"flip": 1, "roll": 2}
_PUBLIC = ("empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones", "new_full",
           "new_empty_strided", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride",
           "is_same_size", "_has_compatible_shallow_copy_type", "empty_strided", "rand_like", "randn_like",
           "randint_like", "_nested_tensor_size", "is_nonzero_shape")
_FIRST_LIKE = ("clone", "_to_copy", "detach", "alias", "contiguous", "lift_fresh", "lift_fresh_copy", "to",
               "_conj", "_neg_view", "resolve_conj", "resolve_neg", "view_as_real", "view_as_complex",
               "_foreach_copy", "pin_memory", "_pin_memory", "detach_", "_lazy_clone")

#: torch's tag for in-place operations (absent from older torch, where the trailing underscore says it)
INPLACE_TAG = getattr(torch.Tag, "inplace", None)

RULES: dict[str, Callable] = {}
for _n in _VIEW_LIKE:
    RULES[_n] = _view
for _n in _PERMUTE:
    RULES[_n] = _permute
for _n, (_d, _k) in _REDUCE.items():
    RULES[_n] = _reduction(_d, _k)
for _n in _SCAN:
    RULES[_n] = _reduction(_SCAN_DIM.get(_n, 1), None, scan=True)
RULES["roll"] = lambda func, args, kwargs, out, rows: _reduction(2 if len(args) > 2 and args[2] not in (None, [], ())
                                                                 else None, None, scan=True)(
    func, args, kwargs, out, rows)
for _n in _PUBLIC:
    RULES[_n] = _public
for _n in _FIRST_LIKE:
    RULES[_n] = _first_like
RULES.update({
    "unsqueeze": _unsqueeze, "unsqueeze_": _unsqueeze, "squeeze": _squeeze, "squeeze_": _squeeze,
    "expand": _expand, "expand_copy": _expand, "slice": _slice, "narrow": _narrow, "select": _select,
    "split": _split, "split_with_sizes": _split, "unsafe_split": _split, "chunk": _split, "tensor_split": _split,
    "unbind": _unbind, "diagonal": _diagonal, "cat": _cat, "stack": _stack,
    "native_layer_norm": _layer_norm, "layer_norm": _layer_norm, "_fused_rms_norm": _layer_norm,
    "rms_norm": _layer_norm, "native_group_norm": _group_norm,
    "native_batch_norm": _batch_norm, "_native_batch_norm_legit": _batch_norm,
    "_native_batch_norm_legit_no_training": lambda f, a, k, o, r: _batch_norm(f, (*a[:5], False), k, o, r),
    "mm": _matmul, "bmm": _matmul, "addmm": _matmul, "baddbmm": _matmul,
    "_scaled_dot_product_flash_attention_for_cpu": _attention, "_scaled_dot_product_flash_attention": _attention,
    "_scaled_dot_product_efficient_attention": _attention, "_scaled_dot_product_cudnn_attention": _attention,
    "_scaled_dot_product_attention_math": _attention, "scaled_dot_product_attention": _attention,
    "_scaled_dot_product_fused_attention_overrideable": _attention,
    "convolution": _convolution, "_convolution": _convolution, "cudnn_convolution": _convolution,
    "embedding": _embedding, "index": _index, "_unsafe_index": _index, "gather": _gather,
    "index_put_": _index_put, "index_put": _index_put, "_index_put_impl_": _index_put,
    "index_add_": _index_add, "index_add": _index_add,
    "nll_loss_forward": _nll_loss, "nll_loss2d_forward": _nll_loss, "nll_loss_nd": _nll_loss,
    "copy_": _copy, "copy": _copy, "topk": _topk, "sort": _topk, "argsort": _topk, "kthvalue": _topk,
    "_local_scalar_dense": local_scalar_rule, "repeat_interleave": _repeat_interleave, "repeat": _repeat,
    "one_hot": _one_hot, "_pack_padded_sequence": _packed,
})
for _n in ("avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
           "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
           "adaptive_avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool1d",
           "adaptive_max_pool2d", "adaptive_max_pool3d", "max_pool1d_with_indices", "lp_pool1d", "lp_pool2d",
           "upsample_nearest1d", "upsample_nearest2d", "upsample_bilinear2d", "upsample_nearest3d",
           "_upsample_nearest_exact2d", "upsample_bicubic2d", "upsample_linear1d"):
    RULES[_n] = _pool
for _n in ("constant_pad_nd", "pad", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d",
           "replication_pad2d", "replication_pad3d", "_pad_circular", "_pad_enum"):
    RULES[_n] = _pad
for _n in ("lstm", "gru", "rnn_tanh", "rnn_relu", "mkldnn_rnn_layer", "_cudnn_rnn", "miopen_rnn"):
    RULES[_n] = _rnn
for _n in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "soft_margin_loss", "kl_div", "poisson_nll_loss"):
    RULES[_n] = _elementwise_loss
# element-wise operations without the pointwise tag
for _n in ("native_dropout", "dropout", "bernoulli", "bernoulli_", "where", "masked_fill", "masked_fill_",
           "clamp", "clamp_", "clamp_min", "clamp_max", "_to_dtype", "fill_", "zero_", "uniform_", "normal_",
           "exponential_", "random_", "gelu", "silu", "relu", "threshold", "hardtanh", "elu", "leaky_relu",
           "softplus", "glu", "isnan", "isinf", "isfinite", "logical_not", "sign", "triu", "tril",
           "masked_scatter_", "_masked_scale", "native_dropout_backward", "mish", "hardswish", "hardsigmoid",
           "nan_to_num", "round", "bitwise_not", "floor_divide", "remainder", "fmod",
           "logit", "rrelu_with_noise", "celu", "selu", "prelu", "log_sigmoid_forward", "log_sigmoid"):
    RULES.setdefault(_n, pointwise_rule)


# ---------------------------------------------------------------------------------------------------------------

"""Rules of the operations that move or copy elements (views, reshapes, permutations, slices, splits,
concatenation, stacking, repeats, padding, indexing, copies): the example axis goes to the output dimension that
carries it, with its example ids; an operation that would put one example's rows among another's, or take one
example's row out of the batch, marks the output mixed.

:data:`LAYOUT_RULES` maps each operation's ATen name to its rule; :data:`dpsgd.rules.RULES` gathers it with
:mod:`dpsgd.mixing_rules`'.  A rule is ``rule(func, args, kwargs, out, rows) -> [Rows]`` (:mod:`dpsgd.rows`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten

from .rows import Rows, dims_arg, merge_axes, mixed_rows, norm_dim, op_name, reshaped

__all__ = ["LAYOUT_RULES"]

aten = torch.ops.aten


def _view(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    return [reshaped(r, t.shape, out.shape, func)]


def _permute(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    n = t.dim()
    name = func.overloadpacket
    if name is aten.permute:
        order = [norm_dim(d, n) for d in args[1]]
    elif name is aten.t:
        order = [1, 0] if n == 2 else list(range(n))
    else:   # transpose
        a, b = norm_dim(args[1], n), norm_dim(args[2], n)
        order = list(range(n))
        order[a], order[b] = order[b], order[a]
    where = {src: dst for dst, src in enumerate(order)}
    return [Rows(tuple(sorted((where[d], ids) for d, ids in r.axes)), r.mixed)]


def _unsqueeze(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    d = norm_dim(args[1], t.dim() + 1)
    return [Rows(tuple((a + (a >= d), ids) for a, ids in r.axes), r.mixed)]


def _squeeze(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    if r.mixed:
        return [r]
    dims = [d for d in range(t.dim()) if t.shape[d] == 1] if len(args) < 2 else \
        [d for d in dims_arg(args[1], t.dim()) if t.shape[d] == 1]
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
    dim = norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), n)
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
    dim = norm_dim(args[1], t.dim())
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
    dim = norm_dim(args[1], t.dim())
    if r.mixed:
        return [r]
    if r.axis(dim) is not None:
        whole = _one_example(r, out)
        return [whole if whole is not None else mixed_rows(f"{op_name(func)} takes one example's row out of the batch")]
    return [Rows(tuple((a - (a > dim), x) for a, x in r.axes))]


def _split(func, args, kwargs, out, rows):
    (t, r), = rows[:1]
    n = t.dim()
    dim = norm_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), n)
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
    dim = norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), t.dim())
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
    d1 = norm_dim(args[2] if len(args) > 2 else kwargs.get("dim1", 0), n)
    d2 = norm_dim(args[3] if len(args) > 3 else kwargs.get("dim2", 1), n)
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
    dim = norm_dim(dim, n)
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
    dim = norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), n)
    by_id = {id(t): r for t, r in rows}
    parts = []
    for t in tensors:
        r = by_id.get(id(t), Rows())
        if r.mixed:
            return [r]
        parts += [(a + (a >= dim), x) for a, x in r.axes]
    return [merge_axes(parts, f"{op_name(func)} stacks rows of different examples")]


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
    dim = norm_dim(dim, x.dim())
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
    dim = norm_dim(dim, x.dim())
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
    return [r if o.shape == t.shape else reshaped(r, t.shape, o.shape, func)
            for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]


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


def _repeat_interleave(func, args, kwargs, out, rows):
    """``x.repeat_interleave(r, dim)``: each index along ``dim`` repeated ``r`` times (``dim=None`` flattens)."""
    (t, r), = rows[:1]
    if r.mixed or not r.axes:
        return [r]
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if dim is None or isinstance(repeats, torch.Tensor) and repeats.numel() > 1:
        return [mixed_rows(f"{op_name(func)} without one repeat count along one dimension")]
    dim = norm_dim(dim, t.dim())
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


_VIEW_LIKE = ("view", "_unsafe_view", "reshape", "_reshape_alias", "view_copy", "flatten", "unflatten")
_PERMUTE = ("permute", "transpose", "t", "transpose_", "t_")
_PUBLIC = ("empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones", "new_full",
           "new_empty_strided", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride",
           "is_same_size", "_has_compatible_shallow_copy_type", "empty_strided", "rand_like", "randn_like",
           "randint_like", "_nested_tensor_size", "is_nonzero_shape")
_FIRST_LIKE = ("clone", "_to_copy", "detach", "alias", "contiguous", "lift_fresh", "lift_fresh_copy", "to",
               "_conj", "_neg_view", "resolve_conj", "resolve_neg", "view_as_real", "view_as_complex",
               "_foreach_copy", "pin_memory", "_pin_memory", "detach_", "_lazy_clone")


#: the rule of each operation that moves or copies elements, by ATen name
LAYOUT_RULES: dict[str, Callable] = {}
for _n in _VIEW_LIKE:
    LAYOUT_RULES[_n] = _view
for _n in _PERMUTE:
    LAYOUT_RULES[_n] = _permute
for _n in _PUBLIC:
    LAYOUT_RULES[_n] = _public
for _n in _FIRST_LIKE:
    LAYOUT_RULES[_n] = _first_like
LAYOUT_RULES.update({
    "unsqueeze": _unsqueeze, "unsqueeze_": _unsqueeze, "squeeze": _squeeze, "squeeze_": _squeeze,
    "expand": _expand, "expand_copy": _expand, "slice": _slice, "narrow": _narrow, "select": _select,
    "split": _split, "split_with_sizes": _split, "unsafe_split": _split, "chunk": _split, "tensor_split": _split,
    "unbind": _unbind, "diagonal": _diagonal, "cat": _cat, "stack": _stack,
    "embedding": _embedding, "index": _index, "_unsafe_index": _index, "gather": _gather,
    "index_put_": _index_put, "index_put": _index_put, "_index_put_impl_": _index_put,
    "index_add_": _index_add, "index_add": _index_add,
    "copy_": _copy, "copy": _copy, "repeat_interleave": _repeat_interleave, "repeat": _repeat,
    "one_hot": _one_hot,
})
for _n in ("constant_pad_nd", "pad", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d",
           "replication_pad2d", "replication_pad3d", "_pad_circular", "_pad_enum"):
    LAYOUT_RULES[_n] = _pad

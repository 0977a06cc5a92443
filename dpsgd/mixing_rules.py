"""Rules of the operations that combine elements along some dimensions (reductions, scans, sorts, softmax,
normalization, matrix products, attention, convolution, pooling, recurrent layers, losses): the output is mixed
where such a dimension carries examples, and keeps the example axes elsewhere.

:data:`MIXING_RULES` maps each operation's ATen name to its rule; :data:`dpsgd.rules.RULES` gathers it with
:mod:`dpsgd.layout_rules`'.  A rule is ``rule(func, args, kwargs, out, rows) -> [Rows]`` (:mod:`dpsgd.rows`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten

from .rows import Rows, dims_arg, merge_axes, mixed_rows, norm_dim, op_name, pointwise_rule, same_examples

__all__ = ["MIXING_RULES"]

aten = torch.ops.aten


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
            dims = dims_arg(raw, n)
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
    dim = norm_dim(raw, max(n, 1))
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

#: the rule of each operation that combines elements along some dimensions, by ATen name
MIXING_RULES: dict[str, Callable] = {}
for _n, (_d, _k) in _REDUCE.items():
    MIXING_RULES[_n] = _reduction(_d, _k)
for _n in _SCAN:
    MIXING_RULES[_n] = _reduction(_SCAN_DIM.get(_n, 1), None, scan=True)
MIXING_RULES["roll"] = lambda func, args, kwargs, out, rows: _reduction(
    2 if len(args) > 2 and args[2] not in (None, [], ()) else None, None, scan=True)(
    func, args, kwargs, out, rows)
MIXING_RULES.update({
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
    "nll_loss_forward": _nll_loss, "nll_loss2d_forward": _nll_loss, "nll_loss_nd": _nll_loss,
    "topk": _topk, "sort": _topk, "argsort": _topk, "kthvalue": _topk, "_pack_padded_sequence": _packed,
})
for _n in ("avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
           "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
           "adaptive_avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool1d",
           "adaptive_max_pool2d", "adaptive_max_pool3d", "max_pool1d_with_indices", "lp_pool1d", "lp_pool2d",
           "upsample_nearest1d", "upsample_nearest2d", "upsample_bilinear2d", "upsample_nearest3d",
           "_upsample_nearest_exact2d", "upsample_bicubic2d", "upsample_linear1d"):
    MIXING_RULES[_n] = _pool
for _n in ("lstm", "gru", "rnn_tanh", "rnn_relu", "mkldnn_rnn_layer", "_cudnn_rnn", "miopen_rnn"):
    MIXING_RULES[_n] = _rnn
for _n in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "soft_margin_loss", "kl_div", "poisson_nll_loss"):
    MIXING_RULES[_n] = _elementwise_loss

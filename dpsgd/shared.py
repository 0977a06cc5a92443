r"""Outputs shared by the batch: per-example gradients of a tensor every example reads.

Some handled modules run on something other than the batch: positions ``wpe(torch.arange(T))``, T5's relative
position bias ``relative_attention_bias(buckets)``, PEFT's prompt-tuning embedding, a parameter of the model
itself (CLIP's ``logit_scale``).  Their output ``y`` has no batch dimension; example ``i``'s loss reads it where
the model combines it with example ``i``'s rows (``x_i + y``, ``scores_i + bias``, ``y.repeat(B, 1, 1)[i]``), so
example ``i``'s gradient of ``y`` is the part of the gradient that flows back through *its* rows there.

:class:`SharedOutput` marks such an output (a tensor subclass: only operations on it are intercepted, nothing
else in the model).  Operations that keep it away from the batch (``permute``, ``unsqueeze``, a mask without a
batch dimension) keep the mark; the first operation that *meets* the batch is rewritten so that the shared
operand ``s`` enters it explicitly expanded, ``s_b = s.expand(B, ...)`` (the same values, so the forward is
unchanged).  Row ``i`` of ``s_b``'s gradient is then example ``i``'s gradient of ``s``, summed over the
positions that broadcast: a tensor hook reads it during the backward and carries it back to ``y`` through the
operations in between (one batched vector-Jacobian product, :class:`Share`).  Supported meetings:

* elementwise arithmetic that broadcasts (``+ - * /``, in place too, ``torch.where``, ...);
* ``matmul`` / ``@`` with a batched operand (the shared one expanded along the batch dimensions);
* ``expand``, ``expand_as``, ``broadcast_to`` and ``repeat`` of the shared tensor to the batch size;
* ``F.scaled_dot_product_attention`` with a shared ``attn_mask`` (T5's relative position bias);
* any other operation whose single output has the batch first: example ``i``'s gradient by a
  vector-Jacobian product of that operation with the output gradient's row ``i`` only (``B`` products).

An output that meets the batch *row-aligned* (its leading dimension is the batch and it is combined row by
row, as BART's batch-expanded positions) was per-example after all: its call is then read as an ordinary
batched call.  The engine checks every step that the per-example gradients add up to the gradient of the
summed loss with respect to ``y`` (a path around the meetings would not), and the row check watches the
expanded tensors' rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_flatten, tree_map

from .materialized import quiet_batching

__all__ = ["SharedOutput", "Share", "share_output", "carrying_back"]

_T = torch.Tensor
_ELEMENTWISE = {
    torch.add, torch.sub, torch.subtract, torch.mul, torch.multiply, torch.div, torch.divide, torch.true_divide,
    torch.where, torch.maximum, torch.minimum, torch.addcmul, torch.addcdiv, torch.lerp,
    _T.add, _T.add_, _T.sub, _T.sub_, _T.mul, _T.mul_, _T.div, _T.div_, _T.__add__, _T.__radd__, _T.__iadd__,
    _T.__sub__, _T.__rsub__, _T.__isub__, _T.__mul__, _T.__rmul__, _T.__imul__, _T.__truediv__, _T.__rtruediv__,
    _T.__itruediv__, _T.where,
}
_MATMUL = {torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__}
_EXPAND = {_T.expand, _T.expand_as, _T.broadcast_to, torch.broadcast_to}
# a generic meeting holds B copies of the output gradient at most this many elements at once
_GENERIC_CHUNK = 1 << 25


_CARRYING = [0]


def carrying_back() -> bool:
    """Whether a backward running now carries per-example gradients of a shared output back (batched over the
    examples): tensor hooks that inspect gradients leave those alone."""
    return _CARRYING[0] > 0


def _vjp(out, inp, grads) -> torch.Tensor | None:
    """Per-example vector-Jacobian products (``grads`` batched along dimension 0) of ``out`` with respect to
    ``inp``, through the recorded graph, which is kept."""
    _CARRYING[0] += 1
    try:
        with DisableTorchFunctionSubclass(), quiet_batching():
            return torch.autograd.grad(out, inp, grads, is_grads_batched=True, retain_graph=True,
                                       allow_unused=True)[0]
    finally:
        _CARRYING[0] -= 1


class Share:
    """One shared call's outputs ``ys`` and the per-example gradients ``(B, *y.shape)`` its meetings send back in
    the backward running now.

    ``aligned`` is set when an output met the batch row by row (it was per-example after all); ``meetings``
    holds the batched tensors where it met the batch (their rows are examples: the row check watches them).
    """

    def __init__(self, name: str, ys: list[torch.Tensor], b: int) -> None:
        self.name, self.ys, self.b = name, ys, b
        self.aligned = False
        self.meetings: list[torch.Tensor] = []
        self.ops: list[str] = []
        self.acc: list[torch.Tensor | None] = [None] * len(ys)

    def add(self, t: torch.Tensor, per: torch.Tensor) -> None:
        """Example ``i``'s gradient of ``t`` (a tensor computed from the outputs) is ``per[i]``: carry it back."""
        for j, y in enumerate(self.ys):
            if t is y:
                g = per
            else:
                g = _vjp(t, y, per.to(t.dtype))
            if g is not None:
                self.acc[j] = g if self.acc[j] is None else self.acc[j] + g

    def reset(self) -> None:
        self.acc = [None] * len(self.ys)

    def take(self) -> list[torch.Tensor | None]:
        acc, self.acc = self.acc, [None] * len(self.ys)
        return acc


class SharedOutput(torch.Tensor):
    """A tensor computed from outputs shared by the batch (``_dp_shares``), until it meets the batch."""

    _dp_shares: tuple = ()

    @property
    def shared(self) -> bool:
        """Whether it still carries shares (it has not met the batch)."""
        return bool(self._dp_shares)

    @classmethod
    @torch.compiler.disable   # followed eagerly inside a torch.compile'd model (a graph break per operation)
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        shared = [t for t in leaves if isinstance(t, SharedOutput) and t._dp_shares]
        with DisableTorchFunctionSubclass():
            if not shared or not torch.is_grad_enabled() or _metadata(func):
                return func(*args, **kwargs)
            shares = tuple(dict.fromkeys(s for t in shared for s in t._dp_shares))
            b = shares[0].b
            batched = any(isinstance(t, torch.Tensor) and not isinstance(t, SharedOutput) and t.dim() > 0
                          and t.shape[0] == b for t in leaves)
            if batched and func in _ELEMENTWISE:
                out = _elementwise(func, args, kwargs, leaves, b)
            elif batched and func in _MATMUL and len(args) == 2 and not kwargs:
                out = _matmul(func, args, b)
            elif batched and func is F.scaled_dot_product_attention:
                out = _attention(args, kwargs, b)
            elif not batched and func in _EXPAND:
                out = _expanded(func(*args, **kwargs), args[0], b)
            elif not batched and func is _T.repeat:
                out = _repeat(args, b)
            else:
                out = func(*args, **kwargs)
                if batched:
                    out = _generic(func, out, shared, b)
            return tree_map(lambda r: _mark(r, shares), out)


# attributes that compute a new tensor from this one (the rest, such as ``_base`` or ``grad``, are read as they are)
_COMPUTED_ATTRIBUTES = {"T", "mT", "H", "mH", "real", "imag"}


def _metadata(func) -> bool:
    """Whether ``func`` reads an attribute of the tensor rather than computing from it."""
    return getattr(func, "__name__", "") == "__get__" and \
        getattr(getattr(func, "__self__", None), "__name__", "") not in _COMPUTED_ATTRIBUTES


def _mark(r: object, shares: tuple) -> object:
    """``r`` as a :class:`SharedOutput` of ``shares`` if it still carries them (requires grad, has not met the
    batch), else unchanged."""
    if not isinstance(r, torch.Tensor) or not r.requires_grad or getattr(r, "_dp_met", False):
        return r
    if isinstance(r, SharedOutput):
        r._dp_shares = tuple(dict.fromkeys(r._dp_shares + shares))
        return r
    m = r.as_subclass(SharedOutput)
    m._dp_shares = shares
    return m


def share_output(out: torch.Tensor, share: Share) -> SharedOutput:
    """``out`` (a shared call's output) marked with its share, for the rest of the forward to use."""
    with DisableTorchFunctionSubclass():
        return _mark(out, (share,))


def _broadcast(shape: torch.Size, target: tuple) -> tuple | None:
    """``shape`` padded on the left to ``len(target)`` if it broadcasts *along* the batch dimension of ``target``
    (its leading size is 1 there), else ``None`` (it has the batch dimension itself)."""
    if len(shape) > len(target):
        return None
    al = (1,) * (len(target) - len(shape)) + tuple(shape)
    return al if al[0] == 1 else None


def _meet(s: torch.Tensor, target: tuple, b: int) -> torch.Tensor:
    """``s`` expanded to ``target`` (batch first), with a hook sending each example's summed gradient back."""
    al = _broadcast(s.shape, target)
    s_b = s.expand(target)
    shares = s._dp_shares
    shape = s.shape

    def hook(grad):
        if carrying_back():
            return
        per = grad.sum_to_size((b, *al[1:])).reshape(b, *shape)
        for share in shares:
            share.add(s, per)
    s_b.register_hook(hook)
    for share in shares:
        share.meetings.append(s_b)
    return s_b


def _mark_aligned(shared: list) -> None:
    for t in shared:
        for share in t._dp_shares:
            share.aligned = True


def _elementwise(func, args, kwargs, leaves, b):
    target = tuple(torch.broadcast_shapes(*(t.shape for t in leaves if isinstance(t, torch.Tensor))))
    if not target or target[0] != b:
        return func(*args, **kwargs)
    aligned = []

    def swap(x):
        if isinstance(x, SharedOutput) and x._dp_shares and x.requires_grad:
            if _broadcast(x.shape, target) is None:
                aligned.append(x)
                return x
            return _meet(x, target, b)
        return x
    args, kwargs = tree_map(swap, (args, kwargs))
    _mark_aligned(aligned)
    out = func(*args, **kwargs)
    _met(out)
    return out


def _matmul(func, args, b):
    """``x @ s`` or ``s @ x`` with ``x`` batched (at least 3-D) and ``s`` shared (at least 2-D): ``s`` expanded along
    the batch dimensions of the product."""
    if min(t.dim() for t in args) < 2:
        return func(*args)
    batch = tuple(torch.broadcast_shapes(args[0].shape[:-2], args[1].shape[:-2]))
    if not batch or batch[0] != b:
        return func(*args)
    new = []
    for t in args:
        target = (*batch, *t.shape[-2:])
        if not (isinstance(t, SharedOutput) and t._dp_shares and t.requires_grad):
            new.append(t)
        elif _broadcast(t.shape, target) is None:
            _mark_aligned([t])
            new.append(t)
        else:
            new.append(_meet(t, target, b))
    out = func(*new)
    _met(out)
    return out


def _expanded(out, s, b):
    if not (isinstance(out, torch.Tensor) and out.dim() and out.shape[0] == b and s.requires_grad
            and _broadcast(s.shape, tuple(out.shape)) is not None):
        return out
    out = _meet(s, tuple(out.shape), b)
    _met(out)
    return out


def _repeat(args, b):
    s, *reps = args
    reps = tuple(reps[0]) if len(reps) == 1 and isinstance(reps[0], (tuple, list, torch.Size)) else tuple(reps)
    al = _broadcast(s.shape, reps) if len(reps) >= s.dim() else None
    if not reps or reps[0] != b or al is None or not s.requires_grad:
        return s.repeat(reps)
    t = s.reshape(al).repeat((1, *reps[1:]))   # everything but the batch repetition
    t = _mark(t, s._dp_shares)
    out = _meet(t, (b, *t.shape[1:]), b).clone(memory_format=torch.contiguous_format)
    _met(out)
    return out


def _attention(args, kwargs, b):
    """``F.scaled_dot_product_attention`` with a shared additive mask (T5's position bias): the mask expanded to
    ``(B, heads, L, S)``."""
    bound = dict(zip(("query", "key", "value", "attn_mask"), args, strict=False))
    bound.update(kwargs)
    mask, q, k = bound.get("attn_mask"), bound["query"], bound["key"]
    if isinstance(mask, SharedOutput) and mask._dp_shares and mask.requires_grad:
        target = (*q.shape[:-1], k.shape[-2])
        if _broadcast(mask.shape, target) is None:
            _mark_aligned([mask])
        else:
            bound["attn_mask"] = _meet(mask, target, b)
    if any(isinstance(t, SharedOutput) and t._dp_shares and t.requires_grad for n, t in bound.items()
           if n != "attn_mask"):
        out = F.scaled_dot_product_attention(*args, **kwargs)
        return _generic(F.scaled_dot_product_attention, out, [t for t in bound.values() if isinstance(t, SharedOutput)],
                        b)
    out = F.scaled_dot_product_attention(**bound)
    _met(out)
    return out


def _met(out: object) -> None:
    """Flag results of a meeting: they carry the batch, not the shares."""
    for r in tree_flatten(out)[0]:
        if isinstance(r, torch.Tensor):
            try:
                r._dp_met = True
            except (AttributeError, RuntimeError):
                pass


def _generic(func, out, shared: list, b: int):
    """Any other meeting with a single batch-first output: example ``i``'s gradient of each shared operand is the
    operation's vector-Jacobian product with row ``i`` of the output gradient."""
    if not (isinstance(out, torch.Tensor) and out.dim() and out.shape[0] == b and out.requires_grad):
        return out
    operands = [t for t in dict.fromkeys(shared) if t.requires_grad]
    for t in operands:
        if _broadcast(t.shape, tuple(out.shape)) is None and t.dim() == out.dim():
            _mark_aligned([t])
            return out

    def hook(grad):
        if carrying_back():
            return
        rows = max(1, _GENERIC_CHUNK // max(grad.numel(), 1))
        for t in operands:
            parts = []
            for start in range(0, b, rows):
                idx = torch.arange(start, min(b, start + rows), device=grad.device)
                mask = torch.zeros(len(idx), b, dtype=grad.dtype, device=grad.device)
                mask[torch.arange(len(idx)), idx] = 1
                masked = grad.unsqueeze(0) * mask.reshape(len(idx), b, *([1] * (grad.dim() - 1)))
                g = _vjp(out, t, masked)
                parts.append(torch.zeros(len(idx), *t.shape, dtype=t.dtype, device=t.device) if g is None else g)
            per = torch.cat(parts)
            for share in t._dp_shares:
                share.add(t, per)
    out.register_hook(hook)
    for t in operands:
        for share in t._dp_shares:
            share.meetings.append(out)
            share.ops.append(getattr(func, "__name__", str(func)))
    _met(out)
    return out

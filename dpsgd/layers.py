r"""Per-layer handlers: how a module's parameters enter per-example norms and the clipped gradient sum.

A handler sees one recorded call of a module (:class:`Call`: its inputs, the gradients of the loss with
respect to its outputs, and the alias each parameter had during that call) and answers, per parameter:

* :meth:`Handler.sq_norms`: the (estimated) squared norm ``||g_i||^2`` of example ``i``'s gradient;
* :meth:`Handler.per_example`: the per-example gradients themselves, as ``(B, rows, cols)`` matrices, or
  their right projections ``(B, rows, k)`` onto a given ``cols x k`` matrix ``P`` (used when one parameter
  receives gradient from several calls, e.g. tied embeddings: the norm must be that of the *summed*
  per-example gradient, so every use is projected with the same ``P``);
* :meth:`Handler.clipped_sum`: ``sum_i c_i g_i`` from the same inputs (book-keeping: no second backward,
  and the contribution that was clipped is exactly the one that was normed);
* :meth:`Handler.terms`: how many ``chi2(k)/k`` terms the parameter's estimate mixes (the envelope's
  ``d``), or ``None`` when it is computed exactly (a point mass in the estimate's law).

:data:`HANDLERS` maps module types to handlers (:func:`register_handler` adds one, like Opacus' registry).
Built in:

* ``nn.Linear`` and GPT-2's ``Conv1D``: the estimator on ``(A, G)``; weight ``min(d_in, d_out)`` terms,
  bias 1;
* ``nn.Embedding``: token-id sums of ``G`` rows; ``min(V, p)`` terms under ``hutch``, exact otherwise;
* ``nn.Conv1d`` / ``nn.Conv2d`` (``groups=1``): a linear map on patches, weight ``min(C_out, C_in k)``
  terms, bias 1 (:class:`ConvHandler`); grouped convolutions exact by ``torch.func``;
* ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``: exact in closed form (:class:`NormalizationHandler`);
  Hugging Face's ``*RMSNorm`` modules likewise, checked per call (:class:`ScaledRMSNormHandler`);
* ``nn.MultiheadAttention``: exact by ``torch.func``, over all its parameters including ``out_proj`` (used
  outside ``out_proj.forward``);
* anything else with parameters of its own: exact by ``torch.func`` (point masses).

Modules that ``torch.distributed.fsdp.fully_shard`` wrapped get the handler of their original class
(:func:`module_type`).  The exact fallback (:class:`FunctionalHandler`) re-runs the module per example
with ``torch.func`` on the recorded inputs; it supports tuple outputs (LSTM, GRU, attention) and keyword
arguments, refuses randomness inside the module (dropout), whose per-example re-run would not reproduce
the forward, and refuses a module whose re-run on one example differs from its batched output (it mixes
examples).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from .estimators import ESTIMATORS, gaussian_projection
from .validator import UnsupportedModuleError

__all__ = ["Call", "Handler", "is_parameter_container", "LinearHandler", "EmbeddingHandler", "FunctionalHandler",
           "HANDLERS", "register_handler", "handler_for", "is_conv1d", "compute_dtype", "flat_tensors", "matrix_view",
           "ConvHandler", "NormalizationHandler", "segment_sum",
           "RootParameterHandler", "ROOT_PARAMETERS", "MaterializedHandler", "quiet_batching", "per_leaf",
           "secret_seed", "full_float32", "weighted_products", "wide_kernel_available",
           "ParametrizedHandler", "ScaledRMSNormHandler", "is_scaled_rmsnorm", "module_type"]


@contextlib.contextmanager
def full_float32():
    """float32 matrix products and convolutions in full precision (no TF32) while norms and clipped sums are
    formed: TF32 rounds float32 inputs to 10 bits, more than the clip bound's rounding margin allows."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    # torch's precision settings, or on a torch that predates them its TF32 switches
    names = ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    old = getattr(matmul, names[0]), getattr(cudnn, names[0])
    setattr(matmul, names[0], names[1])
    setattr(cudnn, names[0], names[1])
    try:
        yield
    finally:
        setattr(matmul, names[0], old[0])
        setattr(cudnn, names[0], old[1])


def weighted_products(left: torch.Tensor, right: torch.Tensor, weights: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    r"""``sum_i w_i left_i^T right_i`` in ``dtype`` (float32 or float64) for ``left`` ``(B, T, m)`` and ``right``
    ``(B, T, n)`` in any floating dtype; wide copies of the inputs, if any, are made for this product only.

    On CUDA, half-precision inputs are multiplied one example at a time by a half-precision kernel with a float32
    result (``torch.mm(..., out_dtype=torch.float32)``, where :func:`wide_kernel_available`: the product of two
    bf16 or fp16 numbers is exact in float32, so this is float32 arithmetic on the same inputs at the
    half-precision kernel's speed), and each example's weight is applied in
    float32 after its product: a weight applied to half-precision rows would be rounded with them, and the clipped
    contribution could exceed ``C``.  Otherwise one contraction of wide copies, made for this product only, with
    the weights folded into the narrower side (an output head's ``B x T x V`` gradient is not copied to be
    weighted: its ``B x T x d`` inputs are).

    >>> import torch
    >>> a, g = torch.randn(3, 5, 4).bfloat16(), torch.randn(3, 5, 2).bfloat16()
    >>> w = torch.tensor([1.0, 0.5, 0.0])
    >>> s = weighted_products(g, a, w, torch.float32)
    >>> ref = torch.einsum("b,bto,bti->oi", w, g.float(), a.float())
    >>> s.dtype, bool(torch.allclose(s, ref))
    (torch.float32, True)
    """
    if not (left.dtype == right.dtype and left.is_cuda and wide_kernel_available(left.device, left.dtype)
            and dtype == torch.float32):   # wide copies of this layer's inputs, for this product only
        w = weights.to(dtype)[:, None, None]
        if left.shape[2] <= right.shape[2]:
            return torch.einsum("btm,btn->mn", left.to(dtype) * w, right.to(dtype))
        return torch.einsum("btm,btn->mn", left.to(dtype), right.to(dtype) * w)
    out = torch.zeros(left.shape[2], right.shape[2], dtype=dtype, device=left.device)
    weights = weights.to(left.device, dtype)
    for i in range(left.shape[0]):   # the weight as a device scalar: no synchronization per example
        out.add_(torch.mm(left[i].T, right[i], out_dtype=torch.float32).mul_(weights[i]))
    return out


_WIDE_KERNELS: dict = {}


def wide_kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` exists for ``dtype`` on ``device`` and equals float32
    arithmetic on the same inputs (probed once per device and dtype, on fixed inputs)."""
    key = (str(device), dtype)
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    if key not in _WIDE_KERNELS:
        g = torch.Generator().manual_seed(0)
        # the layout of its use: a transposed slice of the output gradients times a slice of the inputs
        xt, y = (torch.randn(shape, generator=g).to(dtype) for shape in ((512, 64), (512, 48)))
        x = xt.T
        ref = x.double() @ y.double()
        try:
            with full_float32():
                got = torch.mm(xt.to(device).T, y.to(device), out_dtype=torch.float32).double().cpu()
            _WIDE_KERNELS[key] = bool(((got - ref).abs() <= 1e-5 * (x.double().abs() @ y.double().abs())).all())
        except (RuntimeError, NotImplementedError, TypeError):
            _WIDE_KERNELS[key] = False
    return _WIDE_KERNELS[key]


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32, or float64 when any input is float64: norms and sums are never formed in half precision."""
    dtype = torch.float32
    for t in tensors:
        if t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


@dataclass(eq=False)
class Call:
    """One recorded call of a module during a captured forward.

    Attributes
    ----------
    module : torch.nn.Module
    args, kwargs
        The call's inputs (tensors detached).
    outputs : list of torch.Tensor
        Its tensor outputs (flattened), as the rest of the model saw them.
    aliases : dict
        Parameter name (relative to ``module``) to the leaf tensor that stood in for it during the call.
    batch_size : int
        ``B`` of the forward the call belongs to.
    grads : list
        Gradients of the loss with respect to ``outputs`` (``None`` where unused), set by the engine.
    """

    module: nn.Module
    args: tuple
    kwargs: dict
    outputs: list
    aliases: dict
    batch_size: int
    grads: list = field(default_factory=list)
    cache: dict = field(default_factory=dict)


class Handler:
    """How one kind of module contributes per-example norms and clipped sums (see the module docstring)."""

    #: the handler covers the parameters of the module's submodules too (they are not hooked separately)
    recursive: bool = False
    #: the handler reads the call's output values (not only their gradients): an output added to in place after
    #: the call (``out += y``) is then refused, else accepted (its gradient is unchanged by the addition)
    reads_output: bool = True

    def needs_weights(self, module: nn.Module) -> bool:
        """Whether the handler reads the parameters' values after the backward (not only the recorded
        activations and output gradients): FSDP frees gathered parameters after use, so those are copied."""
        return False

    def parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """The trainable parameters this handler covers, by name relative to ``module``: its own, and those of
        its ``nn.ParameterDict`` / ``nn.ParameterList`` children, which are never called themselves (PEFT keeps
        IA3's scales and LoRA's embedding factors in them and uses them in the parent's forward)."""
        own = {n: p for n, p in module.named_parameters(recurse=self.recursive) if p.requires_grad}
        if not self.recursive:
            for name, child in module.named_children():
                if isinstance(child, _PARAMETER_CONTAINERS):
                    own.update({f"{name}.{n}": p for n, p in child.named_parameters() if p.requires_grad})
        return own

    def terms(self, module: nn.Module, name: str, estimator: str) -> int | None:
        """Chi-square terms of the parameter's estimate under ``estimator``, or ``None`` when exact."""
        raise NotImplementedError

    def sq_norms(self, call: Call, name: str, estimator: str, k: int, generator) -> torch.Tensor:
        raise NotImplementedError

    def per_example(self, call: Call, name: str, projection: torch.Tensor | None) -> torch.Tensor:
        """Example ``i``'s gradient ``M_i`` of parameter ``name`` in this call, as a ``rows x cols`` matrix
        (:func:`matrix_view`), times ``projection`` (``cols x k``, or ``B x cols x k``: one per example) when given."""
        raise NotImplementedError

    def unit_sq_norms(self, call: Call, name: str, estimator: str, k: int, generator, groups: torch.Tensor,
                      units: int) -> torch.Tensor | None:
        """User-level privacy: the (estimated) squared norm of each unit's summed gradient ``sum_{i in u} M_i``
        (``(U,)``; ``groups[i]`` is row ``i``'s unit), for a parameter with this one call; ``None`` (the default)
        lets the engine sum each unit's per-example products (:meth:`per_example`) instead.  An override must keep
        the estimate's law (the chi-square terms :meth:`terms` counts) for the summed gradient."""
        return None

    def transposed_product(self, call: Call, name: str, y: torch.Tensor) -> torch.Tensor:
        """``M_i^T y_i`` for ``y`` of shape ``B x rows x k`` (Hutch++ on a parameter with several calls).  By default
        from the materialized ``M_i``; handlers that can, override it with products that never form ``M_i``."""
        m = self.per_example(call, name, None)
        return torch.matmul(m.transpose(1, 2), y.to(m.dtype))

    def clipped_sum(self, call: Call, name: str, weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def check_forward(self, call: Call) -> None:
        """Called on each recorded call right after its forward (values not yet modified by the model): raise if
        the handler cannot read this call.  Nothing by default."""

    def reruns(self, module: nn.Module) -> bool:
        """Whether per-example gradients come from re-running the module (``torch.func``): randomness inside
        it would then not be reproduced (the validator refuses dropout there)."""
        return False

    def flattened_rows(self, module: nn.Module) -> bool:
        """Whether the handler reads a call whose rows flatten the batch example-major (``(B * T, d)``, as OPT
        and many mixture-of-experts layers run) as ``B`` examples of ``T`` rows each."""
        return False


HANDLERS: dict[type, Handler] = {}

#: parameter containers: never called, so their parameters belong to the parent module's handler
_PARAMETER_CONTAINERS = (nn.ParameterDict, nn.ParameterList)


def is_parameter_container(module: nn.Module) -> bool:
    """Whether ``module`` only holds parameters for its parent (``nn.ParameterDict``, ``nn.ParameterList``)."""
    return isinstance(module, _PARAMETER_CONTAINERS)


def register_handler(module_type: type, handler: Handler | None = None):
    """Use ``handler`` for modules of exactly ``module_type``; usable as a class decorator.

    A registered handler's ``terms`` decide the envelope: return the number of ``chi2(k)/k`` terms its
    estimate mixes, or ``None`` for exact norms.

    Examples
    --------
    >>> from torch import nn
    >>> from dpsgd.layers import HANDLERS, FunctionalHandler, register_handler
    >>> _ = register_handler(nn.Bilinear, FunctionalHandler())
    >>> nn.Bilinear in HANDLERS
    True
    >>> del HANDLERS[nn.Bilinear]
    """
    if handler is not None:
        HANDLERS[module_type] = handler
        return handler

    def wrap(cls):
        HANDLERS[module_type] = cls()
        return cls
    return wrap


def module_type(module: nn.Module) -> type:
    """The module's class, or for a module that ``torch.distributed.fsdp.fully_shard`` wrapped (whose class
    it replaces by ``FSDP<Class>(FSDPModule, Class)``), the original class."""
    bases = type(module).__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule":
        return bases[1]
    return type(module)


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` (transformers), recognised by name and weight layout, without importing it."""
    return module_type(module).__name__ == "Conv1D" and hasattr(module, "weight") and module.weight.dim() == 2


def matrix_view(shape: tuple | torch.Size) -> tuple[int, int]:
    """A parameter's shape as the ``rows x cols`` matrix its per-example gradient is projected as:
    ``(shape[0], rest)`` for 2 or more dimensions (a convolution's weight is ``C_out x C_in k``), else
    ``(1, numel)``."""
    n = math.prod(shape)
    if len(shape) >= 2:
        return shape[0], n // max(shape[0], 1)
    return 1, n


def _bias_sq_norms(s: torch.Tensor, estimator: str, k: int, generator) -> torch.Tensor:
    """A bias's norms: a linear layer with ``A = 1``, whose example ``i`` has the ``1 x p`` gradient ``s_i``,
    the sum of ``G_i``'s rows (one chi-square term under the randomized estimators)."""
    ones = torch.ones(s.shape[0], 1, 1, device=s.device, dtype=s.dtype)
    fn = ESTIMATORS[estimator]
    return fn(ones, s.unsqueeze(1)) if estimator in ("exact", "ghost") else fn(ones, s.unsqueeze(1), k, generator)


def segment_sum(t: torch.Tensor, groups: torch.Tensor, units: int) -> torch.Tensor:
    """``out[u] = sum_{i : groups[i] = u} t[i]``: per-row tensors summed per unit (``(U, *t.shape[1:])``).

    Examples
    --------
    >>> import torch
    >>> from dpsgd.layers import segment_sum
    >>> segment_sum(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1, 0, 1]), 2)
    tensor([2., 5.])
    """
    out = torch.zeros(units, *t.shape[1:], device=t.device, dtype=t.dtype)
    return out.index_add_(0, groups.to(t.device), t)


def _regrouped(x: torch.Tensor, groups: torch.Tensor, units: int) -> torch.Tensor | None:
    """``(B, T, d)`` rows regrouped as ``(U, R T, d)``: each unit's rows laid end to end along the token dimension
    (zero rows pad a unit to the largest one's ``R``), so a unit's summed gradient ``sum_i A_i^T G_i`` is one
    example's ``A_u^T G_u``; ``None`` when padding would more than double the rows (very uneven units)."""
    b = x.shape[0]
    counts = torch.bincount(groups, minlength=units)
    most = int(counts.max()) if b else 0
    if units * most > 2 * b:
        return None
    order = torch.argsort(groups, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(groups)
    pos[order] = torch.arange(b, device=groups.device) - starts[groups[order]]
    out = torch.zeros(units, most, *x.shape[1:], device=x.device, dtype=x.dtype)
    out[groups, pos] = x
    return out.reshape(units, -1, x.shape[-1])


def _as_btd(x: torch.Tensor, b: int) -> torch.Tensor:
    """``(B, ..., d)`` as ``(B, T, d)`` (every middle dimension is a token dimension of a linear map)."""
    return x.reshape(b, -1, x.shape[-1])


def _single_grad(call: Call, what: str) -> torch.Tensor:
    g = call.grads[0] if call.grads else None
    if g is None:
        raise RuntimeError(f"no output gradient recorded for {what}")
    return g


class LinearHandler(Handler):
    """``nn.Linear`` (weight ``d_out x d_in``) and GPT-2's ``Conv1D`` (weight ``d_in x d_out``).

    Weight: the chosen estimator on ``(A, G)`` (projected along the larger side, ``min(d_in, d_out)``
    chi-square terms); bias: a linear layer with ``A = 1`` (one term).  The clipped sum is
    ``A^T diag(c) G`` per weight and ``G^T c`` per bias.
    """

    reads_output = False

    def check_forward(self, call):
        """A subclass of ``nn.Linear`` with a forward of its own (Falcon's ``FalconLinear``: ``x @ W.T + b``) is read
        as a linear layer once its output is checked against ``x W^T + b`` along a random direction ``r`` (two
        matrix-vector products per call), so a forward that computes something else is refused, not misread."""
        m = call.module
        if not isinstance(m, nn.Linear) or type(m).forward is nn.Linear.forward:
            return
        if len(call.outputs) != 1:
            raise UnsupportedModuleError(
                getattr(call.cache.get("unit"), "path", type(m).__name__),
                f"{type(m).__name__} subclasses nn.Linear but returns {len(call.outputs)} tensors, so the linear "
                f"handler cannot read it; register a handler for it "
                f"(dpsgd.layers.register_handler({type(m).__name__}, dpsgd.layers.FunctionalHandler()))")
        x, out = call.args[0] if call.args else call.kwargs.get("input"), call.outputs[0].detach()
        w = call.aliases.get("weight", m.weight).detach()
        bias = call.aliases.get("bias", m.bias)
        dtype = compute_dtype(out, x)
        directions = torch.Generator().manual_seed(secret_seed())
        r = torch.randn(out.shape[-1], generator=directions, dtype=dtype).to(out.device)
        lhs = out.to(dtype) @ r
        rhs = x.to(dtype) @ (w.to(dtype).T @ r) + (0 if bias is None else bias.detach().to(dtype) @ r)
        tol = 5e-2 if out.dtype in (torch.float16, torch.bfloat16) or call.cache.get("autocast") else \
            1e-10 if dtype == torch.float64 else 1e-4
        scale = (x.to(dtype).abs() @ (w.to(dtype).T @ r).abs()).clamp_min(1e-30)
        if lhs.shape != rhs.shape or bool(((lhs - rhs).abs() > tol * (scale + lhs.abs())).any()):
            raise UnsupportedModuleError(
                getattr(call.cache.get("unit"), "path", type(m).__name__),
                f"{type(m).__name__} subclasses nn.Linear but its forward does not compute x @ weight.T + bias, so "
                f"the linear handler cannot read it; register a handler for it "
                f"(dpsgd.layers.register_handler({type(m).__name__}, dpsgd.layers.FunctionalHandler()))")

    def _ag(self, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, G)`` as ``(B, T, d)`` and ``(B, T, p)`` in the dtypes the forward's product used; each use widens
        what it reads (:func:`compute_dtype`) for itself only: kept for every layer, wide copies of a bf16 model's
        inputs and output gradients would triple what the step holds."""
        b = call.batch_size
        a, g = _as_btd(call.args[0], b), _as_btd(_single_grad(call, type(call.module).__name__), b)
        state = call.cache.get("autocast")
        if state and state[0] == a.device.type and a.dtype != state[1] and a.is_floating_point():
            a = a.to(state[1])   # the input the forward's product read: autocast rounds it first
        return a, g

    def flattened_rows(self, module):
        return True

    def terms(self, module, name, estimator):
        if estimator not in ("hutch", "hutchpp"):
            return None
        return 1 if name == "bias" else min(module.weight.shape)

    def sq_norms(self, call, name, estimator, k, generator):
        a, g = self._ag(call)
        dtype = compute_dtype(a, g)
        if name == "bias":
            return _bias_sq_norms(g.to(dtype).sum(1), estimator, k, generator)
        a, g = a.to(dtype), g.to(dtype)
        fn = ESTIMATORS[estimator]
        return fn(a, g) if estimator in ("exact", "ghost") else fn(a, g, k, generator)

    def unit_sq_norms(self, call, name, estimator, k, generator, groups, units):
        """The estimator on each unit's rows regrouped along the token dimension (``A_u^T G_u`` is the unit's
        summed gradient, so ghost clipping never materializes it, and ``hutch`` keeps its ``min(d_in, d_out)``
        terms); the bias from each unit's summed output gradients."""
        a, g = self._ag(call)
        dtype = compute_dtype(a, g)
        if name == "bias":
            return _bias_sq_norms(segment_sum(g.to(dtype).sum(1), groups, units), estimator, k, generator)
        a_u, g_u = _regrouped(a.to(dtype), groups, units), _regrouped(g.to(dtype), groups, units)
        if a_u is None:
            return None
        fn = ESTIMATORS[estimator]
        return fn(a_u, g_u) if estimator in ("exact", "ghost") else fn(a_u, g_u, k, generator)

    def per_example(self, call, name, projection):
        a, g = self._ag(call)
        dtype = compute_dtype(a, g)
        conv1d = is_conv1d(call.module)
        if name == "bias":   # (B, 1, d_out)
            s = g.to(dtype).sum(1, keepdim=True)
            return s if projection is None else s @ projection.to(s.dtype)
        # Linear: M = G^T A (d_out x d_in), cols = d_in; Conv1D: M = A^T G (d_in x d_out), cols = d_out
        a, g = a.to(dtype), g.to(dtype)
        left, right = (a, g) if conv1d else (g, a)
        if projection is not None:
            right = right @ projection.to(right.dtype)
        return torch.bmm(left.transpose(1, 2), right)

    def transposed_product(self, call, name, y):
        a, g = self._ag(call)
        dtype = compute_dtype(a, g)
        y = y.to(dtype)
        if name == "bias":   # M_i = the 1 x d_out row sum of G_i
            return torch.matmul(g.to(dtype).sum(1, keepdim=True).transpose(1, 2), y)
        a, g = a.to(dtype), g.to(dtype)
        left, right = (a, g) if is_conv1d(call.module) else (g, a)   # M = left^T right, as in per_example
        return torch.bmm(right.transpose(1, 2), torch.bmm(left, y))

    def clipped_sum(self, call, name, weights):
        a, g = self._ag(call)
        dtype = compute_dtype(a, g)
        if name == "bias":
            return (g.to(dtype) * weights.to(dtype)[:, None, None]).sum((0, 1))
        if is_conv1d(call.module):
            return weighted_products(a, g, weights, dtype)
        return weighted_products(g, a, weights, dtype)


class EmbeddingHandler(Handler):
    r"""``nn.Embedding``: example ``i``'s gradient is ``onehot(idx_i)^T G_i`` (rows at ``padding_idx`` are 0).

    Rows of ``G_i`` (of ``G_i P`` under ``hutch``: ``min(V, p)`` terms) are summed per distinct token id
    with ``index_add``; the ``V x p`` per-example gradient is never formed for the norm.  ``hutchpp`` uses
    the exact index-based norm (its sketch buys nothing here), a point mass in the law, unless the weight is
    tied to another call's (an output head): then Hutch++ sketches the summed gradient through
    :meth:`per_example` and :meth:`transposed_product`, a gather of ``y``'s rows at the token ids.
    """

    reads_output = False

    def _ig(self, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        if "ig" not in call.cache:
            m, b = call.module, call.batch_size
            idx = call.args[0].reshape(b, -1)
            g = _single_grad(call, "Embedding")
            g = g.reshape(b, idx.shape[1], -1).to(compute_dtype(g))
            if m.padding_idx is not None:
                g = g * (idx != m.padding_idx).unsqueeze(-1).to(g.dtype)
            call.cache["ig"] = (idx, g)
        return call.cache["ig"]

    def flattened_rows(self, module):
        return True

    def terms(self, module, name, estimator):
        return min(module.weight.shape) if estimator == "hutch" else None

    def _rows(self, call: Call, g: torch.Tensor, owner: torch.Tensor | None = None):
        """Per (example, token id) sums of ``g``'s rows: the nonzero rows of every per-example gradient (per
        (unit, token id) with ``owner``, each row's unit: the nonzero rows of every unit's summed gradient)."""
        idx, _ = self._ig(call)
        b, v = idx.shape[0], call.module.num_embeddings
        owner = torch.arange(b, device=idx.device) if owner is None else owner.to(idx.device)
        keys = idx + v * owner.unsqueeze(1)
        uniq, inverse = torch.unique(keys.flatten(), return_inverse=True)
        rows = torch.zeros(uniq.numel(), g.shape[-1], device=g.device, dtype=g.dtype)
        rows.index_add_(0, inverse, g.reshape(-1, g.shape[-1]))
        return uniq, rows

    def sq_norms(self, call, name, estimator, k, generator):
        _, g = self._ig(call)
        if estimator == "hutch":
            g = g @ gaussian_projection(g.shape[-1], k, g, generator)
        uniq, rows = self._rows(call, g)
        out = torch.zeros(call.batch_size, device=g.device, dtype=g.dtype)
        return out.index_add_(0, uniq // call.module.num_embeddings, rows.square().sum(1))

    def unit_sq_norms(self, call, name, estimator, k, generator, groups, units):
        """As :meth:`sq_norms`, with rows summed per (unit, token id): never a ``V x p`` matrix per unit."""
        _, g = self._ig(call)
        if estimator == "hutch":
            g = g @ gaussian_projection(g.shape[-1], k, g, generator)
        uniq, rows = self._rows(call, g, groups)
        out = torch.zeros(units, device=g.device, dtype=g.dtype)
        return out.index_add_(0, uniq // call.module.num_embeddings, rows.square().sum(1))

    def per_example(self, call, name, projection):
        _, g = self._ig(call)
        if projection is not None:
            g = g @ projection.to(g.dtype)
        uniq, rows = self._rows(call, g)
        v = call.module.num_embeddings
        out = torch.zeros(call.batch_size * v, g.shape[-1], device=g.device, dtype=g.dtype)
        out[uniq] = rows
        return out.reshape(call.batch_size, v, -1)

    def transposed_product(self, call, name, y):
        idx, g = self._ig(call)   # M_i^T y_i = G_i^T (the rows of y_i at example i's token ids)
        rows = y.to(g.dtype).gather(1, idx.unsqueeze(-1).expand(-1, -1, y.shape[-1]))
        return torch.bmm(g.transpose(1, 2), rows)

    def clipped_sum(self, call, name, weights):
        idx, g = self._ig(call)
        gc = g * weights.to(g.dtype)[:, None, None]
        out = torch.zeros(call.module.weight.shape, device=g.device, dtype=g.dtype)
        return out.index_add_(0, idx.flatten(), gc.reshape(-1, g.shape[-1]))


def _batched(x: object, b: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == b


def per_leaf(x: object, fn) -> object:
    """``fn(leaf)`` for every leaf of a recorded input, in its nesting of tuples and lists (named tuples, such as a
    ``PackedSequence``, keep their type, built field by field without their constructor's checks)."""
    if isinstance(x, tuple) and hasattr(type(x), "_make"):
        return type(x)._make(per_leaf(v, fn) for v in x)
    if isinstance(x, (tuple, list)):
        return type(x)(per_leaf(v, fn) for v in x)
    return fn(x)


def _leading(x: object, b: int) -> object:
    """Batch dimensions of a recorded input (nested tuples and lists too): 0 for a tensor whose leading
    dimension is the batch, ``None`` for anything passed whole."""
    return per_leaf(x, lambda t: 0 if _batched(t, b) else None)


def _tree(fn, x: object, d: object) -> object:
    """``fn(leaf, dim)`` over an input and its batch dimensions (same nesting); leaves without one unchanged."""
    if isinstance(x, (tuple, list)):
        if not isinstance(d, (tuple, list)):
            d = (d,) * len(x)
        items = (_tree(fn, v, e) for v, e in zip(x, d, strict=True))
        return type(x)._make(items) if isinstance(x, tuple) and hasattr(type(x), "_make") else type(x)(items)
    return x if d is None or not isinstance(x, torch.Tensor) else fn(x, d)


@dataclass
class ExampleInputs:
    """A recorded call's inputs as the exact fallback re-runs them per example.

    ``args`` and ``kwargs`` (a dict) with their batch dimensions ``arg_dims`` / ``kw_dims`` (same nesting; ``None``
    where an input is shared by the batch), and ``fix(args, kwargs) -> (args, kwargs)``, applied to one
    example's inputs (batch dimension of size 1) before the re-run.
    """

    args: tuple
    kwargs: dict
    arg_dims: tuple
    kw_dims: dict
    fix: object = None


class MaterializedHandler(Handler):
    """A handler that forms each example's gradient of every parameter (``_grads(call)``: name to ``(B, *shape)``):
    norms, projections and clipped sums are read from them.  Exact (no chi-square terms)."""

    def terms(self, module, name, estimator):
        return None

    def _grads(self, call: Call) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def sq_norms(self, call, name, estimator, k, generator):
        g = self._grads(call)[name]
        return g.reshape(g.shape[0], -1).to(compute_dtype(g)).square().sum(1)

    def per_example(self, call, name, projection):
        g = self._grads(call)[name]
        g = g.reshape(g.shape[0], *matrix_view(g.shape[1:])).to(compute_dtype(g))
        return g if projection is None else g @ projection.to(g.dtype)

    def clipped_sum(self, call, name, weights):
        g = self._grads(call)[name]
        g = g.to(compute_dtype(g))
        return torch.einsum("b...,b->...", g, weights.to(g.dtype))


class FunctionalHandler(MaterializedHandler):
    """Exact per-example gradients of any module by ``torch.func`` (vmap of a vector-Jacobian product).

    Each example's call is re-run on its slice of the recorded inputs (:meth:`inputs`: by default tensor
    arguments whose leading dimension is the batch, in nested tuples too; other arguments are passed whole).
    Valid for modules that treat examples independently and deterministically; the validator refuses those
    that mix examples (batch norm), and randomness inside the re-run raises.
    """

    def needs_weights(self, module):
        return True

    def reruns(self, module):
        return True

    def flattened_rows(self, module):
        return True

    def check_forward(self, call: Call) -> None:
        """A ``PackedSequence`` input is refused: its rows interleave the examples time step by time step (and sort
        them by length), so no row, nor any block of rows, is one example's, and the per-example re-run could not
        slice it."""
        if any(isinstance(x, nn.utils.rnn.PackedSequence) for x in (*call.args, *call.kwargs.values())):
            raise UnsupportedModuleError(
                getattr(call.cache.get("unit"), "path", type(call.module).__name__),
                f"{type(call.module).__name__} got a PackedSequence, whose rows interleave the examples by time "
                f"step, so per-example gradients cannot be read from them; pad instead: pass the padded "
                f"(B, T, features) batch (batch_first=True) and read each example's output at its last valid step "
                f"(out[torch.arange(B), lengths - 1]), or mask the padded steps in the loss")

    def inputs(self, call: Call) -> ExampleInputs:
        """The call's inputs and each one's batch dimension (override for inputs batched elsewhere)."""
        b = call.batch_size
        # a call on B * k rows that flatten the batch example-major reads its inputs with B * k rows so too
        rows = call.outputs[0].shape[0] if call.outputs and call.outputs[0].dim() else b
        flat = rows if rows != b and rows % b == 0 else None

        def dims(x):
            return per_leaf(x, lambda t: 0 if _batched(t, b) or (flat and _batched(t, flat)) else None)
        return ExampleInputs(call.args, dict(call.kwargs), tuple(dims(x) for x in call.args),
                             {n: dims(x) for n, x in call.kwargs.items()})

    def _grads(self, call: Call) -> dict[str, torch.Tensor]:
        if "per_example" not in call.cache:
            call.cache["per_example"] = self._vmap(call)
        return call.cache["per_example"]

    def _vmap(self, call: Call) -> dict[str, torch.Tensor]:
        module, b = call.module, call.batch_size
        params = {n: a.detach() for n, a in call.aliases.items()}
        if "shared_inputs" in call.cache and call.grads and call.grads[0].shape != call.outputs[0].shape:
            return self._shared_vmap(call, params)
        inp = self.inputs(call)
        kw_names = list(inp.kwargs)
        arg_dims, kw_dims = inp.arg_dims, tuple(inp.kw_dims[n] for n in kw_names)
        # every batched input and output split into (B, rows of one example) at its batch dimension: one row per
        # example, or B * k rows that flatten the batch example-major (a mixture-of-experts layer's tokens)
        args = _tree(lambda x, d: x.unflatten(d, (b, -1)), inp.args, arg_dims)
        kw_vals = _tree(lambda x, d: x.unflatten(d, (b, -1)), tuple(inp.kwargs[n] for n in kw_names), kw_dims)
        # only floating-point outputs carry gradient (a router's chosen expert indices do not)
        keep = [j for j, o in enumerate(call.outputs) if o.is_floating_point()]
        out_dims = self._out_dims(call, params, inp, keep)
        grads = [torch.zeros_like(call.outputs[j]) if call.grads[j] is None else call.grads[j] for j in keep]
        grads = tuple(g.unflatten(d, (b, -1)) for g, d in zip(grads, out_dims, strict=True))

        def run(prm, args, kws):
            kws = dict(zip(kw_names, kws, strict=True))
            if inp.fix is not None:
                args, kws = inp.fix(args, kws)
            out = flat_tensors(torch.func.functional_call(module, prm, args, kws, tie_weights=False))
            return tuple(out[j] for j in keep)

        def one(prm, gs, args, kws):
            out, vjp = torch.func.vjp(lambda pp: run(pp, args, kws), prm)
            return vjp(tuple(gs))[0], out

        try:
            with _rerun(call):
                per, outs = torch.func.vmap(one, in_dims=(None, tuple(out_dims), arg_dims, kw_dims))(
                    params, grads, args, kw_vals)
            _check_per_example(call, outs, out_dims, keep)
            return per
        except RuntimeError as err:
            if "random" in str(err):
                unit = call.cache.get("unit")
                raise RuntimeError(f"{getattr(unit, 'path', '') or type(module).__name__} ({type(module).__name__}) "
                                   f"uses randomness (dropout) in training mode inside a module whose per-example "
                                   f"gradients are recomputed exactly; its re-run would not reproduce the forward. "
                                   f"Set its dropout to 0.") from err
        # some kernels have no batching rule (the float64 LSTM) or control flow depends on the data (a mixture of
        # experts' routing): the same computation, one example at a time
        with _rerun(call):
            rows = [one(params, tuple(g.select(d, i) for g, d in zip(grads, out_dims, strict=True)),
                        _tree(lambda x, d, i=i: x.select(d, i), args, arg_dims),
                        _tree(lambda x, d, i=i: x.select(d, i), kw_vals, kw_dims)) for i in range(b)]
        _check_per_example(call, tuple(torch.stack([r[1][j] for r in rows]) for j in range(len(keep))), out_dims,
                           keep)
        return {n: torch.stack([r[0][n] for r in rows]) for n in params}

    def _shared_vmap(self, call: Call, params: dict) -> dict[str, torch.Tensor]:
        """A call whose output is shared by the batch (:mod:`dpsgd.shared`): every example reads the whole output,
        with its own output gradient ``call.grads[j][i]``."""
        args, kwargs = call.cache["shared_inputs"]

        def one(prm, gs):
            _, vjp = torch.func.vjp(
                lambda pp: tuple(flat_tensors(torch.func.functional_call(call.module, pp, args, kwargs,
                                                                         tie_weights=False))), prm)
            return vjp(tuple(gs))[0]

        with _rerun(call):
            try:
                return torch.func.vmap(one, in_dims=(None, 0))(params, tuple(call.grads))
            except RuntimeError as err:
                if "random" in str(err):
                    raise
            rows = [one(params, tuple(g[i] for g in call.grads)) for i in range(call.batch_size)]
        return {n: torch.stack([r[n] for r in rows]) for n in params}

    def _out_dims(self, call: Call, params: dict, inp: ExampleInputs, keep: list[int]) -> list[int]:
        """The batch dimension of each kept output: 0 for a single tensor; else found from one example's call."""
        b = call.batch_size
        if len(call.outputs) == 1:
            return [0]
        args = _tree(lambda x, d: x.unflatten(d, (b, -1)).select(d, 0), inp.args, inp.arg_dims)
        kwargs = {n: _tree(lambda x, d: x.unflatten(d, (b, -1)).select(d, 0), x, inp.kw_dims[n])
                  for n, x in inp.kwargs.items()}
        if inp.fix is not None:
            args, kwargs = inp.fix(args, kwargs)
        with torch.no_grad(), _rerun(call):
            one = flat_tensors(torch.func.functional_call(call.module, params, args, kwargs, tie_weights=False))
        dims = []
        for j in keep:
            full, single = call.outputs[j], one[j]
            cand = [d for d in range(full.dim()) if d < single.dim() and full.shape[d] == b * single.shape[d]
                    and full.shape[:d] + full.shape[d + 1:] == single.shape[:d] + single.shape[d + 1:]]
            if not cand:
                raise ValueError(f"an output of {type(call.module).__name__} has no batch dimension "
                                 f"({tuple(full.shape)} for {b} examples): per-example gradients need one")
            dims.append(cand[0])
        return dims



class ConvHandler(LinearHandler):
    r"""``nn.Conv1d`` / ``nn.Conv2d`` with ``groups=1``: a linear map on patches.

    With ``A_i`` the ``L x (C_in k)`` patches of example ``i`` (``k`` the kernel's size, ``L`` the output
    positions) and ``G_i`` the ``L x C_out`` output gradients, the weight's per-example gradient is
    ``M_i = G_i^T A_i`` (``C_out x C_in k``, the weight's own layout): weight ``min(C_out, C_in k)`` chi-square
    terms, bias 1, as for :class:`LinearHandler`.  Computed without forming ``A`` where possible:

    * ``hutch`` with ``C_in k >= C_out``: ``A_i P`` is a convolution of the input with the ``k'`` filters
      ``P^T`` (``P`` is ``(C_in k) x k'``), so ``||M_i P||^2 = ||G_i^T (A_i P)||^2`` costs one thin convolution
      and a ``C_out x L x k'`` product per example;
    * the clipped sum ``sum_i c_i M_i`` is the convolution's weight gradient for output gradients
      ``c_i G_i`` (the same kernel as the non-private backward);
    * ``exact``, ``ghost``, ``hutchpp`` and several calls of one convolution unfold the patches
      (``F.unfold``) and use the linear estimators.

    Grouped convolutions (``groups > 1``) are computed exactly by ``torch.func`` (:class:`FunctionalHandler`).
    """

    def _grouped(self, module: nn.Module) -> bool:
        return module.groups != 1

    def needs_weights(self, module):
        return self._grouped(module)

    def reruns(self, module):
        return self._grouped(module)

    def flattened_rows(self, module):
        return False

    def _xg(self, call: Call) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """The (explicitly padded) input as a 2-D convolution's ``(B, C_in, H, W)``, ``G`` as ``(B, C_out, L)``,
        and the convolution's ``(kernel, stride, padding, dilation)`` in 2-D."""
        if "xg" not in call.cache:
            m, b = call.module, call.batch_size
            x, g = call.args[0], _single_grad(call, type(m).__name__)
            dtype = compute_dtype(x, g)
            x = x.to(dtype)
            one_d = isinstance(m, nn.Conv1d)
            if isinstance(m.padding, str) or m.padding_mode != "zeros":
                # the module pads explicitly ('same' may be asymmetric; reflect/replicate/circular modes)
                x = F.pad(x, _explicit_padding(m), mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
                padding = (0,) * len(m.kernel_size)
            else:
                padding = m.padding
            if one_d:  # a 1-D convolution is a 2-D one of height 1
                x = x.unsqueeze(2)
                geometry = ((1, *m.kernel_size), (1, *m.stride), (0, *padding), (1, *m.dilation))
            else:
                geometry = (m.kernel_size, m.stride, padding, m.dilation)
            call.cache["xg"] = (x, g.to(dtype).reshape(b, g.shape[1], -1), geometry)
        return call.cache["xg"]

    def _ag(self, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        if "ag" not in call.cache:
            x, g, (kernel, stride, padding, dilation) = self._xg(call)
            a = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)   # (B, C_in k, L)
            call.cache["ag"] = (a.transpose(1, 2), g.transpose(1, 2))
        return call.cache["ag"]

    def terms(self, module, name, estimator):
        if self._grouped(module) or estimator not in ("hutch", "hutchpp"):
            return None
        return 1 if name == "bias" else min(module.weight.shape[0], module.weight[0].numel())

    def sq_norms(self, call, name, estimator, k, generator):
        m = call.module
        if self._grouped(m):
            return _FUNCTIONAL.sq_norms(call, name, estimator, k, generator)
        x, g, (kernel, stride, padding, dilation) = self._xg(call)
        if name == "bias":
            return _bias_sq_norms(g.sum(-1), estimator, k, generator)
        c_out, d = m.weight.shape[0], m.weight[0].numel()
        if estimator != "hutch" or d < c_out:
            return super().sq_norms(call, name, estimator, k, generator)
        p = gaussian_projection(d, k, x, generator)                         # (C_in k) x k'
        filters = p.t().reshape(k, x.shape[1], *kernel)
        ap = F.conv2d(x, filters, None, stride, padding, dilation)          # (B, k', H', W') = A_i P
        mp = torch.bmm(g, ap.reshape(ap.shape[0], k, -1).transpose(1, 2))   # (B, C_out, k') = M_i P
        return mp.square().sum((1, 2))

    def unit_sq_norms(self, call, name, estimator, k, generator, groups, units):
        if self._grouped(call.module):   # not a linear map on patches: per-example gradients summed per unit
            return None
        return super().unit_sq_norms(call, name, estimator, k, generator, groups, units)

    def per_example(self, call, name, projection):
        if self._grouped(call.module):
            return _FUNCTIONAL.per_example(call, name, projection)
        return super().per_example(call, name, projection)

    def transposed_product(self, call, name, y):
        if self._grouped(call.module):
            return _FUNCTIONAL.transposed_product(call, name, y)
        return super().transposed_product(call, name, y)

    def clipped_sum(self, call, name, weights):
        if self._grouped(call.module):
            return _FUNCTIONAL.clipped_sum(call, name, weights)
        x, g, (kernel, stride, padding, dilation) = self._xg(call)
        gc = g * weights.to(g.dtype)[:, None, None]
        if name == "bias":
            return gc.sum((0, 2))
        w = call.module.weight
        gc = gc.reshape(*gc.shape[:2], *_out_hw(x, kernel, stride, padding, dilation))
        out = torch.nn.grad.conv2d_weight(x, (w.shape[0], x.shape[1], *kernel), gc, stride, padding, dilation)
        return out.reshape(w.shape)


def _out_hw(x: torch.Tensor, kernel, stride, padding, dilation) -> tuple[int, int]:
    return tuple((x.shape[2 + i] + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1
                 for i in range(2))


def _explicit_padding(m: nn.Module) -> list[int]:
    """``F.pad``'s list (last dimension first) for a convolution's ``padding`` (``'same'`` puts the odd one
    at the end, as ``torch`` does)."""
    pad = []
    for i in reversed(range(len(m.kernel_size))):
        if m.padding == "valid":
            lo = hi = 0
        elif m.padding == "same":
            total = m.dilation[i] * (m.kernel_size[i] - 1)
            lo, hi = total // 2, total - total // 2
        else:
            lo = hi = m.padding[i]
        pad += [lo, hi]
    return pad


class NormalizationHandler(FunctionalHandler):
    r"""``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``: exact per-example gradients in closed form.

    The output is ``w * x_hat + b`` with ``x_hat`` the normalized input, so example ``i``'s gradients are
    ``sum G_i * x_hat_i`` (weight) and ``sum G_i`` (bias), summed over every position that shares the
    affine parameters (tokens; GroupNorm: spatial positions).  ``x_hat`` is recomputed from the recorded
    input in float32 (or float64).  Exact: a point mass in the estimate's law, no chi-square terms.
    """

    reads_output = False

    def needs_weights(self, module):
        return False

    def reruns(self, module):
        return False

    def flattened_rows(self, module):
        return not isinstance(module, nn.GroupNorm)

    def _normalized(self, call: Call, x: torch.Tensor) -> torch.Tensor:
        m = call.module
        if isinstance(m, nn.LayerNorm):
            return F.layer_norm(x, m.normalized_shape, None, None, m.eps)
        if isinstance(m, nn.RMSNorm):
            return F.rms_norm(x, m.normalized_shape, None, m.eps)
        return F.group_norm(x, m.num_groups, None, None, m.eps)

    def _grads(self, call: Call) -> dict[str, torch.Tensor]:
        if "per_example" not in call.cache:
            m, b = call.module, call.batch_size
            x, g = call.args[0], _single_grad(call, type(m).__name__)
            dtype = compute_dtype(x, g)
            x, g = x.to(dtype), g.to(dtype)
            xhat = self._normalized(call, x)
            if isinstance(m, nn.GroupNorm):   # parameters per channel (dim 1); summed over positions
                def per(t):
                    return t.reshape(b, t.shape[1], -1).sum(-1)
            else:                             # parameters over the trailing normalized_shape
                def per(t):
                    return t.reshape(b, -1, *m.normalized_shape).sum(1)
            out = {}
            for name in call.aliases:
                out[name] = per(g * xhat) if name == "weight" else per(g)
            call.cache["per_example"] = out
        return call.cache["per_example"]


class ScaledRMSNormHandler(FunctionalHandler):
    r"""Hugging Face's ``*RMSNorm`` modules (Llama, Mistral, Qwen, ...): ``w * x_hat`` with ``x_hat`` computed in
    float32 and cast back to the input dtype.

    Recognised by name and attributes only, so every call is checked: the recorded output must equal
    ``w * x_hat`` to rounding; a variant with another form (e.g. Gemma's ``(1 + w) * x_hat``) falls back to
    the exact ``torch.func`` path.  Exact either way.
    """

    def needs_weights(self, module):
        return True

    def _grads(self, call: Call) -> dict[str, torch.Tensor]:
        if "per_example" not in call.cache:
            m, b = call.module, call.batch_size
            x, g = call.args[0], _single_grad(call, type(m).__name__)
            w = call.aliases["weight"].detach()
            eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
            out = call.outputs[0]
            tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(out.dtype, 1e-2)
            # Hugging Face's x_hat in float32, or one in the input dtype (at least float32)
            for inner in dict.fromkeys((torch.float32, torch.promote_types(x.dtype, torch.float32))):
                xf = x.to(inner)
                xhat = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
                expect = w * xhat
                if expect.shape == out.shape and torch.allclose(expect.to(out.dtype), out, rtol=tol, atol=tol):
                    break
            else:
                return super()._grads(call)
            dtype = compute_dtype(x, g)
            call.cache["per_example"] = {"weight": (g.to(dtype) * xhat.to(dtype)).reshape(b, -1, w.shape[0]).sum(1)}
        return call.cache["per_example"]


def is_scaled_rmsnorm(module: nn.Module) -> bool:
    """An ``*RMSNorm`` module with one 1-D ``weight`` and an epsilon (Hugging Face's layout)."""
    params = dict(module.named_parameters(recurse=False))
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return (module_type(module).__name__.endswith("RMSNorm") and list(params) == ["weight"]
            and params["weight"].dim() == 1 and isinstance(eps, float) and not list(module.children()))


_MIXING_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3}


@contextlib.contextmanager
def quiet_batching():
    """A context that silences torch's notice that a kernel without a batching rule runs in a loop under ``vmap``
    (the result is the same; the notice would appear in every run of a model that uses such a kernel)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented "
                                                  "the batching rule")
        yield


@contextlib.contextmanager
def _rerun(call: Call):
    """The context of a call's exact functional re-run: the autocast its forward ran under
    (``call.cache["autocast"]``: device type and dtype), cuDNN off, since cuDNN's recurrent kernels read the
    raw storage of their weights, which functorch's wrapped parameters do not have (the native kernels compute the
    same function; the re-run's outputs are compared with the forward's), and :func:`quiet_batching` (the vmap of
    a module with attention or experts meets kernels without a batching rule, and would warn at every step)."""
    state = call.cache.get("autocast")
    # cudnn.enabled itself, not torch.backends.cudnn.flags(): that context also reads the legacy TF32 switch, which
    # torch 2.13 refuses to read (RuntimeError) inside full_float32's precision settings, where the norms are formed
    enabled = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = False
    try:
        with quiet_batching(), (torch.autocast(state[0], dtype=state[1]) if state else contextlib.nullcontext()):
            yield
    finally:
        torch.backends.cudnn.enabled = enabled


def _check_per_example(call: Call, outs: tuple, out_dims: list[int], keep: list[int] | None = None) -> None:
    """``UnsupportedModuleError`` unless the module's per-example re-run reproduces its batched outputs: a
    module whose output for one example depends on the others (a batch statistic, attention across the
    batch) has no per-example gradient, and its clipped contribution would not be bounded by ``C``."""
    for j, per, d in zip(range(len(outs)) if keep is None else keep, outs, out_dims, strict=True):
        full = call.outputs[j].detach()
        per = per.detach()                                # (B, one example's output)
        full = full.unflatten(d, (call.batch_size, -1)).movedim(d, 0)
        if per.shape != full.shape:
            bad = True
        elif full.numel():
            # per row, relative to that row's own scale, so a small-scale row is not hidden by the batch's
            # largest (floored at 1e-6 of it, for rows that are rounding noise)
            scale = full.reshape(full.shape[0], -1).abs().amax(1)
            scale = scale.clamp_min(max(1e-6 * float(scale.max()), 1e-30))
            err = (per.to(full.dtype) - full).reshape(full.shape[0], -1).abs().amax(1)
            tol = 5e-2 if call.cache.get("autocast") else _MIXING_TOLERANCE.get(full.dtype, 5e-2)
            bad = bool((err > tol * scale).any())
        else:
            bad = False
        if bad:
            unit = call.cache.get("unit")
            raise UnsupportedModuleError(
                getattr(unit, "path", type(call.module).__name__),
                f"{type(call.module).__name__}'s output for one example depends on other examples of the batch "
                f"(re-run on each example alone it differs), so it has no per-example gradient and a clipped "
                f"contribution could exceed C. Make it treat examples independently (no batch statistics, no "
                f"mixing along the batch dimension)")


class MultiheadAttentionHandler(FunctionalHandler):
    """``nn.MultiheadAttention``: exact, with ``out_proj``'s parameters (used outside ``out_proj.forward``).

    Its inputs are read by name: ``query``, ``key``, ``value`` and ``key_padding_mask`` carry the batch first;
    a 2-D ``attn_mask`` ``(L, S)`` is shared by the batch (also when ``L`` equals the batch size), and a 3-D one
    ``(B * heads, L, S)`` gives each example its ``heads`` rows.
    """

    recursive = True

    def inputs(self, call: Call) -> ExampleInputs:
        m, b = call.module, call.batch_size
        bound = inspect.signature(m.forward).bind(*call.args, **call.kwargs)
        kwargs = dict(bound.arguments)
        dims = {n: (0 if n in ("query", "key", "value", "key_padding_mask") and _batched(x, b) else None)
                for n, x in kwargs.items()}
        mask = kwargs.get("attn_mask")
        fix = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 3:
            heads = m.num_heads
            if mask.shape[0] != b * heads:
                raise ValueError(f"a 3-D attn_mask must have batch * num_heads = {b * heads} rows, got "
                                 f"{tuple(mask.shape)}")
            kwargs["attn_mask"] = mask.reshape(b, heads, *mask.shape[1:])
            dims["attn_mask"] = 0

            def fix(args, kws):
                kws = dict(kws)
                kws["attn_mask"] = kws["attn_mask"].reshape(-1, *kws["attn_mask"].shape[2:])
                return args, kws
        return ExampleInputs((), kwargs, (), dims, fix)


class RecurrentHandler(FunctionalHandler):
    """``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` (``batch_first=True``, which the validator requires): exact.  The
    input carries the batch first; an initial state ``h_0`` (and ``c_0``), ``(layers, B, H)``, in its second
    dimension."""

    def inputs(self, call: Call) -> ExampleInputs:
        b = call.batch_size
        dims = [_leading(x, b) if i == 0 else _state_dims(x, b) if i == 1 else None for i, x in enumerate(call.args)]
        kw_dims = {n: _state_dims(x, b) if n == "hx" else _leading(x, b) for n, x in call.kwargs.items()}
        return ExampleInputs(call.args, dict(call.kwargs), tuple(dims), kw_dims)


class ParametrizedHandler(MaterializedHandler):
    r"""A linear, convolution or embedding layer with parametrized tensors (``torch.nn.utils.parametrizations``:
    ``weight_norm``, ``spectral_norm``, ``orthogonal``; any ``parametrize.register_parametrization``).

    The layer's own handler reads the call as usual and gives each example's gradient ``dW_i`` of the parametrized
    tensor ``W = f(\theta)``; the trainable parameters are the originals ``\theta``, whose per-example gradients are
    the parametrization's vector-Jacobian products ``J_f(\theta)^T dW_i`` (``torch.func``, batched over examples,
    with the parametrization in evaluation mode so that ``spectral_norm`` reuses the power iteration's vectors of the
    forward).  Exact (a point mass in the estimate's law): ``dW_i`` is formed, ``B`` times the tensor's size.
    """

    recursive = True

    def __init__(self, base: Handler) -> None:
        self.base = base
        self.reads_output = base.reads_output

    def needs_weights(self, module):
        return True

    def check_forward(self, call):
        self.base.check_forward(call)

    def flattened_rows(self, module):
        return self.base.flattened_rows(module)

    def _grads(self, call: Call) -> dict[str, torch.Tensor]:
        if "per_example" in call.cache:
            return call.cache["per_example"]
        m, b, out = call.module, call.batch_size, {}
        for name in call.aliases:
            if not name.startswith("parametrizations."):
                out[name] = self.base.per_example(call, name, None).reshape(b, *call.aliases[name].shape)
        for tensor, plist in m.parametrizations.items():
            prefix = f"parametrizations.{tensor}."
            originals = {n[len(prefix):]: a.detach() for n, a in call.aliases.items() if n.startswith(prefix)}
            if not originals:
                continue
            was = plist.training
            plist.eval()
            try:
                value, vjp = torch.func.vjp(lambda o, plist=plist: torch.func.functional_call(plist, o, ()),
                                            originals)
                dw = self.base.per_example(call, tensor, None).reshape(b, *value.shape).to(value.dtype)
                with quiet_batching():
                    per = torch.func.vmap(lambda g, vjp=vjp: vjp(g)[0])(dw)
            finally:
                plist.train(was)
            out.update({prefix + n: g for n, g in per.items()})
        call.cache["per_example"] = out
        return out



class RootParameterHandler(MaterializedHandler):
    """Parameters of the model itself, not of a submodule (CLIP's ``logit_scale``, a learned position table kept on
    the model): each is an output shared by the batch (:mod:`dpsgd.shared`), its uses in the forward followed to
    where they meet the batch; example ``i``'s gradient is what flows back through example ``i``'s rows there.
    Exact (a point mass in the estimate's law); the model is not re-run."""

    def _grads(self, call: Call) -> dict[str, torch.Tensor]:
        out = {}
        for (name, alias), g in zip(call.aliases.items(), call.grads, strict=True):
            out[name] = torch.zeros(call.batch_size, *alias.shape, device=alias.device) if g is None else g
        return out


def _plain_linear(module: nn.Module) -> bool:
    """A subclass of ``nn.Linear`` that could compute ``x W^T + b``: no parameters but ``weight`` and ``bias``, no
    submodules with parameters (its forward is checked per call, :meth:`LinearHandler.check_forward`)."""
    own = {n for n, _ in module.named_parameters(recurse=False)}
    return own <= {"weight", "bias"} and not any(True for c in module.children() for _ in c.parameters())


def secret_seed() -> int:
    """A seed from ``os.urandom``, for the engine's checks: not the user's generators, whose streams stay as they
    were, and not predictable or replayable by the model."""
    return int.from_bytes(os.urandom(7), "little")


def _state_dims(x: object, b: int) -> object:
    """Batch dimensions of a recurrent state: 1 for a ``(layers, B, H)`` tensor, in nested tuples too."""
    return per_leaf(x, lambda t: 1 if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] == b else None)


def flat_tensors(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flat_tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in flat_tensors(o)]
    return []


HANDLERS[nn.Linear] = LinearHandler()
HANDLERS[nn.Embedding] = EmbeddingHandler()
HANDLERS[nn.MultiheadAttention] = MultiheadAttentionHandler()
HANDLERS[nn.LSTM] = HANDLERS[nn.GRU] = HANDLERS[nn.RNN] = RecurrentHandler()
HANDLERS[nn.Conv1d] = HANDLERS[nn.Conv2d] = ConvHandler()
HANDLERS[nn.LayerNorm] = HANDLERS[nn.RMSNorm] = HANDLERS[nn.GroupNorm] = NormalizationHandler()
# the out_proj of nn.MultiheadAttention: a Linear subclass with the same forward
HANDLERS[nn.modules.linear.NonDynamicallyQuantizableLinear] = HANDLERS[nn.Linear]
_LINEAR = HANDLERS[nn.Linear]
_FUNCTIONAL = FunctionalHandler()
ROOT_PARAMETERS = RootParameterHandler()
_SCALED_RMSNORM = ScaledRMSNormHandler()


def handler_for(module: nn.Module) -> Handler:
    """The handler of ``module``: registered by type, GPT-2's ``Conv1D`` and subclasses of ``nn.Linear`` (checked
    per call, :meth:`LinearHandler.check_forward`) as linear, else the exact fallback."""
    if parametrize.is_parametrized(module):
        base = HANDLERS.get(type(module).__bases__[0])
        if isinstance(base, (LinearHandler, EmbeddingHandler)):
            return ParametrizedHandler(base)
    if module_type(module) in HANDLERS:
        return HANDLERS[module_type(module)]
    if is_conv1d(module) or (isinstance(module, nn.Linear) and _plain_linear(module)):
        return _LINEAR
    if is_scaled_rmsnorm(module):
        return _SCALED_RMSNORM
    return _FUNCTIONAL



def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every entry of float32 or float64 tensors is finite, by each one's sum: a NaN or an infinity makes
    the sum non-finite, and an overflowing sum only refuses (``torch.isfinite`` would hold several
    parameter-sized temporaries at the step's peak).  One answer for all of them: on a GPU, one synchronization
    instead of one a tensor."""
    if not tensors:
        return True
    by_device: dict = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t.sum().to(torch.float64))
    return all(bool(torch.isfinite(torch.stack(sums)).all()) for sums in by_device.values())

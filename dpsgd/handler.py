r"""The per-layer handler's contract and registry: :class:`Call` (one recorded call of a module), :class:`Handler`
(what a handler answers per parameter: squared norms, per-example gradients or their projections, the clipped
sum, the envelope's terms), :data:`HANDLERS` and :func:`register_handler` (module type -> handler, like Opacus'
registry), and the numerical helpers the handlers share.  The handlers themselves are :mod:`dpsgd.layers`
(linear, embedding, convolution) and :mod:`dpsgd.materialized` (exact, from materialized per-example gradients).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from .estimators import ESTIMATORS

__all__ = ["Call", "Handler", "HANDLERS", "register_handler", "is_parameter_container", "module_type", "is_conv1d",
           "matrix_view", "compute_dtype", "full_float32", "weighted_products", "wide_kernel_available",
           "segment_sum", "secret_seed", "flat_tensors", "all_finite"]


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
    >>> from dpsgd.handler import HANDLERS, register_handler
    >>> from dpsgd.materialized import FunctionalHandler
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


def bias_sq_norms(s: torch.Tensor, estimator: str, k: int, generator) -> torch.Tensor:
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
    >>> from dpsgd.handler import segment_sum
    >>> segment_sum(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1, 0, 1]), 2)
    tensor([2., 5.])
    """
    out = torch.zeros(units, *t.shape[1:], device=t.device, dtype=t.dtype)
    return out.index_add_(0, groups.to(t.device), t)


def regrouped(x: torch.Tensor, groups: torch.Tensor, units: int) -> torch.Tensor | None:
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


def as_btd(x: torch.Tensor, b: int) -> torch.Tensor:
    """``(B, ..., d)`` as ``(B, T, d)`` (every middle dimension is a token dimension of a linear map)."""
    return x.reshape(b, -1, x.shape[-1])


def single_grad(call: Call, what: str) -> torch.Tensor:
    g = call.grads[0] if call.grads else None
    if g is None:
        raise RuntimeError(f"no output gradient recorded for {what}")
    return g


def secret_seed() -> int:
    """A seed from ``os.urandom``, for the engine's checks: not the user's generators, whose streams stay as they
    were, and not predictable or replayable by the model."""
    return int.from_bytes(os.urandom(7), "little")


def flat_tensors(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flat_tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in flat_tensors(o)]
    return []


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



_WIDE_KERNELS: dict = {}

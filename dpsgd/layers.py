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

:data:`~dpsgd.handler.HANDLERS` maps module types to handlers (:func:`~dpsgd.handler.register_handler` adds one,
like Opacus' registry); the contract (:class:`~dpsgd.handler.Call`, :class:`~dpsgd.handler.Handler`) is
:mod:`dpsgd.handler`, the handlers that materialize per-example gradients are :mod:`dpsgd.materialized`, and this
module holds the estimated ones and :func:`handler_for`.  Built in:

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

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from .estimators import ESTIMATORS, gaussian_projection
from .handler import (
    HANDLERS,
    Call,
    Handler,
    as_btd,
    bias_sq_norms,
    compute_dtype,
    is_conv1d,
    module_type,
    regrouped,
    secret_seed,
    segment_sum,
    single_grad,
    weighted_products,
)
from .materialized import (
    FunctionalHandler,
    MultiheadAttentionHandler,
    NormalizationHandler,
    ParametrizedHandler,
    RecurrentHandler,
    RootParameterHandler,
    ScaledRMSNormHandler,
    is_scaled_rmsnorm,
    plain_linear,
)
from .validator import UnsupportedModuleError

__all__ = ["LinearHandler", "EmbeddingHandler", "ConvHandler", "handler_for", "ROOT_PARAMETERS"]


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
                f"(dpsgd.handler.register_handler({type(m).__name__}, dpsgd.materialized.FunctionalHandler()))")
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
                f"(dpsgd.handler.register_handler({type(m).__name__}, dpsgd.materialized.FunctionalHandler()))")

    def _ag(self, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, G)`` as ``(B, T, d)`` and ``(B, T, p)`` in the dtypes the forward's product used; each use widens
        what it reads (:func:`compute_dtype`) for itself only: kept for every layer, wide copies of a bf16 model's
        inputs and output gradients would triple what the step holds."""
        b = call.batch_size
        a, g = as_btd(call.args[0], b), as_btd(single_grad(call, type(call.module).__name__), b)
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
            return bias_sq_norms(g.to(dtype).sum(1), estimator, k, generator)
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
            return bias_sq_norms(segment_sum(g.to(dtype).sum(1), groups, units), estimator, k, generator)
        a_u, g_u = regrouped(a.to(dtype), groups, units), regrouped(g.to(dtype), groups, units)
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
            g = single_grad(call, "Embedding")
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
            x, g = call.args[0], single_grad(call, type(m).__name__)
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
            return bias_sq_norms(g.sum(-1), estimator, k, generator)
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
    if is_conv1d(module) or (isinstance(module, nn.Linear) and plain_linear(module)):
        return _LINEAR
    if is_scaled_rmsnorm(module):
        return _SCALED_RMSNORM
    return _FUNCTIONAL



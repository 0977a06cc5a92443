r"""Handlers that materialize per-example gradients: :class:`FunctionalHandler` (the exact fallback: the module
re-run per example with ``torch.func`` on the recorded inputs, refusing randomness and a re-run that differs from
the batched output), closed forms for normalization layers, ``nn.MultiheadAttention``, recurrent layers,
parametrized weights, and the parameters of the model itself (:class:`RootParameterHandler`).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .handler import Call, Handler, compute_dtype, flat_tensors, matrix_view, module_type, single_grad
from .validator import UnsupportedModuleError

__all__ = ["FunctionalHandler", "MaterializedHandler", "NormalizationHandler", "ScaledRMSNormHandler",
           "is_scaled_rmsnorm", "quiet_batching", "per_leaf", "RootParameterHandler", "ParametrizedHandler",
           "MultiheadAttentionHandler", "RecurrentHandler", "ExampleInputs", "plain_linear"]


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
            x, g = call.args[0], single_grad(call, type(m).__name__)
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
            x, g = call.args[0], single_grad(call, type(m).__name__)
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


def plain_linear(module: nn.Module) -> bool:
    """A subclass of ``nn.Linear`` that could compute ``x W^T + b``: no parameters but ``weight`` and ``bias``, no
    submodules with parameters (its forward is checked per call, :meth:`LinearHandler.check_forward`)."""
    own = {n for n, _ in module.named_parameters(recurse=False)}
    return own <= {"weight", "bias"} and not any(True for c in module.children() for _ in c.parameters())


def _state_dims(x: object, b: int) -> object:
    """Batch dimensions of a recurrent state: 1 for a ``(layers, B, H)`` tensor, in nested tuples too."""
    return per_leaf(x, lambda t: 1 if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] == b else None)

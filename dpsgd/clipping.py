r"""The DP-SGD-RC step's clipped sums (paper 000, Alg. 1), by book-keeping, and its completeness checks.

One step, for per-example losses ``L_i`` of a forward that :class:`Capture` recorded:

1. **forward**: every handled module's call (:mod:`dpsgd.layers`) runs with its parameters replaced by
   fresh leaf *aliases*, and its inputs and outputs are recorded (:class:`~dpsgd.handler.Call`).  A
   parameter used outside a recorded call (by a parent's forward, after a hook did not fire, ...) is then
   the only way gradient can reach the real parameter, so it is detected rather than missed;
2. **the row check** on checked steps (a new layout of calls, a probed forward, or every step with
   ``Capture.check_every_step``): one backward of a randomly weighted half of the losses, before the step's
   own, whose gradients must be exactly zero in the other examples' rows (:class:`ExampleMixingError`); on a
   new layout, two complementary ones that also check that row ``i`` of every call is example ``i``
   (``_check_rows``);
3. **one backward**, ``autograd.grad(sum_i L_i, outputs + real parameters)``: the output gradients ``G``
   of every call.  Any real parameter that receives gradient raises :class:`IncompleteGradientError`;
4. **norms**: per parameter, the handler's per-example squared norm; a parameter with several calls
   (tied embeddings, a module called twice, two forwards before one backward) gets the norm of its
   *summed* per-example gradient (``exact``/``ghost``: materialized; ``hutch``: every use projected with
   one ``P``, so the estimate stays a chi-square mixture of the summed gradient; ``hutchpp``: the sketch
   and the probes applied through every use's products, never forming the sum);
5. **weights** ``c_i = min(1, C' / sqrt(n_i))`` with ``C' = C (1 - margin)`` (a rounding margin of
   ``2^-17`` in float32, ``2^-46`` in float64), and **clipped sums** ``sum_i c_i g_i`` formed from the
   same ``(A, G)`` by each handler, in float32 or float64, never in half precision.

Noise (:func:`dpsgd.noise.noisy_gradients`) and the optimizer's step follow (:class:`dpsgd.PrivacyEngine`).  If a loss,
a norm or a sum is not finite the step raises ``FloatingPointError`` before anything is written.

The step is laid out by concern, each module importing only those before it: :mod:`dpsgd.plan` (which
norm each parameter gets: the one place that decides it, for the step, the accountant's envelope and the
validator), :mod:`dpsgd.capture` (step 1), :mod:`dpsgd.rowcheck` (step 2), this module (steps 3 to 5) and
:mod:`dpsgd.noise`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .capture import Capture, check_unchanged, release_call
from .estimators import gaussian_projection, hutchpp_operator
from .handler import Call, all_finite, full_float32, matrix_view, segment_sum
from .isolation import IncompleteGradientError
from .plan import NormPlan, check_estimator
from .rowcheck import output_gradients, row_check
from .strategies import HybridClipping, TwiceSampling, masked_clipped_sum


@dataclass
class ClippedGradients:
    """What one private backward produced.

    Attributes
    ----------
    sums : dict
        ``id(param) -> sum_i c_i g_i`` (float32 or float64).
    sq_norms : torch.Tensor
        ``(B,)`` per-example squared norms (estimated), float64; with ``groups``, ``(U,)`` one per unit (the
        squared norm of the unit's summed gradient).
    weights : torch.Tensor
        ``(B,)`` clip weights ``c_i``; with ``groups``, ``(U,)`` one per unit (each of its rows was weighted by it).
    """

    sums: dict
    sq_norms: torch.Tensor
    weights: torch.Tensor


def _margin(dtype: torch.dtype) -> float:
    return 2.0 ** -46 if dtype == torch.float64 else 2.0 ** -17


CLIPPING_PASSES = ("bookkeeping", "two-pass")
"""How the clipped sum is formed: from the recorded ``(A, G)`` (default), or by a second backward."""


def check_clipping_pass(clipping_pass: object) -> str:
    """``clipping_pass``, or ``ValueError`` unless it is one of :data:`CLIPPING_PASSES`."""
    if clipping_pass not in CLIPPING_PASSES:
        raise ValueError(f"clipping_pass must be one of {list(CLIPPING_PASSES)}, got {clipping_pass!r}")
    return clipping_pass


def clipped_backward(capture: Capture, losses: torch.Tensor, max_grad_norm: float, k: int,
                     generator: torch.Generator | None, *, norms_only: bool = False,
                     clipping_pass: str = "bookkeeping", twice: TwiceSampling | HybridClipping | None = None,
                     mask_generator: torch.Generator | None = None,
                     groups: torch.Tensor | None = None, padding: torch.Tensor | None = None) -> ClippedGradients:
    r"""Per-example norms and clipped sums of ``losses`` from the calls ``capture`` recorded.

    Consumes the calls the losses reached; raises :class:`IncompleteGradientError` if any trainable
    parameter of the model receives gradient outside them, and ``FloatingPointError`` on non-finite
    values.  With ``norms_only`` the sums are not formed.

    ``clipping_pass="bookkeeping"`` forms ``sum_i c_i g_i`` per handler from the recorded activations and
    output gradients (one backward; every layer's ``G`` is held until the sums are formed).
    ``"two-pass"`` keeps the autograd graph and runs a second backward of ``sum_i c_i L_i`` to the
    per-call parameter aliases (the classic DP-SGD order; the graph is held instead, and the backward
    runs twice).  Both give the same sums to rounding.  The second backward accumulates in the model's
    dtype, so ``"two-pass"`` refuses half-precision parameters, where rounding of ``c_i`` and of the sum
    could push a clipped contribution above ``C``.

    ``twice`` (with ``mask_generator``, on the losses' device) forms each parameter's per-example gradients
    from the recorded calls and sums them with :func:`dpsgd.strategies.masked_clipped_sum`: l2 clipping of each
    example's part in the parameter's group (one group for :class:`~dpsgd.strategies.TwiceSampling`), then
    l-infinity clipping and coordinate masks; bookkeeping pass and exact norms only.  ``weights`` are then
    the whole-gradient factors, reported only.

    ``groups`` (user-level privacy, :mod:`dpsgd.users`) is a ``(B,)`` integer tensor giving each row's unit
    ``0 .. U-1`` (every unit present): the norm is that of each unit's **summed** gradient ``G_u = sum_{i in u}
    g_i`` (:func:`unit_sq_norms`), its weight ``w_u = min(1, C' / ||G_u||)`` is given to every row of the unit,
    and the handlers' clipped sums ``sum_i w_{u(i)} g_i = sum_u w_u G_u`` follow unchanged.  Not with ``twice``.

    ``padding`` is a ``(B,)`` bool tensor marking rows that carry no example (a batch padded to a fixed size,
    :class:`dpsgd.samplers.TruncatedPoisson`): their weight is 0, so they add nothing to any sum.  Not with
    ``groups`` or ``twice``.

    The stages, in order: :func:`_refuse_unsound_step` (nothing is consumed before it passes), the row check
    (:func:`row_check`), the one backward to every call's outputs (:func:`output_gradients`: no trainable
    parameter may receive gradient outside a recorded call), the per-example norms and clip weights
    (:func:`_clip_weights`), and the clipped sums of one of three strategies (:func:`_two_pass_sums`,
    :func:`_twice_sampled_sums`, :func:`_bookkeeping_sums`), each checked finite.
    """
    two_pass = _refuse_unsound_step(capture, losses, clipping_pass, norms_only, twice, mask_generator)
    plan, b = capture.plan, losses.shape[0]
    units = None if groups is None else check_groups(groups, b, twice)
    if padding is not None and (groups is not None or twice is not None or padding.shape != (b,)
                                or padding.dtype != torch.bool):
        raise ValueError(f"padding must be a ({b},) bool tensor, without groups or twice sampling")
    model_params = [p for p in plan.model.parameters() if p.requires_grad]
    calls = list(capture.calls)
    row_check(capture, calls, losses)
    reached = output_gradients(capture, calls, losses, model_params, two_pass)
    capture.active = False
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(full_float32())
        uses = _uses(plan, reached)
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in plan.params) else torch.float32
        if units is None:
            n, group_n = _sq_norms(plan, uses, k, generator, b, losses.device, twice, max_grad_norm)
        else:
            n, group_n = unit_sq_norms(plan, uses, k, generator, groups.to(losses.device), units), None
        weights = _clip_weights(n, max_grad_norm, dtype)
        if padding is not None:   # a padding row carries no example: it adds nothing
            weights = weights.masked_fill(padding.to(weights.device), 0.0)
        # every row gets its unit's weight: sum_i w_u(i) g_i = sum_u w_u G_u, each unit's sum clipped once
        row_weights = weights if units is None else weights[groups.to(weights.device)]
        sums = {}
        if two_pass:
            sums = _two_pass_sums(capture, losses, row_weights, uses, reached)
        elif twice is not None and not norms_only:
            sums = _twice_sampled_sums(plan, uses, group_n, twice, max_grad_norm, dtype, losses.device,
                                       mask_generator)
        elif not norms_only:
            sums = _bookkeeping_sums(uses, reached, row_weights, dtype)
        if not all_finite(*sums.values()):   # one check for all of them
            raise FloatingPointError("a clipped gradient sum is not finite; the step was not taken")
    finally:
        stack.close()
        capture.active = True
        for c in reached:
            c.cache.clear()
    return ClippedGradients(sums, n.detach(), weights)


def _refuse_unsound_step(capture: Capture, losses: torch.Tensor, clipping_pass: str, norms_only: bool,
                         twice: TwiceSampling | HybridClipping | None, mask_generator: torch.Generator | None) -> bool:
    """Raise, before anything is consumed, for a step that could not be taken soundly: bad arguments, a non-finite
    loss, a unit that ran only under ``no_grad`` (its parameters would silently not train), a recorded call whose
    inputs or parameters changed after its forward, losses that do not require grad, or the two-pass sums on
    half-precision parameters.  Returns whether the second backward forms the sums (``"two-pass"``)."""
    check_clipping_pass(clipping_pass)
    two_pass = clipping_pass == "two-pass" and not norms_only
    if twice is not None and (two_pass or not capture.plan.all_exact or mask_generator is None):
        raise ValueError("twice sampling needs exact norms (estimator 'exact' or 'ghost'), the bookkeeping pass and "
                         "a mask generator")
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
        raise ValueError(f"the per-example losses must be a 1-D tensor (one loss per example), got "
                         f"{'shape ' + str(tuple(losses.shape)) if isinstance(losses, torch.Tensor) else type(losses)}")
    if not torch.isfinite(losses.detach()).all():
        raise FloatingPointError("a per-example loss is NaN or infinite; the step was not taken")
    # a unit run under no_grad that also ran with gradient (a teacher / pseudo-label pass) trains: only a unit
    # that never ran with gradient would silently not train
    recorded = {c.cache["unit"].path or type(c.module).__name__ for c in capture.calls}
    names = sorted(set(capture.no_grad_units) - recorded)
    capture.no_grad_units.clear()
    if names:
        raise IncompleteGradientError(
            f"{', '.join(names[:3])} ran under torch.no_grad() inside a training forward, so its trainable "
            f"parameters would silently not train (reentrant gradient checkpointing does this: use "
            f"use_reentrant=False, the default of Hugging Face's activation_checkpointing_enable()); or freeze "
            f"them with requires_grad_(False)")
    for c in capture.calls:
        check_unchanged(c)
    if losses.shape[0] and not losses.requires_grad:
        raise IncompleteGradientError("the losses do not require grad: the forward that produced them was not "
                                      "recorded with gradients (torch.no_grad?)")
    if two_pass and any(p.dtype in (torch.float16, torch.bfloat16) for p in capture.plan.params):
        raise ValueError("clipping_pass='two-pass' sums clipped gradients in the parameters' dtype, which is half "
                         "precision here; rounding could let a clipped contribution exceed C. Use "
                         "clipping_pass='bookkeeping' (sums in float32)")
    return two_pass


def _sq_norms(plan: NormPlan, uses: list, k: int, generator: torch.Generator | None, b: int, device: torch.device,
              twice: TwiceSampling | HybridClipping | None, max_grad_norm: float
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(n, group_n)``: each example's squared norm ``n_i`` over every parameter the losses reached (float64,
    finite, else ``FloatingPointError``), and with ``twice`` the same per sampling group (``None`` without)."""
    n = torch.zeros(b, dtype=torch.float64, device=device)
    group_n = None if twice is None else torch.zeros(len(twice.bounds(max_grad_norm)), b, dtype=torch.float64,
                                                     device=device)
    for p, contributions in uses:
        sq = _param_sq_norms(plan, p, contributions, k, generator).to(torch.float64)
        n = n + sq
        if group_n is not None:
            group_n[twice.group_of(plan.names[id(p)])] += sq.to(group_n.device)
    if not torch.isfinite(n).all():
        raise FloatingPointError("a per-example gradient norm is NaN or infinite; the step was not taken")
    return n, group_n


def check_groups(groups: object, b: int, twice: object = None) -> int:
    """The number of units ``U`` of a ``groups`` vector (:func:`clipped_backward`), or ``ValueError`` unless it is a
    ``(B,)`` integer tensor whose values are exactly ``0 .. U-1`` (a unit without rows would be a user the loader
    never drew; a value out of range would index another unit's weight)."""
    if twice is not None:
        raise ValueError("groups (user-level privacy) cannot be combined with twice sampling or hybrid clipping: "
                         "their accounting clips and masks each example's gradient, not each user's")
    if not isinstance(groups, torch.Tensor) or groups.dim() != 1 or groups.shape[0] != b \
            or groups.is_floating_point() or groups.dtype == torch.bool:
        raise ValueError(f"groups must be a ({b},) integer tensor giving each row's unit, got "
                         f"{tuple(groups.shape) if isinstance(groups, torch.Tensor) else type(groups).__name__}")
    if b == 0:
        return 0
    units = int(groups.max()) + 1
    if int(groups.min()) < 0 or torch.unique(groups).numel() != units:
        raise ValueError("groups must number the units 0 .. U-1, each with at least one row")
    return units


def unit_sq_norms(plan: NormPlan, uses: list, k: int, generator: torch.Generator | None, groups: torch.Tensor,
                  units: int) -> torch.Tensor:
    r"""Each unit's squared norm ``||sum_{i in u} g_i||^2`` over every parameter the losses reached (float64,
    ``(U,)``; ``FloatingPointError`` if not finite): the norm of the unit's *summed* gradient, cross terms included.

    Per parameter with one call, by its handler's :meth:`~dpsgd.handler.Handler.unit_sq_norms` where it has one
    (linear layers: the estimator on each unit's rows laid end to end along the token dimension; embeddings: rows
    summed per unit and token id); otherwise, and for a parameter with several calls, as
    :func:`_param_sq_norms` sums several calls: exactly from the per-example
    gradients summed per unit (materialized: ``B x numel`` for one parameter at a time); under ``hutch`` one
    Gaussian ``P`` per parameter, so a unit's estimate ``||sum_{i in u} M_i P||^2`` is a chi-square mixture of its
    summed gradient with the parameter's ``min(rows, cols)`` terms, the envelope the plan already counts; under
    ``hutchpp`` the sketch through each unit's summed products.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from dpsgd.capture import Capture
    >>> from dpsgd.clipping import clipped_backward
    >>> from dpsgd.plan import NormPlan
    >>> model = nn.Linear(3, 1)
    >>> capture = Capture(NormPlan.build(model, "exact"))
    >>> x = torch.tensor([[1.0, 0, 0], [-1.0, 0, 0], [0, 1.0, 0]])
    >>> out = clipped_backward(capture, model(x).sum(1), 10.0, 1, None, groups=torch.tensor([0, 0, 1]))
    >>> out.sq_norms.tolist()   # unit 0's two weight gradients cancel: only its two bias gradients remain
    [4.0, 2.0]
    """
    n = torch.zeros(units, dtype=torch.float64, device=groups.device)
    for p, contributions in uses:
        n = n + _param_sq_norms(plan, p, contributions, k, generator, groups, units).to(n.device, torch.float64)
    if not torch.isfinite(n).all():
        raise FloatingPointError("a per-user gradient norm is NaN or infinite; the step was not taken")
    return n


def _clip_weights(n: torch.Tensor, max_grad_norm: float, dtype: torch.dtype) -> torch.Tensor:
    """``c_i = min(1, C' / sqrt(n_i))`` with ``C' = C (1 - margin)``: the rounding of the sums in ``dtype`` cannot
    lift a clipped contribution above ``C``."""
    c_eff = max_grad_norm * (1 - _margin(dtype))
    return torch.clamp(c_eff / n.sqrt().clamp_min(1e-300), max=1.0)


def _two_pass_sums(capture: Capture, losses: torch.Tensor, weights: torch.Tensor, uses: list,
                   reached: list[Call]) -> dict:
    """``sum_i c_i g_i`` per parameter by a second backward of ``sum_i c_i L_i`` (:func:`_second_backward`); the
    output gradients are freed first, since the second pass does not read them."""
    for c in reached:
        c.grads = []
        c.cache.clear()
    return _second_backward(capture, losses, weights, uses)


def _twice_sampled_sums(plan: NormPlan, uses: list, group_n: torch.Tensor, twice: TwiceSampling | HybridClipping,
                        max_grad_norm: float, dtype: torch.dtype, device: torch.device,
                        mask_generator: torch.Generator) -> dict:
    """Twice sampling's sums: each parameter's per-example gradients (summed over its calls, one parameter at a
    time: ``B x numel`` floats at most), clipped to its group's l2 bound ``c2`` and to ``c_inf`` per coordinate,
    masked coordinate-wise (:func:`dpsgd.strategies.masked_clipped_sum`)."""
    bounds = twice.bounds(max_grad_norm)
    b = group_n.shape[1]
    # each group's l2 clipping factors, and its l-infinity bound kept below c_inf after rounding (float32's
    # nearest value to 0.05 is above it)
    group_w = [torch.clamp(c2 * (1 - _margin(dtype)) / group_n[j].sqrt().clamp_min(1e-300), max=1.0)
               for j, (c2, _) in enumerate(bounds)]
    sums = {}
    for p, contributions in uses:
        per_example = None
        for call, local in contributions:
            e = call.cache["unit"].handler.per_example(call, local, None)
            e = e.reshape(b, -1).to(torch.promote_types(e.dtype, dtype))
            per_example = e if per_example is None else per_example + e
        j = twice.group_of(plan.names[id(p)])
        c_inf = bounds[j][1] * (1 - _margin(dtype))
        total = masked_clipped_sum(per_example.to(device), group_w[j], c_inf, twice.coordinate_rate, mask_generator)
        sums[id(p)] = total.reshape(p.shape).to(p.device)
    return sums


def _bookkeeping_sums(uses: list, reached: list[Call], weights: torch.Tensor, dtype: torch.dtype) -> dict:
    """``sum_i c_i g_i`` per parameter from each call's recorded inputs and output gradients (its handler's
    ``clipped_sum``), in float32 or float64.  The sums are formed from the output end (the language-model head's
    ``B T V`` gradient first) and each call is released once its last parameter's sum is formed, so that the sums
    grow as the recorded tensors shrink."""
    left = {id(c): len(c.aliases) for c in reached}
    sums = {}
    for p, contributions in reversed(uses):
        total = None
        for call, local in contributions:
            s = call.cache["unit"].handler.clipped_sum(call, local, weights.to(call.outputs[0].device))
            s = s.to(torch.promote_types(s.dtype, dtype))
            total = s if total is None else total + s
        sums[id(p)] = total.reshape(p.shape)
        for call, _ in contributions:
            left[id(call)] -= 1
            if left[id(call)] == 0:
                release_call(call)
    return sums


def _second_backward(capture: Capture, losses: torch.Tensor, weights: torch.Tensor, uses: list) -> dict:
    """``sum_i c_i g_i`` per parameter by autograd of ``sum_i c_i L_i`` to every call's alias (two-pass)."""
    leaves = [(p, call.aliases[local]) for p, contributions in uses for call, local in contributions]
    weighted = (losses * weights.to(losses.device, losses.dtype)).sum()
    grads = torch.autograd.grad(weighted, [a for _, a in leaves], allow_unused=True)
    sums: dict = {}
    for (p, _), g in zip(leaves, grads, strict=True):
        if g is None:
            continue
        g = g.to(torch.promote_types(g.dtype, torch.float32))
        sums[id(p)] = g if id(p) not in sums else sums[id(p)] + g
    for p, _ in uses:
        if id(p) not in sums:
            sums[id(p)] = torch.zeros(p.shape, device=p.device, dtype=torch.promote_types(p.dtype, torch.float32))
    return sums


def _uses(plan: NormPlan, calls: list[Call]) -> list[tuple[nn.Parameter, list[tuple[Call, str]]]]:
    """Each parameter that received gradient, with the (call, local name) pairs that carry it."""
    by_param: dict[int, list] = {}
    for c in calls:
        unit = c.cache["unit"]
        for local in c.aliases:
            by_param.setdefault(id(unit.params[local]), []).append((c, local))
    return [(p, by_param[id(p)]) for p in plan.params if id(p) in by_param]


def _param_sq_norms(plan: NormPlan, p: nn.Parameter, contributions: list, k: int, generator,
                    groups: torch.Tensor | None = None, units: int = 0) -> torch.Tensor:
    """One parameter's squared norms: per example, or with ``groups`` per unit (of the unit's summed gradient)."""
    estimator = plan.norm(plan.names[id(p)])
    if len(contributions) == 1:
        call, local = contributions[0]
        handler = call.cache["unit"].handler
        if groups is None:
            return handler.sq_norms(call, local, estimator, k, generator)
        n = handler.unit_sq_norms(call, local, estimator, k, generator, groups, units)
        if n is not None:   # the handler's own per-unit path (never a per-example gradient)
            return n
    # several calls, or several rows per unit: the norm of the summed gradient M = sum_u M_u (over calls, then
    # over a unit's rows), from each use's products
    estimated = plan.terms[plan.names[id(p)]] is not None

    def summed(product: str, x: torch.Tensor | None) -> torch.Tensor:
        """``sum_u`` of each use's ``product`` (a handler method: ``per_example`` gives ``M_u x``, or ``M_u`` for
        ``x = None``; ``transposed_product`` gives ``M_u^T x``), summed per unit with ``groups``: a unit's ``x``
        (``U x ... x k``) is then given to each of its rows."""
        if groups is not None and x is not None and x.dim() == 3:
            x = x[groups.to(x.device)]
        total = None
        for call, local in contributions:
            s = getattr(call.cache["unit"].handler, product)(call, local, x)
            total = s if total is None else total + s.to(total.dtype)
        return total if groups is None else segment_sum(total, groups, units)

    if not estimated:
        m = summed("per_example", None)
        return m.reshape(m.shape[0], -1).square().sum(1)
    like = contributions[0][0].outputs[0]
    like = like.to(torch.promote_types(like.dtype, torch.float32))
    cols = matrix_view(p.shape)[1]
    if estimator == "hutch":   # one P for every use: a chi-square mixture of the summed gradient
        return summed("per_example", gaussian_projection(cols, k, like, generator)).square().sum((1, 2))
    return hutchpp_operator(lambda x: summed("per_example", x), lambda y: summed("transposed_product", y),
                            cols, k, like, generator)


def per_sample_sq_norms(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], estimator: str = "hutch",
                        k: int = 32, generator: torch.Generator | None = None) -> torch.Tensor:
    r"""Estimate of each example's squared gradient norm over the whole model.

    .. math:: \hat n_i = \sum_{\text{parameters}} \hat n_{i,p}, \qquad
              E[\hat n_i] = \|\nabla_\theta L_i\|_2^2 \ \text{(unbiased estimators)}

    Parameters
    ----------
    model : torch.nn.Module
        The model (in training mode); parameters with ``requires_grad=False`` are ignored.
    loss_fn : callable
        ``loss_fn(model) -> (B,)`` tensor of per-example losses (runs the forward pass or passes).
    estimator : {"hutch", "hutchpp", "ghost", "exact"}
        Per-layer estimator for linear-like layers (see :mod:`dpsgd.layers` for the others).
    k : int
        Projection dimension of ``hutch``/``hutchpp``.
    generator : torch.Generator, optional
        Source of the projections.

    Returns
    -------
    torch.Tensor
        ``(B,)`` float64, detached; no parameter's ``.grad`` is modified.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from dpsgd import per_sample_sq_norms
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> x, y = torch.randn(5, 4), torch.randn(5, 1)
    >>> loss_fn = lambda m: ((m(x) - y) ** 2).sum(1)
    >>> per_sample_sq_norms(model, loss_fn, "exact").shape
    torch.Size([5])
    """
    check_estimator(estimator, k)
    capture = Capture(NormPlan.build(model, estimator, k))
    try:
        losses = loss_fn(model)
        return clipped_backward(capture, losses, 1.0, k, generator, norms_only=True).sq_norms
    finally:
        capture.remove()

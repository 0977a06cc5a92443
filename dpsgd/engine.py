r"""The DP-SGD-RC step (paper 000, Alg. 1) with book-keeping clipped sums, and its completeness checks.

One step, for per-example losses ``L_i`` of a forward that :class:`Capture` recorded:

1. **forward**: every handled module's call (:mod:`dpsgd.layers`) runs with its parameters replaced by
   fresh leaf *aliases*, and its inputs and outputs are recorded (:class:`~dpsgd.layers.Call`).  A
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

Noise and the optimizer's step follow (:func:`private_step`, or :class:`dpsgd.PrivacyEngine`).  If a loss,
a norm or a sum is not finite the step raises ``FloatingPointError`` before anything is written.

:class:`NormPlan` is the one place that decides, per model, which modules are hooked, each one's
handler, and each parameter's chi-square terms; the step, the accountant's envelope and the validator use
it.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.utils.parametrizations import _SpectralNorm

from dpmath import Envelope, estimator_envelope

from .distributed import MIN_ROWS, any_rank, check_sharding, is_sharded, local_part, max_over_ranks, rank_world
from .estimators import ESTIMATORS, check_k, gaussian_projection, hutchpp_operator
from .isolation import ExampleMixingError, IncompleteGradientError, StateChangedError, call_examples
from .layers import (
    ROOT_PARAMETERS,
    Call,
    FunctionalHandler,
    Handler,
    RootParameterHandler,
    flat_tensors,
    full_float32,
    handler_for,
    is_parameter_container,
    matrix_view,
    module_type,
    per_leaf,
    secret_seed,
    segment_sum,
)
from .noise import GaussianNoise, StepNoise
from .sampling import HybridClipping, TwiceSampling, masked_clipped_sum
from .shared import Share, SharedOutput, carrying_back, share_output
from .validator import ModuleValidator, UnsupportedModuleError, frozen_batch_norm, uncompiled

__all__ = ["NormPlan", "PlanRow", "PlanTable", "PLAN_ESTIMATORS", "AUTO_COST_RATIO", "worth_estimating",
           "Capture", "IncompleteGradientError", "ExampleMixingError",
           "StateChangedError",
           "DEFAULT_CHECK_RATE", "ClippedGradients", "clipped_backward",
           "CLIPPING_PASSES", "check_clipping_pass", "check_groups", "unit_sq_norms",
           "check_estimator", "per_sample_sq_norms", "private_step", "StepResult"]


#: probability that a step's forward is probed and its rows checked (the default schedule; docs/trainer.md)
DEFAULT_CHECK_RATE = 0.125


#: the estimators a plan can be built with: each of :data:`~dpsgd.estimators.ESTIMATORS`, or ``"auto"``
PLAN_ESTIMATORS = ("auto", *sorted(ESTIMATORS))

#: under ``estimator="auto"`` a parameter is estimated only where its exact norm costs at least this many times the
#: estimate's (:func:`worth_estimating`): below it, the envelope's price in noise buys too little time or memory
AUTO_COST_RATIO = 8


def _check_estimator_name(estimator: object) -> None:
    if estimator not in PLAN_ESTIMATORS:
        raise ValueError(f"estimator must be one of {list(PLAN_ESTIMATORS)}, got {estimator!r}")


def worth_estimating(shape: tuple[int, ...], k: int) -> bool:
    r"""Whether ``estimator="auto"`` estimates a parameter of this shape at ``k`` projections: where its exact
    per-example norm costs at least :data:`AUTO_COST_RATIO` times Hutchinson's estimate.

    Per example and token, the exact norm of a ``rows x cols`` weight's gradient materializes ``rows * cols``
    products (ghost clipping's Gram matrices cost ``T (rows + cols)``, no less once the sequence length ``T`` is
    at least ``k``), and the estimate ``k (rows + cols)`` (paper 000, Table 8), in time and in memory alike.  So a
    weight is estimated iff ``rows * cols >= AUTO_COST_RATIO * k * (rows + cols)``: at ``k = 32``, square
    weights from width 512 on; never a bias or a normalization's scale.

    Parameters
    ----------
    shape : tuple of int
        The parameter's shape (read as a matrix: its first dimension by the product of the others).
    k : int
        The projection dimension.

    Returns
    -------
    bool

    Examples
    --------
    >>> from dpsgd.engine import worth_estimating
    >>> worth_estimating((2048, 2048), 32), worth_estimating((64, 20), 16), worth_estimating((2048,), 32)
    (True, False, False)
    """
    rows, cols = matrix_view(tuple(shape))
    return rows * cols >= AUTO_COST_RATIO * k * (rows + cols)


def check_estimator(estimator: object, k: object) -> None:
    """``ValueError`` unless ``estimator`` is a known name and ``k`` a positive integer."""
    _check_estimator_name(estimator)
    check_k(k)


@dataclass(frozen=True)
class Unit:
    """A hooked module: its path, the module, its handler and the parameters (by local name) it covers."""

    path: str
    module: nn.Module
    handler: Handler
    params: dict


def _refuse_dropout(path: str, module: nn.Module) -> None:
    """``UnsupportedModuleError`` if a module whose per-example gradients are recomputed by re-running it has
    dropout: the re-run would draw another mask than the forward did."""
    rates = [(f"{path}.{n}" if n else path, float(s.p)) for n, s in module.named_modules()
             if isinstance(s, nn.modules.dropout._DropoutNd) and s.p > 0]
    if isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
        rates.insert(0, (path, float(module.dropout)))
    if rates:
        where, p = rates[0]
        raise UnsupportedModuleError(
            path, f"{type(module).__name__} has dropout (p={p:g} at {where or '<root>'}) inside a module whose per-"
                  f"example gradients are recomputed exactly by re-running it (no handler of its own), and the "
                  f"re-run would draw another dropout mask than the forward; set that dropout to 0 (e.g. "
                  f"nn.TransformerEncoderLayer(..., dropout=0.0)), or register a handler for the module")


class PlanRow(NamedTuple):
    """One trainable parameter of a :class:`NormPlan` (a row of :meth:`NormPlan.table`).

    Attributes
    ----------
    parameter : str
        Its qualified name.
    module : str
        The type of the module that covers it (several, comma-separated, for a tied parameter).
    shape : tuple of int
    handler : str
        The handler class(es) that compute its per-example norm and clipped sum.
    norm : str
        How its per-example norm is found: ``"hutch"`` or ``"hutchpp"`` (estimated: a chi-square mixture in the
        envelope), or ``"exact"`` / ``"ghost"`` (computed exactly: a point mass in the estimate's law).
    terms : int
        The chi-square terms it adds to the envelope's dimension (``min(rows, cols)`` of an estimated weight,
        1 for an estimated bias; 0 when exact).
    """

    parameter: str
    module: str
    shape: tuple[int, ...]
    handler: str
    norm: str
    terms: int


class PlanTable(list):
    """The rows of :meth:`NormPlan.table` (a list of :class:`PlanRow`), printed as an aligned text table."""

    HEADER = ("parameter", "module", "shape", "handler", "norm", "terms")

    def __str__(self) -> str:
        cells = [self.HEADER] + [(r.parameter, r.module, "x".join(map(str, r.shape)) or "scalar", r.handler, r.norm,
                                  str(r.terms)) for r in self]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.HEADER))]
        lines = ["  ".join(c.rjust(w) if i == len(widths) - 1 else c.ljust(w)
                           for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip() for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


@dataclass
class NormPlan:
    r"""Which modules are hooked, with which handler, and how many ``chi2(k)/k`` terms each parameter adds.

    Built once per model (:meth:`build`): the one place that decides, per parameter, whether its norm is
    estimated or exact; the step (:meth:`norm`) and the accountant (:meth:`envelope`) both read it.
    ``terms[name]`` is a parameter's term count under ``hutch``/``hutchpp`` (``None``: exact, a point mass in the
    estimate's law).  The envelope's dimension ``D``
    (:meth:`envelope_dimension`) is their **sum over every parameter of the model**, not the widest layer's:
    the model's estimated squared norm is the sum of each parameter's independent estimate, a chi-square
    mixture with one term per singular value of that parameter's per-example gradient, so the sum is one
    mixture with all of them.

    Examples
    --------
    >>> from torch import nn
    >>> from dpsgd.engine import NormPlan
    >>> plan = NormPlan.build(nn.Sequential(nn.Linear(8, 3), nn.LayerNorm(3), nn.Linear(3, 2)), "hutch")
    >>> plan.envelope_dimension()   # (3 + 1) + (2 + 1): each Linear's min(rows, cols) and its bias
    (7, True)
    >>> print(plan.table())
    parameter  module     shape  handler               norm   terms
    ---------  ---------  -----  --------------------  -----  -----
    0.weight   Linear     3x8    LinearHandler         hutch      3
    0.bias     Linear     3      LinearHandler         hutch      1
    1.weight   LayerNorm  3      NormalizationHandler  exact      0
    1.bias     LayerNorm  3      NormalizationHandler  exact      0
    2.weight   Linear     2x3    LinearHandler         hutch      2
    2.bias     Linear     2      LinearHandler         hutch      1
    >>> plan.envelope(32)   # exact parts: the d -> inf limit (the Hutch++ envelope's form, d > k)
    HutchPPEnvelope(projection_dim=32, dim=33)
    """

    model: nn.Module
    estimator: str
    units: list = field(default_factory=list)
    names: dict = field(default_factory=dict)      # id(param) -> qualified name
    params: list = field(default_factory=list)     # trainable parameters covered, in model order
    owners: dict = field(default_factory=dict)     # id(param) -> [(unit, local name)]
    terms: dict = field(default_factory=dict)      # qualified name -> int | None

    @classmethod
    def build(cls, model: nn.Module, estimator: str, k: int | None = None) -> NormPlan:
        """The plan of ``model`` under ``estimator``; with ``k`` (the projection dimension) given, a parameter
        whose per-example gradient has rank at most ``k`` under ``hutchpp`` is exact: the sketch's ``k`` columns
        span it, so the norm is computed exactly and is a point mass in the law, not ``min(rows, cols)`` terms.
        ``"auto"`` (``k`` required) estimates with ``hutch`` the parameters :func:`worth_estimating` names and
        computes the others exactly."""
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        _check_estimator_name(estimator)
        if k is not None:
            k = check_k(k)
        elif estimator == "auto":
            raise ValueError("estimator='auto' chooses per parameter at the projection dimension: give k")
        model = uncompiled(model)
        ModuleValidator.check(model)
        plan = cls(model, estimator)
        inside: set[int] = set()
        for path, m in model.named_modules():
            if id(m) in inside or is_parameter_container(m):   # a container's parameters: its parent's
                continue
            h = handler_for(m)
            if not path and type(h) is FunctionalHandler:
                h = ROOT_PARAMETERS   # not a re-run of the whole model per example
            if h.recursive:
                inside.update(id(s) for s in m.modules())
            own = h.parameters(m)
            if own:
                plan.units.append(Unit(path, m, h, own))
                if h.reruns(m):
                    _refuse_dropout(path, m)
        for unit in plan.units:
            for local, p in unit.params.items():
                if id(p) not in plan.owners:
                    plan.owners[id(p)] = []
                    plan.params.append(p)
                    plan.names[id(p)] = f"{unit.path}.{local}" if unit.path else local
                plan.owners[id(p)].append((unit, local))
        if not plan.params:
            raise ValueError("model has no trainable parameters (every parameter has requires_grad=False)")
        for p in plan.params:
            check_sharding(plan.names[id(p)], p)
        method = plan.estimated_with
        for p in plan.params:
            owners = plan.owners[id(p)]
            ts = [u.handler.terms(u.module, local, method) for u, local in owners]
            if all(t is None for t in ts):
                t = None
            elif len(owners) == 1:
                t = ts[0]
            else:  # tied: the summed gradient estimated through every use's products (hutch: one P for all)
                t = min(matrix_view(p.shape)) if method in ("hutch", "hutchpp") else None
            if estimator == "hutchpp" and k is not None and t is not None and t <= k:
                t = None
            if estimator == "auto" and t is not None and not worth_estimating(tuple(p.shape), k):
                t = None
            plan.terms[plan.names[id(p)]] = t
        return plan

    @property
    def estimated_with(self) -> str:
        """The estimator of the parameters the plan estimates (``"hutch"`` under ``"auto"``)."""
        return "hutch" if self.estimator == "auto" else self.estimator

    @property
    def all_exact(self) -> bool:
        """Whether every parameter's norm is exact (no envelope: accounted as DP-SGD)."""
        return all(t is None for t in self.terms.values())

    def norm(self, name: str) -> str:
        """How the step computes the per-example norm of the parameter named ``name``: the plan's estimator where it
        is estimated, else exactly (``"ghost"``, the cheaper exact form, where ``hutchpp`` or ``"auto"`` left it
        exact; a handler with no estimate of its own computes it exactly whatever it is given)."""
        if self.terms[name] is not None:
            return self.estimated_with
        return "ghost" if self.estimator in ("hutchpp", "auto") else self.estimator

    def summary(self) -> str:
        """One line: the parameters estimated (and with what) against those exact, and the envelope's dimension."""
        est = [n for n, t in self.terms.items() if t is not None]
        if not est:
            return f"estimator {self.estimator}: every norm exact ({len(self.terms)} parameters), accounted as DP-SGD"
        d, _ = self.envelope_dimension()
        return (f"estimator {self.estimator}: {len(est)} of {len(self.terms)} parameters estimated with "
                f"{self.estimated_with} (D = {d}), {len(self.terms) - len(est)} exact")

    def envelope_dimension(self) -> tuple[int, bool]:
        """``(D, has_exact_parts)``: the chi-square terms of the model's estimate, summed over every parameter
        (at least 1), and whether a part is exact (a point mass)."""
        counted = [t for t in self.terms.values() if t is not None]
        return max(sum(counted), 1), len(counted) < len(self.terms)

    def envelope(self, k: int) -> Envelope | None:
        """The envelope the accountant charges each step with, at projection dimension ``k``.

        ``None`` when every norm is exact (``exact``/``ghost``, or Hutch++ on matrices of rank at most ``k``):
        DP-SGD's accounting.  With exact parts, their point masses are the ``d -> inf`` limit of the family,
        so the envelope is that limit, ``max(F_{chi2(k)/k}, 1{x >= 1})``, the Hutch++ envelope's form with
        ``d = max(D, k + 1)``; else the estimator's own envelope with ``d = D`` (:meth:`envelope_dimension`).

        Parameters
        ----------
        k : int
            The projection dimension of ``hutch``/``hutchpp``.

        Returns
        -------
        dpmath.Envelope or None
        """
        if self.all_exact:
            return None
        d, exact = self.envelope_dimension()
        if exact:
            return estimator_envelope("hutchpp", k, max(d, k + 1))
        return estimator_envelope(self.estimated_with, k, d)

    def __str__(self) -> str:
        """The :meth:`table` as aligned text (``print(engine.plan)``), with the envelope's dimension."""
        d, exact = self.envelope_dimension()
        if self.all_exact:
            foot = f"estimator {self.estimator}: every norm exact, accounted as DP-SGD (no envelope)"
        else:
            foot = (f"estimator {self.estimator}: envelope dimension D = {d}, the terms column summed over every "
                    f"parameter" + (" (some parts exact: the accountant uses the Hutch++ form with d = "
                                    "max(D, k + 1))" if exact else ""))
        return f"{self.table()}\n{foot}"

    def table(self) -> PlanTable:
        """One :class:`PlanRow` per trainable parameter, in model order; ``print`` it for an aligned table."""
        rows = PlanTable()
        for p in self.params:
            name = self.names[id(p)]
            owners = self.owners[id(p)]
            t = self.terms[name]
            norm = self.estimated_with if t is not None else "exact" if self.estimator in (
                "hutch", "hutchpp", "auto") else self.estimator
            rows.append(PlanRow(name, ", ".join(dict.fromkeys(module_type(u.module).__name__ for u, _ in owners)),
                                tuple(p.shape), ", ".join(dict.fromkeys(type(u.handler).__name__ for u, _ in owners)),
                                norm, t or 0))
        return rows


class Capture:
    """Forward hooks that record handled calls and swap their parameters for per-call aliases.

    Recording happens only while gradients are enabled, the root model is in training mode and the
    capture is active (the engine deactivates it while it computes norms and during its backward, where
    gradient checkpointing re-runs forwards).  ``calls`` keeps every recorded call until a backward
    consumes it or :meth:`clear` drops it.

    Around every recorded forward of the root model, the versions and identities of the model's parameters
    and buffers are compared: a change raises :class:`StateChangedError`.  A forward is *probed* on every
    step (``check_every_step``), on the first forward, or else with probability ``check_rate`` drawn from
    ``os.urandom``: its floating-point inputs that carry the batch are replaced by leaves that require
    gradient, so the row check (:func:`clipped_backward`) can see whether one example's loss depends on
    another example's input.
    """

    def __init__(self, plan: NormPlan) -> None:
        self.plan = plan
        self.calls: list[Call] = []
        self.active = True
        self._batch: int | None = None
        self._root_ints: set = set()
        self._depth = 0
        self._root_grad = False
        self.no_grad_units: list[str] = []
        # layouts of calls whose row-to-example attribution was verified, shared by every capture of the model
        self.checked_layouts: set = _VERIFIED_LAYOUTS.setdefault(plan.model, set())
        self.check_every_step = False
        self.check_rate = DEFAULT_CHECK_RATE
        self._forwards = 0            # recorded root forwards so far (the first is always probed)
        self._forward_probed = False  # whether the forward in progress is probed
        # probed forwards' inputs (name, leaf, the clone's node), until a backward takes them
        self.probes: list[tuple[str, torch.Tensor, object]] = []
        self._state: list | None = None
        self._swapped: dict[int, dict] = {}
        # the engine's ExampleTracker and the ids of the examples drawn for this step: each recorded call keeps the
        # examples of its rows, which the backward compares with the losses' (dpsgd.isolation)
        self.tracker = None
        self.batch_ids: torch.Tensor | None = None
        root = plan.model
        # the hooks run eagerly in a torch.compile'd model (each is a graph break): the compiled code between them
        # is the model's own, and the aliases are its inputs
        eager = torch.compiler.disable
        self._handles = [root.register_forward_pre_hook(eager(self._root_pre), with_kwargs=True),
                         root.register_forward_hook(eager(self._root_post), always_call=True)]
        self._handles += self._unit_hooks()

    def _unit_hooks(self) -> list:
        """The hooks of every unit of the plan, and the frozen batch norms' guards (the root's are registered once)."""
        eager = torch.compiler.disable
        handles = []
        for unit in self.plan.units:
            handles.append(unit.module.register_forward_pre_hook(eager(self._pre_hook(unit)), with_kwargs=True))
            handles.append(unit.module.register_forward_hook(eager(self._post_hook(unit)), with_kwargs=True,
                                                             always_call=True))
        return handles + _batch_norm_guards(self)

    def _recording(self) -> bool:
        return self.active and torch.is_grad_enabled() and self.plan.model.training

    def _root_pre(self, module, args, kwargs):
        self._depth += 1
        if self._depth != 1:
            return None
        # the batch size of this forward: the main input's leading dimension
        self._root_grad = torch.is_grad_enabled()
        main = [kwargs[n] for n in _MAIN_INPUTS if n in kwargs]
        first = next((x for x in (*main, *args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.dim() > 0),
                     None)
        self._batch = None if first is None else int(first.shape[0])
        # integer inputs carry the examples (token ids): a module reading a view of them is batched
        self._root_ints = {t.untyped_storage().data_ptr() for t in flat_tensors([list(args), kwargs])
                           if not (t.is_floating_point() or t.is_complex())}
        self._forward_probed = False
        if not self._recording():
            self._state = None
            return None
        self._state = _state_of(self.plan.model)
        if self.tracker is not None and self.batch_ids is not None and not self.tracker.active:
            self.tracker.push()   # another micro-batch of the batch drawn for this step
        self._forward_probed = (self.check_every_step or self._forwards == 0
                                or _secret_uniform() < self.check_rate)
        self._forwards += 1
        if not self._forward_probed or self._batch is None:
            return None
        return (tuple(self._probe(f"argument {i}", x) for i, x in enumerate(args)),
                {n: self._probe(n, x) for n, x in kwargs.items()})

    def _probe(self, name: str, x: object) -> object:
        """A batched floating-point input as a leaf that requires gradient (its clone enters the forward, so an
        in-place operation on the input inside the model stays legal)."""
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() > 0 and x.shape[0] == self._batch):
            return x
        if x.requires_grad:   # computed from something that trains: checked where it is
            self.probes.append((name, x, None))
            return x
        leaf = x.detach().requires_grad_(True)
        clone = leaf.clone()
        self.probes.append((name, leaf, clone.grad_fn))
        return clone

    def _root_post(self, module, args, output):
        self._depth -= 1
        if self._depth == 0:
            self._batch = None
            state, self._state = self._state, None
            if state is not None and output is not None:
                changed = _changed_state(self.plan.model, state)
                if changed:
                    raise StateChangedError(
                        f"{changed} changed during a training forward, so the model would carry un-noised information "
                        f"about the batch (running statistics of private data, Embedding(max_norm=...)'s in-place "
                        f"renormalization of the looked-up rows). Private training here offers no privatized running "
                        f"statistics: remove the update (or construct the module without it, e.g. max_norm=None, "
                        f"track_running_stats=False), or freeze the statistics before training")

    def _pre_hook(self, unit: Unit):
        def hook(module, args, kwargs):
            if not self._recording():
                if self.active and self._depth and self._root_grad and self.plan.model.training:
                    # no_grad inside a training forward (e.g. reentrant checkpointing's first pass): its
                    # parameters would silently not train
                    self.no_grad_units.append(unit.path or type(module).__name__)
                return None
            aliases, previous = {}, {}
            for local, p in unit.params.items():
                owner, attr = _locate(module, local)
                current = owner._parameters[attr]
                if current is p:
                    data = p.detach()
                elif is_sharded(p) and current is not None and current.shape == p.shape:
                    # FSDP2 gathered the parameter for this forward; it frees the gathered copy after use
                    data = current.detach().clone() if unit.handler.needs_weights(module) else current.detach()
                else:
                    raise RuntimeError(f"{self.plan.names[id(p)]} was replaced after make_private; its gradient "
                                       f"would not be that of the parameter the optimizer updates")
                alias = nn.Parameter(data, requires_grad=True)
                owner._parameters[attr] = alias
                aliases[local], previous[local] = alias, current
            share = None
            if isinstance(unit.handler, RootParameterHandler):
                # the model's own parameters are outputs shared by the batch: marked, every use of them is
                # followed to where it meets the batch
                if self._batch is None:
                    raise UnsupportedModuleError(
                        "", "the model has trainable parameters of its own, whose per-example gradients are found "
                            "where they meet the batch, but its forward got no tensor whose leading dimension is "
                            "the batch")
                share = Share("the model's own parameters", list(aliases.values()), self._batch)
                for local, alias in aliases.items():
                    owner, attr = _locate(module, local)
                    owner._parameters[attr] = share_output(alias, share)
            self._swapped.setdefault(id(module), []).append((aliases, previous, share))
            return None
        return hook

    def _post_hook(self, unit: Unit):
        def hook(module, args, kwargs, output):
            stack = self._swapped.get(id(module))
            if not stack:
                return None
            aliases, previous, share = stack.pop()
            for local in aliases:  # always restore, even when the forward raised
                owner, attr = _locate(module, local)
                owner._parameters[attr] = previous[local]
            if output is None:  # the forward raised (always_call)
                return None
            b = self._batch
            own = share is not None
            if own:   # the model's own parameters: the call is their use, the aliases its outputs (and the root's
                # own post-hook, registered first, has already forgotten the batch size)
                b, args, kwargs, outs = share.b, (), {}, list(aliases.values())
            else:
                outs = flat_tensors(output)
                if not outs:
                    raise ValueError(f"{unit.path or type(module).__name__} has trainable parameters but returned no "
                                     "tensor")
                if b is None:
                    b = outs[0].shape[0] if outs[0].dim() else 1
                if len(outs) > 1:
                    # one output may be computed from another inside the module (a router's scores from its
                    # logits): the model reads views, so each output's gradient is that of its uses outside
                    output = _fresh_views(output)
                    outs = flat_tensors(output)
                one_row = isinstance(output, torch.Tensor) and b > 1 and output.dim() and output.shape[0] == 1
                if self._batch is not None and len(outs) == 1 and isinstance(output, torch.Tensor) and (
                        one_row or _unbatched(args, kwargs, self._root_ints, b)):
                    # computed from no example's data (positions from torch.arange, a bias table, a prompt), or one
                    # row for a batch of several: an output shared by the batch, whose per-example gradients come
                    # from where it meets the batch
                    share = Share(unit.path or type(module).__name__, outs, b)
                    output = share_output(output, share)
            # a call whose inputs need no gradient (a first layer): the row check asks the backward for its outputs
            root = not any(t.requires_grad for t in flat_tensors(list(args)) + flat_tensors(kwargs))
            call = Call(module, tuple(_detach(x) for x in args), {n: _detach(x) for n, x in kwargs.items()},
                        outs, aliases, b)
            call.cache["root"] = root
            call.cache["versions"] = _versions(call)
            call.cache["nodes"] = [o.grad_fn for o in outs]
            call.cache["unit"] = unit
            call.cache["probed"] = self._forward_probed
            call.cache["share"] = share
            if share is not None:   # the exact fallback re-runs the module on these, once per example
                call.cache["shared_inputs"] = (call.args, call.kwargs)
            # the autocast the call ran under: the exact fallback re-runs it so, and the row check's tolerance
            # follows the precision the backward ran in
            call.cache["autocast"] = next(((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
                                           if torch.is_autocast_enabled(d)), None)
            unit.handler.check_forward(call)
            if self.tracker is not None and self.batch_ids is not None:
                # the examples of the call's rows, compared with the losses' at the backward
                call.cache["examples"] = call_examples(
                    self.tracker, f"a call of {unit.path or type(module).__name__}",
                    [*flat_tensors(list(args)), *flat_tensors(kwargs), *outs])
            self.calls.append(call)
            return output if (share is not None and not own) or len(outs) > 1 else None
        return hook

    def clear(self) -> None:
        """Drop every recorded call (their activations are freed)."""
        self.calls.clear()
        self.probes.clear()
        self.no_grad_units.clear()

    def remove(self) -> None:
        """Remove the hooks; the model is as before capture."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.calls.clear()
        self.probes.clear()

    def replan(self, plan: NormPlan) -> None:
        """Follow ``plan``, a new plan of the same model (its trainable parameters changed between steps): the
        hooks of the units are registered again, the root's stay.  ``RuntimeError`` while a recorded call waits for
        a backward (it was recorded under the old plan)."""
        if plan.model is not self.plan.model:
            raise ValueError("a capture follows new plans of its own model only")
        if self.calls:
            raise RuntimeError("the trainable parameters changed while recorded calls wait for a backward")
        for h in self._handles[2:]:
            h.remove()
        self._handles = self._handles[:2]
        self.plan = plan
        self._handles += self._unit_hooks()


def _batch_norm_guards(capture: Capture) -> list:
    """Hooks that refuse a frozen batch norm (the validator's :func:`~dpsgd.validator.frozen_batch_norm`) found in
    training mode at a recorded forward, before it runs: it would normalize with the batch's statistics (mixing
    the examples) and update its running statistics from private data."""
    def guard(path: str):
        def hook(module, args):
            if module.training and capture._recording():
                raise UnsupportedModuleError(
                    path, f"{type(module).__name__} is frozen but in training mode in a training forward, where it "
                          f"would normalize with the batch's statistics (mixing the examples) and update its running "
                          f"statistics from private data. Keep it in evaluation mode: call "
                          f"model.get_submodule({path!r}).eval() after every model.train() (or override the model's "
                          f"train()), or replace it with GroupNorm (ModuleValidator.fix)")
        return hook
    return [m.register_forward_pre_hook(torch.compiler.disable(guard(path)))
            for path, m in capture.plan.model.named_modules() if frozen_batch_norm(m)]


def _keep_saved_buffers():
    """A context in which ``torch.compile`` (AOTAutograd) compiles backward functions that keep their saved buffers
    (no donation), so that a graph can be backpropagated twice (the row check's pass, then the step's own)."""
    try:
        from torch._functorch import config
    except ImportError:   # no compiler: nothing to configure
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False) if hasattr(config, "donated_buffer") else contextlib.nullcontext()


def _fresh_views(out: object) -> object:
    """``out`` with every floating-point tensor replaced by a view of itself (a new node in the autograd graph), in
    the same nesting of tuples, lists and dicts."""
    if isinstance(out, torch.Tensor):
        return out.view_as(out) if out.requires_grad else out
    if isinstance(out, tuple):
        items = [_fresh_views(v) for v in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, list):
        return [_fresh_views(v) for v in out]
    if isinstance(out, dict):
        fresh = out.copy()
        for k, v in out.items():
            fresh[k] = _fresh_views(v)
        return fresh
    return out


def _unbatched(args: tuple, kwargs: dict, root_ints: set, b: int) -> bool:
    """Whether a call's inputs carry no example's data: integer tensors that are neither views of the model's integer
    inputs nor shaped like a batch of sequences (``torch.arange`` positions, T5's relative-position buckets, prompt
    ids), outputs shared by the batch, or none at all.  Either misreading is safe: a batched output read as shared
    meets the batch row by row and is read as batched again; a shared one read as batched fails the row check."""
    for t in flat_tensors([list(args), kwargs]):
        if isinstance(t, SharedOutput) and t._dp_shares:
            continue
        if t.is_floating_point() or t.is_complex() or t.untyped_storage().data_ptr() in root_ints:
            return False
        if t.dim() >= 2 and t.shape[0] == b and t.stride(0) != 0 and not _toeplitz(t):
            return False   # token ids computed from the inputs (labels shifted right into decoder inputs)
    return True


def _toeplitz(t: torch.Tensor) -> bool:
    """A 2-D table constant along its diagonals, as relative-position buckets ``f(j - i)`` are."""
    return t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1 and torch.equal(t[1:, 1:], t[:-1, :-1])


def _reset_shares(calls: list[Call]) -> None:
    for c in calls:
        if c.cache.get("share") is not None:
            c.cache["share"].reset()


def _handler_call(c: Call, b: int) -> Call:
    """``c`` as its handler reads it, after a backward set ``c.grads`` (the gradient of the summed losses): for an
    output shared by the batch, a call of ``b`` examples each reading the whole inputs, with the per-example
    output gradients its meetings with the batch sent back, checked to add up to ``c.grads``."""
    share = c.cache.get("share")
    if share is None:
        return c
    name = c.cache["unit"].path or type(c.module).__name__
    per = share.take()
    met = any(g is not None for g in per)
    if share.aligned:
        if met:
            raise IncompleteGradientError(
                f"{name}'s output is combined with the batch both row by row and broadcast over it, so which rows "
                f"are which example's is ambiguous; give the shared use a leading dimension of 1")
        return c
    for g, p in zip(c.grads, per, strict=True):
        if p is None and g is not None and bool(g.ne(0).any()):
            raise IncompleteGradientError(
                f"a part of {name}'s output that is shared by the batch reached the losses without meeting the batch "
                f"in an operation the trainer follows (one combining it with each example's rows, as x + pos or "
                f"scores + bias; not a custom autograd.Function, torch.vmap, or operations with torch function "
                f"handling off), so its per-example gradient cannot be found; the step was not taken")
    if not met:   # no gradient reached it at all
        return c
    for g, p in zip(c.grads, per, strict=True):
        if g is None or p is None:
            continue
        low = g.dtype in (torch.float16, torch.bfloat16) or c.cache.get("autocast")
        tol = 5e-2 if low else (1e-8 if g.dtype == torch.float64 else 1e-4)
        err = float((p.sum(0).to(g.dtype) - g).norm())
        if not err <= tol * max(float(g.norm()), 1e-30):
            raise IncompleteGradientError(
                f"{name}'s output is shared by the batch, and part of its gradient reached the losses around the "
                f"operations that meet the batch (relative error {err / max(float(g.norm()), 1e-30):.3g}), so "
                f"its per-example gradients are incomplete; the step was not taken. Avoid .data, in-place writes "
                f"into it and operations outside torch on it")

    def expand(x):
        return x.unsqueeze(0).expand(b, *x.shape) if isinstance(x, torch.Tensor) else x
    return Call(c.module, tuple(per_leaf(x, expand) for x in c.args),
                {n: per_leaf(x, expand) for n, x in c.kwargs.items()}, c.outputs, c.aliases, b, per, c.cache)


def _secret_uniform() -> float:
    """A uniform draw from ``os.urandom``: no seed or generator of the user's can predict or replay it."""
    return secret_seed() / 2.0 ** 56


def _state_of(model: nn.Module) -> tuple:
    """What a training forward must leave as it was: every parameter's and buffer's identity and version."""
    params = [(n, p, p._version) for n, p in model.named_parameters(remove_duplicate=False)]
    skip = _weight_only(model)
    buffers = [(n, b, b._version) for n, b in model.named_buffers(remove_duplicate=False) if n not in skip]
    return params, buffers, skip


def _weight_only(model: nn.Module) -> set[str]:
    """Buffers a training forward updates from the weights alone, never from data: ``spectral_norm``'s power
    iteration vectors."""
    return {f"{path}.{n}" if path else n for path, m in model.named_modules() if isinstance(m, _SpectralNorm)
            for n, _ in m.named_buffers(recurse=False)}


def _changed_state(model: nn.Module, state: tuple) -> str | None:
    params, buffers, skip = state
    for name, p, version in params:
        if p._version != version:
            return f"parameter {name}"
    now = {n: b for n, b in model.named_buffers(remove_duplicate=False) if n not in skip}
    for name, b, version in buffers:
        if now.get(name) is not b or b._version != version:
            return f"buffer {name}"
    if len(now) != len(buffers):
        return f"buffer {next(n for n in now if n not in {m for m, _, _ in buffers})}"
    return None


_VERIFIED_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# keyword inputs that carry the batch (Hugging Face names), looked at before any other argument
_MAIN_INPUTS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features")


def _locate(module: nn.Module, local: str) -> tuple[nn.Module, str]:
    *path, attr = local.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def _detach(x: object) -> object:
    """``x`` detached, in nested tuples and lists too (an LSTM's ``(h_0, c_0)``)."""
    return per_leaf(x, lambda t: t.detach() if isinstance(t, torch.Tensor) else t)


def _versions(call: Call) -> list[int]:
    ts = flat_tensors(list(call.args)) + flat_tensors(call.kwargs) + call.outputs
    return [t._version for t in ts]


# in-place operations whose gradient with respect to the tensor modified is the gradient of their result
_PASS_THROUGH = ("AddBackward0", "SubBackward0")


def _added_to(t: torch.Tensor, node: object) -> bool:
    """Whether ``t`` was only added to in place since its autograd node was ``node`` (``x += y`` on a layer's
    output, as Falcon's parallel attention does), each time with something computed without it: the gradient with
    respect to it is then unchanged.  (``x += f(x)`` is not: ``f(x)``'s gradient would reach the recorded output
    behind the row check's hooks, which sit on the sum.)"""
    current = t.grad_fn
    while current is not None and current is not node:
        if type(current).__name__ not in _PASS_THROUGH or _reaches(current.next_functions[1][0], node):
            return False
        current = current.next_functions[0][0]
    return current is node


def _reaches(start: object, node: object) -> bool:
    """Whether the autograd graph below ``start`` contains ``node`` (nodes created before ``node`` cannot, and are not
    searched: sequence numbers grow as nodes are made)."""
    if node is None or start is None:
        return False
    first = node._sequence_nr()
    seen, stack = set(), [start]
    while stack:
        cur = stack.pop()
        if cur is None or id(cur) in seen:
            continue
        if cur is node:
            return True
        seen.add(id(cur))
        if cur._sequence_nr() >= first:
            stack.extend(fn for fn, _ in cur.next_functions)
    return False


def _check_unchanged(call: Call) -> None:
    now, then = _versions(call), call.cache["versions"]
    n_in = len(now) - len(call.outputs)
    unit = call.cache["unit"]
    ok = now[:n_in] == then[:n_in] and all(
        v == w or (not unit.handler.reads_output and _added_to(o, node))
        for o, node, v, w in zip(call.outputs, call.cache["nodes"], now[n_in:], then[n_in:], strict=True))
    if not ok:
        raise IncompleteGradientError(
            f"an input or output of {unit.path or type(call.module).__name__} was modified in place after its "
            f"forward (e.g. ReLU(inplace=True) or x += ...); its per-example gradient cannot be computed from the "
            f"recorded values. Use the out-of-place operation.")


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
    from the recorded calls and sums them with :func:`dpsgd.sampling.masked_clipped_sum`: l2 clipping of each
    example's part in the parameter's group (one group for :class:`~dpsgd.sampling.TwiceSampling`), then
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
    (:func:`_row_check`), the one backward to every call's outputs (:func:`_output_gradients`: no trainable
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
    _row_check(capture, calls, losses, model_params)
    reached = _output_gradients(capture, calls, losses, model_params, two_pass)
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
        _check_unchanged(c)
    if losses.shape[0] and not losses.requires_grad:
        raise IncompleteGradientError("the losses do not require grad: the forward that produced them was not "
                                      "recorded with gradients (torch.no_grad?)")
    if two_pass and any(p.dtype in (torch.float16, torch.bfloat16) for p in capture.plan.params):
        raise ValueError("clipping_pass='two-pass' sums clipped gradients in the parameters' dtype, which is half "
                         "precision here; rounding could let a clipped contribution exceed C. Use "
                         "clipping_pass='bookkeeping' (sums in float32)")
    return two_pass


def _row_check(capture: Capture, calls: list[Call], losses: torch.Tensor, model_params: list) -> None:
    """The row check (:func:`_check_rows`: example ``i``'s loss depends on example ``i``'s rows alone) on a step
    that needs it: a new layout of calls (with the row attribution too), a probed forward, or every step with
    ``check_every_step``; it sees the probed forwards' inputs.  It runs before the step's own backward, which
    then keeps no graph for it.

    Under FSDP2 on several ranks its backward passes gather sharded parameters, so the ranks decide together, in
    one collective: every rank checks, with the attribution passes, if some rank needs to, and every rank raises if
    some rank's check fails (:func:`_check_rows` with ``collective``).  Every rank's batch must then hold at least
    :data:`~dpsgd.distributed.MIN_ROWS` rows (the private loader completes smaller parts with filler rows); a
    smaller one raises ``ValueError`` on every rank, before any backward."""
    b = losses.shape[0]
    probes, capture.probes = capture.probes, []
    layout = _layout(calls, losses, probes)
    new_layout = layout not in capture.checked_layouts
    need = capture.check_every_step or new_layout or any(c.cache.get("probed") for c in calls)
    # 0: no check, 1: the isolation pass, 2: with the attribution passes
    level = (2 if new_layout else 1) if need and b > 1 else 0
    collective = rank_world()[1] > 1 and any(is_sharded(p) for p in model_params)
    if collective:   # the check's backward gathers parameters: every rank or none, with as many passes
        level, neg = max_over_ranks([level, -b])
        fewest = -neg
        if fewest < MIN_ROWS:
            raise ValueError(f"a backward of {fewest} row(s) on some rank (this rank: {b}) under FSDP2: every rank "
                             f"runs the row check's backward, which gathers the sharded parameters, on batches of "
                             f"at least {MIN_ROWS} rows. Draw the batches from the loader make_private returned (it "
                             f"completes a rank's smaller part with filler rows that the step weights 0), or give "
                             f"every rank's losses at least {MIN_ROWS} rows")
    if level:
        capture.active = False
        try:
            with _keep_saved_buffers():   # a torch.compile'd backward is compiled at its first call
                _check_rows(losses, calls, probes, attribution=level == 2, collective=collective)
        finally:
            capture.active = True
        capture.checked_layouts.add(layout)


def _output_gradients(capture: Capture, calls: list[Call], losses: torch.Tensor, model_params: list,
                      two_pass: bool) -> list[Call]:
    """The one backward, ``autograd.grad(sum_i L_i, outputs + real parameters)``: each call the losses reached gets
    its output gradients (``call.grads``) and is consumed from ``capture``, resolved for its handler
    (:func:`_handler_call`); returned in order.

    Guarantees: no trainable parameter received gradient outside a recorded call (else
    :class:`IncompleteGradientError` naming it; under FSDP2 also through a gathered copy), and every reached
    call's tensors start with the losses' batch dimension (else ``ValueError``).  The lists of every output and
    output gradient are this function's own, so each call's are freed once its sums are formed."""
    plan, b = capture.plan, losses.shape[0]
    outputs = [o for c in calls for o in c.outputs]
    _reset_shares(calls)
    with _keep_saved_buffers():
        grads = (_first_backward(capture, losses, outputs, model_params, retain_graph=two_pass) if b
                 else [None] * (len(outputs) + len(model_params)))
    leaked = [plan.names.get(id(p), _qualified(plan.model, p)) for p, g in zip(model_params, grads[len(outputs):],
                                                                              strict=True) if g is not None]
    if b and any(is_sharded(p) for p in model_params):
        # FSDP2 runs modules with gathered copies of the sharded parameters: gradient that reaches one outside
        # a recorded call would not reach the parameter itself, so look for it in the graph
        leaked += _gathered_leaves(losses, calls)
    if leaked:
        raise IncompleteGradientError(_leak_message(leaked, plan))
    pos, reached = 0, []
    for c in calls:
        c.grads = grads[pos:pos + len(c.outputs)]
        pos += len(c.outputs)
        if any(g is not None for g in c.grads):
            reached.append(c)
    done = {id(c) for c in reached}
    capture.calls = [c for c in calls if id(c) not in done]
    reached = [_handler_call(c, b) for c in reached]
    for c in reached:
        name = c.cache["unit"].path or type(c.module).__name__
        if c.batch_size != b:
            raise ValueError(f"{name} ran in a forward of {c.batch_size} examples but the loss has {b}: every "
                             f"handled module's input and output must start with the batch dimension of the loss "
                             f"(one row per example)")
        lead = [tuple(g.shape) for g in c.grads[:1] if g is not None and not _rows_ok(c, g, b)]
        if lead:
            raise ValueError(f"{name}'s output has shape {lead[0]}, which does not start with the batch dimension "
                             f"({b} examples): per-example gradients need one row per example. Outputs shared by the "
                             f"batch are read where they meet it when they are computed from no example's data "
                             f"(positions from torch.arange, a bias table) or have one row for the whole batch; rows "
                             f"that flatten the batch ((B*T, d), example-major) are read by every handler but "
                             f"convolutions and GroupNorm")
    return reached


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

    Per parameter with one call, by its handler's :meth:`~dpsgd.layers.Handler.unit_sq_norms` where it has one
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
    >>> from dpsgd.engine import Capture, NormPlan, clipped_backward
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
    masked coordinate-wise (:func:`dpsgd.sampling.masked_clipped_sum`)."""
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
                _release(call)
    return sums


def _layout(calls: list[Call], losses: torch.Tensor, probes: list) -> tuple:
    """The calls' modules and tensor shapes, with the batch size written ``-1``, and the operations of the
    autograd graph from the calls to the losses (without the probes' own nodes): equal for steps whose forwards
    and losses ran the same way on batches of any size (a loss that starts reading another example's output
    changes it)."""
    b = losses.shape[0]

    def shapes(ts):
        return tuple(tuple(-1 if d == b else d for d in t.shape) for t in ts if isinstance(t, torch.Tensor))
    skip = {id(node) for _, _, node in probes if node is not None}
    ops = tuple(type(node).__name__ for node in _graph_nodes(losses, skip)) if losses.requires_grad else ()
    return tuple((c.cache["unit"].path, type(c.cache["unit"].handler).__name__, shapes(c.args),
                  shapes(c.kwargs.values()), shapes(c.outputs),
                  shapes(c.cache["share"].meetings) if c.cache.get("share") else ()) for c in calls) + (ops,)


def _check_rows(losses: torch.Tensor, calls: list[Call], probes: list, attribution: bool,
                collective: bool = False) -> None:
    r"""Raise unless example ``i``'s loss depends on example ``i``'s rows alone (and, with ``attribution``, row ``i``
    of every recorded call is example ``i`` as its handler reads it).  Runs before the step's own backward and
    keeps the autograd graph for it.

    Each pass draws a random half ``S`` of the batch (from ``os.urandom``) and weights ``v_i`` uniform in
    ``[1, 2]`` for ``i`` in ``S``, ``0`` elsewhere, and runs one backward of ``sum_i v_i L_i``:

    * **isolation** (:class:`ExampleMixingError`): its gradient with respect to every recorded call's output
      and every probed input must be *exactly zero* in the rows outside ``S``.  Operations that treat rows
      separately never create a non-zero there (a zero row times anything finite is zero), so no tolerance
      is needed, and a mixing term of any size (a batch mean, batch statistics, softmax or attention over the
      batch, a loss that reads other rows) is caught once ``S`` separates two examples it mixes: with
      probability at least 1/4 per pass for any one pair, 1/2 over the two complementary passes made with
      ``attribution``, and almost surely for a batch-wide statistic.  The gradients are inspected as they pass
      (tensor hooks) and, without ``attribution``, never stored: the backward is asked only for the probed
      inputs and the outputs of calls whose inputs need no gradient, so no weight gradient is formed.
    * **attribution** (:class:`IncompleteGradientError`, two complementary passes, so every row has a non-zero
      weight once): with the output gradients ``G^v`` of the pass (``v_j G_j`` row by row, once isolation
      holds), each handler's sum of per-example gradients must equal autograd's gradient of ``sum_i v_i L_i``
      with respect to the call's parameters; a wrong per-example gradient agrees only for ``v`` in a set of
      measure zero.  Relative tolerance ``1e-6`` in float64, ``1e-4`` in float32, ``5e-2`` when the forward
      ran under autocast or an output is half precision, of the layer's gradient or (if larger) of the
      largest layer's divided by the batch size.

    With ``collective`` (FSDP2: every rank runs the same passes) each pass's verdict is shared after the pass: if
    any rank's fails, every rank raises (the others :class:`IncompleteGradientError` saying so), so no rank goes on to
    a backward that the failed one skips.
    """
    b = losses.shape[0]
    rows = _secret_halves(b)
    for j in range(2 if attribution else 1):
        inside = rows if j == 0 else ~rows
        v = torch.where(inside, 1 + torch.rand(b, generator=torch.Generator().manual_seed(secret_seed()),
                                               dtype=torch.float64), 0.0)
        v = v.to(losses.device, losses.dtype)
        outside = (~inside).to(losses.device)
        mixed: list[tuple[int, str]] = []   # (forward order, what): the last one is where the mixing follows
        sums = _HandlerSums(calls, b) if attribution else None
        handles = []
        _reset_shares(calls)
        for i, c in enumerate(calls):
            share = c.cache.get("share")
            for t in share.meetings if share is not None else ():
                # where an output shared by the batch meets it: rows are examples
                what = f"{c.cache['unit'].path or type(c.module).__name__}'s output where it meets the batch"
                handles.append(t.register_hook(_rows_hook(outside, mixed, (i, what), None, None)))
            for k, t in enumerate(c.outputs):
                # the first output starts with the batch (the engine refuses a call whose first output does not);
                # another (an LSTM's (layers, B, H) state) may have it elsewhere: kept, not inspected
                first = k == 0 and (share is None or share.aligned) and _rows_ok(c, t, b)
                if t.requires_grad and (first or attribution):
                    what = f"{c.cache['unit'].path or type(c.module).__name__}'s output"
                    handles.append(t.register_hook(_rows_hook(outside if first else None, mixed, (i, what),
                                                              sums, (i, k))))
        probed = [(name, x) for name, x, _ in probes if x.requires_grad]
        if attribution:
            pairs = [(c, local) for c in calls for local in c.aliases]
            targets = [c.aliases[local] for c, local in pairs]
        else:
            pairs = []
            targets = [t for c in calls if c.cache.get("root") for t in c.outputs if t.requires_grad]
            if not targets and not probed:
                targets = [a for c in calls for a in c.aliases.values()]
        if not targets and not probed:   # nothing recorded (an eval-mode forward): the backward below says so
            for h in handles:
                h.remove()
            return
        try:
            if attribution:
                # autograd's gradient of each alias is compared with its handler's sum as soon as both exist, then
                # dropped: the pass never holds every parameter's gradient and sum at once
                index = {id(c): i for i, c in enumerate(calls)}
                for c, local in pairs:
                    handles.append(c.aliases[local].register_post_accumulate_grad_hook(
                        _alias_hook(sums, (index[id(c)], local))))
                torch.autograd.backward((losses * v).sum(), inputs=targets + [x for _, x in probed],
                                        retain_graph=True)
                grads = [x.grad for _, x in probed]
                for _, x in probed:
                    x.grad = None
            else:
                grads = torch.autograd.grad((losses * v).sum(), targets + [x for _, x in probed],
                                            allow_unused=True, retain_graph=True)[len(targets):]
        finally:
            for h in handles:
                h.remove()
        for (name, _), g in zip(probed, grads, strict=True):
            if g is not None and _nonzero_rows(g, outside.to(g.device)):
                mixed.append((-1, f"the input {name}"))
        try:
            if mixed:
                raise ExampleMixingError(_mixing_message(mixed, calls))
            if attribution:
                sums.finish()
                if sums.error is not None:
                    raise sums.error
                _compare_attribution(sums, b)
        except Exception:
            # one rank's verdict (its random half may be the one that separates mixed examples) is every rank's:
            # a rank that went on to the next pass or the step's backward would wait for the others for ever
            if collective:
                any_rank(True)
            raise
        if collective and any_rank(False):
            raise IncompleteGradientError("the row check failed on another rank (its error names the cause); the "
                                          "step was not taken on any rank")


def _mixing_message(mixed: list[tuple[int, str]], calls: list[Call]) -> str:
    """Where the mixing is: after the last recorded output (or input) whose other rows the losses depend on, and
    before the next recorded output that is clean."""
    last, what = max(mixed)
    flagged = {i for i, _ in mixed}
    after = next((c for i, c in enumerate(calls) if i > last and i not in flagged), None)
    where = f"after {what}" + ("" if after is None else
                               f" and before the output of {after.cache['unit'].path or type(after.module).__name__}")
    return (f"the losses of some examples depend on rows of {what} that are not their own (the gradient of a "
            f"weighted sum of some examples' losses is not zero in the other examples' rows), so one example could "
            f"move the others' clipped contributions and no bound by max_grad_norm holds; the step was not taken. "
            f"Look {where}: either the rows are not the examples (a loop over examples inside the forward, permuted "
            f"or gathered rows), or something mixes examples (a batch statistic such as F.batch_norm or "
            f"x - x.mean(0), softmax or attention over the batch dimension, a loss that reads other rows such as "
            f"in-batch negatives). Compute everything per example, row i for example i.")


def _alias_hook(sums: _HandlerSums, key: tuple[int, str]):
    """A post-accumulate-grad hook that hands an alias's gradient from a check pass to ``sums`` and frees it."""
    def hook(alias):
        sums.true_gradient(key, alias.grad.detach().reshape(-1))
        alias.grad = None
    return hook


def _rows_hook(outside: torch.Tensor | None, found: list, what: tuple, sums: _HandlerSums | None, key: tuple):
    """A tensor hook that records ``what`` if the gradient passing is non-zero in a row ``outside`` (and hands it
    to ``sums`` when given)."""
    def hook(grad):
        if carrying_back():
            return   # an output shared by the batch carrying per-example gradients back through this tensor
        if outside is not None and _nonzero_rows(grad, outside.to(grad.device)):
            found.append(what)
        if sums is not None:
            sums.add(key, grad)
    return hook


class _HandlerSums:
    """Each call's handler sums of per-example gradients for the output gradients of one check pass, formed as
    soon as all of the call's output gradients have arrived (inside the backward), and compared with autograd's
    gradient of the same weighted sum as soon as that arrives too: only the sums and gradients of the layers in
    flight are held, not every layer's output gradient nor every parameter's gradient."""

    def __init__(self, calls: list[Call], b: int) -> None:
        self.calls, self.b = calls, b
        self.pending: dict[int, dict[int, torch.Tensor]] = {}
        self.expect = {i: sum(t.requires_grad for t in c.outputs) for i, c in enumerate(calls)}
        self.sums: dict[tuple[int, str], torch.Tensor] = {}    # sums whose autograd gradient has not arrived
        self.trues: dict[tuple[int, str], torch.Tensor] = {}   # autograd gradients whose sum is not formed yet
        self.compared: list[tuple[Call, str, float, float]] = []   # (call, name, ||sum - gradient||, ||gradient||)
        self.error: Exception | None = None   # a handler's refusal, raised after the isolation verdict

    def true_gradient(self, key: tuple[int, str], t: torch.Tensor) -> None:
        """Autograd's gradient of the pass's weighted loss with respect to a call's parameter alias."""
        s = self.sums.pop(key, None)
        if s is None:
            self.trues[key] = t
        else:
            self._compare(key, s, t)

    def _compare(self, key: tuple[int, str], s: torch.Tensor, t: torch.Tensor) -> None:
        self.compared.append((self.calls[key[0]], key[1], float((s - t.to(s.dtype)).norm()), float(t.norm())))

    def add(self, key: tuple[int, int], grad: torch.Tensor) -> None:
        i, k = key
        got = self.pending.setdefault(i, {})
        got[k] = grad if k not in got else got[k] + grad
        if len(got) == self.expect[i]:
            self._form(i)

    def finish(self) -> None:
        """Form the sums of calls some of whose outputs received no gradient, and compare the sums of parameters
        that received none from autograd with zero."""
        for i in list(self.pending):
            self._form(i)
        for key, s in self.sums.items():
            self._compare(key, s, torch.zeros_like(s))
        self.sums.clear()
        self.trues.clear()

    def _form(self, i: int) -> None:
        got = self.pending.pop(i)
        c, b = self.calls[i], self.b
        c.grads = [got.get(k) for k in range(len(c.outputs))]
        try:
            view = _handler_call(c, b)
            lead = view.grads[0] if view is not c else c.outputs[0] if c.outputs else None
            if c.batch_size != b or lead is None or not _rows_ok(view, lead, b):
                return   # not batch-first: the step's own backward refuses it by name
            ones = torch.ones(b, dtype=torch.float64, device=lead.device)
            for local in c.aliases:
                s = c.cache["unit"].handler.clipped_sum(view, local, ones)
                # in the precision it was formed in (float32, or float64 for a float64 model): a float64 copy of
                # every parameter would double the first step's peak
                s = s.detach().reshape(-1)
                t = self.trues.pop((i, local), None)
                if t is None:
                    self.sums[(i, local)] = s
                else:
                    self._compare((i, local), s, t)
        except Exception as err:   # noqa: BLE001 -- kept for after the isolation verdict, which names the cause
            self.error = self.error or err
        finally:
            c.grads = []
            _clear_derived(c)


def _nonzero_rows(grad: torch.Tensor, outside: torch.Tensor) -> bool:
    """Whether ``grad`` is non-zero in a row of an example marked ``outside`` (``(B * k, ...)`` rows that flatten
    the batch example-major: ``k`` rows an example)."""
    if grad.shape[0] != outside.shape[0]:
        outside = outside.repeat_interleave(grad.shape[0] // outside.shape[0])
    return bool(grad[outside].ne(0).any())


def _rows_ok(call: Call, t: torch.Tensor, b: int) -> bool:
    """Whether ``t`` (a call's first output or its gradient) has the call's examples as rows: ``b`` of them, or
    ``b * k`` rows that flatten the batch example-major (OPT's ``(B * T, d)``) for a handler that reads them so
    (the row check verifies the order on the first step of the layout)."""
    if t.dim() == 0 or t.shape[0] == 0:
        return False
    if t.shape[0] == b:
        return True
    unit = call.cache.get("unit")
    return (t.shape[0] % b == 0 and unit is not None and unit.handler.flattened_rows(call.module))


def _secret_halves(b: int) -> torch.Tensor:
    """A random split of ``b >= 2`` rows into two non-empty parts (a boolean mask), from ``os.urandom``."""
    g = torch.Generator().manual_seed(secret_seed())
    while True:
        rows = torch.rand(b, generator=g) < 0.5
        if 0 < int(rows.sum()) < b:
            return rows


def _compare_attribution(sums: _HandlerSums, b: int) -> None:
    """Each handler's sum of per-example gradients from a check pass's output gradients against autograd's gradient
    of the same weighted sum, per (call, parameter) the pass reached (``sums.compared``: the distances and norms)."""
    kept = sums.compared
    if not kept:
        return
    # a layer whose every per-example gradient is rounding noise (a bias before a normalization) is compared
    # with the model's largest gradient per example, not with its own
    floor = max(norm for *_, norm in kept) / b
    # the precision the backward ran in: any half-precision output or autocast in the forward rounds the
    # gradients of every layer below it
    half = (torch.float16, torch.bfloat16)
    dtypes = {o.dtype for c, *_ in kept for o in c.outputs if o.is_floating_point()}
    dtypes |= {c.aliases[local].dtype for c, local, *_ in kept}
    low = any(d in half for d in dtypes) or any(c.cache.get("autocast") for c, *_ in kept)
    tol = 5e-2 if low else (1e-6 if dtypes == {torch.float64} else 1e-4)
    for c, _, err, norm in kept:
        if not err <= tol * max(norm, floor):
            unit = c.cache["unit"]
            raise IncompleteGradientError(
                f"the rows of {unit.path or type(c.module).__name__}'s input and output are not its examples: the "
                f"per-example gradients read from them do not add up to the gradient of a weighted sum of the "
                f"losses (relative error {err / max(norm, floor, 1e-300):.3g}). The module is called on "
                f"something other than the batch (a loop over examples inside the forward, a slice, permuted or "
                f"gathered rows), or its output mixes examples afterwards. Run it on the whole batch, one row per "
                f"example.")


# what a call's cache holds beyond the recording itself: derived from its output gradients by the handlers
_RECORDED = ("versions", "nodes", "unit", "probed", "autocast", "root", "share", "shared_inputs")


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


def _release(call: Call) -> None:
    """Drop what a consumed call holds: its recorded inputs, output gradients and derived values; its outputs become
    stand-ins of one element broadcast to their shapes (the finished step still reads their shapes, dtypes and
    devices, never their values)."""
    call.grads = []
    call.args, call.kwargs = (), {}
    call.outputs = [o.detach().new_zeros(()).expand(o.shape) for o in call.outputs]
    call.cache.clear()


def _clear_derived(call: Call) -> None:
    for key in [k for k in call.cache if k not in _RECORDED]:
        del call.cache[key]


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


def _first_backward(capture: Capture, losses, outputs, model_params, retain_graph: bool = False) -> list:
    capture.active = False  # gradient checkpointing re-runs forwards inside this backward: record nothing
    before = [(p.grad, None if p.grad is None else p.grad._version) for p in model_params]
    # outputs that carry no gradient (a router's integer choices) get None
    wanted = [i for i, t in enumerate(outputs + model_params) if t.requires_grad]
    try:
        found = torch.autograd.grad(losses.sum(), [(outputs + model_params)[i] for i in wanted], allow_unused=True,
                                    materialize_grads=False, retain_graph=retain_graph)
        grads = [None] * (len(outputs) + len(model_params))
        for i, g in zip(wanted, found, strict=True):
            grads[i] = g
        touched = [_qualified(capture.plan.model, p) for p, (g, v) in zip(model_params, before, strict=True)
                   if p.grad is not g or (g is not None and g._version != v)]
        if touched:  # a backward inside our backward wrote .grad behind the per-example norms
            raise IncompleteGradientError(
                f"{touched[0]}.grad was written inside the private backward by a nested backward (reentrant "
                f"gradient checkpointing?), outside the per-example norms; use "
                f"non-reentrant checkpointing (torch.utils.checkpoint(..., use_reentrant=False); the default of "
                f"Hugging Face's activation_checkpointing_enable())")
        return grads
    except RuntimeError as err:
        if "Checkpointing is not compatible" in str(err):
            raise IncompleteGradientError(
                "reentrant gradient checkpointing runs its own backward and cannot give per-example gradients; "
                "use non-reentrant checkpointing (torch.utils.checkpoint(..., use_reentrant=False); the default of "
                "Hugging Face's activation_checkpointing_enable())") from err
        raise
    finally:
        capture.active = True


def _graph_nodes(losses: torch.Tensor, skip: set = frozenset()) -> list:
    """Every node of the autograd graph below ``losses`` (not below the nodes in ``skip``, by id), once each, in a
    deterministic depth-first order."""
    seen, stack, nodes = set(), [losses.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in skip:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return nodes


def _gathered_leaves(losses: torch.Tensor, calls: list[Call]) -> list[str]:
    """Parameters (other than the recorded calls' aliases) that ``losses`` depend on, from its autograd graph."""
    aliases = {id(a) for c in calls for a in c.aliases.values()}
    return [f"a gathered FSDP parameter of shape {tuple(var.shape)}" for node in _graph_nodes(losses)
            if isinstance(var := getattr(node, "variable", None), nn.Parameter) and id(var) not in aliases]


def _qualified(model: nn.Module, p: nn.Parameter) -> str:
    return next((n for n, q in model.named_parameters() if q is p), "<unnamed parameter>")


def _leak_message(names: list[str], plan: NormPlan) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"gradient reached {shown} outside every recorded module call, so its per-example contribution would "
            f"not be clipped; the step was not taken. Causes: the forward ran in eval mode or without the "
            f"private engine's hooks (call model.train()); the parameter is used by another module's forward "
            f"(e.g. F.linear(x, self.other.weight)) -- let that module's handler cover its submodules' parameters: "
            f"class Whole(dpsgd.layers.FunctionalHandler): recursive = True, then "
            f"dpsgd.layers.register_handler(TheModuleClass, Whole()) before make_private; or it became trainable "
            f"after make_private. {len(plan.units)} modules are hooked.")


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


NOISE_CHUNK = 1 << 22
"""Draws per refill of the noise buffer (16 MB in float32): the step never holds a parameter-sized noise tensor
(an embedding of 32000 x 2048 would need 262 MB), and a chunk is large enough that the draws run at full speed."""


def noisy_gradients(sums: list[torch.Tensor], noise_std: float | list[float], expected_batch_size: float,
                    noise_generator: torch.Generator | Callable[[torch.device], torch.Generator] | None,
                    params: list | None = None,
                    noise: StepNoise | None = None, in_place: bool = False) -> list[torch.Tensor]:
    """``(sum + noise_std * xi) / expected_batch_size`` per tensor, in the sums' (wide) dtype, with ``xi`` unit
    draws of ``noise`` (:mod:`dpsgd.noise`; Gaussian by default: ``N(0, noise_std^2 I)``).  ``noise_std`` may
    be a list, one per tensor (hybrid clipping's per-group noise).  ``noise_generator`` is one generator (the
    noise is drawn on its device and moved), a function from a device to the generator that draws there (each
    tensor's noise is drawn on its own device), or ``None`` (torch's default generator of each tensor's device).

    With ``params``, the noise of each is drawn at the parameter's full shape and restricted to this rank's
    shard (:func:`dpsgd.distributed.local_part`; the sums are then the shards' sums).  With ``in_place`` the
    sums themselves are overwritten (no second parameter-sized buffer: the step's peak memory holds the sums and
    a buffer of at most :data:`NOISE_CHUNK` draws, refilled for each chunk of each tensor; a sharded
    parameter's noise is drawn whole, then restricted).  A tensor of at most :data:`NOISE_CHUNK` elements gets
    the draws of ``torch.randn`` from the same generator state."""
    out = []
    noise = GaussianNoise() if noise is None else noise
    stds = noise_std if isinstance(noise_std, list) else [noise_std] * len(sums)
    scratch: dict = {}   # one buffer per device and dtype, reused for every chunk of every tensor
    for i, g in enumerate(sums):
        std = stds[i]
        if not in_place:
            g = g.clone()
        if std > 0:
            p = params[i] if params is not None else None
            gen = noise_generator(g.device) if callable(noise_generator) else noise_generator
            device = gen.device if gen is not None else g.device
            sharded = p is not None and is_sharded(p)   # drawn at the full shape, then this rank's part taken
            whole = sharded or not g.is_contiguous()
            shape = p.shape if sharded else g.shape
            n = math.prod(shape)
            key = (torch.device(device), g.dtype)
            if key not in scratch or scratch[key].numel() < (n if whole else min(n, NOISE_CHUNK)):
                scratch[key] = torch.empty(n if whole else min(n, NOISE_CHUNK), device=device, dtype=g.dtype)
            if whole:
                xi = noise.sample_into(scratch[key][:n].view(shape), gen)
                xi = local_part(p, xi) if sharded else xi
                g.add_(xi.to(g.device), alpha=std)
                del xi
            else:
                flat = g.view(-1)
                for start in range(0, n, NOISE_CHUNK):
                    xi = noise.sample_into(scratch[key][:min(NOISE_CHUNK, n - start)], gen)
                    flat[start:start + xi.numel()].add_(xi.to(g.device), alpha=std)
                    del xi
        out.append(g.div_(expected_batch_size))
    del scratch
    if not all_finite(*out):
        raise FloatingPointError("the noisy gradient is not finite; the step was not taken")
    return out


@dataclass(frozen=True)
class StepResult:
    """What one :func:`private_step` did.

    Attributes
    ----------
    batch_size : int
        Examples in the batch (Poisson: random).
    clipped_fraction : float
        Share of examples whose weight ``min(1, C / sqrt(n_i))`` was below 1.
    mean_loss : float
        Mean per-example loss before the step.
    """

    batch_size: int
    clipped_fraction: float
    mean_loss: float


def check_positive(value: object, name: str, allow_zero: bool = False) -> float:
    """``float(value)``, or ``ValueError`` naming ``name`` unless finite and positive (or zero if allowed)."""
    v = float(value)
    if not (math.isfinite(v) and (v >= 0 if allow_zero else v > 0)):
        raise ValueError(f"{name} must be {'non-negative (>= 0)' if allow_zero else 'positive (> 0)'}, got {value!r}")
    return v


def private_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[[nn.Module], torch.Tensor], *,
                 max_grad_norm: float, noise_multiplier: float, expected_batch_size: float,
                 estimator: str = "hutch", k: int = 32, generator: torch.Generator | None = None,
                 noise_generator: torch.Generator | None = None, clipping_pass: str = "bookkeeping") -> StepResult:
    r"""One DP-SGD-RC step: estimate norms, clip (book-keeping), add noise, let ``optimizer`` step.

    .. math::

        \tilde g = \frac{1}{\bar B}\Big(\sum_i \min\big(1, C/\sqrt{\hat n_i}\big)\nabla L_i
        + \sigma C\, \xi\Big), \qquad \xi \sim \mathcal N(0, I),

    with ``B-bar`` the expected batch size (Poisson sampling normalizes by it, not by the realized size).
    An empty batch (``loss_fn`` returns no losses) still adds the noise and steps.  Atomic: on a
    non-finite loss, norm or gradient, or a gradient that was not counted, it raises with parameters,
    ``.grad`` and the optimizer state unchanged.

    Parameters
    ----------
    model, optimizer
        The model (in training mode) and any ``torch.optim`` optimizer over its parameters.
    loss_fn : callable
        ``loss_fn(model) -> (B,)`` per-example losses of this step's batch.
    max_grad_norm : float
        Clipping threshold ``C > 0``.
    noise_multiplier : float
        ``sigma >= 0``.
    expected_batch_size : float
        ``q N > 0``.
    estimator, k, generator
        As in :func:`per_sample_sq_norms`.
    noise_generator : torch.Generator, optional
        Source of the Gaussian noise.
    clipping_pass : {"bookkeeping", "two-pass"}
        Clipped sums from the recorded activations and output gradients (one backward, default) or by a
        second backward (see :func:`clipped_backward`); the same update to rounding.

    Returns
    -------
    StepResult

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from dpsgd.engine import private_step
    >>> model = nn.Linear(3, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
    >>> r = private_step(model, opt, lambda m: ((m(x) - y) ** 2).sum(1), max_grad_norm=1.0,
    ...                  noise_multiplier=1.0, expected_batch_size=8, estimator="exact")
    >>> r.batch_size
    8
    """
    c = check_positive(max_grad_norm, "max_grad_norm")
    sigma = check_positive(noise_multiplier, "noise_multiplier", allow_zero=True)
    b_bar = check_positive(expected_batch_size, "expected_batch_size")
    check_estimator(estimator, k)
    check_clipping_pass(clipping_pass)
    plan = NormPlan.build(model, estimator, k)
    capture = Capture(plan)
    try:
        losses = loss_fn(model)
        result = clipped_backward(capture, losses, c, k, generator, clipping_pass=clipping_pass)
    finally:
        capture.remove()
    sums = [result.sums[id(p)] if id(p) in result.sums else
            torch.zeros(p.shape, device=p.device, dtype=torch.promote_types(p.dtype, torch.float32))
            for p in plan.params]
    new = noisy_gradients(sums, sigma * c, b_bar, noise_generator)
    for p, g in zip(plan.params, new, strict=True):
        p.grad = g.to(p.dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    n = losses.shape[0]
    return StepResult(n, float((result.weights < 1).double().mean()) if n else 0.0,
                      float(losses.detach().mean()) if n else float("nan"))

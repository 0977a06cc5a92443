r"""The norm plan: per model, which modules are hooked, each one's handler, and which norm each trainable
parameter gets (estimated with Hutchinson/Hutch++, or exact), with its chi-square terms.

:class:`NormPlan` is the one place this is decided; the step (:mod:`dpsgd.clipping`), the accountant's envelope
(:meth:`NormPlan.envelope`) and the validator read it.  Under ``estimator="auto"`` the choice per parameter is
:func:`worth_estimating`'s cost rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from torch import nn

from dpmath import Envelope, estimator_envelope

from .distributed import check_sharding
from .estimators import ESTIMATORS, check_k
from .handler import Handler, is_parameter_container, matrix_view, module_type
from .layers import ROOT_PARAMETERS, handler_for
from .materialized import FunctionalHandler
from .validator import ModuleValidator, UnsupportedModuleError, uncompiled

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
    >>> from dpsgd.plan import worth_estimating
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
    >>> from dpsgd.plan import NormPlan
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

r"""``PrivacyEngine.make_private``: the Opacus-style entry point of DP-SGD-RC.

An Opacus user with ghost clipping writes::

    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, criterion=nn.CrossEntropyLoss(),
        max_grad_norm=1.0, target_epsilon=8.0, target_delta=1e-5, epochs=3, estimator="hutch", projection_dim=32)
    for x, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)   # a DPLoss: per-example losses, reduced only for display
        loss.backward()                 # one backward: per-example norms, clip weights, clipped sums
        optimizer.step()                # noise sigma C, / expected batch size, the wrapped optimizer's step
    engine.get_epsilon(1e-5)

``model`` is the user's own module, with hooks (no wrapper: ``generate``, ``isinstance``, ``state_dict``
keys are unchanged; recording is off in ``eval()`` and under ``no_grad``).  The optimizer is a
:class:`DPOptimizer`, a ``torch.optim.Optimizer`` (schedulers, ``zero_grad``, ``state_dict`` work).

Soundness checks, each a clear error rather than a silent under-count:

* every trainable parameter's gradient must come from a recorded module call
  (:class:`~dpsgd.isolation.IncompleteGradientError` otherwise, naming the parameter);
* several forwards before one backward, tied parameters and modules called twice are counted as the norm
  of the summed per-example gradient;
* several backwards before one step accumulate (gradient accumulation); the step refuses if more
  per-example losses were backpropagated than examples were drawn from the private loader since the last
  step (a second backward of the same batch would let an example contribute twice);
* the clipped sums are held by the engine until ``step()`` (``p.grad`` stays ``None``: the sum before noise
  is not private); a ``.grad`` written by anything else (a plain ``backward()``) makes ``step()`` refuse;
* modules that mix examples are refused by :class:`~dpsgd.validator.ModuleValidator`.

The accountant (:class:`dpmath.PLDAccountant`) sees one mechanism per step: ``SubsampledGaussian(sigma,
q)`` for ``exact``/``ghost``, ``RandomizedClipGaussian(sigma, q, envelope)`` for ``hutch``/``hutchpp``.
The envelope (:meth:`dpsgd.plan.NormPlan.envelope`) has dimension ``D``, the norm plan's chi-square
terms summed over every parameter (:meth:`dpsgd.plan.NormPlan.envelope_dimension`; ``python -m dpsgd plan``
prints it).  Exactly-computed parts are point masses in that
mixture, the ``d -> inf`` limit of the family, so with ``hutch`` they switch the envelope to that limit,
``max(F_{chi2(k)/k}, 1{x >= 1})`` (the :class:`~dpmath.HutchPPEnvelope` form).  Every step is recorded in
the ledger *after* the optimizer's step succeeded.

Under ``torch.distributed`` (initialized before ``make_private``) each rank passes a loader over its own
shard; per-example norms and clipping stay local, the clipped sums are all-reduced, and the same noise
(one generator seeded identically on all ranks) is added once, so every rank takes the same step and the
noise has standard deviation ``sigma C`` in total.  Wrap nothing in ``DistributedDataParallel``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import json
import logging
import math
import os
import time
import warnings
import weakref
import zlib

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpmath import (
    Envelope,
    EpsilonSchedule,
    GridTooLargeError,
    HutchEnvelope,
    HutchPPEnvelope,
    PLDAccountant,
    RDPAccountant,
)

from .accounting import Combination, RunAccounting, auto_estimator, check_combination, read_record
from .capture import DEFAULT_CHECK_RATE, Capture
from .clipping import check_clipping_pass, clipped_backward
from .data import DPDataLoader, loader_size, private_data_loader
from .distributed import (
    all_sum,
    any_rank,
    as_grad,
    broadcast_int,
    check_same_on_ranks,
    is_sharded,
    rank_world,
    reduce_sums,
)
from .isolation import ExampleMixingError, ExampleTracker, StateChangedError, check_backward_functions
from .noise import GaussianNoise, StepNoise, as_noise, noisy_gradients
from .plan import NormPlan, check_estimator
from .samplers import BatchSampling, BoundSampling, Poisson, as_batch_sampling, filled_loader
from .sampling import HybridClipping, PoissonSampling, TwiceSampling
from .users import UserLevel, UserRows, user_data_loader, user_level
from .validator import check_positive, uncompiled

__all__ = ["PrivacyEngine", "DPOptimizer", "DPLoss", "DPCriterion", "UnaccountedSamplingError"]


logger = logging.getLogger("dpsgd")

# the engine whose hooks each model carries (one at a time)
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class UnaccountedSamplingError(ValueError):
    """An epsilon asked of a run whose sampling no accountant here covers: ``poisson_sampling=False``.

    Fixed-size shuffled batches (each example in exactly one batch per epoch) are not Poisson sampling, and the
    privacy amplification of shuffling needs a different analysis, which this library does not implement; an
    epsilon charged as Poisson sampling would not be a proven bound.  Raised by
    :meth:`PrivacyEngine.get_epsilon` and :meth:`PrivacyEngine.accountant` of such a run, and by
    ``make_private`` for ``poisson_sampling=False`` with ``target_epsilon`` (the calibration would be for
    another mechanism).  The run itself trains.
    """


# what every refusal of an epsilon for shuffled batches says
_SHUFFLED = ("poisson_sampling=False draws fixed-size shuffled batches, and no accountant here covers them: the "
             "accountants charge Poisson sampling, and the epsilon of shuffling needs a different analysis, so a "
             "Poisson epsilon would not be a proven bound for this run")


def _per_token_experts(module: nn.Module) -> None:
    """Hugging Face mixture-of-experts models run their experts per token (``batched_mm``): the grouped and
    eager implementations sort or count the tokens of the whole batch by expert, which the isolation tracker
    (rightly) cannot tell from mixing.  The same function per token, so the same training."""
    for m in module.modules():
        config = getattr(m, "config", None)
        current = getattr(config, "_experts_implementation", None)
        if hasattr(m, "set_experts_implementation") and current not in (None, "batched_mm"):
            m.set_experts_implementation("batched_mm")
            logger.info("mixture of experts: experts_implementation %r -> 'batched_mm' (per token, so each "
                        "example's loss is computed from its own tokens alone)", current)


class DPLoss:
    r"""Per-example losses of one batch; ``backward()`` is the private backward.

    It behaves like the scalar loss for logging (``item()``, ``float()``, ``detach()``, ``mean()``,
    f-strings: the mean of the per-example losses).  Arithmetic on it is refused: scaling a loss before
    clipping does not scale the clipped gradient (each example is clipped to ``max_grad_norm`` and the sum
    is divided by the expected batch size at ``step()``), so ``loss / accumulation_steps`` would silently do
    nothing useful.  Combine per-example terms *before* making the loss private
    (:meth:`PrivacyEngine.private_loss`).

    Attributes
    ----------
    losses : torch.Tensor
        ``(B,)`` per-example losses, with their graph.
    """

    def __init__(self, losses: torch.Tensor, engine: PrivacyEngine) -> None:
        self.losses = losses
        self._engine = engine
        self._done = False

    def backward(self, gradient: object = None, retain_graph: bool | None = None, create_graph: bool = False,
                 inputs: object = None) -> None:
        """Per-example norms, clip weights and clipped sums (held until ``step()``), in one backward.

        Each private loss is backpropagated once: the backward consumes the module calls its forward
        recorded.  ``torch.Tensor.backward``'s arguments are accepted only at their defaults (a weighted or
        partial backward would not be the clipped per-example sum), and each refusal says so.
        """
        if gradient is not None or retain_graph or create_graph or inputs is not None:
            raise TypeError("DPLoss.backward() takes no gradient, retain_graph, create_graph or inputs: the private "
                            "backward clips each example's whole gradient once and consumes the recorded forward. "
                            "Combine per-example terms into one loss per example first (PrivacyEngine."
                            "private_loss), then call backward() once.")
        if self._done:
            raise RuntimeError("this private loss was already backpropagated: each example contributes one clipped "
                               "gradient per step, and the recorded forward was consumed. Run a new forward for "
                               "a new backward.")
        self._engine._backward(self.losses)
        self._done = True

    def detach(self) -> torch.Tensor:
        """The mean per-example loss as a detached 0-d tensor (NaN for an empty batch)."""
        tracker = self._engine._tracker
        with tracker.suspended() if tracker is not None else contextlib.nullcontext():
            d = self.losses.detach()
            return d.mean() if d.numel() else torch.tensor(float("nan"))

    def item(self) -> float:
        """Mean per-example loss (for logging)."""
        return float(self.detach())

    def mean(self) -> DPLoss:
        """Itself: it already stands for the mean (so ``criterion(out, y).mean().backward()`` works)."""
        return self

    def sum(self) -> DPLoss:
        """Itself: the private backward sums the clipped per-example gradients whatever the reduction."""
        return self

    @property
    def shape(self) -> torch.Size:
        return torch.Size([])

    def __float__(self) -> float:
        return self.item()

    def __format__(self, spec: str) -> str:
        return format(self.item(), spec)

    def __repr__(self) -> str:
        return f"DPLoss({self.item():.6g}, batch_size={self.losses.shape[0]})"

    def _refuse(self, *_args):
        raise TypeError("arithmetic on a private loss is refused: each example's gradient is clipped to "
                        "max_grad_norm and the clipped sum is divided by the expected batch size at step(), so "
                        "scaling the loss (e.g. / gradient_accumulation_steps) would not scale the update. Combine "
                        "per-example terms first and pass them to PrivacyEngine.private_loss(losses).")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __neg__ = _refuse
    __pow__ = __iadd__ = __imul__ = __itruediv__ = _refuse


class DPCriterion:
    r"""Wraps a loss module, or a loss function that takes ``reduction=`` (``F.cross_entropy``, ``F.nll_loss``,
    ``F.mse_loss``, a ``functools.partial`` of one): ``criterion(output, target)`` returns a :class:`DPLoss` of
    per-example losses.  A function is called with ``reduction="none"``; its own default ``reduction`` and
    ``ignore_index`` (read from its signature) play the part of a module's attributes.

    ``output`` may be a tensor, a Hugging Face output object (its ``logits`` are used) or a tuple (its first
    element).  Token-level targets are accepted in either layout, ``(B, T, V)`` logits with ``(B, T)``
    targets (the Hugging Face layout) or ``(B, V, T)``.  Each example's loss is the **mean over its
    non-ignored elements** (``ignore_index``, e.g. padding and ``-100``) when the criterion's reduction is
    ``"mean"``, and their sum for ``"sum"``; an example whose targets are all ignored has loss 0.  Causal
    language models: shift yourself, ``criterion(out.logits[:, :-1], input_ids[:, 1:])``.
    """

    def __init__(self, criterion: nn.Module, engine: PrivacyEngine) -> None:
        if not callable(criterion):
            raise ValueError(f"criterion must be a loss module, got {type(criterion).__name__}")
        self._criterion = criterion
        self._engine = engine
        # a loss function: its signature's defaults stand for a module's attributes
        self._defaults = None if isinstance(criterion, nn.Module) else _loss_defaults(criterion)
        self.reduction = getattr(criterion, "reduction", "mean") if self._defaults is None \
            else self._defaults["reduction"]
        if self.reduction not in ("mean", "sum"):
            raise ValueError(f"criterion.reduction must be 'mean' or 'sum', got {self.reduction!r}")

    def _elementwise(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The criterion's unreduced losses (a module's ``reduction`` set to ``"none"`` for the call)."""
        if self._defaults is not None:
            return self._criterion(logits, target, reduction="none")
        old = self._criterion.reduction
        self._criterion.reduction = "none"
        try:
            return self._criterion(logits, target)
        finally:
            self._criterion.reduction = old

    def __call__(self, output: object, target: torch.Tensor) -> DPLoss:
        logits = _logits(output)
        ignore = getattr(self._criterion, "ignore_index", None) if self._defaults is None \
            else self._defaults["ignore_index"]
        if not isinstance(target, torch.Tensor):
            raise ValueError(f"target must be a tensor, got {type(target).__name__}")
        if logits.dim() == 0 or target.dim() == 0 or logits.shape[0] != target.shape[0]:
            raise ValueError(f"output and target must start with the same batch dimension, got shapes "
                             f"{tuple(logits.shape)} and {tuple(target.shape)}")
        class_last = (ignore is not None and logits.dim() >= 3 and not target.is_floating_point()
                      and tuple(target.shape) == tuple(logits.shape[:-1]))
        if class_last and tuple(target.shape) == (logits.shape[0], *logits.shape[2:]):
            raise ValueError(f"logits of shape {tuple(logits.shape)} with targets {tuple(target.shape)} fit both "
                             f"(B, T, classes) and (B, classes, T): the classes are ambiguous. Make the per-example "
                             f"losses yourself and pass them to PrivacyEngine.private_loss(losses)")
        if class_last:
            per = self._elementwise(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)).reshape(target.shape)
        else:
            per = self._elementwise(logits, target)
        b = logits.shape[0]
        per = per.reshape(b, -1)
        if ignore is not None and not target.is_floating_point() and target.reshape(b, -1).shape == per.shape:
            keep = (target.reshape(b, -1) != ignore).to(per.dtype)
            total = (per * keep).sum(1)
            losses = total / keep.sum(1).clamp_min(1) if self.reduction == "mean" else total
        else:
            losses = per.mean(1) if self.reduction == "mean" else per.sum(1)
        return DPLoss(losses, self._engine)


def _loss_defaults(criterion) -> dict:
    """``{"reduction": ..., "ignore_index": ...}`` of a loss function, from its signature (``"mean"`` and ``None``
    where it gives no default, or has no ``ignore_index``); ``TypeError`` unless it takes ``reduction`` by name."""
    try:
        params = inspect.signature(criterion).parameters
    except (TypeError, ValueError):
        params = {}
    named = {n: p.default for n, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    if "reduction" not in named:
        raise TypeError(f"criterion {getattr(criterion, '__name__', type(criterion).__name__)} is a function "
                        f"without a reduction keyword, so its per-example losses cannot be asked for: pass a loss "
                        f"module (nn.CrossEntropyLoss()) or a torch.nn.functional loss (F.cross_entropy, which is "
                        f"called with reduction='none'); or make the per-example losses yourself and backpropagate "
                        f"engine.private_loss(losses)")
    empty = inspect.Parameter.empty
    return {"reduction": "mean" if named["reduction"] is empty else named["reduction"],
            "ignore_index": None if named.get("ignore_index", empty) is empty else named["ignore_index"]}


def _logits(output: object) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ValueError(f"output must be a tensor, an object with .logits or a tuple of tensors, got "
                     f"{type(output).__name__}")


class DPOptimizer(torch.optim.Optimizer):
    r"""A ``torch.optim.Optimizer`` around the user's: ``step()`` adds noise to the clipped sum, normalizes by
    the expected batch size, steps, and records the step in the ledger.

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's, so learning-rate schedulers,
    ``state_dict`` and ``add_param_group`` work on it.  Between ``backward()`` and ``step()`` the clipped
    sums are held by the engine and ``p.grad`` stays ``None``: the sum before noise is not private, so it is
    not exposed for logging, and ``clip_grad_norm_`` has nothing to act on (every example is already clipped
    to ``max_grad_norm``).  ``step()`` refuses if a ``.grad`` was written by anything else.  Under
    :class:`~dpsgd.data.BatchMemoryManager`, ``step()`` after a micro-batch that does not end its logical
    batch only accumulates (``zero_grad()`` then keeps the accumulated sums, as in Opacus).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, engine: PrivacyEngine) -> None:
        # no Optimizer.__init__: the wrapped optimizer owns the parameter groups and the state
        self.original_optimizer = optimizer
        self._engine = engine
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        self._sealed = True   # from here on a public attribute it does not have is refused (__setattr__)

    def __setattr__(self, name: str, value) -> None:
        # an Opacus optimizer's setting (loss_reduction, secure_mode, ...) would be accepted and do nothing here;
        # torch's and schedulers' own attributes (step, _opt_called, ...) pass
        if self.__dict__.get("_sealed") and not name.startswith("_") and name not in self.__dict__ \
                and not hasattr(type(self), name):
            raise AttributeError(f"DPOptimizer has no setting {name!r}, so setting it would change nothing. Its "
                                 f"settings are the engine's (noise_multiplier, max_grad_norm, expected_batch_size: "
                                 f"fixed by make_private; check_every_step and check_rate on the PrivacyEngine) and "
                                 f"the wrapped optimizer's param_groups (lr, weight_decay, ...)")
        super().__setattr__(name, value)

    @property
    def param_groups(self) -> list[dict]:
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.original_optimizer.param_groups = groups

    @property
    def state(self):
        return self.original_optimizer.state

    @state.setter
    def state(self, state) -> None:
        self.original_optimizer.state = state

    @property
    def defaults(self) -> dict:
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict) -> None:
        self.original_optimizer.defaults = defaults

    # Opacus' DPOptimizer carries these, and Opacus' noise schedulers set optimizer.noise_multiplier; here they
    # are the engine's settings, fixed by make_private, so a schedule is refused instead of silently ignored
    @property
    def noise_multiplier(self) -> float:
        """The engine's ``noise_multiplier`` (read-only: setting it raises ``AttributeError``)."""
        return self._engine.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self._engine.noise_multiplier = value

    @property
    def max_grad_norm(self) -> float:
        """The engine's ``max_grad_norm`` (read-only: setting it raises ``AttributeError``)."""
        return self._engine.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        self._engine.max_grad_norm = value

    @property
    def expected_batch_size(self) -> float:
        """The engine's ``expected_batch_size`` (read-only: setting it raises ``AttributeError``)."""
        return self._engine.expected_batch_size

    @expected_batch_size.setter
    def expected_batch_size(self, value: float) -> None:
        self._engine.expected_batch_size = value

    def __repr__(self) -> str:
        return f"DPOptimizer({self.original_optimizer!r})"

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the wrapped optimizer; its trainable parameters must be ones the engine covers."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self._engine._check_covered(params, "add_param_group")
        self.original_optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` and the accumulated clipped sums (kept while a logical batch is being accumulated)."""
        self._engine._zero_grad()

    def step(self, closure=None):
        """The noisy step (or, inside a logical batch split by the memory manager, accumulation only)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine._step()
        return loss

    def state_dict(self) -> dict:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.original_optimizer.load_state_dict(state_dict)


def _refuse_hooked(module: nn.Module) -> None:
    """``RuntimeError`` if ``module`` carries the live hooks of another engine: two engines would record its calls
    twice."""
    holder = _ENGINES.get(module)
    if holder is not None and holder() is not None and holder()._capture is not None \
            and holder()._capture._handles:
        raise RuntimeError("this model already carries the hooks of another PrivacyEngine (a re-run notebook "
                           "cell?); two engines would record its calls twice. Call old_engine.detach() first, "
                           "or build the model again")


def _envelope_covers(charged: Envelope | None, planned: Envelope | None) -> bool:
    """Whether the envelope ``charged`` (the accountant's) bounds every estimate that ``planned`` (a new plan's)
    bounds: ``F_planned(x) <= F_charged(x)`` for every ``x``.  True when they are equal; for Hutchinson envelopes
    of the same ``k`` when the new dimension is at most the charged one (the supremum over a smaller simplex, which
    embeds in the larger one); and for the Hutch++ form ``max(F_{chi2(k)/k}, 1{x >= 1})`` (``d > k``) over any
    Hutchinson or Hutch++ envelope of the same ``k`` and over exact norms (``None``, a point mass at 1): below 1
    each of those is at most the vertex ``F_{chi2(k)/k}``, and the form is 1 from 1 on.  Exact norms
    (``charged`` ``None``) bound exact norms only."""
    if planned == charged:
        return True
    if isinstance(charged, HutchPPEnvelope) and charged.dim > charged.projection_dim:
        return planned is None or (isinstance(planned, (HutchEnvelope, HutchPPEnvelope))
                                   and planned.projection_dim == charged.projection_dim)
    return (type(charged) is HutchEnvelope and type(planned) is HutchEnvelope
            and planned.projection_dim == charged.projection_dim and planned.family == charged.family
            and planned.dim <= charged.dim)


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _planned_steps(epochs: float | None, steps: int | None, batches: int) -> int:
    """The steps a target epsilon is calibrated for: ``steps``, or ``ceil(epochs x batches)`` (``ValueError``
    unless positive)."""
    if steps is None:
        return math.ceil(check_positive(epochs, "epochs") * batches)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    return steps


class _DeviceGenerators:
    """One torch generator per device, all seeded alike and made on first use: each draw happens on the device of
    the tensors it is for (a CUDA device without an index is the current one, so one device has one stream)."""

    def __init__(self, seed: int | None = None):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, device: torch.device | str) -> torch.Generator:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def reseed(self, seed: int) -> None:
        """Seed every generator made so far, and those made from now on, with ``seed`` (in place: whoever holds
        one of them draws from the new seed)."""
        self.seed = seed
        for g in self._generators.values():
            g.manual_seed(seed)


def _entropy_seed() -> int:
    """A seed of 63 bits from ``os.urandom`` (the OS's CSPRNG); non-negative, so that :func:`broadcast_int`'s
    int64 carries it."""
    return int.from_bytes(os.urandom(8), "little") >> 1


# what a state_dict of an earlier version held besides the ledger: the generators' states, which predicted the
# batches, projections, masks and noise of the steps after the checkpoint
_GENERATOR_STATE_KEYS = ("sampling_rng", "projection_rngs", "mask_rngs", "noise_rngs", "noise_rng")


class PrivacyEngine:
    r"""Makes a model, optimizer, loss and data loader private with DP-SGD-RC, and keeps the privacy ledger.

    Parameters
    ----------
    secure_mode : bool
        Refuse ``make_private(seed=...)``: every generator (the batches, the Hutchinson projections, twice
        sampling's masks, the noise) is then seeded from ``os.urandom``, each with a seed of its own.  Without a
        seed the default does the same; secure mode guarantees it (a seed left in a configuration is an error,
        not a silently reproducible run).  The generators are torch's (Mersenne Twister on the CPU, Philox on
        CUDA devices), seeded with 63 bits from the OS's CSPRNG: not cryptographic generators, but no state of
        theirs is ever exported (:meth:`state_dict` holds none) and a resumed run reseeds them all from
        ``os.urandom`` (docs/trainer.md, "Sampling, checkpoints, devices").
    ledger_path : str or os.PathLike, optional
        An append-only file with one line per noisy step, flushed to disk before ``step()`` returns.  A
        crash loses no spent privacy: a new engine on the same file counts the steps already recorded
        there (more than a checkpoint may hold) and refuses a file written with other settings.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from dpsgd import PrivacyEngine
    >>> data = TensorDataset(torch.randn(200, 4), torch.randint(0, 2, (200,)))
    >>> model = nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> engine = PrivacyEngine()
    >>> model, opt, crit, loader = engine.make_private(module=model, optimizer=opt,
    ...     data_loader=DataLoader(data, batch_size=20), criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0,
    ...     noise_multiplier=1.0, estimator="hutch", projection_dim=32)
    >>> for x, y in loader:
    ...     opt.zero_grad()
    ...     crit(model(x), y).backward()
    ...     opt.step()
    >>> engine.steps, round(engine.get_epsilon(1e-5), 2) > 0
    (10, True)
    """

    def __init__(self, secure_mode: bool = False, ledger_path: str | os.PathLike | None = None) -> None:
        self.secure_mode = bool(secure_mode)
        self.ledger_path = ledger_path
        self._check_every_step = False
        self._check_rate = DEFAULT_CHECK_RATE
        self._track_examples = True
        self._used_ids: torch.Tensor | None = None   # examples whose losses this step backpropagated
        self._tracker: ExampleTracker | None = None
        self._steps = 0
        self._recorded = 0  # steps in the ledger file from earlier runs
        self._resumed = 0   # steps already counted by the checkpoint this run resumed from
        self._capture: Capture | None = None
        self._basis: torch.Tensor | None = None   # make_private's gradient_projection, orthonormalized
        self._noise_multiplier: float | None = None   # make_private's; read-only afterwards (see noise_multiplier)
        self._accounting: RunAccounting | None = None   # what the run is accounted as: make_private's, read-only
        self._ranks: list[int] = []   # coordinates per sampling group
        self._mask_rngs = _DeviceGenerators()   # twice sampling's masks; seeded by make_private
        self._epsilons: dict[tuple[int, int, float], float] = {}   # (steps, events charged, delta) -> epsilon
        self._schedule: EpsilonSchedule | None = None   # get_epsilon's steps and transforms, built once
        self.plan: NormPlan | None = None
        self.planned_steps: int | None = None   # the steps a target epsilon was calibrated for (None: not calibrated)
        self.privacy_unit = "example"   # make_private's; "user": dpsgd.users
        self.max_examples_per_user: int | None = None
        self._user_rows: UserRows | None = None   # which user each drawn row belongs to (privacy_unit="user")
        self._stream = None   # a non-Poisson scheme's sampler (an epoch sampler's position decides the epochs charged)
        # make_private's, fixed from then on (FIXED_SETTINGS); declared here, where every public attribute is
        self.estimator: str | None = None
        self.projection_dim: int | None = None
        self.max_grad_norm: float | None = None
        self.clipping_pass: str | None = None
        self.envelope = None
        #: with a target and Poisson batches: the noise multiplier exact norms would need for it (the estimate's price)
        self.exact_noise_multiplier: float | None = None
        self.sample_rate: float | None = None
        self.expected_batch_size: float | None = None
        self._trainable: list = []   # (parameter, requires_grad) as the plan was made: a change is re-planned
        self._follow_handle = None   # the model's hook that follows those changes
        self._reset_step_state()
        self._sealed = True   # from here on a public attribute the engine does not have is refused (__setattr__)

    def _reset_step_state(self) -> None:
        self._pending: int | None = None   # the logical batch handed out and not yet stepped
        self._sums: dict[int, torch.Tensor] = {}   # the clipped sums, held here: not private before noise
        self._backpropagated = 0   # per-example losses backpropagated since the last step
        self._drawn = 0            # examples drawn from the private loader since the last step
        self._discarded = False    # zero_grad() dropped a backward's sums since the last step
        self._skip_next = False    # the memory manager: this micro-batch does not end its logical batch
        self._last_skipped = False  # the last step() only accumulated: zero_grad() keeps the sums
        self.last_clipped_fraction = 0.0
        self._padding: torch.Tensor | None = None   # the drawn padded batch's filler rows, for its one backward
        self._consumed = False     # a private backward ran since the last step() or zero_grad()
        if self._user_rows is not None:
            self._user_rows.clear()

    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                     criterion: nn.Module | None = None, max_grad_norm: float, noise_multiplier: float | None = None,
                     target_epsilon: float | None = None, target_delta: float | None = None,
                     epochs: float | None = None, steps: int | None = None, estimator: str = "auto",
                     projection_dim: int = 32,
                     poisson_sampling: bool = True,
                     seed: int | None = None, clipping_pass: str = "bookkeeping",
                     gradient_projection: torch.Tensor | None = None, noise: StepNoise | str = "gaussian",
                     sampling: PoissonSampling | TwiceSampling | HybridClipping | None = None,
                     privacy_unit: str = "example", user_ids=None, max_examples_per_user: int | None = None,
                     batch_sampling: BatchSampling | str = "poisson",
                     ) -> tuple[nn.Module, DPOptimizer, DPCriterion, DPDataLoader]:
        r"""Make training private; give ``noise_multiplier`` or ``target_epsilon``, ``target_delta`` and one of
        ``epochs`` or ``steps``.

        Parameters
        ----------
        module, optimizer, data_loader
            Model, any torch optimizer over its trainable parameters, and a loader with a fixed
            ``batch_size`` (the expected batch size) over a sized dataset.
        criterion : torch.nn.Module or callable, optional
            A loss module with a ``reduction`` attribute (default ``nn.CrossEntropyLoss()``), or a loss function
            that takes ``reduction=`` (``F.cross_entropy``; called with ``reduction="none"``).
        max_grad_norm : float
            Clipping threshold ``C > 0``.
        noise_multiplier : float, optional
            ``sigma >= 0``; or calibrate it from the three targets.
        target_epsilon, target_delta, epochs, steps
            Calibrate ``sigma`` with the PLD accountant for this estimator so that after ``steps`` noisy steps
            (or ``ceil(epochs * len(data_loader))``, ``len`` counting the loader's Poisson batches, empty
            ones included) the upper bound on epsilon is at most ``target_epsilon``.  The engine then refuses a
            step beyond that count (:attr:`planned_steps`): the calibration holds for the steps that run, never
            fewer.  Without a target, ``steps`` is ignored.  The calibration (seconds to a minute) logs its
            start and its duration as INFO records of the ``"dpsgd"`` logger (:mod:`dpsgd.cli`).
        estimator : {"auto", "hutch", "hutchpp", "ghost", "exact"}
            How per-example norms are found.  ``"auto"`` (default) chooses per parameter: Hutchinson's estimate
            (``"hutch"``) only where the exact norm costs at least :data:`~dpsgd.plan.AUTO_COST_RATIO` times as
            much (:func:`~dpsgd.plan.worth_estimating`: wide weights, at ``k = 32`` from width 512 on), exact
            norms elsewhere, so the envelope's noise is paid only for layers where it saves time and memory; where
            the noise or sampling needs exact norms, all are exact.  ``"hutch"``/``"hutchpp"`` estimate every
            weight that has an estimate; ``"ghost"``/``"exact"`` estimate none (ghost clipping, or materialized
            per-example gradients).  ``make_private`` logs the plan's choice and, with a target, the noise
            multiplier with the estimate against the one exact norms would need (:attr:`exact_noise_multiplier`).
        projection_dim : int
            ``k``, the number of random projections per layer of ``"hutch"`` and ``"hutchpp"``.
        poisson_sampling : bool
            Poisson batches (default), the sampling every accountant here assumes.  ``False`` draws fixed-size
            shuffled batches (for benchmarks that need fixed shapes): the run trains, with a ``UserWarning``,
            but no accountant here covers shuffling, so :meth:`get_epsilon` and :meth:`accountant` raise
            :class:`UnaccountedSamplingError`, and so does ``make_private`` with ``target_epsilon``.
        seed : int, optional
            Reproducibility mode, for tests and benchmarks: the batches, projections, masks and noise are all
            derived from this seed (rank 0's under torch.distributed), and a ``UserWarning`` says so: **whoever
            holds the seed can recompute the noise and subtract it, so the run is not private against them.**
            ``None`` (default): every generator is seeded from ``os.urandom``.  Refused (``ValueError``) by a
            ``PrivacyEngine(secure_mode=True)``.  A resumed run (:meth:`load_state_dict`) reseeds every generator
            from ``os.urandom`` whatever the seed.
        clipping_pass : {"bookkeeping", "two-pass"}
            ``"bookkeeping"`` (default): one backward; each layer's clipped sum ``sum_i c_i g_i`` is formed
            from the activations and output gradients already recorded for the norms.  ``"two-pass"``: a
            second backward of ``sum_i c_i L_i`` (holds the autograd graph instead; float32/float64
            parameters only).  The same update to rounding; see :doc:`/trainer` for their cost.
        gradient_projection : torch.Tensor, optional
            A ``P x k`` basis (``P`` the number of trainable parameters, in the model's parameter order):
            each step's clipped sum is projected on its span before the isotropic noise is added (paper
            004's re-training in a top-``k`` subspace; :doc:`/spectrum`).  It is orthonormalized here, so
            the projection cannot lengthen a clipped contribution and the accounting is unchanged.  **It must
            not depend on the private data**: take it from public data, or from gradients this run already
            released (:class:`dpsgd.spectrum.GradientRecorder`; a post-processing).  Single process only.

        noise : StepNoise or {"gaussian", "laplace"}
            The step's noise (:mod:`dpsgd.noise`), which also decides its mechanism: :class:`~dpsgd.noise.
            GaussianNoise` (default), or :class:`~dpsgd.noise.LaplaceNoise` (``"laplace"``): LAP2 (paper 003),
            independent Laplace noise of scale ``b = noise_multiplier * C`` on each coordinate of the
            l2-clipped sum.  It is accounted as :class:`dpmath.SubsampledL2Laplace`, through its sound
            Gaussian domination (never the paper's Thm III.7 bound, which :doc:`/majorization` shows fails),
            and a target epsilon calibrates ``b / C = sqrt(pi / 2) sigma`` from the dominating Gaussian's
            ``sigma``.  Exact norms only (``estimator`` "ghost" or "exact"): no accountant here covers
            Laplace noise on a randomly scaled (estimated-norm) clipped gradient.
        sampling : PoissonSampling, TwiceSampling or HybridClipping, optional
            How a step samples (:mod:`dpsgd.sampling`); ``None`` is :class:`~dpsgd.sampling.PoissonSampling`
            (examples only, DP-SGD's).  :class:`~dpsgd.sampling.TwiceSampling` is twice sampling (paper 002,
            Alg. 2): inside each Poisson batch every coordinate of the clipped sum is formed from its own
            Poisson sub-sample of rate ``coordinate_rate``, with each example also clipped to l-infinity norm
            ``max_grad_coordinate``.
            The step divides by ``coordinate_rate`` times the expected batch size (an unbiased gradient).
            Accounted by :class:`dpmath.twice_sampling.TwiceSampledGaussian` (an RDP bound, so
            :meth:`accountant` is then an :class:`dpmath.RDPAccountant`).  It needs per-example gradients:
            exact norms (``estimator`` "ghost" or "exact"), Gaussian noise, the bookkeeping pass, no
            ``gradient_projection`` (a projection could break the l-infinity bound the accounting
            uses), one process.  :class:`~dpsgd.sampling.HybridClipping` (Thm 5.6) clips parameter groups to
            their own bounds with Thm 4.6's noise shape, accounted by
            :class:`dpmath.twice_sampling.HybridTwiceSampledGaussian`; ``max_grad_norm`` must then be its
            overall bound ``sqrt(sum_j c2_j^2)``.
        privacy_unit : {"example", "user"}
            Whose privacy epsilon is about.  ``"user"`` (:mod:`dpsgd.users`): users are Poisson-sampled at
            ``q_u = batch_size / U`` (``U`` distinct labels in ``user_ids``; **the loader's** ``batch_size`` **is
            then the expected number of users per batch**), a drawn user brings all its examples (or
            ``max_examples_per_user`` of them), the sum of a user's per-example gradients is clipped once to
            ``max_grad_norm``, and the accountant charges ``q_u``: :meth:`get_epsilon` is an epsilon per user.
            Each physical batch holds whole users and is backpropagated by one backward.  Not with twice
            sampling, hybrid clipping, ``poisson_sampling=False`` or torch.distributed.  ``exact`` / ``ghost``
            norms materialize each parameter's per-example gradients (``B x numel``, one parameter at a time).
        batch_sampling : BatchSampling or str
            How each step's examples are chosen, and so how they are accounted (:mod:`dpsgd.samplers`):
            ``"poisson"`` (default), :class:`~dpsgd.samplers.TruncatedPoisson` ``(max_batch_size)`` (at most that
            many a step, the overflow charged to delta), ``"fixed_size"`` (exactly ``batch_size``, epsilon for
            replacing one example), ``"balls_in_bins"`` (each example once per epoch: random allocation, amplified with
            exact norms, one Gaussian step per epoch with randomized clipping)
            or ``"shuffling"`` (a permutation per epoch, one Gaussian step per epoch at ``sigma / 2``, replacing
            one example).  Anything but Poisson: example-level, no twice sampling, Gaussian noise; a padded
            ``TruncatedPoisson`` in a single process; balls in bins and shuffling no ``ledger_path``.
        user_ids : sequence, 1-D tensor, 1-D numpy array or pandas Series, optional
            With ``privacy_unit="user"``: each example's user, one per example of the dataset, in its index order.
            Labels are integers (Python, numpy or 0-d tensor integers, equal values one user: ``3``,
            ``numpy.int64(3)`` and ``torch.tensor(3)`` are the same user, so ``list(author_tensor)`` works) or
            strings, not both; floating-point, boolean and other labels raise ``TypeError``.
        max_examples_per_user : int, optional
            With ``privacy_unit="user"``: a drawn user brings a uniformly random subset of at most this many of
            its examples (``None``: all of them); bounds a physical batch's rows per user.

        Returns
        -------
        tuple
            ``(module, optimizer, criterion, data_loader)``: the same module with hooks, a
            :class:`DPOptimizer`, a :class:`DPCriterion` and a :class:`~dpsgd.data.DPDataLoader`.

        Notes
        -----
        In order: the arguments are checked before anything is built; the norm plan must cover every parameter
        the optimizer steps; the generators are seeded from one seed shared by all ranks; the Poisson loader
        fixes the sampling rate; the noise is calibrated if a target is given; the settings are fixed (read-only
        from then on) and matched against the ledger file; only then are the model hooked and the optimizer and
        loss wrapped, so a refusal at any stage leaves the model untouched.
        """
        if self._capture is not None:
            raise RuntimeError("this PrivacyEngine already made a model private; use a new PrivacyEngine")
        if seed is not None and self.secure_mode:
            raise ValueError(f"seed={seed!r} with secure_mode=True is refused: a seed makes the batches, projections, "
                             f"masks and noise reproducible by whoever holds it, and secure mode draws every one of "
                             f"them from os.urandom. Leave seed=None, or use secure_mode=False for a reproducible run")
        noise, sampling, c, sigma = self._checked_arguments(
            optimizer, max_grad_norm, noise_multiplier, target_epsilon, target_delta, epochs, steps, estimator,
            projection_dim, clipping_pass, noise, sampling, poisson_sampling)
        users = user_level(privacy_unit, user_ids, max_examples_per_user)
        scheme = as_batch_sampling(batch_sampling)
        combination = Combination(estimator, noise, sampling, scheme, users=users is not None,
                                  poisson_sampling=poisson_sampling, clipping_pass=clipping_pass,
                                  projected=gradient_projection is not None, processes=rank_world()[1],
                                  ledger=self.ledger_path is not None)
        if estimator == "auto":   # an estimate no accountant covers here: exact norms throughout
            estimator = auto_estimator(combination)
            combination = dataclasses.replace(combination, estimator=estimator)
        check_combination(combination)
        compiled, module = module, uncompiled(module)   # a torch.compile wrapper: hooks on the model it runs
        _refuse_hooked(module)
        plan = self._cover(module, optimizer, estimator, projection_dim, sampling, c)
        rank, world = rank_world()
        basis = None if gradient_projection is None else self._projection_basis(gradient_projection, world)
        seeds = self._seed_generators(seed, rank, world)
        loader, bound = (self._user_loader(data_loader, users, world) if users is not None
                         else self._private_loader(data_loader, poisson_sampling, world) if type(scheme) is Poisson
                         else self._scheme_loader(data_loader, scheme, seeds))
        if world > 1 and any(is_sharded(p) for p in plan.params):
            # FSDP2: every rank runs every step's forward and backward, which gather the sharded parameters
            # together, so a part of fewer than two examples is completed by filler rows weighted 0
            loader = filled_loader(loader, data_loader.collate_fn)
        self.estimator, self.projection_dim, self.max_grad_norm = estimator, projection_dim, c
        self.clipping_pass = clipping_pass
        self.envelope = plan.envelope(projection_dim)
        accounting = RunAccounting(
            sampling=bound, noise=noise, clipping=sampling, max_grad_norm=c, envelope=self.envelope,
            ranks=tuple(self._ranks), accounted=poisson_sampling, users=users, estimator=estimator,
            projection_dim=projection_dim)
        planned = None
        if sigma is None:
            planned = _planned_steps(epochs, steps, len(loader))
            sigma = self._calibrate(accounting, target_epsilon, target_delta, planned)
            # the estimate's price: the noise exact norms would need for the same target, for Poisson batches (a
            # DP-SGD calibration, a fraction of the estimate's; an epoch sampler's exact PLDs would cost a minute)
            if self.envelope is None:
                self.exact_noise_multiplier = sigma
                price = f"noise_multiplier {sigma:.4g}"
            elif accounting.poisson_batches:
                self.exact_noise_multiplier = self._calibrate(accounting.exact(), target_epsilon, target_delta,
                                                              planned, quiet=True)
                price = (f"noise_multiplier {sigma:.4g} with the estimate against {self.exact_noise_multiplier:.4g} "
                         f"with exact norms (+{100 * (sigma / self.exact_noise_multiplier - 1):.1f} % noise)")
            else:
                price = f"noise_multiplier {sigma:.4g} with the estimate"
        else:
            price = f"noise_multiplier {sigma:.4g} (given)"
        logger.info("norm plan: %s; %s", plan.summary(), price)
        check_same_on_ranks(sigma, "noise_multiplier")
        self._fix_settings(accounting, sigma, planned, basis, seeds)
        self._read_ledger()
        optimizer, crit = self._attach(plan, module, optimizer, criterion)
        if not poisson_sampling:   # stacklevel 2: at the caller's line
            warnings.warn(f"{_SHUFFLED}. The model trains, but get_epsilon() and accountant() will raise "
                          f"UnaccountedSamplingError; for an epsilon, keep poisson_sampling=True (the default)",
                          UserWarning, stacklevel=2)
        if seed is not None:
            warnings.warn(f"make_private(seed={seed!r}) makes the run reproducible: its batches, projections, masks "
                          f"and noise are all derived from the seed, so the run offers no privacy against whoever "
                          f"holds the seed (its epsilon holds only for those who do not). Leave seed=None (the "
                          f"default) to seed them from os.urandom", UserWarning, stacklevel=2)
        return compiled, optimizer, crit, loader

    @staticmethod
    def _checked_arguments(optimizer: torch.optim.Optimizer, max_grad_norm: float, noise_multiplier: float | None,
                           target_epsilon: float | None, target_delta: float | None, epochs: float | None,
                           steps: int | None, estimator: str, k: int, clipping_pass: str, noise: StepNoise | str,
                           sampling: PoissonSampling | TwiceSampling | HybridClipping | None,
                           poisson_sampling: bool,
                           ) -> tuple[StepNoise, PoissonSampling | TwiceSampling | HybridClipping, float,
                                      float | None]:
        """``make_private``'s arguments checked one by one before anything is built (``ValueError`` naming the
        first one wrong): ``(noise, sampling, max_grad_norm, noise_multiplier)``, the noise and sampling as
        objects and the noise multiplier ``None`` when it is to be calibrated from the targets.  Their
        combinations are :data:`dpsgd.accounting.REFUSED`'s."""
        check_estimator(estimator, k)
        check_clipping_pass(clipping_pass)
        noise = as_noise(noise)
        if sampling is None:
            sampling = PoissonSampling()
        if not isinstance(sampling, (PoissonSampling, TwiceSampling, HybridClipping)):
            raise ValueError(f"sampling must be a dpsgd.sampling.PoissonSampling, TwiceSampling, HybridClipping or "
                             f"None, got {type(sampling).__name__}")
        c = check_positive(max_grad_norm, "max_grad_norm")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        sigma = None
        if noise_multiplier is not None:
            sigma = check_positive(noise_multiplier, "noise_multiplier", allow_zero=True)
            if target_epsilon is not None:
                raise ValueError("give either noise_multiplier or target_epsilon, not both")
        elif target_epsilon is None or target_delta is None or (epochs is None) == (steps is None):
            raise ValueError("without noise_multiplier, target_epsilon, target_delta and one of epochs or steps are "
                             "required")
        if not isinstance(poisson_sampling, bool):   # a truthy string would silently mean Poisson
            raise ValueError(f"poisson_sampling must be True or False, got {poisson_sampling!r}")
        if not poisson_sampling and target_epsilon is not None:
            raise UnaccountedSamplingError(f"target_epsilon with poisson_sampling=False is refused: the noise would "
                                           f"be calibrated for Poisson sampling, which this run does not use; "
                                           f"{_SHUFFLED}. Keep poisson_sampling=True (the default) to calibrate, or "
                                           f"give noise_multiplier for a run without an epsilon")
        return noise, sampling, c, sigma

    def _scheme_loader(self, data_loader: DataLoader, scheme: BatchSampling,
                       seeds: dict[str, int]) -> tuple[DPDataLoader, BoundSampling]:
        """The loader of a non-Poisson :mod:`dpsgd.samplers` scheme, bound to the data set: its sampler and the
        mechanism the accountant composes come from the same :class:`~dpsgd.samplers.BoundSampling`.

        Under torch.distributed the scheme is bound to the global data set, the ranks' shards concatenated in rank
        order (``N`` and ``B`` the sums over ranks of the shard sizes and loader batch sizes): every rank draws the
        same stream of global batches and keeps its shard's part (:class:`~dpsgd.samplers.ShardOf`), so the union
        of the ranks' batches is the batch the accountant charges at ``N`` and ``B``."""
        n, batch = loader_size(data_loader)
        rank, world = rank_world()
        # every rank's shard size, in rank order (one all-reduce per rank, once per run)
        sizes = [n] if world == 1 else [round(all_sum(float(n) if r == rank else 0.0)) for r in range(world)]
        total, offset = sum(sizes), sum(sizes[:rank])
        batch = round(all_sum(float(batch)))
        over = " over ranks" if world > 1 else ""
        if batch > total:
            raise ValueError(f"data_loader's batch_size ({batch}{over}) exceeds the dataset size ({total}{over})")
        # before bind, which may refuse the scheme: a refusal on some ranks only would leave the others waiting
        check_same_on_ranks(zlib.crc32(json.dumps(scheme.settings(), sort_keys=True).encode()),
                            f"the batch sampling ({scheme!r} on this rank)")
        bound = scheme.bind(total, batch)
        # rank 0's sampling seed on every rank, derived from the seed all ranks share: one stream of global batches,
        # the same as a single-process run with this seed draws (a rank-local seed would give each rank other
        # batches than the one charged)
        self._sampling_rng.manual_seed(seeds["stream"])
        sampler = bound.sampler(self._sampling_rng, offset=offset, size=n if world > 1 else None)
        loader = DPDataLoader(data_loader.dataset, sampler, data_loader.collate_fn, sample_rate=bound.sample_rate,
                              on_batch=self._on_batch, on_empty=self._empty_step,
                              num_workers=data_loader.num_workers, pin_memory=data_loader.pin_memory)
        self._stream = sampler
        self.sample_rate = bound.sample_rate
        self.expected_batch_size = bound.sample_rate * total
        check_same_on_ranks(total, "the number of examples over ranks")
        check_same_on_ranks(batch, "the batch size over ranks")
        check_same_on_ranks(self.sample_rate, "the sampling rate")
        check_same_on_ranks(len(loader), "the number of batches per epoch")
        return loader, bound

    def _cover(self, module: nn.Module, optimizer: torch.optim.Optimizer, estimator: str, k: int,
               sampling: PoissonSampling | TwiceSampling | HybridClipping, max_grad_norm: float) -> NormPlan:
        """The model's norm plan (:attr:`plan`), its parameters' sampling groups, and the guarantee that every
        trainable parameter the optimizer steps is one the plan clips (``ValueError`` otherwise)."""
        plan = NormPlan.build(module, estimator, k)
        self.plan = plan
        self._ranks = self._sampling_ranks(sampling, plan, max_grad_norm)
        self._check_covered([p for g in optimizer.param_groups for p in g["params"]], "optimizer")
        return plan

    def _seed_generators(self, seed: int | None, rank: int, world: int) -> dict[str, int]:
        """Make the sampling, projection and noise generators, seeded from ``os.urandom`` (:meth:`_fresh_seeds`)
        or, in reproducibility mode, all derived from ``seed`` (rank 0's); the seeds by use: ``"sampling"`` (this
        rank's Poisson draws), ``"stream"`` (a batch-sampling scheme's global stream, the same on every rank),
        ``"projection"``, ``"noise"`` (the same on every rank) and ``"mask"``."""
        if seed is None:
            seeds = self._fresh_seeds()
        else:
            base = torch.Generator().manual_seed(broadcast_int(seed))
            drawn = torch.randint(2**62, (3 + world,), generator=base).tolist()
            seeds = {"sampling": drawn[3 + rank], "stream": drawn[3], "projection": drawn[1] + rank,
                     "noise": drawn[2], "mask": drawn[2] + 1}
        self._sampling_rng = torch.Generator().manual_seed(seeds["sampling"])   # each rank samples its own shard
        self._projection_rngs = _DeviceGenerators(seeds["projection"])
        # one generator per device, all seeded alike: the same noise on every rank (ranks of one GPU type draw the
        # same stream; the first step checks it), drawn where the parameters live (a CPU draw of a billion
        # coordinates, copied to the GPU, would cost seconds a step)
        self._noise_rngs = _DeviceGenerators(seeds["noise"])
        self._noise_checked = False
        return seeds

    @staticmethod
    def _fresh_seeds() -> dict[str, int]:
        """A seed for each generator from ``os.urandom``, each drawn apart: those every rank must share (the
        noise, a scheme's global stream, the masks) are rank 0's draws, broadcast; the others are the rank's own.
        Every rank must call it (the broadcasts are collectives)."""
        shared = {name: broadcast_int(_entropy_seed()) for name in ("stream", "noise", "mask")}
        return {"sampling": _entropy_seed(), "projection": _entropy_seed(), **shared}

    def _reseed(self) -> None:
        """Reseed every generator from ``os.urandom`` in place (the loader keeps drawing from the same generator
        object): a resumed run's draws are predicted by nothing saved, and not by the run's seed either."""
        seeds = self._fresh_seeds()
        # a scheme's sampler draws one global stream on every rank; the Poisson and user samplers the rank's own
        self._sampling_rng.manual_seed(seeds["stream"] if self._stream is not None else seeds["sampling"])
        self._projection_rngs.reseed(seeds["projection"])
        self._mask_rngs.reseed(seeds["mask"])
        self._noise_rngs.reseed(seeds["noise"])
        self._noise_checked = False   # the first resumed step checks again that every rank drew the same noise

    def _private_loader(self, data_loader: DataLoader, poisson_sampling: bool,
                        world: int) -> tuple[DPDataLoader, BoundSampling]:
        """The Poisson loader, and the sampling rate and expected batch size the step and the accountant use: one
        rate for the whole data set, ``q = (expected batch over ranks) / (examples over ranks)``, equal on every
        rank (each rank drawing its own shard's examples independently at ``q`` is a Poisson sample of the
        union; ``ValueError`` if it exceeds 1)."""
        n, batch = loader_size(data_loader)
        total = all_sum(float(n))
        q = all_sum(float(batch)) / total if world > 1 else None
        if q is not None and q > 1:
            raise ValueError(f"the batch sizes over all ranks add up to more than the {int(total)} examples over all "
                             f"ranks: the sampling rate must be at most 1")
        loader = private_data_loader(data_loader, poisson=poisson_sampling, generator=self._sampling_rng,
                                     on_batch=self._on_batch, on_empty=self._empty_step, sample_rate=q)
        self.sample_rate = loader.sample_rate
        self.expected_batch_size = self.sample_rate * total
        check_same_on_ranks(self.sample_rate, "the sampling rate")
        check_same_on_ranks(len(loader), "the number of batches per epoch")
        return loader, Poisson().at_rate(self.sample_rate, round(total))

    def _user_loader(self, data_loader: DataLoader, users: UserLevel,
                     world: int) -> tuple[DPDataLoader, BoundSampling]:
        """The loader of users (:func:`dpsgd.users.user_data_loader`): the rate charged is the user rate ``q_u``, and
        the step divides by the expected number of users ``q_u U``; single process only."""
        if world > 1:
            raise ValueError("privacy_unit='user' is supported in a single process only: under torch.distributed a "
                             "user's examples on different ranks would be clipped separately")
        loader = user_data_loader(data_loader, users, generator=self._sampling_rng, on_batch=self._on_batch,
                                  on_empty=self._empty_step)
        self.sample_rate = loader.sample_rate
        self.expected_batch_size = self.sample_rate * users.num_users
        self.privacy_unit, self.max_examples_per_user = "user", users.max_examples_per_user
        self._user_rows = UserRows()
        return loader, Poisson().at_rate(self.sample_rate, users.num_users)

    def _calibrate(self, accounting: RunAccounting, target_epsilon: float, target_delta: float, planned: int,
                   quiet: bool = False) -> float:
        """``accounting``'s noise multiplier for ``target_epsilon`` at ``target_delta`` after ``planned`` steps
        (:meth:`~dpsgd.accounting.RunAccounting.calibrate`), logged (unless ``quiet``) as it starts and with its
        seconds; ``ValueError`` naming the targets if none reaches them."""
        if not quiet:
            logger.info("calibrating noise_multiplier for target_epsilon=%g at target_delta=%g over %d steps at "
                        "sample rate %.4g (estimator %s, envelope %s)", target_epsilon, target_delta, planned,
                        self.sample_rate, self.estimator, accounting.envelope)
        start = time.perf_counter()
        try:
            sigma = accounting.calibrate(target_epsilon, target_delta, planned)
        except ValueError as err:
            raise ValueError(f"cannot calibrate the noise for target_epsilon={target_epsilon!r}, "
                             f"target_delta={target_delta!r} over {planned} steps at q={self.sample_rate:g}: "
                             f"{err}") from err
        if not quiet:
            logger.info("noise_multiplier %.6g calibrated in %.1f s", sigma, time.perf_counter() - start)
        return sigma

    def _fix_settings(self, accounting: RunAccounting, sigma: float, planned: int | None,
                      basis: torch.Tensor | None, seeds: dict[str, int]) -> None:
        """Fix the settings the step and the accountant share (read-only from here on) and the ledger's record of
        them, which a resumed run or a ledger file must match."""
        self._accounting = accounting
        self._noise_multiplier = sigma
        self.planned_steps = planned
        self._basis = basis
        self._settings = accounting.record(sigma)
        if accounting.clipping.per_coordinate:
            self._mask_rngs = _DeviceGenerators(seeds["mask"])   # sampling randomness, seeded like the noise

    def _attach(self, plan: NormPlan, module: nn.Module, optimizer: torch.optim.Optimizer,
                criterion: nn.Module | None) -> tuple[DPOptimizer, DPCriterion]:
        """Hook the model (recording from here on; the model then belongs to this engine) and wrap the optimizer
        and the loss."""
        self._capture = Capture(plan)
        self._capture.check_every_step, self._capture.check_rate = self._check_every_step, self._check_rate
        _per_token_experts(module)
        # example isolation by structure: active from each batch the private loader yields to its backward
        self._tracker = ExampleTracker(state=lambda: {**{f"parameter {n}": p for n, p in module.named_parameters()},
                                                      **{f"buffer {n}": b for n, b in module.named_buffers()}})
        self._capture.tracker = self._tracker if self._track_examples else None
        _ENGINES[module] = weakref.ref(self)
        self._module = module
        self._trainable = [(p, p.requires_grad) for p in module.parameters()]
        engine = weakref.ref(self)   # the model's hook does not keep the engine alive

        def follow(_module, _args):
            if engine() is not None and engine()._capture is not None and engine()._capture._recording():
                engine()._follow_trainable(strict=True)
        # after the capture's own root hooks: a refusal here leaves them balanced (their post-hooks always run)
        self._follow_handle = module.register_forward_pre_hook(torch.compiler.disable(follow))
        self._optimizer = DPOptimizer(optimizer, self)
        return self._optimizer, DPCriterion(criterion if criterion is not None else nn.CrossEntropyLoss(), self)

    # fixed by make_private: the step and the accountant both read them, and the accountant charges every step
    # taken at their current values (and the ledger records them), so a change mid-run would mis-charge the
    # steps already taken (a lower sample_rate, a higher noise_multiplier, a larger k, "exact" for an estimator
    # or a narrower envelope would under-charge them)
    # planned_steps bounds the steps the calibration holds for; secure_mode decides whether a seed is accepted;
    # ledger_path is where every step is recorded, so a resumed run counts them all
    FIXED_SETTINGS = frozenset({"noise_multiplier", "sample_rate", "expected_batch_size", "estimator", "projection_dim",
                                "max_grad_norm", "envelope", "planned_steps", "secure_mode", "ledger_path",
                                "privacy_unit", "max_examples_per_user"})

    # the settings that may change at any time (the row check's)
    SETTINGS = ("check_every_step", "check_rate")

    def __setattr__(self, name: str, value) -> None:
        if name in PrivacyEngine.FIXED_SETTINGS and self.__dict__.get("_capture") is not None:
            raise AttributeError(f"{name} is fixed by make_private: the accountant charges every step taken at "
                                 f"its current value, so changing it mid-run would mis-charge the steps already "
                                 f"taken; use a new PrivacyEngine")
        if self.__dict__.get("_sealed") and not name.startswith("_") and name not in self.__dict__ \
                and not hasattr(type(self), name):
            fixed = sorted(PrivacyEngine.FIXED_SETTINGS)
            raise AttributeError(f"PrivacyEngine has no setting {name!r}{_did_you_mean(name, [*self.SETTINGS, *fixed])}"
                                 f", so setting it would change nothing. Its settings: "
                                 f"{', '.join(self.SETTINGS)} (changeable at any time); {', '.join(fixed)} (given to "
                                 f"PrivacyEngine(...) or make_private(...), fixed from then on)")
        super().__setattr__(name, value)

    @property
    def check_every_step(self) -> bool:
        """Run the row check (example isolation and row attribution, docs/trainer.md) on every step with more than
        one example; ``False`` (default): on a new layout of module calls, and on each step with probability
        :attr:`check_rate`."""
        return self._check_every_step

    @check_every_step.setter
    def check_every_step(self, value: bool) -> None:
        self._check_every_step = bool(value)
        if self._capture is not None:
            self._capture.check_every_step = self._check_every_step

    @property
    def track_examples(self) -> bool:
        """Whether every step proves example isolation by structure (:mod:`dpsgd.isolation`): each batch the
        private loader yields is followed through every operation until its backward, and a loss or recorded
        call that depends on several examples, example data written into the model's state, or a custom
        ``autograd.Function`` on the way to the losses raises :class:`~dpsgd.ExampleMixingError` on the step
        it happens (:class:`~dpsgd.StateChangedError` for state).  Default ``True``; ``False`` leaves isolation to
        the sampled row check (:attr:`check_rate`)."""
        return self._track_examples

    @track_examples.setter
    def track_examples(self, value: bool) -> None:
        self._track_examples = bool(value)
        if self._capture is not None:
            if not self._track_examples:
                self._untrack()
            self._capture.tracker = self._tracker if self._track_examples else None

    @property
    def check_rate(self) -> float:
        """Probability in ``[0, 1]`` that a step is checked (drawn from ``os.urandom`` at its forward); default
        0.125.  A check costs one extra backward without weight gradients (about 0.6 of a non-private step on
        the long-context benchmark).  A checked step catches a dependence of one example's loss on
        another given example's input or activations with probability at least 1/4 (a batch-wide statistic
        almost surely), so a violation present on ``m`` steps is missed with probability at most
        ``(1 - check_rate / 4)^m`` (0.042 for 100 steps, 7e-5 for 300, at the default rate; a
        batch-wide statistic about ``(1 - check_rate)^m``).  With :attr:`track_examples` isolation is proved on
        every step by structure, and ``check_rate = 0`` leaves the row check to a model's first step and
        each new layout of calls, where it checks each handler's per-example gradients against autograd."""
        return self._check_rate

    @check_rate.setter
    def check_rate(self, value: float) -> None:
        rate = float(value)
        if not 0 <= rate <= 1:
            raise ValueError(f"check_rate must lie in [0, 1] (use check_every_step=True for 1), got {value!r}")
        self._check_rate = rate
        if self._capture is not None:
            self._capture.check_rate = rate

    @property
    def noise_multiplier(self) -> float | None:
        """``sigma``, given to or calibrated by ``make_private`` (``None`` before it).  Read-only, like the other
        :attr:`FIXED_SETTINGS`: the step draws noise at it and the accountant charges every step taken at it,
        so changing it mid-run would charge the steps already taken at a noise they did not have.  Use a new
        ``PrivacyEngine`` to change it."""
        return self._noise_multiplier

    @property
    def noise(self) -> StepNoise:
        """The noise chosen in ``make_private`` (a :class:`~dpsgd.noise.StepNoise`); the step draws it and
        the accountant composes its mechanism, so it cannot be changed afterwards."""
        return GaussianNoise() if self._accounting is None else self._accounting.noise

    @property
    def poisson_sampling(self) -> bool:
        """``make_private``'s ``poisson_sampling`` (read-only); ``False``: fixed-size shuffled batches, for which
        every epsilon is refused (:class:`UnaccountedSamplingError`)."""
        return True if self._accounting is None else self._accounting.accounted

    @property
    def batch_sampling(self) -> BatchSampling:
        """``make_private``'s ``batch_sampling`` (read-only): how each step's examples are chosen and accounted."""
        return Poisson() if self._accounting is None else self._accounting.sampling.scheme

    @property
    def sampling(self) -> PoissonSampling | TwiceSampling | HybridClipping:
        """The sampling chosen in ``make_private`` (:class:`~dpsgd.sampling.PoissonSampling` by default); the
        step and the accountant both follow it, so it cannot be changed afterwards."""
        return PoissonSampling() if self._accounting is None else self._accounting.clipping

    @property
    def accounting(self) -> RunAccounting | None:
        """What the run is accounted as (:class:`~dpsgd.accounting.RunAccounting`: the mechanism, the accountant,
        the ledger's record), fixed by ``make_private`` (``None`` before it)."""
        return self._accounting

    @staticmethod
    def _sampling_ranks(sampling: PoissonSampling | TwiceSampling | HybridClipping, plan: NormPlan,
                        max_grad_norm: float) -> list[int]:
        """Coordinates per group; every parameter in a group and the groups as the sampling requires (else
        ValueError)."""
        ranks = [0] * len(sampling.bounds(max_grad_norm))
        for p in plan.params:
            ranks[sampling.group_of(plan.names[id(p)])] += p.numel()
        sampling.check_groups(ranks, max_grad_norm)
        return ranks

    def _projection_basis(self, basis: torch.Tensor, world: int) -> torch.Tensor:
        """``gradient_projection`` checked and orthonormalized (float64, on the first parameter's device)."""
        if world > 1 or any(is_sharded(p) for p in self.plan.params):
            raise ValueError("gradient_projection is supported in a single process only (every rank would "
                             "need the same basis over the full, unsharded parameter vector)")
        total = sum(p.numel() for p in self.plan.params)
        if not isinstance(basis, torch.Tensor) or basis.ndim != 2 or basis.shape[0] != total or basis.shape[1] < 1:
            raise ValueError(f"gradient_projection must be a ({total}, k) tensor with k >= 1 (one row per trainable "
                             f"parameter entry, in the model's parameter order), got "
                             f"{tuple(getattr(basis, 'shape', ())) or type(basis).__name__}")
        if not torch.isfinite(basis).all():
            raise ValueError("gradient_projection must be finite")
        q, r = torch.linalg.qr(basis.detach().to(self.plan.params[0].device, torch.float64))
        diag = r.diagonal().abs()
        if diag.min() <= 1e-10 * diag.max():
            raise ValueError("gradient_projection's columns are linearly dependent (rank below k)")
        return q

    def _project(self, sums: list[torch.Tensor]) -> list[torch.Tensor]:
        """``V V^T`` applied to the clipped sums, flattened in parameter order (``V`` orthonormal: a contraction,
        so one example's contribution stays within ``C``)."""
        flat = torch.cat([s.reshape(-1).to(self._basis.device, torch.float64) for s in sums])
        flat = self._basis @ (self._basis.T @ flat)
        out, at = [], 0
        for s in sums:
            out.append(flat[at:at + s.numel()].reshape(s.shape).to(s.device, s.dtype))
            at += s.numel()
        return out

    def _check_covered(self, params, where: str) -> None:
        if self._capture is not None:
            self._follow_trainable(strict=False)
        covered = {id(p) for p in self.plan.params}
        for p in params:
            if p.requires_grad and id(p) not in covered:
                raise ValueError(f"{where} holds a trainable parameter that is not in the private model "
                                 f"({tuple(p.shape)}): every trained parameter must be clipped")

    def _follow_trainable(self, strict: bool) -> None:
        """Re-plan when parameters were frozen or unfrozen (``requires_grad``) since the plan was made: at each
        training forward (``strict``) and at ``zero_grad()`` and ``add_param_group`` (where a step's batch still
        in progress defers it to the next forward).

        The accountant charges every step with the envelope fixed at ``make_private``, so the new plan is taken
        only if that envelope still bounds its estimate (:func:`_envelope_covers`: fewer chi-square terms under
        ``hutch``, anything under exact norms as long as they stay exact); else ``RuntimeError``, naming the
        parameters, and nothing changes.  So are a ``gradient_projection`` (its basis spans the parameters of the
        first plan) and a change of the coordinates per group of twice sampling or hybrid clipping (their noise
        and accounting depend on them)."""
        changed = [p for p, flag in self._trainable if p.requires_grad != flag]
        if not changed:
            return
        if self._capture.calls or self._sums or self._backpropagated:
            if not strict:
                return
            raise RuntimeError("requires_grad of a parameter changed while this step's batch was being processed "
                               "(recorded forwards or clipped sums wait for step()): freeze or unfreeze parameters "
                               "between optimizer.step() and the next forward")
        model = self.plan.model
        names = {id(p): n for n, p in model.named_parameters()}
        which = ", ".join(names.get(id(p), "?") + (" (unfrozen)" if p.requires_grad else " (frozen)")
                          for p in changed[:4]) + (", ..." if len(changed) > 4 else "")
        plan = NormPlan.build(model, self.estimator, self.projection_dim)   # the validator and sharding checks
        # the hooks of a unit on the model itself: inside the model's own forward, this call's set of them is fixed
        on_root = {id(p) for old_or_new in (self.plan, plan) for u in old_or_new.units if u.module is model
                   for p in u.params.values()}
        if strict and any(id(p) in on_root for p in changed):
            raise RuntimeError(f"{which}: a parameter of the model itself (not of a submodule) changed requires_grad "
                               f"after make_private; the engine follows that at optimizer.zero_grad(), not inside "
                               f"the model's forward. Call optimizer.zero_grad() before this forward (or move the "
                               f"parameter into a submodule)")
        envelope = plan.envelope(self.projection_dim)
        if not _envelope_covers(self.envelope, envelope):
            raise RuntimeError(
                f"{which}: the model's trainable parameters changed after make_private, and under estimator "
                f"{self.estimator!r} the new plan's estimate needs the envelope {envelope!r}, which the accountant's "
                f"{self.envelope!r} (fixed at make_private, charged for every step) does not bound, so the steps "
                f"would be under-charged. Make those parameters trainable before make_private (or set them back), "
                f"use exact norms (estimator='ghost' or 'exact': accounted as DP-SGD whatever trains), or train the "
                f"new phase with a new PrivacyEngine (the two runs' epsilons and deltas add up)")
        if self._basis is not None:
            raise RuntimeError(f"{which}: the trainable parameters changed after make_private, but "
                               f"gradient_projection's basis spans the parameters of the first plan; use a new "
                               f"PrivacyEngine with a basis for the new ones")
        ranks = self._sampling_ranks(self._accounting.clipping, plan, self.max_grad_norm)
        if self._accounting.clipping.per_coordinate and ranks != self._ranks:
            raise RuntimeError(f"{which}: the trainable parameters changed after make_private, which changes the "
                               f"coordinates per group ({self._ranks} to {ranks}) that "
                               f"{type(self._accounting.clipping).__name__}'s noise and accounting depend on; use a "
                               f"new PrivacyEngine")
        self._capture.replan(plan)
        self.plan, self._ranks = plan, ranks
        self._trainable = [(p, p.requires_grad) for p in model.parameters()]

    def private_loss(self, losses: torch.Tensor) -> DPLoss:
        """A :class:`DPLoss` from your own ``(B,)`` per-example losses (e.g. a paired or DPO-style loss built
        from several forwards: every forward's contribution is counted).  Each loss must depend on its own
        example only (in-batch negatives would mix examples)."""
        self._require_private()
        return DPLoss(losses, self)

    def _require_private(self) -> None:
        if self._capture is None:
            raise RuntimeError("call make_private(...) on this PrivacyEngine first")

    def _require_accounted(self) -> None:
        """:class:`UnaccountedSamplingError` unless an accountant here covers this run's sampling (Poisson)."""
        if not self._accounting.accounted:
            raise UnaccountedSamplingError(f"no epsilon for this run: {_SHUFFLED}. Train with "
                                           f"poisson_sampling=True (the default) for an epsilon")

    def _backward(self, losses: torch.Tensor) -> None:
        self._require_private()
        recorded = self._recorded_examples()
        device = losses.device if isinstance(losses, torch.Tensor) else torch.device("cpu")
        twice = self._accounting.clipping if self._accounting.clipping.per_coordinate else None
        # user-level: the rows of the chunk the loader yielded, each with its user (never taken from the caller)
        groups = None if self._user_rows is None else self._user_rows.take(losses)
        padding = self._take_padding(losses)
        result = clipped_backward(self._capture, losses, self.max_grad_norm, self.projection_dim,
                                  self._projection_rngs(device),
                                  clipping_pass=self.clipping_pass, twice=twice,
                                  mask_generator=None if twice is None else self._mask_rngs(device), groups=groups,
                                  padding=padding)
        self._check_isolated(losses, recorded)   # before anything of this backward is kept
        for p in self.plan.params:
            s = result.sums.get(id(p))
            if s is None:
                continue
            total = self._sums.get(id(p))
            self._sums[id(p)] = s if total is None else total + s
        b = int(losses.shape[0])
        self._backpropagated += b
        self._consumed = True
        self._discarded = False   # a backward after zero_grad(): this batch's losses must be complete again
        clipped = result.weights < 1 if padding is None else (result.weights < 1)[~padding.to(result.weights.device)]
        self.last_clipped_fraction = float(clipped.double().mean()) if clipped.numel() else 0.0

    def _take_padding(self, losses: torch.Tensor) -> torch.Tensor | None:
        """The filler rows of the padded batch drawn for this backward (``None`` for an unpadded loader): the loader
        says which rows they are, and the backward must be of that whole batch."""
        padding, self._padding = self._padding, None
        if padding is not None and (not isinstance(losses, torch.Tensor) or losses.shape != padding.shape):
            raise RuntimeError(f"a padded batch of {padding.numel()} rows (TruncatedPoisson(pad=True), or a rank's "
                               f"part under FSDP2) must be "
                               f"backpropagated whole, one loss per row, got losses of shape "
                               f"{tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__}")
        return padding

    def _on_batch(self, size: int, last: bool, logical: int, groups: torch.Tensor | None = None,
                  padding: torch.Tensor | None = None, batch: object = None) -> None:
        if self._pending is not None and logical != self._pending:
            raise RuntimeError(self._drawn_twice)
        self._track(batch)
        self._padding = padding
        if self._user_rows is not None:
            self._user_rows.drawn(groups)
        self._pending = logical
        self._drawn += size
        self._skip_next = not last

    def _track(self, batch: object) -> None:
        """Register the batch the loader yields with the tracker, and make the tracker active until its backward:
        every tensor computed from it, wherever the user's code takes it, is followed (:mod:`dpsgd.isolation`)."""
        capture = self._capture
        tracker = capture.tracker
        if tracker is None:
            return
        if tracker.active and tracker.failed:   # a refused step left it on the stack
            tracker.pop()
        if not tracker.active:
            tracker.push()
        # under FSDP2 the ranks refuse together at the backward: nothing raises inside one rank's forward
        tracker.defer = rank_world()[1] > 1 and any(is_sharded(p) for p in self.plan.params)
        ids = tracker.register(batch)
        if ids is not None:
            # every chunk drawn for this step (the Hugging Face Trainer draws a logical batch's micro-batches
            # before their forwards)
            capture.batch_ids = ids if capture.batch_ids is None else torch.cat([capture.batch_ids, ids])

    def _untrack(self) -> None:
        """The step is over: the tracker stops, and the next batch starts a new set of examples."""
        capture = self._capture
        self._used_ids = None
        if capture is not None and capture.tracker is not None:
            capture.tracker.pop()
            capture.batch_ids = None

    def _recorded_examples(self) -> list:
        """The examples of each recorded call the coming backward consumes, taken before it consumes them; the
        tracker stops here (the backward runs outside it, and a second micro-batch of this batch re-arms it at
        its forward)."""
        capture = self._capture
        if capture.tracker is None or not self._track_examples:
            return []
        capture.tracker.pop()
        return [(c.cache["unit"].path or type(c.module).__name__, c.cache.get("examples")) for c in capture.calls
                if not c.cache.get("dropped")]

    def _check_isolated(self, losses: torch.Tensor, recorded: list) -> None:
        """Before the backward's clipped sums are kept: the losses must be one per example of the batches drawn
        for this step, each computed from its own example only (the tracker's record of the operations that made
        them), no example's loss backpropagated twice in the step, every recorded call on the losses' examples in
        their order, and no custom ``autograd.Function`` whose backward the tracker cannot see between them and
        the parameters.  Under FSDP2 the ranks refuse together (their next collectives must match)."""
        capture = self._capture
        tracker, ids = capture.tracker, capture.batch_ids
        if tracker is None or not isinstance(losses, torch.Tensor) or not self._track_examples:
            return
        error = None
        try:
            if tracker.deferred is not None:
                raise tracker.deferred
            if ids is None:
                raise ExampleMixingError("a private backward without a batch drawn from this engine's private data "
                                         "loader (its batches are followed from the moment it yields them): a batch "
                                         "made by hand is not charged by the accountant")
            examples = tracker.check_rows(losses, ids, "the per-example losses")
            if self._used_ids is not None and bool(torch.isin(examples, self._used_ids).any()):
                raise ExampleMixingError("some of these per-example losses belong to examples whose losses were "
                                         "already backpropagated for this step: each example contributes one "
                                         "clipped gradient per step")
            for name, seen in recorded:
                if seen is not None and not (seen.shape == examples.shape and bool(torch.equal(seen, examples))):
                    raise ExampleMixingError(f"a recorded call of {name} ran on other examples, or in another "
                                             f"order, than the losses' rows: its per-example gradients would be "
                                             f"attributed to the wrong examples")
            check_backward_functions(losses)
        except (ExampleMixingError, StateChangedError) as e:
            error = e
        # tracker.defer: the ranks under FSDP2, decided at the batch's draw, refuse together
        if tracker.defer and any_rank(error is not None) and error is None:
            error = ExampleMixingError("the isolation check failed on another rank (see its error): every rank "
                                       "refuses the step together under FSDP2")
        if error is not None:
            self._untrack()
            raise error
        self._used_ids = examples if self._used_ids is None else torch.cat([self._used_ids, examples])

    def _zero_grad(self) -> None:
        self._require_private()
        self._follow_trainable(strict=False)
        # the forwards recorded so far are dropped with the batch (a private backward may still consume them):
        # a gradient a plain backward left on their parameters' aliases is cleared with the .grad it stands for
        for c in self._capture.calls:
            c.cache["dropped"] = True
            for alias in c.aliases.values():
                alias.grad = None
        self._consumed = False
        if self._last_skipped:
            return  # the memory manager's logical batch is not complete: keep the clipped sums
        if self._backpropagated or self._drawn:   # the batch so far is dropped: a noise-only step is allowed
            self._discarded = True
        self._used_ids = None   # the dropped batch's losses may be backpropagated again
        self._sums.clear()
        for p in self.plan.params:
            p.grad = None

    _drawn_twice = ("a batch was drawn from the private data loader before optimizer.step() of the batch drawn "
                    "before it: one noisy step per Poisson batch, or the accountant charges rate q for a step that "
                    "used more (two batches concatenated, a buffer of batches). Call optimizer.step() after every "
                    "batch (after optimizer.zero_grad() it takes a noise-only step for a batch you skip); split a "
                    "large batch with BatchMemoryManager; to stop early, stop before drawing the next batch.")

    def _empty_step(self) -> None:
        if self._pending is not None:
            raise RuntimeError(self._drawn_twice)
        if self._backpropagated or self._sums:
            raise RuntimeError("an empty Poisson batch was drawn while a backward's clipped sums wait for step(); "
                               "call optimizer.step() after every batch")
        self._step()

    def _step(self) -> None:
        self._require_private()
        self._untrack()
        if self._skip_next:
            self._refuse_untrained_step()
            self._skip_next, self._last_skipped = False, True
            return
        if self.planned_steps is not None and self.spent_steps >= self.planned_steps:
            raise RuntimeError(f"the noise was calibrated for {self.planned_steps} steps (target_epsilon at "
                               f"target_delta) and they have all been taken; another step would spend more than "
                               f"the target. Calibrate for the steps you will run (make_private(steps=...)).")
        sampling = self._accounting.sampling
        if self.planned_steps is not None and sampling.scheme.per_epoch \
                and self._events(self.spent_steps) > sampling.events(self.planned_steps):
            raise RuntimeError(f"the noise was calibrated for {sampling.events(self.planned_steps)} epochs of "
                               f"{sampling.scheme!r} and this step's batch begins another (batches were drawn "
                               f"without a step); another step would spend more than the target")
        if self._drawn and not self._backpropagated and not self._discarded:
            raise RuntimeError("optimizer.step() without loss.backward() on a private loss of this batch")
        if self._backpropagated > self._drawn:
            raise RuntimeError(f"{self._backpropagated} per-example losses were backpropagated but only {self._drawn} "
                               f"examples were drawn from the private data loader since the last step: an example "
                               f"may contribute one clipped gradient per step (a second backward of the same batch, "
                               f"or batches from another loader, would break the privacy guarantee)")
        if self._backpropagated < self._drawn and not self._discarded:
            raise RuntimeError(f"{self._backpropagated} per-example losses (rows) were backpropagated for "
                               f"{self._drawn} examples drawn from the private data loader: each example must be one "
                               f"row of the batch with a loss of its own. A collate_fn that packs several examples "
                               f"into one row gives each row up to k examples' influence while the accountant charges "
                               f"per example; pack within an example, or use one row per example. (Call "
                               f"optimizer.zero_grad() first to drop this batch with a noise-only step.)")
        self._refuse_untrained_step()
        written = [self.plan.names[id(p)] for p in self.plan.params if p.grad is not None]
        if written:
            raise RuntimeError(f"{written[0]}.grad was written outside the private backward (a plain "
                               f"loss.backward() on an unrecorded forward, or an assignment); the private step "
                               f"uses only the clipped sums of DPLoss.backward(). Call optimizer.zero_grad() "
                               f"first if that gradient is to be dropped.")
        # a parameter no example reached gets zeros (made only then: dict.get's default would fill one
        # parameter-sized tensor for every parameter)
        sums = [self._sums[id(p)] if id(p) in self._sums else
                torch.zeros(p.shape, device=p.device, dtype=torch.promote_types(p.dtype, torch.float32))
                for p in self.plan.params]
        # per-example norms stay local; the clipped sums add up across ranks (all-reduce, or reduce-scatter
        # for FSDP2's sharded parameters)
        sums = reduce_sums(self.plan.params, sums)
        if self._basis is not None:
            sums = self._project(sums)
        # twice sampling keeps each coordinate of an example with probability q2: dividing by q2 too leaves the
        # gradient unbiased (a post-processing; the noise is scaled with it)
        divisor = self.expected_batch_size * self._accounting.clipping.coordinate_rate
        # one noise level per group (hybrid clipping's shape; else all equal)
        per_group = self._accounting.clipping.noise_stds(self.noise_multiplier, self.max_grad_norm, self._ranks)
        std = [per_group[self._accounting.clipping.group_of(self.plan.names[id(p)])] for p in self.plan.params]
        try:   # in place: the clipped sums become the noisy gradients (no second parameter-sized buffer)
            noisy = noisy_gradients(sums, std, divisor, self._noise_rngs, params=self.plan.params,
                                    noise=self._accounting.noise, in_place=True)
        except FloatingPointError:
            self._reset_step_state()   # the sums were overwritten: the batch is dropped, nothing was written
            raise
        if not self._noise_checked:   # replicated parameters' noisy gradients are equal on every rank
            first = next((g for p, g in zip(self.plan.params, noisy, strict=True) if not is_sharded(p)), None)
            try:
                check_same_on_ranks(0.0 if first is None else float(first.sum()),
                                    "the first step's noisy gradient (the noise generators are seeded alike on every "
                                    "rank, but GPUs of different types can draw different streams from one seed)")
            except ValueError:
                self._reset_step_state()
                raise
            self._noise_checked = True
        del sums
        self._sums = {}
        for i, p in enumerate(self.plan.params):
            p.grad = as_grad(p, noisy[i])   # the same tensor when p is float32; else one cast at a time
            noisy[i] = None
        self._optimizer.original_optimizer.step()
        self._record_step()  # the ledger: only after the step has happened
        self._capture.clear()
        self._reset_step_state()
        for p in self.plan.params:
            p.grad = None

    _UNTRAINED_FIX = ("Backpropagate the loss of the criterion returned by make_private (crit = make_private(...)[2]; "
                      "crit(model(x), y).backward()), or your own per-example losses through "
                      "engine.private_loss(losses).backward(); a loss module or function of your own with a plain "
                      "loss.backward() trains nothing here. (Call optimizer.zero_grad() first to drop this batch "
                      "with a noise-only step.)")

    def _refuse_untrained_step(self) -> None:
        """``RuntimeError`` for a step whose batch was forwarded but not privately backpropagated: the step would
        add noise only and train nothing, silently.  The recorded forwards that no private backward consumed are
        still in the capture: a plain ``loss.backward()`` left its gradient on their parameters' aliases, and a
        forward recorded since the last ``zero_grad()`` with no private backward since is one nothing trained
        from.  A noise-only step without a forward, or after ``zero_grad()`` dropped the batch, passes."""
        pending = self._capture.calls
        if any(a.grad is not None for c in pending for a in c.aliases.values()):
            raise RuntimeError(f"a plain loss.backward() reached the model's training forward: its gradient went to "
                               f"the engine's per-call stand-ins for the parameters, not into a clipped per-example "
                               f"sum, so this step would add noise only and train nothing. {self._UNTRAINED_FIX}")
        if not self._consumed and any(not c.cache.get("dropped") for c in pending):
            raise RuntimeError(f"a training forward of the model was recorded since the last step, but no private "
                               f"backward consumed it, so this step would add noise only and train nothing. "
                               f"{self._UNTRAINED_FIX}")

    def _read_ledger(self) -> None:
        if self.ledger_path is None or not os.path.exists(self.ledger_path):
            return
        with open(self.ledger_path) as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
        for rec in lines:
            if read_record(rec["settings"], f"ledger {self.ledger_path}") != self._settings:
                raise ValueError(f"ledger {self.ledger_path} was written with different privacy settings "
                                 f"({rec['settings']}); use a new ledger file")
        self._recorded = len(lines)

    def _record_step(self) -> None:
        self._steps += 1
        if self.ledger_path is not None and rank_world()[0] == 0:
            with open(self.ledger_path, "a") as fh:
                fh.write(json.dumps({"step": self._steps, "settings": self._settings}) + "\n")
                fh.flush()
                os.fsync(fh.fileno())

    @property
    def steps(self) -> int:
        """Noisy steps of this run (from a resumed checkpoint on)."""
        return self._steps

    @property
    def spent_steps(self) -> int:
        """Noisy steps whose privacy is spent: this run's, or the ledger file's count if that is larger."""
        return max(self._steps, self._recorded + self._steps - self._resumed)

    def _mechanism(self):
        """The dpmath mechanism of one accounted event (a step; an epoch for an epoch sampler)."""
        return self._accounting.mechanism(self.noise_multiplier)

    def _events(self, steps: int) -> int:
        """How many of :meth:`_mechanism`'s events ``steps`` steps charge (an epoch sampler: the epochs its stream
        has begun, counted from the batches drawn when ``steps`` are the steps taken)."""
        return self._accounting.events(steps, self._stream if steps == self.spent_steps else None)

    def accountant(self) -> PLDAccountant | RDPAccountant:
        """A fresh accountant holding every step taken so far: a :class:`dpmath.PLDAccountant`, or with twice
        sampling a :class:`dpmath.RDPAccountant` (its mechanism has an RDP bound only).

        Raises
        ------
        UnaccountedSamplingError
            For a run made with ``poisson_sampling=False`` (no accountant here covers shuffled batches).
        """
        self._require_private()
        self._require_accounted()
        return self._composed(self.spent_steps)

    def _composed(self, steps: int) -> PLDAccountant | RDPAccountant:
        """A fresh accountant holding ``steps`` steps of this run's mechanism."""
        self._require_accounted()   # every epsilon passes here or through get_epsilon
        acc = self._accounting.accountant()
        if steps:
            if self.noise_multiplier == 0:
                raise ValueError("noise_multiplier is 0: no privacy guarantee")
            acc.compose(self._mechanism(), self._events(steps))
        return acc

    def get_epsilon(self, delta: float, *, overcount: float = 0.0) -> float:
        """Upper bound on the epsilon spent so far at ``delta`` (0 before the first step).

        Each value is kept by step count and ``delta``, so asking again between steps is free.  A new step count costs
        one FFT pass of a :class:`dpmath.EpsilonSchedule` whose step PLDs and transform are built once per run (for
        :attr:`planned_steps`, or a power of two at least the steps taken, rebuilt when the steps pass it): after the
        first, about 10 ms for ``exact``/``ghost`` and 20 to 40 ms for ``hutch`` at ``projection_dim=16`` (about 0.4 s
        at 8), where a fresh accountant took 0.5 to 1.5 s.  The value is a certified upper bound like the fresh
        accountant's (:meth:`accountant`), within its bracket though not its digits (the module docstring of
        :mod:`dpmath.pld.schedule`); at the calibrated count, :attr:`planned_steps`, it **is** the fresh accountant's,
        the number the calibration met.  Twice sampling and hybrid clipping (an RDP accountant) compose afresh at each
        count.

        Parameters
        ----------
        delta : float
            The delta of the ``(epsilon, delta)`` guarantee.
        overcount : float, optional
            ``0`` (default): the epsilon of the :attr:`spent_steps`.  ``> 0``: **pessimistic**, the epsilon of
            ``n`` steps with ``n`` the first count at or above :attr:`spent_steps` on the grid ``1, 2, ...`` whose
            every count is ``ceil((1 + overcount) x`` the one before (and at least one more), or
            :attr:`planned_steps` if that is smaller.  So ``spent_steps <= n <= ceil((1 + overcount) spent_steps)``,
            and a run computes about ``log(steps) / log(1 + overcount)`` values however often it asks (of use
            with an RDP accountant, whose every count is a composition).  Charging steps not taken only adds
            privacy loss, so the value is an upper bound on the epsilon of the steps taken, at least the value
            at them (epsilon grows with the steps), and equal to it where ``spent_steps`` is on the grid or is
            ``planned_steps`` (the end of a calibrated run).

        Returns
        -------
        float

        Raises
        ------
        UnaccountedSamplingError
            For a run made with ``poisson_sampling=False`` (no accountant here covers shuffled batches), even
            before its first step.

        Examples
        --------
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from dpsgd import PrivacyEngine
        >>> engine, model = PrivacyEngine(), nn.Linear(4, 2)
        >>> data = TensorDataset(torch.randn(100, 4), torch.randint(0, 2, (100,)))
        >>> model, opt, crit, loader = engine.make_private(module=model, data_loader=DataLoader(data, batch_size=10),
        ...     optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, noise_multiplier=1.0,
        ...     estimator="exact")
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     crit(model(x), y).backward()
        ...     opt.step()
        >>> engine.spent_steps
        10
        >>> logged = engine.get_epsilon(1e-5)
        >>> lo, hi = engine.accountant().epsilon_bracket(1e-5)     # a fresh accountant's bracket
        >>> bool(lo <= logged <= hi * (1 + 1e-5))
        True
        >>> bool(logged < engine.get_epsilon(1e-5, overcount=0.25))   # 12 steps: the grid 1, 2, 3, 4, 5, 7, 9, 12
        True
        """
        self._require_private()
        self._require_accounted()
        steps = self.spent_steps
        if not steps:
            return 0.0
        rate = check_positive(overcount, "overcount", allow_zero=True)
        if rate:
            # the first grid count at or above the steps taken (the tolerance keeps a product such as 1.1 x 10
            # from rounding up past the grid's own count)
            charged = 1
            while charged < steps:
                charged = max(charged + 1, math.ceil((1 + rate) * charged - 1e-9))
            if self.planned_steps is not None:
                charged = max(steps, min(charged, self.planned_steps))
            steps = charged
        key = (steps, self._events(steps), float(delta))   # an epoch sampler's epochs move with its batches drawn
        if key not in self._epsilons:
            self._epsilons[key] = self._epsilon_at(steps, delta)
        return self._epsilons[key]

    def _epsilon_at(self, steps: int, delta: float) -> float:
        """The epsilon of ``steps`` steps: the run's :class:`dpmath.EpsilonSchedule`, or a fresh accountant at the
        calibrated count and where the accountant is not a plain :class:`dpmath.PLDAccountant`."""
        accountant = self._accounting.accountant()
        # a float bracket_rtol refines without a budget (the accountant's); the default "auto" and None: the schedule
        if (not isinstance(accountant, PLDAccountant) or isinstance(accountant.bracket_rtol, float)
                or not self._accounting.poisson_batches
                or steps == self.planned_steps or self.noise_multiplier == 0):
            # only the number is kept: the composed accountant holds hundreds of MB of loss grids
            return self._composed(steps).epsilon(delta)
        mechanism = self._mechanism()
        schedule = self._schedule
        if schedule is None or schedule.mechanism != mechanism or schedule.max_count < steps:
            # the calibrated count where there is one (no step passes it); else a power of two, so that a run of
            # unknown length builds the step about log2(steps / 64) times
            planned = self.planned_steps if self.planned_steps is not None and self.planned_steps >= steps else \
                max(64, 1 << (steps - 1).bit_length())
            schedule = self._schedule = EpsilonSchedule.for_accountant(accountant, mechanism, planned)
        try:
            return schedule.epsilon(steps, delta)
        except GridTooLargeError:   # the step's grid, chosen for more steps, is too large: this count's alone
            return self._composed(steps).epsilon(delta)

    def detach(self) -> None:
        """Remove the hooks from the model: it trains and evaluates as it did before ``make_private``."""
        if self._capture is not None:
            self._untrack()
            self._capture.remove()
            self._follow_handle.remove()

    def state_dict(self) -> dict:
        """The ledger's count and the settings: ``{"settings": ..., "steps": ...}``, with ``"epochs"`` (the epochs
        charged) for an epoch sampler; plain numbers and strings only.

        No generator state: nothing in it predicts the batches, Hutchinson projections, twice sampling's masks or
        noise of any step, so a checkpoint file can be read by anyone without disclosing the clipped sums of the
        steps after it."""
        self._require_private()
        epochs = {} if not self._accounting.sampling.scheme.per_epoch else {
            "epochs": self._events(self.spent_steps)}   # an epoch sampler's epochs charged: the resumed stream's start
        return {"settings": dict(self._settings), "steps": self._steps, **epochs}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the settings must equal this engine's (else ValueError); the ledger continues, and every
        generator is reseeded from ``os.urandom`` (under torch.distributed, rank 0's draws where the ranks must
        agree: call it on every rank).

        The resumed run draws batches, projections, masks and noise that nothing saved predicts (and not the
        run's ``seed`` either), so it does not repeat the steps the interrupted run took after the checkpoint; its
        epsilon counts the same steps.  A state of an earlier version, which also held the generators' states,
        loads with a ``UserWarning``: those states are ignored."""
        self._require_private()
        saved = read_record(state["settings"], "this checkpoint")
        if saved != self._settings:
            # keys of either side: a setting only one of them records (privacy_unit) is a difference too
            diff = {k: (saved.get(k), self._settings.get(k)) for k in sorted(saved.keys() | self._settings.keys())
                    if saved.get(k) != self._settings.get(k)}
            raise ValueError(f"checkpoint was made with different privacy settings (saved, now): {diff}")
        self._steps = self._resumed = int(state["steps"])
        if self._accounting.sampling.scheme.per_epoch:
            # the next batch begins a new epoch after those charged, so none of them can see an example twice; the
            # new epoch's allocation or permutation is drawn afresh (below), not the interrupted run's: each epoch
            # charged is one epoch of its own sampler, whatever its draw, so the accounting is the same (the
            # partial epoch cut off by the checkpoint stays charged whole, as before)
            self._stream.resume(int(state["epochs"]))
        old = sorted(k for k in _GENERATOR_STATE_KEYS if k in state)
        if old:
            warnings.warn(f"this state_dict, of an earlier version of dpsgd, holds generator states "
                          f"({', '.join(old)}); they are ignored: a resumed run reseeds every generator from "
                          f"os.urandom. That file predicts the noise of the steps after it: delete it, or keep it as "
                          f"private as the data", UserWarning, stacklevel=2)
        self._reseed()

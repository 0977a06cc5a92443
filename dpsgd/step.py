r"""The private step of one logical batch: from the batches the private loader draws, through the private
backwards, to the noisy gradients the optimizer steps with.

:class:`PrivateStep` holds what a step in progress is made of, and nothing leaves it before the noise: the
recorded forwards (:class:`~dpsgd.capture.Capture`), the isolation tracker's record of the drawn examples
(:mod:`dpsgd.isolation`), the clipped sums of each private backward (:func:`~dpsgd.clipping.clipped_backward`),
and the generators of the projections, masks and noise (seeded from ``os.urandom``, never exported).  Its users:

* the private loader calls :meth:`~PrivateStep.on_batch` as it yields each batch (and
  :meth:`~PrivateStep.check_empty` before the noise-only step of an empty one);
* :meth:`dpsgd.loss.DPLoss.backward` calls :meth:`~PrivateStep.backward`;
* :class:`dpsgd.optimizer.DPOptimizer` owns the step: :meth:`~PrivateStep.begin_step`, the engine's admission of
  the step (its calibration), :meth:`~PrivateStep.noisy_gradients`, the wrapped optimizer's step, the ledger, then
  :meth:`~PrivateStep.end_step`; ``zero_grad()`` is :meth:`~PrivateStep.zero_grad`.

Every refusal of a step that would break the accounting (more losses than examples drawn, a batch not
backpropagated, a ``.grad`` written outside the private backward, a batch drawn before the last one's step, a
change of the trainable parameters the accountant's envelope does not cover) is raised here, before anything of
the step is written.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dpmath import Envelope, HutchEnvelope, HutchPPEnvelope

from .accounting import RunAccounting
from .capture import Capture
from .clipping import clipped_backward
from .distributed import any_rank, as_grad, broadcast_int, check_same_on_ranks, is_sharded, rank_world, reduce_sums
from .isolation import ExampleMixingError, ExampleTracker, StateChangedError, check_backward_functions
from .noise import noisy_gradients
from .plan import NormPlan
from .strategies import HybridClipping, L2Clipping, TwiceSampling
from .users import UserRows

__all__ = ["PrivateStep", "StepControls", "DeviceGenerators", "entropy_seed", "fresh_seeds", "run_seeds",
           "envelope_covers", "refuse_uncovered"]


class DeviceGenerators:
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

    @property
    def generators(self) -> list[torch.Generator]:
        """The generators made so far, one per device."""
        return list(self._generators.values())

    def reseed(self, seed: int) -> None:
        """Seed every generator made so far, and those made from now on, with ``seed`` (in place: whoever holds
        one of them draws from the new seed)."""
        self.seed = seed
        for g in self._generators.values():
            g.manual_seed(seed)


def entropy_seed() -> int:
    """A seed of 63 bits from ``os.urandom`` (the OS's CSPRNG); non-negative, so that
    :func:`~dpsgd.distributed.broadcast_int`'s int64 carries it."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def fresh_seeds() -> dict[str, int]:
    """A seed for each generator from ``os.urandom``, each drawn apart: those every rank must share (the
    noise, a scheme's global stream, the masks) are rank 0's draws, broadcast; the others are the rank's own.
    Every rank must call it (the broadcasts are collectives)."""
    shared = {name: broadcast_int(entropy_seed()) for name in ("stream", "noise", "mask")}
    return {"sampling": entropy_seed(), "projection": entropy_seed(), **shared}


def run_seeds(seed: int | None, rank: int, world: int) -> dict[str, int]:
    """The seeds of every generator of a run, by use: ``"sampling"`` (this rank's Poisson draws), ``"stream"`` (a
    batch-sampling scheme's global stream, the same on every rank), ``"projection"``, ``"noise"`` (the same on every
    rank) and ``"mask"``; from ``os.urandom`` (:func:`fresh_seeds`) or, in reproducibility mode, all derived from
    ``seed`` (rank 0's).  Every rank must call it (the broadcasts are collectives)."""
    if seed is None:
        return fresh_seeds()
    base = torch.Generator().manual_seed(broadcast_int(seed))
    drawn = torch.randint(2**62, (3 + world,), generator=base).tolist()
    return {"sampling": drawn[3 + rank], "stream": drawn[3], "projection": drawn[1] + rank,
            "noise": drawn[2], "mask": drawn[2] + 1}


def envelope_covers(charged: Envelope | None, planned: Envelope | None) -> bool:
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


def refuse_uncovered(plan: NormPlan, params, where: str) -> None:
    """``ValueError`` naming ``where`` if a parameter of ``params`` that the optimizer would step (trainable, or with
    a ``.grad``) is not one ``plan`` clips."""
    covered = {id(p) for p in plan.params}
    for p in params:
        if id(p) in covered:
            continue
        if p.requires_grad:
            raise ValueError(f"{where} holds a trainable parameter that is not in the private model "
                             f"({tuple(p.shape)}): every trained parameter must be clipped")
        if p.grad is not None:
            raise ValueError(f"{where} holds a frozen parameter ({tuple(p.shape)}) with a .grad the private backward "
                             f"did not make: the optimizer would step it unclipped; set its .grad to None")


@dataclass
class StepControls:
    """What only the engine that built a :class:`PrivateStep` may do with it, filled by the step's constructor: the
    private loader's callbacks (``on_batch`` as it yields a batch, ``check_empty`` before an empty batch's noise-only
    step), ``reseed`` (a resumed run's fresh generators) and ``set_checks`` (the row check's schedule).  None of
    them is a method a user of the step can call: a batch registered by hand, a seed chosen by hand or a drawn
    batch forgotten would each break the accounting."""

    on_batch: Callable | None = None
    check_empty: Callable | None = None
    reseed: Callable | None = None
    set_checks: Callable | None = None


class PrivateStep:
    """The step of one logical batch in progress (module docstring), for the model of ``plan``.

    Parameters
    ----------
    plan : NormPlan
        The model's norm plan (re-planned when the trainable parameters change, :meth:`follow_trainable`).
    accounting : RunAccounting
        What the run is accounted as: the clipping, the noise, ``C`` and the envelope the step must stay within.
    noise_multiplier : float
    expected_batch_size : float
        The divisor of the noisy sum (``q N``, or ``q_u U`` users).
    estimator, projection_dim, clipping_pass
        ``make_private``'s (the estimator as resolved).
    basis : torch.Tensor, optional
        ``gradient_projection``'s orthonormal basis.
    seeds : dict
        The seeds of the ``"projection"``, ``"noise"`` and ``"mask"`` generators.
    tracker : ExampleTracker
        Proves example isolation by structure while :attr:`track_examples`.
    user_rows : UserRows, optional
        With ``privacy_unit="user"``: which user each drawn row belongs to.
    admit, record : callable
        The engine's: ``admit()`` raises to refuse a step its calibration does not cover; ``record()`` charges a
        step in the ledger.  :meth:`noisy_gradients` calls both, so noisy gradients never exist uncharged.
    controls : StepControls
        Filled with the operations only the engine may use.
    """

    def __init__(self, plan: NormPlan, accounting: RunAccounting, *, noise_multiplier: float,
                 expected_batch_size: float, estimator: str, projection_dim: int, clipping_pass: str,
                 basis: torch.Tensor | None, seeds: dict[str, int], tracker: ExampleTracker,
                 user_rows: UserRows | None, admit: Callable[[], None],
                 record: Callable[[], None], controls: StepControls) -> None:
        self.plan = plan
        self._accounting = accounting
        self._noise_multiplier = noise_multiplier
        self._expected_batch_size = expected_batch_size
        self._estimator, self._projection_dim, self._clipping_pass = estimator, projection_dim, clipping_pass
        self._basis = basis
        self._admit, self._record = admit, record
        self._user_rows = user_rows
        self._projection_rngs = DeviceGenerators(seeds["projection"])
        # one generator per device, all seeded alike: the same noise on every rank (ranks of one GPU type draw the
        # same stream; the first step checks it), drawn where the parameters live (a CPU draw of a billion
        # coordinates, copied to the GPU, would cost seconds a step)
        self._noise_rngs = DeviceGenerators(seeds["noise"])
        self._mask_rngs = DeviceGenerators(seeds["mask"])   # twice sampling's masks, seeded like the noise
        self._noise_checked = False
        # correlated noise's memory of earlier steps (BandedNoise): held here only, as secret as the generator
        self._noise_stream = accounting.noise.stream()
        self._capture = Capture(plan)
        self._tracker = tracker
        self._track_examples = True
        self._capture.tracker = tracker
        self._used_ids: torch.Tensor | None = None   # examples whose losses this step backpropagated
        self._trainable = [(p, p.requires_grad) for p in plan.model.parameters()]
        step = weakref.ref(self)   # the model's hook does not keep the step alive

        def follow(_module, _args):
            if step() is not None and step().capture.recording():
                step().follow_trainable(strict=True)
        # after the capture's own root hooks: a refusal here leaves them balanced (their post-hooks always run)
        self._follow_handle = plan.model.register_forward_pre_hook(torch.compiler.disable(follow))
        self._released = False   # noisy_gradients made this step's gradients: end_step may close it
        self._reset()
        controls.on_batch, controls.check_empty = self._on_batch, self._check_empty
        controls.reseed, controls.set_checks = self._reseed, self._set_checks

    @property
    def capture(self) -> Capture:
        """The recorded forwards (:class:`~dpsgd.capture.Capture`) of the batch in progress."""
        return self._capture

    @property
    def tracker(self) -> ExampleTracker:
        """The isolation tracker (:class:`~dpsgd.isolation.ExampleTracker`)."""
        return self._tracker

    def _set_checks(self, check_every_step: bool, check_rate: float, track_examples: bool) -> None:
        """The row check's schedule and whether isolation is proved by structure (the engine's settings)."""
        self._capture.check_every_step, self._capture.check_rate = check_every_step, check_rate
        if not track_examples and self._track_examples:
            self.untrack()
        self._track_examples = track_examples
        self._capture.tracker = self._tracker if track_examples else None

    def _reseed(self, seeds: dict[str, int]) -> None:
        """Reseed the projection, mask and noise generators in place (a resumed run's)."""
        self._projection_rngs.reseed(seeds["projection"])
        self._mask_rngs.reseed(seeds["mask"])
        self._noise_rngs.reseed(seeds["noise"])
        self._noise_checked = False   # the first resumed step checks again that every rank drew the same noise

    def remove(self) -> None:
        """Remove the hooks from the model (the engine's ``detach``)."""
        self.untrack()
        self._capture.remove()
        self._follow_handle.remove()

    def _reset(self) -> None:
        """Forget the batch in progress (its draws, backwards and clipped sums)."""
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

    @staticmethod
    def sampling_ranks(sampling: L2Clipping | TwiceSampling | HybridClipping, plan: NormPlan,
                        max_grad_norm: float) -> list[int]:
        """Coordinates per group; every parameter in a group and the groups as the sampling requires (else
        ValueError)."""
        ranks = [0] * len(sampling.bounds(max_grad_norm))
        for p in plan.params:
            ranks[sampling.group_of(plan.names[id(p)])] += p.numel()
        sampling.check_groups(ranks, max_grad_norm)
        return ranks

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

    def check_covered(self, params, where: str) -> None:
        """The plan, following the model's trainable parameters, must clip every trainable one of ``params``
        (:func:`refuse_uncovered`)."""
        self.follow_trainable(strict=False)
        refuse_uncovered(self.plan, params, where)

    def follow_trainable(self, strict: bool) -> None:
        """Re-plan when parameters were frozen or unfrozen (``requires_grad``) since the plan was made: at each
        training forward (``strict``) and at ``zero_grad()`` and ``add_param_group`` (where a step's batch still
        in progress defers it to the next forward).

        The accountant charges every step with the envelope fixed at ``make_private``, so the new plan is taken
        only if that envelope still bounds its estimate (:func:`_envelope_covers`: fewer chi-square terms under
        ``hutch``, anything under exact norms as long as they stay exact); else ``RuntimeError``, naming the
        parameters, and nothing changes.  So are a ``gradient_projection`` (its basis spans the parameters of the
        first plan) and a change of the coordinates per group of twice sampling or hybrid clipping (their noise
        and accounting depend on them), and correlated noise (each parameter's noise continues its own)."""
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
        plan = NormPlan.build(model, self._estimator, self._projection_dim)   # the validator and sharding checks
        # the hooks of a unit on the model itself: inside the model's own forward, this call's set of them is fixed
        on_root = {id(p) for old_or_new in (self.plan, plan) for u in old_or_new.units if u.module is model
                   for p in u.params.values()}
        if strict and any(id(p) in on_root for p in changed):
            raise RuntimeError(f"{which}: a parameter of the model itself (not of a submodule) changed requires_grad "
                               f"after make_private; the engine follows that at optimizer.zero_grad(), not inside "
                               f"the model's forward. Call optimizer.zero_grad() before this forward (or move the "
                               f"parameter into a submodule)")
        envelope = plan.envelope(self._projection_dim)
        if not envelope_covers(self._accounting.envelope, envelope):
            raise RuntimeError(
                f"{which}: the model's trainable parameters changed after make_private, and under estimator "
                f"{self._estimator!r} the new plan's estimate needs the envelope {envelope!r}, which the "
                f"accountant's {self._accounting.envelope!r} (fixed at make_private, charged for every step) does not "
                f"bound, so the steps would be under-charged. Make those parameters trainable before make_private (or "
                f"set them back), use exact norms (estimator='ghost' or 'exact': accounted as DP-SGD whatever "
                f"trains), or train the new phase with a new PrivacyEngine (the two runs' epsilons and deltas add up)")
        if self._basis is not None:
            raise RuntimeError(f"{which}: the trainable parameters changed after make_private, but "
                               f"gradient_projection's basis spans the parameters of the first plan; use a new "
                               f"PrivacyEngine with a basis for the new ones")
        if self._noise_stream is not None:
            # a parameter frozen for some steps and unfrozen would continue its noise from older steps, so two
            # participations a band apart could fall within one band of its noise: the accounting's windows overlap
            raise RuntimeError(f"{which}: the trainable parameters changed after make_private, but "
                               f"noise={self._accounting.noise!r} correlates each parameter's noise with its noise of "
                               f"the last steps, which the accounting assumes every step; use a new PrivacyEngine for "
                               f"the new phase (the runs' epsilons add up)")
        ranks = self.sampling_ranks(self._accounting.clipping, plan, self._accounting.max_grad_norm)
        if self._accounting.clipping.per_coordinate and tuple(ranks) != self._accounting.ranks:
            # (one group's noise does not depend on its size, so l2 clipping follows any plan)
            raise RuntimeError(f"{which}: the trainable parameters changed after make_private, which changes the "
                               f"coordinates per group ({list(self._accounting.ranks)} to {ranks}) that "
                               f"{type(self._accounting.clipping).__name__}'s noise and accounting depend on; use a "
                               f"new PrivacyEngine")
        self._capture.replan(plan)
        self.plan = plan
        self._trainable = [(p, p.requires_grad) for p in model.parameters()]

    def backward(self, losses: torch.Tensor) -> None:
        recorded = self._recorded_examples()
        device = losses.device if isinstance(losses, torch.Tensor) else torch.device("cpu")
        twice = self._accounting.clipping if self._accounting.clipping.per_coordinate else None
        # user-level: the rows of the chunk the loader yielded, each with its user (never taken from the caller)
        groups = None if self._user_rows is None else self._user_rows.take(losses)
        padding = self._take_padding(losses)
        result = clipped_backward(self._capture, losses, self._accounting.max_grad_norm, self._projection_dim,
                                  self._projection_rngs(device),
                                  clipping_pass=self._clipping_pass, twice=twice,
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

    def untrack(self) -> None:
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
            self.untrack()
            raise error
        self._used_ids = examples if self._used_ids is None else torch.cat([self._used_ids, examples])

    def zero_grad(self) -> None:
        self.follow_trainable(strict=False)
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
        self._backpropagated = 0
        self._sums.clear()
        for p in self.plan.params:
            p.grad = None

    _drawn_twice = ("a batch was drawn from the private data loader before optimizer.step() of the batch drawn "
                    "before it: one noisy step per Poisson batch, or the accountant charges rate q for a step that "
                    "used more (two batches concatenated, a buffer of batches). Call optimizer.step() after every "
                    "batch (after optimizer.zero_grad() it takes a noise-only step for a batch you skip); split a "
                    "large batch with BatchMemoryManager; to stop early, stop before drawing the next batch.")

    def _check_empty(self) -> None:
        """Before the noise-only step of an empty Poisson batch: nothing of another batch may be pending."""
        if self._pending is not None:
            raise RuntimeError(self._drawn_twice)
        if self._backpropagated or self._sums:
            raise RuntimeError("an empty Poisson batch was drawn while a backward's clipped sums wait for step(); "
                               "call optimizer.step() after every batch")

    def begin_step(self) -> bool:
        """Close the batch's backwards (the tracker stops); ``False`` when this ``step()`` only accumulates (the
        memory manager's micro-batch that does not end its logical batch), ``True`` when the noisy step follows."""
        self.untrack()
        if self._skip_next:
            self._refuse_untrained_step()
            self._skip_next, self._last_skipped = False, True
            return False
        return True

    def noisy_gradients(self) -> None:
        """Refuse a step whose batch was not privately backpropagated whole (each refusal names the fix), then
        set every parameter's ``.grad`` to its noisy gradient: the clipped sums (zeros where no example reached),
        reduced over ranks, projected on ``gradient_projection``'s span, plus the noise, over the expected batch
        size.  Nothing is written if it raises.  The step is admitted before (the engine's calibration) and charged
        in the ledger as soon as the noisy gradients exist, before anything steps with them: whoever obtains them
        has a charged step (a wrapped optimizer that then fails over-counts one, on the safe side)."""
        self._admit()
        self._refuse_untrained_step()   # first: a plain backward's message names the fix
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
        divisor = self._expected_batch_size * self._accounting.clipping.coordinate_rate
        # one noise level per group (hybrid clipping's shape; else all equal)
        per_group = self._accounting.clipping.noise_stds(self._noise_multiplier, self._accounting.max_grad_norm,
                                                          self._accounting.ranks)
        std = [per_group[self._accounting.clipping.group_of(self.plan.names[id(p)])] for p in self.plan.params]
        try:   # in place: the clipped sums become the noisy gradients (no second parameter-sized buffer)
            noisy = noisy_gradients(sums, std, divisor, self._noise_rngs, params=self.plan.params,
                                    noise=self._accounting.noise, in_place=True, stream=self._noise_stream)
        except FloatingPointError:
            self._reset()   # the sums were overwritten: the batch is dropped, nothing was written
            raise
        if not self._noise_checked:   # replicated parameters' noisy gradients are equal on every rank
            first = next((g for p, g in zip(self.plan.params, noisy, strict=True) if not is_sharded(p)), None)
            try:
                check_same_on_ranks(0.0 if first is None else float(first.sum()),
                                    "the first step's noisy gradient (the noise generators are seeded alike on every "
                                    "rank, but GPUs of different types can draw different streams from one seed)")
            except ValueError:
                self._reset()
                raise
            self._noise_checked = True
        del sums
        self._sums = {}
        for i, p in enumerate(self.plan.params):
            p.grad = as_grad(p, noisy[i])   # the same tensor when p is float32; else one cast at a time
            noisy[i] = None
        self._record()
        self._released = True

    def end_step(self) -> None:
        """After the optimizer's step: the recorded forwards and the noisy gradients are dropped, and a new batch
        begins.  ``RuntimeError`` unless :meth:`noisy_gradients` made this step's gradients: a drawn batch is
        closed only by its charged step."""
        if not self._released:
            raise RuntimeError("end_step() without noisy_gradients(): a drawn batch ends only with its (charged) "
                               "noisy step; call optimizer.step()")
        self._released = False
        self._capture.clear()
        self._reset()
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

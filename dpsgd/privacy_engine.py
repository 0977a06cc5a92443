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
q)`` for ``exact``/``ghost``, ``SubsampledGaussian(sigma, q, envelope)`` for ``hutch``/``hutchpp``.
The envelope (:meth:`dpsgd.plan.NormPlan.envelope`) has dimension ``D``, the norm plan's chi-square
terms summed over every parameter (:meth:`dpsgd.plan.NormPlan.envelope_dimension`; ``python -m dpsgd plan``
prints it).  Exactly-computed parts are point masses in that
mixture, the ``d -> inf`` limit of the family, so with ``hutch`` they switch the envelope to that limit,
``max(F_{chi2(k)/k}, 1{x >= 1})`` (the :class:`~dpmath.HutchPPEnvelope` form).  Every step is recorded in
the ledger as its noisy gradients are made, before the wrapped optimizer steps with them: noisy gradients never
exist uncharged (:meth:`dpsgd.step.PrivateStep.noisy_gradients`).

Under ``torch.distributed`` (initialized before ``make_private``) each rank passes a loader over its own
shard; per-example norms and clipping stay local, the clipped sums are all-reduced, and the same noise
(one generator seeded identically on all ranks) is added once, so every rank takes the same step and the
noise has standard deviation ``sigma C`` in total.  Wrap nothing in ``DistributedDataParallel``.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import time
import warnings
import weakref

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpmath import (
    PLDAccountant,
    RDPAccountant,
)

from .accounting import Combination, RunAccounting, auto_estimator, check_combination, fixed_setting
from .arguments import checked_arguments, estimator_of, planned_steps, projection_basis
from .capture import DEFAULT_CHECK_RATE
from .distributed import check_same_on_ranks, is_sharded, rank_world
from .isolation import ExampleTracker
from .ledger import Ledger
from .loaders import private_loader
from .loss import DPCriterion, DPLoss
from .noise import GaussianNoise, StepNoise
from .optimizer import DPOptimizer
from .plan import NormPlan
from .samplers import BatchSampling, Poisson, as_batch_sampling, filled_loader
from .step import PrivateStep, StepControls, fresh_seeds, refuse_uncovered, run_seeds
from .strategies import HybridClipping, L2Clipping, TwiceSampling
from .users import UserRows, user_level
from .validator import per_token_experts, uncompiled

__all__ = ["PrivacyEngine"]


logger = logging.getLogger("dpsgd")

# the private step whose hooks each model carries (one engine's at a time)
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _refuse_hooked(module: nn.Module) -> None:
    """``RuntimeError`` if ``module`` carries the live hooks of another engine: two engines would record its calls
    twice."""
    holder = _STEPS.get(module)
    if holder is not None and holder() is not None and holder().capture.hooked:
        raise RuntimeError("this model already carries the hooks of another PrivacyEngine (a re-run notebook "
                           "cell?); two engines would record its calls twice. Call old_engine.detach() first, "
                           "or build the model again")


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
        self._track_examples = True   # isolation proved by structure; no public switch (tests and benchmarks only)
        self._controls = StepControls()   # what only this engine may do with its step
        self._ledger: Ledger | None = None   # the steps charged and their epsilon (make_private's)
        self._private_step: PrivateStep | None = None   # the batch in progress and its noisy step (make_private's)
        self._plan: NormPlan | None = None   # the first plan, until the step follows the model's
        self._noise_multiplier: float | None = None   # make_private's; read-only afterwards (see noise_multiplier)
        self._accounting: RunAccounting | None = None   # what the run is accounted as: make_private's, read-only
        self._ranks: list[int] = []   # coordinates per sampling group
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
        self._sealed = True   # from here on a public attribute the engine does not have is refused (__setattr__)


    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                     criterion: nn.Module | None = None, max_grad_norm: float, noise_multiplier: float | None = None,
                     target_epsilon: float | None = None, target_delta: float | None = None,
                     epochs: float | None = None, steps: int | None = None, estimator: str = "auto",
                     projection_dim: int = 32,
                     seed: int | None = None, clipping_pass: str = "bookkeeping",
                     gradient_projection: torch.Tensor | None = None, noise: StepNoise | str = "gaussian",
                     clipping: L2Clipping | TwiceSampling | HybridClipping | None = None,
                     privacy_unit: str = "example", user_ids=None, max_examples_per_user: int | None = None,
                     batch_sampling: BatchSampling | str = "poisson", grad_sample_mode: str | None = None,
                     ) -> tuple:
        r"""Make training private; give ``noise_multiplier`` or ``target_epsilon``, ``target_delta`` and one of
        ``epochs`` or ``steps``.

        Parameters
        ----------
        module, optimizer, data_loader
            Model, any torch optimizer over its trainable parameters, and a loader with a fixed
            ``batch_size`` (the expected batch size) over a sized dataset.
        criterion : torch.nn.Module or callable, optional
            A loss module with a ``reduction`` attribute, or a loss function that takes ``reduction=``
            (``F.cross_entropy``; called with ``reduction="none"``), returned made private; without one, the
            return is Opacus' 3-tuple and losses go through :meth:`private_loss`.
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
        clipping : L2Clipping, TwiceSampling or HybridClipping, optional
            How each example's contribution is clipped (:mod:`dpsgd.strategies`); ``None`` is
            :class:`~dpsgd.strategies.L2Clipping` (each example to l2 norm ``max_grad_norm``, DP-SGD's).
            :class:`~dpsgd.strategies.TwiceSampling` is twice sampling (paper 002, Alg. 2): inside each Poisson
            batch every coordinate of the clipped sum is formed from its own Poisson sub-sample of rate
            ``coordinate_rate``, with each example also clipped to l-infinity norm ``max_grad_coordinate``.
            The step divides by ``coordinate_rate`` times the expected batch size (an unbiased gradient).
            Accounted by :class:`dpmath.twice_sampling.TwiceSampledGaussian` (an RDP bound, so
            :meth:`accountant` is then an :class:`dpmath.RDPAccountant`).  It needs per-example gradients:
            exact norms (``estimator`` "ghost" or "exact"), Gaussian noise, the bookkeeping pass, no
            ``gradient_projection`` (a projection could break the l-infinity bound the accounting
            uses), one process.  :class:`~dpsgd.strategies.HybridClipping` (Thm 5.6) clips parameter groups to
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
            sampling, hybrid clipping, another ``batch_sampling`` or torch.distributed.  ``exact`` / ``ghost``
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
        grad_sample_mode : str, optional
            Opacus' name for how per-example gradients are found, mapped onto ``estimator``:
            :data:`~dpsgd.arguments.GRAD_SAMPLE_MODES` (``"hooks"``, ``"functorch"``, ``"ew"``: ``"exact"``;
            ``"ghost"``: ``"ghost"``; and this library's own ``"auto"``, ``"hutch"``, ``"hutchpp"``, ``"exact"``).
            Give it or ``estimator``, not both.

        Returns
        -------
        tuple
            ``(module, optimizer, criterion, data_loader)`` with a ``criterion``: the same module with hooks, a
            :class:`~dpsgd.optimizer.DPOptimizer`, a :class:`~dpsgd.loss.DPCriterion` and a
            :class:`~dpsgd.data.DPDataLoader`; without one, Opacus' ``(module, optimizer, data_loader)``, the
            per-example losses then made private by :meth:`private_loss`.

        Notes
        -----
        In order: the arguments are checked before anything is built; the norm plan must cover every parameter
        the optimizer steps; the generators are seeded from one seed shared by all ranks; the Poisson loader
        fixes the sampling rate; the noise is calibrated if a target is given; the settings are fixed (read-only
        from then on) and matched against the ledger file; only then are the model hooked and the optimizer and
        loss wrapped, so a refusal at any stage leaves the model untouched.
        """
        if self._private_step is not None:
            raise RuntimeError("this PrivacyEngine already made a model private; use a new PrivacyEngine")
        if seed is not None and self.secure_mode:
            raise ValueError(f"seed={seed!r} with secure_mode=True is refused: a seed makes the batches, projections, "
                             f"masks and noise reproducible by whoever holds it, and secure mode draws every one of "
                             f"them from os.urandom. Leave seed=None, or use secure_mode=False for a reproducible run")
        estimator = estimator_of(estimator, grad_sample_mode)
        noise, clipping, c, sigma = checked_arguments(
            optimizer, max_grad_norm, noise_multiplier, target_epsilon, target_delta, epochs, steps, estimator,
            projection_dim, clipping_pass, noise, clipping)
        users = user_level(privacy_unit, user_ids, max_examples_per_user)
        scheme = as_batch_sampling(batch_sampling)
        combination = Combination(estimator, noise, clipping, scheme, users=users is not None,
                                  clipping_pass=clipping_pass,
                                  projected=gradient_projection is not None, processes=rank_world()[1],
                                  ledger=self.ledger_path is not None,
                                  workers=int(getattr(data_loader, "num_workers", 0) or 0))
        if estimator == "auto":   # an estimate no accountant covers here: exact norms throughout
            estimator = auto_estimator(combination)
            combination = dataclasses.replace(combination, estimator=estimator)
        check_combination(combination)
        compiled, module = module, uncompiled(module)   # a torch.compile wrapper: hooks on the model it runs
        _refuse_hooked(module)
        plan = self._cover(module, optimizer, estimator, projection_dim, clipping, c)
        rank, world = rank_world()
        basis = None if gradient_projection is None else projection_basis(gradient_projection, plan.params, world)
        seeds = self._seed_generators(seed, rank, world)
        built = private_loader(data_loader, scheme, users, self._sampling_rng, stream_seed=seeds["stream"],
                               on_batch=self._on_batch, on_empty=self._empty_step)
        loader, bound, self._stream = built.loader, built.sampling, built.stream
        self.sample_rate, self.expected_batch_size = bound.sample_rate, built.expected_batch_size
        if users is not None:
            self.privacy_unit, self.max_examples_per_user = "user", users.max_examples_per_user
            self._user_rows = UserRows()
        if world > 1 and any(is_sharded(p) for p in plan.params):
            # FSDP2: every rank runs every step's forward and backward, which gather the sharded parameters
            # together, so a part of fewer than two examples is completed by filler rows weighted 0
            loader = filled_loader(loader, data_loader.collate_fn)
        self.estimator, self.projection_dim, self.max_grad_norm = estimator, projection_dim, c
        self.clipping_pass = clipping_pass
        self.envelope = plan.envelope(projection_dim)
        accounting = RunAccounting(
            sampling=bound, noise=noise, clipping=clipping, max_grad_norm=c, envelope=self.envelope,
            ranks=tuple(self._ranks), users=users, estimator=estimator,
            projection_dim=projection_dim)
        planned = None
        if sigma is None:
            planned = planned_steps(epochs, steps, len(loader))
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
        self._fix_settings(accounting, sigma, planned)
        optimizer, crit = self._attach(plan, module, optimizer, criterion, basis, seeds)
        if seed is not None:
            warnings.warn(f"make_private(seed={seed!r}) makes the run reproducible: its batches, projections, masks "
                          f"and noise are all derived from the seed, so the run offers no privacy against whoever "
                          f"holds the seed (its epsilon holds only for those who do not). Leave seed=None (the "
                          f"default) to seed them from os.urandom", UserWarning, stacklevel=2)
        if crit is None:   # Opacus' shape: losses go through private_loss (or pass a criterion)
            return compiled, optimizer, loader
        return compiled, optimizer, crit, loader

    def make_private_with_epsilon(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  data_loader: DataLoader, target_epsilon: float, target_delta: float,
                                  epochs: float | None = None, max_grad_norm: float, steps: int | None = None,
                                  **options) -> tuple:
        """Opacus' name for :meth:`make_private` with a target: the noise multiplier is calibrated so that after
        ``epochs`` (or ``steps``) the epsilon at ``target_delta`` is at most ``target_epsilon``; ``options`` are
        ``make_private``'s.

        Examples
        --------
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from dpsgd import PrivacyEngine
        >>> engine, model = PrivacyEngine(), nn.Linear(4, 2)
        >>> data = TensorDataset(torch.randn(100, 4), torch.randint(0, 2, (100,)))
        >>> model, opt, crit, loader = engine.make_private_with_epsilon(criterion=nn.CrossEntropyLoss(), module=model,
        ...     optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=10),
        ...     target_epsilon=3.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0, grad_sample_mode="ghost")
        >>> engine.planned_steps, engine.estimator
        (20, 'ghost')
        """
        return self.make_private(module=module, optimizer=optimizer, data_loader=data_loader,
                                 target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs, steps=steps,
                                 max_grad_norm=max_grad_norm, **options)

    def _cover(self, module: nn.Module, optimizer: torch.optim.Optimizer, estimator: str, k: int,
               clipping: L2Clipping | TwiceSampling | HybridClipping, max_grad_norm: float) -> NormPlan:
        """The model's norm plan (:attr:`plan`), its parameters' clipping groups, and the guarantee that every
        trainable parameter the optimizer steps is one the plan clips (``ValueError`` otherwise)."""
        plan = NormPlan.build(module, estimator, k)
        self._plan = plan
        self._ranks = PrivateStep.sampling_ranks(clipping, plan, max_grad_norm)
        refuse_uncovered(plan, [p for g in optimizer.param_groups for p in g["params"]], "optimizer")
        return plan

    def _seed_generators(self, seed: int | None, rank: int, world: int) -> dict[str, int]:
        """The seeds of every generator (:func:`~dpsgd.step.run_seeds`); the sampling generator is made here, the
        step makes the others from them and nothing keeps them."""
        seeds = run_seeds(seed, rank, world)
        self._sampling_rng = torch.Generator().manual_seed(seeds["sampling"])   # each rank samples its own shard
        return seeds

    def _reseed(self) -> None:
        """Reseed every generator from ``os.urandom`` in place (the loader keeps drawing from the same generator
        object): a resumed run's draws are predicted by nothing saved, and not by the run's seed either."""
        seeds = fresh_seeds()
        # a scheme's sampler draws one global stream on every rank; the Poisson and user samplers the rank's own
        self._sampling_rng.manual_seed(seeds["stream"] if self._stream is not None else seeds["sampling"])
        self._controls.reseed(seeds)

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

    def _fix_settings(self, accounting: RunAccounting, sigma: float, planned: int | None) -> None:
        """Fix the settings the step and the accountant share (read-only from here on) and the ledger's record of
        them, which a resumed run or a ledger file must match."""
        self._accounting = accounting
        self._noise_multiplier = sigma
        self.planned_steps = planned
        self._ledger = Ledger(accounting, sigma, planned, self.ledger_path, self._stream)

    def _attach(self, plan: NormPlan, module: nn.Module, optimizer: torch.optim.Optimizer,
                criterion: nn.Module | None, basis: torch.Tensor | None,
                seeds: dict[str, int]) -> tuple[DPOptimizer, DPCriterion | None]:
        """Hook the model (recording from here on; the model then belongs to this engine) and wrap the optimizer
        and the loss around the run's :class:`~dpsgd.step.PrivateStep`."""
        per_token_experts(module)
        # example isolation by structure: active from each batch the private loader yields to its backward
        tracker = ExampleTracker(state=lambda: {**{f"parameter {n}": p for n, p in module.named_parameters()},
                                                **{f"buffer {n}": b for n, b in module.named_buffers()}})
        step = PrivateStep(plan, self._accounting, noise_multiplier=self._noise_multiplier,
                           expected_batch_size=self.expected_batch_size, estimator=self.estimator,
                           projection_dim=self.projection_dim, clipping_pass=self.clipping_pass, basis=basis,
                           seeds=seeds, tracker=tracker, user_rows=self._user_rows,
                           admit=self._ledger.admit, record=self._ledger.record, controls=self._controls)
        self._controls.set_checks(self._check_every_step, self._check_rate, self._track_examples)
        self._private_step = step
        _STEPS[module] = weakref.ref(step)
        self._optimizer = DPOptimizer(optimizer, step, noise_multiplier=self._noise_multiplier,
                                      max_grad_norm=self.max_grad_norm, expected_batch_size=self.expected_batch_size)
        return self._optimizer, None if criterion is None else DPCriterion(criterion, step)

    def _on_batch(self, *args, **kwargs) -> None:
        """The private loader's call as it yields a batch (before make_private has built the step: refused)."""
        self._require_private()
        self._controls.on_batch(*args, **kwargs)

    def _empty_step(self) -> None:
        """The private loader's call for an empty Poisson batch: the noise-only step it is charged for."""
        self._require_private()
        self._controls.check_empty()
        self._optimizer.step()

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
        if name in PrivacyEngine.FIXED_SETTINGS and self.__dict__.get("_private_step") is not None:
            raise fixed_setting(name)
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
        self._set_checks()

    @property
    def check_rate(self) -> float:
        """Probability in ``[0, 1]`` that a step is checked (drawn from ``os.urandom`` at its forward); default
        0.125.  A check costs one extra backward without weight gradients (about 0.6 of a non-private step on
        the long-context benchmark).  A checked step catches a dependence of one example's loss on
        another given example's input or activations with probability at least 1/4 (a batch-wide statistic
        almost surely), so a violation present on ``m`` steps is missed with probability at most
        ``(1 - check_rate / 4)^m`` (0.042 for 100 steps, 7e-5 for 300, at the default rate; a
        batch-wide statistic about ``(1 - check_rate)^m``).  Isolation is proved on every step by structure
        (:mod:`dpsgd.isolation`), and ``check_rate = 0`` leaves the row check to a model's first step and
        each new layout of calls, where it checks each handler's per-example gradients against autograd."""
        return self._check_rate

    @check_rate.setter
    def check_rate(self, value: float) -> None:
        rate = float(value)
        if not 0 <= rate <= 1:
            raise ValueError(f"check_rate must lie in [0, 1] (use check_every_step=True for 1), got {value!r}")
        self._check_rate = rate
        self._set_checks()

    def _set_checks(self) -> None:
        if self._private_step is not None:
            self._controls.set_checks(self._check_every_step, self._check_rate, self._track_examples)

    @property
    def private_step(self) -> PrivateStep | None:
        """The step in progress (:class:`~dpsgd.step.PrivateStep`: the batch's recorded forwards, clipped sums and
        generators, none of which ever leaves the process), made by ``make_private`` (``None`` before it)."""
        return self._private_step

    @property
    def plan(self) -> NormPlan | None:
        """The model's norm plan (:class:`~dpsgd.plan.NormPlan`), following its trainable parameters; ``None``
        before ``make_private``."""
        return self._plan if self._private_step is None else self._private_step.plan

    @property
    def last_clipped_fraction(self) -> float:
        """The share of the last private backward's examples whose clip weight was below 1."""
        return 0.0 if self._private_step is None else self._private_step.last_clipped_fraction

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
    def batch_sampling(self) -> BatchSampling:
        """``make_private``'s ``batch_sampling`` (read-only): how each step's examples are chosen and accounted."""
        return Poisson() if self._accounting is None else self._accounting.sampling.scheme

    @property
    def clipping(self) -> L2Clipping | TwiceSampling | HybridClipping:
        """How each example's contribution is clipped, chosen in ``make_private`` (:class:`~dpsgd.strategies.L2Clipping`
        by default); the step and the accountant both follow it, so it cannot be changed afterwards."""
        return L2Clipping() if self._accounting is None else self._accounting.clipping

    @property
    def accounting(self) -> RunAccounting | None:
        """What the run is accounted as (:class:`~dpsgd.accounting.RunAccounting`: the mechanism, the accountant,
        the ledger's record), fixed by ``make_private`` (``None`` before it)."""
        return self._accounting


    def private_loss(self, losses: torch.Tensor) -> DPLoss:
        """A :class:`DPLoss` from your own ``(B,)`` per-example losses (e.g. a paired or DPO-style loss built
        from several forwards: every forward's contribution is counted).  Each loss must depend on its own
        example only (in-batch negatives would mix examples)."""
        self._require_private()
        return DPLoss(losses, self._private_step)

    def _require_private(self) -> None:
        if self._private_step is None:
            raise RuntimeError("call make_private(...) on this PrivacyEngine first")

    @property
    def steps(self) -> int:
        """Noisy steps of this run (from a resumed checkpoint on)."""
        return 0 if self._ledger is None else self._ledger.steps

    @property
    def spent_steps(self) -> int:
        """Noisy steps whose privacy is spent: this run's, or more where the ledger file (or an earlier state of this
        run) counted more."""
        return 0 if self._ledger is None else self._ledger.spent_steps

    def accountant(self) -> PLDAccountant | RDPAccountant:
        """A fresh accountant holding every step taken so far: a :class:`dpmath.PLDAccountant`, or with twice
        sampling a :class:`dpmath.RDPAccountant` (its mechanism has an RDP bound only).
        """
        self._require_private()
        return self._ledger.composed(self.spent_steps)

    def get_epsilon(self, delta: float, *, overcount: float = 0.0) -> float:
        """Upper bound on the epsilon spent so far at ``delta`` (0 before the first step).

        Each value is kept by step count and ``delta``, so asking again between steps is free.  A new step count costs
        one FFT pass of a :class:`dpmath.EpsilonSchedule` whose step PLDs and transform are built once per run (for
        :attr:`planned_steps`, or a power of two at least the steps taken, rebuilt when the steps pass it): after the
        first, about 10 ms for ``exact``/``ghost`` (2 ms where a grid 16 times coarser brackets it within ``1e-5``)
        and 20 to 40 ms for ``hutch`` at ``projection_dim=16`` (about 0.4 s at 8), where a fresh accountant took 0.5
        to 1.5 s.  The value is a certified upper bound like the fresh
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

        Examples
        --------
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from dpsgd import PrivacyEngine
        >>> engine, model = PrivacyEngine(), nn.Linear(4, 2)
        >>> data = TensorDataset(torch.randn(100, 4), torch.randint(0, 2, (100,)))
        >>> model, opt, crit, loader = engine.make_private(criterion=nn.CrossEntropyLoss(), module=model,
        ...     data_loader=DataLoader(data, batch_size=10), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        ...     max_grad_norm=1.0, noise_multiplier=1.0, estimator="exact")
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
        return self._ledger.epsilon(delta, overcount)

    def detach(self) -> None:
        """Remove the hooks from the model: it trains and evaluates as it did before ``make_private``."""
        if self._private_step is not None:
            self._private_step.remove()

    def state_dict(self) -> dict:
        """The ledger's count and the settings: ``{"settings": ..., "steps": ...}``, with ``"epochs"`` (the epochs
        charged) for an epoch sampler; plain numbers and strings only.

        No generator state: nothing in it predicts the batches, Hutchinson projections, twice sampling's masks or
        noise of any step, so a checkpoint file can be read by anyone without disclosing the clipped sums of the
        steps after it."""
        self._require_private()
        return self._ledger.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume: the settings must equal this engine's (else ValueError); the ledger continues, and every
        generator is reseeded from ``os.urandom`` (under torch.distributed, rank 0's draws where the ranks must
        agree: call it on every rank).

        The resumed run draws batches, projections, masks and noise that nothing saved predicts (and not the
        run's ``seed`` either), so it does not repeat the steps the interrupted run took after the checkpoint; its
        epsilon counts the same steps.  A state of an earlier version, which also held the generators' states,
        loads with a ``UserWarning``: those states are ignored.  A run with correlated noise
        (:class:`~dpsgd.noise.BandedNoise`) is refused: its noise depends on the earlier steps' noise, which is never
        saved."""
        self._require_private()
        noise = self._accounting.noise
        if noise.correlated and (int(state.get("steps", 0)) or self._ledger.steps
                                 or getattr(self._stream, "drawn", 0)):
            raise ValueError(f"a run with noise={noise!r} cannot be resumed: each step's noise is correlated with the "
                             f"earlier steps' noise, which stays in the process that drew it (a checkpoint holding it "
                             f"would disclose the noise of the steps to come), and fresh noise after the checkpoint "
                             f"would not be the accounted strategy's. Start a new run (the runs' epsilons add up)")
        self._ledger.load_state_dict(state)
        self._reseed()

r"""What a run is accounted as: one object, built once by ``make_private``, that the step's settings and the
accountant both come from.

A private run's guarantee is decided by a handful of choices: how each step's batch is drawn (a
:class:`~dpsgd.samplers.BatchSampling` bound to the data: Poisson by default), whose privacy it is (each example,
or each user's examples together: :mod:`dpsgd.users`), how each contribution is clipped (l2 to ``C``, or twice
sampling and hybrid clipping's coordinate masks and l-infinity bounds: :mod:`dpsgd.strategies`), the noise
(:mod:`dpsgd.noise`) and the estimator's envelope (:meth:`dpsgd.plan.NormPlan.envelope`; ``None`` with exact
norms).  :class:`RunAccounting` holds them and alone answers

* the dpmath mechanism of one accounted event (:meth:`~RunAccounting.mechanism`: a step, or an epoch for an epoch
  sampler) and how many events a number of steps charges (:meth:`~RunAccounting.events`);
* a fresh accountant for it (:meth:`~RunAccounting.accountant`: PLD, or RDP where the mechanism has an RDP bound
  only), and the calibration of the noise to a target (:meth:`~RunAccounting.calibrate`);
* the ledger's record of it (:meth:`~RunAccounting.record`, versioned by :data:`LEDGER_FORMAT`), which a resumed
  run or a ledger file must match (:func:`read_record` reads the records of every format so far).

Which combinations no accountant here covers is one table, :data:`REFUSED`, checked by :func:`check_combination`
before anything is built; ``estimator="auto"`` falls back to exact norms where the table refuses an estimate
(:func:`auto_estimator`).

Examples
--------
>>> from dpsgd.accounting import RunAccounting
>>> from dpsgd.noise import GaussianNoise
>>> from dpsgd.samplers import Poisson
>>> from dpsgd.strategies import L2Clipping
>>> run = RunAccounting(sampling=Poisson().bind(1000, 10), noise=GaussianNoise(), clipping=L2Clipping(),
...                     max_grad_norm=1.0, envelope=None)
>>> run.mechanism(1.0)
SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.01)
>>> round(run.accountant().compose(run.mechanism(1.0), 100).epsilon(1e-5), 3) > 0
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from dpmath import Envelope, PLDAccountant, RDPAccountant, calibrate_noise

from .noise import BandedNoise, BLTNoise, GaussianNoise, StepNoise
from .samplers import BatchSampling, BoundSampling, CyclicPoisson, Poisson
from .strategies import HybridClipping, L2Clipping, TwiceSampling
from .users import UserLevel

__all__ = ["RunAccounting", "Combination", "Refusal", "REFUSED", "check_combination", "auto_estimator",
           "LEDGER_FORMAT", "read_record", "fixed_setting"]

#: the ledger record's format: 2 is format 1's settings with ``"format"`` and without ``"poisson"`` (format 1's flag of
#: the unaccounted shuffled batches, which are gone)
LEDGER_FORMAT = 2

Clipping = L2Clipping | TwiceSampling | HybridClipping


@dataclass(frozen=True)
class Combination:
    """The choices of a run that decide whether an accountant here covers it (:data:`REFUSED`).

    Attributes
    ----------
    estimator : str
        ``make_private``'s estimator (``"auto"`` resolved).
    noise : StepNoise
    clipping : L2Clipping, TwiceSampling or HybridClipping
        ``make_private``'s ``sampling``: l2 clipping alone, or coordinate masks and l-infinity bounds.
    batch_sampling : BatchSampling
    users : bool
        ``privacy_unit="user"``.
    clipping_pass : str
    projected : bool
        A ``gradient_projection`` is given.
    processes : int
        The torch.distributed world size (1 without it).
    ledger : bool
        A ``ledger_path`` is given.
    workers : int
        The data loader's ``num_workers``.
    """

    estimator: str
    noise: StepNoise
    clipping: Clipping
    batch_sampling: BatchSampling
    users: bool = False
    clipping_pass: str = "bookkeeping"
    projected: bool = False
    processes: int = 1
    ledger: bool = False
    workers: int = 0

    @property
    def exact_norms(self) -> bool:
        """Whether every per-example norm is exact (``"exact"`` or ``"ghost"``)."""
        return self.estimator in ("exact", "ghost")

    @property
    def coordinates(self) -> str:
        """``clipping=TwiceSampling(...)`` or ``HybridClipping``, as the messages name it."""
        return f"clipping={type(self.clipping).__name__}(...)"

    @property
    def scheme(self) -> str:
        return f"batch_sampling={self.batch_sampling!r}"


class Refusal(NamedTuple):
    """A combination no accountant here covers: ``applies(c)`` says whether ``c`` is one, ``reason(c)`` why."""

    applies: Callable[[Combination], bool]
    reason: Callable[[Combination], str]


def _per_coordinate(c: Combination) -> bool:
    return c.clipping.per_coordinate


def _other_scheme(c: Combination) -> bool:
    return type(c.batch_sampling) is not Poisson


#: every combination refused, in the order they are checked (the first that applies is the error)
REFUSED: tuple[Refusal, ...] = (
    # coordinate masks and l-infinity clipping (paper 002): their RDP bound is for exact norms, Gaussian noise,
    # one process, the recorded per-example gradients, no projection
    Refusal(lambda c: _per_coordinate(c) and not c.exact_norms,
            lambda c: f"{c.coordinates} needs exact norms (estimator 'ghost' or 'exact'), got estimator="
                      f"{c.estimator!r}: the randomized-clipping envelope does not cover coordinate sampling or "
                      f"l-infinity clipping"),
    Refusal(lambda c: _per_coordinate(c) and type(c.noise) is not GaussianNoise,
            lambda c: f"{c.coordinates} is accounted for Gaussian noise only, got noise={c.noise!r}"),
    Refusal(lambda c: _per_coordinate(c) and c.clipping_pass != "bookkeeping",
            lambda c: f"{c.coordinates} forms the masked sums from the recorded per-example gradients: use "
                      f"clipping_pass='bookkeeping'"),
    Refusal(lambda c: _per_coordinate(c) and c.projected,
            lambda c: f"{c.coordinates} with gradient_projection is refused: the projection of a coordinate-clipped "
                      f"sum can exceed the l-infinity bound that its accounting uses"),
    Refusal(lambda c: _per_coordinate(c) and c.processes > 1,
            lambda c: f"{c.coordinates} is supported in a single process only"),
    # the noise's own accounting (Laplace: exact norms only)
    Refusal(lambda c: not _per_coordinate(c) and c.noise.refusal(c.estimator) is not None,
            lambda c: c.noise.refusal(c.estimator)),
    # users are Poisson-sampled, each user's gradient clipped once
    Refusal(lambda c: c.users and _per_coordinate(c),
            lambda c: "privacy_unit='user' cannot be combined with twice sampling or hybrid clipping "
                      "(clipping=TwiceSampling/HybridClipping): their accounting masks and clips each example's "
                      "gradient, not each user's"),
    # banded matrix-factorization noise is amplified by cyclic Poisson sampling only (dpmath.correlated)
    Refusal(lambda c: isinstance(c.noise, BandedNoise) and not (isinstance(c.batch_sampling, CyclicPoisson)
                                                                and c.batch_sampling.covers(c.noise)),
            lambda c: f"noise={c.noise!r} ({c.noise.strategy.bands} bands) is accounted under cyclic Poisson sampling "
                      f"with at least as many groups as bands only, got {c.scheme}: pass batch_sampling="
                      f"CyclicPoisson(groups={c.noise.strategy.bands}) (an example's participations must be a band "
                      f"apart, which no other sampling guarantees)"),
    Refusal(lambda c: c.noise.correlated and c.workers > 0,
            lambda c: f"noise={c.noise!r} with a data loader of num_workers={c.workers} is refused: worker processes "
                      f"draw batches ahead of the steps that use them, and a drawn batch that is never stepped would "
                      f"bring an example's participations closer than a band in the noise stream; use num_workers=0"),
    Refusal(lambda c: isinstance(c.noise, BLTNoise) and not isinstance(c.batch_sampling, CyclicPoisson),
            lambda c: f"noise={c.noise!r} is accounted under cyclic Poisson sampling only, got {c.scheme}: pass "
                      f"batch_sampling=CyclicPoisson(groups) (its participations' separation is what the accountant "
                      f"charges)"),
    # the other batch-sampling schemes (dpsgd.samplers)
    Refusal(lambda c: _other_scheme(c) and _per_coordinate(c),
            lambda c: f"{c.scheme} with clipping={type(c.clipping).__name__}(...) is refused: twice sampling is "
                      f"accounted for Poisson batches only"),
    Refusal(lambda c: _other_scheme(c) and c.users,
            lambda c: f"{c.scheme} with privacy_unit='user' is refused: users are Poisson-sampled"),
    Refusal(lambda c: _other_scheme(c) and getattr(c.batch_sampling, "pad", False) and c.processes > 1,
            lambda c: f"{c.scheme} is refused under torch.distributed: a rank's part of a padded global batch has "
                      f"no fixed size; use pad=False"),
    Refusal(lambda c: _other_scheme(c) and c.batch_sampling.per_epoch and c.ledger,
            lambda c: f"{c.scheme} with ledger_path is refused: its epochs are charged from the sampler's stream "
                      f"of batches, which a resumed run would restart"),
    Refusal(lambda c: _other_scheme(c) and not c.batch_sampling.covers(c.noise),
            lambda c: f"{c.scheme} is accounted for Gaussian noise only, got noise={c.noise!r}"),
)


def check_combination(combination: Combination) -> None:
    """``ValueError`` with the reason of the first :data:`REFUSED` entry that applies to ``combination``.

    Examples
    --------
    >>> from dpsgd.accounting import Combination, check_combination
    >>> from dpsgd.noise import LaplaceNoise
    >>> from dpsgd.samplers import Poisson
    >>> from dpsgd.strategies import L2Clipping
    >>> check_combination(Combination("hutch", LaplaceNoise(), L2Clipping(), Poisson()))
    Traceback (most recent call last):
    ...
    ValueError: LaplaceNoise needs exact norms (estimator 'ghost' or 'exact'), got estimator='hutch': ...
    """
    for refusal in REFUSED:
        if refusal.applies(combination):
            raise ValueError(refusal.reason(combination))


def auto_estimator(combination: Combination) -> str:
    """``estimator="auto"`` resolved for the rest of ``combination``: ``"auto"`` (the norm plan chooses per
    parameter) where an estimate is accounted, ``"ghost"`` (exact norms throughout) where :data:`REFUSED`
    refuses one."""
    hutch = dataclasses.replace(combination, estimator="hutch")
    return "auto" if not any(r.applies(hutch) for r in REFUSED) else "ghost"


@dataclass(frozen=True)
class RunAccounting:
    r"""What a run is accounted as (module docstring): its batch sampling bound to the data, the noise, the
    clipping, the clipping threshold and the estimator's envelope.

    Parameters
    ----------
    sampling : BoundSampling
        How each step's batch is drawn, bound to the data (Poisson at the loader's rate by default; for
        ``privacy_unit="user"``, users at the user rate ``q_u``).
    noise : StepNoise
    clipping : L2Clipping, TwiceSampling or HybridClipping
        l2 clipping alone (DP-SGD's), or twice sampling's coordinate masks and l-infinity bounds.
    max_grad_norm : float
        ``C``.
    envelope : Envelope or None
        The estimator's envelope (``None``: exact norms).
    ranks : tuple of int
        Coordinates per clipping group (twice sampling and hybrid clipping's noise and accounting use them).
    users : UserLevel, optional
        User-level privacy (:mod:`dpsgd.users`), recorded in the ledger.
    estimator, projection_dim
        Recorded in the ledger (the envelope is what the accountant reads).
    """

    sampling: BoundSampling
    noise: StepNoise
    clipping: Clipping
    max_grad_norm: float
    envelope: Envelope | None
    ranks: tuple[int, ...] = (1,)
    users: UserLevel | None = None
    estimator: str = "exact"
    projection_dim: int = 32

    @property
    def sample_rate(self) -> float:
        """The rate each example (or user) is drawn at, the ``q`` of the mechanism."""
        return self.sampling.sample_rate

    @property
    def poisson_batches(self) -> bool:
        """Whether batches are Poisson samples (of examples or users)."""
        return type(self.sampling.scheme) is Poisson

    def mechanism(self, noise_multiplier: float):
        """The dpmath mechanism of one accounted event (a step, or an epoch for an epoch sampler) at
        ``noise_multiplier``."""
        if self.clipping.per_coordinate:
            return self.clipping.mechanism(noise_multiplier, self.sample_rate, self.max_grad_norm, self.ranks)
        return self.sampling.mechanism(noise_multiplier, self.noise, self.envelope)

    def events(self, steps: int, sampler: object = None) -> int:
        """How many of :meth:`mechanism`'s events ``steps`` steps charge (an epoch sampler: the epochs its stream
        ``sampler`` has begun)."""
        return self.sampling.events(steps, sampler)

    def accountant(self) -> PLDAccountant | RDPAccountant:
        """A fresh accountant for :meth:`mechanism`: an :class:`dpmath.RDPAccountant` for twice sampling and hybrid
        clipping (an RDP bound is all their mechanisms have), else a :class:`dpmath.PLDAccountant` of the batch
        sampling's neighbouring relation."""
        if self.clipping.per_coordinate:
            return RDPAccountant()
        return self.sampling.accountant()

    def calibrate(self, target_epsilon: float, target_delta: float, steps: int) -> float:
        """The smallest ``noise_multiplier`` whose epsilon after ``steps`` steps is at most ``target_epsilon`` at
        ``target_delta`` (``ValueError`` if none is): the noise's own calibration for Poisson batches of
        examples, else a search over the accountant's epsilon of :meth:`events` ``(steps)`` events."""
        if self.poisson_batches and not self.clipping.per_coordinate:
            return self.noise.calibrate(target_epsilon, target_delta, self.sample_rate, steps, self.envelope)
        events, delta = self.events(steps), float(target_delta)
        return calibrate_noise(lambda s: self.accountant().compose(self.mechanism(s), events).epsilon(delta),
                               target_epsilon)

    def exact(self) -> RunAccounting:
        """The same run with exact norms (no envelope): what the estimate's noise is compared against."""
        return dataclasses.replace(self, envelope=None)

    def record(self, noise_multiplier: float) -> dict:
        """The ledger's record of the run at ``noise_multiplier``: plain numbers and strings, which a resumed run
        or a ledger file must match (a key only where it differs from the default, as format 1 wrote it)."""
        out = {"estimator": self.estimator, "k": self.projection_dim, "max_grad_norm": self.max_grad_norm,
               "noise_multiplier": noise_multiplier, "sample_rate": self.sample_rate}
        if self.noise.name != "gaussian":
            out["noise"] = self.noise.settings()
        if self.clipping.per_coordinate:
            out["sampling"] = self.clipping.settings()
        if self.users is not None:
            out.update(self.users.settings())
        if not self.poisson_batches:
            out["batch_sampling"] = self.sampling.scheme.settings()
        out["format"] = LEDGER_FORMAT
        return out


def fixed_setting(name: str) -> AttributeError:
    """The error of a setting changed after ``make_private``: the accountant charges every step at it."""
    return AttributeError(f"{name} is fixed by make_private: the accountant charges every step taken at its current "
                          f"value, so changing it mid-run would mis-charge the steps already taken; use a new "
                          f"PrivacyEngine")


def read_record(record: dict, where: str) -> dict:
    """A ledger or checkpoint record of any format so far, as :meth:`RunAccounting.record` writes it now: format 1
    (no ``"format"`` key) had the same settings and ``"poisson": True``; a format-1 run of unaccounted shuffled
    batches (``"poisson": False``) or a later format than this version reads is ``ValueError`` naming ``where``."""
    fmt = record.get("format", 1)
    if fmt == 1:
        if record.get("poisson") is not True:
            raise ValueError(f"{where} records a run of fixed-size shuffled batches that no accountant covered "
                             f"(poisson=False): it had no epsilon, and its steps cannot be charged now")
        return {**{k: v for k, v in record.items() if k != "poisson"}, "format": LEDGER_FORMAT}
    if fmt != LEDGER_FORMAT:
        raise ValueError(f"{where} was written in ledger format {fmt!r}, which this version of dpsgd does not read "
                         f"(it reads formats 1 to {LEDGER_FORMAT}); use the dpsgd that wrote it")
    return dict(record)

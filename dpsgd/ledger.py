r"""The run's ledger: the steps charged, the ledger file, and the epsilon of the steps taken.

A :class:`Ledger` is made by ``make_private`` from the run's :class:`~dpsgd.accounting.RunAccounting`, its noise
multiplier and the steps it was calibrated for.  The private step calls :meth:`Ledger.admit` before it draws the
noise (a calibrated run refuses a step beyond its plan) and :meth:`Ledger.record` as soon as the noisy gradients
exist, so every released step is charged; the file (``ledger_path``) gets one line per step, flushed to disk
before the step returns.  :meth:`Ledger.epsilon` answers ``PrivacyEngine.get_epsilon``: an
:class:`dpmath.EpsilonSchedule` built once per run, or a fresh accountant where that is what is certified.
"""

from __future__ import annotations

import json
import math
import os
import warnings

from dpmath import EpsilonSchedule, GridTooLargeError, PLDAccountant, RDPAccountant
from dpmath.pld import published_epsilon

from .accounting import RunAccounting, read_record
from .distributed import rank_world
from .validator import check_positive

__all__ = ["Ledger"]

# what a state_dict of an earlier version held besides the ledger: the generators' states, which predicted the
# batches, projections, masks and noise of the steps after the checkpoint
_GENERATOR_STATE_KEYS = ("sampling_rng", "projection_rngs", "mask_rngs", "noise_rngs", "noise_rng")


class Ledger:
    """The steps a run has charged and their epsilon.

    Parameters
    ----------
    accounting : RunAccounting
        What each step is accounted as.
    noise_multiplier : float
    planned_steps : int or None
        The steps the noise was calibrated for (``None``: not calibrated).
    path : str or os.PathLike, optional
        The ledger file: one line per step; a file of earlier runs is counted, and refused if its settings differ.
    stream : sampler, optional
        An epoch sampler's stream (the epochs it has begun are charged).
    """

    def __init__(self, accounting: RunAccounting, noise_multiplier: float, planned_steps: int | None,
                 path: str | os.PathLike | None = None, stream: object = None) -> None:
        self.accounting, self.noise_multiplier, self.planned_steps = accounting, noise_multiplier, planned_steps
        self.path, self.stream = path, stream
        self.settings = accounting.record(noise_multiplier)
        self.steps = 0        # noisy steps of this run (from a resumed checkpoint on)
        self._recorded = 0    # steps in the ledger file from earlier runs
        self._resumed = 0     # steps already counted by the checkpoint this run resumed from
        self._drawn_at_record = 0   # the stream's batches drawn when the last step was charged (correlated noise)
        self._epsilons: dict[tuple[int, int, float], float] = {}   # (steps, events charged, delta) -> epsilon
        self._schedule: EpsilonSchedule | None = None   # the steps and transforms of epsilon, built once
        self._read()

    def _read(self) -> None:
        if self.path is None or not os.path.exists(self.path):
            return
        with open(self.path) as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
        for rec in lines:
            if read_record(rec["settings"], f"ledger {self.path}") != self.settings:
                raise ValueError(f"ledger {self.path} was written with different privacy settings "
                                 f"({rec['settings']}); use a new ledger file")
        self._recorded = len(lines)

    @property
    def spent_steps(self) -> int:
        """Noisy steps whose privacy is spent: this run's, or more where the ledger file or an earlier state of this
        run counted more."""
        return max(self.steps, self._recorded + self.steps - self._resumed)

    def events(self, steps: int) -> int:
        """How many of the accounting's events ``steps`` steps charge (an epoch sampler: at or above the steps
        taken, also the epochs its stream has begun, batches drawn without a step included)."""
        return self.accounting.events(steps, self.stream if steps >= self.spent_steps else None)

    def admit(self) -> None:
        """``RuntimeError`` for a step beyond those the noise was calibrated for (steps, or an epoch sampler's
        epochs): the target epsilon holds for the calibrated count, never more.  With correlated noise, also for a
        step after a batch that was drawn and never stepped: the noise stream would fall behind the draws, and two
        participations a band apart in the draws would be closer in the noise (noise-only steps, which put the
        stream ahead, are fine)."""
        if self.accounting.noise.correlated and getattr(self.stream, "drawn", 0) - self._drawn_at_record > 1:
            raise RuntimeError(f"{self.stream.drawn - self._drawn_at_record - 1} batch(es) drawn from the cyclic "
                               f"sampler since the last step were never stepped (a refused draw or step, a draw "
                               f"around the loader, or batches drawn ahead): with noise="
                               f"{self.accounting.noise!r} every batch drawn must be stepped, in order, or an "
                               f"example's participations could fall within one band of the noise. Start a new "
                               f"PrivacyEngine")
        if self.planned_steps is None:
            return
        if self.spent_steps >= self.planned_steps:
            raise RuntimeError(f"the noise was calibrated for {self.planned_steps} steps (target_epsilon at "
                               f"target_delta) and they have all been taken; another step would spend more than "
                               f"the target. Calibrate for the steps you will run (make_private(steps=...)).")
        sampling = self.accounting.sampling
        if sampling.scheme.per_epoch and self.events(self.spent_steps) > sampling.events(self.planned_steps):
            raise RuntimeError(f"the noise was calibrated for {sampling.events(self.planned_steps)} epochs of "
                               f"{sampling.scheme!r} and this step's batch begins another (batches were drawn "
                               f"without a step); another step would spend more than the target")

    def record(self) -> None:
        """Charge one step (and write its line, on rank 0, flushed to disk)."""
        self.steps += 1
        self._drawn_at_record = getattr(self.stream, "drawn", 0)
        if self.path is not None and rank_world()[0] == 0:
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"step": self.steps, "settings": self.settings}) + "\n")
                fh.flush()
                os.fsync(fh.fileno())

    def composed(self, steps: int) -> PLDAccountant | RDPAccountant:
        """A fresh accountant holding ``steps`` steps of the run's mechanism."""
        acc = self.accounting.accountant()
        if steps:
            if self.noise_multiplier == 0:
                raise ValueError("noise_multiplier is 0: no privacy guarantee")
            acc.compose(self.accounting.mechanism(self.noise_multiplier), self.events(steps))
        return acc

    def epsilon(self, delta: float, overcount: float = 0.0) -> float:
        """``PrivacyEngine.get_epsilon`` (its docstring): the epsilon of the spent steps, or of the first count of the
        ``overcount`` grid at or above them, kept by count, events and ``delta``."""
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
        key = (steps, self.events(steps), float(delta))   # an epoch sampler's epochs move with its batches drawn
        if key not in self._epsilons:
            self._epsilons[key] = self._epsilon_at(steps, delta)
        return self._epsilons[key]

    def _epsilon_at(self, steps: int, delta: float) -> float:
        """The epsilon of ``steps`` steps: the run's :class:`dpmath.EpsilonSchedule`, or a fresh accountant at the
        calibrated count and where the accountant is not a plain :class:`dpmath.PLDAccountant`."""
        accountant = self.accounting.accountant()
        # a float bracket_rtol refines without a budget (the accountant's); the default "auto" and None: the schedule
        if (not isinstance(accountant, PLDAccountant) or isinstance(accountant.bracket_rtol, float)
                or not self.accounting.poisson_batches
                or steps == self.planned_steps or self.noise_multiplier == 0):
            # only the number is kept: the composed accountant holds hundreds of MB of loss grids.  A PLD accountant's
            # number is shared process-wide (at the calibrated count: the calibration's own last evaluation)
            accountant = self.composed(steps)
            if isinstance(accountant, PLDAccountant):
                return published_epsilon(accountant, delta)
            return accountant.epsilon(delta)
        mechanism = self.accounting.mechanism(self.noise_multiplier)
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
            return self.composed(steps).epsilon(delta)

    def state_dict(self) -> dict:
        """``{"settings": ..., "steps": ...}``, with ``"epochs"`` (the epochs charged) for an epoch sampler."""
        epochs = {} if not self.accounting.sampling.scheme.per_epoch else {
            "epochs": self.events(self.spent_steps)}   # an epoch sampler's epochs charged: the resumed stream's start
        return {"settings": dict(self.settings), "steps": self.steps, **epochs}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: its settings must equal these (else ``ValueError``); the steps known spent stay
        spent (a state older than steps this ledger counted moves this run's count, never the spent count down),
        and an epoch sampler's stream resumes after every epoch charged."""
        saved = read_record(state["settings"], "this checkpoint")
        if saved != self.settings:
            # keys of either side: a setting only one of them records (privacy_unit) is a difference too
            diff = {k: (saved.get(k), self.settings.get(k)) for k in sorted(saved.keys() | self.settings.keys())
                    if saved.get(k) != self.settings.get(k)}
            raise ValueError(f"checkpoint was made with different privacy settings (saved, now): {diff}")
        spent, epochs = self.spent_steps, self.events(self.spent_steps)
        self._recorded = spent
        self.steps = self._resumed = int(state["steps"])
        if self.accounting.sampling.scheme.per_epoch:
            # the next batch begins a new epoch after those charged, so none of them can see an example twice; the
            # new epoch's allocation or permutation is drawn afresh, not the interrupted run's: each epoch charged
            # is one epoch of its own sampler, whatever its draw, so the accounting is the same (the partial epoch
            # cut off by the checkpoint stays charged whole)
            self.stream.resume(max(int(state["epochs"]), epochs))
        old = sorted(k for k in _GENERATOR_STATE_KEYS if k in state)
        if old:
            warnings.warn(f"this state_dict, of an earlier version of dpsgd, holds generator states "
                          f"({', '.join(old)}); they are ignored: a resumed run reseeds every generator from "
                          f"os.urandom. That file predicts the noise of the steps after it: delete it, or keep it as "
                          f"private as the data", UserWarning, stacklevel=3)

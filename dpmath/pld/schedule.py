r"""Epsilon of one mechanism at every count up to a planned one: the steps built once, each count one FFT pass.

A fresh :class:`~dpmath.PLDAccountant` of ``n`` steps builds the step's upper and lower PLDs, then composes them.
Asked at many counts (a trainer logging epsilon), it would build the step again at each: a randomized-clipping
step's loss cap, where its grid ends, is chosen for the count (the mass beyond it, at most ``1e-15 / count`` a
step, moves to ``+inf``).  :class:`EpsilonSchedule` builds the step once, for the largest count ``N``, and reuses
it at every ``n <= N``:

* **The step for ``N`` is sound at every count.**  Its PLD holds the mass above the cap exactly (at the last grid
  point and at ``+inf`` for the upper bound, both masses preserved; at the last point for the lower bound: the
  losses only move up, resp. down), so it bounds the step whatever count it is composed at; the count only set
  how far the grid reaches.  ``n`` copies charge ``1 - (1 - p_inf)^n <= n p_inf <= (n / N) 10^{-15}``, less
  than the fresh accountant's ``10^{-15}``.
* **The step cut for delta.**  Its largest losses, at most ``10^{-6} delta / N`` of its mass, are moved to
  ``+inf`` (upper bound: ``n <= N`` copies add at most ``10^{-6} delta`` to ``delta(epsilon)``) or down to the
  last point kept (lower bound: the losses only shrink).  A randomized-clipping step's range is its scales'
  heavy tail, most of it holding ``10^{-15}`` of mass: the cut halves it at ``delta = 10^{-5}`` (hutch,
  ``k = 16``: 210 nats to 58 for ``N = 1000``), and with it the composition's window.
* **One FFT size for every count.**  The untilted window of ``n`` copies is never wider than that of ``N``
  (:class:`~dpmath.pld.compose.Spectra`; one that is, is computed afresh), so the step's transform at the size
  of ``N``'s window is computed once and each count costs its power, one inverse FFT, the error bound and the
  read-out.  The value is read from that untilted pass where it resolves the answer (error bounds above epsilon
  at most ``10^{-3}`` of delta, as the accountant asks of each of its passes); else the accountant's search over
  tilts runs on the same steps.

Both bounds stay on their side: every pass's answer is a bound (the error bounds charged), so the upper end is
never below the true epsilon and the lower end never above it.  They are not the fresh accountant's numbers:
both are bounds of the truth from different passes and steps.  The upper end is at most the fresh accountant's
upper end at ``delta (1 - 2 10^{-3})`` (the pass's ``10^{-3}`` and the cut's ``10^{-6}``, with room); measured,
it is 3e-7 relative above it for a subsampled Gaussian (a bracket of 1e-6 to 1e-5) and from 4e-6 below to 3e-4
above it for randomized clipping (a bracket of 1 to 2 %).
"""

from __future__ import annotations

import math

from ..accountant import Neighboring
from ..mechanisms import Mechanism
from ..validation import open_probability, positive_int
from .accountant import AUTO, AUTO_BUDGET, PLDAccountant
from .compose import CUT, Composition, Spectra, truncated
from .distribution import GridTooLargeError, Pld, mean_gap
from .steps import accounted_step, is_gaussian_step, one_pair, random_scale, reads_replacement, step_plds

__all__ = ["EpsilonSchedule"]

_LOOSE = 0.5    # a lower end below this fraction of the upper end is recomputed by a fresh accountant
_DELTAS = 4     # the deltas whose cut steps and transforms are kept
_FINER = 0.25   # a bracket wider than its target is intersected with a schedule on a grid this much finer (h^2: 1/16)
_AUTO_RTOL, _AUTO_RC_RTOL = 1e-3, 5e-3   # the default's targets, as the accountant's ...
_FINEST = 2.0 ** -16                      # ... and its finest loss step relative to the first grid
#: The default first asks a grid this many times coarser than its own, and takes that bracket where it is within
#: :data:`_COARSE_RTOL` (relative): about the width of the default grid's own bracket for a subsampled Gaussian
#: (1e-6 to 1e-5), so the upper end is no looser than that grid's would be, at a sixteenth of the points.
_COARSE, _COARSE_RTOL = 16, 1e-5


class EpsilonSchedule:
    r"""The certified epsilon of ``count`` runs of one mechanism, for every ``count`` up to ``max_count``, each
    after the first in one FFT pass.

    ``epsilon(count, delta)`` is an upper bound on

    .. math::

        \varepsilon(n, \delta) = \min\{\varepsilon \ge 0 : \max_{\text{direction}} \delta_n(\varepsilon)
        \le \delta\},\qquad \delta_n(\varepsilon) = p^{(n)}_\infty + \sum_j p^{(n)}_j (1 - e^{\varepsilon - t_j})_+,

    with ``p^{(n)}`` the ``n``-fold composition of the step's upper PLD, built once for ``max_count`` (the module
    docstring says why that is sound at every smaller count), and ``epsilon_bracket`` adds the lower bound from
    the lower PLD.  The first query of each neighbouring direction builds its step (a randomized-clipping step:
    about a second) and the transform; each later count costs one inverse FFT of the window of ``max_count``
    steps and the read-out: about 10 ms for a subsampled Gaussian (2 ms where the default's coarse grid answers,
    below), 20 to 40 ms for randomized clipping with
    ``HutchEnvelope(16, 64)`` (up to about 0.4 s with ``k = 8``'s heavier tail and wider window).  Values are kept
    by ``(count, delta)``.

    The bounds bracket the truth like :meth:`PLDAccountant.epsilon_bracket` on the same grid, though not with the
    same digits (see the module docstring).  A bracket wider than ``bracket_rtol`` (default: the accountant's
    ``"auto"`` target and budget) is intersected with finer schedules' brackets (:meth:`_refined`).  In
    :meth:`epsilon_bracket`, a lower end below half the upper end (a step whose losses sit below the grid,
    ``q mu < h``) is recomputed by a fresh accountant (its finer grid and two-scale curve) and intersected with
    this one (the lower end only, unless ``bracket_rtol=None``); a mechanism of Gaussian steps alone
    (:class:`~dpmath.Gaussian`, sample rate 1) is read out in the accountant's closed form, no grid.

    Parameters
    ----------
    mechanism : Mechanism
        The step, any the accountant accepts (composed as its accountant does: LAP2 as the subsampled Gaussian that
        dominates it, a sampling scheme as its dominating step).
    max_count : int
        The largest count asked (``>= 1``): the step's grid is chosen for it.
    discretization, neighboring, tail_mass
        As for :class:`PLDAccountant` (``neighboring="replace_one"`` refuses randomized clipping and LAP2 there).
    bracket_rtol : float, "auto" or None
        As for :class:`PLDAccountant`: ``"auto"`` (default) refines a bracket wider than 0.1 % on finer grids
        within the default's budget, each finer schedule built once for every count (``_refined``); ``None`` keeps
        the one grid.  The default first asks a grid 16 times coarser (a subsampled Gaussian, not randomized
        clipping) and answers with its bracket where that is within ``1e-5`` relative, about this grid's own
        width: a trainer's run of tens of steps at ``q = 1/4`` then costs about 2 ms a count instead of 20.
        :meth:`epsilon` is then :meth:`epsilon_bracket`'s upper end.

    Examples
    --------
    >>> from dpmath import PLDAccountant, SubsampledGaussian
    >>> from dpmath.pld import EpsilonSchedule
    >>> step = SubsampledGaussian(1.0, 0.01)
    >>> schedule = EpsilonSchedule(step, max_count=1000)
    >>> [round(schedule.epsilon(n, 1e-6), 4) for n in (10, 100, 1000)]
    [0.5924, 0.9542, 2.1245]
    >>> lo, hi = PLDAccountant().compose(step, 100).epsilon_bracket(1e-6)
    >>> s_lo, s_hi = schedule.epsilon_bracket(100, 1e-6)
    >>> bool(lo <= s_hi <= hi * (1 + 1e-5) and s_lo <= hi)
    True
    """

    def __init__(self, mechanism: Mechanism, max_count: int, *, discretization: float = 1e-4,
                 neighboring: Neighboring | str = Neighboring.ADD_OR_REMOVE, tail_mass: float = 1e-18,
                 bracket_rtol: float | str | None = AUTO) -> None:
        n_max = positive_int(max_count, "max_count")
        # the accountant checks the settings and the mechanism (and refuses what it refuses) for us
        checked = PLDAccountant(discretization, neighboring, tail_mass=tail_mass,
                                bracket_rtol=bracket_rtol).compose(mechanism, n_max)
        self.mechanism = mechanism
        self.max_count = n_max
        self.discretization = checked.discretization
        self.neighboring = checked.neighboring
        self.tail_mass = checked.tail_mass
        self.bracket_rtol = checked.bracket_rtol
        self._root = self.discretization   # the first schedule's grid: finer ones stop at root / 64
        self._finer: list[EpsilonSchedule] = []   # the schedule on the grid _FINER times this one, once built
        self._coarse: EpsilonSchedule | None = None   # the default's first try, _COARSE times coarser, once built
        # a count of an epoch of k participations is k counts of the epoch of one that dominates it (as composed)
        base, self._per_run = mechanism.decomposed()
        step = self._step = accounted_step(base, self.neighboring)
        # the accountant's closed form, no grid; a charged truncated step's overflow is the accountant's read-out
        self._closed = is_gaussian_step(step) or base.charged
        # randomized clipping's scale-grid factor: the accountant's first grid's; and whether one run is read in
        # closed form (one randomized-clipping step), decided once by the accountant
        self._scale = checked.first_grid[1]
        self._closed_one = PLDAccountant(discretization, neighboring, tail_mass=tail_mass,
                                         bracket_rtol=bracket_rtol).compose(mechanism, 1).closed_form
        if reads_replacement(base, self.neighboring):
            self._relations: tuple[str, ...] = ("replace",)
        else:   # with q = 1 adding and removing an example are the same pair: one direction serves both
            self._relations = ("remove",) if one_pair(step) else ("remove", "add")
        self._plds: dict[str, list[Pld]] = {}           # relation -> [upper, lower] step PLDs for max_count
        self._gap: float | None = None                  # the steps' largest relative mean gap (:meth:`_narrow`)
        # (relation, upper, delta) -> the step cut for delta (truncated) and its shared transforms
        self._cut: dict[tuple[str, bool, float], tuple[Pld, Spectra | None]] = {}
        # (count, delta, upper) -> the bound and the FFT work its passes read (Composition.work, cached or not)
        self._values: dict[tuple[int, float, bool], tuple[float, int]] = {}

    @classmethod
    def for_accountant(cls, accountant: PLDAccountant, mechanism: Mechanism, max_count: int) -> EpsilonSchedule:
        """The schedule with ``accountant``'s grid, neighbouring relation, tail mass and ``bracket_rtol`` (its events
        play no part).

        Examples
        --------
        >>> from dpmath import PLDAccountant, SubsampledGaussian
        >>> from dpmath.pld import EpsilonSchedule
        >>> EpsilonSchedule.for_accountant(PLDAccountant(1e-3), SubsampledGaussian(1.0, 0.01), 50)
        EpsilonSchedule(SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.01), max_count=50, discretization=0.001)
        """
        return cls(mechanism, max_count, discretization=accountant.discretization,
                   neighboring=accountant.neighboring, tail_mass=accountant.tail_mass,
                   bracket_rtol=accountant.bracket_rtol)

    def __repr__(self) -> str:
        return (f"EpsilonSchedule({self.mechanism!r}, max_count={self.max_count}, "
                f"discretization={self.discretization!r})")

    def _fresh(self, count: int) -> PLDAccountant:
        return PLDAccountant(self.discretization, self.neighboring, tail_mass=self.tail_mass,
                             bracket_rtol=self.bracket_rtol).compose(self.mechanism, count)

    def _checked(self, count: int, delta: float) -> tuple[int, float]:
        n = positive_int(count, "count")
        if n > self.max_count:
            raise ValueError(f"count must be at most max_count={self.max_count} (the step's grid is chosen for it), "
                             f"got {n}; build a schedule with a larger max_count")
        return n, open_probability(delta, "delta")

    def _steps(self, relation: str) -> list[Pld]:
        """The step's upper and lower PLDs in the direction ``relation``, for :attr:`max_count` (built once, both
        bounds at once: they share the step's CDF evaluations)."""
        if relation not in self._plds:
            self._plds[relation] = step_plds(self._step, relation, self.discretization, (True, False),
                                             self.max_count * self._per_run, self._scale)
        return self._plds[relation]

    def _narrow(self, target: float) -> bool:
        """Whether in every direction the step's upper and lower PLDs have means within ``target / 8`` of each other
        (relative): a composed bracket's loss-grid width is then about that or less (at most 1.3 times the gap on
        seven settings from ``q = 1e-3`` to ``q = 0.5``), so no finer grid could be needed and the lower end need not
        be computed to know it.  A property of the step alone, so an upper end never depends on the counts asked
        before it."""
        if self._gap is None:
            self._gap = max(mean_gap([(up, 1)], [(lo, 1)]) for up, lo in map(self._steps, self._relations))
        return self._gap <= target / 8

    def _composition(self, relation: str, upper: bool, count: int, delta: float) -> Composition:
        """``count`` copies of the step (built for ``max_count``, cut for ``delta``) in the direction ``relation``,
        on the shared transform."""
        key = (relation, upper, delta)
        if key not in self._cut:
            if len(self._cut) >= 2 * len(self._relations) * _DELTAS:
                self._cut.pop(next(iter(self._cut)))
            most = self.max_count * self._per_run
            step = truncated(self._steps(relation)[0 if upper else 1], CUT * delta / most)
            spectra = None
            if most > 1:
                try:   # the window of max_count copies: no smaller count's is wider
                    largest = Composition([(step, most)], self.tail_mass)
                    spectra = Spectra(largest.hi - largest.lo + 1)
                except GridTooLargeError:   # the largest count needs too many points: each count on its own
                    pass
            self._cut[key] = (step, spectra)
        step, spectra = self._cut[key]
        return Composition([(step, count * self._per_run)], self.tail_mass, spectra=spectra)

    def _direction(self, relation: str, upper: bool, count: int, delta: float) -> tuple[float, int]:
        """One direction's bound: the untilted pass's where it resolves the answer, else the tightest of it and
        the accountant's tilt search (both bounds on the same side); and the FFT work its passes read."""
        comp = self._composition(relation, upper, count, delta)
        eps, resolved = comp.pass_epsilon(delta)
        if resolved:
            return eps, comp.work
        searched = comp.epsilon(delta)
        return (min(eps, searched) if upper else max(eps, searched)), comp.work

    def _bound(self, count: int, delta: float, upper: bool) -> float:
        """The worse direction's bound, as the accountant takes it: the first direction's, then only the
        directions whose ``delta`` there could exceed ``delta`` (a Chernoff bound on their upper composition at
        most ``delta`` means their true epsilon is at most this one's, so the maximum is unchanged)."""
        key = (count, delta, upper)
        if key not in self._values:
            first, work = self._direction(self._relations[0], upper, count, delta)
            out = [first]
            for relation in self._relations[1:] if first < math.inf else ():
                if self._composition(relation, True, count, delta).delta_bound(first) > delta * (1.0 - 1e-6):
                    value, more = self._direction(relation, upper, count, delta)
                    out.append(value)
                    work += more
            self._values[key] = (max(out), work)
        return self._values[key][0]

    def _refined(self, count: int, delta: float, lower: bool = True) -> tuple[float, float]:
        """The bracket refined as the accountant's ``bracket_rtol`` asks (``"auto"`` or a float): where it is wider
        than the target, intersected with the bracket of a schedule on a grid ``_FINER`` times this one's, built
        once and kept for every later count, while its passes are predicted to read at most
        :data:`~dpmath.pld.accountant.AUTO_BUDGET` points (this grid's work for the count, over ``_FINER``), down to
        ``2^-16`` of the first schedule's grid (a float ``bracket_rtol``: any cost down to ``1/64`` of it, cheap
        grids beyond).  A fixed factor, so the brackets do not depend on
        the order of the queries.  Randomized clipping keeps its grid: its width is mostly the scale grid's, and a
        refined step costs seconds, beyond the default's budget (the accountant's refinement stops there too).
        The default also keeps its grid where the step's bounds are narrow (:meth:`_narrow`: the bracket's width is
        then far below the target, so its lower end is not computed just to show that).
        Without ``lower``, the lower end is computed only where a finer schedule may be built (its width decides), so
        the upper end is the same number either way."""
        rc = random_scale(self._step)
        # (a grid coarser than a loss step of 1, the accountant's largest, is not tried)
        if self.bracket_rtol == AUTO and not rc and self._root == self.discretization \
                and self.discretization * _COARSE <= 1.0:
            coarse = self._coarsened(count, delta)
            if coarse is not None:
                return coarse
        hi = self._bound(count, delta, True)
        target = self.bracket_rtol if isinstance(self.bracket_rtol, float) else (_AUTO_RC_RTOL if rc else _AUTO_RTOL)
        h = self.discretization * _FINER
        # the finer grid's predicted work: the upper end's, twice (the lower end's is about as much), over _FINER
        cheap = 2 * self._values[(count, delta, True)][1] / _FINER <= AUTO_BUDGET
        finer = not (rc or not 0 < hi < math.inf or h < self._root * _FINEST
                     or self.bracket_rtol == AUTO and self._narrow(target)
                     or not cheap and (self.bracket_rtol == AUTO or h < self._root / 64 * (1 - 1e-9)))
        if not (lower or finer):   # no width could be acted on: epsilon alone needs no lower end
            return 0.0, hi
        lo = min(self._bound(count, delta, False), hi)
        if not finer or hi - lo <= target * hi:
            return lo, hi
        if not self._finer:
            child = EpsilonSchedule(self.mechanism, self.max_count, discretization=h, neighboring=self.neighboring,
                                    tail_mass=self.tail_mass, bracket_rtol=self.bracket_rtol)
            child._root = self._root
            self._finer.append(child)
        try:
            f_lo, f_hi = self._finer[0]._refined(count, delta, lower)
        except GridTooLargeError:   # the finer grid needs too many points: this grid's bracket stands
            return lo, hi
        # both brackets hold the truth, so their intersection does
        return max(lo, f_lo), min(hi, f_hi)

    def _coarsened(self, count: int, delta: float) -> tuple[float, float] | None:
        """The bracket on a grid :data:`_COARSE` times coarser, where it is within :data:`_COARSE_RTOL` of its upper
        end; else ``None``.  Both ends are bounds of the truth whatever the grid, so the answer is as sound as this
        grid's; asked for every count afresh (never skipped after a wide one), so the answers do not depend on the
        order of the queries.  Randomized clipping keeps its grid (its bracket's width is its scale grid's)."""
        if self._coarse is None:
            self._coarse = EpsilonSchedule(self.mechanism, self.max_count, discretization=self.discretization * _COARSE,
                                           neighboring=self.neighboring, tail_mass=self.tail_mass, bracket_rtol=None)
        try:
            hi = self._coarse._bound(count, delta, True)
            if not 0 < hi < math.inf:
                return None
            lo = min(self._coarse._bound(count, delta, False), hi)
        except GridTooLargeError:
            return None
        return (lo, hi) if hi - lo <= _COARSE_RTOL * hi else None

    def epsilon(self, count: int, delta: float) -> float:
        """Upper bound on ``epsilon(delta)`` after ``count`` runs of the mechanism (``1 <= count <= max_count``).

        Examples
        --------
        >>> from dpmath import SubsampledGaussian
        >>> from dpmath.pld import EpsilonSchedule
        >>> round(EpsilonSchedule(SubsampledGaussian(1.0, 0.01), 1000).epsilon(1000, 1e-6), 4)
        2.1245
        """
        n, d = self._checked(count, delta)
        if self._closed or (n == 1 and self._closed_one):
            return self._fresh(n).epsilon(d)
        if self.bracket_rtol is None:
            return self._bound(n, d, True)
        return self._refined(n, d, lower=False)[1]

    def epsilon_bracket(self, count: int, delta: float) -> tuple[float, float]:
        """``(lower, upper)`` bounds on ``epsilon(delta)`` after ``count`` runs (``1 <= count <= max_count``).

        Examples
        --------
        >>> from dpmath import SubsampledGaussian
        >>> from dpmath.pld import EpsilonSchedule
        >>> lo, hi = EpsilonSchedule(SubsampledGaussian(1.0, 0.01), 1000).epsilon_bracket(1000, 1e-6)
        >>> bool(lo <= 2.1245 <= hi < lo + 1e-4)
        True
        """
        n, d = self._checked(count, delta)
        if self._closed or (n == 1 and self._closed_one):
            return self._fresh(n).epsilon_bracket(d)
        if self.bracket_rtol is None:
            hi = self._bound(n, d, True)
            lo = min(self._bound(n, d, False), hi)
        else:
            lo, hi = self._refined(n, d)
        if hi > 0 and lo < _LOOSE * hi:
            # the losses sit below the grid: the accountant's finer grid and two-scale curve; both brackets hold
            # the truth, so their intersection does (refined: the lower end only, so that the upper end stays
            # epsilon's, the number published)
            f_lo, f_hi = self._fresh(n).epsilon_bracket(d)
            lo, hi = max(lo, f_lo), (hi if self.bracket_rtol is not None else min(hi, f_hi))
        return lo, hi

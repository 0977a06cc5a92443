r"""The privacy-loss-distribution (PLD) accountant.

:class:`PLDAccountant` composes :mod:`dpmath.mechanisms` on a grid of privacy losses and reads out
``epsilon(delta)``, ``delta(epsilon)`` and the f-DP trade-off curve.  Every number comes in two
versions computed side by side: an **upper** bound (default; connect-the-dots discretization,
truncated mass charged to delta, the envelope discretized toward larger scales) and an optimistic
**lower** bound, so that ``epsilon_bracket`` shows how much the discretization costs.  The layers below it
(:mod:`dpmath.pld`) say how each bound is built and why it is sound.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
from numpy.typing import ArrayLike

from ..accountant import Accountant, Neighboring
from ..mechanisms import MECHANISMS, Mechanism, SubsampledGaussian
from ..validation import non_negative, open_probability, positive_int, probability_array, real_number
from .compose import TILT_BINS, Composition, tilt_bin
from .distribution import GridTooLargeError, Pld, mean_gap
from .gaussian import GaussianCurve
from .scale_mixture import ScaleMixtureCurve
from .steps import (
    accounted_step,
    is_gaussian_step,
    one_pair,
    random_scale,
    reads_replacement,
    scale_atoms,
    step_kind,
    step_plds,
)
from .two_scale import TwoScaleLower

__all__ = ["AUTO_SCALE_START", "PLDAccountant", "published_epsilon"]

_RC_WIDE = 1e-2         # a randomized-clipping bracket_rtol below this starts on a finer grid (_refined)
#: ``bracket_rtol``'s default: refine to 0.1 % (0.5 % with randomized clipping) within :data:`AUTO_BUDGET`.
AUTO = "auto"
_AUTO_RTOL = 1e-3       # the default's target width, DP-SGD-type mechanisms ...
_AUTO_RC_RTOL = 5e-3    # ... and with randomized clipping (whose scale grid makes each grid dearer)
#: The grid points the default's refinement may spend per query, all grids counted (``_refined``): about a second on
#: the project's 2-core machine.
AUTO_BUDGET = 1 << 23
#: The default's first scale-grid factor with randomized clipping: its scale step is the envelope's ``scale_resolution``
#: times this (the first grid is 0.25 to 1 % wide on the benchmark's multi-step cases, 0.5 to 1.1 % at the factor 1;
#: half the scale step keeps a randomized-clipping calibration within 2 s, a quarter did not).
AUTO_SCALE_START = 0.5
#: A randomized-clipping query's FFT points and scale atoms together may cost this many times its FFT budget, the FFT
#: points alone at most the budget: once heavy tails are split (:class:`~dpmath.pld.compose.OneLargeLoss`) the atoms
#: dominate the cost.  At Hutch k 8, d 1024, 72 steps the first grid (3,870 atoms) and the split's (the same atoms on
#: h / 2) leave the scale grid's refinement 14,010 atoms: 3 budgets reach it (0.20 %), 2 stopped at 0.73 %; no grid
#: holds more points than before.
_RC_ATOMS = 3
_ATOM_POINTS = 1024     # a randomized-clipping step's cost per scale atom, in composition grid points
_MIXTURE_FINEST = 1 / 64    # a single randomized-clipping step's finest closed-form curve (HutchEnvelope(2, 5): 151,140
                            # atoms, 12 s)
_MIXTURE_ATOMS = 25_000     # the default's finest closed-form curve has at most about this many atoms (2 s)
_LOWER_STEPS = (0.95, 0.9)    # the finer loss steps (times h) a fixed-scale lower composition may move to ...
_LOWER_POINTS = 1 << 19       # ... where its steps hold at most this many points
_RUNGS = 2              # a refined loss step is h0 2^(-k / _RUNGS): the queries of one accountant share grids
_SCALE_RUNGS = 16       # ... and a refined scale factor 2^(-k / _SCALE_RUNGS) (its cost grows like 1 / s: finer rungs)
_AGREE_RTOL = 1e-10     # epsilon's first nudge toward its own delta read-out (_agreeing), then 10 times more each
_FINEST = 2.0 ** -16    # the finest loss step, relative to discretization (below 1/64 only on grids within budget)
_COARSER = 64.0         # an infinite upper end retries on a loss grid this much coarser, up to a step of 1 ...
_COARSER_TRIES = 3      # ... this many times
# directions read: replacing one example reads most steps once ("replace"), but fixed-size and shuffled batches
# as their dominating step's removing and adding pairs (steps.reads_replacement), so it has two directions too
_NEIGHBORING = {Neighboring.ADD_OR_REMOVE: ("remove", "add"), Neighboring.REPLACE_ONE: ("remove", "add")}


#: The most runs of one mechanism :meth:`PLDAccountant.compose` takes (its counts are used as floats).
MAX_COUNT = 10**18

class PLDAccountant(Accountant):
    r"""Privacy-loss-distribution accountant with FFT composition and a [lower, upper] bracket.

    Mechanisms are composed with :meth:`compose`; queries (:meth:`epsilon`, :meth:`delta`,
    :meth:`tradeoff`) return the **upper** bound, the sound number to publish, and the ``*_bracket``
    methods return ``(lower, upper)``.  Both neighbouring directions are tracked (an example added,
    an example removed) and the worse one is reported; ``neighboring="replace_one"`` uses the
    substitution pair instead.

    The curve read out is the hockey-stick divergence of the composed discrete PLD,

    .. math::

        \delta(\varepsilon) = \max_{\text{direction}}\Big(p_\infty +
        \sum_j p_j\,(1 - e^{\varepsilon - t_j})_+\Big),\qquad
        \beta(\alpha) = \min_{\text{direction}} \sup_\varepsilon \big(1 - \delta(\varepsilon)
        - e^{\varepsilon}\alpha\big),

    exact for the discrete distributions (no root-finding error), with ``t_j = j h``.  An accountant that holds
    only Gaussian steps (:class:`~dpmath.Gaussian`, or a sample rate of 1) has no grid: its curves are the composed
    Gaussian's closed form (:mod:`dpmath.pld.gaussian`), bracketed by the nearest floats, at any noise level.

    Parameters
    ----------
    discretization : float
        Grid step ``h`` of the privacy loss, in ``(0, 1]`` (default ``1e-4``).  The upper bound's error
        shrinks like ``h^2`` per step (connect-the-dots); the composed grid grows like ``1/h``.
    neighboring : Neighboring or {"add_or_remove", "replace_one"}
        Neighbouring relation (:class:`~dpmath.Neighboring`, or its value).
    tail_mass : float
        Mass cut from each side whenever a composition is truncated, in ``(0, 1e-6]`` (default
        ``1e-18``); the upper bound charges it to delta.
    bracket_rtol : float, "auto" or None
        How tight each query's bracket is.  ``"auto"`` (default): refine the grid until ``upper - lower <=
        1e-3 * upper`` (``5e-3`` where randomized clipping is composed; for a delta bracket these times
        ``|d log delta / d log eps|``, the factor by which its relative width is epsilon's) while the finer grids fit a
        budget of :data:`AUTO_BUDGET` grid points, about a second here (a cost model in grid points, never
        wall-clock time: the same inputs give the same bracket on every machine); where the budget runs out,
        the tightest bracket reached is returned.  A float in ``(0, 1)``: refine until that width, with no
        budget: the discretization shrinks by the factor the width asks for (errors fall about like ``h^2``;
        each grid is composed afresh and cached) down to ``discretization / 64`` (further, down to
        ``discretization / 65536``, only while a grid costs at most the budget: tiny sample rates and tiny
        epsilons), or until a finer grid would exceed the grid-size limit, or where it could not narrow the
        bracket by a tenth (each end's move between the last two grids, scaled by ``h^2``, predicts the next one's)
        or did not.  A randomized-clipping mechanism's
        scale grid is refined too, down to 1/16 of its step, each grid by what its share of the width asks for;
        a float target below 1 % starts with the scale step halved, and the loss step halved, kept, or doubled or
        quadrupled, as a plain step's upper and lower PLDs differ in mean (``_first_loss_step``).  With a single
        :class:`SubsampledGaussian` without an envelope, a lower end short of a float target is recomputed on two
        scales (see :meth:`epsilon_bracket`) before any finer grid is built.  ``None``: the coarse single grid.
        Every grid's bracket holds the truth, so the refined upper end is never above the coarse grid's.

    Examples
    --------
    >>> from dpmath import PLDAccountant, SubsampledGaussian
    >>> acc = PLDAccountant().compose(SubsampledGaussian(1.1, 256 / 60000), count=14040)
    >>> round(acc.epsilon(1e-5), 3)
    2.38
    >>> lo, hi = acc.epsilon_bracket(1e-5)
    >>> bool(lo <= hi < lo + 0.01)
    True
    """

    def __init__(self, discretization: float = 1e-4, neighboring: Neighboring | str = Neighboring.ADD_OR_REMOVE, *,
                 tail_mass: float = 1e-18, bracket_rtol: float | str | None = AUTO) -> None:
        h = real_number(discretization, "discretization", allow_inf=False)
        if not 0 < h <= 1:
            raise ValueError(f"discretization must lie in (0, 1], got {discretization!r}")
        relation = Neighboring(neighboring)
        tm = real_number(tail_mass, "tail_mass", allow_inf=False)
        if not 0 < tm <= 1e-6:
            raise ValueError(f"tail_mass must lie in (0, 1e-6], got {tail_mass!r}")
        if isinstance(bracket_rtol, str):
            if bracket_rtol != AUTO:
                raise ValueError(f"bracket_rtol must be {AUTO!r}, None or a float in (0, 1), got {bracket_rtol!r}")
        elif bracket_rtol is not None:
            r = real_number(bracket_rtol, "bracket_rtol", allow_inf=False)
            if not 0 < r < 1:
                raise ValueError(f"bracket_rtol must be {AUTO!r}, None or a float in (0, 1), got {bracket_rtol!r}")
            bracket_rtol = r
        # read-only (properties below): the cached compositions and curves were built at these values, and
        # compose() refused the mechanisms a relation does not cover, so a later change would be read against
        # stale caches (replace-one read off an add-or-remove curve, a refused mechanism let through)
        self._discretization = h
        self._neighboring = relation
        self._tail_mass = tm
        self._bracket_rtol = bracket_rtol
        self._events: tuple[tuple[Mechanism, int], ...] = ()
        self._plds: dict[tuple[float, bool, float, tuple[str, ...]], Composition] = {}
        self._two_scale: list[TwoScaleLower | None] = []   # built at most once per composition
        self._gaussian: list[GaussianCurve | None] = []    # likewise
        self._mixtures: dict[float, ScaleMixtureCurve] = {}   # a single randomized-clipping step's, by scale factor

    @property
    def discretization(self) -> float:
        """The loss grid's step h (read-only: make a new accountant to change it)."""
        return self._discretization

    @property
    def neighboring(self) -> Neighboring:
        """The neighbouring relation, a :class:`~dpmath.Neighboring` (read-only)."""
        return self._neighboring

    @property
    def tail_mass(self) -> float:
        """The probability mass each step may leave beyond its grid, charged to δ (read-only)."""
        return self._tail_mass

    @property
    def bracket_rtol(self) -> float | str | None:
        """The relative width each query refines to, ``"auto"`` (the default's budgeted target) or ``None`` (the
        coarse single grid); read-only."""
        return self._bracket_rtol

    def __repr__(self) -> str:
        return (f"PLDAccountant(discretization={self.discretization!r}, neighboring={self.neighboring.value!r}, "
                f"events={len(self._events)})")

    @property
    def events(self) -> tuple[tuple[Mechanism, int], ...]:
        """The composed ``(mechanism, count)`` pairs, in order.

        Examples
        --------
        >>> from dpmath import Gaussian, PLDAccountant
        >>> PLDAccountant().compose(Gaussian(1.0), 5).events
        ((Gaussian(noise_multiplier=1.0), 5),)
        """
        return self._events

    def compose(self, mechanism: Mechanism, count: int = 1) -> PLDAccountant:
        """Add ``count`` runs of ``mechanism``; returns the accountant, so calls chain.

        Parameters
        ----------
        mechanism : Mechanism
            Any of :mod:`dpmath.mechanisms` (LAP2 and the sampling schemes are composed as the step that dominates
            them; fixed-size and shuffled batches only with ``neighboring="replace_one"``).
        count : int
            How many times it runs (``>= 1``).

        Raises
        ------
        UnsupportedMechanismError
            Where :meth:`refusal` gives a reason (:meth:`supports` is False); nothing is composed.

        Examples
        --------
        >>> from dpmath import Gaussian, PLDAccountant
        >>> acc = PLDAccountant().compose(Gaussian(10.0), 50).compose(Gaussian(5.0), 50)
        >>> len(acc.events)
        2
        """
        self._refuse_unsupported(mechanism)
        n = positive_int(count, "count")
        # an epoch of k participations is composed as the k epochs of one that dominate it
        base, k = mechanism.decomposed()
        if n * k > MAX_COUNT:   # the composed tail mass and the loss range are floats: beyond this they overflow
            raise ValueError(f"count must be at most {MAX_COUNT // k:.0e} (a float's range of steps), got a count of "
                             f"{len(str(n))} digits; no training run takes that many steps")
        self._events = self._events + ((base, n * k),)
        self._plds = {}
        self._two_scale = []
        self._gaussian = []
        self._mixtures = {}
        return self

    def refusal(self, mechanism: object) -> str | None:
        """Why this accountant cannot account for ``mechanism``, or ``None``: it accounts for every mechanism of
        :data:`~dpmath.mechanisms.MECHANISMS` under the relation its analysis covers
        (:attr:`~dpmath.mechanisms.Mechanism.neighboring`), except randomized clipping for replacing one example.

        Examples
        --------
        >>> from dpmath import FixedSizeSubsampledGaussian, PLDAccountant
        >>> PLDAccountant().refusal(FixedSizeSubsampledGaussian(2.0, batch_size=100, dataset_size=10_000))
        "neighboring='add_or_remove' is not supported for FixedSizeSubsampledGaussian: its batches have a fixed ..."
        """
        name = type(mechanism).__name__
        if type(mechanism) not in MECHANISMS:   # the tables are keyed on these classes, never a subclass
            return f"mechanism must be one of {', '.join(m.__name__ for m in MECHANISMS)}, got {name}"
        covered = mechanism.neighboring
        if covered is not None and covered is not self.neighboring:
            return (f"neighboring={self.neighboring.value!r} is not supported for {name}: {mechanism.uncovered}; use "
                    f"neighboring={covered.value!r}")
        if reads_replacement(mechanism, self.neighboring) and random_scale(accounted_step(mechanism.decomposed()[0])):
            return (f"neighboring='replace_one' is not supported for {name} with randomized clipping: the two "
                    f"differing examples carry independent random scales, whose joint pair this accountant does not "
                    f"discretize; use neighboring='add_or_remove'")
        return None

    def _target(self) -> float:
        """The relative width the queries refine to: a float ``bracket_rtol``, else the default's target (also the
        target of a collapsed lower end's one finer grid on the coarse grid, ``bracket_rtol=None``)."""
        if isinstance(self.bracket_rtol, float):
            return self.bracket_rtol
        return _AUTO_RC_RTOL if self.bracket_rtol == AUTO and self._scaled() else _AUTO_RTOL

    def _scaled(self) -> bool:
        """Whether a randomized-clipping step is composed (its bracket has a scale grid's part)."""
        return any(random_scale(accounted_step(m)) for m, _ in self._events)

    def _atom_points(self, s: float) -> float:
        """The randomized-clipping steps' part of a grid's cost at the scale factor ``s``, in grid points:
        ``_ATOM_POINTS`` per scale atom (each atom's loss grid is built point by point; the default's first grid of
        ``HutchEnvelope(32, 2048)`` has 2,610 atoms, about 0.2 s more step building here than the envelope's own
        step's 714)."""
        atoms = 0
        for m, _ in self._events:
            step = accounted_step(m)
            if random_scale(step):
                atoms += scale_atoms(step.envelope, step.scale_resolution * s, True)[0].size
        return float(_ATOM_POINTS * atoms)

    def _refined(self, query, lower: bool, zero_refines: bool = False, slope=None, capped=None,
                 lower_end=None, at: float | None = None, enough: float | None = None) -> tuple[float, float]:
        """``query(h, upper, s, together)`` on finer grids until the bracket is :meth:`_target` tight (``h`` the
        loss grid's step, ``s`` the factor on randomized clipping's scale step, ``together`` the bounds whose steps
        are built together).

        Every grid's bracket holds the truth, so the tightest is their intersection.  Its width has two parts:
        the loss grid's, shrinking about like ``h^2``, and (randomized clipping) the scale grid's, shrinking
        like ``s``.  Which one dominates depends on the case (one RC step: the scale grid; ``10^6`` steps at
        sigma = 2: the loss grid), so the first refinement of an RC accountant splits the width between them from one
        more grid, ``h`` halved (it takes off 3/4 of the loss part), or the scale step halved where ``h`` is at its
        floor (half of the scale part); a float target below 1 % starts from a grid with the scale step halved and
        the loss step chosen by :meth:`_first_loss_step`, the default from :data:`AUTO_SCALE_START`; each next grid
        shrinks only the parts above their share of the target (with a safety factor 0.8, by ``1/8`` to ``1/2``),
        down to ``discretization / 64`` and ``s = 1/16``.  A float target stops where a finer grid narrowed the
        bracket by under 10 %.  A loss
        grid finer than ``discretization / 64`` (down to ``discretization * _FINEST``) is tried only where its
        predicted cost is within :data:`AUTO_BUDGET`: tiny sample rates and tiny epsilons, whose grids hold a
        few thousand points.

        **Cost model** (deterministic: grid points, never time).  A grid's cost is twice the FFT points its upper
        end's passes read (:attr:`Composition.work`, cached passes too, so the count does not depend on earlier
        queries; a single step's points count ``STEP_COST`` each), and its randomized-clipping scale atoms'
        :meth:`_atom_points`: the FFT points within the budget, and both together within :data:`_RC_ATOMS` times it
        (so that a heavy tail reaches a fine scale grid without any grid holding more points); a finer grid's count
        is predicted from the last one's (count times ``h`` is about constant).  A finer loss step is rounded down to
        a rung ``h0 2^(-k/2)``, and a refined scale factor to a rung ``2^(-k/16)`` (or up to the next where the rung
        below is over the budget), so that the queries of one accountant (an epsilon and the delta read back at it)
        meet on the same cached grids: at Hutch k 32, d 2048, 19 steps the delta that checks the epsilon built its
        own scale grids for 13 of the query's 17 s, and now reads the epsilon's (4 s in all).

        A delta query passes ``slope(h, s)``, ``|d log delta / d log epsilon|`` on its first grid: delta's relative
        width is epsilon's times that, so its target is epsilon's times the slope (a float target's at most its
        own), and it refines as far as an epsilon query there would (its passes read up to 1.4 times an epsilon
        query's points on a grid, so a randomized-clipping delta query's budget is twice).  With
        ``bracket_rtol="auto"`` a grid is built only while the grids built so far and it fit :data:`AUTO_BUDGET`
        (a randomized-clipping delta query's: twice that), and :meth:`epsilon`
        alone builds the lower end only where a finer grid would fit (else no width could be acted on), so it is
        :meth:`epsilon_bracket`'s upper end to the last bit.

        An infinite upper end (losses beyond the loss cap, ``2^22`` points: randomized clipping with a heavy-tailed
        scale, epsilon in the thousands) retries on loss grids ``_COARSER`` times coarser, up to a step of 1, whose
        cap reaches further, in any mode and whatever the budget: a huge epsilon is an answer, infinity is not.  A
        delta query passes ``capped(h, s, upper)``, whether that grid's upper end is mostly the mass beyond its cap,
        and retries the same way.

        Without ``bracket_rtol`` but with ``zero_refines`` (epsilon queries), a lower end of 0 under a positive
        upper end (one step's losses span only a few grid points, e.g. ``q mu < h``) is refined the same way, to
        ``1e-3``, for one finer grid (``h/8``; where even that leaves it at 0, finer ones rarely help).

        ``at``: the epsilon a delta query reads at (an epsilon query's is its bracket's upper end), for
        ``futile``'s rule.

        ``enough``: stop once the upper end is at most this (:meth:`_agreeing`'s check, which needs only that).  The
        grids follow the same sequence with or without it, so the refinement run to its end reads an upper end at most
        this too.

        ``lower_end(lo, hi)`` (a float ``bracket_rtol``'s epsilon queries): another lower bound, asked before any
        finer grid is built for a bracket wider than the target (the two-scale curve of a single subsampled Gaussian
        at a tiny sampling rate, whose grid lower ends stay near 0 however fine the grid: at q = 1e-6 a 1e-3 target
        refined for 73 s where the curve closes the bracket in about a second)."""
        h0 = self.discretization
        mode = self.bracket_rtol
        rtol = self._target()
        scaled = self._scaled()
        # a randomized-clipping delta query reads more passes per grid than an epsilon query (up to 1.4 times the
        # points on the benchmark's cases), so it has twice the budget: it reaches the grids an epsilon query there
        # would (without randomized clipping the agreement sweep meets its delta at the first nudges already)
        budget = (AUTO_BUDGET * (2 if slope is not None and scaled else 1)) if mode == AUTO else math.inf
        best: tuple[float, float] | None = None
        parts: tuple[float, float] | None = None     # the width's loss-grid and scale-grid parts at (h, s)
        spent = 0.0                                  # the FFT cost of the grids built, in grid points ...
        spent_atoms = 0.0                            # ... and their scale atoms' (within _RC_ATOMS times the budget)
        span = 0.0                                   # the last grid's upper FFT work (Composition.work) times h

        def cost(h: float, s: float) -> float:
            """A grid's predicted FFT cost in grid points (the cost model above)."""
            return 2.0 * span / h

        def atoms(s: float) -> float:
            return self._atom_points(s) if scaled else 0.0

        def allowed(h: float, s: float) -> bool:
            """Whether the grid ``(h, s)`` may be built: above the finest step, below ``h0 / 64`` only when cheap,
            and within the budgets."""
            if h < h0 * _FINEST or (h < h0 / 64 * (1 - 1e-9) and cost(h, s) + atoms(s) > AUTO_BUDGET):
                return False
            fft, atom = spent + cost(h, s), spent_atoms + atoms(s)
            return fft <= budget and fft + atom <= _RC_ATOMS * budget

        def finer(h: float, s: float) -> bool:
            """Whether the smallest refinement from ``(h, s)`` may be built: a lower end is worth computing."""
            if mode is None or mode == AUTO and self._narrow():
                return False
            if scaled and h <= h0 / 64:   # the split's grid (_refined's loop) halves the scale step there
                return allowed(h, s / 2)
            return allowed(h / 2, s)

        def run(h: float, s: float, need_lower: bool, coarser_next: bool = False) -> float:
            """Query one grid, intersect its bracket into ``best``; its own width (1 where its lower end was not
            computed).  ``coarser_next``: a coarser grid follows where this one's upper end is infinite, and its lower
            end is then not computed (a grid whose loss cap holds more than delta would read a lower end below the
            coarser grid's; at Hutch k 4, 51 steps, epsilon 2,600, that lower end took 4 s and 2.6 GB)."""
            nonlocal best, spent, spent_atoms, span
            together = (True, False) if need_lower or mode is not None else ()   # the ends share CDF evaluations
            for k, c in self._plds.items():   # count this query's passes only, cached or not: the same in every
                if k[0] == h and k[2] == s and c.single is None:   # order of queries
                    c.work = 0
            hi = query(h, True, s, together)
            span = h * sum(c.work for k, c in self._plds.items() if k[0] == h and k[1] and k[2] == s)
            spent += cost(h, s)
            spent_atoms += atoms(s)
            # an upper end at most ``enough`` ends the query (done), so its lower end would decide nothing: at sigma
            # 0.5, q 1e-6, 10^4 steps, bracket_rtol=1e-4 the agreement check's lower end took 7 of its 13 s
            if not (need_lower or (mode == AUTO and finer(h, s))) or (coarser_next and hi == math.inf) \
                    or (enough is not None and hi <= enough):
                best = (0.0, hi) if best is None else (best[0], min(best[1], hi))
                return 1.0
            lo = query(h, False, s, together)
            ends.append((h, lo, hi))
            best = (min(lo, hi), hi) if best is None else (max(best[0], min(lo, hi)), min(best[1], hi))
            return max(hi - lo, 0.0) / hi if 0 < hi < math.inf else 0.0

        def done(h: float) -> bool:
            nonlocal best
            if enough is not None and best[1] <= enough:
                return True
            if mode is None:
                return not (zero_refines and lower and best[0] <= 0.0 < best[1] and h == h0)
            # narrow steps: no refinement in the default, with or without a lower end, so that epsilon is the
            # bracket's upper end to the last bit
            if best[1] - best[0] <= rtol * best[1] or mode == AUTO and self._narrow():
                return True
            if lower_end is not None and best[1] < math.inf:
                # another lower bound may close the bracket without a finer grid (both hold the truth)
                best = (max(best[0], min(lower_end(*best), best[1])), best[1])
                return best[1] - best[0] <= rtol * best[1]
            return False

        both = lower or isinstance(mode, float)
        h, s = self._start()
        def stalled(last: float) -> bool:
            """A float target's stop where a finer grid narrowed the bracket by under 10 % (its lower end is held by
            something no grid moves, e.g. steps whose losses sit far below it): the next grid would cost more and
            narrow it as little."""
            return isinstance(mode, float) and best[1] - best[0] > 0.9 * last

        ends: list[tuple[float, float, float]] = []   # each loss grid's (h, lower end, upper end)

        def futile(h_next: float) -> bool:
            """A float target's stop before a finer loss grid that cannot narrow the bracket by a tenth: each end of
            the last grid moved by ``C (h_prev^2 - h^2)`` from the grid before, so the next moves it by that times
            ``(h^2 - h_next^2) / (h_prev^2 - h^2)``; an end counts only where that move could reach the bracket (a
            grid's lower end far below a lower end held by the two-scale curve does not), and only where epsilon spans
            at least 1000 grid steps.  At sigma 0.5, q = 1e-6, 10^4 steps, ``bracket_rtol=1e-4`` the grid 1.25e-5
            moved the upper end by 1.1e-5 and the next, 1.6e-6, would move it by 1.8e-7 against a width of 2.9e-5: it
            took 100 s and 8 GB and narrowed nothing."""
            if not isinstance(mode, float) or len(ends) < 2 or ends[-1][0] != h:
                return False
            (h0_, lo0, hi0), (h1, lo1, hi1) = ends[-2], ends[-1]
            # the h^2 model holds where epsilon spans many grid steps (a tiny epsilon of a few steps moves like h)
            span_eps = best[1] if at is None else at
            if not h1 < h0_ or not all(math.isfinite(v) for v in (lo0, hi0, lo1, hi1)) or span_eps < 1000.0 * h1:
                return False
            factor = (h1 * h1 - h_next * h_next) / (h0_ * h0_ - h1 * h1)
            width = best[1] - best[0]
            gain_hi = abs(hi0 - hi1) * factor
            gain_lo = abs(lo1 - lo0) * factor
            reach = max(0.0, lo1 + gain_lo - best[0])   # what the next lower end could add above the best one
            return gain_hi + reach < 0.1 * width

        def rung(x: float, finer: bool = True) -> float:
            """``x`` rounded to the ladder ``h0 2^(-k / _RUNGS)``, down (``finer``) or up."""
            k = _RUNGS * math.log2(h0 / x)
            k = math.ceil(k - 1e-9) if finer else math.floor(k + 1e-9)
            return h0 * 2.0 ** (-k / _RUNGS)

        try:
            width = run(h, s, both, _COARSER_TRIES > 0 and h < 1.0)
            if slope is not None:
                # delta's relative width is epsilon's times |d log delta / d log epsilon| (29 at sigma = 2,
                # q = 1e-3, 10^6 steps, delta = 1e-9; about 1 for one step at q = 1e-3 near epsilon = 3e-4)
                rtol *= slope(h, s) if mode == AUTO else min(1.0, slope(h, s))
            tries = 0
            while (best[1] == math.inf or capped is not None and capped(h, s, best[1])) and h < 1.0 \
                    and tries < _COARSER_TRIES:
                h, tries = min(_COARSER * h, 1.0), tries + 1
                width = run(h, s, both, tries < _COARSER_TRIES and h < 1.0)
            while best[1] < math.inf and not done(h) and (both or mode != AUTO or finer(h, s) or width < 1.0):
                target = 0.8 * rtol
                if not scaled or mode is None:
                    h_next = max(h * min(max(math.sqrt(target / width), 0.125), 0.5) if width > 0 else h / 2,
                                 h0 * _FINEST)
                    h_next = rung(h_next)
                    if h_next < h0 / 64 and cost(h_next, s) > AUTO_BUDGET:
                        # below h0 / 64 only where cheap: the finest grid within the budget, else h0 / 64
                        h_next = max(h0 / 64, rung(2.0 * span / AUTO_BUDGET, finer=False))
                    if spent + cost(h_next, s) > budget:   # the finest grid the default's budget leaves
                        h_next = rung(2.0 * span / (budget - spent), finer=False) if budget > spent else math.inf
                    # the default refines by at least half (as finer() assumes: epsilon alone then refines exactly
                    # where the bracket does); a float target takes any progress
                    if h_next > (0.5 * h * (1 + 1e-9) if mode == AUTO else h * (1 - 1e-9)) or not allowed(h_next, s) \
                            or futile(h_next):
                        break
                    h = h_next
                    last = best[1] - best[0]
                    width = run(h, s, True)
                    if stalled(last):
                        break
                    continue
                if parts is None:
                    # split the width w = A h^2 + B s with one more grid: h halved (it took off 3/4 of A h^2), or
                    # where h is at its floor, s halved (half of B s); that grid is the next one
                    halve_h = h > h0 / 64
                    h_s, s_s = (h / 2, s) if halve_h else (h, s / 2)
                    if (not halve_h and s <= 1 / 16) or not allowed(h_s, s_s):
                        break
                    last = best[1] - best[0]
                    w_next = run(h_s, s_s, True)
                    if halve_h:
                        loss = min(max(width - w_next, 0.0) * 4 / 3, width)
                        parts = (loss / 4, width - loss)
                    else:
                        scale = min(max(width - w_next, 0.0) * 2, width)
                        parts = (width - scale, scale / 2)
                    if sum(parts) <= 0:
                        parts = (0.5 * w_next, 0.5 * w_next)
                    h, s, width = h_s, s_s, w_next
                    # a split that halved h measured the loss part: narrowing little says the scale part holds the
                    # width, which the next grid shrinks (its own stall check stops a bracket neither moves).  At
                    # Hutch k 4, d 256, 51 steps, epsilon 2,600 the halved h moved 1.07 % to 1.00 %, and a float
                    # target stopped there, where the scale step / 8 gives 0.30 %
                    if done(h) or not halve_h and stalled(last):
                        break
                loss, scale = parts
                # shrink only the parts above their share of the target
                f_h = 1.0 if loss <= 0.5 * target or h <= h0 / 64 else \
                    min(max(math.sqrt(0.5 * target / loss), 0.125), 0.5)
                f_s = 1.0 if scale <= 0.5 * target or s <= 1 / 16 else min(max(0.5 * target / scale, 0.125), 0.5)
                if f_h == 1.0 and f_s == 1.0:     # the split was off: shrink both
                    f_h, f_s = (0.5 if h > h0 / 64 else 1.0), (0.5 if s > 1 / 16 else 1.0)
                if f_h == 1.0 and f_s == 1.0:     # both at their floors
                    break
                # the scale factor on the ladder 2^(-k / _SCALE_RUNGS), so that an epsilon query and the delta query
                # that checks it (_agreeing) meet on the same scale grids, whose steps are cached: the rung below
                # (finer) where it is within the budget, else the rung above
                h_next = max(h * f_h, h0 / 64)
                k = -_SCALE_RUNGS * math.log2(max(s * f_s, 1 / 16))
                s_next = 2.0 ** (-math.ceil(k - 1e-9) / _SCALE_RUNGS)
                if not allowed(h_next, s_next):
                    s_next = 2.0 ** (-math.floor(k + 1e-9) / _SCALE_RUNGS)
                s_next = max(s_next, 1 / 16)
                while not allowed(h_next, s_next) and s_next < s / 2:   # the finest scale grid within the budget
                    s_next *= 2
                if not allowed(h_next, s_next):
                    break
                h, s = h_next, s_next
                last = best[1] - best[0]
                width = run(h, s, True)
                if stalled(last):
                    break
                parts = (loss * f_h ** 2, scale * f_s)
        except GridTooLargeError:   # a finer grid would exceed the size limit: keep the tightest so far
            if best is None:
                raise
        return best if lower else (0.0, best[1])

    @property
    def first_grid(self) -> tuple[float, float]:
        """``(h, s)``: the loss step and the scale-grid factor of every query's first grid (:meth:`_start`).

        Examples
        --------
        >>> from dpmath import HutchEnvelope, PLDAccountant, SubsampledGaussian
        >>> PLDAccountant().compose(SubsampledGaussian(1.0, 0.01, HutchEnvelope(32, 2048)), 100).first_grid
        (0.0001, 0.5)
        """
        return self._start()

    def _start(self) -> tuple[float, float]:
        """The first grid ``(h, s)`` of every query's refinement: the discretization and the envelope's scale step,
        except that a float target below 1 % with randomized clipping starts where the default grid would only be a
        first, wasted try (0.5 to 1.7 % wide on the benchmark's cases): the scale step halved, and the loss step where
        a plain step's mean gap puts it (a guess of where to start; the refinement decides), and the default's
        randomized clipping starts at :data:`AUTO_SCALE_START` of the scale step."""
        mode = self.bracket_rtol
        if self._scaled() and isinstance(mode, float) and mode < _RC_WIDE:
            return self._first_loss_step(mode), 0.5
        if self._scaled() and mode == AUTO:
            return self.discretization, AUTO_SCALE_START
        return self.discretization, 1.0

    def _first_loss_step(self, rtol: float) -> float:
        """The loss step of a refined randomized-clipping bracket's first grid: the coarsest of ``4 h0`` and
        ``2 h0`` (``h0`` the discretization) where a plain step's :meth:`_mean_gap` is at most ``rtol / 32``,
        so that the loss grid's share of the width is a negligible part of the target; else ``h0``, or ``h0 / 2``
        where the gap at ``h0`` exceeds ``rtol / 2``.

        A coarser loss grid shrinks the composition's FFTs and the steps' dense grids.  At sigma = 0.6,
        q = 0.01, 10^5 steps (epsilon 172, where the bracket is all scale grid) the gaps are 4e-6, 1.9e-5 and
        7.9e-5 at ``h0``, ``2 h0`` and ``4 h0``, and the 0.5 % bracket starting at ``4 h0`` is 0.379 % wide
        against 0.376 % from ``h0``, in half the time."""
        h0 = self.discretization
        for h in (4.0 * h0, 2.0 * h0):
            if self._mean_gap(h) <= rtol / 32:
                return h
        return h0 / 2 if self._mean_gap(h0) > 0.5 * rtol else h0

    def _mean_gap(self, h: float) -> float:
        """The largest relative gap ``(m_upper - m_lower) / m_upper`` between the means of a plain subsampled-
        Gaussian step's upper and lower PLDs on the grid ``h`` (removal), over the randomized-clipping events'
        ``(sigma, q)``.

        The means are ``n`` times the composition's, so this is the loss grid's relative shift of the composed
        losses; on issue 16's cases the loss grid's share of a randomized-clipping bracket is at most about half
        of it (1.9 % at sigma = 2, q = 1e-3, where the share is 0.9 %; 0.14 % at sigma = 0.8, q = 1e-3, and
        4e-6 at sigma = 0.6, q = 0.01, where the bracket is all scale grid).  A plain step costs a fraction of
        a randomized-clipping one (1 to 70 ms here).
        """
        gaps = [0.0]
        for m, _ in self._events:
            m = accounted_step(m)
            if random_scale(m):
                up, lo = step_plds(SubsampledGaussian(m.noise_multiplier, m.sample_rate), "remove", h, (True, False))
                gap = mean_gap([(up, 1)], [(lo, 1)])
                gaps.append(gap if gap < math.inf else 0.0)
        return max(gaps)

    def _narrow(self) -> bool:
        """Whether the default's bracket is known to be within its target without a lower end: no randomized
        clipping, and the first direction's upper and lower steps on the first grid have means within ``1/8`` of the
        target of each other (:func:`~dpmath.pld.distribution.mean_gap`, which bounds the bracket's loss-grid width
        on the benchmark's settings with room to spare), so neither the lower end nor a finer grid is built for
        :meth:`epsilon` (0.125 s to 0.095 s at sigma 1, q = 0.25, 20 steps).  A property of the composed steps
        alone: an answer never depends on the queries before it."""
        if self._scaled():
            return False
        h, rels = self.discretization, self._relations(0)
        if (h, False, 1.0, rels) not in self._plds:   # the first query builds both bounds in the default
            return False
        upper, lower = (self._plds[(h, b, 1.0, rels)] for b in (True, False))
        return mean_gap(upper.events, lower.events) <= self._target() / 8

    def _composed(self, upper: bool, h: float | None = None, s: float = 1.0, directions: tuple[int, ...] | None = None,
                  together: tuple[bool, ...] = ()) -> list[Composition]:
        """The composed PLD of each neighbouring direction in ``directions`` (default: all) for the bound
        ``upper`` on the grid ``(h, s)``; the bounds in ``together`` are built with it where it is not cached
        (they share their steps' CDF evaluations)."""
        h = self.discretization if h is None else h
        dirs = range(len(_NEIGHBORING[self.neighboring])) if directions is None else directions
        rels = [self._relations(j) for j in dirs]
        todo = tuple(dict.fromkeys(r for r in rels if (h, upper, s, r) not in self._plds))
        bounds = tuple(dict.fromkeys((upper, *together)))
        for r in todo:
            # with q = 1 adding and removing an example are the same pair: one composition serves both
            missing = tuple(b for b in bounds if (h, b, s, r) not in self._plds)
            for b, steps in zip(missing, self._steps(r, missing, h, s), strict=True):
                self._plds[(h, b, s, r)] = Composition(steps, self.tail_mass, split=self._scaled())
        return [self._plds[(h, upper, s, r)] for r in rels]

    def _relations(self, direction: int) -> tuple[str, ...]:
        relation = _NEIGHBORING[self.neighboring][direction]
        # with q = 1 adding and removing an example are the same pair
        return tuple("replace" if reads_replacement(m, self.neighboring) else
                     "remove" if (relation == "add" and one_pair(accounted_step(m, self.neighboring))) else relation
                     for m, _ in self._events)

    def _steps(self, relations: tuple[str, ...], bounds: tuple[bool, ...], h: float, s: float
               ) -> list[list[tuple[Pld, int]]]:
        """The step PLDs and their counts, one list per bound in ``bounds``."""
        events = [(accounted_step(m, self.neighboring), n) for m, n in self._events]
        per_event = [step_plds(m, rel, h, bounds, n, s) for (m, n), rel in zip(events, relations, strict=True)]
        out = [[(plds[j], n) for plds, (_, n) in zip(per_event, events, strict=True)] for j in range(len(bounds))]
        if False in bounds and all(step_kind(m).gaussian for m, _ in events):
            j = bounds.index(False)
            # the upper steps: built with it, or those of the upper composition on this grid (cached), or built now
            cached = self._plds.get((h, True, s, relations))
            upper = out[bounds.index(True)] if True in bounds else (
                cached.events if cached is not None else self._steps(relations, (True,), h, s)[0])
            out[j] = self._lower_grid(events, relations, upper, out[j], h)
        return out

    def _lower_grid(self, events: list[tuple[Mechanism, int]], relations: tuple[str, ...],
                    upper: list[tuple[Pld, int]], lower: list[tuple[Pld, int]], h: float) -> list[tuple[Pld, int]]:
        """The lower steps of fixed-scale events on the loss step ``h`` or, where that grid resonates with the steps,
        on a slightly finer one (:data:`_LOWER_STEPS`, the first whose :func:`~dpmath.pld.distribution.mean_gap` to
        the upper steps on ``h`` is under half of ``h``'s), tried where the gap exceeds an eighth of the target and the
        steps hold at most :data:`_LOWER_POINTS` points.

        Any lower PLD gives a lower bound, so the grid is free to choose.  On a grid whose point sits just above a
        step's least loss ``log(1 - q)`` (``q = 1e-4`` at ``h = 1e-4``, where ``log(1 - q) = -1.00005 h``), one
        interval holds nearly all of a step's mass with its bend inside, and the lowered split must drop that bend by
        about a quarter of ``h`` times the mass: at sigma = 0.3, ``10^4`` steps the composed mean sits 0.06 below the
        upper one and the lower end 0.47 % below the truth; on ``0.95 h`` the gap is ``7e-6`` and the bracket
        ``5e-7`` wide.  Away from such resonance a finer grid narrows the gap only like ``h^2`` (0.81 times at
        ``0.9 h``), so ``h`` stays, and where a step's losses sit within one interval whatever the grid (``q mu`` far
        below ``h``: the two-scale curve's case) no grid helps.  Fixed-scale steps only, on small grids: each try
        rebuilds the steps (0.07 s for 288,182 points; 1.3 s for 1.4M at ``q = 1e-5``, ``h = 1.25e-5``, which it
        would not help)."""
        gap = mean_gap(upper, lower)
        # a step's least loss log(1 - q) above -0.9 h: its bulk sits within (-h, 0] on every grid tried
        reach = max(-math.log1p(-m.sample_rate) if m.sample_rate < 1.0 else math.inf for m, _ in events)
        if gap <= self._target() / 8 or sum(p.pmf.size for p, _ in lower) > _LOWER_POINTS \
                or reach < min(_LOWER_STEPS) * h:
            return lower
        for r in _LOWER_STEPS:
            steps = [(step_plds(m, rel, h * r, (False,), n)[0], n)
                     for (m, n), rel in zip(events, relations, strict=True)]
            if mean_gap(upper, steps) < 0.5 * gap:
                return steps
        return lower

    def _closed_form(self) -> GaussianCurve | None:
        """The composed Gaussian (:mod:`dpmath.pld.gaussian`) where every event is a Gaussian step: a sample rate of
        1 and a fixed scale (LAP2 as its dominating Gaussian); ``None`` otherwise."""
        if not self._gaussian:
            events = [(accounted_step(m, self.neighboring), n, reads_replacement(m, self.neighboring))
                      for m, n in self._events]
            plain = all(is_gaussian_step(m) for m, _, _ in events)
            # replacing one example moves a Gaussian step's mean by 2 mu: the Gaussian at noise sigma / 2
            self._gaussian.append(GaussianCurve([(m.noise_multiplier / (2.0 if r else 1.0), n) for m, n, r in events])
                                  if plain else None)
        return self._gaussian[0]

    @property
    def closed_form(self) -> bool:
        """Whether the accountant reads its curves in closed form, with no loss grid: Gaussian steps alone
        (:mod:`dpmath.pld.gaussian`), or one run of one randomized-clipping step, adding or removing an example
        (:mod:`dpmath.pld.scale_mixture`, whose bracket's only width is the scale grid's).

        Examples
        --------
        >>> from dpmath import HutchEnvelope, PLDAccountant, SubsampledGaussian
        >>> step = SubsampledGaussian(1.0, 0.05, HutchEnvelope(32, 2048))
        >>> PLDAccountant().compose(step).closed_form, PLDAccountant().compose(step, 2).closed_form
        (True, False)
        """
        return bool(self._events) and (self._closed_form() is not None or self._mixture_step() is not None)

    def _mixture_step(self) -> SubsampledGaussian | None:
        """The step read in closed form by :class:`~dpmath.pld.scale_mixture.ScaleMixtureCurve`, where the accountant
        holds one run of one randomized-clipping step, adding or removing an example; ``None`` otherwise."""
        if self.neighboring is not Neighboring.ADD_OR_REMOVE or len(self._events) != 1 or self._events[0][1] != 1:
            return None
        step = accounted_step(self._events[0][0])
        return step if random_scale(step) else None

    def _mixture_curve(self, s: float) -> ScaleMixtureCurve:
        """The closed-form curve of :meth:`_mixture_step` at the scale-grid factor ``s`` (built once)."""
        if s not in self._mixtures:
            self._mixtures[s] = ScaleMixtureCurve(self._mixture_step(), s)
        return self._mixtures[s]

    def _mixture_refined(self, read, rtol: float) -> tuple[float, float]:
        """``read(curve)``, a ``(lower, upper)`` bracket of a :class:`ScaleMixtureCurve`, on finer scale grids.

        The bracket's width is the scale grid's alone and shrinks like the scale step ``s``, and the atoms' count
        grows like ``1/s``.  Without ``bracket_rtol`` it is one curve at ``s = 1`` (3.5 % wide on one step of
        ``HutchEnvelope(2, 5)``, 0.5 % at ``(32, 2048)``).  The default reads the curve at :data:`AUTO_SCALE_START`
        and at the finest power of 2 below it whose atoms are predicted to stay within :data:`_MIXTURE_ATOMS` (down
        to :data:`_MIXTURE_FINEST`): a choice that depends on the step alone, so epsilon and delta queries read the
        same curves and agree without a nudge.  A float ``rtol`` goes on from there to the power of 2 that the width
        predicts for ``0.8 rtol`` (at most ``1/16`` of the last), down to :data:`_MIXTURE_FINEST`, and stops where a
        finer grid narrowed the bracket by under 10 %.  Every curve's bracket holds the truth: the tightest is their
        intersection."""
        mode = self.bracket_rtol

        def at(s: float) -> tuple[float, float]:
            return read(self._mixture_curve(s))

        s = 1.0 if mode is None else AUTO_SCALE_START
        lo, hi = at(s)
        if mode == AUTO:
            halvings = math.floor(math.log2(_MIXTURE_ATOMS / max(self._mixture_curve(s).atoms, 1)))
            finest = max(s * 2.0 ** -max(halvings, 0), _MIXTURE_FINEST)
            if finest < s:
                l2, h2 = at(finest)
                lo, hi = max(lo, l2), min(hi, h2)
            return lo, hi
        while mode is not None and 0 < hi < math.inf and hi - lo > rtol * hi and s > _MIXTURE_FINEST:
            shrink = max(1 / 16, min(0.5, 0.8 * rtol * hi / (hi - lo)))
            s = max(2.0 ** math.floor(math.log2(s * shrink)), _MIXTURE_FINEST)
            last = hi - lo
            l2, h2 = at(s)
            lo, hi = max(lo, l2), min(hi, h2)
            if hi - lo > 0.9 * last:
                break
        return lo, hi

    def _mixture_delta_target(self, e: float) -> float:
        """A float ``bracket_rtol``'s closed-form delta target: epsilon's times ``|d log delta / d log epsilon|`` at
        ``e`` on the first curve, at most its own (as :meth:`_refined` sets a grid's delta target)."""
        rtol = self._target()
        if e == 0:
            return rtol
        step = 1.0 + 1e-3
        curve = self._mixture_curve(AUTO_SCALE_START)   # the refinement's first curve
        return rtol * min(1.0, _log_slope(curve.delta(e), curve.delta(e * step), step))

    def _coarsely_below(self, direction: int, eps: float, delta: float, of_delta: bool = False) -> bool:
        """Whether a randomized-clipping accountant's ``direction`` has a true ``epsilon(delta) <= eps`` (with
        ``of_delta``: a true ``delta(eps) <= delta``), shown by its upper bound on a coarse grid (10 times the loss
        step, up to ``1e-2``, and 4 times the scale step), which costs a fraction of a step built on the query's
        grid.  Always ``False`` without randomized clipping, whose steps are cheap enough to build and bound on the
        query's grid."""
        if not any(random_scale(accounted_step(m)) for m, _ in self._events):
            return False
        try:
            coarse = self._composed(True, min(10.0 * self.discretization, 1e-2), 4.0, (direction,))[0]
        except GridTooLargeError:
            return False
        return coarse.delta(eps) <= delta if of_delta else coarse.epsilon(delta) <= eps

    def epsilon(self, delta: float) -> float:
        r"""Upper bound on the smallest ``epsilon >= 0`` with ``delta(epsilon) <= delta``; :meth:`delta` at the
        answer is at most ``delta`` (the answer is moved up where the two read-outs would disagree: :meth:`_agreeing`).

        Returns ``inf`` when mass that no epsilon can cover (unbounded scales, truncation) exceeds
        ``delta``.

        Examples
        --------
        >>> from dpmath import Gaussian, PLDAccountant
        >>> round(PLDAccountant().compose(Gaussian(1.0)).epsilon(1e-5), 3)
        4.377
        """
        return self.epsilon_bracket(delta, lower=False)[1]

    def epsilon_bracket(self, delta: float, *, lower: bool = True) -> tuple[float, float]:
        """``(lower, upper)`` bounds on ``epsilon(delta)``; ``lower=False`` skips the lower bound (NaN-free:
        it is then reported as 0).  By default (``bracket_rtol="auto"``) the bracket is refined to 0.1 % (0.5 %
        with randomized clipping) on finer grids while they fit :data:`AUTO_BUDGET`, and :meth:`epsilon` is its
        upper end to the last bit; an infinite upper end (losses beyond the grid's cap) is retried on coarser
        grids (:meth:`_refined`).  On the coarse grid (``None``) a lower end of 0 under a positive upper end tries
        one grid 8 times finer; for a single :class:`SubsampledGaussian` without an envelope, a lower end still below
        half the upper end (or short of a float ``bracket_rtol``) is recomputed on two scales, which resolves steps
        whose losses sit far below the grid (``q = 1e-6``; :mod:`dpmath.pld.two_scale`; the default does so only
        below half).
        Gaussian steps alone are read out in closed form (:mod:`dpmath.pld.gaussian`), where an epsilon beyond the
        largest float raises :class:`ValueError`.

        Examples
        --------
        >>> from dpmath import PLDAccountant, SubsampledGaussian
        >>> lo, hi = PLDAccountant().compose(SubsampledGaussian(1.0, 0.01), 1000).epsilon_bracket(1e-6)
        >>> round(lo, 5), round(hi, 5)
        (2.1245, 2.12452)
        """
        d = open_probability(delta, "delta")
        if not self._events:   # nothing composed: the output does not depend on the data
            return 0.0, 0.0
        lo, hi = self._epsilon_bracket(d, lower)
        return lo, self._agreeing(d, hi)

    def _agreeing(self, d: float, eps: float) -> float:
        """``eps``, or the first of ``eps + r max(eps, 1e-6)``, ``r = 1e-10, 1e-9, ...`` (then doubling) whose
        :meth:`delta` is at most ``d``: the epsilon published and the delta read back at it agree.

        Both queries return upper bounds, but each is the tightest over the grids its own refinement built, read by
        tilted passes centred on its own argument, so ``delta(epsilon(d))`` could exceed ``d`` (by ``1e-7`` of it
        where the passes differ; by up to the delta bracket's width where delta's refinement stops on another grid).
        A larger epsilon is an upper bound too, so moving up is sound.  Every delta query reads its first grid
        (:meth:`_start`) and, where that one is infinite or capped, the coarser ones it retries
        (:meth:`_first_delta_read`), so where those grids' upper bound agrees within a nudge of ``1e-6``, :meth:`delta`
        does too, without running its refinement; else :meth:`delta` itself is asked (its grids are shared rungs,
        cached), stopped once its upper end is at most ``d`` (:meth:`_delta_at_most`).
        ``inf`` only if doubling 64 times never agrees."""
        if not 0.0 <= eps < math.inf:
            return eps
        unit = max(eps, 1e-6)
        # 0, then _AGREE_RTOL, 10 times more each up to 1e-1, then doubling
        nudges = [0.0, *(_AGREE_RTOL * 10.0 ** k for k in range(10)), *(2.0 ** k for k in range(1, 65))]
        checks = [(lambda x: self._delta_at_most(x, d), nudges)]
        if self._closed_form() is None and self._mixture_step() is None:
            checks.insert(0, (lambda x: self._first_delta_read(x) + self._charge(x) <= d, nudges[:6]))
        for i, (check, rels) in enumerate(checks):
            try:
                for rel in rels:
                    if check(x := eps + rel * unit):
                        return x
            except GridTooLargeError:
                if i == len(checks) - 1:   # delta's own refinement: nothing is left to ask
                    raise
        return math.inf

    def _first_delta_read(self, x: float) -> float:
        """The upper bound on ``delta(x)`` that :meth:`delta`'s refinement (:meth:`_refined`) reads before any finer
        grid, without the overflow charge: its first grid's and, where that reading is infinite or mostly the
        composition's mass beyond the loss cap, the coarser grids' it then retries, as it does (the largest epsilon,
        e.g. 2,600 at Hutch k 4, is read on a grid 64 times coarser than the first, whose cap holds 1.5e-6)."""
        h, s = self._start()
        best = self._delta_read(x, h, True, s)
        tries = 0
        # the retry rule of _refined's coarser loop
        while (best == math.inf or self._capped(h, s, best)) and h < 1.0 and tries < _COARSER_TRIES:
            h, tries = min(_COARSER * h, 1.0), tries + 1
            best = min(best, self._delta_read(x, h, True, s))
        return best

    def _capped(self, h: float, s: float, upper: float) -> bool:
        """Whether most of the grid ``(h, s)``'s upper end ``upper`` on delta is mass beyond its loss cap (a coarser
        grid's cap reaches further): a delta query's refinement then retries on a coarser one."""
        return max(c.inf_mass for c in self._composed(True, h, s, (0,))) > 0.5 * upper

    def _charge(self, e: float) -> float:
        """A truncated step's overflow charged to delta at ``e``: ``eta (1 + e^e)`` (:meth:`_overflow`)."""
        eta = self._overflow()
        return eta * (1.0 + math.exp(e)) if e < 700.0 else (math.inf if eta else 0.0)

    def _epsilon_bracket(self, d: float, lower: bool) -> tuple[float, float]:
        """:meth:`epsilon_bracket` before :meth:`_agreeing`."""
        if (gaussian := self._closed_form()) is not None:
            return gaussian.epsilon_bracket(d)
        eta = self._overflow()
        if not eta:
            return self._plain_epsilon_bracket(d, lower)
        # a truncated step's overflow: delta_PLD(eps) + eta (1 + e^eps) <= delta; each delta's bracket is the
        # plain one (refined as any query: the compositions are cached, only the read-outs repeat)
        hi = _charged_epsilon(lambda budget: self._plain_epsilon_bracket(budget, False)[1], d, eta)
        if hi == math.inf:
            warnings.warn(f"epsilon is infinite at delta={d:g}: the truncated batches' overflow probability, charged "
                          f"to delta ({eta:.3g} over the steps composed, times 1 + e^epsilon), leaves no epsilon at "
                          f"which the total is at most delta; raise max_batch_size (TruncatedSubsampledGaussian) or "
                          f"delta",
                          RuntimeWarning, stacklevel=4)
        if not lower:
            return 0.0, hi
        # the truth is at most hi, where the charge is at most eta (1 + e^hi)
        widened = d + eta * (1.0 + math.exp(hi)) if hi < 700.0 else 1.0
        return (min(hi, self._plain_epsilon_bracket(widened, True)[0]) if widened < 1.0 else 0.0), hi

    def _plain_epsilon_bracket(self, d: float, lower: bool) -> tuple[float, float]:
        """The bracket of the composed PLD's own epsilon at ``d`` (no overflow charge)."""
        if self._mixture_step() is not None:
            lo, hi = self._mixture_refined(lambda curve: curve.epsilon_bracket(d), self._target())
            return (lo if lower else 0.0), hi
        def query(h: float, upper: bool, s: float, together: tuple[bool, ...]) -> float:
            # the first direction's epsilon, then only the directions whose delta there could exceed delta:
            # a bound on another direction's exact curve at most delta there means its true epsilon is at most
            # this one, so the maximum is unchanged (both ends: a lower end needs no direction whose truth lies
            # below it).  The bound is the direction's upper epsilon on a coarse grid (randomized clipping,
            # whose steps are costly: the direction is then never built on this grid) or a Chernoff bound on
            # its upper composition on this grid
            def comp(j: int, upper: bool) -> Composition:
                return self._composed(upper, h, s, (j,), together)[0]

            first = comp(0, upper).epsilon(d)
            out = [first]
            for j in range(1, len(_NEIGHBORING[self.neighboring]) if first < math.inf else 1):
                if self._relations(j) == self._relations(0) or self._coarsely_below(j, first, d):
                    continue
                if comp(j, True).delta_bound(first) > d * (1.0 - 1e-6):
                    out.append(comp(j, upper).epsilon(d))
            return max(out)
        def lower_end(lo: float, hi: float) -> float:
            curve = self._two_scale_lower(True, lo, hi)
            return lo if curve is None else curve.epsilon(d, hi, lo)

        # a float target's bracket asks the two-scale curve before it refines (the default applies it below only)
        float_target = isinstance(self.bracket_rtol, float)
        lo, hi = self._refined(query, lower, True, lower_end=lower_end if float_target else None)
        curve = self._two_scale_lower(lower, lo, hi)
        return (curve.epsilon(d, hi, lo), hi) if curve is not None else (lo, hi)

    def _overflow(self) -> float:
        """``sum n eta``: the probability that some truncated randomized-clipping step's Poisson draw overflows,
        charged to delta as ``eta (1 + e^epsilon)`` (:class:`~dpmath.TruncatedSubsampledGaussian`), rounded up."""
        total = math.fsum(n * m.overflow_probability() for m, n in self._events if m.charged)
        return min(1.0, total * (1.0 + 1e-12))

    def _two_scale_lower(self, lower: bool, lo: float, hi: float) -> TwoScaleLower | None:
        """The two-scale lower curve (:mod:`dpmath.pld.two_scale`) where a bracket's lower end is far from its upper
        end (below half of it, or short of ``bracket_rtol``) and the accountant holds a single
        :class:`SubsampledGaussian` event with ``q < 1`` and no envelope, adding or removing an example: one step's
        losses then sit far below the grid's step.  Its curve is the removal's, below the larger direction's.  The
        default (``"auto"``) asks for it below half the upper end, like the coarse grid, and where its lower end is
        short of the default's target only if the bulk's composition has at most ``AUTO_BUDGET / 4`` points (its two
        compositions read a few passes of that window: about a second; at ``q = 8e-6`` and ``n = 4e5`` steps the
        curve takes 40 s and 4 GB).  A curve refused by that limit is not kept, so a later query below half still
        builds it: the answer never depends on the order of the queries."""
        target = self.bracket_rtol if isinstance(self.bracket_rtol, float) else (
            self._target() if self.bracket_rtol == AUTO else None)
        half = lo < 0.5 * hi
        loose = 0 < hi < math.inf and (half or (target is not None and hi - lo > target * hi))
        if not (lower and loose and self.neighboring is Neighboring.ADD_OR_REMOVE and len(self._events) == 1
                and type(self._events[0][0]) is SubsampledGaussian and not random_scale(self._events[0][0])
                and self._events[0][0].sample_rate < 1.0):
            return None
        if not self._two_scale:
            (m, n), = self._events
            limit = AUTO_BUDGET // 4 if self.bracket_rtol == AUTO and not half else None
            try:
                curve = TwoScaleLower.build(1.0 / m.noise_multiplier, m.sample_rate, n, self.discretization,
                                            self.tail_mass, limit)
            except GridTooLargeError:   # the bulk's composition needs too many points: keep the grid's lower end
                if limit is not None:   # over the default's limit only: not kept (above)
                    return None
                curve = None
            self._two_scale.append(curve)
        return self._two_scale[0]

    def delta(self, epsilon: float) -> float:
        """Upper bound on ``delta(epsilon)``, the worse of the two directions.

        Examples
        --------
        >>> from dpmath import Gaussian, PLDAccountant
        >>> f"{PLDAccountant().compose(Gaussian(1.0)).delta(1.0):.4f}"
        '0.1269'
        """
        return self.delta_bracket(epsilon, lower=False)[1]

    def _delta_at_most(self, epsilon: float, delta: float) -> bool:
        """Whether :meth:`delta` at ``epsilon`` is at most ``delta``, its refinement stopped as soon as its upper end
        shows it (:meth:`_agreeing`: a float ``bracket_rtol``'s delta query would refine on to its own target, at
        Hutch k 4, d 256, 51 steps, epsilon 2,600 to 4 GB, where its third grid already read under ``delta``)."""
        return self._delta_bracket(epsilon, False, delta)[1] <= delta

    def delta_bracket(self, epsilon: float, *, lower: bool = True) -> tuple[float, float]:
        """``(lower, upper)`` bounds on ``delta(epsilon)``.

        Examples
        --------
        >>> from dpmath import Gaussian, PLDAccountant
        >>> lo, hi = PLDAccountant().compose(Gaussian(1.0)).delta_bracket(1.0)
        >>> f"{lo:.6f} {hi:.6f}"
        '0.126937 0.126937'
        """
        return self._delta_bracket(non_negative(epsilon, "epsilon"), lower)

    def _delta_bracket(self, e: float, lower: bool, enough: float | None = None) -> tuple[float, float]:
        """:meth:`delta_bracket`, its refinement stopped once its upper end is at most ``enough`` (:meth:`_refined`)."""
        if not self._events:   # nothing composed: the output does not depend on the data
            return 0.0, 0.0
        if (gaussian := self._closed_form()) is not None:
            return gaussian.delta_bracket(e)

        charge = self._charge(e)
        if self._mixture_step() is not None:
            target = self._mixture_delta_target(e) if isinstance(self.bracket_rtol, float) else self._target()
            lo, hi = self._mixture_refined(lambda curve: curve.delta_bracket(e), target)
            return (max(0.0, lo - charge) if lower else 0.0), min(1.0, hi + charge)

        def query(h: float, upper: bool, s: float, together: tuple[bool, ...]) -> float:
            return self._delta_read(e, h, upper, s, together)

        def slope(h: float, s: float) -> float:
            """``|d log delta / d log epsilon|`` at ``e`` on the grid's upper compositions: a secant over half a tilt
            bin, up or down, whichever stays in ``e``'s bin (:meth:`Composition.delta` reads both from one pass); 1 at
            epsilon 0, where a relative width in epsilon means nothing."""
            if e == 0:
                return 1.0
            step = 2.0 ** (0.5 / TILT_BINS)
            other = e * step if tilt_bin(e * step) == tilt_bin(e) else e / step
            return _log_slope(self._delta_read(e, h, True, s), self._delta_read(other, h, True, s), step)

        def lower_end(lo: float, hi: float) -> float:
            curve = self._two_scale_lower(True, 0.0, 1.0)
            return lo if curve is None else curve.delta(e)

        lo, hi = self._refined(query, lower, slope=slope, capped=self._capped, at=e,
                               lower_end=lower_end if isinstance(self.bracket_rtol, float) else None,
                               enough=None if enough is None else enough - charge)
        curve = self._two_scale_lower(lower, lo, hi)
        lo = max(lo, curve.delta(e)) if curve is not None else lo
        # a truncated step's overflow, outside the refinement (no grid narrows it)
        return (max(0.0, lo - charge) if lower else 0.0), min(1.0, hi + charge)

    def _delta_read(self, x: float, h: float, upper: bool, s: float, together: tuple[bool, ...] = ()) -> float:
        """The grid ``(h, s)``'s bound on ``delta(x)``, the worse direction: the first direction's, then only the
        directions whose delta could exceed its upper bound there (shown by a coarse grid's upper bound, or a
        Chernoff bound), so the maximum is unchanged (a lower end needs no direction whose truth lies below the
        first's upper bound: the first's own lower end is a lower bound)."""
        first = self._composed(upper, h, s, (0,), together)[0].delta(x)
        ceiling = first if upper else self._composed(True, h, s, (0,), together)[0].delta(x)
        out = [first]
        for j in range(1, len(_NEIGHBORING[self.neighboring])):
            if (self._relations(j) == self._relations(0) or self._coarsely_below(j, x, ceiling, of_delta=True)
                    or self._composed(True, h, s, (j,), together)[0].delta_bound(x) <= ceiling):
                continue
            out.append(self._composed(upper, h, s, (j,), together)[0].delta(x))
        return max(out)

    def tradeoff(self, alpha: ArrayLike) -> np.ndarray:
        r"""Lower bound on the f-DP trade-off curve: the smallest false-negative rate ``beta`` of any test
        with false-positive rate ``alpha``, over both neighbouring directions.

        Computed by duality from the hockey-stick curve,
        ``beta(alpha) = sup_eps (1 - delta(eps) - e^eps alpha)``, over all real ``eps``.

        Examples
        --------
        >>> from dpmath import Gaussian, PLDAccountant
        >>> beta = PLDAccountant().compose(Gaussian(1.0)).tradeoff([1e-3, 1e-5])
        >>> (1 - beta).round(5).tolist()          # Phi(Phi^-1(alpha) + 1)
        [0.0183, 0.00055]
        """
        a = probability_array(alpha, "alpha")
        if not self._events:   # nothing composed: no test beats chance
            out = 1.0 - a
            return out[()] if out.ndim == 0 else out
        if self._overflow():
            raise ValueError("tradeoff is not available with TruncatedSubsampledGaussian: its overflow is charged to "
                             "delta(epsilon) as eta (1 + e^epsilon), which the trade-off curve does not carry; use "
                             "delta() or epsilon()")
        flat = a.ravel()
        if (gaussian := self._closed_form()) is not None:
            out = np.minimum(gaussian.tradeoff(flat), 1.0 - flat).reshape(a.shape)
            return out[()] if out.ndim == 0 else out
        out = np.min([p.tradeoff(flat) for p in self._composed(True)], axis=0)
        out = np.where(flat >= 1, 0.0, np.where(flat <= 0, 1.0 - max(p.inf_mass for p in self._composed(True)), out))
        out = np.minimum(out, 1.0 - flat).reshape(a.shape)
        return out[()] if out.ndim == 0 else out


def _log_slope(here: float, there: float, ratio: float) -> float:
    """``|d log delta / d log epsilon|`` from two delta reads at epsilons ``ratio`` apart (at least ``1e-3``); 1 where
    the reads cannot say (0, 1 or equal)."""
    if not (0 < min(here, there) and max(here, there) < 1 and here != there):
        return 1.0
    return max(abs(math.log(here / there) / math.log(ratio)), 1e-3)


_PUBLISHED: dict[tuple, float] = {}   # published_epsilon's values, by settings, events and delta
_PUBLISHED_KEPT = 256


def published_epsilon(accountant: PLDAccountant, delta: float) -> float:
    """``accountant.epsilon(delta)``, kept in a process-wide cache by the accountant's settings, its events and
    ``delta``: the value is a function of those alone, so the evaluations of one run share it (the trainer's ledger
    reads the calibration's last evaluation at the calibrated count instead of composing it again).

    Examples
    --------
    >>> from dpmath import PLDAccountant, SubsampledGaussian
    >>> from dpmath.pld.accountant import published_epsilon
    >>> acc = PLDAccountant().compose(SubsampledGaussian(1.0, 0.01), 1000)
    >>> published_epsilon(acc, 1e-5) == acc.epsilon(1e-5) == published_epsilon(acc, 1e-5)
    True
    """
    d = open_probability(delta, "delta")
    key = (accountant.discretization, accountant.neighboring, accountant.tail_mass, accountant.bracket_rtol,
           accountant.events, d)
    if key not in _PUBLISHED:
        value = accountant.epsilon(d)
        if len(_PUBLISHED) >= _PUBLISHED_KEPT:
            _PUBLISHED.pop(next(iter(_PUBLISHED)))
        _PUBLISHED[key] = value
    return _PUBLISHED[key]


def _charged_epsilon(epsilon_at, delta: float, eta: float) -> float:
    """An ``epsilon`` with ``delta_PLD(epsilon) + eta (1 + e^epsilon) <= delta``, ``epsilon_at(d)`` being an upper bound
    on the PLD's epsilon at ``d``: the fixed point of ``e <- epsilon_at(delta - eta (1 + e^e (1 + 1e-9)))``, which
    increases from 0 and stops once a step moves ``e^e`` by less than the ``1e-9`` allowed for; ``inf`` where the
    charge alone reaches ``delta``."""
    eps = 0.0
    for _ in range(200):
        budget = delta - eta * (1.0 + math.exp(eps) * (1.0 + 1e-9))
        if budget <= 0.0:
            return math.inf
        nxt = epsilon_at(budget)
        if nxt >= 700.0:
            return math.inf if nxt == math.inf else nxt if math.exp(nxt - eps) <= 1.0 + 1e-9 else math.inf
        if math.exp(nxt) <= math.exp(eps) * (1.0 + 1e-9):
            return nxt
        eps = nxt
    return math.inf

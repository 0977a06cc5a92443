r"""One step of a mechanism in one neighbouring direction, as an upper and a lower discrete PLD.

A :class:`~dpmath.mechanisms.Mechanism` is composed as the step that dominates it (:func:`accounted_step`), and a step
becomes a subsampled-Gaussian pair on a loss grid (:mod:`dpmath.pld.losses`), split onto grid points for each bound
(:mod:`dpmath.pld.discretize`), as its entry of :data:`STEPS` says.

For randomized clipping (:class:`~dpmath.SubsampledGaussian` with an ``envelope``) the scale ``a = 1/sqrt(Y)`` is
part of the output of the dominating pair, so its hockey-stick curve is the ``Y``-average of subsampled-Gaussian
curves, and its PLD the ``Y``-mixture of their PLDs.  ``Y`` is discretized with
:func:`~dpmath.pessimistic_discretization`; the mass below the grid has an unbounded scale and is charged as follows:
when the example is removed, ``q`` of it is an infinite loss and the rest has loss ``log(1-q)``; when it is added, the
loss is ``-log(1-q)`` (``+inf`` if ``q = 1``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from scipy import special

from ..accountant import Neighboring
from ..discretization import pessimistic_discretization
from ..envelope import Envelope
from ..mechanisms import Gaussian, Mechanism, RandomAllocationGaussian, SubsampledGaussian
from .allocation import epoch_plds
from .discretize import assemble, split
from .distribution import GridTooLargeError, Pld
from .gaussian import GaussianCurve
from .losses import (
    MixtureSums,
    StepMasses,
    band_start,
    loss_range,
    mix,
    mixture_masses,
    mixture_sums,
    pair_cdfs,
    sparse_points,
    step_grid,
)

__all__ = ["STEPS", "StepKind", "accounted_step", "is_gaussian_step", "one_pair", "random_scale", "reads_replacement",
           "scale_atoms", "scale_sums", "step_kind", "step_plds"]


def accounted_step(mechanism: Mechanism, neighboring: Neighboring = Neighboring.ADD_OR_REMOVE) -> Mechanism:
    """The step composed for ``mechanism``: the step its :meth:`~dpmath.mechanisms.Mechanism.dominating` names (LAP2
    as the subsampled Gaussian that dominates it, a sampling scheme as its dominating step, a Gaussian step as
    itself), or, adding or removing an example, the mechanism itself where it is
    :attr:`~dpmath.mechanisms.Mechanism.amplified` (an epoch of random allocation: :mod:`dpmath.pld.allocation`).
    It has an entry of :data:`STEPS` (:func:`step_kind`)."""
    if mechanism.amplified and neighboring is Neighboring.ADD_OR_REMOVE:
        return mechanism
    return mechanism.dominating()


def reads_replacement(mechanism: Mechanism, neighboring: Neighboring) -> bool:
    """Whether the accounted step's pair is read for replacing one example (the "replace" pair), rather than in
    the adding and removing directions: under ``Neighboring.REPLACE_ONE``, except for a mechanism whose analysis
    covers that relation only (fixed-size and shuffled batches): its replacing pairs are its dominating step's
    adding and removing pairs (:attr:`~dpmath.mechanisms.Mechanism.neighboring`)."""
    return neighboring is Neighboring.REPLACE_ONE and mechanism.neighboring is None


class StepKind(NamedTuple):
    """How the PLD accountant builds and reads one kind of accounted step (an entry of :data:`STEPS`)."""

    #: ``build(step, relation, h, bounds, count, scale_refinement)``: the step's PLD for each bound (:func:`step_plds`)
    build: Callable[..., list[Pld]]
    #: a fixed scale: at sample rate 1 a Gaussian mechanism, read out in closed form (:func:`is_gaussian_step`)
    gaussian: bool
    #: a random scale, discretized on a scale grid (:func:`random_scale`)
    scaled: bool
    #: adding and removing an example are one pair at sample rate 1 (:func:`one_pair`)
    symmetric: bool


def step_kind(step: Mechanism) -> StepKind:
    """An accounted step's entry of :data:`STEPS`: by its class and whether it has an envelope (randomized
    clipping; a point mass too)."""
    return STEPS[type(step), getattr(step, "envelope", None) is not None]


def is_gaussian_step(step: Mechanism) -> bool:
    """Whether an accounted step is a Gaussian mechanism (sample rate 1, a fixed scale): it is read out in
    closed form (:mod:`dpmath.pld.gaussian`), no grid."""
    return step_kind(step).gaussian and step.sample_rate == 1.0


def one_pair(step: Mechanism) -> bool:
    """Whether adding and removing an example are the same pair for an accounted step (sample rate 1, one scale or
    a random one): one direction serves both.  Not for random allocation, whose two directions differ."""
    return step.sample_rate == 1.0 and step_kind(step).symmetric


def random_scale(step: Mechanism) -> bool:
    """Whether an accounted step has a random scale (randomized clipping): a scale grid, refined with the loss grid."""
    return step_kind(step).scaled


_RANGE_TAIL = 1e-22     # per-step mass left unresolved beyond the loss grid (still accounted for)
_LOSS_CAP = 1 << 22     # grid points of one step's loss range, at most (420 at h = 1e-4)
_CAP_MASS = 1e-15       # mass a composition may charge to delta for losses beyond the cap
_TAIL_POINTS = 5000     # one scale of weight w is resolved on at most max(_TAIL_POINTS, ...
_POINTS_PER_MASS = 1e6  # ... w * _POINTS_PER_MASS) points (geometrically sparser far from 0), rounded up to a power
                        # of 2 (8192; 4096 was 20 to 35 % faster, but Hutch k 8, d 64, 5 steps at epsilon 89 read
                        # 0.117 % where 8192 read 0.047 %: its moderate scales' losses sit on the geometric points)
_FINE_TAIL = 1e-12      # quantile of Y down to which the scale grid keeps bins of a 1/256 decade of mass ...
_FINE_DECADES = 1 / 256 / 2e-3  # ... per 2e-3 of scale_resolution (a refined grid's mass bins shrink with it)
_COARSE_DROP = 10.0 ** (-1 / 8)
_FALLBACK_POINTS = 1 << 19   # the unamplified bound of an epoch is built on at most this many points (_coarse_gaussian)
_PROBE_DELTA = 1e-6   # where an epoch of random allocation's two upper PLDs are compared


@functools.lru_cache(maxsize=16)
def scale_atoms(envelope: Envelope, resolution: float, upper: bool) -> tuple[np.ndarray, np.ndarray, float]:
    """``(scales, weights, unbounded_mass)`` of ``a = 1/sqrt(Y)``, discretized toward larger (``upper``)
    or smaller scales.

    The grid is geometric in ``a`` with relative step ``resolution`` (``a = 1`` is a grid point) from
    the top of the support down to the envelope's ``1e-2`` quantile of ``Y``, and on down to its
    ``_FINE_TAIL`` quantile, except that a bin may widen while it holds at most a ``1/256`` decade of the
    tail's mass at the default ``resolution = 2e-3``, proportionally less at a finer one (heavy tails,
    e.g. ``k = 1``, would otherwise need a bin per ``resolution`` over many decades of ``a``).  With
    ``P(a > s) ~ s^-k`` such a bin spans ``a`` by about ``4.5 resolution / k`` of itself, so from ``k = 4``
    on a bin is one step (the grid's candidates are a step apart): a long composition's
    epsilon in the thousands is set by one tail atom's loss, ``~a^2``, whose bin's two ends are the
    bracket's (a ``1/64`` decade, four steps at ``k = 4``, left Hutch k 4, d 256, 51 steps, epsilon 2,640 at
    0.97 % with the default; one step, 0.35 %, and 0.23 % with that atom's own losses on a band of the loss grid,
    :func:`~dpmath.pld.losses.sparse_points`; 2.5 times the atoms at ``k = 4``, 1.6 at ``k = 8``, 1.7 at ``k = 1``,
    the same from ``k = 16``).  Below, a
    bin holds up to an ``1/8`` decade, down to the ``1e-20`` quantile, whose lower mass is unbounded.
    The tail carries the large scales, whose steps dominate a long composition's epsilon: with Hutch
    (k = 32, d = 2048) at (sigma, q, steps, delta) = (0.8, 1e-3, 5e4, 1e-6) and
    ``discretization = 2.5e-5``, the first grid (``2 resolution`` between the ``1e-6`` and ``1e-2``
    quantiles, half-decade quantile bins below) gave [4.2258, 4.3461]; this
    one gives [4.2589, 4.2955] (714 atoms instead of 313).
    """
    exact = envelope.atoms()
    if exact is not None:   # finitely many scales: the atoms themselves, for both bounds
        return 1.0 / np.sqrt(exact[0]), exact[1], 0.0
    y_lo, y_b, y_top = (float(v) for v in envelope.ppf([1e-20, 1e-2, 1.0 - 1e-16]))
    step = math.log1p(resolution)
    m = np.arange(math.floor(-0.5 * math.log(y_top) / step), math.ceil(-0.5 * math.log(y_lo) / step) + 1)
    y_geo = np.exp(-2.0 * step * m)                      # increasing in m: decreasing y, increasing a
    bulk = y_geo[(y_geo > y_b) & (y_geo < y_top)]
    cand = np.append(y_geo[(y_geo <= y_b) & (y_geo > y_lo)], y_lo)
    F = np.asarray(envelope.cdf(cand), dtype=np.float64)  # non-increasing along cand
    # from the 1e-2 quantile outward, a bin ends at the last candidate within its mass allowance
    keep, j = [], 0
    neg = -F
    fine_drop = 10.0 ** (-_FINE_DECADES * resolution)
    while j < cand.size - 1:
        keep.append(j)
        drop = fine_drop if F[j] >= _FINE_TAIL else _COARSE_DROP
        j = max(j + 1, int(np.searchsorted(neg, -drop * F[j], side="right")) - 1)
    grid = np.unique(np.concatenate([cand[keep], [y_lo], bulk, [y_top]]))
    dist = pessimistic_discretization(envelope, grid, optimistic=not upper)
    keep_w = dist.weights > 0
    with np.errstate(divide="ignore"):
        scales = 1.0 / np.sqrt(dist.y[keep_w])
    return scales, dist.weights[keep_w], float(dist.below_mass)


def _loss_cap(scales: np.ndarray, weights: np.ndarray, sigma: float, q: float, relation: str, h: float,
              count: int) -> float:
    """Largest loss the grid resolves for a random scale: the smallest ``T`` whose upper tail
    ``sum_i w_i P_i(L > T)`` is below ``_CAP_MASS / count`` (so the composition charges at most
    ``_CAP_MASS`` to delta for it), and at most ``_LOSS_CAP`` grid points."""
    t_grid = np.geomspace(1e-2, _LOSS_CAP * h, 240)
    pos = scales > 0   # scale 0 (the lower bound's atom at Y = inf) has loss 0
    tail = weights[pos] @ pair_cdfs(t_grid, scales[pos, None] / sigma, q, relation)[1]
    ok = np.nonzero(tail <= _CAP_MASS / count)[0]
    return float(t_grid[ok[0]]) if ok.size else _LOSS_CAP * h


@functools.lru_cache(maxsize=4)
def scale_sums(mechanism: SubsampledGaussian, h: float, bounds: tuple[bool, ...], count: int,
                scale_refinement: float) -> tuple[list[tuple[bool, MixtureSums]], np.ndarray | None, list[float]]:
    """A randomized-clipping step's "remove" pair, reduced to normal-CDF sums per grid (:class:`MixtureSums`:
    ``(sparse, sums)`` per group of scales sharing a grid), the weights of the zero scale per bound (``None``
    without one), and the unbounded mass per bound.

    Both directions are read from it: "add" is the swapped pair on the mirrored grids
    (:meth:`MixtureSums.swapped`), whose normal CDFs are the same, so the second direction costs none (the
    sums are cached, since the directions are built one at a time, and only where the first leaves the
    second in doubt).  The mirrored grid resolves "add" at least as far as "remove": its losses are those
    of the same outputs ``x``, and "add"'s ``P``, ``N(0, 1)``, is within ``1/(1-q)`` of "remove"'s ``P``.

    A random scale is discretized with ``scale_resolution * scale_refinement``.  Both bounds' bins sit on
    one grid of scales (the upper bound's mass at each bin's top, the lower's at its bottom), so the
    bounds are computed together on each scale's loss grid, which is chosen for the larger of its two
    weights: the CDF evaluations are shared.  The envelope's tail reaches losses no grid can hold: losses
    beyond :func:`_loss_cap` are charged to ``+inf`` (upper) or held at the cap (lower), and a scale of weight
    ``w`` is resolved on at most ``max(_TAIL_POINTS, _POINTS_PER_MASS w)`` points."""
    q = mechanism.sample_rate
    # the scales, grids and blocks come from both bounds' bins whichever bounds are asked for, so a bound
    # is the same number computed alone or with the other
    atoms = {b: scale_atoms(mechanism.envelope, mechanism.scale_resolution * scale_refinement, b)
             for b in (True, False)}
    scales = np.unique(np.concatenate([sc for sc, _, _ in atoms.values()]))
    both = np.zeros((2, scales.size))
    for r, (sc, w, _) in enumerate(atoms.values()):
        both[r, np.searchsorted(scales, sc)] = w
    largest = both.max(axis=0)
    weights = both[[0 if b else 1 for b in bounds]]
    # the cap for the larger weights is at least each bound's own
    t_cap = _loss_cap(scales, largest, mechanism.noise_multiplier, q, "remove", h, count)
    t_floor = -_LOSS_CAP * h  # below: placed at the floor (upper) or dropped (lower); never matters for delta
    zero = None
    groups: dict[tuple[int, int, int | None], tuple[list[float], list[int]]] = {}   # scales sharing a grid
    for i, (a, w) in enumerate(zip(scales, largest, strict=True)):
        if a == 0.0:   # the lower bound's atom at Y = inf: loss 0
            zero = weights[:, i].copy()
            continue
        z = float(-special.ndtri(min(1e-4, _RANGE_TAIL / w)))
        points = max(_TAIL_POINTS, int(_POINTS_PER_MASS * w))
        mu = float(a) / mechanism.noise_multiplier
        mus, cols, starts = groups.setdefault(step_grid(mu, q, "remove", h, z, t_cap, points, t_floor, shared=True),
                                              ([], [], []))
        mus.append(mu)
        cols.append(i)
        starts.append(band_start(mu, q, h, z))
    # the scales on one grid are one mixture, computed as one array: its interval masses are the weighted sums
    # (the PLD of a mixture whose label is revealed is the mixture of the PLDs); a sparse grid's band starts at its
    # scales' lowest band_start, so that it holds each one's own losses (grouping by it as well had doubled the
    # groups, and the dense sums each group adds: 2.8 to 3.8 s for one step of Hutch k 8 at h = 1e-4)
    sums = [(n is not None, mixture_sums(np.array(mus), weights[:, cols], q, "remove", h, k_lo, k_hi,
                                         None if n is None else sparse_points(k_lo, k_hi, n, _band(n, k_hi, starts))))
            for (k_lo, k_hi, n), (mus, cols, starts) in groups.items()]
    return sums, zero, [atoms[b][2] for b in bounds]


def _band(points: int, k_hi: int, starts: list[float]) -> int | None:
    """A sparse grid's band start (:func:`~dpmath.pld.losses.sparse_points`): its scales' lowest
    :func:`~dpmath.pld.losses.band_start`, where that lies beyond twice its points and below its top."""
    start = min(starts)
    return math.floor(start) if 2 * points < start < k_hi else None


def step_plds(step: Mechanism, relation: str, h: float, bounds: tuple[bool, ...], count: int = 1,
               scale_refinement: float = 1.0) -> list[Pld]:
    """One accounted step (an entry of :data:`STEPS`) in one neighbouring direction, as a discrete PLD for each bound in
    ``bounds`` (``True``: upper, ``False``: lower), built as its :class:`StepKind` says: a randomized-clipping step
    from :func:`scale_sums`, an epoch of random allocation from :mod:`dpmath.pld.allocation`, the others on one grid
    of up to :data:`MAX_GRID` points."""
    return step_kind(step).build(step, relation, h, bounds, count, scale_refinement)


def _epoch_plds(step: RandomAllocationGaussian, relation: str, h: float, bounds: tuple[bool, ...], count: int,
                scale_refinement: float) -> list[Pld]:
    """An amplified epoch of random allocation (:mod:`dpmath.pld.allocation`)."""
    try:
        plds = epoch_plds(step.noise_multiplier, step.steps, relation, h, bounds, count)
    except OverflowError:   # exp(mu^2 / 2 + ...) of the lognormal terms: mu = 1 / sigma is in the hundreds
        raise GridTooLargeError(
            f"noise_multiplier={step.noise_multiplier:g} is too small for the random-allocation PLD: its likelihood "
            f"ratios (lognormal, exp(1 / (2 sigma^2))) overflow float64, so epsilon is astronomically large; use more "
            f"noise, or bound the epoch by its dominating step ({step.dominating()!r})") from None
    at = bounds.index(True) if True in bounds else None
    # the unamplified bound is an upper PLD of the epoch too (either is sound): a last resort, used where its
    # epsilon at _PROBE_DELTA is the smaller (the octave bands make that rare: not at sigma >= 0.3).  Its grid is
    # built only where the exact Gaussian's epsilon (at most the grid's) is below the epoch's: at sigma = 0.05 the
    # grid (3.8M points) was the epoch's peak memory, 1.45 GB
    if at is not None and _gaussian_probe(step.noise_multiplier) < (amplified := plds[at].epsilon(_PROBE_DELTA)):
        bound, f = _coarse_gaussian(step.dominating(), h)
        if bound.epsilon(_PROBE_DELTA) < amplified:
            plds[at] = _embedded(bound, f)
    return plds


@functools.lru_cache(maxsize=64)
def _gaussian_probe(noise_multiplier: float) -> float:
    """The exact Gaussian step's epsilon at :data:`_PROBE_DELTA` (its lower end): asked again on every loss grid an
    accountant tries, and an mpmath evaluation takes 0.15 s."""
    return GaussianCurve([(noise_multiplier, 1)]).epsilon_bracket(_PROBE_DELTA)[0]


def _coarse_gaussian(step: Gaussian, h: float) -> tuple[Pld, int]:
    """The upper PLD of a Gaussian step on the grid ``h f``, ``f`` the least power of 2 that keeps it within
    :data:`_FALLBACK_POINTS` points, and ``f``: connect-the-dots on a coarser grid is an upper bound too, and its
    arrays stay small (at sigma = 0.05 the grid ``h = 1e-4`` spans 3.8M points and took 1.45 GB to build; its
    epsilon at 1e-5 moves by ``5e-10`` relative on the coarser one)."""
    t_lo, t_hi = loss_range(1.0 / step.noise_multiplier, 1.0, "remove", float(-special.ndtri(_RANGE_TAIL)))
    f = 1
    while (t_hi - t_lo) / (h * f) > _FALLBACK_POINTS:
        f *= 2
    return step_plds(step, "remove", h * f, (True,))[0], f


def _embedded(pld: Pld, f: int) -> Pld:
    """``pld`` on a grid ``f`` times finer: its points are every ``f``-th point there, the same law."""
    if f == 1:
        return pld
    pmf = np.zeros((pld.pmf.size - 1) * f + 1)
    pmf[::f] = pld.pmf
    return Pld(pld.h / f, pld.start * f, pmf, pld.inf, pld.upper, slack=pld.slack)


def _fixed_plds(step: Gaussian | SubsampledGaussian, relation: str, h: float, bounds: tuple[bool, ...], count: int,
                scale_refinement: float) -> list[Pld]:
    """A (subsampled) Gaussian step: scale 1."""
    return _point_plds(step, 1.0, relation, h, bounds)


def _point_plds(step: Gaussian | SubsampledGaussian, point: float, relation: str, h: float,
                bounds: tuple[bool, ...]) -> list[Pld]:
    """A step of the fixed scale ``a = 1 / sqrt(point)``, on one grid."""
    q = step.sample_rate
    mu = 1.0 / math.sqrt(point) / step.noise_multiplier
    if relation == "replace" and q == 1.0:
        relation, mu = "remove", 2.0 * mu  # N(-mu) against N(mu): a Gaussian with shift 2 mu
    k_lo, k_hi, _ = step_grid(mu, q, relation, h, float(-special.ndtri(_RANGE_TAIL)))
    masses = mixture_masses(np.array([mu]), np.ones((len(bounds), 1)), q, relation, h, bounds, k_lo, k_hi, None)
    return [assemble([split(mix([m]), h, upper)], h, upper) for m, upper in zip(masses, bounds, strict=True)]


def _scaled_plds(step: SubsampledGaussian, relation: str, h: float, bounds: tuple[bool, ...], count: int,
                 scale_refinement: float) -> list[Pld]:
    """A randomized-clipping step: a mixture over the envelope's scales (one scale where it is a point mass)."""
    point = step.envelope.point_mass()
    if point is not None:
        return _point_plds(step, point, relation, h, bounds)
    q = step.sample_rate
    fine: list[list[StepMasses]] = [[] for _ in bounds]
    pieces: list[list[tuple[np.ndarray, np.ndarray, float, float]]] = [[] for _ in bounds]
    sums, zero, unbounded = scale_sums(step, h, bounds, count, scale_refinement)
    for r in range(len(bounds) if zero is not None else 0):
        fine[r].append(StepMasses(0, np.zeros(0), np.zeros(0), zero[r:r + 1].copy(), 0.0))
    for sparse, group in sums:
        masses = (group if relation == "remove" else group.swapped()).masses(bounds)
        for r, (m, upper) in enumerate(zip(masses, bounds, strict=True)):
            # a sparse grid's masses are split at once, the dense grids' are added up and split together
            if sparse:
                pieces[r].append(split(m, h, upper))
            else:
                fine[r].append(m)
    out = []
    for r, upper in enumerate(bounds):
        if unbounded[r] > 0:
            fine[r].append(_unbounded_atom(unbounded[r], q, relation, h))
        if fine[r]:
            pieces[r].append(split(mix(fine[r]), h, upper))
        out.append(assemble(pieces[r], h, upper))
    return out


def _unbounded_atom(mass: float, q: float, relation: str, h: float) -> StepMasses:
    """The unbounded scale's ``mass``: atoms whose loss is the supremum over scales (upper bound only)."""
    if relation == "remove" and q < 1:
        return StepMasses(math.ceil(math.log1p(-q) / h), np.zeros(0), np.zeros(0), np.array([mass * (1 - q)]),
                          mass * q)
    if relation == "add" and q < 1:
        return StepMasses(math.ceil(-math.log1p(-q) / h), np.zeros(0), np.zeros(0), np.array([mass]), 0.0)
    return StepMasses(0, np.zeros(0), np.zeros(0), np.zeros(1), mass)


#: How each accounted step is built and read: the PLD accountant's one table, keyed on a mechanism class and whether
#: the step has an envelope (randomized clipping) (:func:`step_kind`; :func:`accounted_step` takes every mechanism of
#: :data:`~dpmath.mechanisms.MECHANISMS` to one of these).
STEPS: dict[tuple[type[Mechanism], bool], StepKind] = {
    (Gaussian, False): StepKind(_fixed_plds, gaussian=True, scaled=False, symmetric=True),
    (SubsampledGaussian, False): StepKind(_fixed_plds, gaussian=True, scaled=False, symmetric=True),
    (SubsampledGaussian, True): StepKind(_scaled_plds, gaussian=False, scaled=True, symmetric=True),
    (RandomAllocationGaussian, False): StepKind(_epoch_plds, gaussian=False, scaled=False, symmetric=False),
}

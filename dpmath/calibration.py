r"""Noise calibration and one-call epsilon for DP-SGD and DP-SGD-RC.

:func:`calibrate_noise_multiplier` finds the smallest noise multiplier ``sigma`` whose **upper-bound** epsilon does not
exceed the target: it brackets the root of the monotone ``epsilon(sigma)``, then narrows the
bracket with safeguarded secant steps (Illinois) in ``log sigma`` until it is ``rtol`` wide, and
returns the bracket's upper end, which was evaluated and meets the target.  It never overshoots:
the returned sigma is one whose epsilon was computed, not an interpolated guess.  For DP-SGD-RC the
search starts from the plain DP-SGD answer and takes three Newton steps on a coarse grid (100x the loss step, 4x
the scale bins); one evaluation on a medium grid (10x the loss step: epsilon within about 1e-4 of the requested
grid's) then takes a Newton step with the coarse slope, and one evaluation on the requested grid, aimed just above
that root, confirms the answer where it meets the target within ``rtol`` (or a second aim, or a last search there,
moves it); only the requested grid's epsilon decides the result.  Each epsilon query cuts the steps' farthest
losses, up to ``1e-6`` of delta (:data:`dpmath.pld.compose.CUT`), which shrinks a heavy-tailed envelope's FFT
window about four-fold.  The README's former setting (Hutch, ``k = 16``, ``D = 24``, q = 0.05, 60 steps, epsilon 2)
took 3.4 s cold with a search on the requested grid, 2.1 s with a medium-grid search, and 0.98 s on the envelope's
own scale step; the medium and requested grids now read the default accountant's first scale grid
(:data:`~dpmath.pld.accountant.AUTO_SCALE_START`, half the step), which gives 0.05 % less noise in 1.8 s
(``benchmarks/calibration_bench.py --compare``).  A search that runs longer than
:data:`PROGRESS_AFTER` seconds logs each evaluation as an INFO record of the ``"dpmath"`` logger.

A large target is searched on a coarser grid: the loss step is at least ``1e-5`` times ``target_epsilon``
(``1e-3`` at 100, ``1e-2`` at 1000), since the losses that make epsilon large span a grid in proportion to it.
Upper bounds barely move (at sigma = 0.10849, q = 0.01, 1000 steps, delta = 1e-5: 999.80151 at ``h = 1e-4``,
999.80045 at ``1e-2``), and each evaluation costs a tenth to a hundredth (16 s to 0.2 s there): targets of 100,
1e3 and 1e4 took 3.8, 34 and 45 s, and take 0.4, 0.5 and 0.3 s.  ``target_epsilon`` is at most ``1e5``, where the
step reaches 1, the accountant's coarsest.

:func:`dpsgd_epsilon` is the common case in one call (:func:`dpsgd_epsilon_bracket` with both ends of the
bracket), and :func:`estimator_envelope` maps an estimator name (``"exact"``, ``"hutch"``, ``"hutchpp"``)
and ``(projection_dim, dim)`` to its envelope.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from typing import NamedTuple

from .envelope import Envelope
from .hutch import HutchEnvelope, HutchPPEnvelope
from .mechanisms import SubsampledGaussian
from .pld import GridTooLargeError, PLDAccountant
from .pld.accountant import AUTO, AUTO_SCALE_START, published_epsilon
from .rdp import RDPAccountant
from .validation import open_probability, positive_int, positive_real, real_number
from .validation import sample_rate as checked_sample_rate

__all__ = ["Bracket", "calibrate_noise", "calibrate_noise_multiplier", "dpsgd_epsilon",
           "dpsgd_epsilon_bracket", "estimator_envelope"]

_ESTIMATORS = ("exact", "hutch", "hutchpp")


class Bracket(NamedTuple):
    """``(lower, upper)`` bounds on a privacy quantity; publish ``upper``.

    Examples
    --------
    >>> from dpmath import Bracket
    >>> Bracket(0.69, 0.70).upper
    0.7
    """

    lower: float
    upper: float


@functools.lru_cache(maxsize=32)
def estimator_envelope(estimator: str, projection_dim: int = 32, dim: int = 2048) -> Envelope | None:
    """The envelope of a norm estimator: ``None`` for exact norms, :class:`~dpmath.HutchEnvelope` or
    :class:`~dpmath.HutchPPEnvelope` with ``k = projection_dim`` probes and ``d = dim`` chi-square terms
    (for a model, summed over its layers; see :class:`~dpmath.HutchEnvelope`), cached, so repeated calls
    reuse one envelope and its discretization.

    Examples
    --------
    >>> from dpmath.calibration import estimator_envelope
    >>> estimator_envelope("hutch", 32, 2048), estimator_envelope("exact")
    (HutchEnvelope(projection_dim=32, dim=2048, family='heavy-light'), None)
    """
    if estimator not in _ESTIMATORS:
        raise ValueError(f"estimator must be one of {_ESTIMATORS}, got {estimator!r}")
    if estimator == "exact":
        return None
    k = positive_int(projection_dim, "projection_dim")
    d = positive_int(dim, "dim")
    return HutchEnvelope(k, d) if estimator == "hutch" else HutchPPEnvelope(k, d)


logger = logging.getLogger("dpmath")

#: a search running longer than this logs each evaluation as an INFO record of the ``"dpmath"`` logger
PROGRESS_AFTER = 2.0

_SCALE_RESOLUTION = SubsampledGaussian.__dataclass_fields__["scale_resolution"].default
_FAR = 1e-2         # a Newton step from the coarse root longer than this (in log sigma) is not aimed, but searched
_OVERSHOOT = 1e-2   # the part of an aimed Newton step added back (the coarse slope's bias)
_RELATIVE_STEP = 1e-5   # the search's grid step is at least this times target_epsilon ...
_MAX_TARGET = 1e5       # ... up to 1, the accountant's coarsest, at this target: none is larger


def _epsilon(sigma: float, q: float, steps: int, delta: float, envelope: Envelope | None, accountant: str,
             discretization: float, scale_resolution: float = _SCALE_RESOLUTION,
             bracket_rtol: float | str | None = None) -> float:
    if accountant == "rdp":
        return RDPAccountant().compose(SubsampledGaussian(sigma, q, envelope), steps).epsilon(delta)
    h = discretization
    for _ in range(3):
        try:
            return published_epsilon(PLDAccountant(h, bracket_rtol=bracket_rtol).compose(
                SubsampledGaussian(sigma, q, envelope, scale_resolution), steps), delta)
        except GridTooLargeError:
            # far from the answer (tiny sigma) the loss can outgrow the grid; a coarser grid still gives an
            # upper bound on epsilon, which is all the search needs there
            if h >= 0.1:
                raise
            h = min(10 * h, 0.1)
    return math.inf


def calibrate_noise_multiplier(target_epsilon: float, target_delta: float, sample_rate: float, steps: int, *,
                               envelope: Envelope | None = None, accountant: str = "pld",
                               discretization: float = 1e-4, rtol: float = 1e-4,
                               bracket_rtol: float | str | None = AUTO) -> float:
    r"""Smallest noise multiplier ``sigma`` with ``epsilon(sigma) <= target_epsilon`` (upper bound) at
    ``target_delta``, as Opacus' ``make_private_with_epsilon`` would need.

    Parameters
    ----------
    target_epsilon : float
        The privacy budget, in ``(0, 1e5]``.
    target_delta : float
        ``delta``, in ``(0, 1)``.
    sample_rate : float
        ``q``, the sampling probability (batch size / data-set size), in ``(0, 1]``.
    steps : int
        Number of DP-SGD steps, ``>= 1``.
    envelope : Envelope, optional
        Envelope of the norm estimator for DP-SGD-RC (see :func:`estimator_envelope`); ``None`` is
        plain DP-SGD.
    accountant : {"pld", "rdp"}
        Accountant; ``"rdp"`` only for plain DP-SGD.
    discretization : float
        PLD grid step, or ``1e-5 * target_epsilon`` where that is coarser (module docstring).
    rtol : float
        Relative width of the final bracket, in ``[1e-8, 0.1]``; the result exceeds the exact
        minimizer of the computed ``epsilon(sigma)`` by at most this fraction.
    bracket_rtol : float, "auto" or None
        The accountant whose upper end must meet the target (:class:`~dpmath.PLDAccountant`'s ``bracket_rtol``;
        default ``"auto"``, what ``PLDAccountant()`` publishes).  The search runs on the coarse grid (``None``), whose
        upper ends are never below the default's; a last search with this accountant starts from its answer, and
        is skipped where that accountant's epsilon there is so close to the coarse one that sigma would move by
        less than ``rtol`` (the coarse answer meets the target on both).

    Returns
    -------
    float
        The noise multiplier ``sigma``, evaluated to satisfy the target with ``bracket_rtol``'s accountant.

    Examples
    --------
    >>> from dpmath import calibrate_noise_multiplier
    >>> round(calibrate_noise_multiplier(1.0, 1e-5, 0.01, 1000), 3)
    1.415
    """
    eps_t = positive_real(target_epsilon, "target_epsilon")
    if eps_t > _MAX_TARGET:
        raise ValueError(
            f"target_epsilon must lie in (0, {_MAX_TARGET:g}], got {target_epsilon!r}: an epsilon above "
            f"{_MAX_TARGET:g} lets two neighbouring data sets' likelihood ratio exceed e^{_MAX_TARGET:g}, which is no "
            f"privacy at all, "
            f"and its search would need grids of millions of points; to see the epsilon of a given noise level, use "
            f"dpsgd_epsilon")
    d = open_probability(target_delta, "target_delta")
    qq = checked_sample_rate(sample_rate, "sample_rate")
    n = positive_int(steps, "steps")
    if accountant not in ("pld", "rdp"):
        raise ValueError(f"accountant must be 'pld' or 'rdp', got {accountant!r}")
    if envelope is not None and not isinstance(envelope, Envelope):
        raise ValueError(f"envelope must be a dpmath Envelope or None, got {type(envelope).__name__}")
    rt = real_number(rtol, "rtol", allow_inf=False)
    if not 1e-8 <= rt <= 0.1:
        raise ValueError(f"rtol must lie in [1e-8, 0.1], got {rtol!r}")

    PLDAccountant(bracket_rtol=bracket_rtol)   # checks it now, with the accountant's message
    start = time.perf_counter()

    def objective(scale_resolution: float, h: float, env: Envelope | None = envelope, refined=None):
        def f(s: float) -> float:
            # log epsilon is close to linear in log sigma, so secant steps on it converge in a few calls
            e = _epsilon(s, qq, n, d, env, accountant, h, scale_resolution, refined)
            if (elapsed := time.perf_counter() - start) > PROGRESS_AFTER:
                logger.info("calibrating: noise_multiplier %.6g gives epsilon %.6g (target %g; grid step %g) after "
                            "%.1f s", s, e, eps_t, h, elapsed)
            return math.log(e / eps_t) if 0 < e < math.inf else (math.inf if e == math.inf else -math.inf)
        return f

    # a large target is searched on a grid step in proportion (module docstring): the same upper bounds, to a
    # millionth, in a tenth of the time or less
    h = max(real_number(discretization, "discretization", allow_inf=False), min(_RELATIVE_STEP * eps_t, 1.0))
    # memoized: the last search reads the coarse value at its start
    f = functools.lru_cache(maxsize=None)(objective(_SCALE_RESOLUTION, h))
    context = f"target_delta={d:g}, sample_rate={qq:g}, steps={n}"

    # the accountant whose epsilon decides the answer: the default's upper end ("auto") is the least over the grids
    # it builds, the first of which is the requested grid unrefined, so that grid's upper end bounds it (at half the
    # cost of the refined bracket: no lower end, no finer grid); a float or None bracket_rtol is its own
    # (with randomized clipping that first grid's scale step is AUTO_SCALE_START of the envelope's)
    published_scale = _SCALE_RESOLUTION * (AUTO_SCALE_START if bracket_rtol == AUTO else 1.0)
    if bracket_rtol == AUTO and envelope is not None:
        final = functools.lru_cache(maxsize=None)(objective(published_scale, h))
    else:
        final = f if bracket_rtol is None else functools.lru_cache(maxsize=None)(
            objective(_SCALE_RESOLUTION, h, refined=bracket_rtol))
    # the search's grid decides where it is the published one; RDP has no grid; a large target's search runs on a
    # grid in proportion, not the published one (module docstring)
    decides = accountant == "rdp" or h > discretization

    def confirmed(sigma: float, slope: float, searched) -> float:
        """The answer of a search on ``searched`` (a coarser grid, or the requested grid without ``bracket_rtol``)
        on the published accountant: the search's answer where that accountant's epsilon there meets the target and
        is within the search's tolerance of the searched one, else a last search from it."""
        if searched is final or decides:
            return sigma
        # where the published log epsilon meets the target and is below the searched one by less than rtol times
        # the slope, a last search would move sigma by less than rtol: the searched answer stands
        if final(sigma) <= 0 and searched(sigma) - final(sigma) <= rt * abs(slope):
            return sigma
        return _search(final, sigma, [1.01, 1.05, 1.2], eps_t, context, rt, slope)[0]

    if envelope is None:
        return confirmed(*_search(f, 1.0, [2.0], eps_t, context, rt), f)
    # a randomized-clipping step costs ~100 plain ones: start from the plain DP-SGD answer; take three Newton steps
    # on a coarse grid (4x the scale bins, 100x the loss step); one evaluation on a medium grid (10x the loss step:
    # its epsilon is within 1e-4 of the requested grid's on the README's and the studies' settings, at half the
    # cost) takes a Newton step with the coarse slope (within about 1 % of the requested grid's); one evaluation on
    # the published accountant, aimed rtol / 2 above that root, confirms it where it meets the target within rtol,
    # else a last search there moves it
    coarse_h = max(h, min(100 * h, 1e-2))
    plain, plain_slope = _search(objective(_SCALE_RESOLUTION, coarse_h, None), 1.0, [2.0],
                                 eps_t, context, 1e-2)
    # memoized: where the Newton steps fail, the bracketing search starts from the sigma they evaluated first
    coarse_f = functools.lru_cache(maxsize=None)(objective(4 * _SCALE_RESOLUTION, coarse_h))
    coarse, slope = _newton_start(coarse_f, plain, plain_slope)
    if coarse is None:   # the Newton steps did not work out: a bracketing search on the coarse grid
        coarse, slope = _search(coarse_f, plain, [1.03, 1.1, 1.3], eps_t, context, 1e-3, plain_slope)
    medium_h = max(h, min(10 * h, 1e-2))
    # on the published accountant's scale grid: the Newton step from it aims at that accountant's root
    medium = functools.lru_cache(maxsize=None)(objective(published_scale, medium_h)) if medium_h != h else (
        final if bracket_rtol == AUTO else f)
    if decides:
        return _search(medium, coarse, [1.01, 1.05, 1.2], eps_t, context, rt, slope)[0]
    value = medium(coarse)
    if not (math.isfinite(value) and slope < 0) or abs(value / slope) > _FAR:
        # the coarse root is far from the medium grid's (small targets, where the coarse scale bins are loose): the
        # coarse slope cannot aim to rtol from there, so the medium grid is searched to rtol and confirmed
        return confirmed(*_search(medium, coarse, [1.01, 1.05, 1.2], eps_t, context, rt, slope), medium)
    aim = coarse
    for _ in range(2):   # a second aim from the first's value: a step of a few rtol, where the slope's error is moot
        # the coarse slope is the flatter (wider scale bins; a secant from above the root), so the Newton step
        # overshoots by up to 2 % of itself: aimed 1 % of the step higher, and rtol / 2 above the predicted root
        step = -value / slope
        aim *= math.exp(step + 0.5 * math.log1p(rt) + _OVERSHOOT * abs(step))
        value = final(aim)
        # below the target by less than rtol times the slope: the root lies within rtol below the aim
        if -rt * abs(slope) <= value <= 0:
            return aim
        if not math.isfinite(value):
            break
    return _search(final, aim, [1.01, 1.05, 1.2], eps_t, context, rt, slope)[0]


def _newton_start(f, guess: float, slope: float) -> tuple[float | None, float]:
    """Three Newton steps on ``f(log sigma)`` from ``guess`` with ``slope``, each later one with the secant slope of
    the last two evaluations: a start for the searches on finer grids, and the slope between the last two, which
    are close to the root, so it is the local slope (within about 1 % of the requested grid's, where the first
    secant can be 10 % off).  ``None`` where a value or a slope is not finite and negative."""
    x, fx = math.log(guess), f(guess)
    for _ in range(2):
        if not (math.isfinite(fx) and slope < 0):
            return None, slope
        x_next = x - fx / slope
        f_next = f(math.exp(x_next))
        slope = (f_next - fx) / (x_next - x) if math.isfinite(f_next) and x_next != x else math.nan
        x, fx = x_next, f_next
    if not slope < 0:
        return None, slope
    return math.exp(x - fx / slope), slope


def calibrate_noise(epsilon: Callable[[float], float], target_epsilon: float, *, guess: float = 1.0,
                    rtol: float = 1e-4) -> float:
    r"""Smallest noise multiplier ``sigma`` with ``epsilon(sigma) <= target_epsilon``, for any mechanism.

    The search of :func:`calibrate_noise_multiplier` (bracketing, then Illinois steps on ``log sigma``; the returned
    ``sigma`` is one whose epsilon was evaluated and meets the target) over a caller's ``epsilon(sigma)``,
    which must be non-increasing, e.g. an :class:`RDPAccountant` over a mechanism of
    :mod:`dpmath.twice_sampling`.

    Parameters
    ----------
    epsilon : callable
        ``sigma -> epsilon`` (an upper bound), non-increasing in ``sigma``.
    target_epsilon : float
        The budget, ``> 0``.
    guess : float
        Where the search starts, ``> 0``.
    rtol : float
        Relative width of the final bracket, in ``[1e-8, 0.1]``.

    Examples
    --------
    >>> from dpmath import RDPAccountant, calibrate_noise
    >>> from dpmath.twice_sampling import TwiceSampledGaussian
    >>> def eps(s):
    ...     return RDPAccountant().compose(TwiceSampledGaussian(s, 0.01, 0.5, 1.0, 0.1), 1000).epsilon(1e-5)
    >>> s = calibrate_noise(eps, 1.0)
    >>> bool(eps(s) <= 1.0 < eps(s * (1 - 2e-4)))
    True
    """
    if not callable(epsilon):
        raise ValueError(f"epsilon must be a callable sigma -> epsilon, got {type(epsilon).__name__}")
    eps_t = positive_real(target_epsilon, "target_epsilon")
    start = positive_real(guess, "guess")
    rt = real_number(rtol, "rtol", allow_inf=False)
    if not 1e-8 <= rt <= 0.1:
        raise ValueError(f"rtol must lie in [1e-8, 0.1], got {rtol!r}")

    def f(s: float) -> float:
        e = float(epsilon(s))
        return math.log(e / eps_t) if 0 < e < math.inf else (math.inf if e == math.inf else -math.inf)

    return _search(f, start, [2.0], eps_t, "the given epsilon function", rt)[0]


def _search(f, guess: float, factors: list[float], eps_t: float, context: str, rt: float,
            slope: float | None = None) -> tuple[float, float]:
    """Smallest sigma with ``f(sigma) <= 0`` to relative width ``rt``, and the final bracket's slope
    ``d f / d log sigma``: grow or shrink ``guess`` by ``factors`` (then doubling) until the root is
    bracketed, then Illinois steps on ``log sigma``.  With a ``slope`` (from a coarser search) the first
    step is the Newton step from ``guess``, overshot by ``2 rt`` so that it usually brackets the root."""
    lo = hi = guess
    f_lo = f_hi = f(guess)
    if slope is not None and slope < 0 and math.isfinite(f_hi):
        # the Newton root from the coarse slope is usually within rt / 2 of the true one: two points 0.8 rt
        # apart around it then bracket the root to rt (three evaluations in all), else they start the search
        x = math.log(guess) - f_hi / slope
        m = 0.4 * math.log1p(rt)
        a, b = math.exp(x - m), math.exp(x + m)
        f_a, f_b = f(a), f(b)
        if f_a > 0 >= f_b:
            return b, (f_b - f_a) / (2 * m) if math.isfinite(f_a) and math.isfinite(f_b) else -1.0
        # the smallest evaluated sigma that meets the target, and the largest that misses it, go on
        known = sorted([(guess, f_hi), (a, f_a), (b, f_b)])
        meets = [(s, v) for s, v in known if v <= 0]
        misses = [(s, v) for s, v in known if v > 0]
        if meets and misses:
            (lo, f_lo), (hi, f_hi) = misses[-1], meets[0]
        elif meets:
            lo = hi = meets[0][0]
            f_lo = f_hi = meets[0][1]
        else:
            lo = hi = misses[-1][0]
            f_lo = f_hi = misses[-1][1]
    steps = iter(factors + [2.0] * 40)
    if f_hi > 0:
        while f_hi > 0:
            lo, f_lo = hi, f_hi
            hi *= next(steps)
            if hi > 1e8:
                raise ValueError(f"no noise multiplier <= 1e8 reaches epsilon = {eps_t:g} ({context})")
            f_hi = f(hi)
    else:
        while f_lo <= 0:
            hi, f_hi = lo, f_lo
            lo /= next(steps)
            if lo < 1e-3:
                return hi, -1.0  # epsilon stays below the target down to sigma = 2e-3: noise is not the constraint
            f_lo = f(lo)
    # invariant: f(lo) > 0 >= f(hi); Illinois steps on log sigma
    x_lo, x_hi = math.log(lo), math.log(hi)
    side = 0
    while x_hi - x_lo > math.log1p(rt):
        # bisect where epsilon underflowed to 0 (f = -inf) or overflowed: a secant step through it is NaN
        finite = math.isfinite(f_lo) and math.isfinite(f_hi) and f_lo != f_hi
        x = x_hi - f_hi * (x_hi - x_lo) / (f_hi - f_lo) if finite else 0.5 * (x_lo + x_hi)
        # keep the trial point off the bracket ends so the bracket always shrinks
        margin = 0.5 * math.log1p(rt)
        x = min(max(x, x_lo + margin), x_hi - margin)
        fx = f(math.exp(x))
        if fx > 0:
            x_lo, f_lo = x, fx
            if side == -1:
                f_hi *= 0.5
            side = -1
        else:
            x_hi, f_hi = x, fx
            if side == 1:
                f_lo *= 0.5
            side = 1
    finite = math.isfinite(f_lo) and math.isfinite(f_hi) and x_hi > x_lo
    return math.exp(x_hi), ((f_hi - f_lo) / (x_hi - x_lo) if finite else -1.0)


def dpsgd_epsilon_bracket(noise_multiplier: float, sample_rate: float, steps: int, delta: float, *,
                          estimator: str = "exact", projection_dim: int = 32, dim: int = 2048,
                          discretization: float = 1e-4, bracket_rtol: float | str | None = AUTO) -> Bracket:
    r"""The ``[lower, upper]`` bracket of epsilon of DP-SGD (``estimator="exact"``) or DP-SGD-RC (``"hutch"``,
    ``"hutchpp"``) in one call; ``upper`` is the number to publish (:func:`dpsgd_epsilon`).

    Composes ``steps`` Poisson-subsampled steps in a :class:`~dpmath.PLDAccountant` and brackets
    ``epsilon(delta)``.

    Parameters
    ----------
    noise_multiplier : float
        ``sigma``, the noise standard deviation over the clipping norm, ``> 0``.
    sample_rate : float
        ``q``, the batch size over the data-set size, in ``(0, 1]``.
    steps : int
        Number of steps, ``>= 1``.
    delta : float
        In ``(0, 1)``.
    estimator : {"exact", "hutch", "hutchpp"}
        How per-example norms are obtained.
    projection_dim, dim : int
        ``k`` probes and ``d`` chi-square terms of the envelope (:func:`estimator_envelope`; ignored for
        ``"exact"``).
    discretization : float
        PLD grid step.
    bracket_rtol : float, "auto" or None
        How tight the bracket is (:class:`~dpmath.PLDAccountant`): ``"auto"`` (default) 0.1 % (0.5 % with an
        estimator) within about a second, ``None`` the coarse single grid.

    Returns
    -------
    Bracket
        ``(lower, upper)``.

    Examples
    --------
    >>> from dpmath import dpsgd_epsilon_bracket
    >>> r = dpsgd_epsilon_bracket(1.0, 0.01, 1000, 1e-5, estimator="hutch", projection_dim=32, dim=2048)
    >>> bool(r.lower <= r.upper), r.upper > 1.828
    (True, True)
    """
    env = estimator_envelope(estimator, projection_dim, dim)
    n = positive_int(steps, "steps")   # checked here, so that an error names it (the accountant calls it count)
    acc = PLDAccountant(discretization, bracket_rtol=bracket_rtol).compose(
        SubsampledGaussian(noise_multiplier, sample_rate, env), n)
    return Bracket(*acc.epsilon_bracket(delta))


def dpsgd_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, *,
                  estimator: str = "exact", projection_dim: int = 32, dim: int = 2048,
                  discretization: float = 1e-4, bracket_rtol: float | str | None = AUTO) -> float:
    r"""Epsilon of DP-SGD or DP-SGD-RC at ``delta``, the certified upper bound: like Opacus'
    ``get_epsilon(delta)``, in one call.

    The upper end of :func:`dpsgd_epsilon_bracket` (the same computation and arguments).

    Examples
    --------
    >>> from dpmath import dpsgd_epsilon
    >>> round(dpsgd_epsilon(1.0, 0.01, 1000, 1e-5), 3)
    1.828
    """
    return dpsgd_epsilon_bracket(noise_multiplier, sample_rate, steps, delta, estimator=estimator,
                                 projection_dim=projection_dim, dim=dim, discretization=discretization,
                                 bracket_rtol=bracket_rtol).upper

r"""Mechanisms: small immutable descriptions that accountants compose.

Every mechanism releases a sum of clipped vectors plus Gaussian noise of standard deviation ``sigma``
(the ``noise_multiplier``) times the clipping norm, so one example moves the output by a vector of norm
at most ``a / sigma`` noise standard deviations, where ``a`` is the example's *scale*; ``q`` is the
``sample_rate``:

* :class:`Gaussian`: ``a = 1``, every step (no sampling).
* :class:`SubsampledGaussian`: ``a = 1``, the example is in the batch with probability ``q``
  (Poisson sampling).
* Randomized clipping (DP-SGD-RC), the ``envelope`` of any sampling scheme: the norm is *estimated*, so the
  clipped contribution has the random norm ``a = 1 / sqrt(Y)`` with ``Y`` drawn from an envelope (paper 000,
  Sec. 5.2 and Lemma B.2-B.3).  Under Poisson sampling (:class:`SubsampledGaussian` with an ``envelope``) the
  dominating pair is ``(a, q N(a/sigma, 1) + (1-q) N(0, 1))`` against ``(a, N(0, 1))``.  ``a`` is part of the
  output, so the pair's hockey-stick curve is the ``Y``-average of subsampled-Gaussian curves.
* :class:`SubsampledL2Laplace`: LAP2, Laplace noise instead of Gaussian; accounted through the
  subsampled Gaussian that dominates it (:mod:`dpmath.lap2`).

How examples are chosen is part of the mechanism too (:doc:`/sampling`):

* :class:`TruncatedSubsampledGaussian`: Poisson sampling with at most ``max_batch_size`` examples a step: a
  mixture of scale 1 (the batch not cut) and scale 2 (cut: the example replaces another).
* :class:`FixedSizeSubsampledGaussian`: batches of exactly ``B`` examples without replacement, replacing one
  example (``a = 2`` against the other example's gradient).
* :class:`RandomAllocationGaussian` (balls in bins) and :class:`ShuffledGaussian`: one epoch in which every
  example is in exactly one step, bounded by one Gaussian step (no amplification is certified for them).

A mechanism validates its arguments once, at construction; accountants never see an invalid one.

Every mechanism is a :class:`Mechanism` and is listed in :data:`MECHANISMS`, the registry the accountants read.
What an accountant needs to know of a mechanism besides its parameters (the step that dominates it, the neighbouring
relation its analysis covers, whether it is amplified or charged to delta apart) is a member of its class here; only
how an accountant computes a step is its own, in one table keyed on these classes and on whether a step has an
``envelope``, randomized clipping (:data:`dpmath.pld.steps.STEPS`, the RDP accountant's Gaussian steps).  Adding a
mechanism is a class here, its entry in :data:`MECHANISMS`, and each accountant's handling of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .accountant import Neighboring
from .envelope import DiscreteEnvelope, Envelope, ReplacementEnvelope
from .validation import positive_int, positive_real, real_number
from .validation import sample_rate as checked_sample_rate

__all__ = ["Mechanism", "MECHANISMS", "Gaussian", "SubsampledGaussian", "SubsampledL2Laplace",
           "FixedSizeSubsampledGaussian", "TruncatedSubsampledGaussian", "RandomAllocationGaussian", "ShuffledGaussian"]


class Mechanism:
    """Base class of the mechanisms: what an accountant reads of every one besides its parameters.

    Each mechanism also has a ``sample_rate``, the probability that a given example takes part in one run, and a
    ``noise_multiplier`` (LAP2: a ``scale``).  The defaults here are those of a single Gaussian step; a sampling
    scheme overrides what differs.

    Examples
    --------
    >>> from dpmath.mechanisms import FixedSizeSubsampledGaussian, Mechanism, SubsampledGaussian
    >>> step = SubsampledGaussian(1.0, 0.01)
    >>> isinstance(step, Mechanism), step.dominating() is step, step.neighboring
    (True, True, None)
    >>> FixedSizeSubsampledGaussian.neighboring
    <Neighboring.REPLACE_ONE: 'replace_one'>
    """

    #: The one neighbouring relation the mechanism's analysis covers, whose pairs are :meth:`dominating`'s pairs for
    #: adding and removing an example; ``None`` where it covers both, each by :meth:`dominating`'s pairs for it.
    neighboring: ClassVar[Neighboring | None] = None
    #: Why the other relation is not covered, where :attr:`neighboring` names one.
    uncovered: ClassVar[str] = ""

    def dominating(self) -> Mechanism:
        """The step whose pairs dominate this mechanism's, composed in its place: the mechanism itself for a Gaussian
        step (:class:`Gaussian`, :class:`SubsampledGaussian` with or without an envelope)."""
        return self

    @property
    def amplified(self) -> bool:
        """Whether adding or removing an example is accounted by the mechanism's own PLD rather than by
        :meth:`dominating` (only an epoch of :class:`RandomAllocationGaussian` has one)."""
        return False

    @property
    def charged(self) -> bool:
        """Whether each run also charges a probability to delta, outside its pairs (only
        :class:`TruncatedSubsampledGaussian` with randomized clipping: its ``overflow_probability()``)."""
        return False

    def decomposed(self) -> tuple[Mechanism, int]:
        """``(mechanism, k)``: one run of this mechanism is dominated by ``k`` runs of ``mechanism`` composed, which
        the accountants compose in its place (the mechanism itself once, except an epoch of
        :class:`RandomAllocationGaussian` with several participations)."""
        return self, 1


@dataclass(frozen=True)
class Gaussian(Mechanism):
    r"""The Gaussian mechanism with noise multiplier ``sigma`` (noise std / sensitivity).

    Its privacy-loss distribution is ``N(mu^2/2, mu^2)`` with ``mu = 1/sigma`` in both neighbouring
    directions, and its Renyi divergence of order ``alpha`` is ``alpha / (2 sigma^2)``.

    Parameters
    ----------
    noise_multiplier : float
        ``sigma``, the noise standard deviation over the sensitivity, ``> 0``.

    Examples
    --------
    >>> from dpmath import Gaussian
    >>> Gaussian(2.0)
    Gaussian(noise_multiplier=2.0)
    >>> Gaussian(0.0)
    Traceback (most recent call last):
    ...
    ValueError: noise_multiplier must be positive (> 0), got 0.0
    """

    noise_multiplier: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", positive_real(self.noise_multiplier, "noise_multiplier"))

    @property
    def sample_rate(self) -> float:
        """Sampling probability: 1 (every step sees the example).

        Examples
        --------
        >>> from dpmath import Gaussian
        >>> Gaussian(3.0).sample_rate
        1.0
        """
        return 1.0


def _optional_envelope(envelope: object) -> Envelope | None:
    if envelope is not None and not isinstance(envelope, Envelope):
        raise ValueError(f"envelope must be a dpmath Envelope or None, got {type(envelope).__name__}")
    return envelope


@dataclass(frozen=True, repr=False)
class SubsampledGaussian(Mechanism):
    r"""The Poisson-subsampled Gaussian mechanism: one step of DP-SGD, or of DP-SGD-RC with an ``envelope``.

    Each example is in the batch independently with probability ``q``; the clipped sum gets
    ``N(0, sigma^2)`` noise per coordinate.  With unit-variance coordinates and ``mu = 1/sigma`` the
    dominating pairs are ``(q N(mu, 1) + (1-q) N(0, 1), N(0, 1))`` when an example is removed, the swap
    when one is added, and ``(q N(-mu, 1) + (1-q) N(0, 1), q N(mu, 1) + (1-q) N(0, 1))`` when one is
    replaced.

    **Randomized clipping** (an ``envelope``: DP-SGD-RC).  The sensitivity is the random scale
    ``a = 1/sqrt(Y)``, where ``Y`` follows the envelope (:class:`~dpmath.HutchEnvelope`,
    :class:`~dpmath.HutchPPEnvelope`, or any :class:`~dpmath.Envelope`).  The dominating pair (paper 000,
    Sec. 5.2) is

    .. math::

        P = \big(a,\; q\,\mathcal N(a/\sigma, 1) + (1-q)\,\mathcal N(0, 1)\big),\qquad
        Q = \big(a,\; \mathcal N(0, 1)\big),

    so its hockey-stick divergence is ``E_Y[H_{e^eps}]`` of the subsampled Gaussian with noise
    ``sigma * sqrt(Y)``.  The accountant discretizes ``Y`` on a grid whose scales ``a`` are spaced by
    the relative step ``scale_resolution``: pessimistically (each bin's mass at its largest scale, the
    mass below the grid charged to delta) for the upper bound, optimistically for the lower bound.
    With a constant ``Y = 1`` (:class:`~dpmath.PointMassEnvelope`) its pairs are those of the step without an
    envelope; the accountants still treat it as randomized clipping (the PLD accountant's scale grid of one scale,
    the RDP accountant's refusal).  The PLD accountant covers randomized clipping for adding or removing an example
    only.

    Its Renyi divergence is infinite for every order (paper 000, App. B.2): ``a`` has a polynomial
    tail, ``P(a > s) ~ s^{-k}``, so ``E[exp(alpha (alpha-1) a^2 / (2 sigma^2))]`` diverges.  Only
    the PLD accountant accepts it.

    Parameters
    ----------
    noise_multiplier : float
        ``sigma``, the noise standard deviation over the clipping norm, ``> 0``.
    sample_rate : float
        ``q``, the sampling probability (batch size / data-set size), in ``(0, 1]``.
    envelope : Envelope, optional
        Randomized clipping's envelope: the distribution of the squared-norm ratio ``Y`` (estimate / true
        norm, squared, worst case).  ``None`` (default): exact norms, ``a = 1``.
    scale_resolution : float
        Relative spacing of the envelope's scale grid, in ``(0, 0.1]`` (default ``2e-3``; not shown in the
        ``repr``).

    Examples
    --------
    >>> from dpmath import HutchEnvelope, SubsampledGaussian
    >>> SubsampledGaussian(1.1, 256 / 60000)
    SubsampledGaussian(noise_multiplier=1.1, sample_rate=0.004266666666666667)
    >>> SubsampledGaussian(4.0, 0.01, HutchEnvelope(projection_dim=32, dim=2048))
    SubsampledGaussian(noise_multiplier=4.0, sample_rate=0.01,
                       envelope=HutchEnvelope(projection_dim=32, dim=2048, family='heavy-light'))
    >>> SubsampledGaussian(1.0, 1.5)
    Traceback (most recent call last):
    ...
    ValueError: sample_rate must lie in (0, 1], got 1.5
    """

    noise_multiplier: float
    sample_rate: float
    envelope: Envelope | None = None
    scale_resolution: float = 2e-3

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", positive_real(self.noise_multiplier, "noise_multiplier"))
        object.__setattr__(self, "sample_rate", checked_sample_rate(self.sample_rate, "sample_rate"))
        object.__setattr__(self, "envelope", _optional_envelope(self.envelope))
        r = real_number(self.scale_resolution, "scale_resolution", allow_inf=False)
        if not 0 < r <= 0.1 or math.isnan(r):
            raise ValueError(f"scale_resolution must lie in (0, 0.1], got {self.scale_resolution!r}")
        object.__setattr__(self, "scale_resolution", r)

    def __repr__(self) -> str:
        # the envelope only where there is one: a step with exact norms reads as the plain DP-SGD step it is
        tail = "" if self.envelope is None else f", envelope={self.envelope!r}"
        return (f"{type(self).__name__}(noise_multiplier={self.noise_multiplier!r}, "
                f"sample_rate={self.sample_rate!r}{tail})")


LAPLACE_GDP_FACTOR = math.sqrt(math.pi / 2.0)
"""``c = sqrt(pi/2)``: a Laplace shift of ``t`` noise scales is dominated by ``G_{c t}`` (:mod:`dpmath.lap2`)."""


@dataclass(frozen=True)
class SubsampledL2Laplace(Mechanism):
    r"""LAP2 (paper 003): Poisson sampling ``q``, l2 clipping, independent Laplace noise on each coordinate.

    ``scale`` is the Laplace scale ``b`` in units of the clipping norm ``C`` (``b / C``).  Accountants
    compose it through its Gaussian domination (:mod:`dpmath.lap2`): a coordinate shifted by ``u`` is
    dominated by ``G_{c u / b}`` with ``c = sqrt(pi/2)``, coordinates compose to ``G_{c ||g||_2 / b}
    >= G_{c C / b}``, and Poisson subsampling preserves domination in both neighbouring directions, so
    every step is at least as private as :class:`SubsampledGaussian` with noise multiplier
    ``sigma = scale / c`` (:meth:`dominating`).  The bound holds for any number of coordinates.  Paper 003's
    own accountant (Thm III.7) is unsound; it is available, named as such, in
    :func:`dpmath.lap2.published_epsilon`.

    Parameters
    ----------
    scale : float
        Laplace scale over clipping norm, ``b / C > 0``.
    sample_rate : float
        ``q``, the sampling probability, in ``(0, 1]``.

    Examples
    --------
    >>> from dpmath import SubsampledL2Laplace
    >>> SubsampledL2Laplace(2.0, 0.01).dominating()
    SubsampledGaussian(noise_multiplier=1.595769..., sample_rate=0.01)
    """

    scale: float
    sample_rate: float

    neighboring = Neighboring.ADD_OR_REMOVE
    uncovered = "its Gaussian domination is proved for adding or removing one example"

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", positive_real(self.scale, "scale"))
        object.__setattr__(self, "sample_rate", checked_sample_rate(self.sample_rate, "sample_rate"))

    def dominating(self) -> SubsampledGaussian:
        """The subsampled Gaussian whose pair dominates this mechanism's in both directions."""
        return SubsampledGaussian(self.scale / LAPLACE_GDP_FACTOR, self.sample_rate)

    @classmethod
    def for_noise_multiplier(cls, noise_multiplier: float, sample_rate: float) -> SubsampledL2Laplace:
        """The LAP2 mechanism whose :meth:`dominating` Gaussian has noise multiplier ``sigma = noise_multiplier``:
        scale ``b / C = sqrt(pi / 2) sigma``, so it is accounted exactly as that Gaussian (used to calibrate ``b``).

        Examples
        --------
        >>> from dpmath import SubsampledL2Laplace
        >>> SubsampledL2Laplace.for_noise_multiplier(1.0, 0.01).dominating().noise_multiplier
        1.0
        """
        s = positive_real(noise_multiplier, "noise_multiplier")
        scale = s * LAPLACE_GDP_FACTOR
        while scale / LAPLACE_GDP_FACTOR < s:   # rounded up: the dominating Gaussian never has less noise than sigma
            scale = math.nextafter(scale, math.inf)
        return cls(scale, sample_rate)


@dataclass(frozen=True)
class FixedSizeSubsampledGaussian(Mechanism):
    r"""One step on a batch of exactly ``B`` examples drawn uniformly without replacement from ``N``.

    The batch size is public and constant, so the data-set size is too: the neighbouring relation is
    **replacing** one example (``neighboring="replace_one"``; adding one is not covered).  With
    ``q = B / N`` and ``mu = 1 / sigma``, replacing example ``x`` by ``x'`` moves the clipped sum by at most
    ``2 C``, and the step's worst pair is (Zhu, Dong and Wang 2022, Thm. 10; Balle, Barthe and Gaboardi 2018)

    .. math::

        \big(q\,\mathcal N(2\mu, 1) + (1-q)\,\mathcal N(0, 1),\; \mathcal N(0, 1)\big)

    and its swap: the pairs of :class:`SubsampledGaussian` at noise ``sigma / 2`` (:meth:`dominating`).  Both
    are reached (every other example's gradient equal to ``x'``'s, ``x``'s opposite), so the bound is tight.

    With randomized clipping (an ``envelope``) the move is ``v_x - v_y`` of norm at most ``a_x + a_y``, two
    examples' random scales computed with the same projections: the step is :class:`SubsampledGaussian` at
    rate ``q`` with :class:`~dpmath.ReplacementEnvelope` (a union bound over the unknown coupling, so it costs
    more than twice an example's scale: at ``sigma = 2``, ``q = 0.01``, 1000 steps, ``delta = 1e-5``, 5.97 against
    1.83 with exact norms).

    Parameters
    ----------
    noise_multiplier : float
        ``sigma > 0``, noise standard deviation over the clipping norm.
    batch_size : int
        ``B >= 1``.
    dataset_size : int
        ``N >= B``.
    envelope : Envelope, optional
        Randomized clipping's envelope (one example's).

    Examples
    --------
    >>> from dpmath import FixedSizeSubsampledGaussian
    >>> FixedSizeSubsampledGaussian(2.0, batch_size=100, dataset_size=10_000).dominating()
    SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.01)
    """

    noise_multiplier: float
    batch_size: int
    dataset_size: int
    envelope: Envelope | None = None

    neighboring = Neighboring.REPLACE_ONE
    uncovered = ("its batches have a fixed size, so a data set with one example more or less is not a neighbour it "
                 "covers")

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", positive_real(self.noise_multiplier, "noise_multiplier"))
        object.__setattr__(self, "batch_size", positive_int(self.batch_size, "batch_size"))
        object.__setattr__(self, "dataset_size", positive_int(self.dataset_size, "dataset_size"))
        if self.batch_size > self.dataset_size:
            raise ValueError(f"batch_size must be at most dataset_size ({self.dataset_size}), got {self.batch_size}")
        object.__setattr__(self, "envelope", _optional_envelope(self.envelope))

    @property
    def sample_rate(self) -> float:
        """``q = B / N``, the probability that a given example is in a batch."""
        return self.batch_size / self.dataset_size

    def dominating(self) -> SubsampledGaussian:
        """The Poisson pair whose adding and removing directions are this step's replacing pairs."""
        if self.envelope is not None:
            return SubsampledGaussian(self.noise_multiplier, self.sample_rate, ReplacementEnvelope(self.envelope))
        return SubsampledGaussian(self.noise_multiplier / 2.0, self.sample_rate)


@dataclass(frozen=True)
class TruncatedSubsampledGaussian(Mechanism):
    r"""Poisson sampling at rate ``q`` with at most ``B = max_batch_size`` examples a step (a larger draw keeps a
    uniformly random ``B`` of them), then the Gaussian (or randomized-clipping) step; adding or removing one example.

    **Exact norms** (no ``envelope``).  Let ``S ~ Binomial(N, q)`` count the other examples drawn (``N`` of them in
    the larger neighbour).  Where ``S < B`` the added example ``x`` joins with probability ``q`` and nothing is cut:
    the subsampled Gaussian's pair.  Where ``S >= B`` the batch is cut to ``B``: ``x`` is kept with probability
    ``q B / (S + 1) <= q``, in place of an example ``y`` the smaller neighbour keeps, so the sum moves by
    ``g(x) - g(y)``, of norm at most ``2 C``.  Revealing ``S`` (and ``y``) only helps an adversary, so the step is
    dominated by the mixture, over whether ``S >= B`` (probability ``p = P(S >= B)``), of the subsampled Gaussian
    at scale 1 and at scale 2, both at rate ``q``: :class:`SubsampledGaussian` with the two-point
    :class:`~dpmath.DiscreteEnvelope` ``Y = 1/4`` (scale 2) with probability ``p``, ``Y = 1`` otherwise
    (:meth:`dominating`; ``p`` rounded up).  This is dp_accounting's decomposition, with the cut's rate bounded by
    ``q``.

    **Randomized clipping** (an ``envelope``: two examples' random scales would add).  Accounted by coupling with
    untruncated Poisson sampling: both read the same draws and differ only in a step whose draw overflows, so
    ``|M_trunc(D)(S) - M_Poisson(D)(S)| <= eta`` with ``eta = P(Binomial(N + 1, q) > B)`` a step, and over ``n``
    steps

    .. math::

        \delta_{\mathrm{Poisson}}(\varepsilon) - n\,\eta\,(1 + e^{\varepsilon})
        \le \delta_{\mathrm{trunc}}(\varepsilon) \le
        \delta_{\mathrm{Poisson}}(\varepsilon) + n\,\eta\,(1 + e^{\varepsilon}),

    which :class:`~dpmath.PLDAccountant` applies to its bracket (:meth:`overflow_probability`); a ``B`` a few
    binomial standard deviations above ``q N`` keeps the charge far below delta (:meth:`max_batch_size_for`).

    Parameters
    ----------
    noise_multiplier : float
        ``sigma > 0``.
    sample_rate : float
        ``q`` in ``(0, 1)``.
    max_batch_size : int
        The most examples a step takes, ``>= 1``.
    dataset_size : int
        ``N``, the number of examples sampled from, ``>= 1``.
    envelope : Envelope, optional
        Randomized clipping's envelope.

    Examples
    --------
    >>> from dpmath import TruncatedSubsampledGaussian
    >>> m = TruncatedSubsampledGaussian(1.0, 0.01, max_batch_size=110, dataset_size=10_000)   # q N = 100
    >>> f"{m.truncation_probability():.3f}"
    '0.169'
    >>> m.dominating().envelope
    DiscreteEnvelope(values=[0.25, 1.0], weights=[0.169..., 0.830...])
    """

    noise_multiplier: float
    sample_rate: float
    max_batch_size: int
    dataset_size: int
    envelope: Envelope | None = None

    neighboring = Neighboring.ADD_OR_REMOVE
    uncovered = "its analysis is for adding or removing one example"

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", positive_real(self.noise_multiplier, "noise_multiplier"))
        q = checked_sample_rate(self.sample_rate, "sample_rate")
        if q == 1.0:
            raise ValueError("sample_rate must be below 1 for truncated Poisson sampling (at q = 1 every step takes "
                             "every example: use FixedSizeSubsampledGaussian or Gaussian)")
        object.__setattr__(self, "sample_rate", q)
        object.__setattr__(self, "max_batch_size", positive_int(self.max_batch_size, "max_batch_size"))
        object.__setattr__(self, "dataset_size", positive_int(self.dataset_size, "dataset_size"))
        object.__setattr__(self, "envelope", _optional_envelope(self.envelope))

    @property
    def charged(self) -> bool:
        """Whether the overflow is charged to delta (randomized clipping) rather than composed as a mixture."""
        return self.envelope is not None

    def truncation_probability(self) -> float:
        """``p = P(Binomial(N, q) >= max_batch_size)``: a step's other draws fill the batch (rounded up,
        :func:`_binomial_tail`)."""
        return _binomial_tail(self.max_batch_size - 1, self.dataset_size, self.sample_rate)

    def dominating(self) -> SubsampledGaussian:
        """The step the accountant composes: the scale-1 / scale-2 mixture (exact norms), or the untruncated Poisson
        step whose overflow is charged to delta (randomized clipping)."""
        if self.envelope is not None:
            return SubsampledGaussian(self.noise_multiplier, self.sample_rate, self.envelope)
        p = self.truncation_probability()
        if p == 0.0:
            return SubsampledGaussian(self.noise_multiplier, self.sample_rate)
        if p == 1.0:   # every step cut: the scale-2 step (noise sigma / 2)
            return SubsampledGaussian(self.noise_multiplier / 2.0, self.sample_rate)
        cut = DiscreteEnvelope([0.25, 1.0], [p, 1.0 - p])   # Y = 1/4: scale 2
        return SubsampledGaussian(self.noise_multiplier, self.sample_rate, cut)

    def overflow_probability(self) -> float:
        """``eta``: an upper bound on the probability that a step's Poisson draw exceeds ``max_batch_size`` (``N + 1``
        examples, the larger neighbour), charged to delta with randomized clipping (rounded up,
        :func:`_binomial_tail`)."""
        return _binomial_tail(self.max_batch_size, self.dataset_size + 1, self.sample_rate)

    @staticmethod
    def max_batch_size_for(sample_rate: float, dataset_size: int, steps: int, budget: float) -> int:
        """The smallest ``max_batch_size`` whose total overflow ``steps * eta`` is at most ``budget`` (a part of
        delta to give up, e.g. ``delta / 100``).

        Examples
        --------
        >>> from dpmath import TruncatedSubsampledGaussian
        >>> TruncatedSubsampledGaussian.max_batch_size_for(256 / 60000, 60000, 10_000, 1e-8)   # q N = 256
        376
        """
        from scipy import stats

        q = checked_sample_rate(sample_rate, "sample_rate")
        n = positive_int(dataset_size, "dataset_size") + 1
        t = positive_int(steps, "steps")
        b = positive_real(budget, "budget")
        cap = int(stats.binom.isf(b / t, n, q))   # a first guess; the steps below settle it on the rounded tail
        while cap < n and t * _binomial_tail(cap, n, q) > b:
            cap += 1
        while cap > 1 and t * _binomial_tail(cap - 1, n, q) <= b:
            cap -= 1
        return max(cap, 1)


def _binomial_tail(k: int, n: int, q: float) -> float:
    """``P(Binomial(n, q) > k)`` rounded up: scipy's float64 tail times ``1 + 1e-9`` (its error is far smaller), plus
    ``1e-300``, at most 1; exactly 0 where the tail is."""
    from scipy import stats

    tail = float(stats.binom.sf(k, n, q))
    return min(1.0, tail * (1.0 + 1e-9) + 1e-300) if tail > 0 else 0.0


class _OneEpoch(Mechanism):
    """What the epoch mechanisms share: their checks, and the rate 1 their bound charges."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", positive_real(self.noise_multiplier, "noise_multiplier"))
        object.__setattr__(self, "steps", positive_int(self.steps, "steps"))
        object.__setattr__(self, "envelope", _optional_envelope(self.envelope))

    @property
    def sample_rate(self) -> float:
        """1: every example is in the epoch."""
        return 1.0


@dataclass(frozen=True)
class RandomAllocationGaussian(_OneEpoch):
    r"""One **epoch** of balls-in-bins sampling (random allocation): each example is put in exactly one of the
    epoch's ``steps`` steps, uniformly and independently.

    With exact norms, adding or removing an example, the epoch is accounted by its own PLD (**amplified**): the pair

    .. math::

        P = \frac1t \sum_{j=1}^{t} N(e_j / \sigma, I_t), \qquad Q = N(0, I_t)

    dominates the epoch for adaptively chosen gradients (Chua et al., AISTATS 2025), and its privacy loss is the log
    of the mean of ``t`` lognormals, whose law :mod:`dpmath.pld.allocation` bounds from both sides by rounded FFT
    compositions.  Random allocation then costs about as much epsilon as Poisson sampling at rate ``1 / steps``, often
    less (Feldman and Shenfeld 2025 prove it at most that, up to lower-order terms).

    With randomized clipping (an ``envelope``), or replacing one example, the epoch is accounted by a certified
    bound without amplification: adding (or replacing) one example changes one step of the epoch, whichever it is,
    and the other examples' steps do not depend on it, so the epoch is dominated by one Gaussian step
    (:meth:`dominating`: :class:`Gaussian`, or :class:`SubsampledGaussian` at rate 1 with the envelope).

    **k of T steps** (``participations = k``): each example is in ``k`` distinct steps of the epoch, a uniformly
    random ``k``-subset.  The epoch is dominated by ``k`` epochs of one participation in ``m = floor(T / k)`` steps,
    composed (:meth:`decomposed`).  Why: cut ``T`` into ``k`` blocks
    of ``m`` steps (and ``T - k m`` left over) and put the example in one uniformly random step of each block; a
    uniformly random permutation of the ``T`` steps, independent of everything, turns that ``k``-subset into a
    uniform one.  So the epoch's pair is the average over permutations ``pi`` of the block pair moved by ``pi``,
    against ``Q``, which no permutation moves; the hockey-stick divergence is jointly convex and unchanged by a
    bijection, so it is at most the block pair's, whose blocks are independent epochs of one participation in ``m``
    steps (their interleaving in time is a concurrent composition, which is no worse than the sequential one:
    Vadhan and Zhang 2023).  Without amplification each participation is one dominating step, ``k`` of them.

    Parameters
    ----------
    noise_multiplier : float
        ``sigma > 0``.
    steps : int
        Steps per epoch, ``>= 1`` (the batches' expected size is ``k N / steps``).
    envelope : Envelope, optional
        Randomized clipping's envelope.
    participations : int
        Steps each example is in, ``k``, in ``[1, steps]`` (default 1).

    Examples
    --------
    >>> from dpmath import PLDAccountant, RandomAllocationGaussian, SubsampledGaussian
    >>> epoch = RandomAllocationGaussian(2.0, steps=100)
    >>> epoch.amplified
    True
    >>> lo, hi = PLDAccountant().compose(epoch, 5).epsilon_bracket(1e-5)
    >>> hi < PLDAccountant().compose(SubsampledGaussian(2.0, 0.01), 500).epsilon(1e-5)   # below Poisson at 1/100
    True
    >>> RandomAllocationGaussian(2.0, steps=100, participations=4).decomposed()
    (RandomAllocationGaussian(noise_multiplier=2.0, steps=25, envelope=None, participations=1), 4)
    """

    noise_multiplier: float
    steps: int
    envelope: Envelope | None = None
    participations: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        k = positive_int(self.participations, "participations")
        if k > self.steps:
            raise ValueError(f"participations must lie in [1, steps={self.steps}] (each example is in that many "
                             f"distinct steps of the epoch), got {k}")
        object.__setattr__(self, "participations", k)

    @property
    def amplified(self) -> bool:
        """Whether adding or removing an example is accounted by the epoch's own PLD (exact norms, at least two steps
        per participation), rather than by :meth:`dominating`."""
        return self.envelope is None and self.steps // self.participations > 1

    def decomposed(self) -> tuple[RandomAllocationGaussian, int]:
        """``(epoch, k)``: ``k = participations`` epochs of one participation in ``floor(steps / k)`` steps, whose
        composition dominates this epoch (the class docstring says why); the epoch itself where ``k = 1``."""
        if self.participations == 1:
            return self, 1
        return RandomAllocationGaussian(self.noise_multiplier, self.steps // self.participations,
                                        self.envelope), self.participations

    def dominating(self) -> Gaussian | SubsampledGaussian:
        """The one step that dominates an epoch of one participation: the bound used with randomized clipping, for
        replacing one example, and for a one-step epoch (where it is exact).  With several participations it is
        each one's (:meth:`decomposed`: one step per participation)."""
        if self.envelope is None:
            return Gaussian(self.noise_multiplier)
        return SubsampledGaussian(self.noise_multiplier, 1.0, self.envelope)


@dataclass(frozen=True)
class ShuffledGaussian(_OneEpoch):
    r"""One **epoch** of shuffled fixed-size batches: a uniformly random permutation of the ``N`` examples cut
    into ``steps`` consecutive batches.

    Adding an example would shift every later batch's boundaries, so only **replacing** one is covered
    (``neighboring="replace_one"``).  Given the permutation, the replaced example sits in one batch, which moves
    by at most ``2 C``, and the others are unchanged: the epoch is dominated by one Gaussian step under
    replacement, which is :class:`Gaussian` at noise ``sigma / 2`` adding or removing an example
    (:meth:`dominating`).  This is the only bound known to hold for shuffling; it keeps no amplification, so at
    the same noise it costs far more epsilon than Poisson sampling (see the sampling page of the docs).

    With randomized clipping (an ``envelope``) the replaced example and the one it displaces carry two random
    scales: :class:`SubsampledGaussian` at rate 1 with :class:`~dpmath.ReplacementEnvelope`.

    Parameters
    ----------
    noise_multiplier : float
        ``sigma > 0``.
    steps : int
        Batches per epoch, ``>= 1``.
    envelope : Envelope, optional
        Randomized clipping's envelope (one example's).

    Examples
    --------
    >>> from dpmath import ShuffledGaussian
    >>> ShuffledGaussian(4.0, steps=100).dominating()
    Gaussian(noise_multiplier=2.0)
    """

    noise_multiplier: float
    steps: int
    envelope: Envelope | None = None

    neighboring = Neighboring.REPLACE_ONE
    uncovered = ("adding an example would shift every later batch's boundaries, so a data set with one example more "
                 "or less is not a neighbour it covers")

    def dominating(self) -> Gaussian | SubsampledGaussian:
        """The Gaussian whose adding/removing pair is the epoch's replacing pair."""
        if self.envelope is not None:
            return SubsampledGaussian(self.noise_multiplier, 1.0, ReplacementEnvelope(self.envelope))
        return Gaussian(self.noise_multiplier / 2.0)


#: Every mechanism, in the order the docs list them: the registry the accountants' tables are keyed on.
MECHANISMS: tuple[type[Mechanism], ...] = (Gaussian, SubsampledGaussian, SubsampledL2Laplace,
                                           FixedSizeSubsampledGaussian, TruncatedSubsampledGaussian,
                                           RandomAllocationGaussian, ShuffledGaussian)

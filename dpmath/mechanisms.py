r"""Mechanisms: small immutable descriptions that accountants compose.

Every mechanism releases a sum of clipped vectors plus Gaussian noise of standard deviation ``sigma``
(the ``noise_multiplier``) times the clipping norm, so one example moves the output by a vector of norm
at most ``a / sigma`` noise standard deviations, where ``a`` is the example's *scale*; ``q`` is the
``sample_rate``:

* :class:`Gaussian`: ``a = 1``, every step (no sampling).
* :class:`SubsampledGaussian`: ``a = 1``, the example is in the batch with probability ``q``
  (Poisson sampling).
* :class:`RandomizedClipGaussian`: DP-SGD-RC. The norm is *estimated*, so the clipped contribution
  has the random norm ``a = 1 / sqrt(Y)`` with ``Y`` drawn from an envelope (paper 000, Sec. 5.2 and
  Lemma B.2-B.3): the dominating pair is ``(a, q N(a/sigma, 1) + (1-q) N(0, 1))`` against
  ``(a, N(0, 1))``.  ``a`` is part of the output, so the pair's hockey-stick curve is the
  ``Y``-average of subsampled-Gaussian curves.
* :class:`SubsampledL2Laplace`: LAP2, Laplace noise instead of Gaussian; accounted through the
  subsampled Gaussian that dominates it (:mod:`dpmath.lap2`).

A mechanism validates its arguments once, at construction; accountants never see an invalid one.  The
paper's names (``sigma``, ``q``) still work as keywords and attributes until dpmath 0.3, with a
:class:`DeprecationWarning` (:mod:`dpmath.deprecation`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .deprecation import renamed_arguments, warn_renamed
from .envelope import Envelope
from .validation import positive_real, real_number
from .validation import sample_rate as checked_sample_rate

__all__ = ["Gaussian", "SubsampledGaussian", "RandomizedClipGaussian", "SubsampledL2Laplace"]


@renamed_arguments({"sigma": "noise_multiplier", "q": "sample_rate"})
@dataclass(frozen=True)
class Gaussian:
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


@renamed_arguments({"sigma": "noise_multiplier", "q": "sample_rate"})
@dataclass(frozen=True)
class SubsampledGaussian:
    r"""The Poisson-subsampled Gaussian mechanism: one step of DP-SGD.

    Each example is in the batch independently with probability ``q``; the clipped sum gets
    ``N(0, sigma^2)`` noise per coordinate.  With unit-variance coordinates and ``mu = 1/sigma`` the
    dominating pairs are ``(q N(mu, 1) + (1-q) N(0, 1), N(0, 1))`` when an example is removed, the swap
    when one is added, and ``(q N(-mu, 1) + (1-q) N(0, 1), q N(mu, 1) + (1-q) N(0, 1))`` when one is
    replaced.

    Parameters
    ----------
    noise_multiplier : float
        ``sigma``, the noise standard deviation over the clipping norm, ``> 0``.
    sample_rate : float
        ``q``, the sampling probability (batch size / data-set size), in ``(0, 1]``.

    Examples
    --------
    >>> from dpmath import SubsampledGaussian
    >>> SubsampledGaussian(1.1, 256 / 60000)
    SubsampledGaussian(noise_multiplier=1.1, sample_rate=0.004266666666666667)
    >>> SubsampledGaussian(1.0, 1.5)
    Traceback (most recent call last):
    ...
    ValueError: sample_rate must lie in (0, 1], got 1.5
    """

    noise_multiplier: float
    sample_rate: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", positive_real(self.noise_multiplier, "noise_multiplier"))
        object.__setattr__(self, "sample_rate", checked_sample_rate(self.sample_rate, "sample_rate"))


@renamed_arguments({"sigma": "noise_multiplier", "q": "sample_rate"})
@dataclass(frozen=True)
class RandomizedClipGaussian:
    r"""One step of DP-SGD-RC: a subsampled Gaussian whose sensitivity is the random scale ``1/sqrt(Y)``.

    ``Y`` follows an envelope (:class:`~dpmath.HutchEnvelope`, :class:`~dpmath.HutchPPEnvelope`, or
    any :class:`~dpmath.Envelope`).  The dominating pair (paper 000, Sec. 5.2) is, with
    ``a = 1/sqrt(Y)``,

    .. math::

        P = \big(a,\; q\,\mathcal N(a/\sigma, 1) + (1-q)\,\mathcal N(0, 1)\big),\qquad
        Q = \big(a,\; \mathcal N(0, 1)\big),

    so its hockey-stick divergence is ``E_Y[H_{e^eps}]`` of the subsampled Gaussian with noise
    ``sigma * sqrt(Y)``.  The accountant discretizes ``Y`` on a grid whose scales ``a`` are spaced by
    the relative step ``scale_resolution``: pessimistically (each bin's mass at its largest scale, the
    mass below the grid charged to delta) for the upper bound, optimistically for the lower bound.
    With a constant ``Y = 1`` (:class:`~dpmath.PointMassEnvelope`) the mechanism *is*
    :class:`SubsampledGaussian` and every accountant returns the same numbers.

    Its Renyi divergence is infinite for every order (paper 000, App. B.2): ``a`` has a polynomial
    tail, ``P(a > s) ~ s^{-k}``, so ``E[exp(alpha (alpha-1) a^2 / (2 sigma^2))]`` diverges.  Only
    the PLD accountant accepts it.

    Parameters
    ----------
    noise_multiplier : float
        ``sigma``, the noise standard deviation over the clipping norm, ``> 0``.
    sample_rate : float
        ``q``, the sampling probability, in ``(0, 1]``.
    envelope : Envelope
        Distribution of the squared-norm ratio ``Y`` (estimate / true norm, squared, worst case).
    scale_resolution : float
        Relative spacing of the scale grid, in ``(0, 0.1]`` (default ``2e-3``).

    Examples
    --------
    >>> from dpmath import HutchEnvelope, RandomizedClipGaussian
    >>> RandomizedClipGaussian(4.0, 0.01, HutchEnvelope(projection_dim=32, dim=2048))
    RandomizedClipGaussian(noise_multiplier=4.0, sample_rate=0.01,
                           envelope=HutchEnvelope(projection_dim=32, dim=2048, family='heavy-light'))
    """

    noise_multiplier: float
    sample_rate: float
    envelope: Envelope
    scale_resolution: float = field(default=2e-3, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", positive_real(self.noise_multiplier, "noise_multiplier"))
        object.__setattr__(self, "sample_rate", checked_sample_rate(self.sample_rate, "sample_rate"))
        if not isinstance(self.envelope, Envelope):
            raise ValueError(f"envelope must be a dpmath Envelope, got {type(self.envelope).__name__}")
        r = real_number(self.scale_resolution, "scale_resolution", allow_inf=False)
        if not 0 < r <= 0.1 or math.isnan(r):
            raise ValueError(f"scale_resolution must lie in (0, 0.1], got {self.scale_resolution!r}")
        object.__setattr__(self, "scale_resolution", r)


LAPLACE_GDP_FACTOR = math.sqrt(math.pi / 2.0)
"""``c = sqrt(pi/2)``: a Laplace shift of ``t`` noise scales is dominated by ``G_{c t}`` (:mod:`dpmath.lap2`)."""


@renamed_arguments({"q": "sample_rate"})
@dataclass(frozen=True)
class SubsampledL2Laplace:
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

    @classmethod
    def for_sigma(cls, sigma: float, q: float) -> SubsampledL2Laplace:
        """Deprecated name of :meth:`for_noise_multiplier` (warns; removed in dpmath 0.3)."""
        warn_renamed("SubsampledL2Laplace.for_sigma", "SubsampledL2Laplace.for_noise_multiplier")
        return cls.for_noise_multiplier(sigma, q)

r"""Renyi-DP accountant for the (subsampled) Gaussian mechanism.

The Renyi divergence of order ``alpha`` of the Poisson-subsampled Gaussian (Mironov, Talwar and
Zhang 2019) is ``log(A_alpha) / (alpha - 1)`` with, for integer ``alpha``,

.. math::

    A_\alpha = \sum_{k=0}^{\alpha} \binom{\alpha}{k} (1-q)^{\alpha-k} q^k
    \exp\Big(\frac{k^2 - k}{2\sigma^2}\Big),

and, for fractional ``alpha``, the two convergent series of their Sec. 3.3 with
``z_0 = sigma^2 log(1/q - 1) + 1/2``:

.. math::

    A_\alpha = \sum_{i \ge 0} \binom{\alpha}{i}\Big[(1-q)^{\alpha-i} q^i e^{(i^2-i)/(2\sigma^2)}
    \tfrac12\operatorname{erfc}\tfrac{i - z_0}{\sqrt2\sigma}
    + q^{\alpha-i}(1-q)^i e^{((\alpha-i)^2-(\alpha-i))/(2\sigma^2)}
    \tfrac12\operatorname{erfc}\tfrac{z_0 - (\alpha - i)}{\sqrt2\sigma}\Big].

RDP adds up over compositions; :mod:`dpmath.conversions` turns it into ``(epsilon, delta)``.

Randomized clipping (:class:`~dpmath.SubsampledGaussian` with an ``envelope``) has no finite Renyi divergence of any
order (paper 000, App. B.2, Prop. B.1): the scale ``a = 1/sqrt(Y)`` has a polynomial tail, ``P(a > s) ~ c s^{-k}``,
while the conditional moment ``E[e^{(alpha-1) L} | a] = exp(alpha (alpha - 1) a^2 / (2 sigma^2))``
(for ``q = 1``; with ``q < 1`` it still grows like ``q^alpha`` times it) grows like
``e^{c' s^2}``, so the mixture's moment diverges.  :meth:`RDPAccountant.compose` refuses it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy import special

from . import conversions
from .accountant import Accountant, Neighboring
from .mechanisms import Gaussian, SubsampledGaussian, SubsampledL2Laplace
from .validation import non_negative, open_probability, positive_int, probability_array, real_array

__all__ = ["RDPAccountant", "DEFAULT_ORDERS", "subsampled_gaussian_rdp"]

# accounted through the subsampled Gaussian their dominating() names (a Gaussian step is its own): the RDP
# accountant's table of the mechanisms of dpmath.mechanisms.MECHANISMS (a SubsampledGaussian without an envelope:
# _randomized)
_GAUSSIAN_STEPS = (Gaussian, SubsampledGaussian, SubsampledL2Laplace)


def _randomized(mechanism: object) -> bool:
    """Whether ``mechanism`` is a step with randomized clipping (an envelope, a point mass too): refused."""
    return isinstance(mechanism, SubsampledGaussian) and mechanism.envelope is not None

#: Orders used when none are given: Opacus' 1.1, 1.2, ..., 10.9, 12, ..., 63 plus four large ones for
#: small delta and large sigma.
DEFAULT_ORDERS: tuple[float, ...] = tuple([1 + x / 10 for x in range(1, 100)] + list(range(12, 64))
                                          + [128, 256, 512, 1024])


def _log_add(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    m = max(a, b)
    return m + math.log1p(math.exp(min(a, b) - m))


def _log_sub(a: float, b: float) -> float:
    """``log(e^a - e^b)`` for ``a >= b``."""
    if b == -math.inf:
        return a
    if b >= a:
        return -math.inf
    return a + math.log(-math.expm1(b - a))


def log_subsampled_moment(order: int, q: float, log_moments: ArrayLike) -> np.ndarray:
    r"""``log E_Q[(1 - q + q L)^n]`` from the moments ``E_Q[L^v] = exp(log_moments[..., v])``, ``v = 0..n``.

    .. math:: \log \sum_{v=0}^{n} \binom{n}{v} (1-q)^{n-v} q^v\, E_Q[L^v]

    The binomial expansion behind every integer-order bound for Poisson subsampling here: the subsampled
    Gaussian (``E[L^v] = e^{v(v-1)/(2 sigma^2)}``, Mironov et al. 2019), LAP2's univariate moment (paper
    003, Thm III.2) and the coordinate-wise and twice sampling of paper 002 (eq. 7, 8).

    Parameters
    ----------
    order : int
        ``n >= 0``.
    q : float
        Sampling probability in ``(0, 1]`` (``q = 1`` returns ``log_moments[..., n]``).
    log_moments : array_like
        ``log E_Q[L^v]`` along the last axis, at least ``n + 1`` entries; leading axes are batched.

    Returns
    -------
    numpy.ndarray
        Shape of ``log_moments`` without its last axis.

    Examples
    --------
    >>> import numpy as np
    >>> from dpmath.rdp import log_subsampled_moment
    >>> v = np.arange(3.0)
    >>> round(float(log_subsampled_moment(2, 0.5, v * (v - 1) / 2)), 6)   # log(1/4 + 1/2 + e/4)
    0.357374
    """
    m = np.asarray(log_moments, dtype=np.float64)
    if q == 1.0:
        return m[..., order]
    v = np.arange(order + 1, dtype=np.float64)
    log_binom = special.gammaln(order + 1) - special.gammaln(v + 1) - special.gammaln(order - v + 1)
    return special.logsumexp(log_binom + v * math.log(q) + (order - v) * math.log1p(-q) + m[..., :order + 1],
                             axis=-1)


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    k = np.arange(alpha + 1, dtype=np.float64)
    return float(log_subsampled_moment(alpha, q, (k * k - k) / (2 * sigma * sigma)))


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    z0 = sigma * sigma * math.log(1 / q - 1) + 0.5
    log_pos = log_neg = -math.inf
    i = 0
    while True:
        log_coef = float(special.gammaln(alpha + 1) - special.gammaln(i + 1) - special.gammaln(alpha - i + 1))
        negative = special.gammasgn(alpha - i + 1) < 0
        j = alpha - i
        # 0.5 erfc(x / (sqrt(2) sigma)) = Phi(-x / sigma)
        t0 = log_coef + i * math.log(q) + j * math.log1p(-q) + (i * i - i) / (2 * sigma * sigma) \
            + float(special.log_ndtr((z0 - i) / sigma))
        t1 = log_coef + j * math.log(q) + i * math.log1p(-q) + (j * j - j) / (2 * sigma * sigma) \
            + float(special.log_ndtr((j - z0) / sigma))
        term = _log_add(t0, t1)
        if negative:
            log_neg = _log_add(log_neg, term)
        else:
            log_pos = _log_add(log_pos, term)
        if i > alpha and term < max(log_pos, log_neg) - 40:
            break
        i += 1
        if i > 100000:  # pragma: no cover - the terms fall like (i - alpha)^-alpha / e^{...}; never reached
            raise ValueError(f"fractional-order RDP series did not converge (alpha={alpha}, sigma={sigma}, q={q})")
    return _log_sub(log_pos, log_neg)


def subsampled_gaussian_rdp(noise_multiplier: float, sample_rate: float, orders: ArrayLike) -> np.ndarray:
    r"""Renyi divergence of one step of the Poisson-subsampled Gaussian, per order.

    ``q = 1`` gives the Gaussian mechanism's ``alpha / (2 sigma^2)`` exactly.

    Parameters
    ----------
    noise_multiplier : float
        ``sigma``, the noise standard deviation over the clipping norm, ``> 0``.
    sample_rate : float
        ``q``, the sampling probability, in ``(0, 1]``.
    orders : array_like
        Orders ``alpha > 1``.

    Returns
    -------
    ndarray
        ``D_alpha`` per order (``inf`` where the series overflows).

    Examples
    --------
    >>> from dpmath.rdp import subsampled_gaussian_rdp
    >>> r = 50 * subsampled_gaussian_rdp(2.5, 0.01, [1.5, 2.5, 5, 50, 100])
    >>> [f"{v:.6e}" for v in r]   # integer orders: dp_accounting's test values; fractional: exact
    ['6.500709e-04', '1.085418e-03', '2.180757e-03', '2.384604e-02', '1.674163e+02']
    """
    mech = SubsampledGaussian(noise_multiplier, sample_rate)   # validates both
    sigma, q = mech.noise_multiplier, mech.sample_rate
    a = real_array(orders, "orders", allow_inf=False)
    if (a <= 1).any():
        raise ValueError("orders must all be > 1")
    flat = a.ravel()
    if sigma < 1e-150:
        # the k = 2 term alone puts the divergence near 1e300 / (alpha - 1) or above, and 1/sigma^2 soon overflows:
        # inf, an upper bound that says the same
        return np.full(a.shape, math.inf)
    out = np.empty(flat.shape)
    for idx, alpha in enumerate(flat):
        if q == 1.0:
            out[idx] = alpha / (2 * sigma * sigma)   # sigma * sigma overflows to inf (0 divergence), not an error
            continue
        with np.errstate(over="ignore"):
            log_a = (_log_a_int(q, sigma, int(alpha)) if float(alpha).is_integer()
                     else _log_a_frac(q, sigma, float(alpha)))
        out[idx] = log_a / (alpha - 1)
    return out.reshape(a.shape)


class RDPAccountant(Accountant):
    r"""Renyi-DP accountant (Mironov et al. 2019) with the Balle et al. 2020 conversion.

    Composes :class:`~dpmath.Gaussian` and :class:`~dpmath.SubsampledGaussian` (add-or-remove
    neighbours), :class:`~dpmath.SubsampledL2Laplace` (through its dominating subsampled Gaussian), and
    any mechanism with an ``rdp(orders)`` method, such as those of :mod:`dpmath.twice_sampling`;
    composing randomized clipping (an ``envelope``) raises :class:`~dpmath.UnsupportedMechanismError` (a
    ``ValueError``), because its Renyi divergence is infinite at every order, and so does composing a sampling scheme
    (:meth:`supports` says which beforehand).  RDP is an upper bound only; for a tight number use
    :class:`~dpmath.PLDAccountant`.

    Parameters
    ----------
    orders : sequence of float, optional
        Renyi orders ``> 1`` (default :data:`DEFAULT_ORDERS`).
    conversion : {"balle", "classic"}
        RDP to ``(epsilon, delta)``: Balle et al. 2020 Thm 21 (default, always at least as tight) or
        Mironov 2017 Prop. 3, ``eps = rdp + log(1/delta) / (alpha - 1)``.

    Examples
    --------
    >>> from dpmath import SubsampledGaussian
    >>> from dpmath.rdp import RDPAccountant
    >>> acc = RDPAccountant().compose(SubsampledGaussian(1.1, 256 / 60000), 14063)
    >>> round(acc.epsilon(1e-5), 3)
    2.597
    """

    def __init__(self, orders: Sequence[float] | None = None, conversion: str = "balle") -> None:
        o = np.asarray(DEFAULT_ORDERS if orders is None else real_array(orders, "orders", allow_inf=False),
                       dtype=np.float64).ravel()
        if o.size == 0 or (o <= 1).any():
            raise ValueError("orders must be a non-empty list of numbers > 1")
        if conversion not in ("balle", "classic"):
            raise ValueError(f"conversion must be 'balle' or 'classic', got {conversion!r}")
        self.orders = o
        self.conversion = conversion
        self._rdp = np.zeros(o.size)
        self._events: tuple[tuple[object, int], ...] = ()

    @property
    def neighboring(self) -> Neighboring:
        """``Neighboring.ADD_OR_REMOVE``: the relation of the Renyi divergences composed (read-only)."""
        return Neighboring.ADD_OR_REMOVE

    def __repr__(self) -> str:
        return f"RDPAccountant(orders=<{self.orders.size}>, conversion={self.conversion!r}, events={len(self._events)})"

    @property
    def events(self) -> tuple[tuple[object, int], ...]:
        """The composed ``(mechanism, count)`` pairs, in order.

        Examples
        --------
        >>> from dpmath import Gaussian
        >>> from dpmath.rdp import RDPAccountant
        >>> RDPAccountant().compose(Gaussian(1.0), 5).events
        ((Gaussian(noise_multiplier=1.0), 5),)
        """
        return self._events

    @property
    def rdp(self) -> np.ndarray:
        """The composed Renyi divergence at each of :attr:`orders`.

        Examples
        --------
        >>> from dpmath import Gaussian
        >>> from dpmath.rdp import RDPAccountant
        >>> RDPAccountant(orders=[2.0, 4.0]).compose(Gaussian(2.0), 3).rdp.tolist()   # 3 alpha / (2 sigma^2)
        [0.75, 1.5]
        """
        return self._rdp.copy()

    def compose(self, mechanism: object, count: int = 1) -> RDPAccountant:
        """Add ``count`` runs of ``mechanism``; returns the accountant.

        Raises
        ------
        UnsupportedMechanismError
            Where :meth:`refusal` gives a reason (:meth:`supports` is False); nothing is composed.

        Examples
        --------
        >>> from dpmath import Gaussian, HutchEnvelope, SubsampledGaussian
        >>> from dpmath.rdp import RDPAccountant
        >>> float(RDPAccountant(orders=[2.0, 3.0]).compose(Gaussian(1.0), 2).rdp[1])
        3.0
        >>> RDPAccountant().compose(SubsampledGaussian(1.0, 0.01, HutchEnvelope(4, 8)))
        Traceback (most recent call last):
        ...
        dpmath.accountant.UnsupportedMechanismError: SubsampledGaussian with randomized clipping (an envelope) has ...
        """
        self._refuse_unsupported(mechanism)
        if isinstance(mechanism, _GAUSSIAN_STEPS):
            inner = mechanism.dominating()
            step = subsampled_gaussian_rdp(inner.noise_multiplier, inner.sample_rate, self.orders)
        else:
            step = np.asarray(mechanism.rdp(self.orders), dtype=np.float64)
        n = positive_int(count, "count")
        self._rdp = self._rdp + n * step
        self._events = self._events + ((mechanism, n),)
        return self

    def refusal(self, mechanism: object) -> str | None:
        """Why this accountant cannot account for ``mechanism``, or ``None``: it accounts for the Gaussian steps, LAP2
        and any mechanism with an ``rdp(orders)`` method.

        Examples
        --------
        >>> from dpmath import RandomAllocationGaussian
        >>> from dpmath.rdp import RDPAccountant
        >>> RDPAccountant().refusal(RandomAllocationGaussian(1.0, steps=10))
        'mechanism must be Gaussian, SubsampledGaussian, SubsampledL2Laplace or have an rdp(orders) method, got ...'
        """
        if _randomized(mechanism):
            return ("SubsampledGaussian with randomized clipping (an envelope) has no Renyi-DP guarantee: its Renyi "
                    "divergence is infinite for every order alpha > 1 (paper 000, App. B.2, Prop. B.1), because the "
                    "estimated-norm scale a = 1/sqrt(Y) has a polynomial tail while the conditional moment grows like "
                    "exp(alpha (alpha-1) a^2 / (2 sigma^2)); use PLDAccountant")
        if isinstance(mechanism, _GAUSSIAN_STEPS) or callable(getattr(mechanism, "rdp", None)):
            return None
        return (f"mechanism must be {', '.join(m.__name__ for m in _GAUSSIAN_STEPS)} or have an rdp(orders) method, "
                f"got {type(mechanism).__name__}")

    def epsilon(self, delta: float) -> float:
        """``min`` over orders of the converted epsilon (the best order is :meth:`best_order`).

        Examples
        --------
        >>> from dpmath import Gaussian
        >>> from dpmath.rdp import RDPAccountant
        >>> round(RDPAccountant().compose(Gaussian(1.0)).epsilon(1e-5), 3)
        4.729
        """
        return conversions.rdp_to_epsilon(self._rdp, self.orders, open_probability(delta, "delta"), self.conversion)[0]

    def best_order(self, delta: float) -> float:
        """The order that attains :meth:`epsilon`.

        Examples
        --------
        >>> from dpmath import SubsampledGaussian
        >>> from dpmath.rdp import RDPAccountant
        >>> RDPAccountant().compose(SubsampledGaussian(1.3, 150 / 60000), 6000).best_order(1e-5)
        19.0
        """
        return conversions.rdp_to_epsilon(self._rdp, self.orders, open_probability(delta, "delta"), self.conversion)[1]

    def delta(self, epsilon: float) -> float:
        """``min`` over orders of the converted delta.

        Examples
        --------
        >>> from dpmath import Gaussian
        >>> from dpmath.rdp import RDPAccountant
        >>> f"{RDPAccountant().compose(Gaussian(1.0)).delta(4.729):.2e}"
        '9.98e-06'
        """
        return conversions.rdp_to_delta(self._rdp, self.orders, non_negative(epsilon, "epsilon"), self.conversion)

    def tradeoff(self, alpha: ArrayLike) -> np.ndarray:
        r"""Lower bound on the trade-off curve from the ``(epsilon, delta(epsilon))`` family.

        Every ``(eps, delta)`` guarantee bounds the false-negative rate at false-positive rate ``a`` by
        ``max(0, 1 - delta - e^eps a, e^-eps (1 - delta - a))``; the maximum over a grid of eps is
        returned.

        Examples
        --------
        >>> from dpmath import Gaussian
        >>> from dpmath.rdp import RDPAccountant
        >>> float(RDPAccountant().compose(Gaussian(1.0)).tradeoff(1e-3)) < 1 - 0.0183   # looser than PLD
        True
        """
        a = probability_array(alpha, "alpha")
        eps = np.concatenate([[0.0], np.geomspace(1e-4, 200.0, 1200)])
        deltas = np.array([conversions.rdp_to_delta(self._rdp, self.orders, e, self.conversion) for e in eps])
        return conversions.profile_to_tradeoff(eps, deltas, a)

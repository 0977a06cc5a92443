r"""LAP2: Laplace noise on l2-clipped gradients (paper 003), its published accountant, and a sound one.

The mechanism: each step Poisson-samples examples with rate ``q``, clips each example's gradient to
l2 norm ``C``, sums, and adds independent ``Laplace(0, b)`` noise to each of the ``n`` coordinates.
Adding one example with clipped gradient ``g`` (``||g||_2 <= C``) moves the sum by ``g``.

**The published accountant** (paper 003, Thm III.7), reproduced by :func:`published_log_moment` and
:func:`published_epsilon`: the moments-accountant function is bounded by a *sum over coordinates* of
the univariate subsampled-Laplace moment (Thm III.2, :func:`univariate_log_moment`) evaluated at the
majorizing vector ``x_i = C (sqrt(i) - sqrt(i-1))`` (Lemma III.6, :func:`majorizer`).

**It is unsound.**  The example is sampled once per step for *all* coordinates, so the likelihood
ratio of the step is ``1 - q + q prod_i L_i`` with ``L_i = Lap(g_i, b) / Lap(0, b)`` at coordinate
``i``, not a product of per-coordinate mixtures ``prod_i (1 - q + q L_i)``.  Because the ``L_i`` are
independent under ``Lap(0, b)``, the exact moment is (:func:`joint_log_moment`)

.. math::

    E\big[(1 - q + q \textstyle\prod_i L_i)^{\lambda+1}\big]
    = \sum_{\eta=0}^{\lambda+1} \binom{\lambda+1}{\eta} (1-q)^{\lambda+1-\eta} q^\eta
      \prod_i F(|g_i|, \eta),

and by Chebyshev's sum inequality (all ``F(u, eta)`` increase with ``eta``) it is *at least* the
product of the per-coordinate sums that Thm III.7 adds up.  For ``q < 1`` the gap grows with
``C/b``; e.g. ``q = 0.01``, ``C/b = 2``, ``n = 1000``, ``lambda = 8``: the gradient
``g = (C/sqrt(10)) (1, ..., 1, 0, ...)`` (ten equal entries, ``||g||_2 = C``) has log-moment 4.41 while
Thm III.7 claims at most 0.0392 for every ``g`` (tested in ``tests/dpmath/test_lap2.py``).  In ``(eps, delta)``
terms: at ``q = 0.001``, ``T = 1000``, ``b = C/2``, ``n = 10^4``, ``delta = 1e-5`` the published
accountant gives ``eps = 0.43``, while spreading ``g`` evenly over the coordinates approaches (central
limit theorem, ``n -> inf``) the subsampled Gaussian with ``sigma = b/C``, whose ``eps`` is 3.22.  The rest of the
argument (Thm III.2's univariate moment, Schur-convexity of the sum, the weak majorization of Lemma
III.6) checks out numerically; the error is applying per-coordinate subsampling amplification to a
mechanism whose subsampling is shared.

**The sound accountant** (:class:`~dpmath.SubsampledL2Laplace`) goes through Gaussian domination
(f-DP, Dong-Roth-Su 2022):

1. one coordinate's pair ``(Lap(u, b), Lap(0, b))`` has the trade-off function ``f_{u/b}`` of the
   Laplace mechanism, and ``f_t >= G_{c t}`` for all ``t > 0`` with ``c = sqrt(pi/2)``
   (:func:`laplace_gdp_mu`: the smallest ``mu`` with ``f_t >= G_mu`` is ``< c t``, tends to ``c t`` as
   ``t -> 0`` from the slope at ``alpha = 1/2``, and falls to ``0.34 t`` at ``t = 30``; checked on a
   grid of ``t`` in ``tests/dpmath/test_lap2.py``);
2. coordinates are independent, so the un-sampled step's pair is the composition
   ``f_{g_1/b} (x) ... (x) f_{g_n/b} >= G_{c ||g||_2 / b} >= G_{c C / b}``;
3. Poisson subsampling of a mechanism dominated by ``G_mu`` is dominated, in both neighbouring
   directions, by the subsampled Gaussian pair with the same ``mu`` (Zhu, Dong, Wang 2022, Thm 11);
   so LAP2 with scale ``b`` is at least as private as :class:`~dpmath.SubsampledGaussian` with noise
   multiplier ``sigma = b / (c C)``, which :class:`~dpmath.PLDAccountant` and
   :class:`~dpmath.RDPAccountant` then compose.

The bound is independent of ``n``; spreading ``g`` over many coordinates gives, by the central limit
theorem, ``G_{C/b}``, so the sound bound is within the factor ``c = 1.2533`` in ``mu`` of the worst
case for large ``n``.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize, special

from .conversions import rdp_to_epsilon
from .mechanisms import LAPLACE_GDP_FACTOR
from .rdp import log_subsampled_moment
from .validation import non_negative, open_probability, positive_int, positive_real, real_array
from .validation import sample_rate as checked_sample_rate

__all__ = [
    "LAPLACE_GDP_FACTOR",
    "laplace_moment",
    "univariate_log_moment",
    "majorizer",
    "published_log_moment",
    "published_epsilon",
    "joint_log_moment",
    "laplace_tradeoff",
    "laplace_gdp_mu",
]


def _order(order: object) -> int:
    return positive_int(order, "order")


def _log_moment_terms(u: np.ndarray, eta: np.ndarray) -> np.ndarray:
    """``log F(u, eta)`` for ``u = shift / b >= 0`` and integer ``eta >= 0`` (broadcast)."""
    u, eta = np.broadcast_arrays(np.asarray(u, np.float64), np.asarray(eta, np.float64))
    out = np.zeros(u.shape)
    big = eta >= 2  # F(u, 0) = F(u, 1) = 1
    a, e = u[big], eta[big]
    # F = [eta e^{(eta-1)u} + (eta-1) e^{-eta u}] / (2 eta - 1), both terms positive for eta >= 1
    out[big] = np.logaddexp(np.log(e) + (e - 1) * a, np.log(e - 1) - e * a) - np.log(2 * e - 1)
    return out


def laplace_moment(shift: ArrayLike, eta: ArrayLike, scale: float = 1.0) -> np.ndarray:
    r"""``F(u, eta) = E_{z ~ Lap(0, b)}[(Lap(u, b)(z) / Lap(0, b)(z))^eta]`` (paper 003, eq. III.5).

    .. math:: F(u, \eta) = \frac{\eta e^{(\eta-1)u/b} + (\eta-1) e^{-\eta u/b}}{2\eta - 1}

    for integer ``eta >= 0`` (``F = 1`` at ``eta = 0, 1``); ``e^{(eta-1) D_eta}`` of the Laplace pair.

    Parameters
    ----------
    shift : array_like
        ``u >= 0``, the shift between the two Laplace laws.
    eta : array_like of int
        Moment order(s), integers ``>= 0``.
    scale : float
        Laplace scale ``b > 0``.

    Returns
    -------
    numpy.ndarray
        ``F`` broadcast over ``shift`` and ``eta`` (``inf`` where it overflows).

    Examples
    --------
    >>> from dpmath.lap2 import laplace_moment
    >>> float(laplace_moment(1.0, 2))           # (2 e + e^{-2}) / 3
    1.857299...
    >>> laplace_moment([0.0, 0.5], [0, 3]).tolist()
    [1.0, 1.7202...]
    """
    u = real_array(shift, "shift", allow_inf=False)
    e = real_array(eta, "eta", allow_inf=False)
    if (u < 0).any():
        raise ValueError("shift must be non-negative (>= 0)")
    if (e < 0).any() or not np.all(e == np.round(e)):
        raise ValueError("eta must be integers >= 0")
    b = positive_real(scale, "scale")
    with np.errstate(over="ignore"):
        return np.exp(_log_moment_terms(u / b, e))


def univariate_log_moment(shift: ArrayLike, order: int, sample_rate: float, scale: float = 1.0) -> np.ndarray:
    r"""Paper 003, Thm III.2: the moments-accountant function of one subsampled Laplace coordinate.

    .. math::

        \alpha(\lambda) = \log \sum_{\eta=0}^{\lambda+1} \binom{\lambda+1}{\eta}
        (1-q)^{\lambda+1-\eta} q^\eta F(u, \eta)

    This is ``log E_{Lap(0)}[(1 - q + q L)^{lambda+1}]``, exact for the pair (mixture, ``Lap(0)``);
    ``alpha(lambda) = lambda D_{lambda+1}`` in Renyi terms.

    Parameters
    ----------
    shift : array_like
        ``u = |g_i| >= 0`` (vectorized).
    order : int
        ``lambda >= 1``.
    sample_rate : float
        ``q``, the Poisson sampling rate, in ``(0, 1]``.
    scale : float
        Laplace scale ``b > 0``.

    Returns
    -------
    numpy.ndarray

    Examples
    --------
    >>> from dpmath.lap2 import univariate_log_moment
    >>> float(univariate_log_moment(1.0, 1, 1.0))   # q = 1: log F(1, 2)
    0.619...
    """
    u = real_array(shift, "shift", allow_inf=False)
    if (u < 0).any():
        raise ValueError("shift must be non-negative (>= 0)")
    lam = _order(order)
    q = checked_sample_rate(sample_rate, "sample_rate")
    b = positive_real(scale, "scale")
    eta = np.arange(lam + 2, dtype=np.float64)
    return log_subsampled_moment(lam + 1, q, _log_moment_terms(u[..., None] / b, eta))


def majorizer(dim: int, clip_norm: float = 1.0) -> np.ndarray:
    r"""Paper 003, Lemma III.6: ``x_i = C (sqrt(i) - sqrt(i-1))``, ``i = 1..n``.

    Its partial sums are ``C sqrt(k)``, so it weakly submajorizes the magnitudes of every ``g`` with
    ``||g||_2 <= C`` (the ``k`` largest of them sum to at most ``C sqrt(k)`` by Cauchy-Schwarz).
    Computed as ``C / (sqrt(i) + sqrt(i-1))`` (no cancellation).

    Parameters
    ----------
    dim : int
        ``n >= 1``.
    clip_norm : float
        ``C > 0``.

    Returns
    -------
    numpy.ndarray

    Examples
    --------
    >>> from dpmath.lap2 import majorizer
    >>> majorizer(4).round(4).tolist()
    [1.0, 0.4142, 0.3178, 0.2679]
    """
    n = positive_int(dim, "dim")
    c = positive_real(clip_norm, "clip_norm")
    i = np.arange(1, n + 1, dtype=np.float64)
    return c / (np.sqrt(i) + np.sqrt(i - 1.0))


def published_log_moment(order: int, sample_rate: float, scale: float, clip_norm: float, dim: int) -> float:
    r"""Paper 003, Thm III.7 **as published** (unsound, see the module docstring).

    .. math:: \alpha_G(\lambda) \le \sum_{i=1}^n \alpha(x_i), \qquad x_i = C(\sqrt{i} - \sqrt{i-1}),

    with :func:`univariate_log_moment` as ``alpha``.  The claim is false because the example is
    sampled once for all coordinates: :func:`joint_log_moment` exceeds it, e.g. at ``q = 0.01``,
    ``C/b = 2``, ``n = 1000``, ``lambda = 8`` for ``g`` with ten equal entries (4.41 against 0.0392).

    Parameters
    ----------
    order : int
        ``lambda >= 1``.
    sample_rate : float
        ``q``, the Poisson sampling rate, in ``(0, 1]``.
    scale : float
        Laplace scale ``b > 0``.
    clip_norm : float
        ``C > 0``.
    dim : int
        Number of coordinates ``n``.

    Returns
    -------
    float

    Examples
    --------
    >>> from dpmath.lap2 import published_log_moment
    >>> round(published_log_moment(8, 0.01, 0.5, 1.0, 1000), 4)
    0.0392
    """
    x = majorizer(dim, clip_norm)
    total = 0.0
    for start in range(0, x.size, 1 << 16):
        total += float(univariate_log_moment(x[start:start + (1 << 16)], order, sample_rate, scale).sum())
    return total


def published_epsilon(delta: float, sample_rate: float, steps: int, scale: float, clip_norm: float, dim: int,
                      orders: ArrayLike = tuple(range(1, 129))) -> float:
    r"""Epsilon of LAP2 by the paper's accountant **as published** (unsound; for comparison only).

    ``T`` steps compose to ``T alpha_G(lambda)`` (eq. II.8) with :func:`published_log_moment`, and the
    paper converts with Balle et al.'s formula (Sec. II-B),

    .. math::

        \varepsilon = \min_\lambda \frac{T \alpha_G(\lambda)}{\lambda} + \log\frac{\lambda}{\lambda+1}
        - \frac{\log\delta + \log(\lambda+1)}{\lambda},

    i.e. Renyi order ``lambda + 1``.  Use :class:`~dpmath.SubsampledL2Laplace` for a sound number.

    Parameters
    ----------
    delta : float
        In ``(0, 1)``.
    sample_rate : float
        ``q``, the Poisson sampling rate, in ``(0, 1]``.
    steps : int
        ``T >= 1``.
    scale, clip_norm : float
        Laplace scale ``b`` and clipping norm ``C``.
    dim : int
        Number of coordinates ``n``.
    orders : sequence of int
        The ``lambda`` searched.

    Returns
    -------
    float

    Examples
    --------
    >>> from dpmath.lap2 import published_epsilon
    >>> round(published_epsilon(1e-5, 0.01, 1000, 2.0, 1.0, 1000), 3)
    1.031
    """
    delta = open_probability(delta, "delta")
    steps = positive_int(steps, "steps")
    lams = [_order(o) for o in np.atleast_1d(np.asarray(orders)).tolist()]
    moments = np.array([published_log_moment(lam, sample_rate, scale, clip_norm, dim) for lam in lams])
    lam = np.array(lams, dtype=np.float64)
    eps, _ = rdp_to_epsilon(steps * moments / lam, lam + 1.0, delta, "balle")
    return eps


def joint_log_moment(gradient: ArrayLike, order: int, sample_rate: float, scale: float = 1.0) -> float:
    r"""Exact ``log E_{Lap(0)^n}[(1 - q + q prod_i L_i)^{lambda+1}]`` of one LAP2 step for gradient ``g``.

    .. math::

        \log \sum_{\eta=0}^{\lambda+1} \binom{\lambda+1}{\eta} (1-q)^{\lambda+1-\eta} q^\eta
        \prod_{i=1}^n F(|g_i|, \eta)

    (the coordinates' ratios ``L_i`` are independent under ``Lap(0, b)^n``).  This is the moment the
    moments accountant needs in the add direction; its supremum over ``||g||_2 <= C`` is what
    :func:`published_log_moment` claims to bound.

    Parameters
    ----------
    gradient : array_like
        The added example's clipped gradient ``g`` (any length).
    order : int
        ``lambda >= 1``.
    sample_rate : float
        ``q``, the Poisson sampling rate, in ``(0, 1]``.
    scale : float
        Laplace scale ``b > 0``.

    Returns
    -------
    float

    Examples
    --------
    >>> import numpy as np
    >>> from dpmath.lap2 import joint_log_moment, published_log_moment
    >>> g = np.full(10, 1 / np.sqrt(10))                      # ||g||_2 = 1 = C
    >>> round(joint_log_moment(g, 8, 0.01, 0.5), 2)
    4.41
    >>> joint_log_moment(g, 8, 0.01, 0.5) > published_log_moment(8, 0.01, 0.5, 1.0, 1000)
    True
    """
    g = np.abs(real_array(gradient, "gradient", allow_inf=False)).ravel()
    lam = _order(order)
    q = checked_sample_rate(sample_rate, "sample_rate")
    b = positive_real(scale, "scale")
    eta = np.arange(lam + 2, dtype=np.float64)
    return float(log_subsampled_moment(lam + 1, q, _log_moment_terms(g[:, None] / b, eta[None, :]).sum(axis=0)))


def laplace_tradeoff(alpha: ArrayLike, shift: float) -> np.ndarray:
    r"""Trade-off function ``f_t`` of the Laplace mechanism with shift ``t`` noise scales.

    .. math::

        f_t(\alpha) = \begin{cases} 1 - e^t \alpha & \alpha < e^{-t}/2 \\
        e^{-t} / (4\alpha) & e^{-t}/2 \le \alpha \le 1/2 \\ e^{-t}(1 - \alpha) & \alpha > 1/2 \end{cases}

    (Dong, Roth, Su 2022, Sec. 2.4).

    Parameters
    ----------
    alpha : array_like
        Type I errors in ``[0, 1]``.
    shift : float
        ``t = u / b >= 0``.

    Returns
    -------
    numpy.ndarray

    Examples
    --------
    >>> from dpmath.lap2 import laplace_tradeoff
    >>> laplace_tradeoff([0.0, 0.5, 1.0], 1.0).round(4).tolist()
    [1.0, 0.1839, 0.0]
    """
    a = real_array(alpha, "alpha")
    if ((a < 0) | (a > 1)).any():
        raise ValueError("alpha must lie in [0, 1]")
    t = non_negative(shift, "shift")
    with np.errstate(divide="ignore"):
        mid = math.exp(-t) / (4.0 * np.where(a > 0, a, 1.0))
    return np.where(a < 0.5 * math.exp(-t), 1.0 - math.exp(t) * a,
                    np.where(a <= 0.5, mid, math.exp(-t) * (1.0 - a)))


def _gap(a: np.ndarray, t: float) -> np.ndarray:
    """``Phi^{-1}(1 - a) - Phi^{-1}(f_t(a))``: the ``mu`` that makes ``G_mu(a) = f_t(a)``."""
    lo = a < 0.5 * math.exp(-t)
    out = np.empty_like(a)
    out[lo] = -special.ndtri(a[lo]) + special.ndtri(math.exp(t) * a[lo])  # both quantiles in their tails
    mid = ~lo & (a <= 0.5)
    out[mid] = -special.ndtri(a[mid]) - special.ndtri(math.exp(-t) / (4.0 * a[mid]))
    hi = a > 0.5
    out[hi] = -special.ndtri(a[hi]) - special.ndtri(math.exp(-t) * (1.0 - a[hi]))
    return out


def laplace_gdp_mu(shift: float) -> float:
    r"""Smallest ``mu`` with ``G_mu <= f_t``: the Gaussian-DP parameter of a Laplace shift ``t = u/b``.

    .. math:: \mu(t) = \sup_{\alpha \in (0,1)} \Phi^{-1}(1-\alpha) - \Phi^{-1}(f_t(\alpha))

    computed by a dense log-spaced grid in ``alpha`` refined with a bounded scalar search.  The ratio
    ``mu(t)/t`` decreases from ``sqrt(pi/2) = 1.2533`` (the limit ``t -> 0``, set by the kink of
    ``f_t`` at ``alpha = 1/2``) to 0.34 at ``t = 30``; :data:`LAPLACE_GDP_FACTOR` is its supremum.

    Parameters
    ----------
    shift : float
        ``t > 0``.

    Returns
    -------
    float

    Examples
    --------
    >>> from dpmath.lap2 import laplace_gdp_mu
    >>> round(laplace_gdp_mu(1.0), 3)
    1.03
    >>> laplace_gdp_mu(1e-3) / 1e-3 < 1.2533141373155
    True
    """
    t = positive_real(shift, "shift")
    a = np.concatenate([np.logspace(-300, math.log10(0.5), 20000), 1.0 - np.logspace(-16, math.log10(0.5), 2000)])
    gaps = _gap(a, t)
    i = int(np.nanargmax(gaps))
    lo, hi = a[max(i - 1, 0)], a[min(i + 1, a.size - 1)]
    if hi > lo:
        res = optimize.minimize_scalar(lambda v: -_gap(np.array([v]), t)[0], bounds=(lo, hi), method="bounded",
                                       options={"xatol": 1e-15 * max(lo, 1e-300)})
        return float(max(gaps[i], -res.fun))
    return float(gaps[i])

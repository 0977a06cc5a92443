r"""Coordinate-wise sampling, twice sampling and hybrid clipping (paper 002), as RDP mechanisms.

Setting (paper 002, Sec. 5): each example's vector is clipped to l2 norm ``c2`` *and* to l-infinity
norm ``c_inf`` (so at most ``d0 = (c2/c_inf)^2`` coordinates can carry the full ``c_inf``); Gaussian
noise of standard deviation ``sigma`` (``noise_std``: absolute units, like ``c2`` and ``c_inf``, so it is
the noise multiplier times ``c2``) is added to every coordinate.

* **Coordinate-wise sampling** (Alg. 1, Thm 5.2, eq. 7): each coordinate of the sum is formed from its
  own Poisson sample of rate ``q`` (``coordinate_rate``).  Coordinates are then independent
  subsampled-Gaussian pairs, so the Renyi divergence is a sum over coordinates of ``phi(s_l^2)``, with
  ``phi`` convex in ``s^2`` (log-sum-exp of linear functions); its maximum over
  ``{sum s_l^2 <= c2^2, |s_l| <= c_inf}`` is at a vertex: ``floor(d0)`` coordinates at ``c_inf`` and one
  at ``c' = sqrt(c2^2 - floor(d0) c_inf^2)`` (Remark 5.1; :func:`coordinate_sampling_rdp`).  Eq. (7)
  with a fractional ``d0`` multiplies by ``d0`` instead, which is larger (``phi(r y) <= r phi(y)`` for
  ``r <= 1``, ``phi(0) = 0``), so still an upper bound; we use the exact vertex.
* **Twice sampling** (Alg. 2, Thm 5.4, eq. 8): a Poisson sample of rate ``q1`` (``sample_rate``) of the
  examples, then coordinate-wise sampling of rate ``q2`` (``coordinate_rate``) within it:
  ``eps(a) = log((1-q1)^a + sum_v C(a,v) (1-q1)^{a-v} q1^v e^{(v-1) eps0(v)}) / (a-1)`` with ``eps0``
  the coordinate-wise RDP at rate ``q2``.
* **Hybrid clipping with twice sampling** (Thm 5.6): ``m`` orthogonal subspaces of ranks ``r_j``, each
  clipped to ``(c2_j, c_inf_j)`` with its own noise ``sigma_j``; ``eps0`` is the sum over subspaces.

All three are valid at integer orders only (binomial expansions); :meth:`rdp` returns ``inf`` at the
others, which any accountant may safely take.  Noise allocations: :func:`hypercube_noise` (Thm 4.5)
and :func:`hybrid_noise` (Thm 4.6).  The paper's argument names (``sigma``, ``q``, ``q1``, ``q2``,
``sigmas``) still work as keywords and attributes until dpmath 0.3, with a :class:`DeprecationWarning`.

Checked against the paper (``tests/dpmath/test_twice_sampling.py``, ``benchmarks/twice_sampling.py``): with
the *classic* conversion of its Lemma 2.3 (integer orders 2-256), ``q = 0.005``, ``T = 10^4``,
``delta = 1e-5``, ``sigma = 0.48`` gives 30.43 for input-wise sampling (paper: 30.4) and 8.25 for twice
sampling ``(0.01, 1/2)`` at ``d0 = 64`` (paper: "8"); Table 1's noise-variance ratios are reproduced
within 3 points except two entries of the ``eps = 4`` column, which match each other's row (a swap in
the published table).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from .rdp import log_subsampled_moment, subsampled_gaussian_rdp
from .validation import positive_int, positive_real, real_array
from .validation import sample_rate as checked_sample_rate

__all__ = [
    "CoordinateSampledGaussian",
    "TwiceSampledGaussian",
    "HybridTwiceSampledGaussian",
    "coordinate_sampling_rdp",
    "twice_sampling_rdp",
    "split_d0",
    "hypercube_noise",
    "hybrid_noise",
]


def split_d0(c2: float, c_inf: float) -> tuple[int, float]:
    """``(floor(d0), c'^2)``: the vertex of ``{sum s^2 <= c2^2, |s| <= c_inf}``."""
    full = math.floor((c2 / c_inf) ** 2 + 1e-9)  # (c2/c_inf)^2 rounded to 99.999... must give 100
    rest = max(c2 * c2 - full * c_inf * c_inf, 0.0)
    return full, rest


def _integer_orders(orders: ArrayLike) -> np.ndarray:
    o = real_array(orders, "orders", allow_inf=False).ravel()
    if o.size == 0 or (o <= 1).any():
        raise ValueError("orders must be a non-empty list of numbers > 1")
    return o


def coordinate_sampling_rdp(noise_std: float, coordinate_rate: float, c2: float, c_inf: float,
                            orders: ArrayLike) -> np.ndarray:
    r"""RDP of coordinate-wise Poisson sampling with l2 + l-infinity clipping (paper 002, eq. 7, Remark 5.1).

    .. math::

        \varepsilon(\alpha) = \frac{\lfloor d_0 \rfloor}{\alpha-1} \log A_\alpha(c_\infty)
        + \frac{1}{\alpha-1}\log A_\alpha(c'), \quad
        A_\alpha(s) = \sum_{v=0}^{\alpha}\binom{\alpha}{v}(1-q)^{\alpha-v}q^v e^{v(v-1)s^2/(2\sigma^2)},

    with ``d0 = (c2/c_inf)^2`` and ``c'^2 = c2^2 - floor(d0) c_inf^2``; ``inf`` at non-integer orders.

    Parameters
    ----------
    noise_std : float
        ``sigma``, the noise standard deviation per coordinate (``> 0``, same units as ``c2``).
    coordinate_rate : float
        ``q``, the coordinate-wise sampling rate, in ``(0, 1]``.
    c2, c_inf : float
        l2 and l-infinity clipping norms, ``0 < c_inf <= c2``.
    orders : array_like
        Renyi orders ``> 1``.

    Returns
    -------
    numpy.ndarray

    Examples
    --------
    >>> from dpmath.twice_sampling import coordinate_sampling_rdp
    >>> from dpmath.rdp import subsampled_gaussian_rdp
    >>> a = coordinate_sampling_rdp(1.0, 0.01, 1.0, 1.0, [2, 3])   # d0 = 1: input-wise sampling
    >>> bool(abs(a - subsampled_gaussian_rdp(1.0, 0.01, [2, 3])).max() < 1e-12)
    True
    """
    s = positive_real(noise_std, "noise_std")
    q = checked_sample_rate(coordinate_rate, "coordinate_rate")
    c2 = positive_real(c2, "c2")
    c_inf = positive_real(c_inf, "c_inf")
    if c_inf > c2:
        raise ValueError(f"c_inf must be at most c2 (a coordinate cannot exceed the l2 norm), got {c_inf} > {c2}")
    o = _integer_orders(orders)
    full, rest = split_d0(c2, c_inf)
    out = np.full(o.size, np.inf)
    ints = o == np.round(o)
    # each coordinate is a subsampled Gaussian with noise multiplier sigma / (its sensitivity)
    out[ints] = full * subsampled_gaussian_rdp(s / c_inf, q, o[ints])
    if rest > 0:
        out[ints] += subsampled_gaussian_rdp(s / math.sqrt(rest), q, o[ints])
    return out


def twice_sampling_rdp(sample_rate: float, base_rdp, orders: ArrayLike) -> np.ndarray:
    r"""Paper 002, Thm 5.4 (eq. 8): RDP of a ``q1`` Poisson sample fed to a mechanism of RDP ``eps0``.

    .. math::

        \varepsilon(\alpha) = \frac{1}{\alpha-1}\log\Big((1-q_1)^\alpha + \sum_{v=1}^{\alpha}
        \binom{\alpha}{v}(1-q_1)^{\alpha-v} q_1^v e^{(v-1)\varepsilon_0(v)}\Big)

    Parameters
    ----------
    sample_rate : float
        ``q1``, the input-wise (example) sampling rate, in ``(0, 1]``.
    base_rdp : callable
        ``base_rdp(orders) -> array``: ``eps0`` at integer orders ``2..alpha``.
    orders : array_like
        Renyi orders ``> 1`` (``inf`` at non-integer ones).

    Returns
    -------
    numpy.ndarray

    Examples
    --------
    >>> from dpmath.twice_sampling import twice_sampling_rdp
    >>> from dpmath.rdp import subsampled_gaussian_rdp
    >>> gauss = lambda o: [a / 2.0 for a in o]          # Gaussian mechanism, sigma = 1
    >>> bool(abs(twice_sampling_rdp(0.1, gauss, [4]) - subsampled_gaussian_rdp(1.0, 0.1, [4]))[0] < 1e-12)
    True
    """
    q1 = checked_sample_rate(sample_rate, "sample_rate")
    o = _integer_orders(orders)
    ints = o[o == np.round(o)].astype(int)
    out = np.full(o.size, np.inf)
    if ints.size == 0:
        return out
    top = int(ints.max())
    eps0 = np.zeros(top + 1)
    eps0[2:] = np.asarray(base_rdp(np.arange(2, top + 1, dtype=np.float64)), dtype=np.float64)
    log_terms = np.zeros(top + 1)
    log_terms[2:] = (np.arange(2, top + 1) - 1) * eps0[2:]
    for n, alpha in enumerate(o):
        if alpha == round(alpha):
            a = int(alpha)
            out[n] = float(log_subsampled_moment(a, q1, log_terms)) / (a - 1)
    return out


@dataclass(frozen=True)
class CoordinateSampledGaussian:
    """Coordinate-wise Poisson sampling of rate ``coordinate_rate`` with l2 (``c2``) and l-infinity (``c_inf``)
    clipping and Gaussian noise of standard deviation ``noise_std`` per coordinate (paper 002, Alg. 1); see
    :func:`coordinate_sampling_rdp`.

    Examples
    --------
    >>> from dpmath.rdp import RDPAccountant
    >>> from dpmath.twice_sampling import CoordinateSampledGaussian
    >>> m = CoordinateSampledGaussian(noise_std=0.48, coordinate_rate=0.005, c2=1.0, c_inf=0.125)
    >>> round(RDPAccountant(orders=range(2, 257), conversion="classic").compose(m, 10_000).epsilon(1e-5), 2)
    5.68
    """

    noise_std: float
    coordinate_rate: float
    c2: float = 1.0
    c_inf: float = 1.0

    def __post_init__(self) -> None:
        coordinate_sampling_rdp(self.noise_std, self.coordinate_rate, self.c2, self.c_inf, [2])  # validates

    def rdp(self, orders: ArrayLike) -> np.ndarray:
        """Renyi divergence at ``orders`` (``inf`` at non-integer orders)."""
        return coordinate_sampling_rdp(self.noise_std, self.coordinate_rate, self.c2, self.c_inf, orders)


@dataclass(frozen=True)
class TwiceSampledGaussian:
    """Twice sampling (paper 002, Alg. 2): Poisson rate ``sample_rate`` (``q1``) over examples, then rate
    ``coordinate_rate`` (``q2``) per coordinate, l2 + l-infinity clipping, Gaussian noise of standard deviation
    ``noise_std`` per coordinate; see :func:`twice_sampling_rdp`.

    Examples
    --------
    >>> from dpmath.rdp import RDPAccountant
    >>> from dpmath.twice_sampling import TwiceSampledGaussian
    >>> m = TwiceSampledGaussian(noise_std=0.48, sample_rate=0.01, coordinate_rate=0.5, c2=1.0, c_inf=0.125)
    >>> round(RDPAccountant(orders=range(2, 257), conversion="classic").compose(m, 10_000).epsilon(1e-5), 2)
    8.25
    """

    noise_std: float
    sample_rate: float
    coordinate_rate: float
    c2: float = 1.0
    c_inf: float = 1.0

    def __post_init__(self) -> None:
        checked_sample_rate(self.sample_rate, "sample_rate")
        coordinate_sampling_rdp(self.noise_std, self.coordinate_rate, self.c2, self.c_inf, [2])

    def rdp(self, orders: ArrayLike) -> np.ndarray:
        """Renyi divergence at ``orders`` (``inf`` at non-integer orders)."""
        return twice_sampling_rdp(self.sample_rate, lambda o: coordinate_sampling_rdp(
            self.noise_std, self.coordinate_rate, self.c2, self.c_inf, o), orders)


@dataclass(frozen=True)
class HybridTwiceSampledGaussian:
    """Hybrid clipping with twice sampling (paper 002, Thm 5.6): subspace ``j`` is clipped to
    ``(c2[j], c_inf[j])`` and gets Gaussian noise of standard deviation ``noise_stds[j]``; ``eps0`` sums the
    subspaces' coordinate-wise RDP at ``coordinate_rate`` (``q2``), then eq. (8) applies with ``sample_rate``
    (``q1``).

    Examples
    --------
    >>> from dpmath.rdp import RDPAccountant
    >>> from dpmath.twice_sampling import HybridTwiceSampledGaussian, TwiceSampledGaussian
    >>> one = TwiceSampledGaussian(0.5, 0.02, 0.5, 1.0, 0.1)
    >>> split = HybridTwiceSampledGaussian((0.5,), 0.02, 0.5, (1.0,), (0.1,))   # one subspace: the same
    >>> bool(abs(one.rdp([4]) - split.rdp([4]))[0] < 1e-12)
    True
    """

    noise_stds: tuple[float, ...]
    sample_rate: float
    coordinate_rate: float
    c2: tuple[float, ...]
    c_inf: tuple[float, ...]

    def __post_init__(self) -> None:
        for name in ("noise_stds", "c2", "c_inf"):
            object.__setattr__(self, name, tuple(float(v) for v in np.atleast_1d(getattr(self, name))))
        if not len(self.noise_stds) == len(self.c2) == len(self.c_inf) or not self.noise_stds:
            raise ValueError("noise_stds, c2 and c_inf must be non-empty and of the same length (one per subspace)")
        checked_sample_rate(self.sample_rate, "sample_rate")
        for s, a, b in zip(self.noise_stds, self.c2, self.c_inf, strict=True):
            coordinate_sampling_rdp(s, self.coordinate_rate, a, b, [2])

    def _base(self, orders: np.ndarray) -> np.ndarray:
        return sum(coordinate_sampling_rdp(s, self.coordinate_rate, a, b, orders)
                   for s, a, b in zip(self.noise_stds, self.c2, self.c_inf, strict=True))

    def rdp(self, orders: ArrayLike) -> np.ndarray:
        """Renyi divergence at ``orders`` (``inf`` at non-integer orders)."""
        return twice_sampling_rdp(self.sample_rate, self._base, orders)


def hypercube_noise(sides: ArrayLike) -> np.ndarray:
    r"""Paper 002, Thm 4.5: the optimal Gaussian noise shape for a hypercube sensitivity set.

    For ``S = {sum_l s_l u_l : |s_l| <= V_l}`` the noise standard deviations along ``u_l`` that minimize
    the RDP for a fixed total variance ``sum sigma_l^2 = 1`` are

    .. math:: \sigma_l = \sqrt{V_l / \textstyle\sum_j V_j},

    so the noise power needed scales with ``(sum_l V_l)^2`` (the l1 norm of the sides), not with ``d``.

    Parameters
    ----------
    sides : array_like
        ``V_l >= 0``, not all zero.

    Returns
    -------
    numpy.ndarray
        ``sigma_l`` with ``sum sigma_l^2 = 1``.

    Examples
    --------
    >>> from dpmath.twice_sampling import hypercube_noise
    >>> hypercube_noise([4.0, 1.0, 0.0]).round(4).tolist()
    [0.8944, 0.4472, 0.0]
    """
    v = real_array(sides, "sides", allow_inf=False).ravel()
    if (v < 0).any() or v.sum() <= 0:
        raise ValueError("sides must be non-negative and not all zero")
    return np.sqrt(v / v.sum())


def hybrid_noise(c2: Sequence[float], ranks: Sequence[int]) -> np.ndarray:
    r"""Paper 002, Thm 4.6: optimal isotropic noise per subspace for hybrid l2 clipping.

    Subspace ``j`` (rank ``r_j``, clipped to ``c2_j``) gets standard deviation

    .. math:: \sigma_j = \sqrt{\frac{c_{2j}}{\sqrt{r_j}\,\sum_l c_{2l}\sqrt{r_l}}}

    (normalized so that ``sum_j r_j sigma_j^2 = 1``); the total noise power needed is proportional to
    ``(sum_j c_{2j} sqrt(r_j))^2`` against ``(sum_j r_j)(sum_j c_{2j}^2)`` for one isotropic ball.

    Parameters
    ----------
    c2 : sequence of float
        Clipping norms ``> 0`` per subspace.
    ranks : sequence of int
        Ranks ``r_j >= 1``.

    Returns
    -------
    numpy.ndarray

    Examples
    --------
    >>> from dpmath.twice_sampling import hybrid_noise
    >>> s = hybrid_noise([2.5, 1.0], [1000, 290898])
    >>> round(float((s ** 2 * [1000, 290898]).sum()), 12)
    1.0
    """
    c = real_array(c2, "c2", allow_inf=False).ravel()
    r = np.array([positive_int(v, "ranks") for v in np.atleast_1d(ranks)], dtype=np.float64)
    if c.size != r.size or c.size == 0:
        raise ValueError("c2 and ranks must be non-empty and of the same length")
    if (c <= 0).any():
        raise ValueError("c2 must be positive")
    return np.sqrt(c / (np.sqrt(r) * np.sum(c * np.sqrt(r))))

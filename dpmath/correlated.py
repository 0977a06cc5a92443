r"""Correlated noise: banded Toeplitz matrix factorization (DP-FTRL / MF-DP-SGD) and its accounting.

A run of ``n`` steps releases the noisy gradients :math:`\hat x = x + C^{-1} z`, where :math:`x` stacks the steps'
clipped sums, :math:`z_t \sim N(0, \sigma^2 I)` and :math:`C` is the **strategy**: lower-triangular, Toeplitz and
``b``-banded, :math:`C_{t,s} = c_{t-s}` for :math:`0 \le t - s < b`.  Equivalently the mechanism releases
:math:`C x + z`, a Gaussian mechanism, and training post-processes it; the noise added at step ``t`` is
:math:`w_t = (C^{-1} z)_t`, made by the recurrence :math:`w_t = (z_t - \sum_{j=1}^{b-1} c_j w_{t-j}) / c_0`
(:meth:`BandedStrategy.correlate`), which keeps the last ``b - 1`` noise vectors: ``O(b d)`` memory.

**Sensitivity.**  One example that takes part at steps :math:`\pi` with clipped gradients :math:`\|g_t\| \le 1`
moves :math:`Cx` by :math:`\sum_{t \in \pi} C_{:,t} g_t`, whose squared norm is at most
:math:`\sum_{s,t \in \pi} |G_{st}|` with :math:`G = C^\top C`.  Participations at least ``b`` steps apart have
disjoint column supports, so the bound is :math:`k \|c\|^2` for ``k`` participations, exactly
(:meth:`BandedStrategy.sensitivity`); closer participations are bounded from above.

**Accounting** (:class:`BandedMatrixFactorization`).  Without amplification the run is one Gaussian mechanism of
noise multiplier :math:`\sigma / \mathrm{sens}`.  With **cyclic Poisson sampling** (the data split into ``b``
groups; at step ``t`` each example of group ``t mod b`` joins the batch with probability ``q``, the others never),
an example's participations are ``b`` apart, and the rows of :math:`Cx + z` that participation ``i`` can move,
``t_i .. t_i + b - 1``, are disjoint from the other participations' rows.  Given everything else released, the
window of participation ``i`` is the mixture :math:`q N(C_{:,t_i} g, \sigma^2 I) + (1-q) N(0, \sigma^2 I)` against
:math:`N(0, \sigma^2 I)` on those rows, which the subsampled Gaussian of noise multiplier
:math:`\sigma / \|c\|` dominates (rotate :math:`C_{:,t_i} g` onto one axis; its norm is at most :math:`\|c\|`).  By
adaptive composition over the disjoint windows the run is dominated by ``ceil(n / b)`` subsampled-Gaussian steps
(Choquette-Choo et al., "Amplified banded matrix factorization", NeurIPS 2023).  With randomized clipping the
gradient's norm is the estimator's random scale :math:`a`, fresh at each participation: the window's shift has norm
:math:`a \|c\|`, and the same argument gives ``ceil(n / b)`` steps of
:class:`~dpmath.mechanisms.SubsampledGaussian` with the envelope at noise multiplier :math:`\sigma / \|c\|`.

Examples
--------
>>> from dpmath import PLDAccountant
>>> from dpmath.correlated import BandedMatrixFactorization, BandedStrategy
>>> strategy = BandedStrategy.sqrt_prefix_sum(4)
>>> run = BandedMatrixFactorization(1.0, strategy, steps=400, sample_rate=0.04)
>>> run.participations, round(run.step().noise_multiplier, 4)
(100, 0.8197)
>>> round(run.epsilon(1e-5), 3)
4.435
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import linalg, optimize, signal

from .envelope import Envelope
from .mechanisms import Gaussian, SubsampledGaussian
from .validation import positive_int, positive_real
from .validation import sample_rate as checked_sample_rate

__all__ = ["BandedStrategy", "BLTStrategy", "BandedMatrixFactorization", "prefix_sum_errors"]


def _lower_toeplitz(first_column: np.ndarray) -> np.ndarray:
    """The lower-triangular Toeplitz matrix with this first column (a strategy's ``C``, for checks)."""
    return linalg.toeplitz(first_column, np.zeros_like(first_column))


@dataclass(frozen=True)
class BandedStrategy:
    r"""A lower-triangular banded Toeplitz strategy :math:`C`: ``coefficients`` :math:`c_0, \dots, c_{b-1}`
    (``c_0 > 0``; ``b`` is the number of bands).

    Examples
    --------
    >>> from dpmath.correlated import BandedStrategy
    >>> s = BandedStrategy((1.0, 0.5))
    >>> s.matrix(3)
    array([[1. , 0. , 0. ],
           [0.5, 1. , 0. ],
           [0. , 0.5, 1. ]])
    >>> s.sensitivity(participations=2, min_separation=2)   # columns 2 apart: disjoint supports
    1.5811388300841898
    """

    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        try:
            c = tuple(float(v) for v in self.coefficients)
        except (TypeError, ValueError):
            raise ValueError(f"coefficients must be a sequence of numbers, got {self.coefficients!r}") from None
        if not c or not all(math.isfinite(v) for v in c):
            raise ValueError(f"coefficients must be a non-empty sequence of finite numbers, got {self.coefficients!r}")
        if c[0] <= 0:
            raise ValueError(f"coefficients[0] (the diagonal) must be > 0, got {c[0]!r}")
        object.__setattr__(self, "coefficients", c)

    @property
    def bands(self) -> int:
        """``b``: the number of coefficients."""
        return len(self.coefficients)

    @property
    def column_norm(self) -> float:
        r""":math:`\|c\|_2`, the norm of every column at least ``b - 1`` steps from the end (the largest)."""
        return float(np.linalg.norm(self.coefficients))

    @classmethod
    def sqrt_prefix_sum(cls, bands: int) -> BandedStrategy:
        r"""The square root of the prefix-sum matrix, truncated to ``bands`` bands: :math:`c_j = \binom{2j}{j}
        4^{-j}` (the Toeplitz :math:`A^{1/2}` of Henzinger et al. and Fichtenberger et al.).

        Examples
        --------
        >>> from dpmath.correlated import BandedStrategy
        >>> BandedStrategy.sqrt_prefix_sum(3).coefficients
        (1.0, 0.5, 0.375)
        """
        b = positive_int(bands, "bands")
        c = [1.0]
        for j in range(1, b):
            c.append(c[-1] * (2 * j - 1) / (2 * j))
        return cls(tuple(c))

    @classmethod
    def optimized(cls, bands: int, steps: int, error: str = "mean") -> BandedStrategy:
        r"""The ``bands``-banded Toeplitz strategy that minimizes the prefix-sum workload's squared error at equal
        sensitivity over ``steps`` steps: :math:`\|c\|^2` times the ``"mean"`` (or ``"max"``) over steps of
        :math:`\|(A C^{-1})_{t,:}\|^2` (:func:`prefix_sum_errors`), by L-BFGS from :meth:`sqrt_prefix_sum`;
        ``O(steps x bands)`` per evaluation.  The result is normalized to ``c_0 = 1``.

        Examples
        --------
        >>> from dpmath.correlated import BandedStrategy, prefix_sum_errors
        >>> best = BandedStrategy.optimized(4, 256)
        >>> sqrt = BandedStrategy.sqrt_prefix_sum(4)
        >>> bool(prefix_sum_errors(best, 256)[0] <= prefix_sum_errors(sqrt, 256)[0])
        True
        """
        b, n = positive_int(bands, "bands"), positive_int(steps, "steps")
        if error not in ("mean", "max"):
            raise ValueError(f"error must be 'mean' or 'max', got {error!r}")
        start = np.array(cls.sqrt_prefix_sum(b).coefficients[1:])
        if b == 1:
            return cls((1.0,))
        which = 0 if error == "mean" else 1

        def loss(tail: np.ndarray) -> float:
            value = prefix_sum_errors(cls((1.0, *tail)), n)[which]
            return math.log(value) if math.isfinite(value) else 1e300

        result = optimize.minimize(loss, start, method="L-BFGS-B")
        best = result.x if result.fun <= loss(start) else start
        return cls((1.0, *(float(v) for v in best)))

    def matrix(self, steps: int) -> np.ndarray:
        """``C`` as a dense ``(steps, steps)`` array (for checks; training never builds it)."""
        n = positive_int(steps, "steps")
        first = np.zeros(n)
        first[:min(n, self.bands)] = self.coefficients[:n]
        return _lower_toeplitz(first)

    def inverse_coefficients(self, steps: int) -> np.ndarray:
        r"""The first ``steps`` coefficients :math:`r` of :math:`C^{-1}` (lower-triangular Toeplitz, not banded):
        :math:`r_0 = 1/c_0`, :math:`r_k = -\sum_{j=1}^{\min(k, b-1)} c_j r_{k-j} / c_0`.  ``O(steps x bands)``."""
        n = positive_int(steps, "steps")
        c = np.asarray(self.coefficients)
        r = np.zeros(n)
        r[0] = 1.0 / c[0]
        for k in range(1, n):
            m = min(k, c.size - 1)
            r[k] = -np.dot(c[1:m + 1], r[k - 1::-1][:m]) / c[0]
        return r

    def correlate(self, z: np.ndarray, history: list | None = None) -> np.ndarray:
        r"""The correlated noise :math:`w = C^{-1} z` of independent noise ``z`` (steps along axis 0), by the
        streaming recurrence :math:`w_t = (z_t - \sum_{j=1}^{b-1} c_j w_{t-j}) / c_0`.  ``history`` (a list, most
        recent last, at most ``b - 1`` kept) carries the earlier steps' ``w`` across calls, so a run can be made one
        step at a time; it is updated in place.

        Examples
        --------
        >>> import numpy as np
        >>> from dpmath.correlated import BandedStrategy
        >>> s, z = BandedStrategy((1.0, 0.5, 0.25)), np.arange(1.0, 6.0)
        >>> bool(np.allclose(s.correlate(z), np.linalg.solve(s.matrix(5), z)))
        True
        >>> past = []
        >>> bool(np.allclose(np.stack([s.correlate(z[t:t + 1], past)[0] for t in range(5)]), s.correlate(z)))
        True
        """
        z = np.asarray(z, dtype=np.float64)
        c = self.coefficients
        past = [] if history is None else history
        out = np.empty_like(z)
        for t in range(z.shape[0]):
            w = z[t].copy()
            for j in range(1, min(len(c), len(past) + 1)):
                w -= c[j] * past[-j]
            w /= c[0]
            out[t] = w
            past.append(w)
            if len(past) > len(c) - 1:
                del past[0]
        if len(c) == 1:
            past.clear()
        return out

    def sensitivity(self, participations: int = 1, min_separation: int | None = None) -> float:
        r"""The largest :math:`\|\sum_{t \in \pi} C_{:,t} g_t\|` over at most ``participations`` steps at least
        ``min_separation`` apart (default: ``b``), :math:`\|g_t\| \le 1`, and runs of any length; an upper bound
        where it is not exact.

        * ``min_separation >= b``: the columns do not meet, :math:`\sqrt{k}\,\|c\|` (exact).
        * Closer, with non-negative non-increasing coefficients (the square-root strategy's): exact, the pattern
          ``0, s, 2 s, ...`` with whole columns, :math:`k G(0) + 2 \sum_{m=1}^{k-1} (k - m) G(m s)` with
          :math:`G(d) = \sum_j c_j c_{j+d}` (arXiv 2405.13763, Thm. 2; every entry of ``C^T C`` is then
          non-negative, so the participations' gradients are best aligned, and a column cut short by the run's end
          only loses terms).
        * Otherwise: :math:`k` times the largest row sum of :math:`|C^T C|` a participation can see, its own
          :math:`\|c\|^2` plus, on its two sides together, at most ``k - 1`` others within its band, each side's
          at least ``s`` apart from one another (a dynamic program over the band's offsets); near the run's end a
          column loses its last rows, so each :math:`|G(d)|` is the largest of its prefix sums.

        Examples
        --------
        >>> from dpmath.correlated import BandedStrategy
        >>> s = BandedStrategy.sqrt_prefix_sum(4)
        >>> round(s.sensitivity(4, 1), 6), round(s.sensitivity(4, 4), 6)
        (3.678485, 2.439903)
        """
        k = positive_int(participations, "participations")
        b = self.bands
        s = b if min_separation is None else positive_int(min_separation, "min_separation")
        c = np.asarray(self.coefficients)
        per = float(np.dot(c, c))
        if s >= b or k == 1:
            return float(math.sqrt(k * per))
        if np.all(c >= 0) and np.all(np.diff(c) <= 0):
            total = k * per + 2.0 * sum((k - m) * float(np.dot(c[:b - m * s], c[m * s:]))
                                        for m in range(1, min(k, (b - 1) // s + 1)))
            return float(math.sqrt(total))
        # |G(d)| for d = s .. b-1, each the largest prefix sum (a column cut short by the run's end)
        near = np.array([np.max(np.abs(np.cumsum(c[:b - d] * c[d:]))) for d in range(s, b)])
        side = _spaced_best(near, s, k - 1)   # side[j]: the best j offsets of one side, s apart
        best = max(side[i] + side[j] for i in range(side.size) for j in range(side.size) if i + j <= k - 1)
        return float(math.sqrt(k * (per + best)))


def _spaced_best(values: np.ndarray, s: int, most: int) -> np.ndarray:
    """``out[j]``: the largest sum of ``j`` of ``values`` (offsets ``s, s + 1, ...`` of a band) at positions at least
    ``s`` apart, for ``j = 0 .. most`` (as many as fit; a dynamic program, ``O(len(values)^2 most)``)."""
    n = values.size
    out = [0.0]
    last = values.astype(float).copy()   # best sum of j picks whose last pick is at position i
    for _ in range(min(most, (n - 1) // s + 1)):
        if not np.isfinite(last).any():
            break
        out.append(float(np.max(last)))
        head = np.maximum.accumulate(last)   # best with the last pick at or before i
        nxt = np.full(n, -np.inf)
        nxt[s:] = values[s:] + head[:n - s]
        last = nxt
    return np.array(out)


def _blt_interlaced(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    r"""A BLT and its inverse from ``2 d`` unconstrained logits (along the last axis; real or complex, for the
    complex-step derivative): the softmax of ``(x, 0)`` is ``2 d + 1`` positive gaps that sum to 1, and their partial
    sums are ``2 d`` ordered points :math:`0 < \hat\theta_1 < \theta_1 < \hat\theta_2 < \dots < \theta_d < 1`.
    Returns ``(decays, inverse_decays, 1 - decays, weights)`` with :math:`\omega_i = \prod_j (\theta_i -
    \hat\theta_j) / \prod_{j \ne i} (\theta_i - \theta_j) > 0`: ``C``'s generating function is
    :math:`\prod_i (1 - \hat\theta_i x) / (1 - \theta_i x)`, so :math:`C^{-1}`'s decays are the
    :math:`\hat\theta` (its weights are negative)."""
    z = np.concatenate([x, np.zeros(x.shape[:-1] + (1,), dtype=x.dtype)], axis=-1)
    u = np.exp(z - z.real.max(axis=-1, keepdims=True))
    u = u / u.sum(axis=-1, keepdims=True)
    head = np.cumsum(u, axis=-1)[..., :-1]
    tail = np.flip(np.cumsum(np.flip(u, -1), axis=-1), -1)[..., 1:]    # 1 - head, without its cancellation
    p = np.where(head.real <= 0.5, head, 1.0 - tail)
    inverse_decays, decays, one_minus = p[..., 0::2], p[..., 1::2], tail[..., 1::2]
    m = p.shape[-1]
    # p_a - p_b as the sum of the gaps between them (full relative precision when two points nearly meet)
    a, b, g = np.arange(m)[:, None, None], np.arange(m)[None, :, None], np.arange(m + 1)[None, None, :]
    between = ((b < g) & (g <= a)).astype(float) - ((a < g) & (g <= b))
    diff = np.einsum("abg,...g->...ab", between, u)
    d = m // 2
    to_inverse = diff[..., 1::2, 0::2]                               # theta_i - theta_hat_j
    to_decays = diff[..., 1::2, 1::2] + np.eye(d)                    # theta_i - theta_j, 1 on the diagonal
    weights = np.prod(to_inverse, axis=-1) / np.prod(to_decays, axis=-1)
    return decays, inverse_decays, one_minus, weights


def _blt_sensitivity_squared(weights: np.ndarray, decays: np.ndarray, one_minus: np.ndarray,
                             min_separation: int | None) -> np.ndarray:
    r""":math:`g(0)` (``min_separation`` None: one participation) or :meth:`BLTStrategy.sensitivity_per_participation`
    in closed form, batched along the leading axes and complex-safe (for the complex-step derivative);
    :math:`1 - \theta_i\theta_j = (1 - \theta_i) + \theta_i (1 - \theta_j)` keeps decays near 1 accurate."""
    w, t, om = weights, decays, one_minus
    one_tt = om[..., :, None] + t[..., :, None] * om[..., None, :]
    pair = w[..., :, None] * w[..., None, :] / one_tt
    total = 1.0 + pair.sum(axis=(-2, -1))
    if min_separation is None:
        return total
    s = min_separation
    one_ts = -np.expm1(s * np.log(t))                   # 1 - theta^s
    heads = (w * t ** (s - 1) / one_ts).sum(axis=-1)
    tails = ((t ** s / one_ts)[..., :, None] * pair).sum(axis=(-2, -1))
    return total + 2.0 * (heads + tails)


@dataclass(frozen=True)
class BLTStrategy:
    r"""A buffered linear Toeplitz (BLT) strategy: :math:`C` lower-triangular Toeplitz with :math:`c_0 = 1` and
    :math:`c_k = \sum_{i=1}^{d} \omega_i \theta_i^{k-1}` for :math:`k \ge 1` (Dvijotham et al., 2024), with
    ``weights`` :math:`\omega_i \ge 0` and ``decays`` :math:`\theta_i \in [0, 1)`.

    Not banded: every column reaches the end of the run, with geometrically decaying entries.  Its noise
    :math:`w = C^{-1} z` streams with ``d`` buffers per coordinate, :math:`w_t = z_t - \sum_i \omega_i b_{i,t}` and
    :math:`b_{i,t+1} = \theta_i b_{i,t} + w_t` (:meth:`correlate`): ``O(d)`` memory and work per coordinate
    whatever the run's length.  All its coefficients are non-negative, so :math:`G = C^\top C \ge 0` entrywise and
    :meth:`sensitivity` has closed forms.  No amplification by sampling is proved for it here: its accounting
    (:meth:`participation_noise`) charges every eligible step as taken.

    Examples
    --------
    >>> from dpmath.correlated import BLTStrategy
    >>> s = BLTStrategy((0.5,), (0.5,))
    >>> s.coefficients(4)
    array([1.   , 0.5  , 0.25 , 0.125])
    >>> round(s.sensitivity_per_participation(2), 6)   # g(0) + 2 sum_j g(2j) = 4/3 + 8/9
    2.222222
    """

    weights: tuple[float, ...]
    decays: tuple[float, ...]

    def __post_init__(self) -> None:
        try:
            w = tuple(float(v) for v in self.weights)
            t = tuple(float(v) for v in self.decays)
        except (TypeError, ValueError):
            raise ValueError(f"weights and decays must be sequences of numbers, got {self.weights!r}, "
                             f"{self.decays!r}") from None
        if len(w) != len(t) or not w:
            raise ValueError(f"weights and decays must be non-empty and of one length, got {len(w)} and {len(t)}")
        if not all(math.isfinite(v) and v >= 0 for v in w):
            raise ValueError(f"weights must be finite and >= 0, got {self.weights!r}")
        if not all(0 <= v < 1 for v in t):
            raise ValueError(f"decays must lie in [0, 1), got {self.decays!r}")
        object.__setattr__(self, "weights", w)
        object.__setattr__(self, "decays", t)

    @property
    def buffers(self) -> int:
        """``d``: the buffers per coordinate of its noise."""
        return len(self.weights)

    @classmethod
    def optimized(cls, buffers: int, steps: int, error: str = "mean",
                  min_separation: int | None = None) -> BLTStrategy:
        r"""The BLT with ``buffers`` buffers that minimizes the prefix-sum workload's squared error over ``steps``
        steps times the squared sensitivity this module charges it.

        The objective is :math:`\mathrm{err}(C) \cdot \mathrm{sens}^2(C)`, with
        :math:`\mathrm{err} = \frac1n \sum_{t<n} \|(A C^{-1})_{t,:}\|^2` (``"mean"``) or its last, largest row
        (``"max"``), ``A`` the lower-triangular matrix of ones, and :math:`\mathrm{sens}^2` one participation's
        :math:`g(0) = \|c\|^2` (:attr:`column_norm` squared, the limit over run lengths; ``min_separation=None``),
        or, for participations at least ``s = min_separation`` steps apart, the bound per participation
        :math:`g(0) + 2 \sum_{j \ge 1} g(j s)` of :meth:`sensitivity_per_participation`, which is what
        ``BLTNoise`` is charged (``k`` participations multiply it by ``k``, which moves no optimum).  So for one
        participation the objective is ``prefix_sum_errors(result, steps)`` (its mean or max).

        **Parameterization.**  :math:`C(x) = \prod_i (1 - \hat\theta_i x) / (1 - \theta_i x)` and
        :math:`C^{-1}(x)` its reciprocal; the ``2 d`` decays are kept interlaced,
        :math:`0 < \hat\theta_1 < \theta_1 < \hat\theta_2 < \dots < \hat\theta_d < \theta_d < 1`, as the partial
        sums of a softmax of ``2 d`` free logits (L-BFGS-B, bounded logits).  For distinct decays, interlacing holds
        exactly when the weights :math:`\omega_i` are positive and :math:`\sum_i \omega_i / \theta_i < 1` (the
        roots of :math:`1 + \sum_i \omega_i / (\lambda - \theta_i)` interlace the poles; arXiv:2504.21413,
        Thm. 1), so every point is a valid :class:`BLTStrategy` whose inverse has decays in ``(0, 1)`` and
        negative weights: the feasible set that jax_privacy's optimizer keeps with barrier penalties.

        **Cost.**  :math:`C^{-1}`'s coefficients come from its ``d``-state streaming recurrence (``d``
        first-order sections, :func:`scipy.signal.lfilter`), the error is a weighted sum of their squared prefix
        sums, and its gradient takes one more first-order recurrence per decay (the adjoint): ``O(steps x
        buffers)`` per evaluation of the objective and its gradient, no matrix; the sensitivity is closed form,
        ``O(buffers^3)`` with its complex-step gradient.  L-BFGS-B runs from two geometric spreads of the decays
        (``1 - theta`` log-spaced from 0.9, and from 0.6, down to ``3 / steps``), typically 100 to 700 evaluations
        each (0.01 to 0.4 s for ``d <= 5``, ``n <= 2000``), and the best of the results and the starts is kept
        (deterministic).

        Parameters
        ----------
        buffers : int
            ``d >= 1``, the buffers per coordinate of the noise.
        steps : int
            ``n >= 1``, the run's length.
        error : {"mean", "max"}
            The mean or the maximum over steps of the prefix sums' noise variance.
        min_separation : int, optional
            ``s >= 1``: optimize for any number of participations at least ``s`` steps apart (cyclic sampling with
            ``s`` groups); ``None`` (default): one participation.

        Returns
        -------
        BLTStrategy
            Weights > 0 (a buffer the optimum does not use keeps a weight near 0) and decays in ``(0, 1)``,
            largest decay first.

        Raises
        ------
        ValueError
            ``buffers``, ``steps`` or ``min_separation`` not an integer >= 1, or ``error`` not ``"mean"`` or
            ``"max"``.

        Examples
        --------
        >>> from dpmath.correlated import BLTStrategy, prefix_sum_errors
        >>> blt = BLTStrategy.optimized(3, 256)
        >>> blt.buffers, bool(all(0 < t < 1 for t in blt.decays) and all(w > 0 for w in blt.weights))
        (3, True)
        >>> round(prefix_sum_errors(blt, 256)[0], 2)   # BandedStrategy.optimized(4, 256), as much memory: 35.74
        6.86
        """
        d, n = positive_int(buffers, "buffers"), positive_int(steps, "steps")
        if error not in ("mean", "max"):
            raise ValueError(f"error must be 'mean' or 'max', got {error!r}")
        s = None if min_separation is None else positive_int(min_separation, "min_separation")

        k = np.arange(n)
        row_weights = (n - k) / n if error == "mean" else np.ones(n)
        impulse = np.zeros(n)
        impulse[0] = 1.0
        probe = 1e-30 * 1j * np.eye(2 * d)     # complex steps, one logit each

        def loss(x: np.ndarray) -> tuple[float, np.ndarray]:
            decays, inverse_decays, one_minus, weights = _blt_interlaced(x)
            if not (np.all(np.isfinite(weights)) and np.all(one_minus > 0)):
                return 1e3, np.zeros_like(x)
            r = impulse
            for a, b in zip(decays, inverse_decays, strict=True):
                r = signal.lfilter([1.0, -a], [1.0, -b], r)      # the inverse's coefficients, d sections
            prefix = np.cumsum(r)
            err = float(np.dot(row_weights, prefix * prefix))
            # d err / d r_j = sum_{k >= j} 2 w_k s_k; r'(x) = -x r(x) / (1 - theta x) for theta, +x r / (1 - th x)
            adjoint = np.cumsum((2.0 * row_weights * prefix)[::-1])[::-1][1:]
            d_decays = np.array([-np.dot(adjoint, signal.lfilter([1.0], [1.0, -a], r)[:-1]) for a in decays])
            d_inverse = np.array([np.dot(adjoint, signal.lfilter([1.0], [1.0, -b], r)[:-1])
                                  for b in inverse_decays])
            sens = float(_blt_sensitivity_squared(weights, decays, one_minus, s).real)
            steps_decays, steps_inverse, steps_one_minus, steps_weights = _blt_interlaced(x + probe)
            grad = ((steps_decays.imag @ d_decays + steps_inverse.imag @ d_inverse) / err
                    + _blt_sensitivity_squared(steps_weights, steps_decays, steps_one_minus, s).imag / sens) / 1e-30
            value = math.log(err) + math.log(sens)
            return (value, grad) if math.isfinite(value) and np.all(np.isfinite(grad)) else (1e3, np.zeros_like(x))

        best_x, best_value = None, math.inf
        for high in (0.9, 0.6):
            one_minus = np.geomspace(high, min(3.0 / n, high / 2), 2 * d)
            gaps = np.diff(np.concatenate([[0.0], 1.0 - one_minus, [1.0]]))
            start = np.log(gaps[:-1] / gaps[-1])
            result = optimize.minimize(loss, start, jac=True, method="L-BFGS-B", bounds=[(-30.0, 30.0)] * (2 * d),
                                       options={"maxiter": 2000, "ftol": 1e-13, "gtol": 1e-10})
            for x in (start, result.x):
                value = loss(x)[0]
                if value < best_value:
                    best_x, best_value = x, value
        decays, _, _, weights = _blt_interlaced(best_x)
        order = np.argsort(decays)[::-1]
        return cls(tuple(float(max(w, 0.0)) for w in weights[order]), tuple(float(t) for t in decays[order]))

    def coefficients(self, steps: int) -> np.ndarray:
        r""":math:`c_0, \dots, c_{n-1}`."""
        n = positive_int(steps, "steps")
        k = np.arange(1, n)
        c = np.ones(n)
        c[1:] = sum(w * t ** (k - 1) for w, t in zip(self.weights, self.decays, strict=True))
        return c

    def matrix(self, steps: int) -> np.ndarray:
        """``C`` as a dense ``(steps, steps)`` array (for checks)."""
        return _lower_toeplitz(self.coefficients(steps))

    @property
    def column_norm(self) -> float:
        r""":math:`\sqrt{G_{tt}}` for a column far from the end: :math:`\sqrt{1 + \sum_{ij} \omega_i\omega_j /
        (1 - \theta_i\theta_j)}`, the largest column norm."""
        return math.sqrt(self._gram(0))

    def _gram(self, d: int) -> float:
        r""":math:`g(d) = \sum_{u \ge d} c_u c_{u-d}`, the entry of ``G`` at offset ``d`` far from the end (every
        entry at that offset is at most it: the coefficients are non-negative)."""
        w, t = np.array(self.weights), np.array(self.decays)
        tail = float(np.sum(np.outer(w * t ** d, w) / (1.0 - np.outer(t, t))))
        head = 1.0 if d == 0 else float(np.sum(w * t ** (d - 1)))
        return head + tail

    def sensitivity_per_participation(self, min_separation: int) -> float:
        r"""An upper bound on :math:`\max \|\sum_{t \in \pi} C_{:,t} g_t\|^2 / k` over any number ``k`` of
        participations at least ``min_separation`` steps apart and :math:`\|g_t\| \le 1`:
        :math:`g(0) + 2 \sum_{j \ge 1} g(j s)`.  Each participation's row of ``G`` meets the others at offsets of at
        least ``s``, ``2 s``, ... on each side, and ``g`` is non-increasing, so the bound holds for every pattern and
        run length, and is the limit of the pattern ``0, s, 2 s, ...`` as ``k`` and the run grow."""
        s = positive_int(min_separation, "min_separation")
        w, t = np.array(self.weights), np.array(self.decays)
        ts = t ** s
        # sum_j c_{js} and sum_j theta_i^{js} in closed form
        heads = float(np.sum(w * t ** (s - 1) / (1.0 - ts)))
        tails = float(np.sum(np.outer(w * ts / (1.0 - ts), w) / (1.0 - np.outer(t, t))))
        return self._gram(0) + 2.0 * (heads + tails)

    def correlate(self, z: np.ndarray, state: list | None = None) -> np.ndarray:
        r""":math:`w = C^{-1} z` along axis 0 by the buffers (class docstring); ``state`` (a list) carries the buffers
        across calls.

        Examples
        --------
        >>> import numpy as np
        >>> from dpmath.correlated import BLTStrategy
        >>> s, z = BLTStrategy((0.4, 0.2), (0.9, 0.3)), np.arange(1.0, 7.0)
        >>> bool(np.allclose(s.correlate(z), np.linalg.solve(s.matrix(6), z)))
        True
        """
        z = np.asarray(z, dtype=np.float64)
        if state is None:
            state = []
        if not state:
            state.extend(np.zeros(z.shape[1:]) for _ in self.weights)
        out = np.empty_like(z)
        for k in range(z.shape[0]):
            w = z[k] - sum(om * b for om, b in zip(self.weights, state, strict=True))
            out[k] = w
            for i, th in enumerate(self.decays):
                state[i] = th * state[i] + w
        return out

    def inverse_coefficients(self, steps: int) -> np.ndarray:
        """The first ``steps`` coefficients of :math:`C^{-1}` (its first column), ``O(steps x buffers)``."""
        n = positive_int(steps, "steps")
        e = np.zeros(n)
        e[0] = 1.0
        return self.correlate(e)

    def participation_noise(self, noise_multiplier: float, min_separation: int) -> float:
        r"""The noise multiplier of the Gaussian step that bounds one participation, charging every eligible step as
        taken (no amplification): :math:`\sigma / \sqrt{\text{sensitivity per participation}}`; ``k``
        participations compose to one Gaussian mechanism of sensitivity :math:`\sqrt{k \cdot \text{per}}`, the
        bound of :meth:`sensitivity_per_participation`."""
        return positive_real(noise_multiplier, "noise_multiplier") / math.sqrt(
            self.sensitivity_per_participation(min_separation))


def prefix_sum_errors(strategy: BandedStrategy | BLTStrategy, steps: int) -> tuple[float, float]:
    r"""``(mean, max)`` over the ``steps`` prefix sums of their noise variance per coordinate, for unit sensitivity of
    one participation: :math:`\|c\|^2 \|(A C^{-1})_{t,:}\|^2`, with :math:`A` the lower-triangular matrix of ones.

    :math:`A C^{-1}` is lower-triangular Toeplitz with the prefix sums :math:`s_k` of :math:`C^{-1}`'s coefficients,
    so row ``t`` has squared norm :math:`\sum_{k \le t} s_k^2`: ``O(steps x bands)`` in all.  Independent noise
    (``C = I``) gives ``((steps + 1) / 2, steps)``.

    Examples
    --------
    >>> from dpmath.correlated import BandedStrategy, prefix_sum_errors
    >>> prefix_sum_errors(BandedStrategy((1.0,)), 4)
    (2.5, 4.0)
    """
    n = positive_int(steps, "steps")
    s = np.cumsum(strategy.inverse_coefficients(n))
    rows = np.cumsum(s * s)
    scale = strategy.column_norm ** 2
    return float(rows.mean() * scale), float(rows[-1] * scale)


@dataclass(frozen=True)
class BandedMatrixFactorization:
    r"""A training run with banded matrix-factorization noise: ``steps`` steps of noise :math:`C^{-1} z`,
    :math:`z \sim N(0, \sigma^2)` per coordinate (``noise_multiplier`` :math:`\sigma` times the clipping norm), under
    cyclic Poisson sampling at rate ``sample_rate`` (``1``: every example of the step's group, every ``b`` steps;
    module docstring), with exact norms or randomized clipping's ``envelope``.

    Parameters
    ----------
    noise_multiplier : float
        :math:`\sigma > 0`, of the independent noise ``z``.
    strategy : BandedStrategy
        :math:`C`.
    steps : int
        ``n >= 1``.
    sample_rate : float
        ``q`` in ``(0, 1]``, the Poisson rate within the step's group.
    envelope : Envelope, optional
        Randomized clipping's envelope.

    Examples
    --------
    >>> from dpmath.correlated import BandedMatrixFactorization, BandedStrategy
    >>> run = BandedMatrixFactorization(2.0, BandedStrategy.sqrt_prefix_sum(8), steps=64, sample_rate=1.0)
    >>> run.participations, run.step()
    (8, Gaussian(noise_multiplier=1.5257047018113674))
    """

    noise_multiplier: float
    strategy: BandedStrategy
    steps: int
    sample_rate: float = 1.0
    envelope: Envelope | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", positive_real(self.noise_multiplier, "noise_multiplier"))
        if not isinstance(self.strategy, BandedStrategy):
            raise ValueError(f"strategy must be a BandedStrategy, got {type(self.strategy).__name__}")
        object.__setattr__(self, "steps", positive_int(self.steps, "steps"))
        object.__setattr__(self, "sample_rate", checked_sample_rate(self.sample_rate, "sample_rate"))
        if self.envelope is not None and not isinstance(self.envelope, Envelope):
            raise ValueError(f"envelope must be a dpmath Envelope or None, got {type(self.envelope).__name__}")

    @property
    def participations(self) -> int:
        """``ceil(steps / b)``: the most steps one example can take part in (its group's steps)."""
        return -(-self.steps // self.strategy.bands)

    def step(self) -> Gaussian | SubsampledGaussian:
        r"""The mechanism that dominates one participation's window (module docstring), at noise multiplier
        :math:`\sigma / \|c\|`; the run is :attr:`participations` of them composed."""
        sigma = self.noise_multiplier / self.strategy.column_norm
        if self.envelope is not None:
            return SubsampledGaussian(sigma, self.sample_rate, self.envelope)
        if self.sample_rate == 1.0:
            return Gaussian(sigma)
        return SubsampledGaussian(sigma, self.sample_rate)

    def epsilon(self, delta: float) -> float:
        """The PLD accountant's epsilon at ``delta`` (the upper end of its bracket)."""
        from .pld import PLDAccountant

        return PLDAccountant().compose(self.step(), self.participations).epsilon(delta)

r"""Majorization: orderings of vectors by spread, and the transforms that generate them.

For ``x, y`` in :math:`\mathbb{R}^n` with entries sorted decreasingly, :math:`x^\downarrow`,

* ``y`` is **majorized** by ``x`` (:math:`y \prec x`, "x is more spread out") when
  :math:`\sum_{i\le k} y^\downarrow_i \le \sum_{i\le k} x^\downarrow_i` for every ``k`` and the totals
  are equal;
* ``y`` is **weakly submajorized** by ``x`` (:math:`y \prec_w x`) when the partial sums of the largest
  entries satisfy the same inequalities, totals free;
* ``y`` is **weakly supermajorized** by ``x`` (:math:`y \prec^w x`) when the partial sums of the
  *smallest* entries satisfy :math:`\sum_{i\le k} y^\uparrow_i \ge \sum_{i\le k} x^\uparrow_i`.

Hardy-Littlewood-Polya: :math:`y \prec x` iff ``y = M x`` for a doubly stochastic ``M``, iff ``y`` is
reached from ``x`` by finitely many T-transforms (averages of two coordinates).  On the simplex the
vertex ``e = (1, 0, ..., 0)`` majorizes every point and every point majorizes the centre
``u = (1/n, ..., 1/n)``.  These are the orders behind the envelope of randomized clipping (paper 000,
App. A.2 and B.4-B.6), LAP2's accountant (paper 003, Lemma III.6) and the vertex arguments of twice
sampling (paper 002, Lemma C.1); :func:`dpmath.schur.check_schur` tests functions against them.

All comparisons take an explicit absolute tolerance ``atol`` on the partial sums (scaled by the
vectors' magnitude), so that floating-point rounding does not decide a verdict.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from .validation import positive_int, real_array

__all__ = [
    "majorizes",
    "weakly_submajorizes",
    "weakly_supermajorizes",
    "t_transform",
    "random_doubly_stochastic",
    "majorization_chain",
]


def _pair(x: ArrayLike, y: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    a = real_array(x, "x", allow_inf=False)
    b = real_array(y, "y", allow_inf=False)
    if a.ndim != 1 or b.ndim != 1:
        raise ValueError(f"x and y must be 1-D vectors, got shapes {a.shape} and {b.shape}")
    if a.size != b.size:
        raise ValueError(f"x and y must have the same length, got {a.size} and {b.size}")
    if a.size == 0:
        raise ValueError("x and y must not be empty")
    return a, b


def _tol(a: np.ndarray, b: np.ndarray, atol: float) -> float:
    if not atol >= 0:
        raise ValueError(f"atol must be non-negative (>= 0), got {atol!r}")
    return atol * max(1.0, float(np.abs(a).sum()), float(np.abs(b).sum()))


def _top_sums(v: np.ndarray) -> np.ndarray:
    return np.cumsum(np.sort(v)[::-1])


def weakly_submajorizes(x: ArrayLike, y: ArrayLike, *, atol: float = 1e-12) -> bool:
    r"""Whether ``x`` weakly submajorizes ``y``: :math:`y \prec_w x`.

    .. math:: \sum_{i=1}^k y^\downarrow_i \le \sum_{i=1}^k x^\downarrow_i \quad (k = 1, \dots, n).

    Every increasing Schur-convex function ``f`` then has ``f(y) <= f(x)`` (Marshall-Olkin 3.A.8);
    this is the relation of paper 003's Lemma III.6, where the clipped gradient's magnitudes are
    weakly submajorized by ``C (sqrt(i) - sqrt(i-1))``.

    Parameters
    ----------
    x, y : array_like
        Real vectors of the same length, without NaN or infinities.
    atol : float
        Slack allowed in each partial-sum inequality, relative to ``max(1, sum|x|, sum|y|)``.

    Returns
    -------
    bool

    Examples
    --------
    >>> from dpmath.majorization import weakly_submajorizes
    >>> weakly_submajorizes([1.0, 0.0], [0.5, 0.4])
    True
    >>> weakly_submajorizes([0.5, 0.5], [0.9, 0.0])
    False
    """
    a, b = _pair(x, y)
    return bool(np.all(_top_sums(b) <= _top_sums(a) + _tol(a, b, atol)))


def weakly_supermajorizes(x: ArrayLike, y: ArrayLike, *, atol: float = 1e-12) -> bool:
    r"""Whether ``x`` weakly supermajorizes ``y``: :math:`y \prec^w x`.

    .. math:: \sum_{i=1}^k y^\uparrow_i \ge \sum_{i=1}^k x^\uparrow_i \quad (k = 1, \dots, n),

    with :math:`v^\uparrow` sorted increasingly.  Every decreasing Schur-convex ``f`` then has
    ``f(y) <= f(x)`` (Marshall-Olkin 3.A.8).

    Parameters
    ----------
    x, y : array_like
        Real vectors of the same length, without NaN or infinities.
    atol : float
        Slack allowed in each partial-sum inequality, relative to ``max(1, sum|x|, sum|y|)``.

    Returns
    -------
    bool

    Examples
    --------
    >>> from dpmath.majorization import weakly_supermajorizes
    >>> weakly_supermajorizes([0.0, 1.0], [0.2, 0.9])
    True
    >>> weakly_supermajorizes([0.2, 0.9], [0.0, 1.0])
    False
    """
    a, b = _pair(x, y)
    return bool(np.all(np.cumsum(np.sort(b)) >= np.cumsum(np.sort(a)) - _tol(a, b, atol)))


def majorizes(x: ArrayLike, y: ArrayLike, *, atol: float = 1e-12) -> bool:
    r"""Whether ``x`` majorizes ``y``: :math:`y \prec x` (``y`` is a doubly stochastic average of ``x``).

    .. math::

        \sum_{i=1}^k y^\downarrow_i \le \sum_{i=1}^k x^\downarrow_i \ (k < n), \qquad
        \sum_{i=1}^n y_i = \sum_{i=1}^n x_i.

    A Schur-convex ``f`` has ``f(y) <= f(x)`` whenever this holds.

    Parameters
    ----------
    x, y : array_like
        Real vectors of the same length, without NaN or infinities.
    atol : float
        Slack in each partial-sum comparison and in the equality of totals, relative to
        ``max(1, sum|x|, sum|y|)``.

    Returns
    -------
    bool

    Examples
    --------
    >>> from dpmath.majorization import majorizes
    >>> majorizes([1, 0, 0], [0.5, 0.3, 0.2])      # the vertex majorizes every point of the simplex
    True
    >>> majorizes([0.5, 0.3, 0.2], [1, 0, 0])
    False
    >>> majorizes([1, 0], [1, 1])                  # different totals: not comparable
    False
    >>> majorizes([1, 0], [1, 0, 0])
    Traceback (most recent call last):
    ...
    ValueError: x and y must have the same length, got 2 and 3
    """
    a, b = _pair(x, y)
    tol = _tol(a, b, atol)
    sa, sb = _top_sums(a), _top_sums(b)
    return bool(abs(sa[-1] - sb[-1]) <= tol and np.all(sb <= sa + tol))


def t_transform(x: ArrayLike, i: int, j: int, weight: float) -> np.ndarray:
    r"""The T-transform that averages coordinates ``i`` and ``j`` of ``x``.

    .. math:: y_i = w x_i + (1-w) x_j, \quad y_j = w x_j + (1-w) x_i, \quad y_l = x_l \ (l \ne i, j),

    i.e. ``y = (w I + (1-w) P_{ij}) x`` with ``P_{ij}`` the transposition.  Always ``y`` is majorized
    by ``x``; every majorization is a finite chain of these (Hardy-Littlewood-Polya).

    Parameters
    ----------
    x : array_like
        Real 1-D vector.
    i, j : int
        Distinct coordinates (``0 <= i, j < len(x)``).
    weight : float
        ``w`` in ``[0, 1]``; ``w = 1`` is the identity, ``w = 1/2`` sets both to their mean.

    Returns
    -------
    numpy.ndarray

    Examples
    --------
    >>> from dpmath.majorization import t_transform
    >>> t_transform([1.0, 0.0, 0.0], 0, 1, 0.75).tolist()
    [0.75, 0.25, 0.0]
    """
    v = real_array(x, "x", allow_inf=False).copy()
    if v.ndim != 1:
        raise ValueError(f"x must be a 1-D vector, got shape {v.shape}")
    n = v.size
    for name, k in (("i", i), ("j", j)):
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < n:
            raise ValueError(f"{name} must be an integer index in [0, {n}), got {k!r}")
    if i == j:
        raise ValueError(f"i and j must differ, got {i} and {j}")
    w = float(weight)
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"weight must lie in [0, 1], got {weight!r}")
    xi, xj = v[i], v[j]
    v[i] = w * xi + (1.0 - w) * xj
    v[j] = w * xj + (1.0 - w) * xi
    return v


def random_doubly_stochastic(n: int, *, permutations: int | None = None,
                             rng: np.random.Generator | int | None = None) -> np.ndarray:
    r"""A random ``n x n`` doubly stochastic matrix: a Birkhoff mixture of permutation matrices.

    .. math:: M = \sum_{m=1}^{M} w_m P_{\pi_m}, \qquad w \sim \mathrm{Dirichlet}(1, \dots, 1),

    with uniformly random permutations ``pi_m``.  By Birkhoff's theorem every doubly stochastic matrix is
    such a mixture, and ``M x`` is majorized by ``x`` for every ``x``.

    Parameters
    ----------
    n : int
        Size, ``>= 1``.
    permutations : int, optional
        Number of permutations mixed (default ``n``; the identity is always one of them).
    rng : numpy.random.Generator or int, optional
        Source of randomness (or a seed).

    Returns
    -------
    numpy.ndarray
        Non-negative ``(n, n)`` array whose rows and columns sum to 1.

    Examples
    --------
    >>> import numpy as np
    >>> from dpmath.majorization import majorizes, random_doubly_stochastic
    >>> m = random_doubly_stochastic(4, rng=0)
    >>> bool(np.allclose(m.sum(0), 1) and np.allclose(m.sum(1), 1))
    True
    >>> x = np.array([0.7, 0.2, 0.1, 0.0])
    >>> majorizes(x, m @ x)
    True
    """
    n = positive_int(n, "n")
    count = n if permutations is None else positive_int(permutations, "permutations")
    gen = np.random.default_rng(rng)
    weights = gen.dirichlet(np.ones(count))
    out = weights[0] * np.eye(n)
    for w in weights[1:]:
        out[np.arange(n), gen.permutation(n)] += w
    return out


def majorization_chain(n: int, steps: int, *, rng: np.random.Generator | int | None = None) -> np.ndarray:
    r"""A random chain on the simplex from the vertex ``e`` to the centre ``u``, decreasing in majorization.

    Row 0 is ``e = (1, 0, ..., 0)``, the last row is ``u = (1/n, ..., 1/n)``, and each row in between is
    a random T-transform (random pair, weight uniform in ``[0.5, 1]``) of the previous one, so
    ``chain[r]`` majorizes ``chain[r + 1]`` for every ``r``.  Along such a chain a Schur-convex function
    decreases and a Schur-concave one increases.

    Parameters
    ----------
    n : int
        Dimension, ``>= 2``.
    steps : int
        Number of T-transforms between ``e`` and ``u`` (the chain has ``steps + 2`` rows).
    rng : numpy.random.Generator or int, optional
        Source of randomness (or a seed).

    Returns
    -------
    numpy.ndarray
        ``(steps + 2, n)`` array.

    Examples
    --------
    >>> from dpmath.majorization import majorization_chain, majorizes
    >>> c = majorization_chain(4, 6, rng=1)
    >>> c.shape
    (8, 4)
    >>> all(majorizes(c[r], c[r + 1]) for r in range(len(c) - 1))
    True
    """
    n = positive_int(n, "n")
    if n < 2:
        raise ValueError(f"n must be at least 2, got {n}")
    steps = positive_int(steps, "steps")
    gen = np.random.default_rng(rng)
    rows = [np.eye(n)[0]]
    for _ in range(steps):
        i, j = gen.choice(n, size=2, replace=False)
        rows.append(t_transform(rows[-1], int(i), int(j), float(gen.uniform(0.5, 1.0))))
    rows.append(np.full(n, 1.0 / n))
    return np.vstack(rows)

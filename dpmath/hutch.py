r"""The envelopes of Hutchinson- and Hutch++-estimated squared norms: the distributions that make randomized
clipping private.

With Hutchinson's estimator the clipped contribution of one example is scaled by
``a = 1 / sqrt(X(lambda))``, where

.. math::

    X(\lambda) = \sum_{i=1}^{d} \lambda_i X_i,\qquad X_i \overset{iid}{\sim} \chi^2(k)/k,\qquad
    \lambda \in \Delta^{d-1},

and ``lambda`` (the normalized spectrum of the example's gradient) is data dependent.  The
accountant needs one data-independent ``Y`` that is stochastically smaller than every ``X(lambda)``;
the tightest is the *envelope*

.. math::

    F_Y(x) = \sup_{\lambda \in \Delta^{d-1}} P(X(\lambda) \le x).

Paper 000 (Thm 5.1, Prop 5.2, App. B.5-B.9) describes it in three regions.  What this module uses,
and what it checked first (``tests/dpmath/test_envelope.py``), is:

* ``x <= 1``: the vertex ``e = (1, 0, ..., 0)`` is extremal, ``F_Y(x) = F(x; chi2(k)/k)``
  (the paper's ``x_- = 1``, App. B.5 and Prop. B.10).  Checked by brute force over the whole two-block
  family for ``d <= 6`` and by a 2,001-point lam scan of the heavy-light family up to ``d = 2048``.
  *Theorem 5.1's display has the two extremes swapped* (it puts the
  uniform vector below 1 and the vertex above ``x_+``); App. B.5 and Algorithm 4 have them the right
  way round, and so does the numerics.
* ``x >= x_+``: the uniform vector ``u`` is extremal, ``F_Y(x) = F(x; chi2(kd)/(kd))``.  ``x_+`` is
  found numerically as the largest crossing point ``x_{lambda,u}`` of a member with ``F_u`` (every
  ``F_lambda`` crosses ``F_u`` once, App. B.4, Thm B.7), maximized over lam. *The paper's ``x_+ = 1
  + 2/(dk)`` is only right for d = 2*: for ``k = 32, d = 2048`` the vertex alone crosses the uniform
  law at ``x ~ 1.00046``, far beyond ``1 + 2/(dk) ~ 1.00003``, and for ``d > 2`` the measured
  ``x_+`` exceeds the formula everywhere we looked (see :attr:`HutchEnvelope.x_plus` and the docs).
  Algorithm 3 of the paper also tests ``F_u(x_mid) > 0.5`` instead of comparing with the supremum,
  which locates the median of ``u``, not ``x_+``; we do not use it.
* ``1 < x < x_+``: the supremum is attained by one heavy coordinate and ``d - 1`` equal light ones,
  ``lambda e_1 + (1 - lambda)/(d - 1) (0, 1, ..., 1)`` (a two-block form ``S(1, d-1, lambda)``); this
  one-parameter family contains both ``e`` (``lambda = 1``) and ``u`` (``lambda = 1/d``).  It is the
  structure of the Szekely-Bakirov counterexample (App. B.1) and, in every comparison with the full
  two-block family ``1 <= i + j <= d`` (``tests/dpmath/test_envelope.py``: d in {3, 5, 8} for k in {1, 2, 32};
  the slow set adds d = 16 for k in {1, 4, 32} and d = 48 for k = 32), it attains the same supremum
  and the same ``x_plus``.  This is verified numerically, not proved.  ``family="full"`` searches the
  whole two-block family instead (cost ``O(d^2)`` per point) for anyone who wants to check a larger d.

:class:`HutchPPEnvelope` is Hutch++'s (paper 000, App. B.7.2 / B.8).  Both subclass
:class:`~dpmath.envelope.Envelope`; the base class and the envelopes known in closed form are :mod:`dpmath.envelope`'s.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike
from scipy import special

from .chi2mix import two_block_cdf
from .envelope import Envelope
from .validation import positive_int, real_array, real_number

__all__ = ["HutchEnvelope", "HutchPPEnvelope", "Maximizer"]


_PROFILE_GRID = 65
_SEARCH_GRID = 33
_REFINE_POINTS = 17
_REFINE_LEVELS = 3
_XPLUS_TOL = 1e-11
_BEAT_MARGIN = 1e-13


def _narrow(points: list[np.ndarray], values: list[np.ndarray], lo: np.ndarray, hi: np.ndarray,
            g_lo: np.ndarray, g_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Brackets ``[lo, hi]`` of a single sign change (``g >= 0`` left of the root, ``< 0`` right) shrunk to
    the evaluated ``points`` (``values`` of ``g``) inside them, elementwise."""
    for p, v in zip(points, values, strict=True):
        left, right = (v >= 0) & (p >= lo), (v < 0) & (p < hi)
        lo, g_lo = np.where(left, p, lo), np.where(left, v, g_lo)
        hi, g_hi = np.where(right, p, hi), np.where(right, v, g_hi)
    return lo, hi, g_lo, g_hi


def _close_bracket(g, lo: np.ndarray, hi: np.ndarray, g_lo: np.ndarray, g_hi: np.ndarray, tol,
                   todo: np.ndarray | None = None) -> np.ndarray:
    """Upper ends of the brackets ``[lo, hi]`` of a single sign change of ``g`` (``g >= 0`` left of the root,
    ``< 0`` right) shrunk to width ``tol`` (where ``todo``), elementwise.

    Each step evaluates, in one call ``g(x, y)`` (a list of values per array), the secant point ``x`` and a
    companion ``y`` twice the secant's last move beyond it, toward the bracket's farther end: regula falsi
    alone keeps one end fixed and converges from one side, while the companion lands beyond the root and
    closes the bracket.  A call of the two-block CDF costs little more for twice the points (its set-up
    dominates), and 5 to 8 calls replace the 30 to 40 of bisection or the Illinois method.
    """
    todo = np.ones(lo.shape, dtype=bool) if todo is None else todo
    moved = 0.05 * (hi - lo)
    x_prev = None
    for _ in range(80):
        if not np.any(todo & (hi - lo > tol)):
            break
        with np.errstate(invalid="ignore", divide="ignore"):
            secant = (lo * g_hi - hi * g_lo) / (g_hi - g_lo)
        bad = ~np.isfinite(secant) | (secant <= lo) | (secant >= hi)
        x = np.where(bad, 0.5 * (lo + hi), secant)
        if x_prev is not None:
            moved = np.abs(x - x_prev)
        x_prev = x
        step = np.maximum(2.0 * moved, 0.4 * tol)
        up = hi - x > x - lo
        y = np.where(up, np.minimum(x + step, 0.5 * (x + hi)), np.maximum(x - step, 0.5 * (lo + x)))
        lo, hi, g_lo, g_hi = _narrow([x, y], g(x, y), lo, hi, g_lo, g_hi)
    return hi


def _zoom_max(f, lam_b: np.ndarray, val_b: np.ndarray, h: np.ndarray):
    """Refine maximizers of ``f`` (rows of lam values -> rows of values) around ``lam_b``.

    ``_REFINE_LEVELS`` grids of ``_REFINE_POINTS`` points spanning one previous spacing ``h`` on each
    side, each 8 times finer.  Returns the best lam and value per row, the final spacing and every
    (lam, value) batch evaluated.
    """
    offsets = np.linspace(-1.0, 1.0, _REFINE_POINTS)
    rows = np.arange(lam_b.size)
    tried = []
    for _ in range(_REFINE_LEVELS):
        lam = np.clip(lam_b[:, None] + h[:, None] * offsets[None, :], 0.0, 1.0)
        v = f(lam)
        tried.append((lam, v))
        arg = np.argmax(v, axis=1)
        better = v[rows, arg] > val_b
        lam_b = np.where(better, lam[rows, arg], lam_b)
        val_b = np.where(better, v[rows, arg], val_b)
        h = h * (offsets[1] - offsets[0])
    return lam_b, val_b, h, tried


def _lam_grid(lam_min: float, size: int) -> np.ndarray:
    """``size`` points evenly on [0, 1] merged with ``size`` points geometric on ``[lam_min, 1]``: the
    heavy-light family's interesting lam runs from the uniform vector (``1/d``) to the vertex (1),
    and at large d its features sit at lam ~ 1e-3, between two points of a linear grid."""
    return np.unique(np.concatenate([np.linspace(0.0, 1.0, size), np.geomspace(min(lam_min, 0.5), 1.0, size)]))


def _local_spacing(grid: np.ndarray, arg: np.ndarray) -> np.ndarray:
    """Per row, the larger of the two spacings of ``grid`` next to column ``arg``."""
    rows = np.arange(grid.shape[0])
    last = grid.shape[1] - 1
    right = grid[rows, np.minimum(arg + 1, last)] - grid[rows, arg]
    left = grid[rows, arg] - grid[rows, np.maximum(arg - 1, 0)]
    return np.maximum(right, left)


class Maximizer(NamedTuple):
    """A member ``S(i, j, lam)`` of the two-block family: ``lam`` spread over ``i`` coordinates and
    ``1 - lam`` over ``j`` others (``j = 0`` means all weight on ``i`` equal coordinates)."""

    i: int
    j: int
    lam: float


class HutchEnvelope(Envelope):
    r"""Envelope of Hutchinson-estimated squared norms, ``F(x) = sup_lambda P(X(lambda) <= x)``.

    ``X(lambda) = sum_i lambda_i X_i`` with ``X_i ~ chi2(k)/k`` i.i.d. and ``lambda`` in the simplex of
    dimension ``d - 1`` (module docstring for the three regions and what was verified).

    Parameters
    ----------
    projection_dim : int
        ``k``, the projection dimension (number of Gaussian probe vectors), ``k >= 1``.
    dim : int
        ``d``, the number of ``chi2(k)/k`` terms (the length of ``lambda``), ``d >= 1``.  For a model
        trained by :mod:`dpsgd` it is summed over the layers, not the widest one: ``min(rows, cols)`` of
        every estimated weight matrix plus 1 per estimated bias
        (:meth:`dpsgd.plan.NormPlan.envelope_dimension`).
    family : {"heavy-light", "full"}
        ``"heavy-light"`` (default) maximizes over ``S(1, d-1, lam)`` in the middle region;
        ``"full"`` over every two-block form ``S(i, j, lam)``, ``1 <= i + j <= d`` (``O(d^2)`` per point).

    Examples
    --------
    >>> from dpmath import HutchEnvelope
    >>> env = HutchEnvelope(projection_dim=32, dim=2048)
    >>> round(float(env.cdf(0.9)), 6) == round(float(env.vertex_cdf(0.9)), 6)   # x <= 1: vertex
    True
    >>> 1.0 < env.x_plus < 1.01
    True
    >>> float(env.cdf(2.0))
    1.0
    """

    def __init__(self, projection_dim: int, dim: int, *, family: str = "heavy-light") -> None:
        self.projection_dim = positive_int(projection_dim, "projection_dim")
        self.dim = positive_int(dim, "dim")
        if family not in ("heavy-light", "full"):
            raise ValueError(f"family must be 'heavy-light' or 'full', got {family!r}")
        self.family = family
        self._x_plus: float | None = None
        self._profile_cache: list[tuple[float, float, np.ndarray, np.ndarray]] | None = None

    def __repr__(self) -> str:
        return f"HutchEnvelope(projection_dim={self.projection_dim}, dim={self.dim}, family={self.family!r})"

    def _parameters(self) -> tuple:
        return (self.projection_dim, self.dim, self.family)

    # extremes -----------------------------------------------------------------------------------
    def vertex_cdf(self, x: ArrayLike) -> np.ndarray:
        """CDF of the vertex ``X(e) = chi2(k)/k``, the envelope for ``x <= 1``.

        Examples
        --------
        >>> from dpmath import HutchEnvelope
        >>> round(float(HutchEnvelope(projection_dim=2, dim=8).vertex_cdf(1.0)), 6)   # 1 - exp(-1)
        0.632121
        """
        xs = np.maximum(real_array(x, "x"), 0.0)
        return special.gammainc(self.projection_dim / 2.0, xs * self.projection_dim / 2.0)

    def uniform_cdf(self, x: ArrayLike) -> np.ndarray:
        """CDF of the uniform mixture ``X(u) = chi2(kd)/(kd)``, the envelope for ``x >= x_plus``.

        Examples
        --------
        >>> from dpmath import HutchEnvelope
        >>> round(float(HutchEnvelope(projection_dim=1, dim=2).uniform_cdf(1.0)), 6)  # chi2(2)/2 is Exp(1)
        0.632121
        """
        xs = np.maximum(real_array(x, "x"), 0.0)
        n = self.projection_dim * self.dim
        return special.gammainc(n / 2.0, xs * n / 2.0)

    # the middle region --------------------------------------------------------------------------
    def _candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """(i, j) pairs searched in the middle region (only reached for d >= 2)."""
        d = self.dim
        if self.family == "heavy-light":
            return np.array([1.0]), np.array([float(d - 1)])
        ii, jj = np.meshgrid(np.arange(1, d + 1), np.arange(0, d + 1), indexing="ij")
        keep = (ii + jj <= d) & ((jj == 0) | (ii <= jj))  # (i, j, lam) ~ (j, i, 1 - lam)
        return ii[keep].astype(float), jj[keep].astype(float)

    def _crossing(self, lam: np.ndarray, ii: np.ndarray, jj: np.ndarray, near: np.ndarray | None = None
                  ) -> np.ndarray:
        """Crossing point ``x_{lam,u}`` of each ``F(.; S(i, j, lam))`` with ``F_u``, elementwise.

        ``h(x) = F(x; S) - F_u(x) - 1e-13`` is >= 0 at ``x = 1`` for every member that beats the uniform
        law at all (Schur-convexity at 1) and negative for large x; its single sign change (Thm B.7) is
        bracketed from ``[1, 1 + 1.25 sqrt(2 / (k d))]`` (the crossings lie within one standard deviation
        of the uniform law above 1), widened as needed, and closed by :func:`_close_bracket`.
        Returns the upper end of the final bracket (width <= 1e-11), or 1 where ``h(1) < 0``.  ``near``
        (crossings already found at nearby lam) adds two points around it to the first evaluation.
        """
        k = self.projection_dim

        def h(*xs: np.ndarray) -> list[np.ndarray]:
            # one call for every point: a call's cost is mostly fixed (the quadrature's set-up), not per point
            x = np.concatenate(xs, axis=-1)
            args = (np.concatenate([v] * len(xs), axis=-1) for v in (lam, ii, jj))
            return np.split(two_block_cdf(x, *args, k) - self.uniform_cdf(x) - _BEAT_MARGIN, len(xs), axis=-1)

        lo = np.ones(lam.shape)
        hi = np.full(lam.shape, np.inf)
        f_lo, f_hi = np.zeros(lam.shape), np.zeros(lam.shape)
        sd = math.sqrt(2.0 / (k * self.dim))
        first = [lo, np.full(lam.shape, 1.0 + 1.25 * sd)]
        if near is not None:
            span = 0.1 * np.maximum(near - 1.0, 0.0) + 1e-9
            first += [np.maximum(near - span, 1.0), near + 0.1 * span]
        lo, hi, f_lo, f_hi = _narrow(first, h(*first), lo, hi, f_lo, f_hi)
        active = hi > 1.0   # h(1) >= 0
        while np.any(active & (hi == np.inf)):
            wide = np.where(active & (hi == np.inf), 1.0 + 2.0 * (lo - 1.0) + sd, lo)
            if wide.max() > 64:
                raise RuntimeError("no crossing with the uniform law below 64: single crossing failed")
            lo, hi, f_lo, f_hi = _narrow([wide], h(wide), lo, hi, f_lo, f_hi)
        hi = _close_bracket(h, lo, hi, f_lo, f_hi, _XPLUS_TOL, active)
        return np.where(active, hi, 1.0)

    def _profile(self) -> list[tuple[float, float, np.ndarray, np.ndarray]]:
        """For each searched (i, j): the lam values tried and their crossing points, sorted by lam.

        ``_PROFILE_GRID`` values on [0, 1], then ``_REFINE_LEVELS`` grids of ``_REFINE_POINTS`` around
        the best so far, each 8 times finer.  ``x_plus`` is the largest crossing found.
        """
        if self._profile_cache is not None:
            return self._profile_cache
        ii, jj = self._candidates()
        lam0 = _lam_grid(1.0 / self.dim, _PROFILE_GRID)
        L = np.broadcast_to(lam0, (ii.size, lam0.size)).copy()
        Ii = np.broadcast_to(ii[:, None], L.shape)
        Jj = np.broadcast_to(jj[:, None], L.shape)
        C = self._crossing(L, Ii, Jj)
        first = np.argmax(C, axis=1)
        rows = np.arange(ii.size)

        best = C[rows, first]

        def crossing(lam: np.ndarray) -> np.ndarray:
            shape = lam.shape
            out = self._crossing(lam, np.broadcast_to(ii[:, None], shape), np.broadcast_to(jj[:, None], shape),
                                 np.broadcast_to(best[:, None], shape))
            best[:] = np.maximum(best, out.max(axis=1))
            return out

        _, _, _, tried = _zoom_max(crossing, L[rows, first], C[rows, first], _local_spacing(L, first))
        allL = np.concatenate([L] + [t[0] for t in tried], axis=1)
        allC = np.concatenate([C] + [t[1] for t in tried], axis=1)
        prof = []
        for p in range(ii.size):
            lam_p, idx = np.unique(allL[p], return_index=True)
            prof.append((float(ii[p]), float(jj[p]), lam_p, allC[p][idx]))
        self._profile_cache = prof
        return prof

    def _family_sup(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Supremum over the searched family at each x in the middle region: (value, i, j, lam).

        By single crossing only members whose crossing point ``c(lam)`` exceeds x can beat ``F_u``; for
        each (i, j) the lam-interval where the profile has ``c >= x`` (widened by one profile sample
        each side) is searched with a ``_SEARCH_GRID``-point grid, ``_REFINE_LEVELS`` finer grids around
        the best point and a final parabolic step.  The interval shrinks as x approaches ``x_plus``, so
        the narrow bump that survives there is always resolved.  The uniform law and the vertex are
        always candidates; every reported value is an evaluated CDF.
        """
        k = self.projection_dim
        val = np.maximum(self.uniform_cdf(x), self.vertex_cdf(x))
        use_u = self.uniform_cdf(x) >= self.vertex_cdf(x)
        best_i = np.where(use_u, float(self.dim), 1.0)
        best_j = np.zeros(x.shape)
        best_lam = np.ones(x.shape)
        xs_l, ii_l, jj_l, lo_l, hi_l, row_l = [], [], [], [], [], []
        for i, j, lam_p, c_p in self._profile():
            above = c_p[None, :] >= x[:, None]
            has = above.any(axis=1)
            if not has.any():
                continue
            first = np.argmax(above, axis=1)
            last = c_p.size - 1 - np.argmax(above[:, ::-1], axis=1)
            rows = np.flatnonzero(has)
            xs_l.append(x[rows])
            ii_l.append(np.full(rows.size, i))
            jj_l.append(np.full(rows.size, j))
            lo_l.append(lam_p[np.maximum(first[rows] - 1, 0)])
            hi_l.append(lam_p[np.minimum(last[rows] + 1, c_p.size - 1)])
            row_l.append(rows)
        if not xs_l:
            return val, best_i, best_j, best_lam
        xs_all, i_all, j_all = np.concatenate(xs_l), np.concatenate(ii_l), np.concatenate(jj_l)
        lo, hi, rows = np.concatenate(lo_l), np.concatenate(hi_l), np.concatenate(row_l)
        # geometric where the interval spans more than a factor 8 (at large d the maximizer sits at
        # lam ~ 1e-3, a bump a linear grid on [0, 1] steps over), linear otherwise.  An interval from lam = 0
        # (x just above 1) is geometric from the profile's least positive lam, 1/(8d), with 0 itself in front:
        # searched linearly, at (32, 1e9) and x = 1 + 9e-8 the bump at 6.92e-4 was found at 6.95e-4, 2e-9 low
        t = np.linspace(0.0, 1.0, _SEARCH_GRID)[None, :]
        start = np.where(lo > 0, lo, 0.125 / self.dim)
        wide = hi > 8.0 * start
        with np.errstate(divide="ignore", invalid="ignore"):
            geo = start[:, None] * (hi / start)[:, None] ** t
        grid = np.where(wide[:, None], geo, lo[:, None] + (hi - lo)[:, None] * t)
        grid = np.concatenate([lo[:, None], grid], axis=1)   # lam = lo itself (a repeat where the grid starts there)
        v = two_block_cdf(xs_all[:, None], grid, i_all[:, None], j_all[:, None], k)
        arg = np.argmax(v, axis=1)
        n = np.arange(xs_all.size)
        lam_b, val_b = grid[n, arg], v[n, arg]

        def family_cdf(lam: np.ndarray) -> np.ndarray:
            return two_block_cdf(xs_all[:, None], lam, i_all[:, None], j_all[:, None], k)

        lam_b, val_b, h, _ = _zoom_max(family_cdf, lam_b, val_b, _local_spacing(grid, arg))
        lam3 = np.clip(lam_b[:, None] + h[:, None] * np.array([-1.0, 1.0])[None, :], 0.0, 1.0)
        v3 = family_cdf(lam3)
        denom = v3[:, 0] - 2.0 * val_b + v3[:, 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            step = np.where(denom < 0, 0.5 * h * (v3[:, 0] - v3[:, 1]) / denom, 0.0)
        lam_p = np.clip(lam_b + np.clip(step, -h, h), 0.0, 1.0)
        v_p = two_block_cdf(xs_all, lam_p, i_all, j_all, k)
        cand_lam = np.column_stack([lam_b, lam3, lam_p])
        cand_val = np.column_stack([val_b, v3, v_p])
        arg = np.argmax(cand_val, axis=1)
        val_c, lam_c = cand_val[n, arg], cand_lam[n, arg]
        for m in np.argsort(val_c):  # ascending, so the best candidate of each row is written last
            r = rows[m]
            if val_c[m] > val[r]:
                val[r], best_i[r], best_j[r], best_lam[r] = val_c[m], i_all[m], j_all[m], lam_c[m]
        return val, best_i, best_j, best_lam

    @property
    def x_plus(self) -> float:
        r"""Point beyond which the uniform vector is extremal: ``sup_lambda x_{lambda,u}``.

        Every ``F(.; X(lambda))`` crosses ``F_u`` exactly once (paper 000, Thm B.7), at ``x_{lambda,u}``,
        so ``x_plus = max over the family of x_{lambda,u}``: a smooth one-dimensional maximization over
        lam (for each searched (i, j)) of a root found by regula falsi.  A member counts as beating
        ``F_u`` only by more than ``1e-13``; beyond ``x_plus`` the envelope exceeds ``F_u`` by less than
        that, far inside the ``cdf_tolerance`` that :func:`~dpmath.pessimistic_discretization` adds.  The value
        is the upper end of a bracket of width ``1e-11`` plus ``1e-10``, so the middle region is not cut
        short.
        """
        if self._x_plus is None:
            if self.dim == 1:
                self._x_plus = 1.0
            else:
                top = max(float(c_p.max()) for _, _, _, c_p in self._profile())
                self._x_plus = top + 1e-10 if top > 1.0 else 1.0
        return self._x_plus

    # distribution functions -----------------------------------------------------------------------
    def _middle_mask(self, xs: np.ndarray) -> np.ndarray:
        return (xs > 1.0) & (xs < self.x_plus) if self.dim > 1 else np.zeros(xs.shape, dtype=bool)

    def _cdf(self, xs: np.ndarray) -> np.ndarray:
        r"""Envelope CDF ``sup_lambda P(X(lambda) <= x)``, vectorized; 0 for ``x <= 0``, 1 at ``+inf``.

        Examples
        --------
        >>> from dpmath import HutchEnvelope
        >>> env = HutchEnvelope(projection_dim=1, dim=3)
        >>> round(float(env.cdf(1.5)), 4)   # above both 0.7877 (uniform) and 0.7872 (rank 2)
        0.7952
        """
        out = np.where(xs <= 1.0, self.vertex_cdf(xs), self.uniform_cdf(xs))
        mid = self._middle_mask(xs)
        if mid.any():
            out[mid] = self._family_sup(xs[mid])[0]
        return np.clip(out, 0.0, 1.0)

    def _sf(self, xs: np.ndarray) -> np.ndarray:
        """``1 - cdf(x)``, computed from the complementary incomplete gamma in the extreme regions
        so that the right tail keeps relative accuracy.

        Examples
        --------
        >>> from dpmath import HutchEnvelope
        >>> float(HutchEnvelope(projection_dim=32, dim=2048).sf(1.1)) < 1e-40
        True
        """
        n = self.projection_dim * self.dim
        with np.errstate(invalid="ignore"):
            half = self.projection_dim / 2.0
            out = np.where(xs <= 1.0, special.gammaincc(half, np.maximum(xs, 0) * half),
                           special.gammaincc(n / 2.0, np.maximum(xs, 0) * n / 2.0))
        mid = self._middle_mask(xs)
        if mid.any():
            out[mid] = 1.0 - self._family_sup(xs[mid])[0]
        return np.clip(out, 0.0, 1.0)

    def _ppf(self, qs: np.ndarray) -> np.ndarray:
        """Quantile function: closed form (``gammaincinv``) in the two extreme regions, secant steps
        that close the bracket (to ``2^-40 (x_plus - 1)``) on the middle-region CDF in between.

        Examples
        --------
        >>> from dpmath import HutchEnvelope
        >>> env = HutchEnvelope(projection_dim=4, dim=16)
        >>> x = env.ppf(0.6)
        >>> abs(float(env.cdf(x)) - 0.6) < 1e-12
        True
        """
        k, n = self.projection_dim, self.projection_dim * self.dim
        with np.errstate(invalid="ignore"):
            out = np.where(qs <= self.vertex_cdf(1.0), special.gammaincinv(k / 2.0, qs) * 2.0 / k,
                           special.gammaincinv(n / 2.0, qs) * 2.0 / n)
        if self.dim > 1:
            xp = self.x_plus
            mid = (qs > self.vertex_cdf(1.0)) & (qs < self.uniform_cdf(xp))
            if mid.any():
                target = qs[mid]
                lo, hi = np.ones_like(target), np.full_like(target, xp)

                def g(*xs: np.ndarray) -> list[np.ndarray]:
                    # one CDF call for both points; cdf < target left of the quantile
                    return [target - c for c in np.split(self._cdf(np.concatenate(xs)), len(xs))]

                out[mid] = _close_bracket(g, lo, hi, target - self.vertex_cdf(lo), target - self.uniform_cdf(hi),
                                          (xp - 1.0) * 2.0 ** -40)
        return np.where(qs >= 1.0, np.inf, out)

    def maximizer(self, x: float) -> Maximizer:
        """The member ``S(i, j, lam)`` of the two-block family that attains the envelope at ``x``.

        ``(1, 0, 1.0)`` (the vertex) for ``x <= 1``, ``(d, 0, 1.0)`` (uniform) for ``x >= x_plus``.

        Examples
        --------
        >>> from dpmath import HutchEnvelope
        >>> m = HutchEnvelope(projection_dim=1, dim=3).maximizer(1.5)
        >>> (m.i, m.j, round(m.lam, 2))
        (1, 2, 0.7)
        """
        xv = real_number(x, "x")
        if xv <= 1.0 or self.dim == 1:
            return Maximizer(1, 0, 1.0)
        if xv >= self.x_plus:
            return Maximizer(self.dim, 0, 1.0)
        _, i, j, lam = self._family_sup(np.array([xv]))
        if j[0] == 0 or lam[0] >= 1.0:
            return Maximizer(int(i[0]), 0, 1.0)
        return Maximizer(int(i[0]), int(j[0]), float(lam[0]))


class HutchPPEnvelope(Envelope):
    r"""Envelope of Hutch++-estimated squared norms (paper 000, App. B.7.2 / B.8, Prop. B.24).

    Against an adversary who knows the sketched head, the estimate is
    ``alpha + (1 - alpha) Z(beta)`` with ``Z(beta)`` a Hutchinson mixture of ``chi2(k)/k`` variables, and

    .. math::

        F_Y(x) = \max\big(F(x; \chi^2(k)/k),\ \mathbf 1\{x \ge 1\}\big),

    i.e. ``Y = min(chi2(k)/k, 1)``: a vertex below 1 and an atom of mass ``P(chi2(k)/k > 1)`` at 1.
    When ``d <= k`` the sketch captures the whole spectrum, the estimate is exact and ``Y = 1``.

    Parameters
    ----------
    projection_dim : int
        ``k``, the sketch and probe size, ``k >= 1``.
    dim : int
        ``d``, as for :class:`HutchEnvelope`, ``d >= 1``.

    Examples
    --------
    >>> from dpmath import HutchPPEnvelope
    >>> env = HutchPPEnvelope(projection_dim=32, dim=2048)
    >>> float(env.cdf(1.0)), round(float(env.cdf(0.999999)), 3)
    (1.0, 0.533)
    """

    def __init__(self, projection_dim: int, dim: int) -> None:
        self.projection_dim = positive_int(projection_dim, "projection_dim")
        self.dim = positive_int(dim, "dim")
        self.x_plus = 1.0

    def __repr__(self) -> str:
        return f"HutchPPEnvelope(projection_dim={self.projection_dim}, dim={self.dim})"

    def _parameters(self) -> tuple:
        return (self.projection_dim, self.dim)

    def _cdf(self, xs: np.ndarray) -> np.ndarray:
        """``max(F(x; chi2(k)/k), 1{x >= 1})``, vectorized.

        Examples
        --------
        >>> from dpmath import HutchPPEnvelope
        >>> HutchPPEnvelope(projection_dim=2, dim=8).cdf([0.5, 1.0]).round(6).tolist()   # 1 - exp(-0.5), then 1
        [0.393469, 1.0]
        """
        if self.dim <= self.projection_dim:
            return np.where(xs >= 1.0, 1.0, 0.0)
        half = self.projection_dim / 2.0
        return np.where(xs >= 1.0, 1.0, special.gammainc(half, np.maximum(xs, 0) * half))

    def _sf(self, xs: np.ndarray) -> np.ndarray:
        """``1 - cdf(x)``, from the complementary incomplete gamma below 1.

        Examples
        --------
        >>> from dpmath import HutchPPEnvelope
        >>> HutchPPEnvelope(projection_dim=2, dim=8).sf([0.5, 1.0]).round(6).tolist()
        [0.606531, 0.0]
        """
        if self.dim <= self.projection_dim:
            return np.where(xs >= 1.0, 0.0, 1.0)
        half = self.projection_dim / 2.0
        return np.where(xs >= 1.0, 0.0, special.gammaincc(half, np.maximum(xs, 0) * half))

    def _ppf(self, qs: np.ndarray) -> np.ndarray:
        """Quantile: the ``chi2(k)/k`` quantile below ``F(1; chi2(k)/k)``, and 1 above it.

        Examples
        --------
        >>> from dpmath import HutchPPEnvelope
        >>> HutchPPEnvelope(projection_dim=2, dim=8).ppf([0.393469340287, 0.9]).round(6).tolist()
        [0.5, 1.0]
        """
        if self.dim <= self.projection_dim:
            return np.where(qs > 0, 1.0, 0.0)
        k = self.projection_dim
        below = qs <= special.gammainc(k / 2.0, k / 2.0)
        return np.where(below, special.gammaincinv(k / 2.0, qs) * 2.0 / k, 1.0)

    def point_mass(self) -> float | None:
        """``1.0`` when ``d <= k`` (the estimate is exact), else ``None``.

        Examples
        --------
        >>> from dpmath import HutchPPEnvelope
        >>> HutchPPEnvelope(32, dim=16).point_mass(), HutchPPEnvelope(32, dim=64).point_mass()
        (1.0, None)
        """
        return 1.0 if self.dim <= self.projection_dim else None

    def maximizer(self, x: float) -> Maximizer:
        """``(1, 0, 1.0)``: the vertex on a tail coordinate for ``x < 1``; ``(0, 0, 1.0)``, all weight on
        the known head (``alpha = 1``, the estimate is exactly 1), for ``x >= 1``.

        Examples
        --------
        >>> from dpmath import HutchPPEnvelope
        >>> env = HutchPPEnvelope(projection_dim=4, dim=64)
        >>> env.maximizer(0.5), env.maximizer(1.0)
        (Maximizer(i=1, j=0, lam=1.0), Maximizer(i=0, j=0, lam=1.0))
        """
        xv = real_number(x, "x")
        return Maximizer(0, 0, 1.0) if (xv >= 1.0 or self.dim <= self.projection_dim) else Maximizer(1, 0, 1.0)

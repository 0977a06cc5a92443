r"""Numerical checks of Schur-convexity and Schur-concavity, with a report instead of a yes.

A symmetric function ``f`` is **Schur-convex** when ``y`` majorized by ``x`` implies ``f(y) <= f(x)``
(more spread, larger value) and **Schur-concave** when it implies ``f(y) >= f(x)``.  For a
continuously differentiable symmetric ``f`` on a permutation-symmetric convex set, Schur-convexity is
equivalent to the Schur-Ostrowski condition

.. math:: (x_i - x_j)\,(\partial_i f(x) - \partial_j f(x)) \ge 0 \quad \text{for all } x, i, j

(the reverse inequality for Schur-concave).  :func:`check_schur` can never *prove* either property; it
tries to refute it three ways and reports what it tried:

1. **symmetry**: ``f(P x) = f(x)`` for random permutations ``P``;
2. **Schur-Ostrowski** at sampled points: the directional derivative along ``e_i - e_j`` (analytic
   gradient when given, else a complex step, else a central difference whose step stays inside the
   domain), for the extreme pair and random pairs;
3. **direct falsification** on generated majorization pairs ``y = M x`` (random T-transforms and
   Birkhoff mixtures of permutations) and along random chains from the vertex to the centre.

Points are drawn from Dirichlet laws of concentrations 0.1, 1 and 10, near-vertex, sparse and
two-block vectors (the simplex), or the same times log-normal totals (the positive orthant).  A
violation counts only when it exceeds the stated tolerances, and a function that returns NaN, an
infinity or a non-scalar makes the verdict ``"invalid"`` rather than "holds".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .majorization import majorization_chain, random_doubly_stochastic, t_transform
from .validation import positive_int, real_array

__all__ = ["SchurReport", "check_schur"]

_EPS = np.finfo(np.float64).eps


@dataclass(frozen=True)
class SchurReport:
    """What :func:`check_schur` tried and found.

    Attributes
    ----------
    kind : str
        ``"convex"`` or ``"concave"``: the property tested.
    verdict : str
        ``"consistent"`` (no violation beyond tolerance; evidence, not proof), ``"violated"`` (a
        counterexample is in ``witness``) or ``"invalid"`` (the function returned NaN, an infinity or a
        non-scalar at ``witness``; nothing was concluded).
    worst_violation : float
        The largest amount by which a tested condition failed, before tolerances (``<= 0`` means every
        test passed with room to spare; it is the most negative margin seen in that case).
    test : str or None
        Which test produced ``worst_violation``: ``"symmetry"``, ``"schur-ostrowski"``, ``"pair"``.
    witness : tuple of numpy.ndarray
        The point ``(x,)`` or the pair ``(x, y)`` (``y`` majorized by ``x``) behind ``worst_violation``,
        or the point where the function failed.
    n_points, n_pairs, n_symmetry : int
        How many Schur-Ostrowski conditions (point, coordinate pair), majorization pairs and
        permutations were tested.
    derivative : str
        How derivatives were obtained: ``"analytic"``, ``"complex-step"`` or ``"central"``.
    message : str
        One line in words.
    """

    kind: str
    verdict: str
    worst_violation: float
    test: str | None
    witness: tuple[np.ndarray, ...]
    n_points: int
    n_pairs: int
    n_symmetry: int
    derivative: str
    message: str

    @property
    def holds(self) -> bool:
        """True when no violation was found (``verdict == "consistent"``)."""
        return self.verdict == "consistent"

    def __str__(self) -> str:
        return f"Schur-{self.kind}: {self.verdict} ({self.message})"


class _Invalid(Exception):
    def __init__(self, x: np.ndarray, value: object) -> None:
        super().__init__(f"f returned {value!r}")
        self.x = x
        self.value = value


def _evaluate(f: Callable, x: np.ndarray, allow_complex: bool = False) -> float | complex:
    value = f(x)
    arr = np.asarray(value)
    if arr.ndim != 0 and arr.size != 1:
        raise _Invalid(x, value)
    v = arr.reshape(()).item()
    if isinstance(v, bool) or not isinstance(v, (int, float, complex)):
        raise _Invalid(x, value)
    if isinstance(v, complex) and not allow_complex:
        v = v.real
    if not np.isfinite(v):
        raise _Invalid(x, value)
    return v


def _sample_points(d: int, count: int, domain: str, floor: float, gen: np.random.Generator) -> list[np.ndarray]:
    pts = []
    for r in range(count):
        kind = r % 6
        if kind < 3:
            x = gen.dirichlet(np.full(d, (0.1, 1.0, 10.0)[kind]))
        elif kind == 3:  # near a vertex
            x = gen.dirichlet(np.ones(d)) * gen.uniform(1e-3, 0.2)
            x[gen.integers(d)] += 1.0
            x /= x.sum()
        elif kind == 4:  # sparse: a few non-negligible entries
            m = int(gen.integers(1, d + 1))
            x = np.full(d, max(floor, 1e-6))
            x[gen.choice(d, size=m, replace=False)] += gen.dirichlet(np.ones(m))
            x /= x.sum()
        else:  # two blocks: m entries a, the rest b
            m = int(gen.integers(1, d))
            a = gen.uniform(1.0 / d, 1.0 / m)
            x = np.full(d, (1.0 - m * a) / (d - m))
            x[:m] = a
            gen.shuffle(x)
        x = np.maximum(x, floor)
        x /= x.sum()
        if domain == "orthant":
            x = x * float(np.exp(gen.normal(0.0, 1.0))) * d
        pts.append(x)
    return pts


def _directional(f, x, f0, i, j, gradient, mode, h_rel):
    """``(d/ds) f(x + s (e_i - e_j))`` at ``s = 0`` and an error bound on it, or None when ``x`` is too
    close to the boundary for a difference step."""
    if mode == "analytic":
        g = np.asarray(gradient(x), dtype=np.float64).ravel()
        if g.size != x.size or not np.isfinite(g).all():
            raise _Invalid(x, g)
        return float(g[i] - g[j]), 0.0
    direction = np.zeros(x.size)
    direction[i], direction[j] = 1.0, -1.0
    if mode == "complex-step":
        s = 1e-20 * max(1.0, float(np.abs(x).max()))
        v = _evaluate(f, x + 1j * s * direction, allow_complex=True)
        if not isinstance(v, complex):
            raise ValueError("derivative='complex-step' needs f to return a complex value for complex input; "
                             "use derivative='central' or pass gradient=")
        return v.imag / s, 0.0
    # a central step may not leave the domain (x_i - s, x_j - s >= 0)
    s = min(h_rel * max(1.0, float(np.abs(x).max())), 0.5 * float(min(x[i], x[j])))
    if s < 1e-9 * max(1.0, float(np.abs(x).max())):
        return None
    fp = _evaluate(f, x + s * direction)
    fm = _evaluate(f, x - s * direction)
    # rounding of the three values plus the third-order truncation, estimated from their spread
    err = 8.0 * _EPS * (abs(fp) + abs(fm) + abs(f0)) / s + abs(fp - 2.0 * f0 + fm) / s
    return (fp - fm) / (2.0 * s), err


def check_schur(f: Callable[[np.ndarray], float], d: int, kind: str = "convex", *, domain: str = "simplex",
                gradient: Callable[[np.ndarray], np.ndarray] | None = None, derivative: str = "auto",
                points: int = 60, pairs: int = 60, coordinate_pairs: int = 3, symmetry: int = 10,
                rtol: float = 1e-9, atol: float = 1e-12, step: float = 1e-5, min_entry: float = 1e-9, seed: int = 0,
                extra_points: Sequence[np.ndarray] = ()) -> SchurReport:
    r"""Try to refute that ``f`` is Schur-convex (or Schur-concave) on the simplex or the positive orthant.

    For ``kind="convex"`` the tested conditions are, with ``y = M x`` majorized by ``x``,

    .. math::

        f(Px) = f(x), \qquad (x_i - x_j)(\partial_i f - \partial_j f)(x) \ge 0, \qquad f(y) \le f(x),

    and the reverse inequalities for ``"concave"``.  A test fails when it misses by more than its
    tolerance: ``atol + rtol * (|f(x)| + |f(y)|)`` for values, and for derivatives the same plus the
    difference's own error bound (zero for analytic gradients and complex steps).

    Parameters
    ----------
    f : callable
        ``f(x) -> float`` for a 1-D array ``x`` of length ``d``.  It is only evaluated inside the domain.
    d : int
        Dimension, ``>= 2``.
    kind : {"convex", "concave"}
        The property to test.
    domain : {"simplex", "orthant"}
        Points with non-negative entries summing to 1, or positive entries of any size.
    gradient : callable, optional
        ``gradient(x) -> array`` of length ``d``; used for the Schur-Ostrowski test when given.
    derivative : {"auto", "complex-step", "central"}
        Without ``gradient``: ``"auto"`` uses a complex step if ``f`` propagates complex input
        (tried once), else a central difference.
    points : int
        Sampled points for the Schur-Ostrowski test (each tests the extreme coordinate pair and
        ``coordinate_pairs - 1`` random ones).
    pairs : int
        Majorization pairs for the direct test (plus one vertex-to-centre chain per 10 pairs).
    coordinate_pairs : int
        Coordinate pairs tested per point, ``>= 1``.
    symmetry : int
        Random permutations tested.
    rtol, atol : float
        Relative and absolute tolerances (see above), ``>= 0``.
    step : float
        Relative step of central differences, ``> 0``.
    min_entry : float
        Smallest entry of a sampled point, relative to its total, in ``[0, 1/d)`` (points nearer the
        boundary stress functions whose cost grows with the spread of ``x``).
    seed : int
        Seed of the point and pair generator (the check is deterministic).
    extra_points : sequence of array
        Points tested in addition to the sampled ones (e.g. a suspected counterexample).

    Returns
    -------
    SchurReport

    Examples
    --------
    >>> import numpy as np
    >>> from dpmath.schur import check_schur
    >>> check_schur(lambda x: float(np.sum(x ** 2)), 4).verdict
    'consistent'
    >>> r = check_schur(lambda x: float(np.sum(x ** 2)), 4, kind="concave")
    >>> r.verdict, r.worst_violation > 0
    ('violated', True)
    >>> check_schur(lambda x: float("nan"), 3).verdict
    'invalid'
    """
    d = positive_int(d, "d")
    if d < 2:
        raise ValueError(f"d must be at least 2, got {d}")
    if kind not in ("convex", "concave"):
        raise ValueError(f"kind must be 'convex' or 'concave', got {kind!r}")
    if domain not in ("simplex", "orthant"):
        raise ValueError(f"domain must be 'simplex' or 'orthant', got {domain!r}")
    if derivative not in ("auto", "complex-step", "central"):
        raise ValueError(f"derivative must be 'auto', 'complex-step' or 'central', got {derivative!r}")
    if not callable(f):
        raise ValueError("f must be callable")
    if gradient is not None and not callable(gradient):
        raise ValueError("gradient must be callable or None")
    points = positive_int(points, "points")
    pairs = positive_int(pairs, "pairs")
    coordinate_pairs = positive_int(coordinate_pairs, "coordinate_pairs")
    symmetry = positive_int(symmetry, "symmetry")
    for name, v in (("rtol", rtol), ("atol", atol)):
        if not (np.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    if not (np.isfinite(min_entry) and 0 <= min_entry < 1.0 / d):
        raise ValueError(f"min_entry must lie in [0, 1/d) = [0, {1.0 / d:g}), got {min_entry!r}")
    if not (np.isfinite(step) and step > 0):
        raise ValueError(f"step must be a finite number > 0, got {step!r}")
    extras = []
    for p in extra_points:
        x = real_array(p, "extra_points", allow_inf=False).ravel()
        if x.size != d or (x < 0).any():
            raise ValueError(f"extra_points must be non-negative vectors of length {d}")
        extras.append(x)

    sign = 1.0 if kind == "convex" else -1.0
    gen = np.random.default_rng(seed)
    # the test that came closest to failing: (excess over tolerance, raw amount, test, witness)
    worst: list = [-np.inf, -np.inf, None, ()]
    counts = {"points": 0, "pairs": 0, "symmetry": 0}

    def record(amount: float, tol: float, test: str, witness: tuple) -> None:
        if amount - tol > worst[0]:
            worst[:] = [amount - tol, amount, test, witness]

    mode = "analytic" if gradient is not None else derivative
    pts = _sample_points(d, points, domain, min_entry, gen) + extras
    try:
        if mode == "auto":
            mode = "central"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", np.exceptions.ComplexWarning)
                    v = _evaluate(f, pts[0] + 1j * 1e-20 * np.eye(d)[0], allow_complex=True)
                if isinstance(v, complex) and v.imag != 0.0:
                    mode = "complex-step"
            except (TypeError, ValueError, ArithmeticError, np.exceptions.ComplexWarning, _Invalid):
                mode = "central"
        values = [_evaluate(f, x) for x in pts]  # each sampled point once; every test below reuses it
        for _ in range(symmetry):
            n = int(gen.integers(len(pts)))
            x, fx = pts[n], values[n]
            y = gen.permutation(x)
            fy = _evaluate(f, y)
            record(abs(fx - fy), atol + rtol * (abs(fx) + abs(fy)), "symmetry", (x, y))
            counts["symmetry"] += 1
        for x, fx in zip(pts, values, strict=True):
            order = np.argsort(x)
            ij = [(int(order[-1]), int(order[0]))]
            ij += [tuple(int(v) for v in gen.choice(d, size=2, replace=False)) for _ in range(coordinate_pairs - 1)]
            for i, j in ij:
                if x[i] == x[j]:
                    continue
                got = _directional(f, x, fx, i, j, gradient, mode, step)
                if got is None:
                    continue
                dd, err = got
                cond = sign * (x[i] - x[j]) * dd  # must be >= 0
                tol = abs(x[i] - x[j]) * (err + atol + rtol * abs(fx))
                record(-cond, tol, "schur-ostrowski", (x,))
                counts["points"] += 1
        chains = max(1, pairs // 10)
        for r in range(pairs):
            x, fx = pts[r % len(pts)], values[r % len(pts)]
            if r % 2 == 0:
                i, j = (int(v) for v in gen.choice(d, size=2, replace=False))
                y = t_transform(x, i, j, float(gen.uniform(0.0, 1.0)))
            else:
                y = random_doubly_stochastic(d, permutations=int(gen.integers(2, d + 2)), rng=gen) @ x
            fy = _evaluate(f, y)
            record(sign * (fy - fx), atol + rtol * (abs(fx) + abs(fy)), "pair", (x, y))
            counts["pairs"] += 1
        if domain == "simplex":
            for _ in range(chains):
                # pulled toward the centre (an affine map that keeps the order), so that log and
                # entropy-like functions are evaluated inside the simplex, no entry below min_entry
                pull = max(1e-9, min_entry * d)
                chain = (1.0 - pull) * majorization_chain(d, 8, rng=gen) + pull / d
                vals = [_evaluate(f, row) for row in chain]
                for a in range(len(chain) - 1):
                    fx, fy = vals[a], vals[a + 1]
                    record(sign * (fy - fx), atol + rtol * (abs(fx) + abs(fy)), "pair", (chain[a], chain[a + 1]))
                    counts["pairs"] += 1
    except _Invalid as bad:
        return SchurReport(kind, "invalid", float("nan"), None, (np.asarray(bad.x),), counts["points"],
                           counts["pairs"], counts["symmetry"], mode,
                           f"f returned {bad.value!r} (not a finite scalar) at a point of the domain")
    excess, raw, test, witness = worst
    tried = f"{counts['points']} Schur-Ostrowski tests, {counts['pairs']} pairs, {counts['symmetry']} permutations"
    if excess > 0:
        return SchurReport(kind, "violated", float(raw), test, witness, counts["points"], counts["pairs"],
                           counts["symmetry"], mode, f"{test} test fails by {raw:.3g} (tolerance exceeded "
                                                    f"by {excess:.3g}); {tried}")
    return SchurReport(kind, "consistent", float(raw), test, witness, counts["points"], counts["pairs"],
                       counts["symmetry"], mode, f"no violation beyond tolerance in {tried}")

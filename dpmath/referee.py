r"""A referee for the PLD accountant: the hockey-stick curve of composed subsampled Gaussians by numerical
inversion of a Laplace transform, with an error bound, independent of any grid of privacy losses.

For a pair ``(P, Q)`` with privacy loss ``L = log dP/dQ`` and independent steps, ``delta`` is the price of a
call option on ``e^L`` under ``Q``:

.. math::

    \delta(\varepsilon) = E_P\big[(1 - e^{\varepsilon - L})_+\big] = E_Q\big[(e^{L} - e^{\varepsilon})_+\big].

Its Fourier inversion on the line ``Re z = alpha > 0`` (Carr & Madan 1999; a Bromwich integral) is

.. math::

    \delta(\varepsilon) = \frac1\pi \int_0^\infty \operatorname{Re}
    \frac{\exp\big(\sum_j n_j \log M_j(\alpha + iv) - (\alpha + iv)\varepsilon\big)}
         {(\alpha + iv)(\alpha + 1 + iv)}\,dv,
    \qquad M_j(z) = E_P\big[e^{z L_j}\big],

where ``M_j`` is the moment-generating function of step ``j``'s loss (``n_j`` copies).  ``alpha`` is the
saddle point (it minimises the integrand at ``v = 0``, as an RDP bound would), so the integral has no
cancellation even at ``delta = 1e-12`` and ``epsilon`` in the hundreds.

The integral is computed by the trapezoidal rule with step ``Delta`` on ``[0, V]``; every error is bounded:

* **aliasing** (Poisson summation, exact for the trapezoidal rule): the rule returns
  ``sum_m e^{alpha P m} delta(epsilon + P m)`` with period ``P = 2 pi / Delta``; the terms ``m != 0`` are
  non-negative and at most ``e^{-alpha P}/(1 - e^{-alpha P})`` (``m < 0``, ``delta <= 1``) plus
  ``M(beta)^n e^{-beta epsilon} e^{-(beta - alpha) P} / (1 - e^{-(beta - alpha) P})`` (``m > 0``, the Chernoff
  bound at ``beta = 2 alpha``);
* **truncation** at ``V``: integrating by parts in the Gaussian output ``x``, ``|M(alpha + iv)| <= TV/v``
  with ``TV`` the total variation of ``x -> g(x) / |L'(x)|`` (``g`` the tilted density), so the dropped
  integral is at most ``e^{-alpha epsilon} prod_j TV_j^{n_j} / (pi (N + 1) V^{N + 1})`` with ``N = sum n_j``
  (``TV`` is computed on a fine grid);
* **quadrature** of each ``M_j`` (the trapezoidal rule in ``x``, exponentially convergent for these
  Gaussian integrands): estimated as the change when the ``x`` step is halved, propagated to ``delta``;
* **rounding**: ``N`` times the double-precision unit of ``log M``.

The MGFs are computed as ``1 + E[expm1(z L)]`` and their logarithm by an exact complex ``log1p``, so that
``N log M`` keeps its absolute accuracy near ``1e-16 N`` when ``M`` is close to 1 (small sampling rates).

Randomized clipping (:func:`referee_rc_delta`, :func:`referee_rc_epsilon`): the scale ``a = 1/sqrt(Y)`` is
binned, each bin's mass at its largest scale for the upper end and its smallest for the lower end (a
subsampled Gaussian's curve grows with its scale); one step is then a weighted sum of closed-form curves, and
a composition the inversion above with each step's MGF the bins' weighted sum.

Examples
--------
>>> from dpmath.referee import referee_delta
>>> d = referee_delta([(1.0, 1.0, 4)], 2.0)                      # four Gaussian steps at sigma 1
>>> round(d.value, 9), d.error < 1e-9 * d.value
(0.331897999, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special

from .discretization import pessimistic_discretization
from .envelope import Envelope
from .validation import non_negative, open_probability, positive_int, positive_real, sample_rate

__all__ = ["RefereeDelta", "referee_delta", "referee_epsilon", "referee_rc_delta", "referee_rc_epsilon"]

_REL_TOL = 1e-10      # wanted: aliasing and truncation each below this fraction of the saddle-point scale
_MAX_POINTS = 4_000_000  # v-grid points at most (beyond: an error, the case is too costly for the referee)
_BLOCK = 1 << 22       # x-points times v-points per vectorized block
_RELATIONS = ("remove", "add")


@dataclass(frozen=True)
class RefereeDelta:
    """``delta(epsilon)`` with ``|delta - value| <= error`` (the sum of the bounds in the module docstring).

    Attributes
    ----------
    value, error : float
    alpha : float
        The line of integration ``Re z = alpha``.
    points : int
        Trapezoidal nodes in ``v``.
    """

    value: float
    error: float
    alpha: float
    points: int

    @property
    def low(self) -> float:
        return max(self.value - self.error, 0.0)

    @property
    def high(self) -> float:
        return min(self.value + self.error, 1.0)


class _Step:
    """One subsampled-Gaussian step (``mu = 1/sigma``, rate ``q``) in one direction.

    ``remove``: ``P = q N(mu, 1) + (1-q) N(0, 1)``, ``Q = N(0, 1)``, ``L = l(x)``;
    ``add``: ``P = N(0, 1)``, ``Q`` the mixture, ``L = -l(x)``; with ``l(x) = log(1 + q expm1(mu x - mu^2/2))``.
    ``E_P[e^{zL}] = E_{N(0,1)}[e^{a l(x)}]`` with ``a = z + 1`` (remove) or ``a = -z`` (add).
    """

    def __init__(self, sigma: float, q: float, relation: str) -> None:
        self.mu, self.q, self.sign = 1.0 / sigma, q, (1.0 if relation == "remove" else -1.0)

    def _a(self, z: np.ndarray) -> np.ndarray:
        return z + 1.0 if self.sign > 0 else -z

    def _ell(self, x: np.ndarray) -> np.ndarray:
        u = self.mu * x - 0.5 * self.mu ** 2
        if self.q == 1.0:
            return u
        return np.where(u < 30, np.log1p(self.q * np.expm1(np.minimum(u, 30))),
                        np.logaddexp(math.log(self.q) + u, math.log1p(-self.q)))

    def _log_slope(self, x: np.ndarray) -> np.ndarray:
        """``log l'(x)``, ``l'(x) = mu * logistic(mu x - mu^2/2 + log q - log(1-q))`` (no underflow far left)."""
        if self.q == 1.0:
            return np.full(x.shape, math.log(self.mu))
        u = self.mu * x - 0.5 * self.mu ** 2 + math.log(self.q) - math.log1p(-self.q)
        return math.log(self.mu) - np.logaddexp(0.0, -u)

    def _grid(self, re_a: float, v_max: float, refine: int) -> tuple[np.ndarray, float]:
        # the tilted density exp(-x^2/2 + Re(a) l(x)) peaks below Re(a) mu (l' <= mu); 40 units either side
        top = max(0.0, re_a * self.mu)
        lo, hi = -40.0 + min(0.0, re_a * self.mu), 40.0 + top
        step = min(0.25, 2 * math.pi / (abs(v_max) * self.mu + 40.0)) / refine
        n = int(math.ceil((hi - lo) / step)) + 1
        return np.linspace(lo, hi, n), (hi - lo) / (n - 1)

    def log_mgf_real(self, z: float) -> float:
        """``log E_P[e^{zL}]`` for real ``z`` (``inf`` where it overflows)."""
        a = float(self._a(np.array(z)))
        x, hx = self._grid(a, 0.0, 2)
        r = _log_phi(x) + a * self._ell(x)
        if float(np.max(r)) > 0.5:
            return float(special.logsumexp(r) + math.log(hx))
        al = a * self._ell(x)
        log_phi = r - al
        w = np.where(al > 0.5, np.exp(np.minimum(r, 700.0)) - np.exp(log_phi),
                     np.expm1(np.minimum(al, 0.5)) * np.exp(log_phi))
        return math.log1p(float(np.sum(w)) * hx)

    def log_mgf(self, z: np.ndarray, refine: int = 1) -> np.ndarray:
        """``log E_P[e^{zL}]`` for complex ``z`` of one real part and ascending imaginary parts (vectorized;
        each block of ``z`` on an ``x`` grid fine enough for its largest imaginary part)."""
        return _log1p(self.mgf_minus_one(z, refine))

    def mgf_minus_one(self, z: np.ndarray, refine: int = 1) -> np.ndarray:
        """``E_P[e^{zL}] - 1``, accurate when it is small (see :meth:`log_mgf`)."""
        a = self._a(np.asarray(z, dtype=np.complex128))
        re_a = float(a.real[0])
        out = np.empty(a.size, dtype=np.complex128)
        i = 0
        while i < a.size:
            x, hx = self._grid(re_a, float(np.max(np.abs(a.imag[i:i + 64]))), refine)
            per = max(1, min(_BLOCK // x.size, 64))
            ell = self._ell(x)
            log_phi = _log_phi(x)
            phi = np.exp(log_phi)[None, :]
            big = (re_a * ell > 0.5)[None, :]                 # where e^{Re(a) l} is not close to 1
            grow = np.exp(np.minimum(log_phi + re_a * ell, 700.0))[None, :]
            wr, wi = re_a * ell[None, :], a.imag[i:i + per, None] * ell[None, :]
            # phi * expm1(wr + i wi), accurate for small arguments; phi e^{a l} - phi where that is large (the
            # small-argument branch is capped where it is not used, so it cannot overflow)
            wr_small = np.minimum(wr, 0.5)
            small = phi * (np.expm1(wr_small) * np.cos(wi) - 2.0 * np.sin(0.5 * wi) ** 2)
            s_re = np.where(big, grow * np.cos(wi) - phi, small)
            s_im = np.where(big, grow * np.sin(wi), phi * np.exp(wr_small) * np.sin(wi))
            out[i:i + per] = (s_re.sum(1) + 1j * s_im.sum(1)) * hx
            i += per
        return out

    def lipschitz(self, alpha: float) -> float:
        """``E_P[|L| e^{alpha L}]``, a Lipschitz constant of ``v -> E_P[e^{(alpha + iv) L}]``."""
        re_a = float(self._a(np.array(alpha + 0j)).real)
        x, hx = self._grid(re_a, 0.0, 2)
        ell = self._ell(x)
        with np.errstate(divide="ignore"):
            r = _log_phi(x) + re_a * ell + np.log(np.abs(ell))
        return float(math.exp(special.logsumexp(r)) * hx)

    def total_variation(self, alpha: float) -> float:
        """``TV`` of ``x -> phi(x) e^{Re(a) l(x)} / |l'(x)|`` on the line ``Re z = alpha``."""
        re_a = float(self._a(np.array(alpha + 0j)).real)
        x, _ = self._grid(re_a, 0.0, 8)
        log_h = _log_phi(x) + re_a * self._ell(x) - self._log_slope(x)
        c = float(np.max(log_h))
        h = np.exp(log_h - c)
        return float(np.sum(np.abs(np.diff(h))) + h[0] + h[-1]) * math.exp(c)


class _Mixture:
    """One randomized-clipping step with a discrete scale: ``mu = mus[j]`` (``a / sigma``) with probability
    ``weights[j]``.  ``a`` is part of the output and has the same law under ``P`` and ``Q``, so the step's MGF
    is the weighted sum of its subsampled Gaussians'.  The weights may sum to less than 1: the missing mass
    ``dropped`` is left out of the measure, which can only lower ``delta`` (its terms are non-negative), so
    such a step gives lower bounds only.

    The MGFs are :class:`_Step`'s, vectorized over the scales on one ``x`` grid (the grid the largest ``mu``
    needs; finer and wider than a smaller one's)."""

    def __init__(self, mus: np.ndarray, weights: np.ndarray, dropped: float, q: float, relation: str) -> None:
        keep = weights > 0
        self.parts = [_Step(1.0 / float(mu), q, relation) for mu in mus[keep]]
        self.weights = weights[keep]
        self.log_w = np.log(self.weights)
        self.dropped = float(dropped)
        self.top = max(self.parts, key=lambda p: p.mu)    # its grid serves every scale
        self._ells: dict[tuple[float, float], np.ndarray] = {}

    def _ell(self, x: np.ndarray) -> np.ndarray:
        """``(scales, x)`` matrix of the parts' losses ``l(x)`` (cached per grid)."""
        key = (float(x[0]), float(x[-1]), x.size)
        if key not in self._ells:
            if len(self._ells) > 8:
                self._ells.clear()
            self._ells[key] = np.stack([p._ell(x) for p in self.parts])
        return self._ells[key]

    def log_mgf_real(self, z: float) -> float:
        a = float(self.top._a(np.array(z)))
        x, hx = self.top._grid(a, 0.0, 2)
        al = a * self._ell(x)
        log_phi = _log_phi(x)[None, :]
        r = log_phi + al
        big = np.max(r, axis=1) > 0.5
        with np.errstate(over="ignore"):
            direct = special.logsumexp(r, axis=1) + math.log(hx)
            w = np.where(al > 0.5, np.exp(np.minimum(r, 700.0)) - np.exp(log_phi),
                         np.expm1(np.minimum(al, 0.5)) * np.exp(log_phi))
            small = np.log1p(np.sum(w, axis=1) * hx)
        return float(special.logsumexp(self.log_w + np.where(big, direct, small)))

    def log_mgf(self, z: np.ndarray, refine: int = 1) -> np.ndarray:
        a = self.top._a(np.asarray(z, dtype=np.complex128))
        re_a = float(a.real[0])
        out = np.full(a.size, -self.dropped, dtype=np.complex128)
        i = 0
        while i < a.size:
            x, hx = self.top._grid(re_a, float(np.max(np.abs(a.imag[i:i + 64]))), refine)
            ell = self._ell(x)                                  # (scales, x)
            per = max(1, min(_BLOCK // ell.size, 64))
            log_phi = _log_phi(x)[None, None, :]
            phi = np.exp(log_phi)
            wr = re_a * ell[None]
            wi = a.imag[i:i + per, None, None] * ell[None]      # (v, scales, x)
            big = wr > 0.5
            if float(np.max(log_phi + wr)) > 690.0:   # the integrand would be capped: the sum silently wrong
                raise ValueError("a scale in the envelope's tail makes the MGF overflow on the line of "
                                 "integration; charge more of the tail to delta (a larger tail)")
            grow = np.exp(np.minimum(log_phi + wr, 700.0))
            wr_small = np.minimum(wr, 0.5)
            cos, sin = np.cos(wi), np.sin(wi)
            small = phi * (np.expm1(wr_small) * cos - 2.0 * np.sin(0.5 * wi) ** 2)
            s_re = np.where(big, grow * cos - phi, small).sum(2)
            s_im = np.where(big, grow * sin, phi * np.exp(wr_small) * sin).sum(2)
            out[i:i + per] += ((s_re + 1j * s_im) * hx) @ self.weights
            i += per
        return _log1p(out)

    def lipschitz(self, alpha: float) -> float:
        return float(sum(w * p.lipschitz(alpha) for w, p in zip(self.weights, self.parts, strict=True)))

    def total_variation(self, alpha: float) -> float:
        # |sum_j w_j M_j(alpha + iv)| <= sum_j w_j TV_j / v
        return float(sum(w * p.total_variation(alpha) for w, p in zip(self.weights, self.parts, strict=True)))


def _log_phi(x: np.ndarray) -> np.ndarray:
    """The standard normal log-density."""
    return -0.5 * x * x - 0.5 * math.log(2 * math.pi)


def _log1p(w: np.ndarray) -> np.ndarray:
    """Complex ``log(1 + w)`` accurate for small ``|w|``."""
    with np.errstate(divide="ignore"):     # |M| underflows to 0 far out in v: log = -inf, its term 0
        re = 0.5 * np.log1p(2.0 * w.real + w.real ** 2 + w.imag ** 2)
    return re + 1j * np.arctan2(w.imag, 1.0 + w.real)


def _steps(events, relation):
    out = []
    for sigma, q, n in events:
        s = float(sigma)
        qq = float(q)
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"sigma must be positive and finite, got {sigma!r}")
        if not 0 < qq <= 1:
            raise ValueError(f"q must lie in (0, 1], got {q!r}")
        out.append((_Step(s, qq, relation), positive_int(n, "count")))
    if not out:
        raise ValueError("events must hold at least one (sigma, q, count)")
    return out


def _delta_one(steps, eps: float) -> RefereeDelta:
    total = sum(n for _, n in steps)

    def log_m(z: float) -> float:
        return sum(n * s.log_mgf_real(z) for s, n in steps)

    def objective(log_alpha: float) -> float:
        a = math.exp(log_alpha)
        v = log_m(a)
        return v - a * eps - math.log(a * (a + 1.0)) if math.isfinite(v) else math.inf

    grid = np.linspace(math.log(1e-3), math.log(200.0), 60)
    vals = [objective(g) for g in grid]
    j = int(np.argmin(vals))
    lo, hi = grid[max(j - 1, 0)], grid[min(j + 1, grid.size - 1)]
    res = optimize.minimize_scalar(objective, bounds=(lo, hi), method="bounded", options={"xatol": 1e-6})
    alpha = math.exp(float(res.x))
    scale = math.exp(min(700.0, float(res.fun)))          # the integrand at v = 0: the size of delta
    tol = _REL_TOL * scale
    # aliasing: period P with both sides' bounds below tol / 2; the right side's Chernoff tilt beta > alpha
    # is chosen to need the shortest period (high moments of a subsampled step grow fast)
    best = (math.inf, 2.0 * alpha, math.inf)
    for beta in alpha * (1.0 + np.geomspace(0.01, 1.0, 15)):
        log_mb = log_m(float(beta))
        need = (log_mb - beta * eps - math.log(tol / 4.0)) / (beta - alpha)
        if math.isfinite(need) and need < best[0]:
            best = (need, float(beta), log_mb)
    p_right, beta, log_mb = best
    p_left = math.log(4.0 / tol) / alpha
    period = max(p_left, p_right, 1e-3)
    delta_v = 2.0 * math.pi / period
    alias = math.exp(-alpha * period) / -math.expm1(-alpha * period)
    alias += math.exp(min(700.0, log_mb - beta * eps - (beta - alpha) * period)) / -math.expm1(-(beta - alpha) * period)
    # truncation beyond V_TV: e^{-alpha eps} prod TV^n / (pi (N+1) V^(N+1)) <= tol / 4
    log_tv = sum(n * math.log(s.total_variation(alpha)) for s, n in steps)
    log_v = (log_tv - alpha * eps - math.log(math.pi * (total + 1) * tol / 4.0)) / (total + 1)
    v_tv = max(math.exp(log_v), 10 * delta_v)
    trunc = math.exp(log_tv - alpha * eps - (total + 1) * math.log(v_tv)) / (math.pi * (total + 1))
    # the uniform grid runs to V1, where the integrand has become negligible; [V1, V_TV] is bounded by a walk
    lips = [s.lipschitz(alpha) for s, _ in steps]
    v1 = min(v_tv, 64 * delta_v)
    while True:
        walked = _walk(steps, lips, alpha, eps, v1, v_tv, tol / 4.0)
        if walked[0]:
            trunc += walked[1]
            break
        v1 = min(v_tv, max(2.0 * v1, 1.5 * walked[1]))
    points = int(math.ceil(v1 / delta_v)) + 1
    if points > _MAX_POINTS:
        raise ValueError(f"the referee needs {points:,} nodes for this case (limit {_MAX_POINTS:,}); it is meant "
                         f"for compositions of several steps")
    v = np.arange(points) * delta_v
    z = alpha + 1j * v
    log_f = np.zeros(points, dtype=np.complex128)
    log_f_fine = np.zeros(points, dtype=np.complex128)
    with np.errstate(invalid="ignore"):    # -inf + 0j times n: the term is dropped below
        for s, n in steps:
            log_f += n * s.log_mgf(z)
            log_f_fine += n * s.log_mgf(z, refine=2)
    den = np.log(z) + np.log(z + 1.0)
    dead = ~np.isfinite(log_f_fine.real) | ~np.isfinite(log_f.real)
    log_f_fine[dead], log_f[dead] = -np.inf, -np.inf
    f = np.where(dead, 0.0, np.exp(log_f_fine - z * eps - den))
    with np.errstate(invalid="ignore"):
        gap = np.where(dead, 0.0, np.abs(log_f_fine - log_f))
    weights = np.full(points, delta_v / math.pi)
    weights[0] *= 0.5
    value = float(np.sum(weights * f.real))
    abs_sum = float(np.sum(weights * np.abs(f)))
    quad = float(np.sum(weights * np.abs(f) * np.expm1(gap)))
    rounding = abs_sum * 8.0 * np.finfo(float).eps * (total + 10)
    # the aliased terms are non-negative: value - alias <= delta <= value (plus the symmetric errors)
    error = alias + trunc + quad + rounding
    return RefereeDelta(float(value - 0.5 * alias), float(error - 0.5 * alias), float(alpha), int(points))


def _chernoff(steps, eps: float) -> float:
    """``min_alpha alpha^alpha / (alpha+1)^(alpha+1) e^{-alpha eps} prod_j M_j(alpha)^n_j``, an upper bound on
    ``delta(eps)`` (``(y - 1)_+ <= c y^(alpha+1)`` with that ``c``), over a grid of ``alpha``."""
    best = math.inf
    for a in np.geomspace(1e-3, 200.0, 40):
        log_m = sum(n * s.log_mgf_real(float(a)) for s, n in steps)
        val = log_m - a * eps + a * math.log(a) - (a + 1) * math.log1p(a)
        best = min(best, val)
    return math.exp(min(best, 0.0))


def _walk(steps, lips, alpha: float, eps: float, start: float, end: float, budget: float) -> tuple[bool, float]:
    """Bound the integral over ``[start, end]`` by ``budget``: ``(True, bound)``, or ``(False, v)`` at the first
    ``v`` where the integrand is not negligible.

    Between nodes ``v_k`` the step MGFs move by at most their Lipschitz constants ``D_j = E_P[|L| e^{alpha L}]``
    (``|M_j(u)| <= |M_j(v_k)| + D_j (u - v_k)``), and ``|den| >= v^2``; each node's step is the longest (halving
    from the rest of the range) whose bound stays within the budget's share of its length."""
    if start >= end:
        return True, 0.0
    rate = budget / (end - start)
    total, v = 0.0, start
    for _ in range(400):                    # beyond that, a longer uniform grid is cheaper: give up here
        if v >= end:
            return True, total
        mags = [float(s.log_mgf(np.array([alpha + 1j * v]))[0].real) for s, _ in steps]

        def bound(width: float, v: float = v, mags: list = mags) -> float:
            grown = [math.exp(m) + d * width for m, d in zip(mags, lips, strict=True)]
            if min(grown) <= 0.0:
                return 0.0
            log_b = sum(n * math.log(g) for (_, n), g in zip(steps, grown, strict=True))
            return math.exp(min(700.0, log_b - alpha * eps)) / (math.pi * v * v)

        if bound(0.0) > rate:
            return False, v
        width = end - v
        while bound(width) > rate and width > 1e-9 * end:
            width *= 0.5
        if bound(width) > rate:
            return False, v
        total += bound(width) * width
        v += width
    return (True, total) if v >= end else (False, v)


def referee_delta(events, epsilon: float, relation: str | None = None) -> RefereeDelta:
    r"""``delta(epsilon)`` of composed subsampled Gaussians, with an error bound.

    Parameters
    ----------
    events : list of tuple
        ``(sigma, q, count)``: noise multiplier ``sigma > 0``, sampling rate ``q`` in ``(0, 1]`` (1: the
        Gaussian mechanism) and how many steps (Poisson subsampling, add-or-remove neighbours).
    epsilon : float
        ``epsilon >= 0``.
    relation : {"remove", "add"}, optional
        One neighbouring direction; by default the larger ``delta`` of the two.

    Returns
    -------
    RefereeDelta
        ``value`` and ``error`` with ``|delta(epsilon) - value| <= error``.

    Examples
    --------
    >>> from dpmath.referee import referee_delta
    >>> d = referee_delta([(1.1, 256 / 60000, 1000)], 1.0)
    >>> bool(d.low <= d.high and d.error < 1e-8 * d.value)
    True
    """
    e = non_negative(epsilon, "epsilon")
    rels = _RELATIONS if relation is None else (relation,)
    if any(r not in _RELATIONS for r in rels):
        raise ValueError(f"relation must be one of {list(_RELATIONS)} or None, got {relation!r}")
    # a direction whose Chernoff bound lies below another's certified value cannot be the maximum: skipped
    built = {r: _steps(events, r) for r in rels}
    ranked = sorted(((_chernoff(built[r], e), r) for r in rels), reverse=True)
    best = None
    for bound, r in ranked:
        if best is not None and bound < best.low:
            continue
        d = _delta_one(built[r], e)
        best = d if best is None or d.value > best.value else best
    return best


def referee_epsilon(events, delta: float, *, rtol: float = 1e-9, guess: float | None = None) -> tuple[float, float]:
    r"""``(low, high)`` enclosing the smallest ``epsilon >= 0`` with ``delta(epsilon) <= delta``.

    The crossing of the computed ``delta`` (Brent's method on :func:`referee_delta`), then a bracket around
    it: ``low`` is an ``epsilon`` whose certified ``delta`` interval lies above ``delta``, ``high`` one whose
    interval lies at or below it, so the truth lies between them.  Its width is twice what the error
    bounds need, plus ``rtol`` relative.

    Parameters
    ----------
    events : list of tuple
        ``(sigma, q, count)``, as in :func:`referee_delta`.
    delta : float
        In ``(0, 1)``.
    rtol : float
        Relative slack added to the bracket.
    guess : float, optional
        Where to start looking (default: a coarse PLD upper bound, discretization 1e-3); only the search
        starts there, the answer does not depend on it.

    Examples
    --------
    >>> from dpmath.referee import referee_epsilon
    >>> lo, hi = referee_epsilon([(2.0, 1.0, 16)], 1e-5)            # Gaussian, mu = 2
    >>> round(lo, 6), round(hi, 6)
    (9.997256, 9.997256)
    """
    d = open_probability(delta, "delta")
    if referee_delta(events, 0.0).high <= d:
        return 0.0, 0.0
    if guess is None:
        from .mechanisms import SubsampledGaussian
        from .pld import PLDAccountant

        acc = PLDAccountant(1e-3)
        for sigma, q, n in events:
            acc.compose(SubsampledGaussian(sigma, q), n)
        guess = acc.epsilon(d)
    above = max(float(guess), 1e-6)
    while referee_delta(events, above).value > d:      # evaluations near the answer only: they are cheap
        above *= 1.01
    gap = 1e-3 * above
    while (below := max(above - gap, 0.0)) > 0.0 and referee_delta(events, below).value <= d:
        above, gap = below, 2.0 * gap
    # the crossing of the computed value, then a bracket around it as wide as the error bounds need
    root = optimize.brentq(lambda e: referee_delta(events, e).value - d, below, above, xtol=1e-12, rtol=1e-13)
    at = referee_delta(events, root)
    step = max(1e-9 * root, 1e-12)
    slope = (referee_delta(events, root + step).value - at.value) / step     # d delta / d epsilon < 0
    width = 2.0 * at.error / max(-slope, 1e-300) + rtol * root
    for _ in range(60):
        low, high = max(root - width, 0.0), root + width
        if (low == 0.0 or referee_delta(events, low).low > d) and referee_delta(events, high).high <= d:
            return float(low), float(high)
        width *= 4.0
    raise ValueError("the referee's error bounds do not separate delta from its crossing")


_RC_ROUNDING = 1e-12   # relative allowance for the closed-form one-step curve (log_ndtr and expm1 rounding)


def _subsampled_hockey(mu: np.ndarray, q: float, eps: float, relation: str) -> np.ndarray:
    r"""Hockey-stick divergence ``H_{e^eps}`` of one subsampled Gaussian pair (vectorized in ``mu > 0``).

    ``remove``: ``H = q Phi(mu - x) (1 - e^{eps'} Phi(-x) / Phi(mu - x))`` with ``eps' = log(1 + expm1(eps)/q)``
    and ``x = eps'/mu + mu/2`` (the loss exceeds ``eps`` beyond ``x``).  ``add``: with ``c = 1 - (1 -
    e^{-eps})/q`` (none of the loss exceeds ``eps`` when ``c <= 0``) and ``x = log(c)/mu + mu/2``,
    ``H = e^eps q c Phi(x) (1 - Phi(x - mu) / (c Phi(x)))``.  Both in log form, so small values keep their
    relative accuracy."""
    mu = np.asarray(mu, dtype=float)
    if relation == "remove":
        e1 = eps + math.log1p((q - 1.0) * math.exp(-eps)) - math.log(q)     # log(1 + expm1(eps)/q), any eps
        x = e1 / mu + 0.5 * mu
        lead = math.log(q) + special.log_ndtr(mu - x)
        return np.exp(lead) * -np.expm1(e1 + special.log_ndtr(-x) - special.log_ndtr(mu - x))
    c = 1.0 + math.expm1(-eps) / q
    if c <= 0.0:
        return np.zeros(mu.shape)
    x = math.log(c) / mu + 0.5 * mu
    lead = eps + math.log(q) + math.log(c) + special.log_ndtr(x)
    return np.exp(lead) * -np.expm1(special.log_ndtr(x - mu) - math.log(c) - special.log_ndtr(x))


class _ScaleBins:
    """The envelope's scale ``a = 1/sqrt(Y)`` on a geometric grid of relative step ``resolution`` (the
    accountant's construction, :func:`~dpmath.discretization.pessimistic_discretization`): each bin's mass at its
    largest scale for the upper bound (the mass below ``ppf(tail)``, unbounded scales, charged), at its
    smallest for the lower bound (the mass above the grid, scales near 0, left out)."""

    def __init__(self, sigma: float, q: float, envelope: Envelope, resolution: float, tail: float) -> None:
        y_lo = float(envelope.ppf(tail))
        y_hi = envelope.support_interval(1e-16)[1]
        a_min, a_max = 1.0 / math.sqrt(y_hi), 1.0 / math.sqrt(y_lo)
        a_max = max(a_max, a_min * (1.0 + resolution))
        count = max(1, math.ceil(math.log(a_max / a_min) / math.log1p(resolution)))
        a = a_min * (a_max / a_min) ** (np.arange(count + 1) / count)
        y = np.sort(1.0 / a ** 2)
        pess = pessimistic_discretization(envelope, y)
        opt = pessimistic_discretization(envelope, y, optimistic=True)
        self.q = q
        self.charged = pess.below_mass          # P(Y <= y_0), at most tail (plus the CDF's tolerance)
        self.up_mu = pess.scale / sigma
        self.up_w = pess.weights / (1.0 - self.charged)          # the law given Y > y_0
        finite = np.isfinite(opt.y)
        self.low_mu, self.low_w = opt.scale[finite] / sigma, opt.weights[finite]
        self.low_dropped = float(opt.weights[~finite].sum())
        self.bins = int(self.up_mu.size)

    def tail_charge(self, steps: int) -> float:
        """``1 - (1 - q P(Y <= y_0))^n``: a step whose scale is in the charged tail moves ``delta`` by at most
        its total variation ``q``, and at most that many steps are."""
        return float(-math.expm1(steps * math.log1p(-self.q * self.charged)))


def _rc_args(sigma, q, envelope, steps, resolution, tail) -> tuple[float, float, int, float, float]:
    """The validated ``(sigma, q, steps, resolution, tail)``, named in errors as the public arguments."""
    s = positive_real(sigma, "noise_multiplier")
    qq = sample_rate(q, "sample_rate")
    if not isinstance(envelope, Envelope):
        raise ValueError(f"envelope must be a dpmath Envelope, got {type(envelope).__name__}")
    n = positive_int(steps, "steps")
    r = float(resolution)
    if not 1e-6 <= r <= 0.1:
        raise ValueError(f"resolution must lie in [1e-6, 0.1], got {resolution!r}")
    t = float(tail)
    if not 0 < t < 1e-3:
        raise ValueError(f"tail must lie in (0, 1e-3), got {tail!r}")
    return s, qq, n, r, t


class _RcCurve:
    """``[low, high]`` enclosing the composed randomized-clipping curve at any ``epsilon`` (both directions)."""

    def __init__(self, bins: _ScaleBins, steps: int) -> None:
        self.bins, self.steps = bins, steps
        if steps > 1:
            self.up = {r: [(_Mixture(bins.up_mu, bins.up_w, 0.0, bins.q, r), steps)] for r in _RELATIONS}
            self.low = {r: [(_Mixture(bins.low_mu, bins.low_w, bins.low_dropped, bins.q, r), steps)]
                        for r in _RELATIONS}

    def __call__(self, eps: float) -> tuple[float, float]:
        b = self.bins
        if self.steps == 1:     # one step: the bins' closed-form curves, monotone in the scale
            high = max(float(b.up_w @ _subsampled_hockey(b.up_mu, b.q, eps, r)) for r in _RELATIONS)
            low = max(float(b.low_w @ _subsampled_hockey(b.low_mu, b.q, eps, r)) for r in _RELATIONS)
            high, low = high * (1.0 + _RC_ROUNDING), low * (1.0 - _RC_ROUNDING)
        else:
            high, low = self._larger(self.up, eps).high, self._larger(self.low, eps).low
        return max(low, 0.0), min(high + b.tail_charge(self.steps), 1.0)

    @staticmethod
    def _larger(built: dict, eps: float) -> RefereeDelta:
        """The direction with the larger curve; one whose Chernoff bound lies below the other's certified
        interval cannot be it and is skipped (as in :func:`referee_delta`)."""
        first = _delta_one(built["remove"], eps)
        if _chernoff(built["add"], eps) < first.low:
            return first
        second = _delta_one(built["add"], eps)
        return first if first.value >= second.value else second


def referee_rc_delta(noise_multiplier: float, sample_rate: float, envelope: Envelope, steps: int, epsilon: float,
                     *, resolution: float = 2e-4, tail: float = 1e-16) -> tuple[float, float]:
    r"""``(low, high)`` enclosing ``delta(epsilon)`` of ``steps`` DP-SGD-RC steps
    (:class:`~dpmath.SubsampledGaussian` with an envelope), without a grid of privacy losses.

    The scale ``a = 1/sqrt(Y)`` is binned with relative step ``resolution``: the mechanism with each bin's mass
    at its largest scale dominates the true one (a subsampled Gaussian's curve grows with its ``mu``), the one
    with it at its smallest scale is dominated, so their curves enclose the truth.  ``P(Y <= ppf(tail))``
    (scales without bound) is charged: ``1 - (1 - q tail)^steps`` is added to ``high``; the mass above the grid
    is left out of ``low``.  One step: the bins' closed-form curves (:func:`_subsampled_hockey`).  Several: the
    Laplace inversion of :func:`referee_delta`, with each step's MGF the bins' weighted sum and the same
    error bounds.  The larger of the two neighbouring directions, for each end.

    Parameters
    ----------
    noise_multiplier : float
        ``sigma``, the noise standard deviation over the clipping norm, ``> 0``.
    sample_rate : float
        ``q``, the sampling probability, in ``(0, 1]``.
    envelope : Envelope
        The law of ``Y`` (e.g. :class:`~dpmath.HutchEnvelope`).
    steps : int
        Number of compositions, ``>= 1``.
    epsilon : float
        ``>= 0``.
    resolution : float
        Relative width of the scale bins, in ``[1e-6, 0.1]``; the enclosure's width is about proportional.
    tail : float
        Mass of ``Y`` at the small end charged to ``delta`` (per step, times ``q``), in ``(0, 1e-3)``.  A
        heavy-tailed envelope (small ``k``) may need a larger one: the composition refuses when a charged-off
        scale would make an MGF overflow.

    Returns
    -------
    tuple of float
        ``(low, high)`` with ``low <= delta(epsilon) <= high``.

    Examples
    --------
    >>> from dpmath import HutchEnvelope
    >>> from dpmath.referee import referee_rc_delta
    >>> low, high = referee_rc_delta(2.0, 0.1, HutchEnvelope(projection_dim=32, dim=2048), 1, 0.5)
    >>> bool(0 < low <= high < 1.01 * low)
    True
    """
    e = non_negative(epsilon, "epsilon")
    s, qq, n, r, t = _rc_args(noise_multiplier, sample_rate, envelope, steps, resolution, tail)
    return _RcCurve(_ScaleBins(s, qq, envelope, r, t), n)(e)


def referee_rc_epsilon(noise_multiplier: float, sample_rate: float, envelope: Envelope, steps: int, delta: float,
                       *, resolution: float = 2e-4, tail: float | None = None, rtol: float = 1e-6
                       ) -> tuple[float, float]:
    r"""``(low, high)`` enclosing the smallest ``epsilon`` with ``delta(epsilon) <= delta`` for ``steps``
    DP-SGD-RC steps: ``low`` is an ``epsilon`` whose certified ``delta`` lies above ``delta``, ``high`` one whose
    certified ``delta`` lies at or below it (:func:`referee_rc_delta`), each found to ``rtol`` relative.

    ``tail`` defaults to ``1e-4 delta / (steps q)`` (capped at ``1e-4``), so the charged tail moves ``delta``
    by at most ``1e-4`` of itself.  Other parameters as in :func:`referee_rc_delta`.

    Examples
    --------
    >>> from dpmath import HutchEnvelope
    >>> from dpmath.referee import referee_rc_epsilon
    >>> low, high = referee_rc_epsilon(1.0, 0.05, HutchEnvelope(projection_dim=32, dim=2048), 1, 1e-6)
    >>> bool(low < high < 1.003 * low)
    True
    """
    d = open_probability(delta, "delta")
    s, qq, n, r, _ = _rc_args(noise_multiplier, sample_rate, envelope, steps, resolution, 1e-16)
    t = min(1e-4, 1e-4 * d / (n * qq)) if tail is None else _rc_args(s, qq, envelope, n, r, tail)[4]
    curve = _RcCurve(_ScaleBins(s, qq, envelope, r, t), n)
    cache: dict[float, tuple[float, float]] = {}

    def at(e: float) -> tuple[float, float]:
        if e not in cache:
            cache[e] = curve(e)
        return cache[e]

    def crossing(end: int) -> float:
        """For the low end (``end = 0``) the largest ``epsilon`` found where it is above ``delta``; for the high
        end the smallest where it is at or below; within ``rtol`` of the crossing (Brent's method on the
        logarithm, then one step to the right side)."""
        if at(0.0)[end] <= d:
            return 0.0
        hi = 1.0
        while at(hi)[end] > d:
            hi *= 2.0
            if hi > 1e4:
                raise ValueError("the enclosure stays above delta up to epsilon = 1e4")
        lo = hi / 2.0 if hi > 1.0 else 0.0

        def f(e: float) -> float:
            v = at(e)[end]
            return (math.log(v) if v > 0 else -800.0) - math.log(d)
        if hi - lo > rtol * hi:
            root = optimize.brentq(f, lo, hi, xtol=0.25 * rtol * hi)
            step = 0.5 * rtol * root
            if end == 0:
                while root > 0 and at(root)[0] <= d:
                    root = max(root - step, 0.0)
                return root
            while at(root)[1] > d:
                root += step
            return root
        return lo if end == 0 else hi

    return crossing(0), crossing(1)

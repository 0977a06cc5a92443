r"""Gaussian steps in closed form: the composed curves of an accountant that holds nothing else, to the nearest floats.

Steps of the Gaussian mechanism with noise multipliers ``sigma_i``, run ``n_i`` times, compose to one Gaussian
pair, ``N(mu, 1)`` against ``N(0, 1)`` with ``mu = sqrt(sum_i n_i / sigma_i^2)`` (``2 mu`` when one example is
replaced: ``N(-mu, 1)`` against ``N(mu, 1)``), the same in both directions, whose hockey-stick and trade-off curves
are (Dong, Roth and Su, Gaussian differential privacy, Cor. 2.13)

.. math::

    \delta(\varepsilon) = \Phi(a) - e^{\varepsilon}\,\Phi(a - \mu) = \Phi(a) - \varphi(a)\, M(\mu - a),
    \quad a = \frac{\mu}{2} - \frac{\varepsilon}{\mu},\qquad
    \beta(\alpha) = \Phi\big(\Phi^{-1}(1 - \alpha) - \mu\big),

with the Mills ratio ``M(y) = Phi(-y) / phi(y)`` (``e^eps phi(a - mu) = phi(a)``).  No grid holds every noise level
(at ``sigma = 1e-3`` one step's losses reach ``5e5``; at ``sigma = 1e300`` they are ``1e-300``), so
:class:`GaussianCurve` evaluates these in mpmath and rounds each bound outward to a float: an upper end is never
below the exact value and a lower end never above it.

Every evaluation is an interval.  At a working precision of ``P`` digits, ``mu`` and ``a`` carry a rounding error
that is bounded and added outward; the curve is increasing in ``a`` and in ``mu`` (``M`` decreases), so it is
evaluated at the ends of their intervals, and the difference of its two terms is widened by its rounding.  Where
the interval is wider than :data:`_DIGITS` digits (the terms cancel, e.g. ``mu = 1e-300``, or ``a`` is the small
difference of ``mu / 2 = 5e149`` and ``eps / mu``), the precision grows by the digits missing.  ``|a|`` beyond 40
puts ``delta`` within ``1e-340`` of 0 or 1, and a Mills ratio of an argument beyond :data:`_SERIES_FROM` is its
asymptotic series (enveloping: the error is below the first term left out), so no function is evaluated at an
argument where mpmath's own evaluation fails (``ncdf(-1e50)``).  An epsilon that exceeds the largest float
(``sigma`` below about ``1e-154`` for one step) is refused with a :class:`ValueError`.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
from scipy import special

__all__ = ["GaussianCurve"]

_DIGITS = 40            # a bound is computed until its interval is this many digits wide ...
_MAX_DIGITS = 3000      # ... or the working precision reaches this (then the wider interval, still sound)
_FAR = 40               # |a| beyond: Phi(a) or 1 - Phi(a) below 1e-349, past every positive float
_SERIES_FROM = 1000     # the Mills ratio's asymptotic series from this argument on (its terms fall by y^2 each)
_LARGEST = float(np.finfo(np.float64).max)


def _up(x: mpmath.mpf) -> float:
    """The smallest float at or above ``x``."""
    f = float(x)
    while mpmath.mpf(f) < x:
        f = math.nextafter(f, math.inf)
    return f


def _down(x: mpmath.mpf) -> float:
    """The largest float at or below ``x``, and at least 0."""
    f = float(x)
    while f > 0 and mpmath.mpf(f) > x:
        f = math.nextafter(f, -math.inf)
    return max(f, 0.0)


def _mills(y: mpmath.mpf) -> tuple[mpmath.mpf, mpmath.mpf]:
    """``(lower, upper)`` bounds on the Mills ratio ``M(y) = Phi(-y) / phi(y)``, ``y > 0``, at the working
    precision: mpmath's ratio up to :data:`_SERIES_FROM`, the asymptotic series ``sum_k (-1)^k (2k-1)!! / y^(2k+1)``
    beyond, summed until a term is below the precision, which bounds its remainder."""
    tol = mpmath.mpf(10) ** (3 - mpmath.mp.dps)
    if y < _SERIES_FROM:
        m = mpmath.ncdf(-y) / mpmath.npdf(y)
        return m * (1 - tol), m * (1 + tol)
    total, term, k = mpmath.mpf(0), 1 / y, 0
    while k == 0 or abs(term) > tol * total:
        total += term
        k += 1
        term *= -(2 * k - 1) / (y * y)
    # the remainder has the sign of the first term left out and is smaller; tol covers the sum's rounding
    ends = (total, total + term)
    return min(ends) * (1 - tol), max(ends) * (1 + tol)


class GaussianCurve:
    """The composition of Gaussian steps, ``N(mu, 1)`` against ``N(0, 1)``, read out in closed form.

    Parameters
    ----------
    steps : list of (float, int)
        ``(noise_multiplier, count)`` of each event.
    shift_factor : int
        2 when one example is replaced (the pair's means are ``2 mu`` apart), else 1.
    """

    def __init__(self, steps: list[tuple[float, int]], shift_factor: int = 1) -> None:
        self._steps = steps
        self._factor = shift_factor
        with mpmath.workdps(20):
            self.mu = float(self._mu())   # for messages: inf where it exceeds the largest float

    def _mu(self) -> mpmath.mpf:
        """``mu`` at the working precision (the inputs are exact: a float is an mpf without rounding, and mpmath's
        exponents are unbounded, so ``1 / sigma^2`` neither overflows nor underflows)."""
        return mpmath.sqrt(mpmath.fsum(mpmath.mpf(n) / mpmath.mpf(s) ** 2 for s, n in self._steps)) * self._factor

    def _mu_interval(self) -> tuple[mpmath.mpf, mpmath.mpf]:
        """``(lower, upper)`` bounds on the exact ``mu`` at the working precision (each of the sum's terms and
        additions, and the square root, rounds by at most one unit in the last digit)."""
        mu = self._mu()
        err = mu * mpmath.mpf(10) ** (1 - mpmath.mp.dps) * (len(self._steps) + 4)
        return mu - err, mu + err

    # ----------------------------------------------------------------------------- delta
    @staticmethod
    def _curve(a: mpmath.mpf, mu: mpmath.mpf) -> tuple[mpmath.mpf, mpmath.mpf, mpmath.mpf]:
        """``(lower, upper, slope)`` at ``a`` (``|a| <= 41``) for the shift ``mu``: ``Phi(a) - phi(a) M(mu - a)``
        widened by the rounding of its terms, and ``d delta / d a = mu phi(a) M(mu - a)``."""
        t1 = mpmath.ncdf(a)
        m_lo, m_hi = _mills(mu - a)
        pdf = mpmath.npdf(a)
        err = t1 * mpmath.mpf(10) ** (3 - mpmath.mp.dps)
        return t1 - pdf * m_hi - err, t1 - pdf * m_lo + err, mu * pdf * m_lo

    def _bounds(self, eps: mpmath.mpf) -> tuple[mpmath.mpf, mpmath.mpf]:
        """``(lower, upper)`` bounds on the exact ``delta(eps)``, :data:`_DIGITS` digits apart where the precision
        allows (module docstring)."""
        with mpmath.workdps(15):
            mu = self._mu()
            size = float(mpmath.log10(mu / 2 + eps / mu + 1))   # digits of a's terms, lost in their difference
        digits = _DIGITS + 10 + max(0, math.ceil(size))
        while True:
            with mpmath.workdps(digits):
                mu_lo, mu_hi = self._mu_interval()
                slack = (mu_hi / 2 + eps / mu_lo) * mpmath.mpf(10) ** (2 - digits)
                a_lo = mu_lo / 2 - eps / mu_lo - slack   # a increases with mu
                a_hi = mu_hi / 2 - eps / mu_hi + slack
                # beyond |a| = 40 the bounds need not be tight, only representable at this precision
                if a_hi < -_FAR:   # delta <= Phi(a) < Phi(-40)
                    return mpmath.mpf(0), mpmath.ncdf(-_FAR) * (1 + mpmath.mpf(10) ** (3 - digits))
                if a_lo > _FAR:   # 1 - delta <= Phi(-a) + phi(a) M(mu - a) < 1e-340
                    return 1 - mpmath.mpf(10) ** -_DIGITS, mpmath.mpf(1)
                lo = self._curve(a_lo, mu_lo)[0] if a_lo > -_FAR - 1 else mpmath.mpf(0)
                hi = self._curve(a_hi, mu_hi)[1] if a_hi < _FAR + 1 else mpmath.mpf(1)
                lo, hi = max(lo, mpmath.mpf(0)), min(hi, mpmath.mpf(1))
                wanted = mpmath.mpf(10) ** -_DIGITS * hi
                if hi - lo <= wanted or digits >= _MAX_DIGITS:
                    return lo, hi
                missing = float(mpmath.log10((hi - lo) / wanted)) if hi > 0 else digits
                digits = min(digits + math.ceil(missing) + 10, _MAX_DIGITS)

    def delta_bracket(self, eps: float) -> tuple[float, float]:
        """``(lower, upper)`` floats around the exact ``delta(eps)``, ``eps >= 0``."""
        lo, hi = self._bounds(mpmath.mpf(eps))
        return _down(lo), min(_up(hi), 1.0)

    # ----------------------------------------------------------------------------- epsilon
    def epsilon_bracket(self, delta: float) -> tuple[float, float]:
        """``(lower, upper)`` floats around the exact ``epsilon(delta)``, the smallest ``eps >= 0`` with
        ``delta(eps) <= delta``; ``delta`` in ``(0, 1)``.

        The root is found in ``a``, where the curve is well conditioned whatever ``mu`` (its slope there is
        ``mu phi(a) M(mu - a)``): safeguarded Newton steps on ``log delta``, at :data:`_DIGITS` plus 20 digits.
        ``eps = mu (mu / 2 - a)``, rounded to floats, is then certified on each side by :meth:`_bounds`, stepping
        outward where the rounding left it in doubt.

        Raises
        ------
        ValueError
            Where ``epsilon(delta)`` exceeds the largest float.
        """
        if self._bounds(mpmath.mpf(0))[1] <= delta:
            return 0.0, 0.0
        if self.mu > 2e154:   # eps >= mu^2 / 2 - 41 mu
            self._refuse(delta)
        with mpmath.workdps(_DIGITS + 20):
            mu = self._mu()
            # delta(a) <= Phi(a): the root is above Phi^-1(delta); at a = mu / 2 (eps = 0) delta is above the target
            lo = max(mpmath.mpf(float(special.ndtri(delta))) - 1e-6, mpmath.mpf(-_FAR - 1))
            hi = min(mu / 2, mpmath.mpf(_FAR + 1))
            x = (lo + hi) / 2
            for _ in range(200):
                d_lo, d_hi, slope = self._curve(x, mu)
                d = (d_lo + d_hi) / 2
                if d <= 0:
                    lo, x = x, (x + hi) / 2
                    continue
                g = mpmath.log(d) - mpmath.log(delta)
                if g > 0:
                    hi = x
                else:
                    lo = x
                nxt = x - g * d / slope if slope > 0 else (lo + hi) / 2
                if not lo < nxt < hi:
                    nxt = (lo + hi) / 2
                done = abs(nxt - x) <= mpmath.mpf(10) ** -(_DIGITS + 5) * (1 + abs(x))
                x = nxt
                if done or hi - lo <= mpmath.mpf(10) ** -(_DIGITS + 5):
                    break
        with mpmath.workdps(_DIGITS + 20 + max(0, math.ceil(2 * math.log10(max(self.mu, 1.0))))):
            eps = self._mu() * (self._mu() / 2 - x)
        if eps > _LARGEST:
            self._refuse(delta)
        return self._certified(eps, delta, -1), self._certified(eps, delta, 1)

    def _certified(self, eps: mpmath.mpf, delta: float, direction: int) -> float:
        """The float nearest ``eps`` on the side ``direction`` where :meth:`_bounds` makes it certain: above
        (``1``), ``delta(eps) <= delta``, an upper bound on epsilon; below (``-1``), ``delta(eps) > delta``, a
        lower one (0 where none is).  Steps outward by a doubling number of units in the last place."""
        f = _up(max(eps, mpmath.mpf(0))) if direction > 0 else _down(eps)
        gap = 1
        while True:
            lo, hi = self._bounds(mpmath.mpf(f))
            if (hi <= delta) if direction > 0 else (lo > delta):
                return f
            if direction < 0 and f <= 0:
                return 0.0
            f = max(f + direction * gap * math.ulp(f), 0.0) if f > 0 else (5e-324 if direction > 0 else 0.0)
            if f > _LARGEST:
                self._refuse(delta)
            gap *= 2

    def _refuse(self, delta: float) -> None:
        """An epsilon beyond the largest float says nothing: refuse it."""
        raise ValueError(
            f"epsilon at delta = {delta:g} exceeds the largest float, {_LARGEST:.3g}: the composed Gaussian steps, "
            f"mu = sqrt(sum of count / noise_multiplier^2) = {self.mu:.3g}, give no privacy to account; use a "
            f"larger noise_multiplier (mu below about 1.8e154)")

    # ----------------------------------------------------------------------------- trade-off
    def tradeoff(self, alpha: np.ndarray) -> np.ndarray:
        """A lower bound, rounded down to floats, on ``beta(alpha)`` at every point of ``alpha`` (in ``[0, 1]``).

        ``z = Phi^-1(alpha)`` is ndtri's value (good to about ``1e-15``) after three Newton steps in mpmath, its
        error bounded by the last step; ``beta = Phi(-z - mu)`` decreases in ``z`` and ``mu``, so it is taken at
        their upper ends."""
        flat = np.asarray(alpha, dtype=np.float64).ravel()
        out = np.empty_like(flat)
        digits = _DIGITS + 20   # 1 - alpha cancels up to 16 digits in the Newton steps
        with mpmath.workdps(digits):
            mu_hi = self._mu_interval()[1]
            for i, a in enumerate(flat.tolist()):
                if a <= 0 or a >= 1:
                    out[i] = 1.0 if a <= 0 else 0.0
                    continue
                z = mpmath.mpf(float(special.ndtri(a)))
                for _ in range(3):
                    step = (mpmath.ncdf(z) - a) / mpmath.npdf(z)
                    z -= step
                # Newton converges quadratically here: the next step is far below the last one, which bounds it
                x = -z - mu_hi - abs(step) - mpmath.mpf(10) ** (3 - digits) * (1 + abs(z))
                out[i] = 0.0 if x < -_FAR else _down(mpmath.ncdf(x) * (1 - mpmath.mpf(10) ** (3 - digits)))
        return out.reshape(np.shape(alpha))

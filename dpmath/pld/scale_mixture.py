r"""One randomized-clipping step in closed form: its hockey-stick curve as a sum over the envelope's scale atoms.

A single step of DP-SGD-RC (:class:`~dpmath.SubsampledGaussian` with an envelope) reveals its scale ``a = 1/sqrt(Y)``
in the dominating pair, so its curve is the ``Y``-average of subsampled-Gaussian curves, and each of those is a
Gaussian pair's curve ``delta_G(mu, e) = Phi(mu/2 - e/mu) - e^e Phi(-mu/2 - e/mu)`` (any real ``e``) at a shifted
argument: with ``mu = a / sigma``,

.. math::

    \delta_{\mathrm{remove}}(\varepsilon) = q\,\mathbb E_a\big[\delta_G(\mu, \varepsilon_r)\big],\quad
    \varepsilon_r = \log\big(1 + (e^{\varepsilon} - 1)/q\big),\qquad
    \delta_{\mathrm{add}}(\varepsilon) = \beta\,\mathbb E_a\big[\delta_G(\mu, \varepsilon_a)\big],\quad
    \beta = 1 - (1-q)e^{\varepsilon},\ \varepsilon_a = \log(q e^{\varepsilon} / \beta)

(``delta_add = 0`` where ``beta <= 0``): removing an example, ``(q p_mu + (1-q) p_0 - e^eps p_0)_+ = q (p_mu - c
p_0)_+`` with ``c = (e^eps - 1 + q) / q``; adding one, ``(p_0 - e^eps (q p_mu + (1-q) p_0))_+ = beta (p_0 - (q e^eps
/ beta) p_mu)_+``.  An unbounded scale (the envelope's mass below the scale grid) has ``delta_G = 1``.

:class:`ScaleMixtureCurve` sums these over the atoms of :func:`~dpmath.pld.steps.scale_atoms` (each bin's mass at its
largest scale for the upper curve, at its smallest for the lower), with no loss grid: the bracket's only width is
the scale grid's, and an atom costs a few special-function calls per evaluation, so the scale grid can be 16 to 64
times finer than a loss grid affords (one step of ``HutchEnvelope(2, 5)`` at ``epsilon = 23498``: ``[23043, 24006]``
on the default loss grid, whose sparse grids round a scale's losses by 0.6 %).

**Rounding.**  Every term is evaluated in float64 and widened by a bound on its rounding error, up for the upper
curve and down for the lower: ``delta_G`` as ``Phi(a) - phi(a) M(mu - a)`` (``a = mu/2 - e/mu``, ``M`` the Mills
ratio, via ``erfcx``), for ``a < 0`` as ``phi(a) (M(-a) - M(mu - a))``, so no term is below the float range where
the difference is not.  The bound assumes scipy's ``ndtr``, ``log_ndtr`` and ``erfcx`` within 16 ulp of the exact
value (their documented accuracy is a few ulp) and propagates the arguments' rounding through the derivatives
(``|d log Phi(x) / dx| <= |x| + 1``, ``|d delta_G / d e| = e^e Phi(b) <= Phi(a)``, ``d delta_G / d mu = phi(a)``);
the tests check it against mpmath.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from ..mechanisms import SubsampledGaussian
from ..validation import non_negative, open_probability, real_number
from .steps import scale_atoms

__all__ = ["ScaleMixtureCurve", "gaussian_curve_terms"]

_U = 2.0 ** -53          # float64's unit roundoff
_SLACK = 64.0 * _U       # a term's relative error per unit of its condition (16 ulp per special function, summed)
_TINY = 1e-306           # absolute error allowed for a term that underflows (below the smallest normal float)
_SQRT_HALF_PI = math.sqrt(0.5 * math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def gaussian_curve_terms(mu: np.ndarray, e: float) -> tuple[np.ndarray, np.ndarray]:
    r"""The Gaussian pair's hockey-stick curve ``delta_G(mu, e)`` at each positive ``mu`` and one real ``e``, in
    float64, with a bound on each value's error (the module docstring says how it is bounded).

    .. math::

        \delta_G(\mu, e) = \Phi\Big(\frac{\mu}{2} - \frac{e}{\mu}\Big)
        - e^{e}\,\Phi\Big(-\frac{\mu}{2} - \frac{e}{\mu}\Big)

    Returns
    -------
    value, err : ndarray
        ``|value - delta_G| <= err``, ``value`` in ``[0, 1]``.

    Examples
    --------
    >>> import numpy as np
    >>> value, err = gaussian_curve_terms(np.array([1.0]), 1.0)
    >>> f"{value[0]:.6f}", bool(err[0] < 1e-12)
    ('0.126937', True)
    """
    m = np.asarray(mu, dtype=np.float64)
    if m.ndim != 1 or not np.all((m > 0) & np.isfinite(m)):
        raise ValueError("mu must be a 1-D array of positive finite floats")
    return _terms(m, real_number(e, "e", allow_inf=False))


def _terms(mu: np.ndarray, e: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`gaussian_curve_terms` without the checks (the curve's atoms are positive by construction)."""
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        a = 0.5 * mu - e / mu
        b = a - mu
        phi_a = _INV_SQRT_2PI * np.exp(-0.5 * a * a)
        neg = a < 0
        # a < 0: both terms phi(a) M(.), their difference without leaving the float range
        m1 = _SQRT_HALF_PI * special.erfcx(-a / math.sqrt(2.0))
        m2 = _SQRT_HALF_PI * special.erfcx(-b / math.sqrt(2.0))
        t1_neg, t2_neg = phi_a * m1, phi_a * m2
        # a >= 0: Phi(a) and e^e Phi(b) as they are
        t1_pos = special.ndtr(a)
        log_b = special.log_ndtr(b)
        t2_pos = np.exp(e + log_b)
        t1 = np.where(neg, t1_neg, t1_pos)
        t2 = np.where(neg, t2_neg, t2_pos)
        value = np.where(neg, phi_a * (m1 - m2), t1_pos - t2_pos)
        value = np.where(np.isfinite(value), value, 0.0)
        t1 = np.where(np.isfinite(t1), t1, 1.0)
        t2 = np.where(np.isfinite(t2), t2, 1.0)
        # each term's condition: its arguments' rounding (|da|, |db| <= 3 u A, A = mu/2 + |e|/mu) through
        # |d log Phi(x) / dx| <= max(-x, 0) + 1 (and |d log M(y) / dy| <= y + 1); phi(a)'s exponent a^2 / 2 where it
        # is computed; e + log Phi(b)'s rounding where e^e Phi(b) is exp of it
        big_a = 0.5 * mu + abs(e) / mu
        # for a >= 0 the slope phi(x) / Phi(x), decreasing in x, at the lowest a the rounding allows (a huge mu puts
        # a's rounding at 1e-16 mu, where the slope is 0, not 1)
        a_lo = a - 3.0 * _SLACK * big_a
        ratio = _INV_SQRT_2PI * np.exp(-0.5 * a_lo * a_lo) / special.ndtr(a_lo)
        slope = np.minimum(np.maximum(-a_lo, 0.0) + 1.0, ratio)
        slope = np.where(neg | ~np.isfinite(slope), np.maximum(-a, 0.0) + 1.0, slope)
        c1 = 1.0 + np.where(slope > 0, slope * 3.0 * big_a, 0.0) + np.where(neg, 0.5 * a * a, 0.0)
        c2 = 1.0 + (np.maximum(-b, 0.0) + np.abs(mu - a) + 1.0) * 3.0 * big_a + np.where(
            neg, 0.5 * a * a, abs(e) + np.abs(log_b))
        err = _SLACK * (t1 * c1 + t2 * c2 + phi_a * mu) + _TINY
        # 0 times an overflowed condition: |a| past 1e150, where both terms are 0 at any rounding of a
        err = np.where(np.isnan(err), np.where((t1 == 0) & (t2 == 0), _TINY, 1.0), err)
        # e / mu beyond the float range: a = -inf (delta_G = 0) or +inf (delta_G = 1), exactly
        value = np.where(a == -np.inf, 0.0, np.where(a == np.inf, 1.0, value))
        err = np.where(np.isinf(a), _TINY, err)
    value = np.clip(value, 0.0, 1.0)
    return value, np.where(np.isfinite(err), err, 1.0)


class ScaleMixtureCurve:
    """The hockey-stick curve of one randomized-clipping step, adding or removing an example, bracketed.

    Parameters
    ----------
    step : SubsampledGaussian
        The step, with an envelope.
    scale_refinement : float
        The scale grid's step is ``step.scale_resolution * scale_refinement``.

    Examples
    --------
    >>> from dpmath import HutchEnvelope, SubsampledGaussian
    >>> curve = ScaleMixtureCurve(SubsampledGaussian(1.0, 0.05, HutchEnvelope(32, 2048)), 0.25)
    >>> lo, hi = curve.epsilon_bracket(1e-6)
    >>> round(lo, 3), round(hi, 3), (hi - lo) / hi < 2e-3
    (2.309, 2.312, True)
    """

    def __init__(self, step: SubsampledGaussian, scale_refinement: float) -> None:
        self.q = step.sample_rate
        sigma = step.noise_multiplier
        resolution = step.scale_resolution * scale_refinement
        point = step.envelope.point_mass()
        self._atoms = {}
        for upper in (True, False):
            if point is not None:
                scales, weights, unbounded = np.array([1.0 / math.sqrt(point)]), np.ones(1), 0.0
            else:
                scales, weights, unbounded = scale_atoms(step.envelope, resolution, upper)
            keep = (scales > 0) & (weights > 0)   # scale 0 (the lower curve's atom at Y = inf) has delta 0 at eps >= 0
            self._atoms[upper] = (scales[keep] / sigma, weights[keep], unbounded if upper else 0.0)

    @property
    def atoms(self) -> int:
        """The number of scale atoms of the upper curve."""
        return int(self._atoms[True][0].size)

    def _mixture(self, e: float, upper: bool) -> float:
        """``E_a[delta_G(mu, e)]`` (plus the unbounded mass, upper only), rounded toward ``upper``."""
        mu, w, unbounded = self._atoms[upper]
        value, err = _terms(mu, e)
        # delta_G is in [0, 1] whatever the rounding bound says
        terms = np.minimum(value + err, 1.0) if upper else np.maximum(value - err, 0.0)
        total = float(w @ terms)
        spread = 2.0 * (w.size + 2) * _U * total   # the sum's own rounding
        return total + spread + unbounded + _TINY if upper else max(total - spread, 0.0)

    def delta(self, eps: float, upper: bool = True) -> float:
        """The upper (``upper``) or lower bound on ``delta(eps)``, the worse of the two directions, ``eps >= 0``."""
        out = max(self._directions(non_negative(eps, "eps"), upper))
        out *= (1.0 + 4.0 * _U) if upper else (1.0 - 4.0 * _U)
        return min(max(out, 0.0), 1.0)

    def _directions(self, eps: float, upper: bool) -> tuple[float, float]:
        """The bounds on removing's and adding's ``delta(eps)``, before the last rounding."""
        q = self.q
        # removing: e_r = log(1 + (e^eps - 1) / q), rounded by a few ulp of itself
        if eps < 1.0:   # beyond, e^eps / q may pass the float range (eps near 700 at q = 1e-6)
            e_r = math.log1p(math.expm1(eps) / q)
        else:
            e_r = eps - math.log(q) + math.log1p(-(1.0 - q) * math.exp(-eps))
        # e's rounding moves delta_G by at most e^e Phi(b) <= 1 per unit: 4 ulp of e, outward
        shift = 4.0 * _U * abs(e_r)
        remove = q * self._mixture(e_r - shift if upper else e_r + shift, upper)
        add = 0.0
        x = eps + math.log1p(-q) if q < 1.0 else 0.0
        if x < 0.0:
            beta = -math.expm1(x)
            # beta's rounding (through x's) and the shifted argument's, outward
            d_beta = 4.0 * _U * (abs(eps) + abs(math.log1p(-q)) + beta)
            e_a = math.log(q) + eps - math.log(beta)
            shift = 4.0 * _U * (abs(math.log(q)) + eps + abs(math.log(beta)) + 1.0) + d_beta / beta
            if upper:
                add = (beta + d_beta) * self._mixture(e_a - shift, True)
            else:
                add = max(beta - d_beta, 0.0) * self._mixture(e_a + shift, False)
        return remove, add

    def delta_bracket(self, eps: float) -> tuple[float, float]:
        """``(lower, upper)`` bounds on ``delta(eps)``."""
        return self.delta(eps, False), self.delta(eps, True)

    def epsilon_bracket(self, delta: float) -> tuple[float, float]:
        """``(lower, upper)`` bounds on ``epsilon(delta)``: the upper end is a float where the upper curve is at most
        ``delta`` (``inf`` where none is: unbounded mass at least ``delta / q``), the lower end one where the lower
        curve exceeds ``delta`` (or 0), found by bisection to the last few bits."""
        d = open_probability(delta, "delta")
        return self._end(d, False), self._end(d, True)

    def _end(self, delta: float, upper: bool) -> float:
        if self.delta(0.0, upper) <= delta:
            return 0.0
        lo, hi = 0.0, 1.0
        while self.delta(hi, upper) > delta:
            lo, hi = hi, 2.0 * hi
            if hi > 1e300:
                return math.inf if upper else lo
        # invariant: delta(lo) > delta >= delta(hi)
        while hi - lo > 1e-13 * hi:
            mid = 0.5 * (lo + hi)
            if mid <= lo or mid >= hi:
                break
            if self.delta(mid, upper) > delta:
                lo = mid
            else:
                hi = mid
        return hi if upper else lo

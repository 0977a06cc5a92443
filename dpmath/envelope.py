"""The envelope distributions' common interface, and the envelopes known in closed form.

An envelope is the law of a data-independent ``Y`` that is stochastically smaller than every squared norm an
example's clipped contribution can be scaled by (``a = 1 / sqrt(Y)``), so that an accountant can charge the
mechanism at the scales it bounds.  :class:`Envelope` is their base class, a frozen, scipy.stats-like distribution
on ``(0, inf)``; this module also holds the envelopes known in closed form: :class:`PointMassEnvelope` (exact
norms), :class:`DiscreteEnvelope` (finitely many scales, e.g. truncated Poisson sampling's) and
:class:`ReplacementEnvelope` (two examples' scales together, for replacing one).

The envelopes of estimated norms are :mod:`dpmath.hutch`'s (:class:`~dpmath.HutchEnvelope`,
:class:`~dpmath.HutchPPEnvelope`); :mod:`dpmath.discretization` discretizes an envelope for the accountants.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike

from .validation import probability_array, real_array, real_number

__all__ = ["Envelope", "PointMassEnvelope", "DiscreteEnvelope", "ReplacementEnvelope"]


def _bisect_quantile(cdf, target: np.ndarray, lo: np.ndarray, hi: np.ndarray, iters: int) -> np.ndarray:
    """Smallest x in ``[lo, hi]`` with ``cdf(x) >= target`` (to ``(hi - lo) 2^-iters``), elementwise."""
    for _ in range(iters):
        mid = (lo + hi) / 2.0
        below = cdf(mid) < target
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return hi


def _scalar_or_array(out: np.ndarray) -> np.ndarray:
    """A distribution function's result: a NumPy scalar for a scalar argument, else the array."""
    return out[()] if out.ndim == 0 else out


def _published(function: Callable[[Envelope, ArrayLike], np.ndarray], cls: type, doc: str
               ) -> Callable[[Envelope, ArrayLike], np.ndarray]:
    """``function`` (a public distribution function of :class:`Envelope`) as a method of ``cls`` documented by
    ``doc``: the same checks and call (and signature), its own docstring, named as ``cls``'s (its module too, so
    that doctest finds its examples with the class's)."""
    @functools.wraps(function)
    def method(self: Envelope, value: ArrayLike) -> np.ndarray:
        return function(self, value)

    method.__doc__ = doc
    method.__qualname__ = f"{cls.__qualname__}.{function.__name__}"
    method.__module__ = cls.__module__
    return method


class Envelope:
    """Base class of the envelope distributions: a frozen, scipy.stats-like distribution on (0, inf).

    As in :class:`scipy.stats.rv_continuous`, the public distribution functions are this class's: :meth:`cdf` and
    :meth:`sf` check ``x`` (real numbers, no NaN), :meth:`ppf` checks ``q`` (in ``[0, 1]``), each refusing bad input
    with a ``ValueError`` that names the argument, converts it to a float64 array once, calls the subclass's
    ``_cdf``, ``_sf`` or ``_ppf`` on that array, and returns a NumPy scalar for a scalar argument, an array of the
    argument's shape otherwise.  Subclasses implement ``_cdf`` and ``_sf``, vectorized over arrays of any shape, and
    may override ``_ppf`` (by default bisection on ``_cdf``); the docstring of an implementation documents its public
    function (:meth:`__init_subclass__`).

    Envelopes whose parameters determine them (dpmath's) compare and hash by value, so two equal
    envelopes share the accountant's caches and survive a pickle round trip (``torch.distributed``
    ranks compare them); a subclass without ``_parameters`` compares by identity.
    """

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Publish each distribution function a subclass documents: where it gives ``_cdf``, ``_sf`` or ``_ppf`` a
        docstring, the subclass gets the public ``cdf``, ``sf`` or ``ppf`` of this class (its checks) under that
        docstring, so ``help()`` and the API reference show each envelope's own formula and example, as
        scipy.stats fills its distributions' docstrings in.  The docstring moves, so that doctest runs its examples
        once."""
        super().__init_subclass__(**kwargs)
        for public, private in (("cdf", "_cdf"), ("sf", "_sf"), ("ppf", "_ppf")):
            impl = cls.__dict__.get(private)
            if impl is not None and impl.__doc__:
                setattr(cls, public, _published(getattr(Envelope, public), cls, impl.__doc__))
                impl.__doc__ = None

    def _parameters(self) -> tuple | None:
        """The arguments that determine the distribution, or ``None`` (identity semantics)."""
        return None

    def __eq__(self, other: object) -> bool:
        p = self._parameters()
        if p is None:
            return self is other
        return type(other) is type(self) and other._parameters() == p

    def __hash__(self) -> int:
        p = self._parameters()
        return id(self) if p is None else hash((type(self).__name__, p))

    def cdf(self, x: ArrayLike) -> np.ndarray:
        """``P(Y <= x)``, vectorized: ``_cdf`` of ``x`` checked (real numbers, no NaN) and made a float64 array.

        Parameters
        ----------
        x : array_like
            Where to evaluate it.

        Returns
        -------
        numpy.ndarray
            The shape of ``x``; a NumPy scalar for a scalar ``x``.

        Raises
        ------
        ValueError
            Where ``x`` is not real numbers or contains NaN.

        Examples
        --------
        >>> import numpy as np
        >>> from dpmath import Envelope
        >>> class Uniform(Envelope):      # Y ~ U(0, 1), for illustration: _cdf gets a float64 array
        ...     def _cdf(self, x):
        ...         return np.clip(x, 0.0, 1.0)
        >>> float(Uniform().cdf(0.25)), Uniform().cdf([[0.5], [2]]).tolist()
        (0.25, [[0.5], [1.0]])
        >>> Uniform().cdf([0.5, float("nan")])
        Traceback (most recent call last):
        ...
        ValueError: x must not contain NaN
        """
        return _scalar_or_array(self._cdf(real_array(x, "x")))

    def sf(self, x: ArrayLike) -> np.ndarray:
        """``P(Y > x)``, vectorized: ``_sf`` of ``x`` checked (real numbers, no NaN) and made a float64 array.

        Parameters
        ----------
        x : array_like
            Where to evaluate it.

        Returns
        -------
        numpy.ndarray
            The shape of ``x``; a NumPy scalar for a scalar ``x``.

        Raises
        ------
        ValueError
            Where ``x`` is not real numbers or contains NaN.

        Examples
        --------
        >>> import numpy as np
        >>> from dpmath import Envelope
        >>> class Uniform(Envelope):      # Y ~ U(0, 1), for illustration: _sf gets a float64 array
        ...     def _sf(self, x):
        ...         return 1.0 - np.clip(x, 0.0, 1.0)
        >>> float(Uniform().sf(0.25))
        0.75
        """
        return _scalar_or_array(self._sf(real_array(x, "x")))

    def ppf(self, q: ArrayLike) -> np.ndarray:
        r"""Quantile function ``inf{x : F(x) >= q}``, vectorized; ``ppf(0) = 0`` and ``ppf(1) = inf``.

        Computed by bisection on the cdf (60 halvings of a bracket found by doubling), so the
        result is within ``1e-15`` relative of the exact quantile of the computed cdf.  Subclasses
        with closed-form pieces override ``_ppf``.

        Examples
        --------
        >>> import numpy as np
        >>> from dpmath import Envelope
        >>> class Exp(Envelope):          # Y ~ Exp(1), for illustration: _cdf gets a float64 array
        ...     def _cdf(self, x):
        ...         return -np.expm1(-np.maximum(x, 0.0))
        >>> round(float(Exp().ppf(0.5)), 12) == round(float(np.log(2)), 12)
        True
        """
        return _scalar_or_array(self._ppf(probability_array(q, "q")))

    def _cdf(self, x: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _sf(self, x: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _ppf(self, qs: np.ndarray) -> np.ndarray:
        flat = qs.ravel()
        out = np.empty(flat.shape)
        out[flat == 0] = 0.0
        out[flat == 1] = np.inf
        inner = (flat > 0) & (flat < 1)
        if inner.any():
            target = flat[inner]
            lo = np.zeros_like(target)
            hi = np.ones_like(target)
            for _ in range(1100):
                low_cdf = self._cdf(hi) < target
                if not low_cdf.any():
                    break
                lo = np.where(low_cdf, hi, lo)
                hi = np.where(low_cdf, 2.0 * hi, hi)
            out[inner] = _bisect_quantile(self._cdf, target, lo, hi, 60)
        return out.reshape(qs.shape)

    def point_mass(self) -> float | None:
        """The constant ``y`` when ``Y`` is almost surely equal to it, else ``None``.

        An accountant uses it to skip the grid: a constant scale needs no discretization, so the
        mechanism is then exactly a (subsampled) Gaussian.

        Examples
        --------
        >>> from dpmath import HutchEnvelope, PointMassEnvelope
        >>> HutchEnvelope(projection_dim=4, dim=8).point_mass() is None, PointMassEnvelope(1.0).point_mass()
        (True, 1.0)
        """
        return None

    def atoms(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(values, weights)`` when ``Y`` takes finitely many values, else ``None``: an accountant then uses the
        atoms as they are, with no grid.

        Examples
        --------
        >>> from dpmath import HutchEnvelope, PointMassEnvelope
        >>> HutchEnvelope(projection_dim=4, dim=8).atoms() is None, PointMassEnvelope(2.0).atoms()[0].tolist()
        (True, [2.0])
        """
        point = self.point_mass()
        return None if point is None else (np.array([point]), np.ones(1))

    def support_interval(self, tail: float = 1e-16) -> tuple[float, float]:
        """``(ppf(tail), ppf(1 - tail))``: the range that holds all but ``2 tail`` of the mass.

        Examples
        --------
        >>> from dpmath import HutchEnvelope
        >>> lo, hi = HutchEnvelope(projection_dim=32, dim=2048).support_interval(1e-16)
        >>> round(lo, 4), round(hi, 4)
        (0.0443, 1.046)
        """
        if not 0 < tail < 0.5:
            raise ValueError(f"tail must lie in (0, 0.5), got {tail!r}")
        lo, hi = self.ppf([tail, 1.0 - tail])
        return float(lo), float(hi)


class PointMassEnvelope(Envelope):
    """The trivial envelope ``Y = value`` almost surely (``value = 1``: exact norms, plain DP-SGD).

    Parameters
    ----------
    value : float
        The constant, positive and finite (default 1).

    Examples
    --------
    >>> from dpmath import PointMassEnvelope
    >>> env = PointMassEnvelope()
    >>> env.cdf([0.5, 1.0]).tolist(), float(env.ppf(0.3))
    ([0.0, 1.0], 1.0)
    """

    def __init__(self, value: float = 1.0) -> None:
        v = real_number(value, "value", allow_inf=False)
        if v <= 0:
            raise ValueError(f"value must be positive (> 0), got {value!r}")
        self.value = v

    def __repr__(self) -> str:
        return f"PointMassEnvelope(value={self.value!r})"

    def _parameters(self) -> tuple:
        return (self.value,)

    def _cdf(self, xs: np.ndarray) -> np.ndarray:
        """``1{x >= value}``, vectorized."""
        return np.where(xs >= self.value, 1.0, 0.0)

    def _sf(self, xs: np.ndarray) -> np.ndarray:
        """``1{x < value}``, vectorized."""
        return np.where(xs >= self.value, 0.0, 1.0)

    def _ppf(self, qs: np.ndarray) -> np.ndarray:
        """``value`` for ``q > 0`` and 0 at ``q = 0``."""
        return np.where(qs > 0, self.value, 0.0)

    def point_mass(self) -> float | None:
        """``value``."""
        return self.value


class DiscreteEnvelope(Envelope):
    """``Y`` taking finitely many values: ``values[i]`` with probability ``weights[i]``.

    A mixture of fixed scales ``a = 1 / sqrt(y)``, e.g. truncated Poisson sampling's steps
    (:class:`~dpmath.TruncatedSubsampledGaussian`): scale 1 where the batch was not truncated, 2 where it was.

    Parameters
    ----------
    values : array_like
        Distinct, positive and finite.
    weights : array_like
        Non-negative, summing to 1 (within ``1e-12``; renormalized).

    Examples
    --------
    >>> from dpmath import DiscreteEnvelope
    >>> env = DiscreteEnvelope([0.25, 1.0], [0.1, 0.9])
    >>> env.cdf([0.2, 0.5, 1.0]).tolist(), env.point_mass()
    ([0.0, 0.1, 1.0], None)
    """

    def __init__(self, values: ArrayLike, weights: ArrayLike) -> None:
        y = real_array(values, "values", allow_inf=False).ravel()
        w = real_array(weights, "weights", allow_inf=False).ravel()
        if y.size == 0 or y.shape != w.shape:
            raise ValueError(f"values and weights must be non-empty and of one length, got {y.size} and {w.size}")
        if (y <= 0).any() or np.unique(y).size != y.size:
            raise ValueError("values must be distinct and positive (> 0)")
        if (w < 0).any() or abs(float(w.sum()) - 1.0) > 1e-12:
            raise ValueError(f"weights must be non-negative and sum to 1, got a sum of {float(w.sum())!r}")
        order = np.argsort(y)
        self.values, self.weights = y[order], w[order] / w.sum()

    def __repr__(self) -> str:
        return f"DiscreteEnvelope(values={self.values.tolist()!r}, weights={self.weights.tolist()!r})"

    def _parameters(self) -> tuple:
        return (tuple(self.values.tolist()), tuple(self.weights.tolist()))

    def _cdf(self, xs: np.ndarray) -> np.ndarray:
        """``P(Y <= x)``, vectorized."""
        out = np.concatenate([[0.0], np.cumsum(self.weights)])[np.searchsorted(self.values, xs, side="right")]
        return np.minimum(out, 1.0)

    def _sf(self, xs: np.ndarray) -> np.ndarray:
        """``P(Y > x)``, vectorized."""
        tail = np.concatenate([np.cumsum(self.weights[::-1])[::-1], [0.0]])
        return tail[np.searchsorted(self.values, xs, side="right")]

    def point_mass(self) -> float | None:
        """The value, where there is one; else ``None``."""
        return float(self.values[0]) if self.values.size == 1 else None

    def atoms(self) -> tuple[np.ndarray, np.ndarray]:
        """``(values, weights)``."""
        return self.values.copy(), self.weights.copy()


class ReplacementEnvelope(Envelope):
    r"""The scale of two examples' clipped contributions together, for replacing one example.

    Replacing ``x`` by ``x'`` in a fixed-size batch moves the clipped sum by ``v_x - v_y`` (:class:`~dpmath.
    FixedSizeSubsampledGaussian`), of norm at most ``a_x + a_y`` where each scale ``a = 1/sqrt(Y)`` is bounded by
    ``envelope``; the two are computed with the same projections, so their coupling is unknown.  Whatever it is,
    ``P(a_x + a_y >= s) <= P(a_x >= s/2) + P(a_y >= s/2)``, so ``S = a_x + a_y`` is stochastically below the law
    with that tail (capped at 1).  In ``Y_S = 1/S^2`` this envelope is

    .. math::

        F_S(y) = \min\big(1,\; 2 F(4 y)\big),

    with ``F`` the given envelope's CDF.  For exact norms (``Y = 1``) it is the point mass at ``1/4``: scale 2.

    Parameters
    ----------
    envelope : Envelope
        One example's envelope.

    Examples
    --------
    >>> from dpmath import HutchEnvelope, PointMassEnvelope, ReplacementEnvelope
    >>> ReplacementEnvelope(PointMassEnvelope(1.0)).cdf([0.2, 0.25]).tolist()
    [0.0, 1.0]
    >>> env = HutchEnvelope(projection_dim=16, dim=1000)
    >>> bool(ReplacementEnvelope(env).cdf(0.1) == min(1.0, 2 * env.cdf(0.4)))
    True
    """

    def __init__(self, envelope: Envelope) -> None:
        if not isinstance(envelope, Envelope):
            raise ValueError(f"envelope must be a dpmath Envelope, got {type(envelope).__name__}")
        self.envelope = envelope

    def __repr__(self) -> str:
        return f"ReplacementEnvelope({self.envelope!r})"

    def _parameters(self) -> tuple | None:
        inner = self.envelope._parameters()
        return None if inner is None else (type(self.envelope).__name__, inner)

    def _cdf(self, xs: np.ndarray) -> np.ndarray:
        """``min(1, 2 F(4 x))``, vectorized."""
        return np.minimum(1.0, 2.0 * np.asarray(self.envelope.cdf(4.0 * xs), dtype=np.float64))

    def _sf(self, xs: np.ndarray) -> np.ndarray:
        """``1 - cdf``, vectorized (``max(0, sf(4x) - F(4x))``: exact in the upper tail)."""
        x4 = 4.0 * xs
        return np.maximum(0.0, np.asarray(self.envelope.sf(x4), dtype=np.float64)
                          - np.asarray(self.envelope.cdf(x4), dtype=np.float64))

    def point_mass(self) -> float | None:
        """``point / 4`` when the given envelope is a point mass (the two scales then add exactly)."""
        point = self.envelope.point_mass()
        return None if point is None else point / 4.0

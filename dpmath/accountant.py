r"""What every accountant shares: the neighbouring relation, ``supports`` and the refusal of a mechanism.

An accountant composes :mod:`dpmath.mechanisms` and reads out ``epsilon(delta)``, ``delta(epsilon)`` and the f-DP
trade-off curve, for one :class:`Neighboring` relation.  As dp_accounting's ``PrivacyAccountant`` does for its
events, it says beforehand whether it can account for a mechanism (:meth:`Accountant.supports`), and composing one
it cannot raises :class:`UnsupportedMechanismError`, with the reason, and composes nothing:

.. code-block:: text

    accountant.refusal(mechanism) -> str | None      why not (each accountant's own rules), or None
    accountant.supports(mechanism) -> bool           refusal(mechanism) is None
    accountant.compose(mechanism, count)             UnsupportedMechanismError(refusal) where refused

The two accountants are :class:`~dpmath.PLDAccountant` (both relations, every mechanism of
:data:`~dpmath.mechanisms.MECHANISMS` its analysis covers) and :class:`~dpmath.RDPAccountant` (adding or removing one
example; the Gaussian steps and LAP2).
"""

from __future__ import annotations

import abc
import enum

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["Accountant", "Neighboring", "UnsupportedMechanismError"]


class Neighboring(enum.Enum):
    """The neighbouring relation: what "one example's difference" between two data sets means.

    Public arguments named ``neighboring`` take a member or its value, e.g. ``"replace_one"``; ``Neighboring(value)``
    converts either, and refuses anything else naming the argument and the values allowed.

    Examples
    --------
    >>> from dpmath import Neighboring
    >>> Neighboring("replace_one") is Neighboring.REPLACE_ONE, Neighboring(Neighboring.ADD_OR_REMOVE).value
    (True, 'add_or_remove')
    >>> Neighboring("swap")
    Traceback (most recent call last):
    ...
    ValueError: neighboring must be one of 'add_or_remove', 'replace_one' (or a Neighboring member), got 'swap'
    """

    #: one data set has one example more than the other
    ADD_OR_REMOVE = "add_or_remove"
    #: both have the same size and differ in one example (up to ``2 C`` on a clipped sum)
    REPLACE_ONE = "replace_one"

    @classmethod
    def _missing_(cls, value: object) -> Neighboring:
        # Neighboring(value) is the one conversion at the public boundary: its refusal names the argument
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"neighboring must be one of {allowed} (or a Neighboring member), got {value!r}")


class UnsupportedMechanismError(ValueError):
    """An accountant was asked to compose a mechanism it cannot account for (a ``ValueError``).

    Its message names the mechanism and says why, as :meth:`Accountant.refusal` does; :attr:`mechanism` is the
    mechanism refused.

    Examples
    --------
    >>> from dpmath import HutchEnvelope, RDPAccountant, SubsampledGaussian, UnsupportedMechanismError
    >>> rc = SubsampledGaussian(1.0, 0.01, HutchEnvelope(4, 8))
    >>> try:
    ...     RDPAccountant().compose(rc)
    ... except UnsupportedMechanismError as error:
    ...     print(error.mechanism is rc, isinstance(error, ValueError))
    True True
    """

    def __init__(self, mechanism: object, reason: str) -> None:
        super().__init__(reason)
        self.mechanism = mechanism


class Accountant(abc.ABC):
    """Base class of the accountants: compose mechanisms, then read out epsilon, delta and the trade-off curve.

    A subclass implements :meth:`refusal` (which mechanisms it accounts for, under :attr:`neighboring`), the
    composition and the read-outs; :meth:`supports` and the refusal's error (:meth:`_refuse_unsupported`, called
    first thing by :meth:`compose`) are the same for all.

    Examples
    --------
    >>> from dpmath import Accountant, PLDAccountant, RDPAccountant, ShuffledGaussian
    >>> epoch = ShuffledGaussian(4.0, steps=100)
    >>> [acc.supports(epoch) for acc in (PLDAccountant(neighboring="replace_one"), PLDAccountant(), RDPAccountant())]
    [True, False, False]
    >>> isinstance(RDPAccountant(), Accountant)
    True
    """

    @property
    @abc.abstractmethod
    def neighboring(self) -> Neighboring:
        """The neighbouring relation the accountant's numbers are for (read-only)."""

    @property
    @abc.abstractmethod
    def events(self) -> tuple[tuple[object, int], ...]:
        """The composed ``(mechanism, count)`` pairs, in order."""

    @abc.abstractmethod
    def refusal(self, mechanism: object) -> str | None:
        """Why this accountant cannot account for ``mechanism`` under :attr:`neighboring`, naming it, or ``None``."""

    def supports(self, mechanism: object) -> bool:
        """Whether :meth:`compose` accepts ``mechanism`` (under :attr:`neighboring`), without composing it.

        Examples
        --------
        >>> from dpmath import HutchEnvelope, PLDAccountant, RDPAccountant, SubsampledGaussian
        >>> rc = SubsampledGaussian(1.0, 0.01, HutchEnvelope(4, 8))
        >>> PLDAccountant().supports(rc), RDPAccountant().supports(rc)
        (True, False)
        """
        return self.refusal(mechanism) is None

    def _refuse_unsupported(self, mechanism: object) -> None:
        """Raise :class:`UnsupportedMechanismError` with :meth:`refusal`'s reason where ``mechanism`` is refused."""
        if (reason := self.refusal(mechanism)) is not None:
            raise UnsupportedMechanismError(mechanism, reason)

    @abc.abstractmethod
    def compose(self, mechanism: object, count: int = 1) -> Accountant:
        """Add ``count`` runs of ``mechanism`` (raising :class:`UnsupportedMechanismError` where it is refused, with
        nothing composed); returns the accountant, so calls chain."""

    @abc.abstractmethod
    def epsilon(self, delta: float) -> float:
        """An upper bound on the smallest ``epsilon >= 0`` with ``delta(epsilon) <= delta``."""

    @abc.abstractmethod
    def delta(self, epsilon: float) -> float:
        """An upper bound on ``delta(epsilon)``."""

    @abc.abstractmethod
    def tradeoff(self, alpha: ArrayLike) -> np.ndarray:
        """A lower bound on the f-DP trade-off curve: the smallest false-negative rate at false-positive rate
        ``alpha``."""

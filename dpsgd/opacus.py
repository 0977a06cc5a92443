r"""An Opacus accountant backed by dpmath's PLD accountant: brackets and randomized clipping in Opacus.

Opacus picks its accountant by name (``PrivacyEngine(accountant="rdp")``) from a registry of
``IAccountant`` classes that it constructs without arguments.  :func:`register` adds ours under a
name, with its configuration bound, so one line gives an Opacus user our numbers::

    from dpsgd.opacus import register
    register("dpmath")                                          # DP-SGD, PLD with a [lower, upper] bracket
    engine = opacus.PrivacyEngine(accountant="dpmath")          # make_private_with_epsilon works too

    register("dpmath-hutch", envelope=dpmath.HutchEnvelope(32, 2048))  # DP-SGD-RC's mechanism

:class:`BracketAccountant` keeps Opacus' history format, ``[(noise_multiplier, sample_rate, steps)]``,
so ``opacus.accountants.utils.get_noise_multiplier`` drives it unchanged; ``get_epsilon`` returns the
upper end of the bracket (the number to publish), :meth:`BracketAccountant.get_epsilon_bracket` both.

An ``envelope`` accounts for randomized clipping (each step a
:class:`~dpmath.SubsampledGaussian` with it); that is the mechanism of :mod:`dpsgd`'s estimated-norm
trainer, not of Opacus' own exact clipping, for which it only over-charges.

Requires the ``opacus`` extra.  Nothing in dpsgd imports this module.
"""

from __future__ import annotations

import math
from typing import Any

from opacus.accountants import IAccountant
from opacus.accountants.registry import register_accountant

from dpmath import Bracket, Envelope, PLDAccountant, SubsampledGaussian

__all__ = ["BracketAccountant", "register"]


def _checked_step(noise_multiplier: object, sample_rate: object, where: str) -> tuple[float, float]:
    """``(sigma, q)`` as floats, or ``ValueError`` naming ``where`` and the value unless ``sigma`` is finite and
    positive and ``q`` lies in ``(0, 1]``: the step's mechanism is only defined there, so a value outside is
    refused where it enters the history, not at the first epsilon."""
    try:
        sigma = float(noise_multiplier) if not isinstance(noise_multiplier, bool) else math.nan
    except (TypeError, ValueError):
        sigma = math.nan
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"{where}: noise_multiplier must be finite and positive (> 0), got {noise_multiplier!r}; "
                         f"a step without noise (0) has no finite epsilon, and a negative, infinite or NaN value is "
                         f"not a noise level (check the optimizer's noise_multiplier or the noise scheduler)")
    try:
        q = float(sample_rate) if not isinstance(sample_rate, bool) else math.nan
    except (TypeError, ValueError):
        q = math.nan
    if not 0 < q <= 1:   # NaN fails too
        raise ValueError(f"{where}: sample_rate must lie in (0, 1] (the Poisson sampling probability, expected "
                         f"batch size / dataset size), got {sample_rate!r}")
    return sigma, q


class BracketAccountant(IAccountant):
    r"""Opacus ``IAccountant`` over :class:`dpmath.PLDAccountant` (both neighbouring directions, add or remove).

    Parameters
    ----------
    envelope : dpmath.Envelope, optional
        If given, every step is a :class:`~dpmath.SubsampledGaussian` with this envelope (randomized clipping);
        otherwise one without.
    discretization, bracket_rtol : float
        As in :class:`dpmath.PLDAccountant` (``bracket_rtol``: ``"auto"``, the default bracket, ``None`` or a float).

    Examples
    --------
    >>> from dpsgd.opacus import BracketAccountant
    >>> acc = BracketAccountant()
    >>> for _ in range(100):
    ...     acc.step(noise_multiplier=1.0, sample_rate=0.01)
    >>> acc.history, len(acc)
    ([(1.0, 0.01, 100)], 100)
    >>> round(acc.get_epsilon(delta=1e-5), 3)
    0.718
    """

    def __init__(self, *, envelope: Envelope | None = None, discretization: float = 1e-4,
                 bracket_rtol: float | str | None = "auto") -> None:
        if envelope is not None and not isinstance(envelope, Envelope):
            raise ValueError(f"envelope must be a dpmath Envelope or None, got {type(envelope).__name__}")
        PLDAccountant(discretization, bracket_rtol=bracket_rtol)  # validates both now, not at the first epsilon
        self.history: list[tuple[float, float, int]] = []
        self.envelope = envelope
        self.discretization = discretization
        self.bracket_rtol = bracket_rtol
        self._cached: tuple[tuple, PLDAccountant] | None = None  # (history, its composed accountant)

    @classmethod
    def mechanism(cls) -> str:
        return "dpmath"

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Record one step; consecutive steps with the same parameters share one history entry.

        Raises
        ------
        ValueError
            Unless ``noise_multiplier`` is finite and positive and ``sample_rate`` lies in ``(0, 1]``; nothing
            is recorded then (the first epsilon would otherwise fail, or be asked of a step with no bound).
        """
        noise_multiplier, sample_rate = _checked_step(noise_multiplier, sample_rate, "BracketAccountant.step()")
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            sigma, q, n = self.history[-1]
            self.history[-1] = (sigma, q, n + 1)
        else:
            self.history.append((noise_multiplier, sample_rate, 1))

    def __len__(self) -> int:
        return sum(n for _, _, n in self.history)

    def _accountant(self) -> PLDAccountant:
        # Opacus replaces ``history`` wholesale (get_noise_multiplier) or appends to it (step): the
        # composed accountant is reused while the history is unchanged
        key = tuple(self.history)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        for i, (sigma, q, n) in enumerate(key):   # a history set wholesale (load_state_dict) skipped step()
            _checked_step(sigma, q, f"BracketAccountant.history[{i}]")
            if isinstance(n, bool) or int(n) != n or n < 1:
                raise ValueError(f"BracketAccountant.history[{i}]: the step count must be a positive integer, "
                                 f"got {n!r}")
        acc = PLDAccountant(self.discretization, bracket_rtol=self.bracket_rtol)
        for sigma, q, n in key:
            acc.compose(SubsampledGaussian(sigma, q, self.envelope), int(n))
        self._cached = (key, acc)
        return acc

    def get_epsilon(self, delta: float, **kwargs: Any) -> float:
        """Upper end of the epsilon bracket at ``delta`` (0 before the first step)."""
        return self.get_epsilon_bracket(delta).upper

    def get_epsilon_bracket(self, delta: float) -> Bracket:
        """``(lower, upper)`` epsilon at ``delta``; publish ``upper``."""
        if not self.history:
            return Bracket(0.0, 0.0)
        return Bracket(*self._accountant().epsilon_bracket(delta))


def register(name: str = "dpmath", *, envelope: Envelope | None = None, discretization: float = 1e-4,
             bracket_rtol: float | str | None = "auto") -> type[BracketAccountant]:
    """Register a :class:`BracketAccountant` with this configuration in Opacus under ``name``.

    Opacus constructs registered accountants without arguments, so the configuration is bound in a
    subclass whose ``mechanism()`` is ``name``; registering a name again replaces it.  Returns the class.

    Examples
    --------
    >>> import opacus
    >>> from dpsgd.opacus import register
    >>> cls = register("dpmath")
    >>> opacus.accountants.create_accountant("dpmath").mechanism()
    'dpmath'
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    BracketAccountant(envelope=envelope, discretization=discretization, bracket_rtol=bracket_rtol)  # validate

    class Registered(BracketAccountant):
        def __init__(self) -> None:
            super().__init__(envelope=envelope, discretization=discretization, bracket_rtol=bracket_rtol)

        @classmethod
        def mechanism(cls) -> str:
            return name

    Registered.__name__ = Registered.__qualname__ = f"BracketAccountant[{name}]"
    register_accountant(name, Registered, force=True)
    return Registered

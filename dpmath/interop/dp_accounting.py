r"""dp_accounting interop: a ``DpEvent`` for randomized clipping and an accountant that composes it.

dp_accounting describes what ran as a tree of ``DpEvent`` records and lets accountants refuse what
they cannot account for (``supports``).  This module adds

* :class:`RandomizedClipDpEvent`: one step of the randomized-clipping Gaussian mechanism (noise
  multiplier and the :class:`~dpmath.Envelope` of the squared-norm ratio), to be wrapped in dp_accounting's
  ``PoissonSampledDpEvent`` like a ``GaussianDpEvent``;
* :func:`to_mechanisms` / :func:`to_dp_event`: exact conversions between dp_accounting events and
  :mod:`dpmath.mechanisms` (``GaussianDpEvent`` is :class:`~dpmath.Gaussian`,
  ``PoissonSampledDpEvent(q, GaussianDpEvent(s))`` is :class:`~dpmath.SubsampledGaussian`,
  ``PoissonSampledDpEvent(q, RandomizedClipDpEvent(...))`` is :class:`~dpmath.SubsampledGaussian` with the event's
  envelope (a bare ``RandomizedClipDpEvent`` is that at ``q = 1``),
  ``TruncatedSubsampledGaussianDpEvent`` is :class:`~dpmath.TruncatedSubsampledGaussian`, and
  ``SampledWithoutReplacementDpEvent(N, B, GaussianDpEvent(s))`` is
  :class:`~dpmath.FixedSizeSubsampledGaussian` at noise multiplier ``2 s``: dp_accounting's noise multiplier is
  the noise over the *sensitivity under the relation*, and replacing one example moves a sum clipped to ``C`` by
  up to ``2 C``, so a DP-SGD step with noise ``sigma C`` on fixed-size batches is that event with
  ``s = sigma / 2``.  (Passing ``s = sigma`` there, as for a Poisson event, under-reports epsilon: at
  ``sigma = 1``, ``B / N = 0.01``, 1000 steps, ``delta = 1e-6`` dp_accounting's RDP accountant says 4.02 where two
  neighbouring data sets reach 15.48.)  Anything else raises :class:`UnsupportedEventError`;
* :class:`BracketPLDAccountant`: a dp_accounting ``PrivacyAccountant`` backed by
  :class:`dpmath.PLDAccountant`.  ``get_epsilon`` returns the upper end of our bracket (the number to
  publish) and :meth:`BracketPLDAccountant.epsilon_bracket` both ends.

dp_accounting's ``MixtureOfGaussiansDpEvent`` (sensitivity drawn from a distribution, *not* revealed)
is a different model from the one our accountant uses: the dominating pair of paper 000 reveals the
scale ``a = 1/sqrt(Y)``, which can only cost more privacy.  We do not convert between the two.

Requires the ``dp-accounting`` extra.  Nothing in dpmath imports this module.
"""

from __future__ import annotations

from collections.abc import Callable

import attr
from dp_accounting import dp_event, privacy_accountant

from ..accountant import Neighboring
from ..envelope import Envelope
from ..mechanisms import (
    FixedSizeSubsampledGaussian,
    Gaussian,
    Mechanism,
    SubsampledGaussian,
    TruncatedSubsampledGaussian,
)
from ..pld import PLDAccountant
from ..validation import positive_real

__all__ = ["RandomizedClipDpEvent", "BracketPLDAccountant", "UnsupportedEventError", "to_mechanisms",
           "to_dp_event"]


class UnsupportedEventError(privacy_accountant.UnsupportedEventError, ValueError):
    """A dp_accounting event with no exact counterpart among dpmath's mechanisms (a ``ValueError`` and
    dp_accounting's ``UnsupportedEventError``)."""


@attr.s(frozen=True, slots=True, auto_attribs=True)
class RandomizedClipDpEvent(dp_event.DpEvent):
    r"""One step of the randomized-clipping Gaussian mechanism (DP-SGD-RC, paper 000), unsampled.

    Each contribution is clipped to ``C / sqrt(Y)`` where ``Y`` (estimated over true squared norm, worst
    case over the data) follows ``envelope``; Gaussian noise of standard deviation ``noise_multiplier * C``
    is added.  Wrap it in ``PoissonSampledDpEvent`` for DP-SGD-RC's Poisson batches.

    Attributes
    ----------
    noise_multiplier : float
        Noise standard deviation over ``C``, ``> 0``.
    envelope : dpmath.Envelope
        E.g. ``HutchEnvelope(projection_dim, dim)`` or ``HutchPPEnvelope(projection_dim, dim)``.
    scale_resolution : float
        Relative spacing of the accountant's scale grid (as in :class:`~dpmath.SubsampledGaussian`).

    Examples
    --------
    >>> import dp_accounting
    >>> from dpmath import HutchEnvelope
    >>> from dpmath.interop.dp_accounting import RandomizedClipDpEvent
    >>> step = dp_accounting.PoissonSampledDpEvent(0.01, RandomizedClipDpEvent(1.0, HutchEnvelope(32, 2048)))
    >>> type(step.event).__name__
    'RandomizedClipDpEvent'
    """

    noise_multiplier: float
    envelope: Envelope
    scale_resolution: float = 2e-3

    def __attrs_post_init__(self) -> None:
        positive_real(self.noise_multiplier, "noise_multiplier")
        if not isinstance(self.envelope, Envelope):
            raise ValueError(f"envelope must be a dpmath Envelope, got {type(self.envelope).__name__}")


def _leaves(event: dp_event.DpEvent, count: int) -> list[tuple[Mechanism, int]]:
    """Flatten ``event`` run ``count`` times into ``(mechanism, count)`` pairs (count may be 0), or raise."""
    if isinstance(event, dp_event.NoOpDpEvent):
        return []
    if isinstance(event, dp_event.SelfComposedDpEvent):
        if not isinstance(event.count, int) or event.count < 0:
            raise UnsupportedEventError(f"SelfComposedDpEvent count must be a non-negative int, got {event.count!r}")
        return _leaves(event.event, count * event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        return [pair for sub in event.events for pair in _leaves(sub, count)]
    return [(_leaf(event), count)]  # count 0 is kept: supports() checks with it


def _leaf(event: dp_event.DpEvent) -> Mechanism:
    if isinstance(event, dp_event.GaussianDpEvent):
        return Gaussian(event.noise_multiplier)
    if isinstance(event, RandomizedClipDpEvent):
        return SubsampledGaussian(event.noise_multiplier, 1.0, event.envelope, event.scale_resolution)
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        q, inner = event.sampling_probability, event.event
        if isinstance(inner, dp_event.GaussianDpEvent):
            return SubsampledGaussian(inner.noise_multiplier, q)
        if isinstance(inner, RandomizedClipDpEvent):
            return SubsampledGaussian(inner.noise_multiplier, q, inner.envelope, inner.scale_resolution)
        raise UnsupportedEventError(f"PoissonSampledDpEvent of {type(inner).__name__} is not supported (only of "
                                    "GaussianDpEvent or RandomizedClipDpEvent)")
    if isinstance(event, dp_event.TruncatedSubsampledGaussianDpEvent):
        return TruncatedSubsampledGaussian(event.noise_multiplier, event.sampling_probability,
                                           event.truncated_batch_size, event.dataset_size)
    if isinstance(event, dp_event.SampledWithoutReplacementDpEvent):
        if not isinstance(event.event, dp_event.GaussianDpEvent):
            raise UnsupportedEventError(f"SampledWithoutReplacementDpEvent of {type(event.event).__name__} is not "
                                        "supported (only of GaussianDpEvent)")
        # the event's noise is over the replacement sensitivity 2 C; ours over C
        return FixedSizeSubsampledGaussian(2.0 * event.event.noise_multiplier, event.sample_size,
                                           event.source_dataset_size)
    raise UnsupportedEventError(f"{type(event).__name__} has no exact counterpart in dpmath (supported: "
                                "GaussianDpEvent, RandomizedClipDpEvent, PoissonSampledDpEvent of either, "
                                "TruncatedSubsampledGaussianDpEvent, SampledWithoutReplacementDpEvent of a "
                                "GaussianDpEvent, SelfComposedDpEvent, ComposedDpEvent, NoOpDpEvent)")


def to_mechanisms(event: dp_event.DpEvent) -> list[tuple[Mechanism, int]]:
    """dpmath ``(mechanism, count)`` pairs equivalent to a dp_accounting event (exact, no approximation).

    Raises
    ------
    UnsupportedEventError
        For an event (or sub-event) with no exact counterpart.

    Examples
    --------
    >>> import dp_accounting
    >>> from dpmath.interop.dp_accounting import to_mechanisms
    >>> step = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.1))
    >>> to_mechanisms(dp_accounting.SelfComposedDpEvent(step, 1000))
    [(SubsampledGaussian(noise_multiplier=1.1, sample_rate=0.01), 1000)]
    """
    if not isinstance(event, dp_event.DpEvent):
        raise ValueError(f"event must be a dp_accounting DpEvent, got {type(event).__name__}")
    return [(m, n) for m, n in _leaves(event, 1) if n > 0]


def _poisson_event(mechanism: SubsampledGaussian) -> dp_event.DpEvent:
    """A Poisson step's event: of a ``GaussianDpEvent``, or with randomized clipping a ``RandomizedClipDpEvent``
    (bare at ``q = 1``)."""
    if mechanism.envelope is None:
        return dp_event.PoissonSampledDpEvent(mechanism.sample_rate,
                                              dp_event.GaussianDpEvent(mechanism.noise_multiplier))
    inner = RandomizedClipDpEvent(mechanism.noise_multiplier, mechanism.envelope, mechanism.scale_resolution)
    return inner if mechanism.sample_rate == 1.0 else dp_event.PoissonSampledDpEvent(mechanism.sample_rate, inner)


# the mechanisms with an exact dp_accounting event, and the event (None: not with randomized clipping, which
# dp_accounting's events of a sampling scheme other than Poisson do not describe)
_EVENTS: dict[type[Mechanism], Callable[..., dp_event.DpEvent | None]] = {
    Gaussian: lambda m: dp_event.GaussianDpEvent(m.noise_multiplier),
    SubsampledGaussian: _poisson_event,
    TruncatedSubsampledGaussian: lambda m: None if m.envelope is not None else (
        dp_event.TruncatedSubsampledGaussianDpEvent(m.dataset_size, m.sample_rate, m.max_batch_size,
                                                    m.noise_multiplier)),
    # the event's noise is over the replacement sensitivity 2 C; ours over C
    FixedSizeSubsampledGaussian: lambda m: None if m.envelope is not None else (
        dp_event.SampledWithoutReplacementDpEvent(m.dataset_size, m.batch_size,
                                                  dp_event.GaussianDpEvent(m.noise_multiplier / 2.0))),
}


def to_dp_event(mechanism: Mechanism, count: int = 1) -> dp_event.DpEvent:
    """The dp_accounting event of ``count`` runs of a dpmath mechanism (exact).

    Examples
    --------
    >>> from dpmath import SubsampledGaussian
    >>> from dpmath.interop.dp_accounting import to_dp_event
    >>> to_dp_event(SubsampledGaussian(1.1, 0.01), 1000)  # doctest: +NORMALIZE_WHITESPACE
    SelfComposedDpEvent(event=PoissonSampledDpEvent(sampling_probability=0.01,
        event=GaussianDpEvent(noise_multiplier=1.1)), count=1000)
    """
    convert = _EVENTS.get(type(mechanism))
    event = None if convert is None else convert(mechanism)
    if event is None:
        raise ValueError(f"mechanism must be {', '.join(m.__name__ for m in _EVENTS)} (fixed-size and truncated "
                         f"batches without an envelope), got {type(mechanism).__name__}")
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    return event if count == 1 else dp_event.SelfComposedDpEvent(event, count)


_RELATIONS = {privacy_accountant.NeighboringRelation.ADD_OR_REMOVE_ONE: Neighboring.ADD_OR_REMOVE,
              privacy_accountant.NeighboringRelation.REPLACE_ONE: Neighboring.REPLACE_ONE}


class BracketPLDAccountant(privacy_accountant.PrivacyAccountant):
    r"""A dp_accounting ``PrivacyAccountant`` backed by :class:`dpmath.PLDAccountant`.

    Composes ``GaussianDpEvent``, :class:`RandomizedClipDpEvent`, ``PoissonSampledDpEvent`` of either,
    ``SelfComposedDpEvent``, ``ComposedDpEvent`` and ``NoOpDpEvent``; ``supports`` is False for anything
    else, and ``compose`` then raises dp_accounting's ``UnsupportedEventError`` with nothing composed.
    ``get_epsilon`` / ``get_delta`` return the upper end of our ``[lower, upper]`` bracket.

    Parameters
    ----------
    neighboring_relation : dp_accounting.NeighboringRelation
        ``ADD_OR_REMOVE_ONE`` (default) or ``REPLACE_ONE`` (not with randomized clipping).
    discretization, bracket_rtol : float
        As in :class:`dpmath.PLDAccountant` (``bracket_rtol``: ``"auto"``, the default bracket, ``None`` or a float).

    Examples
    --------
    >>> import dp_accounting
    >>> from dpmath.interop.dp_accounting import BracketPLDAccountant
    >>> step = dp_accounting.PoissonSampledDpEvent(256 / 60000, dp_accounting.GaussianDpEvent(1.1))
    >>> acc = BracketPLDAccountant().compose(dp_accounting.SelfComposedDpEvent(step, 14063))
    >>> round(acc.get_epsilon(1e-5), 2)
    2.38
    """

    def __init__(self, neighboring_relation: privacy_accountant.NeighboringRelation =
                 privacy_accountant.NeighboringRelation.ADD_OR_REMOVE_ONE, *, discretization: float = 1e-4,
                 bracket_rtol: float | str | None = "auto") -> None:
        if neighboring_relation not in _RELATIONS:
            raise ValueError(f"neighboring_relation must be ADD_OR_REMOVE_ONE or REPLACE_ONE, got "
                             f"{neighboring_relation!r}")
        super().__init__(neighboring_relation)
        self._accountant = PLDAccountant(discretization, _RELATIONS[neighboring_relation],
                                         bracket_rtol=bracket_rtol)

    @property
    def accountant(self) -> PLDAccountant:
        """The dpmath accountant holding what was composed (for :meth:`~dpmath.PLDAccountant.tradeoff` etc.)."""
        return self._accountant

    def _maybe_compose(self, event: dp_event.DpEvent, count: int, do_compose: bool
                       ) -> privacy_accountant.PrivacyAccountant.CompositionErrorDetails | None:
        try:
            pairs = _leaves(event, count)
            # the accountant's refusals (PLDAccountant.refusal: replace_one with randomized clipping) and a count
            # beyond its limit come from compose on a scratch accountant, so a refused event leaves this one untouched
            scratch = PLDAccountant(self._accountant.discretization, self._accountant.neighboring)
            for mechanism, n in pairs:
                scratch.compose(mechanism, max(n, 1))
        except ValueError as exc:
            return self.CompositionErrorDetails(invalid_event=event, error_message=str(exc))
        if do_compose:
            for mechanism, n in pairs:
                if n > 0:
                    self._accountant.compose(mechanism, n)
        return None

    def get_epsilon(self, target_delta: float) -> float:
        """Upper end of the epsilon bracket at ``target_delta`` (0 before anything is composed)."""
        return self._accountant.epsilon(target_delta) if self._accountant.events else 0.0

    def get_delta(self, target_epsilon: float) -> float:
        """Upper end of the delta bracket at ``target_epsilon`` (0 before anything is composed)."""
        return self._accountant.delta(target_epsilon) if self._accountant.events else 0.0

    def epsilon_bracket(self, target_delta: float) -> tuple[float, float]:
        """``(lower, upper)`` epsilon at ``target_delta``; publish ``upper``.

        Examples
        --------
        >>> import dp_accounting
        >>> from dpmath.interop.dp_accounting import BracketPLDAccountant
        >>> acc = BracketPLDAccountant().compose(dp_accounting.GaussianDpEvent(1.0), 10)
        >>> lo, hi = acc.epsilon_bracket(1e-5)
        >>> bool(lo <= hi < lo + 1e-3)
        True
        """
        return self._accountant.epsilon_bracket(target_delta) if self._accountant.events else (0.0, 0.0)

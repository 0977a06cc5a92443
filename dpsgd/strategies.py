r"""How the private step clips: each example to l2 norm ``C`` (:class:`L2Clipping`, the default: DP-SGD's), or
twice sampling (paper 002, Alg. 2) and hybrid clipping's coordinate masks and l-infinity bounds.  The objects do
what the step does to the tensors (bounds, groups, masks, noise shape) and describe their mechanism; the run's
accounting, and what no accountant here covers, is :mod:`dpsgd.accounting`'s.

DP-SGD samples examples (Poisson, rate ``q1``: the data loader's ``sample_rate``).  Twice sampling then
forms every *coordinate* of the clipped sum from its own Poisson sub-sample of the batch, of rate ``q2``,
after clipping each example to l2 norm ``C`` and to l-infinity norm ``c_inf``:

.. math::

    s_l = \sum_{i \in B} m_{il}\, \mathrm{clamp}\big(\min(1, C / \|g_i\|_2)\, g_{il}, -c_\infty, c_\infty\big),
    \qquad m_{il} \sim \mathrm{Bernoulli}(q_2)\ \text{independent},

and Gaussian noise of standard deviation ``sigma C`` is added to every coordinate.  Its privacy is
:class:`dpmath.twice_sampling.TwiceSampledGaussian` (eq. 8 of the paper over the coordinate-wise RDP of
Thm 5.2), an RDP bound; ``PrivacyEngine.accountant()`` is then a :class:`dpmath.RDPAccountant`.

:class:`HybridClipping` (Thm 5.6) splits the parameters into groups, orthogonal coordinate subspaces of
ranks ``r_j`` (their sizes).  Group ``j`` is clipped to its own ``(c2_j, c_inf_j)`` and gets noise
``sigma_j`` of the shape of Thm 4.6 (:func:`dpmath.twice_sampling.hybrid_noise`); it is accounted by
:class:`dpmath.twice_sampling.HybridTwiceSampledGaussian`.  :class:`TwiceSampling` is its one-group case.

The masks need every example's gradient coordinate by coordinate, so the step materializes per-example
gradients one parameter at a time (``B x numel`` floats for the largest parameter): exact norms only
(``estimator="exact"`` or ``"ghost"``), in one process.

Examples
--------
>>> from dpsgd.strategies import TwiceSampling
>>> TwiceSampling(coordinate_rate=0.5, max_grad_coordinate=0.05).mechanism(1.0, 0.01, 1.0)
TwiceSampledGaussian(noise_std=1.0, sample_rate=0.01, coordinate_rate=0.5, c2=1.0, c_inf=0.05)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from dpmath.twice_sampling import HybridTwiceSampledGaussian, TwiceSampledGaussian, hybrid_noise

__all__ = ["L2Clipping", "TwiceSampling", "HybridClipping", "masked_clipped_sum"]


def _rate(q2: object) -> float:
    if isinstance(q2, bool) or not isinstance(q2, (int, float)) or not 0.0 < q2 <= 1.0:
        raise ValueError(f"coordinate_rate must be a number in (0, 1], got {q2!r}")
    return float(q2)


def _bound(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def masked_clipped_sum(per_example: torch.Tensor, weights: torch.Tensor, coordinate_bound: float, rate: float,
                       generator: torch.Generator) -> torch.Tensor:
    """``sum_i m_i * clamp(w_i g_i, +-coordinate_bound)`` over the ``(B, m)`` per-example gradients
    ``per_example``, with the l2 clipping factors ``weights`` (``(B,)``, each ``<= 1``) and Bernoulli(``rate``)
    masks ``m_i`` drawn from ``generator`` (none at ``rate = 1``)."""
    clipped = (per_example * weights.to(per_example.dtype)[:, None]).clamp_(-coordinate_bound, coordinate_bound)
    if rate < 1.0:
        keep = torch.rand(clipped.shape, generator=generator, device=clipped.device) < rate
        clipped = clipped * keep.to(clipped.dtype)
    return clipped.sum(0)


class _OneGroup:
    """What the one-group samplings share: every parameter in group 0, one noise level ``sigma C``."""

    def group_of(self, name: str) -> int:
        """Every parameter is in the one group."""
        return 0

    def noise_stds(self, noise_multiplier: float, max_grad_norm: float, ranks: Sequence[int]) -> list[float]:
        """Noise scale of the one group: ``noise_multiplier * C``."""
        return [noise_multiplier * max_grad_norm]

    def check_groups(self, ranks: Sequence[int], max_grad_norm: float) -> None:
        """One group holds every parameter: nothing to check."""
        return None


@dataclass(frozen=True)
class L2Clipping(_OneGroup):
    """Each example's gradient clipped to l2 norm ``C`` (DP-SGD's; ``make_private``'s default): every coordinate
    of every sampled example enters the clipped sum, and the noise decides the mechanism (:mod:`dpsgd.noise`; the
    run's accounting: :class:`dpsgd.accounting.RunAccounting`).

    Examples
    --------
    >>> L2Clipping().bounds(1.0), L2Clipping().per_coordinate
    ([(1.0, 1.0)], False)
    """

    coordinate_rate: ClassVar[float] = 1.0
    per_coordinate: ClassVar[bool] = False   # no coordinate masks: the clipped sums are formed as DP-SGD's

    def bounds(self, max_grad_norm: float) -> list[tuple[float, float]]:
        """``[(C, C)]``: l2 clipping alone."""
        return [(max_grad_norm, max_grad_norm)]


class _CoordinateSampling:
    """What twice sampling and hybrid clipping share: coordinate masks, so exact norms and Gaussian noise (what
    their accounting covers is :data:`dpsgd.accounting.REFUSED`; an RDP bound is all their mechanisms have)."""

    per_coordinate: ClassVar[bool] = True   # the step forms masked per-example sums


@dataclass(frozen=True)
class TwiceSampling(_OneGroup, _CoordinateSampling):
    """Coordinate-wise Poisson sampling of rate ``coordinate_rate`` inside each Poisson batch, with every
    example's gradient clipped to l-infinity norm ``max_grad_coordinate`` after its l2 clipping to ``C``.

    Parameters
    ----------
    coordinate_rate : float
        ``q2``, in ``(0, 1]``: each (example, coordinate) pair enters the sum with this probability.
    max_grad_coordinate : float
        ``c_inf > 0``, in the units of ``max_grad_norm``; at most ``(C / c_inf)^2`` coordinates of a
        clipped example can reach it.  ``c_inf >= C`` is l2 clipping alone.
    """

    coordinate_rate: float
    max_grad_coordinate: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "coordinate_rate", _rate(self.coordinate_rate))
        object.__setattr__(self, "max_grad_coordinate", _bound(self.max_grad_coordinate, "max_grad_coordinate"))

    def bounds(self, max_grad_norm: float) -> list[tuple[float, float]]:
        """``[(c2, c_inf)]`` per group: ``C`` and ``min(c_inf, C)``."""
        return [(max_grad_norm, min(self.max_grad_coordinate, max_grad_norm))]

    def mechanism(self, noise_multiplier: float, sample_rate: float, max_grad_norm: float,
                  ranks: Sequence[int] = (1,)) -> TwiceSampledGaussian:
        """The dpmath mechanism of one step with Gaussian noise and exact norms: noise ``noise_multiplier * C`` per
        coordinate (absolute units, like ``c2 = C`` and ``c_inf``), examples sampled at ``sample_rate``."""
        (c2, c_inf), = self.bounds(max_grad_norm)
        return TwiceSampledGaussian(noise_std=noise_multiplier * max_grad_norm, sample_rate=sample_rate,
                                    coordinate_rate=self.coordinate_rate, c2=c2, c_inf=c_inf)

    def settings(self) -> dict:
        """The ledger's record of these settings (a resumed run must match them)."""
        return {"coordinate_rate": self.coordinate_rate, "max_grad_coordinate": self.max_grad_coordinate}


@dataclass(frozen=True)
class HybridClipping(_CoordinateSampling):
    """Hybrid clipping with twice sampling (paper 002, Thm 5.6): parameter groups, each clipped to its own l2
    and l-infinity bounds, with the noise shape of Thm 4.6.

    Noise: group ``j`` (rank ``r_j``, its number of coordinates) gets standard deviation
    ``sigma_j = noise_multiplier * C * sqrt(R) * s_j``, with ``s_j`` from
    :func:`dpmath.twice_sampling.hybrid_noise` (``sum_j r_j s_j^2 = 1``), ``R = sum_j r_j`` and ``C`` the
    overall bound: the total noise power of isotropic DP-SGD at ``C``, spread as Thm 4.6 prescribes.

    Parameters
    ----------
    groups : mapping of str to (float, float)
        Parameter-name prefix -> ``(c2_j, c_inf_j)``, both ``> 0``.  A parameter belongs to the group of the
        longest prefix its qualified name starts with (``""`` catches the rest); every trainable parameter
        must belong to one, and every group must hold one.  ``make_private``'s ``max_grad_norm`` must be
        the overall bound ``sqrt(sum_j c2_j^2)``.
    coordinate_rate : float
        ``q2`` in ``(0, 1]`` (default 1: hybrid clipping without coordinate sampling).

    Examples
    --------
    >>> from dpsgd.strategies import HybridClipping
    >>> h = HybridClipping({"0.": (0.6, 0.1), "": (0.8, 0.05)})
    >>> h.group_of("0.weight"), h.group_of("2.bias")
    (0, 1)
    """

    groups: Mapping[str, tuple[float, float]]
    coordinate_rate: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.groups, Mapping) or not self.groups:
            raise ValueError(f"groups must be a non-empty mapping of name prefix -> (c2, c_inf), got {self.groups!r}")
        frozen = []
        for prefix, pair in self.groups.items():
            if not isinstance(prefix, str):
                raise ValueError(f"groups' keys must be parameter-name prefixes (str), got {prefix!r}")
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"groups[{prefix!r}] must be a pair (c2, c_inf), got {pair!r}")
            frozen.append((prefix, (_bound(pair[0], f"groups[{prefix!r}] c2"),
                                    _bound(pair[1], f"groups[{prefix!r}] c_inf"))))
        object.__setattr__(self, "groups", tuple(frozen))
        object.__setattr__(self, "coordinate_rate", _rate(self.coordinate_rate))

    def group_of(self, name: str) -> int:
        """Index of the group of the longest prefix of ``name`` (``ValueError`` if none)."""
        matches = [(len(prefix), j) for j, (prefix, _) in enumerate(self.groups) if name.startswith(prefix)]
        if not matches:
            raise ValueError(f"parameter {name!r} matches no prefix of HybridClipping.groups "
                             f"{[p for p, _ in self.groups]}; add one (\"\" catches the rest)")
        return max(matches)[1]

    def overall_norm(self) -> float:
        """``sqrt(sum_j c2_j^2)``: the l2 bound of a whole clipped contribution."""
        return math.sqrt(sum(c2 * c2 for _, (c2, _) in self.groups))

    def check_groups(self, ranks: Sequence[int], max_grad_norm: float) -> None:
        """``ValueError`` unless every group holds a parameter (``ranks``: coordinates per group) and
        ``max_grad_norm`` is the overall bound :meth:`overall_norm`, which the accountant charges."""
        empty = [prefix for (prefix, _), r in zip(self.groups, ranks, strict=True) if r == 0]
        if empty:
            raise ValueError(f"HybridClipping group(s) {empty} hold no trainable parameter")
        overall = self.overall_norm()
        if abs(max_grad_norm - overall) > 1e-9 * overall:
            raise ValueError(f"with HybridClipping, max_grad_norm must be the overall bound sqrt(sum c2_j^2) = "
                             f"{overall!r}, got {max_grad_norm!r}")

    def bounds(self, max_grad_norm: float) -> list[tuple[float, float]]:
        """``[(c2_j, min(c_inf_j, c2_j))]`` per group."""
        return [(c2, min(c_inf, c2)) for _, (c2, c_inf) in self.groups]

    def noise_stds(self, noise_multiplier: float, max_grad_norm: float, ranks: Sequence[int]) -> list[float]:
        """``sigma_j`` per group (see the class docstring)."""
        shape = hybrid_noise([c2 for _, (c2, _) in self.groups], list(ranks))
        return [float(v) for v in noise_multiplier * max_grad_norm * math.sqrt(float(np.sum(ranks))) * shape]

    def mechanism(self, noise_multiplier: float, sample_rate: float, max_grad_norm: float,
                  ranks: Sequence[int] = ()) -> HybridTwiceSampledGaussian:
        """The dpmath mechanism of one step with Gaussian noise and exact norms, for groups of ``ranks``
        coordinates."""
        b = self.bounds(max_grad_norm)
        return HybridTwiceSampledGaussian(tuple(self.noise_stds(noise_multiplier, max_grad_norm, ranks)), sample_rate,
                                          self.coordinate_rate, tuple(c2 for c2, _ in b), tuple(c for _, c in b))

    def settings(self) -> dict:
        """The ledger's record of these settings (a resumed run must match them)."""
        return {"coordinate_rate": self.coordinate_rate, "groups": {p: list(v) for p, v in self.groups}}

r"""Twice sampling (paper 002, Alg. 2) as a part of the private step.

DP-SGD samples examples (Poisson, rate ``q1``: the data loader's ``sample_rate``).  Twice sampling then
forms every *coordinate* of the clipped sum from its own Poisson sub-sample of the batch, of rate ``q2``,
after clipping each example to l2 norm ``C`` and to l-infinity norm ``c_inf``:

.. math::

    s_l = \sum_{i \in B} m_{il}\, \mathrm{clamp}\big(\min(1, C / \|g_i\|_2)\, g_{il}, -c_\infty, c_\infty\big),
    \qquad m_{il} \sim \mathrm{Bernoulli}(q_2)\ \text{independent},

and Gaussian noise of standard deviation ``sigma C`` is added to every coordinate.  Its privacy is
:class:`dpmath.twice_sampling.TwiceSampledGaussian` (eq. 8 of the paper over the coordinate-wise RDP of
Thm 5.2), an RDP bound; ``PrivacyEngine.accountant()`` is then a :class:`dpmath.RDPAccountant`.

The masks need every example's gradient coordinate by coordinate, so the step materializes per-example
gradients one parameter at a time (``B x numel`` floats for the largest parameter): exact norms only
(``estimator="exact"`` or ``"ghost"``), in one process.

Examples
--------
>>> from dpsgd.sampling import TwiceSampling
>>> TwiceSampling(coordinate_rate=0.5, max_grad_coordinate=0.05).mechanism(1.0, 0.01, 1.0)
TwiceSampledGaussian(sigma=1.0, q1=0.01, q2=0.5, c2=1.0, c_inf=0.05)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dpmath.twice_sampling import TwiceSampledGaussian

__all__ = ["TwiceSampling"]


@dataclass(frozen=True)
class TwiceSampling:
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
        q2, c_inf = self.coordinate_rate, self.max_grad_coordinate
        if isinstance(q2, bool) or not isinstance(q2, (int, float)) or not 0.0 < q2 <= 1.0:
            raise ValueError(f"coordinate_rate must be a number in (0, 1], got {q2!r}")
        if (isinstance(c_inf, bool) or not isinstance(c_inf, (int, float)) or not math.isfinite(c_inf)
                or c_inf <= 0):
            raise ValueError(f"max_grad_coordinate must be a finite number > 0, got {c_inf!r}")
        object.__setattr__(self, "coordinate_rate", float(q2))
        object.__setattr__(self, "max_grad_coordinate", float(c_inf))

    def mechanism(self, noise_multiplier: float, sample_rate: float, max_grad_norm: float) -> TwiceSampledGaussian:
        """The dpmath mechanism of one step: noise ``noise_multiplier * C`` per coordinate (absolute units,
        like ``c2 = C`` and ``c_inf``), examples sampled at ``sample_rate``."""
        return TwiceSampledGaussian(sigma=noise_multiplier * max_grad_norm, q1=sample_rate, q2=self.coordinate_rate,
                                    c2=max_grad_norm, c_inf=min(self.max_grad_coordinate, max_grad_norm))

    def clipped_sum(self, per_example: torch.Tensor, weights: torch.Tensor, generator: torch.Generator,
                    margin: float = 0.0) -> torch.Tensor:
        """``sum_i m_i * clamp(w_i g_i, +-c_inf (1 - margin))`` over the ``(B, m)`` per-example gradients
        ``per_example``, with the l2 clipping factors ``weights`` (``(B,)``, each ``<= 1``) and fresh Bernoulli
        masks.  ``margin`` keeps the bound below ``c_inf`` after rounding to the tensors' dtype (float32's
        nearest value to 0.05 is above it)."""
        bound = self.max_grad_coordinate * (1.0 - margin)
        clipped = (per_example * weights.to(per_example.dtype)[:, None]).clamp_(-bound, bound)
        if self.coordinate_rate < 1.0:
            keep = torch.rand(clipped.shape, generator=generator, device=clipped.device) < self.coordinate_rate
            clipped = clipped * keep.to(clipped.dtype)
        return clipped.sum(0)

r"""The privacy-loss-distribution (PLD) accountant, with randomized-clipping mechanisms.

:class:`PLDAccountant` composes :mod:`dpmath.mechanisms` on a grid of privacy losses and reads out
``epsilon(delta)``, ``delta(epsilon)`` and the f-DP trade-off curve, each as an **upper** bound (the
number to publish) and an optimistic **lower** bound.  It is built in layers, one module each, every
layer using only those listed before it:

* :mod:`dpmath.pld.distribution`: a discrete PLD on the grid ``t_j = j h`` and its exact read-out; the
  grid-size limit (:class:`GridTooLargeError`).
* :mod:`dpmath.pld.losses`: the privacy loss of a subsampled-Gaussian pair, its CDFs and its exact masses
  in each interval of a loss grid, for mixtures over scales too.
* :mod:`dpmath.pld.discretize`: those masses placed on grid points, as an upper (connect-the-dots) or a
  lower discrete PLD.
* :mod:`dpmath.pld.compose`: FFT composition under exponential tilts, its floating-point error bounded.
* :mod:`dpmath.pld.two_scale`: the lower end of a single subsampled Gaussian at tiny sampling rates.
* :mod:`dpmath.pld.gaussian`: Gaussian steps alone in closed form, at any noise level (no grid).
* :mod:`dpmath.pld.steps`: one step of each mechanism as upper and lower PLDs, with the envelope's scale
  atoms for randomized clipping.
* :mod:`dpmath.pld.accountant`: :class:`PLDAccountant`, and :func:`published_epsilon`, its epsilon kept process-wide.
* :mod:`dpmath.pld.schedule`: :class:`EpsilonSchedule`, the epsilon of one mechanism at every count up to a
  planned one, the steps built once.
"""

from .accountant import PLDAccountant, published_epsilon
from .distribution import GridTooLargeError
from .schedule import EpsilonSchedule
from .steps import scale_atoms as scale_atoms  # public in dpmath.pld before the split, though not in __all__

__all__ = ["PLDAccountant", "EpsilonSchedule", "GridTooLargeError", "published_epsilon"]

"""Chi-square mixtures ``sum_i w_i chi2(nu_i)`` whose float64 distribution functions are checked against mpmath, by
the tests and by ``benchmarks/chi2mix_accuracy.py``, and the points of their bulk where they are checked."""

from __future__ import annotations

import numpy as np

#: ``(weights, dof)`` of each mixture, ``dof`` an integer for all or one per weight: one or two blocks, blocks of
#: very different degrees of freedom, three distinct weights, the Hutchinson envelope's vertex (``k = 64``)
MIXTURES = [
    ([0.3, 0.7], [1, 1]),
    ([0.2, 0.16], [2, 10]),
    ([0.71, 0.145, 0.145], 1),
    ([0.9 / 32, 0.1 / (2047 * 32)], [32, 2047 * 32]),
    ([1.0 / 64], [64]),
]

#: more of the same kinds whose mpmath reference takes 8 to 16 s each
SLOW_MIXTURES = [
    ([0.5 / 32, 0.5 / (1000 * 32)], [32, 32000]),
    ([0.5, 0.3, 0.2], 1),
    ([0.05, 0.25, 0.7], [3, 1, 2]),
]


def bulk_points(weights, dof) -> np.ndarray:
    """Seven quantiles, from 0.002 to 0.998, of 4000 draws of the mixture (seed 0): points of its bulk."""
    mc = np.random.default_rng(0)
    w = np.asarray(weights, float)
    nu = np.broadcast_to(np.asarray(dof, float), w.shape)
    sample = (w * mc.chisquare(nu, size=(4000, w.size))).sum(axis=1)
    return np.quantile(sample, [0.002, 0.05, 0.3, 0.5, 0.8, 0.97, 0.998])

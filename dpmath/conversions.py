r"""Conversions between privacy descriptions, in one place.

* Renyi DP to ``(epsilon, delta)``: ``"classic"`` (Mironov 2017, Prop. 3)

  .. math:: \varepsilon = \min_\alpha\; \mathrm{rdp}(\alpha) + \frac{\log(1/\delta)}{\alpha - 1},

  and ``"balle"`` (Balle et al. 2020, Thm 21; what Opacus and dp_accounting use)

  .. math:: \varepsilon = \min_\alpha\; \mathrm{rdp}(\alpha) + \log\frac{\alpha-1}{\alpha}
            - \frac{\log\delta + \log\alpha}{\alpha - 1},

  and their inverses for ``delta(epsilon)``.
* A privacy profile ``delta(eps)`` to a lower bound on the trade-off curve: every ``(eps, delta)``
  guarantee gives ``beta(a) >= max(0, 1 - delta - e^eps a, e^-eps (1 - delta - a))``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["rdp_to_epsilon", "rdp_to_delta", "profile_to_tradeoff"]


def rdp_to_epsilon(rdp: np.ndarray, orders: np.ndarray, delta: float, conversion: str = "balle"
                   ) -> tuple[float, float]:
    """``(epsilon, best order)`` from RDP values at ``orders``; epsilon is clipped at 0.

    Examples
    --------
    >>> import numpy as np
    >>> from dpmath.conversions import rdp_to_epsilon
    >>> orders = np.array([2.0, 4.0, 8.0, 16.0, 32.0])
    >>> eps, order = rdp_to_epsilon(orders / 2, orders, 1e-5, "classic")   # Gaussian, sigma = 1
    >>> round(eps, 4), order
    (5.6447, 8.0)
    """
    a = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)
    if conversion == "classic":
        eps = r + math.log(1 / delta) / (a - 1)
    elif conversion == "balle":
        eps = r + np.log1p(-1 / a) - (math.log(delta) + np.log(a)) / (a - 1)
    else:
        raise ValueError(f"conversion must be 'balle' or 'classic', got {conversion!r}")
    eps = np.where(np.isnan(eps), np.inf, eps)
    best = int(np.argmin(eps))
    return max(0.0, float(eps[best])), float(a[best])


def rdp_to_delta(rdp: np.ndarray, orders: np.ndarray, epsilon: float, conversion: str = "balle") -> float:
    """Smallest delta over ``orders`` for which the conversion certifies ``epsilon`` (at most 1).

    Examples
    --------
    >>> import numpy as np
    >>> from dpmath.conversions import rdp_to_delta
    >>> orders = np.array([2.0, 4.0, 8.0, 16.0, 32.0])
    >>> f"{rdp_to_delta(orders / 2, orders, 5.6447, 'classic'):.3e}"
    '1.000e-05'
    """
    a = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)
    log_delta = (a - 1) * (r - epsilon)
    if conversion == "balle":
        log_delta = log_delta + (a - 1) * np.log1p(-1 / a) - np.log(a)
    elif conversion != "classic":
        raise ValueError(f"conversion must be 'balle' or 'classic', got {conversion!r}")
    log_delta = np.where(np.isnan(log_delta), np.inf, log_delta)
    return float(min(1.0, math.exp(min(0.0, float(np.min(log_delta))))))


def profile_to_tradeoff(eps: np.ndarray, deltas: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Lower bound on the trade-off curve at ``alpha`` from a privacy profile sampled at ``eps >= 0``.

    Examples
    --------
    >>> import numpy as np
    >>> from dpmath.conversions import profile_to_tradeoff
    >>> float(profile_to_tradeoff(np.array([0.0]), np.array([0.0]), np.array(0.3)))   # perfect privacy
    0.7
    """
    a = np.asarray(alpha, dtype=np.float64)
    flat = a.ravel()[:, None]
    e = np.asarray(eps, dtype=np.float64)[None, :]
    d = np.asarray(deltas, dtype=np.float64)[None, :]
    with np.errstate(over="ignore"):
        lines = np.maximum(1 - d - np.exp(e) * flat, np.exp(-e) * (1 - d - flat))
    out = np.clip(lines.max(axis=1), 0.0, 1.0).reshape(a.shape)
    return out[()] if out.ndim == 0 else out

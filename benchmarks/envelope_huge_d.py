"""The Hutch envelope at very large d: exactness against its own family, and cost against d.

Run: ``OMP_NUM_THREADS=1 python benchmarks/envelope_huge_d.py``.  For each (k, d) it builds the envelope,
times ``x_plus`` plus 200 middle-region points (median of 3), and scans the heavy-light family at seven
middle-region points: a 20,001-point lam grid (linear and geometric from 1/d) evaluated with
``two_block_cdf`` locates the best member, and 201 points around it are evaluated again by contour inversion
(``dpmath.contour.contour_inversion``, independent of the two-block quadrature, which itself wobbles by
~3e-12 between neighbouring lam at d = 1e9).  ``excess`` is the largest member CDF so found minus the
envelope; before the geometric lam grid it was 3.8e-10 (k = 1, d = 1e6), 5.1e-7 (k = 1, d = 3e7) and 3.4e-9
(k = 32, d = 1e7), measured with two_block_cdf.
"""

from __future__ import annotations

import time

import numpy as np

from dpmath import HutchEnvelope, two_block_cdf
from dpmath.contour import contour_inversion


def excess(env: HutchEnvelope) -> float:
    k, d = env.projection_dim, env.dim
    xs = 1 + (env.x_plus - 1) * np.array([0.01, 0.05, 0.1, 0.3, 0.6, 0.9, 0.99])
    worst = -np.inf
    lam = np.unique(np.concatenate([np.linspace(0, 1, 10001), np.geomspace(1 / d, 1, 10001)]))
    for x, f in zip(xs, env.cdf(xs), strict=True):
        v = two_block_cdf(np.full(lam.size, x), lam, 1, d - 1, k)
        i = int(np.argmax(v))
        fine = np.clip(lam[i] + np.linspace(-1, 1, 201) * (lam[min(i + 1, lam.size - 1)] - lam[max(i - 1, 0)]), 0, 1)
        member = [float(contour_inversion([x], [v / k, (1 - v) / ((d - 1) * k)], [k, (d - 1) * k])[0][0])
                  for v in fine if 0 < v < 1]
        worst = max(worst, max(member) - float(f))
    return worst


def timing(k: int, d: int) -> float:
    runs = []
    for _ in range(3):
        t = time.perf_counter()
        env = HutchEnvelope(k, d)
        env.cdf(1 + (env.x_plus - 1) * np.linspace(0.01, 0.99, 200))
        runs.append(time.perf_counter() - t)
    return float(np.median(runs))


def main() -> None:
    print(f"{'k':>3} {'d':>11} {'x_plus':>18} {'excess':>10} {'seconds':>8}")
    for k, d in ((32, 2048), (1, 10**6), (1, 3 * 10**7), (4, 10**7), (32, 10**7), (32, 10**9)):
        env = HutchEnvelope(k, d)
        print(f"{k:>3} {d:>11} {env.x_plus:>18.12f} {excess(env):>10.1e} {timing(k, d):>8.2f}")


if __name__ == "__main__":
    main()

"""Chi-square mixtures over any spread: time per point and error against mpmath.

Run: ``OMP_NUM_THREADS=1 python benchmarks/chi2mix_spread.py``.  For weights log-uniform over 1, 4, 8
and 12 decades (fixed seed) and 3, 200 and 2000 distinct weights, one degree of freedom each, prints
the float64 time per point (3 points around the mean, median of 5 runs) of ``chi2_mixture_cdf``,
the contour inversion's reported error bound, and the relative error against the mpmath reference at the
mean (20 digits; skipped for 2000 weights, ~3 minutes per point).  The baseline measured in the same
run is the mpmath reference's time per point, so the ratio says what the float64 path saves.
"""

from __future__ import annotations

import time

import numpy as np

from dpmath import chi2_mixture_cdf
from dpmath.contour import contour_inversion


def main() -> None:
    print(f"{'weights':>8} {'decades':>8} {'float64 ms/pt':>14} {'bound/value':>12} {'rel. err vs mpmath':>19} "
          f"{'mpmath s/pt':>12} {'ratio':>8}")
    for m in (3, 200, 2000):
        for decades in (1, 4, 8, 12):
            w = np.sort(10.0 ** -np.random.default_rng(m + decades).uniform(0, decades, m))
            x = np.sum(w) * np.array([0.7, 1.0, 1.4])
            times = []
            for _ in range(5):
                t = time.perf_counter()
                value = chi2_mixture_cdf(x, w, 1)
                times.append(time.perf_counter() - t)
            fast = float(np.median(times)) / x.size
            inv, err = contour_inversion(x, w, 1)
            bound = float(np.max(err / inv))
            if m <= 200:
                t = time.perf_counter()
                ref = float(chi2_mixture_cdf(x[1], w, 1, precision=20))
                slow = time.perf_counter() - t
                rel = abs(float(value[1]) - ref) / ref
                print(f"{m:>8} {decades:>8} {1e3 * fast:>14.2f} {bound:>12.1e} {rel:>19.1e} {slow:>12.2f} "
                      f"{slow / fast:>8.0f}")
            else:
                print(f"{m:>8} {decades:>8} {1e3 * fast:>14.2f} {bound:>12.1e} {'-':>19} {'-':>12} {'-':>8}")


if __name__ == "__main__":
    main()

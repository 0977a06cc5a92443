"""Measure chi2_mixture_cdf / sf float64 against the mpmath reference on the test suite's mixtures.

Run: ``python benchmarks/chi2mix_accuracy.py``.  Prints the largest absolute error in the bulk and the
largest relative error in the left tail (values down to ~1e-280), per mixture and overall.
"""

from __future__ import annotations

import numpy as np

from dpmath import chi2_mixture_cdf, chi2_mixture_sf
from verify.mixtures import MIXTURES, SLOW_MIXTURES, bulk_points

TAIL_MIXTURES = [([0.3, 0.7], [1, 1]), ([0.2, 0.16], [2, 10]), ([0.5, 0.3, 0.2], 1),
                 ([0.05, 0.25, 0.7], [3, 1, 2]), ([0.5 / 32, 0.5 / 96], [32, 96])]


def main() -> None:
    print(f"{'mixture (weights)':>44} {'bulk max |err|':>15}")
    worst = 0.0
    for w, nu in MIXTURES + SLOW_MIXTURES:
        x = bulk_points(w, nu)
        err = max(float(np.max(np.abs(fn(x, w, nu) - np.array(fn(x, w, nu, precision=30), float))))
                  for fn in (chi2_mixture_cdf, chi2_mixture_sf))
        worst = max(worst, err)
        print(f"{str(np.round(w, 6).tolist())[:44]:>44} {err:>15.2e}")
    print(f"{'overall':>44} {worst:>15.2e}\n")
    print(f"{'mixture (weights)':>44} {'tail max rel err':>17} {'smallest cdf':>13}")
    worst = 0.0
    for w, nu in TAIL_MIXTURES:
        total = float(np.sum(np.broadcast_to(np.asarray(nu, float), np.shape(w))))
        x = np.min(w) * 10.0 ** (-np.linspace(0.5, 1.0, 6) * (200.0 / total + 1.0))
        ref = np.array(chi2_mixture_cdf(x, w, nu, precision=40), float)
        keep = ref > 1e-300
        rel = float(np.max(np.abs(chi2_mixture_cdf(x[keep], w, nu) / ref[keep] - 1.0)))
        worst = max(worst, rel)
        print(f"{str(np.round(w, 6).tolist())[:44]:>44} {rel:>17.2e} {ref[keep].min():>13.2e}")
    print(f"{'overall':>44} {worst:>17.2e}")


if __name__ == "__main__":
    main()

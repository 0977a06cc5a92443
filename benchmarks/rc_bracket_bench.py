"""Randomized clipping's refined brackets and calibration, for comparing two checkouts.

Run ``OMP_NUM_THREADS=1 python benchmarks/rc_bracket_bench.py LABEL cal`` and ``... LABEL rc`` from each
checkout in turn (alternate them: the machines are shared and noisy).  ``cal``: ``calibrate_noise_multiplier`` for Hutch
(k = 32, d = 2048) at epsilon 0.7, delta 1e-5, q = 64/1139, 180 steps, cold (the first call in the process)
and warm (median of 2).  ``rc``: for each of three randomized-clipping configurations, the bracket
at ``bracket_rtol=5e-3`` and the default bracket (warm), after one default query has warmed the envelope.
"""

from __future__ import annotations

import statistics
import sys
import time

from dpmath import HutchEnvelope, PLDAccountant, SubsampledGaussian, calibrate_noise_multiplier

CONFIGS = [(0.8, 1e-3, 50000, 1e-6), (0.6, 0.01, 100000, 1e-8), (2.0, 1e-3, 10**6, 1e-9)]


def calibration(label: str) -> None:
    env = HutchEnvelope(32, 2048)
    t = time.perf_counter()
    sigma = calibrate_noise_multiplier(0.7, 1e-5, 64 / 1139, 180, envelope=env)
    cold = time.perf_counter() - t
    warm = []
    for _ in range(2):
        t = time.perf_counter()
        calibrate_noise_multiplier(0.7, 1e-5, 64 / 1139, 180, envelope=env)
        warm.append(time.perf_counter() - t)
    print(label, "cal", f"{sigma:.6f}", f"cold {cold:.2f} warm {statistics.median(warm):.2f}", flush=True)


def brackets(label: str) -> None:
    env = HutchEnvelope(32, 2048)
    out = []
    for sigma, q, steps, delta in CONFIGS:
        m = SubsampledGaussian(sigma, q, env)
        PLDAccountant().compose(m, steps).epsilon_bracket(delta)
        t = time.perf_counter()
        lo, hi = PLDAccountant(bracket_rtol=5e-3).compose(m, steps).epsilon_bracket(delta)
        refined = time.perf_counter() - t
        t = time.perf_counter()
        PLDAccountant().compose(m, steps).epsilon_bracket(delta)
        default = time.perf_counter() - t
        out.append(f"[{lo:.4f},{hi:.4f}] {100 * (hi - lo) / hi:.3f}% {refined:.2f}s default-warm {default:.2f}s")
    print(label, "rc", " | ".join(out), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in ("cal", "rc"):
        sys.exit("usage: rc_bracket_bench.py LABEL {cal,rc}")
    (calibration if sys.argv[2] == "cal" else brackets)(sys.argv[1])

"""The two-scale lower end (``dpmath/pld/two_scale.py``): why the grid's lower end collapses at tiny q, and the
two-scale bound against the referee.

Run ``OMP_NUM_THREADS=1 python benchmarks/two_scale_bench.py`` (about 2 minutes; the referee takes most of it).
Prints (1) one removal step's mean loss, upper and lower, at sigma = 0.5, q = 1e-6 on grids 1e-4, 1e-5 and 1e-6
(the true mean is about 3e-11); (2) for a few (sigma, q, steps, delta), the two-scale lower end, the default upper
end and the referee's enclosure, with the time of each; (3) the bracket at sigma = 1, q = 1e-6, 1000 steps,
delta = 1e-5 with ``discretization=1e-6``, where epsilon is below the default grid's step.
"""

from __future__ import annotations

import time

import numpy as np

from dpmath import PLDAccountant, SubsampledGaussian
from dpmath.pld.steps import step_plds
from dpmath.pld.two_scale import TwoScaleLower
from dpmath.referee import referee_epsilon


def step_means() -> None:
    print("one removal step at sigma = 0.5, q = 1e-6: mean loss of the upper and lower PLDs")
    for h in (1e-4, 1e-5, 1e-6):
        up, lo = step_plds(SubsampledGaussian(0.5, 1e-6), "remove", h, (True, False))
        means = [float(p.pmf @ ((p.start + np.arange(p.pmf.size)) * h)) for p in (up, lo)]
        print(f"  h = {h:g}: upper {means[0]:.3e}, lower {means[1]:.3e} ({means[1] / h:+.3f} h)")


def against_referee() -> None:
    print("two-scale lower end against the referee (h = 1e-4)")
    print("  sigma        q   steps  delta |   two-scale      s |     upper |        referee [low, high]      s | ok")
    for sigma, q, steps, delta in [(2.0, 0.01, 500, 1e-6), (1.0, 1e-3, 2000, 1e-5), (1.0, 1e-4, 10**5, 1e-6)]:
        hi = PLDAccountant().compose(SubsampledGaussian(sigma, q), steps).epsilon(delta)
        t = time.perf_counter()
        low = TwoScaleLower.build(1.0 / sigma, q, steps, 1e-4, 1e-18).epsilon(delta, hi)
        t_low = time.perf_counter() - t
        t = time.perf_counter()
        ref = referee_epsilon([(sigma, q, steps)], delta, guess=hi)
        t_ref = time.perf_counter() - t
        print(f"  {sigma:5g} {q:8g} {steps:7d} {delta:6g} | {low:.9f} {t_low:6.1f} | {hi:.7f} | "
              f"[{ref[0]:.11f}, {ref[1]:.11f}] {t_ref:6.1f} | {low <= ref[0]}")


def below_the_grid() -> None:
    t = time.perf_counter()
    lo, hi = PLDAccountant(discretization=1e-6).compose(SubsampledGaussian(1.0, 1e-6), 1000).epsilon_bracket(1e-5)
    print(f"sigma = 1, q = 1e-6, 1000 steps, delta = 1e-5, discretization 1e-6: [{lo:.5e}, {hi:.5e}] "
          f"in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    step_means()
    against_referee()
    below_the_grid()

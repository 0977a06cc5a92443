"""Whether ``epsilon`` and ``delta`` of one accountant agree, what it costs, and how tight k-of-T allocation is.

Table A1: for the issue's cases and ``--random`` random DP-SGD settings (fixed seed), ``delta(epsilon(d)) / d - 1``
(above 0: the two read-outs contradict each other) and the epsilon query's time, in this checkout and, with
``--compare DIR``, in another (a ``git worktree`` of an earlier commit), each setting in a fresh process per checkout,
alternated.
Table A2: the k-of-T allocation bound (``RandomAllocationGaussian(..., participations=k)``, composed as k epochs of one
participation) against a Monte Carlo delta of the k-of-T pair itself (``verify.allocation.allocation_delta_estimate``,
400,000 draws, fixed seed), and Poisson sampling at rate ``k / T``.

    OMP_NUM_THREADS=1 python benchmarks/agreement_bench.py [--compare DIR] [--random 20]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys

_CHILD = r"""
import json, sys, time
if sys.argv[1] != '-':
    sys.path.insert(0, sys.argv[1])
import dpmath
from dpmath import PLDAccountant, SubsampledGaussian
sigma, q, steps, delta = json.loads(sys.argv[2])
acc = PLDAccountant().compose(SubsampledGaussian(sigma, q), steps)
start = time.perf_counter()
eps = acc.epsilon(delta)
seconds = time.perf_counter() - start
print(json.dumps({"eps": eps, "s": seconds, "excess": acc.delta(eps) / delta - 1, "file": dpmath.__file__}))
"""

ISSUE_CASES = [(2.0, 1e-3, 1, 1e-4), (1.0, 1e-3, 10, 1e-8), (0.5, 0.01, 1000, 1e-8)]


def settings(count: int) -> list[tuple[float, float, int, float]]:
    rng = random.Random(0)
    out = list(ISSUE_CASES)
    for _ in range(count):
        out.append((math.exp(rng.uniform(math.log(0.4), math.log(5))), math.exp(rng.uniform(math.log(1e-4),
                    math.log(0.5))), int(math.exp(rng.uniform(0, math.log(3000)))), 10 ** rng.uniform(-10, -3)))
    return out


def run(checkout: str, setting: tuple) -> dict:
    res = subprocess.run([sys.executable, "-c", _CHILD, checkout, json.dumps(setting)], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if checkout != "-" and not out["file"].startswith(os.path.abspath(checkout)):
        raise RuntimeError(f"imported {out['file']}, not the checkout {checkout}")
    return out


def table_a1(compare: str | None, count: int) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print("Table A1: delta(epsilon(d)) / d - 1 and the epsilon query's seconds (cold, fresh process)")
    print(f"{'sigma':>6s} {'q':>9s} {'steps':>6s} {'delta':>8s} | {'after: excess':>14s} {'s':>6s}"
          + (f" | {'before: excess':>15s} {'s':>6s}" if compare else ""))
    bad, times = [0, 0], [[], []]
    for setting in settings(count):
        rows = [run(here, setting)] + ([run(compare, setting)] if compare else [])
        line = f"{setting[0]:6.3g} {setting[1]:9.3g} {setting[2]:6d} {setting[3]:8.2g}"
        for i, r in enumerate(rows):
            bad[i] += r["excess"] > 0
            times[i].append(r["s"])
            line += f" | {r['excess']:+14.2e} {r['s']:6.2f}"
        print(line, flush=True)
    n = len(times[0])
    print(f"disagreements (excess > 0): after {bad[0]} of {n}" + (f", before {bad[1]} of {n}" if compare else ""))
    if compare:
        ratio = math.exp(sum(math.log(a / b) for a, b in zip(times[0], times[1], strict=True)) / n)
        print(f"epsilon time: after {sum(times[0]):.2f} s, before {sum(times[1]):.2f} s in all; geometric mean "
              f"ratio {ratio:.2f}")


def table_a2() -> None:
    import numpy as np

    from dpmath import PLDAccountant, RandomAllocationGaussian, SubsampledGaussian
    from verify.allocation import allocation_delta_estimate

    eps = np.array([0.25, 0.5, 1.0, 1.5])
    print("\nTable A2: k of T steps, one epoch: our delta (upper end) over a Monte Carlo delta of the k-of-T pair "
          "itself (400,000 draws, seed 3; +- one standard error), and Poisson sampling at k / T")
    print(f"{'sigma':>6s} {'T':>4s} {'k':>3s} {'eps':>5s} | {'Monte Carlo':>22s} {'ours':>9s} {'ours/MC':>8s} "
          f"{'Poisson':>9s}")
    for sigma, t, k in [(1.0, 8, 2), (1.5, 12, 3), (2.0, 20, 4)]:
        est, se = allocation_delta_estimate(sigma, t, eps, 400_000, seed=3, participations=k)
        ours = PLDAccountant().compose(RandomAllocationGaussian(sigma, t, participations=k))
        poisson = PLDAccountant().compose(SubsampledGaussian(sigma, k / t), t)
        for e, m, s in zip(eps, est, se, strict=True):
            hi = ours.delta(float(e))
            print(f"{sigma:6.3g} {t:4d} {k:3d} {e:5.2f} | {m:.5f} +- {s:.5f} {hi:9.5f} {hi / m:8.3f} "
                  f"{poisson.delta(float(e)):9.5f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", metavar="DIR", help="another checkout, alternated with this one")
    parser.add_argument("--random", type=int, default=20, help="random settings after the issue's (default 20)")
    args = parser.parse_args()
    table_a1(args.compare, args.random)
    table_a2()


if __name__ == "__main__":
    main()

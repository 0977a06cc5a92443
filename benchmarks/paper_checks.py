"""Published numbers of papers 002 (twice sampling) and 003 (LAP2) against dpmath.

Prints four tables:
1. paper 002 Sec. 5.3 / Fig. 5: eps at q = 0.005, T = 1e4, delta = 1e-5, c2 = 1, by conversion;
2. paper 002 Table 1: noise-variance ratios (%) of twice sampling vs input-wise sampling at q1 q2;
3. LAP2: the published accountant (Thm III.7, unsound) against the sound Gaussian-domination bound and
   the n -> inf limit of an evenly spread gradient;
4. mu(t) / t of the Laplace mechanism's Gaussian domination.

    python benchmarks/paper_checks.py
"""

import math
import time

import numpy as np

from dpmath import PLDAccountant, SubsampledGaussian, SubsampledL2Laplace
from dpmath.lap2 import LAPLACE_GDP_FACTOR, laplace_gdp_mu, published_epsilon
from dpmath.rdp import RDPAccountant
from dpmath.twice_sampling import CoordinateSampledGaussian, TwiceSampledGaussian
from verify.claims import table1_ratio

ORDERS = np.arange(2, 257)
TABLE1 = {(0.06, 1 / 3): [86.2, 85.4, 82.2, 70.8], (0.04, 1 / 2): [89.4, 88.2, 77.4, 75.1],
          (0.03, 1 / 3): [67.4, 65.9, 53.2, 43.3], (0.02, 1 / 2): [72.8, 71.6, 61.0, 53.5]}
BUDGETS = [(2.0, 1500), (2.5, 2000), (4.0, 2500), (8.0, 5000)]


def eps(mech, steps, conversion, delta=1e-5):
    return RDPAccountant(orders=ORDERS, conversion=conversion).compose(mech, steps).epsilon(delta)


def main() -> None:
    t0 = time.perf_counter()
    print("1. paper 002 Sec. 5.3: q = 0.005, T = 10^4, delta = 1e-5 (paper: input-wise 30.4, twice ~8)")
    print(f"{'sigma':>6} {'conversion':>10} {'input-wise':>10} " + " ".join(
        f"{f'({q1},{q2:.2g}) d0={d0}':>20}" for d0 in (16, 64, 256) for q1, q2 in ((0.01, 0.5), (0.015, 1 / 3))))
    for sigma in (0.45, 0.48, 0.5):
        for conv in ("classic", "balle"):
            row = [eps(CoordinateSampledGaussian(sigma, 0.005), 10_000, conv)]
            row += [eps(TwiceSampledGaussian(sigma, q1, q2, 1.0, 1 / math.sqrt(d0)), 10_000, conv)
                    for d0 in (16, 64, 256) for q1, q2 in ((0.01, 0.5), (0.015, 1 / 3))]
            print(f"{sigma:>6} {conv:>10} " + " ".join(f"{v:>10.2f}" if i == 0 else f"{v:>20.2f}"
                                                        for i, v in enumerate(row)))
    print("\n2. paper 002 Table 1: noise variance ratio (%), d0 = 100, delta = 1e-5; ours (paper)")
    print(f"{'(q1, q2)':>14} {'conversion':>10} " + " ".join(f"{f'eps={e} T={t}':>16}" for e, t in BUDGETS))
    for conv in ("classic", "balle"):
        for (q1, q2), paper in TABLE1.items():
            got = [table1_ratio(q1, q2, e, t, conv) for e, t in BUDGETS]
            print(f"{f'({q1}, {q2:.3g})':>14} {conv:>10} " + " ".join(
                f"{f'{g:.1f} ({p})':>16}" for g, p in zip(got, paper, strict=True)))
    print("\n3. LAP2, delta = 1e-5, C = 1: published (Thm III.7, unsound) vs sound bound vs spread-gradient limit")
    print(f"{'b/C':>5} {'q':>6} {'T':>6} {'n':>7} {'published':>10} {'sound (PLD)':>12} {'sound (RDP)':>12} "
          f"{'n->inf limit':>13}")
    for b, q, steps, n in [(2.0, 0.01, 1000, 1000), (1.0, 0.01, 1000, 1000), (0.5, 0.01, 1000, 1000),
                           (0.5, 0.001, 1000, 10_000), (4.0, 0.01, 10_000, 100_000)]:
        m = SubsampledL2Laplace(b, q)
        pub = published_epsilon(1e-5, q, steps, b, 1.0, n)
        up = PLDAccountant().compose(m, steps).epsilon(1e-5)
        rdp = RDPAccountant().compose(m, steps).epsilon(1e-5)
        clt = PLDAccountant().compose(SubsampledGaussian(b, q), steps).epsilon_bracket(1e-5)[0]
        print(f"{b:>5} {q:>6} {steps:>6} {n:>7} {pub:>10.3f} {up:>12.3f} {rdp:>12.3f} {clt:>13.3f}")
    print(f"\n4. Laplace shift t (noise scales) is dominated by G_mu(t); "
          f"sup mu/t = sqrt(pi/2) = {LAPLACE_GDP_FACTOR:.6f}")
    ts = [1e-4, 1e-2, 0.1, 0.5, 1, 2, 5, 10, 30]
    print("   t     " + " ".join(f"{t:>8g}" for t in ts))
    print("   mu/t  " + " ".join(f"{laplace_gdp_mu(t) / t:>8.5f}" for t in ts))
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

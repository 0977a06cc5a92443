"""Time the Hutch envelope: the (k, d) = (32, 2048) table, growth with d, and the brute-force baseline.

Run: ``python benchmarks/envelope_bench.py``.  Prints three tables.  Times are wall-clock seconds on
this machine, all measured in the same run; the brute force (paper 000, App. B.9: every two-block form
S(i, j, lam) with 1 <= i + j <= d on an n_lam grid, at every middle-region grid point) is timed at small
d and extrapolated with its O(d^2 n_x n_lam) count, since at d = 2048 it would take days.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dpmath import HutchEnvelope, two_block_cdf


def tabulate(k: int, d: int, n_grid: int) -> dict[str, float]:
    t0 = time.perf_counter()
    env = HutchEnvelope(k, d)
    x_plus = env.x_plus
    t1 = time.perf_counter()
    lo, hi = env.support_interval(1e-16)
    grid = np.linspace(lo, hi, n_grid)
    F = env.cdf(grid)
    t2 = time.perf_counter()
    n_mid = int(np.sum((grid > 1.0) & (grid < x_plus)))
    assert np.all(np.diff(F) >= 0)
    return {"x_plus": x_plus, "t_xplus": t1 - t0, "t_table": t2 - t1, "total": t2 - t0, "n_mid": n_mid,
            "lo": lo, "hi": hi}


def brute_force_cost(k: int, d: int, n_x: int, n_lambda: int) -> float:
    """Seconds for the paper's brute force at n_x middle points (measured)."""
    env = HutchEnvelope(k, d)
    xs = np.linspace(1.0, env.x_plus, n_x + 2)[1:-1]
    pairs = [(i, j) for i in range(1, d + 1) for j in range(0, d - i + 1)]
    ii = np.array([p[0] for p in pairs], float)
    jj = np.array([p[1] for p in pairs], float)
    lam = np.linspace(0.0, 1.0, n_lambda)
    t0 = time.perf_counter()
    vals = two_block_cdf(xs[:, None, None], lam[None, None, :], ii[None, :, None], jj[None, :, None], k)
    vals.reshape(n_x, -1).max(axis=1)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--grid", type=int, default=10000)
    parser.add_argument("--quick", action="store_true", help="smaller d sweep")
    args = parser.parse_args()

    print(f"Table 1: Hutch envelope k = 32, d = 2048 on a {args.grid}-point grid over its support")
    r = tabulate(32, 2048, args.grid)
    print(f"  support [{r['lo']:.6f}, {r['hi']:.6f}], x_plus = {r['x_plus']:.9f}, middle-region grid points "
          f"= {r['n_mid']}")
    print(f"  x_plus search {r['t_xplus']:.2f} s + table {r['t_table']:.2f} s = {r['total']:.2f} s "
          f"(target <= 5 s)")
    print()
    print("Table 2: cost against d (k = 32, same grid size)")
    print(f"  {'d':>6} {'x_plus':>14} {'mid pts':>8} {'x_plus s':>9} {'table s':>8} {'total s':>8}")
    ds = (2, 8, 32, 128, 512, 2048) if args.quick else (2, 8, 32, 128, 512, 2048, 8192)
    for d in ds:
        r = tabulate(32, d, args.grid)
        print(f"  {d:>6} {r['x_plus']:>14.9f} {r['n_mid']:>8} {r['t_xplus']:>9.2f} {r['t_table']:>8.2f} "
              f"{r['total']:>8.2f}")
    print()
    print("Table 3: brute force over the full two-block family (n_lam = 101), measured and extrapolated")
    n_lambda = 101
    print(f"  {'d':>6} {'pairs':>8} {'s / middle point':>17}")
    per_unit = []
    for d in (4, 8, 16):
        n_x = 4
        t = brute_force_cost(32, d, n_x, n_lambda)
        pairs = d * (d + 1) // 2  # i >= 1, j >= 0, i + j <= d
        per_unit.append(t / (n_x * pairs * n_lambda))
        print(f"  {d:>6} {pairs:>8} {t / n_x:>17.3f}")
    unit = float(np.median(per_unit))
    pairs_2048 = 2048 * 2049 // 2
    r = tabulate(32, 2048, args.grid)
    t_brute = unit * pairs_2048 * n_lambda * max(r["n_mid"], 1)
    print(f"  d = 2048: {pairs_2048} pairs x {n_lambda} lam x {r['n_mid']} middle points x {unit * 1e6:.1f} us "
          f"= {t_brute:.0f} s (extrapolated; x_plus bisection not included)")
    print(f"  ours: {r['total']:.2f} s including x_plus -> speed-up {t_brute / r['total']:.0f}x")


if __name__ == "__main__":
    main()

"""Command line: ``python -m dpmath envelope --k 32 --d 2048`` prints the envelopes of randomized clipping."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .envelope import HutchEnvelope, HutchPPEnvelope, pessimistic_discretization


def _envelope(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    hutch = HutchEnvelope(args.k, args.d)
    hpp = HutchPPEnvelope(args.k, args.d)
    x_plus = hutch.x_plus
    lo, hi = hutch.support_interval(1e-16)
    grid = np.linspace(lo, hi, args.grid)
    dist = pessimistic_discretization(hutch, grid)
    elapsed = time.perf_counter() - t0
    print(f"Envelope of randomized clipping, k = {args.k} probes, d = {args.d} (widest layer)")
    print(f"  x_minus = 1 (vertex extremal below), x_plus = {x_plus:.10f} (uniform extremal above);")
    print(f"  paper 000's asymptotic x_plus = 1 + 2/(dk) = {1 + 2 / (args.d * args.k):.10f}")
    print(f"  support (1e-16 quantiles): [{lo:.6f}, {hi:.6f}]")
    print()
    print(f"  {'x':>10} {'Hutch F(x)':>14} {'maximizer (i, j, lam)':>26} {'Hutch++ F(x)':>14}")
    for x in (0.5, 0.8, 0.95, 1.0, 0.5 * (1 + x_plus), x_plus, 1.01, 1.05):
        m = hutch.maximizer(x)
        print(f"  {x:>10.6f} {float(hutch.cdf(x)):>14.10f} {str((m.i, m.j, round(m.lam, 6))):>26} "
              f"{float(hpp.cdf(x)):>14.10f}")
    print()
    print(f"  pessimistic discretization on {args.grid} points: mass below grid (charged to delta) = "
          f"{dist.below_mass:.3e}, largest scale a = {dist.scale.max():.4f}")
    print(f"  time: {elapsed:.2f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpmath", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("envelope", help="tabulate the Hutch and Hutch++ envelopes")
    env.add_argument("--k", type=int, default=32, help="projection dimension (default 32)")
    env.add_argument("--d", type=int, default=2048, help="widest layer min(p, d) (default 2048)")
    env.add_argument("--grid", type=int, default=10000, help="grid points for the discretization")
    args = parser.parse_args(argv)
    try:
        return _envelope(args)
    except ValueError as exc:
        parser.error(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())

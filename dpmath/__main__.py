"""Command line for people who only want a number.

* ``python -m dpmath envelope --k 32 --d 2048``: the envelopes of randomized clipping.
* ``python -m dpmath epsilon --sigma 1.1 --q 0.004 --steps 14000 --delta 1e-5 [--estimator hutch --k 32 --d 2048]``:
  the ``[lower, upper]`` bracket of epsilon (publish the upper end).
* ``python -m dpmath sigma --epsilon 0.7 --delta 1e-5 --dataset-size 1139 --batch-size 64 --epochs 10``:
  the smallest noise multiplier whose upper-bound epsilon meets the target, and its bracket.

``--q``/``--steps`` or ``--dataset-size``/``--batch-size``/``--epochs`` (``q = batch/size``,
``steps = epochs * ceil(size/batch)``) describe the sampling.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .calibration import calibrate_noise_multiplier, dpsgd_epsilon_bracket, estimator_envelope
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


def _sampling(args: argparse.Namespace) -> tuple[float, int, str]:
    if args.dataset_size is not None or args.batch_size is not None or args.epochs is not None:
        if None in (args.dataset_size, args.batch_size, args.epochs):
            raise ValueError("--dataset-size, --batch-size and --epochs go together")
        if args.q is not None or args.steps is not None:
            raise ValueError("give either --q/--steps or --dataset-size/--batch-size/--epochs, not both")
        if not 1 <= args.batch_size <= args.dataset_size:
            raise ValueError("--batch-size must lie in [1, dataset-size]")
        if args.epochs < 1:
            raise ValueError("--epochs must be a positive integer (>= 1)")
        q = args.batch_size / args.dataset_size
        steps = args.epochs * -(-args.dataset_size // args.batch_size)
        return q, steps, f"q = {args.batch_size}/{args.dataset_size} = {q:.6g}, steps = {steps}"
    if args.q is None or args.steps is None:
        raise ValueError("give --q and --steps (or --dataset-size, --batch-size and --epochs)")
    return args.q, args.steps, f"q = {args.q:g}, steps = {args.steps}"


def _mechanism_line(args: argparse.Namespace) -> str:
    if args.estimator == "exact":
        return "DP-SGD (exact norms)"
    name = {"hutch": "Hutch", "hutchpp": "Hutch++"}[args.estimator]
    return f"DP-SGD-RC with {name}, k = {args.k} probes, d = {args.d}"


def _epsilon(args: argparse.Namespace) -> int:
    q, steps, sampling = _sampling(args)
    t0 = time.perf_counter()
    lo, hi = dpsgd_epsilon_bracket(args.sigma, q, steps, args.delta, estimator=args.estimator, projection_dim=args.k,
                           dim=args.d, discretization=args.discretization)
    print(f"{_mechanism_line(args)}: sigma = {args.sigma:g}, {sampling}, delta = {args.delta:g}")
    print(f"  epsilon in [{lo:.6f}, {hi:.6f}]   (publish the upper bound {hi:.6f})")
    print(f"  PLD accountant, discretization {args.discretization:g}, add-or-remove neighbours; "
          f"time {time.perf_counter() - t0:.2f} s")
    return 0


def _sigma(args: argparse.Namespace) -> int:
    q, steps, sampling = _sampling(args)
    t0 = time.perf_counter()
    env = estimator_envelope(args.estimator, args.k, args.d)
    sigma = calibrate_noise_multiplier(args.epsilon, args.delta, q, steps, envelope=env,
                                       discretization=args.discretization)
    lo, hi = dpsgd_epsilon_bracket(sigma, q, steps, args.delta, estimator=args.estimator, projection_dim=args.k,
                           dim=args.d, discretization=args.discretization)
    print(f"{_mechanism_line(args)}: target epsilon = {args.epsilon:g}, delta = {args.delta:g}, {sampling}")
    print(f"  noise multiplier sigma = {sigma:.6f}   (epsilon in [{lo:.6f}, {hi:.6f}])")
    print(f"  PLD accountant, discretization {args.discretization:g}; time {time.perf_counter() - t0:.2f} s")
    return 0


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--delta", type=float, required=True, help="delta, in (0, 1)")
    p.add_argument("--q", type=float, help="sampling probability, in (0, 1]")
    p.add_argument("--steps", type=int, help="number of steps")
    p.add_argument("--dataset-size", type=int, help="training-set size (with --batch-size, --epochs)")
    p.add_argument("--batch-size", type=int, help="expected batch size")
    p.add_argument("--epochs", type=int, help="epochs; steps = epochs * ceil(size / batch)")
    p.add_argument("--estimator", choices=["exact", "hutch", "hutchpp"], default="exact",
                   help="per-example norms: exact (DP-SGD) or randomized (DP-SGD-RC)")
    p.add_argument("--k", type=int, default=32, help="projection dimension (default 32)")
    p.add_argument("--d", type=int, default=2048, help="widest layer min(p, d) (default 2048)")
    p.add_argument("--discretization", type=float, default=1e-4, help="PLD grid step (default 1e-4)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpmath", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("envelope", help="tabulate the Hutch and Hutch++ envelopes")
    env.add_argument("--k", type=int, default=32, help="projection dimension (default 32)")
    env.add_argument("--d", type=int, default=2048, help="widest layer min(p, d) (default 2048)")
    env.add_argument("--grid", type=int, default=10000, help="grid points for the discretization")
    eps = sub.add_parser("epsilon", help="epsilon bracket of DP-SGD or DP-SGD-RC")
    eps.add_argument("--sigma", type=float, required=True, help="noise multiplier, > 0")
    _add_common(eps)
    sig = sub.add_parser("sigma", help="calibrate the noise multiplier to a target epsilon")
    sig.add_argument("--epsilon", type=float, required=True, help="target epsilon, > 0")
    _add_common(sig)
    args = parser.parse_args(argv)
    try:
        return {"envelope": _envelope, "epsilon": _epsilon, "sigma": _sigma}[args.command](args)
    except ValueError as exc:
        parser.error(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())

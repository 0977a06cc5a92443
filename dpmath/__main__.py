"""Command line for people who only want a number (``python -m dpmath --help``).

Three subcommands: ``envelope`` tabulates the envelopes of randomized clipping, ``epsilon`` brackets the
epsilon of DP-SGD or DP-SGD-RC, ``noise-multiplier`` calibrates the noise multiplier to a target epsilon.
Options use the Python API's names (``--noise-multiplier``, ``--sample-rate``, ``--projection-dim``,
``--dim``, ...).
"""

from __future__ import annotations

import argparse
import sys
import time
from fractions import Fraction

import numpy as np

from .calibration import calibrate_noise_multiplier, dpsgd_epsilon_bracket, estimator_envelope
from .discretization import pessimistic_discretization
from .hutch import HutchEnvelope, HutchPPEnvelope

PROG = "python -m dpmath"

DESCRIPTION = """\
Numbers of differential privacy for DP-SGD and DP-SGD-RC (randomized clipping).

Run "python -m dpmath SUBCOMMAND --help" for a subcommand's options and an example."""

SAMPLING = """\
The sampling is given either as --sample-rate and --steps, or as --dataset-size, --batch-size and
--epochs (sample rate = batch size / dataset size, steps = epochs * ceil(dataset size / batch size)).
Rates accept fractions (256/60000) and numbers accept exponents (1e-5)."""

DIM_HELP = ("d, the number of chi-square terms of the envelope (required with an estimator; envelope: default 2048). "
            "For a model trained by dpsgd it "
            "is summed over the layers, not taken from the widest one: min(rows, cols) of every weight matrix "
            "whose norm is estimated, plus 1 per estimated bias. \"python -m dpsgd plan\" prints it for a model, "
            "and whether some parts are exact (the trainer then accounts with the hutchpp form)")

PROJECTION_HELP = "k, the number of random projections (probes) of Hutchinson or Hutch++ (default 32)"



def _number(text: str) -> float:
    """A real number on the command line: ``0.004``, ``1e-5`` or a fraction such as ``256/60000``."""
    try:
        return float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"not a number or a fraction: {text!r}") from None
    except OverflowError:
        raise argparse.ArgumentTypeError(f"beyond the largest float (about 1.8e308): {text!r}") from None


def _count(text: str) -> int:
    """A whole number on the command line, also written ``1e4``."""
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        value = None
    if value is None or value.denominator != 1:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)


def _bracket_rtol(text: str) -> float | str | None:
    """``--bracket-rtol``: ``auto`` (the default's budgeted target), ``none`` (the coarse single grid) or a
    relative width such as ``1e-3``."""
    word = text.strip().lower()
    if word in ("auto", "none"):
        return None if word == "none" else "auto"
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"not auto, none or a relative width in (0, 1): {text!r}")
    return value


def _bracket_line(args: argparse.Namespace) -> str:
    """How the bracket was refined, for the output."""
    if args.bracket_rtol is None:
        return "one grid (--bracket-rtol none)"
    if args.bracket_rtol == "auto":
        width = "0.5 %" if getattr(args, "estimator", "exact") != "exact" else "0.1 %"
        return f"bracket refined to {width} within a budget"
    return f"refined to {args.bracket_rtol:g} relative width"


def _dest(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def _add(parser: argparse.ArgumentParser, option: str, kind, metavar: str, help: str, required: bool = False) -> None:
    """Add ``option`` with default ``None`` (whether it was given matters); ``required`` ones are listed so."""
    parser.add_argument(option, type=kind, metavar=metavar, help=help, required=required)


def _envelope_dims(parser: argparse.ArgumentParser, args: argparse.Namespace, estimated: bool) -> None:
    """Refuse ``--projection-dim``/``--dim`` where no envelope uses them (not ``estimated``); else fill in
    their defaults."""
    if not estimated and (args.projection_dim is not None or args.dim is not None):
        parser.error("--projection-dim and --dim describe a norm estimator's envelope: give --estimator hutch or "
                     "hutchpp with them (exact norms, the default, have no envelope)")
    if estimated and args.command != "envelope" and args.dim is None:
        parser.error("--dim is required with --estimator hutch or hutchpp: it is the envelope's dimension D, the "
                     "chi-square terms summed over every estimated weight of the model (python -m dpsgd plan prints "
                     "it), and a guess would give another epsilon")
    args.projection_dim = 32 if args.projection_dim is None else args.projection_dim
    args.dim = 2048 if args.dim is None else args.dim


def _envelope(args: argparse.Namespace) -> int:
    k, d = args.projection_dim, args.dim
    t0 = time.perf_counter()
    hutch = HutchEnvelope(k, d)
    hpp = HutchPPEnvelope(k, d)
    x_plus = hutch.x_plus
    lo, hi = hutch.support_interval(1e-16)
    grid = np.linspace(lo, hi, args.grid)
    dist = pessimistic_discretization(hutch, grid)
    elapsed = time.perf_counter() - t0
    print(f"Envelope of randomized clipping, projection dim k = {k}, dim d = {d} (chi-square terms)")
    print(f"  x_minus = 1 (vertex extremal below), x_plus = {x_plus:.10f} (uniform extremal above);")
    print(f"  (paper 000's Prop. 5.2 asymptote 1 + 2/(dk) = {1 + 2 / (d * k):.10f} is refuted: python -m verify "
          f"--only envelope_claims)")
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
        if args.sample_rate is not None or args.steps is not None:
            raise ValueError("give either --sample-rate/--steps or --dataset-size/--batch-size/--epochs, not both")
        if not 1 <= args.batch_size <= args.dataset_size:
            raise ValueError("--batch-size must lie in [1, dataset-size]")
        if args.epochs < 1:
            raise ValueError("--epochs must be a positive integer (>= 1)")
        q = args.batch_size / args.dataset_size
        steps = args.epochs * -(-args.dataset_size // args.batch_size)
        return q, steps, f"sample rate = {args.batch_size}/{args.dataset_size} = {q:.6g}, steps = {steps}"
    if args.sample_rate is None or args.steps is None:
        raise ValueError("give --sample-rate and --steps (or --dataset-size, --batch-size and --epochs)")
    return args.sample_rate, args.steps, f"sample rate = {args.sample_rate:g}, steps = {args.steps}"


def _mechanism_line(args: argparse.Namespace) -> str:
    if args.estimator == "exact":
        return "DP-SGD (exact norms)"
    name = {"hutch": "Hutch", "hutchpp": "Hutch++"}[args.estimator]
    return f"DP-SGD-RC with {name}, projection dim k = {args.projection_dim}, dim d = {args.dim}"


def _epsilon(args: argparse.Namespace) -> int:
    q, steps, sampling = _sampling(args)
    t0 = time.perf_counter()
    lo, hi = dpsgd_epsilon_bracket(args.noise_multiplier, q, steps, args.delta, estimator=args.estimator,
                                   projection_dim=args.projection_dim, dim=args.dim,
                                   discretization=args.discretization, bracket_rtol=args.bracket_rtol)
    print(f"{_mechanism_line(args)}: noise multiplier = {args.noise_multiplier:g}, {sampling}, "
          f"delta = {args.delta:g}")
    print(f"  epsilon in [{lo:.6f}, {hi:.6f}]   (publish the upper bound {hi:.6f})")
    print(f"  PLD accountant, discretization {args.discretization:g}, {_bracket_line(args)}, add-or-remove "
          f"neighbours; time {time.perf_counter() - t0:.2f} s")
    return 0


def _noise_multiplier(args: argparse.Namespace) -> int:
    q, steps, sampling = _sampling(args)
    t0 = time.perf_counter()
    env = estimator_envelope(args.estimator, args.projection_dim, args.dim)
    sigma = calibrate_noise_multiplier(args.target_epsilon, args.target_delta, q, steps, envelope=env,
                                       discretization=args.discretization, bracket_rtol=args.bracket_rtol)
    lo, hi = dpsgd_epsilon_bracket(sigma, q, steps, args.target_delta, estimator=args.estimator,
                                   projection_dim=args.projection_dim, dim=args.dim,
                                   discretization=args.discretization, bracket_rtol=args.bracket_rtol)
    print(f"{_mechanism_line(args)}: target epsilon = {args.target_epsilon:g}, target delta = "
          f"{args.target_delta:g}, {sampling}")
    print(f"  noise multiplier = {sigma:.6f}   (epsilon in [{lo:.6f}, {hi:.6f}])")
    print(f"  PLD accountant, discretization {args.discretization:g}, {_bracket_line(args)}; "
          f"time {time.perf_counter() - t0:.2f} s")
    return 0


def _add_common(p: argparse.ArgumentParser) -> None:
    _add(p, "--sample-rate", _number, "Q", "q, the sampling probability, in (0, 1], e.g. 256/60000")
    p.add_argument("--steps", type=_count, help="number of steps")
    p.add_argument("--dataset-size", type=_count, help="training-set size (with --batch-size and --epochs)")
    p.add_argument("--batch-size", type=_count, help="expected batch size")
    p.add_argument("--epochs", type=_count, help="epochs; steps = epochs * ceil(dataset size / batch size)")
    p.add_argument("--estimator", choices=["exact", "hutch", "hutchpp"], default="exact",
                   help="per-example norms: exact (DP-SGD, the default) or estimated by hutch or hutchpp "
                        "(DP-SGD-RC, whose envelope --projection-dim and --dim describe)")
    _add(p, "--projection-dim", _count, "K", PROJECTION_HELP + "; only with --estimator hutch or hutchpp")
    _add(p, "--dim", _count, "D", DIM_HELP + "; only with --estimator hutch or hutchpp")
    p.add_argument("--discretization", type=_number, default=1e-4, help="PLD grid step (default 1e-4)")
    p.add_argument("--bracket-rtol", type=_bracket_rtol, default="auto", metavar="{auto,none,WIDTH}",
                   help="how tight the epsilon bracket is: auto (default) refines it to 0.1 %% (0.5 %% with an "
                        "estimator) within about a second; none keeps the coarse single grid; a number such as "
                        "1e-3 refines to that relative width at any cost")


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser and each subcommand's own (for errors about its options)."""
    plain = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, formatter_class=plain)
    sub = parser.add_subparsers(dest="command", required=True, title="subcommands", metavar="SUBCOMMAND")
    env = sub.add_parser(
        "envelope", help="tabulate the Hutch and Hutch++ envelopes of randomized clipping", formatter_class=plain,
        description="Tabulate the Hutch and Hutch++ envelopes of randomized clipping for k projections and "
                    "d chi-square terms,\nand the pessimistic discretization the accountant uses.",
        epilog="example:\n  python -m dpmath envelope --projection-dim 32 --dim 2048")
    _add(env, "--projection-dim", _count, "K", PROJECTION_HELP)
    _add(env, "--dim", _count, "D", DIM_HELP)
    env.add_argument("--grid", type=_count, default=10000, help="grid points for the discretization (default 10000)")
    eps = sub.add_parser(
        "epsilon", help="the [lower, upper] bracket of epsilon of DP-SGD or DP-SGD-RC (publish the upper end)",
        formatter_class=plain,
        description="The [lower, upper] bracket of epsilon at --delta of DP-SGD, or of DP-SGD-RC with "
                    "--estimator hutch\nor hutchpp; publish the upper end.\n\n" + SAMPLING,
        epilog="examples:\n"
               "  python -m dpmath epsilon --noise-multiplier 1.1 --sample-rate 256/60000 --steps 14000 "
               "--delta 1e-5\n"
               "  python -m dpmath epsilon --noise-multiplier 4.073 --dataset-size 1139 --batch-size 64 --epochs 10 "
               "--delta 1e-5 --estimator hutch --projection-dim 32 --dim 2048")
    _add(eps, "--noise-multiplier", _number, "SIGMA", "sigma, the noise standard deviation over the clipping norm, > 0",
         required=True)
    _add(eps, "--delta", _number, "DELTA", "delta, in (0, 1)", required=True)
    _add_common(eps)
    cal = sub.add_parser(
        "noise-multiplier", formatter_class=plain,
        help="the smallest noise multiplier whose epsilon meets a target",
        description="The smallest noise multiplier whose upper-bound epsilon at --target-delta meets "
                    "--target-epsilon,\nand its epsilon bracket.\n\n" + SAMPLING,
        epilog="example:\n  python -m dpmath noise-multiplier --target-epsilon 0.7 --target-delta 1e-5 "
               "--dataset-size 1139 --batch-size 64 --epochs 10")
    _add(cal, "--target-epsilon", _number, "EPSILON", "the privacy budget epsilon, > 0", required=True)
    _add(cal, "--target-delta", _number, "DELTA", "delta, in (0, 1)", required=True)
    _add_common(cal)
    return parser, {"envelope": env, "epsilon": eps, "noise-multiplier": cal}


def main(argv: list[str] | None = None) -> int:
    parser, subparsers = _parser()
    args = parser.parse_args(argv)
    sub = subparsers[args.command]
    _envelope_dims(sub, args, args.command == "envelope" or args.estimator != "exact")
    try:
        return {"envelope": _envelope, "epsilon": _epsilon, "noise-multiplier": _noise_multiplier}[args.command](args)
    except ValueError as exc:
        sub.error(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Randomized clipping's heavy tails read two ways: split at their large losses, and cut.

Table S1: random Hutch settings (fixed seed), each composed on one grid (loss step 1e-3, scale factor 0.5) and read
once with the steps split at their large losses (:class:`dpmath.pld.compose.OneLargeLoss`, the one-large-loss terms
exact) and once cut (:func:`dpmath.pld.compose.truncated`).  Both are valid brackets of the same grid's steps, so
neither lower end may pass the other's upper end ("holds"); the split's width over the cut's shows what the exact
terms buy.  Table S2: ``delta(epsilon(d)) <= d`` at the sweep's far-tail rows (an epsilon far out in the tail, read
on a grid 64 times coarser than the first), with both queries' times.

    OMP_NUM_THREADS=1 python benchmarks/split_bench.py [--settings 28] [--seed 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dpmath import HutchEnvelope, PLDAccountant, SubsampledGaussian
from dpmath.pld.distribution import GridTooLargeError

FAR_ROWS = [   # (sigma, q, Hutch k, d, steps, delta): benchmarks/dpmath_widths.py --sweep 12 --seed 1's rows
    (0.9989453463441592, 0.010494010094203959, 4, 256, 51, 3.846136106005523e-08),
    (2.2105926300755847, 0.001786275298658882, 8, 1024, 1495, 6.098001690972707e-09),
]


def split_and_cut(rng: np.random.Generator) -> tuple[str, list[float | None]] | None:
    """One random setting's ``(label, [split lower, split upper, cut lower, cut upper])`` (``None``: that reading does
    not apply), or ``None`` where the grid does not fit."""
    k, d = int(rng.choice([4, 8, 16, 32])), int(rng.choice([16, 64, 256, 1024]))
    sigma, q = float(np.exp(rng.uniform(np.log(0.6), np.log(3)))), float(10 ** rng.uniform(-3, -1))
    steps, delta = int(10 ** rng.uniform(1, 3.3)), float(10 ** rng.uniform(-9, -4))
    label = f"Hutch k {k}, d {d}; σ {sigma:.3f}, q {q:.3g}, {steps} steps, δ {delta:.2g}"
    acc = PLDAccountant().compose(SubsampledGaussian(sigma, q, HutchEnvelope(k, d)), steps)
    try:
        comps = [acc._composed(b, 1e-3, 0.5, (0,), (True, False))[0] for b in (False, True)]
    except GridTooLargeError:
        return None
    ends: list[float | None] = []
    for read in ("split", "cut"):
        for comp in comps:
            other = comp._split(delta) if read == "split" else comp._cut(delta)
            ends.append(None if other is None or other is comp else other.epsilon(delta))
    return label, ends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", type=int, default=28)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print("Table S1: split and cut readings of one grid\n")
    print("| setting | split | cut | holds | split width / cut width - 1 | s |\n|---|---|---|---|---|---|")
    held = True
    for _ in range(args.settings):
        start = time.perf_counter()
        row = split_and_cut(rng)
        if row is None:
            continue
        label, (s_lo, s_hi, c_lo, c_hi) = row
        lows = [v for v in (s_lo, c_lo) if v is not None]
        ups = [v for v in (s_hi, c_hi) if v is not None]
        ok = not lows or not ups or max(lows) <= min(ups)
        held &= ok
        both = None not in (s_lo, s_hi, c_lo, c_hi) and c_hi > c_lo
        ratio = f"{(s_hi - s_lo) / (c_hi - c_lo) - 1:+.2e}" if both else "-"
        fmt = lambda lo, hi: "-" if lo is None else f"[{lo:.8g}, {hi:.8g}]"   # noqa: E731
        print(f"| {label} | {fmt(s_lo, s_hi)} | {fmt(c_lo, c_hi)} | {'yes' if ok else 'NO'} | {ratio} | "
              f"{time.perf_counter() - start:.1f} |", flush=True)
    print(f"\nevery reading holds the other: {held}\n")
    print("Table S2: delta(epsilon(d)) <= d at the far-tail rows\n")
    print("| setting | epsilon | delta(epsilon) / d - 1 | epsilon s | delta s |\n|---|---|---|---|---|")
    for sigma, q, k, d, steps, delta in FAR_ROWS:
        acc = PLDAccountant().compose(SubsampledGaussian(sigma, q, HutchEnvelope(k, d)), steps)
        start = time.perf_counter()
        eps = acc.epsilon(delta)
        mid = time.perf_counter()
        back = acc.delta(eps)
        print(f"| Hutch k {k}, d {d}; σ {sigma:.3f}, q {q:.3g}, {steps} steps, δ {delta:.2g} | {eps:.10g} | "
              f"{back / delta - 1:+.3e} | {mid - start:.1f} | {time.perf_counter() - mid:.1f} |", flush=True)


if __name__ == "__main__":
    main()

"""Default brackets of every mechanism family: width, time and peak memory, before and after.

Each row is one accounting call, ``PLDAccountant(...).compose(mechanism, count).epsilon_bracket(delta)`` (the
default ``bracket_rtol="auto"`` unless the row says otherwise), run in a fresh Python process so that its time is
cold and its peak RSS (``resource.getrusage``) its own.  ``--compare DIR`` runs the same rows with another checkout's
``dpmath`` (a ``git worktree`` of the commit before a change), alternated with this one's, so both columns come from
one run on one machine; a row the other checkout cannot express (a newer argument) is left empty there.  A row that
runs past ``--timeout`` seconds is shown as such.

Families: DP-SGD (the Poisson-subsampled Gaussian), randomized clipping (an envelope on it), random allocation
(balls in bins, one and ``k`` participations), fixed-size batches, truncated Poisson batches, and the cost rows
(a float ``bracket_rtol``, tiny noise).

    OMP_NUM_THREADS=1 python benchmarks/dpmath_widths.py [--compare DIR] [--families rc alloc ...] [--timeout S]
        [--warm]   # also the same call again on a new accountant in the same process
    OMP_NUM_THREADS=1 python benchmarks/dpmath_widths.py --sweep 25 --seed 1 [--compare DIR]   # random settings
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# (family, label, python expression of (mechanism, count, delta, accountant keyword arguments)); names come from
# dpmath's top level
ROWS: list[tuple[str, str, str]] = [
    ("dpsgd", "σ 0.3, q 1e-4, 10⁴ steps, δ 1e-12", "SubsampledGaussian(0.3, 1e-4), 10**4, 1e-12, {}"),
    ("dpsgd", "σ 1.1, q 0.00427, 14063 steps, δ 1e-5", "SubsampledGaussian(1.1, 256 / 60000), 14063, 1e-5, {}"),
    ("dpsgd", "σ 0.8, q 1e-3, 5·10⁴ steps, δ 1e-6", "SubsampledGaussian(0.8, 1e-3), 50000, 1e-6, {}"),
    ("dpsgd", "σ 0.6, q 0.01, 10⁵ steps, δ 1e-8", "SubsampledGaussian(0.6, 0.01), 10**5, 1e-8, {}"),
    ("dpsgd", "σ 2, q 1e-3, 10⁶ steps, δ 1e-9", "SubsampledGaussian(2.0, 1e-3), 10**6, 1e-9, {}"),
    ("dpsgd", "σ 1, q 1e-3, 10⁶ steps, δ 1e-10", "SubsampledGaussian(1.0, 1e-3), 10**6, 1e-10, {}"),
    ("rc", "Hutch k 2, d 5; σ 0.97, q 0.111, 1 step, δ 2.51e-6",
     "SubsampledGaussian(0.97, 0.111, HutchEnvelope(2, 5)), 1, 2.51e-6, {}"),
    ("rc", "Hutch k 8, d 200; σ 0.8, q 0.3, 1 step, δ 1e-8",
     "SubsampledGaussian(0.8, 0.3, HutchEnvelope(8, 200)), 1, 1e-8, {}"),
    ("rc", "Hutch k 4, d 8; σ 3, q 0.1, 1 step, δ 1e-6",
     "SubsampledGaussian(3.0, 0.1, HutchEnvelope(4, 8)), 1, 1e-6, {}"),
    ("rc", "Hutch k 32, d 2048; σ 1, q 0.05, 1 step, δ 1e-6",
     "SubsampledGaussian(1.0, 0.05, HutchEnvelope(32, 2048)), 1, 1e-6, {}"),
    ("rc", "Hutch k 32, d 2048; σ 0.8, q 1e-3, 5·10⁴ steps, δ 1e-6",
     "SubsampledGaussian(0.8, 1e-3, HutchEnvelope(32, 2048)), 50000, 1e-6, {}"),
    ("rc", "Hutch k 32, d 2048; σ 2, q 1e-3, 10⁶ steps, δ 1e-9",
     "SubsampledGaussian(2.0, 1e-3, HutchEnvelope(32, 2048)), 10**6, 1e-9, {}"),
    ("rc", "Hutch++ k 32, d 616; σ 1.015, q 0.032, 96 steps, δ 1e-5",
     "SubsampledGaussian(1.01514, 0.032, HutchPPEnvelope(32, 616)), 96, 1e-5, {}"),
    ("alloc", "σ 0.35, 200 steps, 5 epochs, δ 1e-6", "RandomAllocationGaussian(0.35, 200), 5, 1e-6, {}"),
    ("alloc", "σ 0.3, 100 steps, 1 epoch, δ 1e-5", "RandomAllocationGaussian(0.3, 100), 1, 1e-5, {}"),
    ("alloc", "σ 0.3, 1000 steps, 1 epoch, δ 1e-5", "RandomAllocationGaussian(0.3, 1000), 1, 1e-5, {}"),
    ("alloc", "σ 0.4, 1000 steps, 10 epochs, δ 1e-5", "RandomAllocationGaussian(0.4, 1000), 10, 1e-5, {}"),
    ("alloc", "σ 0.45, 500 steps, 1 epoch, δ 1e-6", "RandomAllocationGaussian(0.45, 500), 1, 1e-6, {}"),
    ("alloc", "σ 0.8, 4000 steps, 10 epochs, δ 1e-5", "RandomAllocationGaussian(0.8, 4000), 10, 1e-5, {}"),
    ("alloc", "σ 1, 20000 steps, 1 epoch, δ 1e-5", "RandomAllocationGaussian(1.0, 20000), 1, 1e-5, {}"),
    ("alloc", "σ 2, 10⁵ steps, 1 epoch, δ 1e-5", "RandomAllocationGaussian(2.0, 100000), 1, 1e-5, {}"),
    ("alloc", "σ 0.5, 10⁵ steps, 1 epoch, δ 1e-5", "RandomAllocationGaussian(0.5, 100000), 1, 1e-5, {}"),
    ("alloc", "σ 0.8, 10⁵ steps, 1 epoch, δ 1e-5", "RandomAllocationGaussian(0.8, 100000), 1, 1e-5, {}"),
    ("alloc", "σ 1, 10⁵ steps, 1 epoch, δ 1e-5", "RandomAllocationGaussian(1.0, 100000), 1, 1e-5, {}"),
    ("alloc", "σ 1, 100 steps, 3 epochs, δ 1e-6", "RandomAllocationGaussian(1.0, 100), 3, 1e-6, {}"),
    ("alloc", "σ 2, 50 steps, 9 epochs, δ 1e-6", "RandomAllocationGaussian(2.0, 50), 9, 1e-6, {}"),
    ("alloc", "k 2 of 100 steps; σ 1, 5 epochs, δ 1e-5",
     "RandomAllocationGaussian(1.0, 100, participations=2), 5, 1e-5, {}"),
    ("alloc", "k 4 of 1000 steps; σ 2, 3 epochs, δ 1e-6",
     "RandomAllocationGaussian(2.0, 1000, participations=4), 3, 1e-6, {}"),
    ("fixed", "batch 256 of 60000; σ 1.1, 14063 steps, δ 1e-5 (replace one)",
     "FixedSizeSubsampledGaussian(1.1, 256, 60000), 14063, 1e-5, {'neighboring': 'replace_one'}"),
    ("fixed", "batch 100 of 10⁴; σ 2, 5000 steps, δ 1e-6 (replace one)",
     "FixedSizeSubsampledGaussian(2.0, 100, 10**4), 5000, 1e-6, {'neighboring': 'replace_one'}"),
    ("truncated", "q 0.01, cap 150 of 10⁴; σ 1, 3000 steps, δ 1e-5",
     "TruncatedSubsampledGaussian(1.0, 0.01, 150, 10**4), 3000, 1e-5, {}"),
    ("truncated", "Hutch k 16, d 64; q 0.01, cap 60 of 2000; σ 2, 50 steps, δ 1e-5",
     "TruncatedSubsampledGaussian(2.0, 0.01, 60, 2000, HutchEnvelope(16, 64)), 50, 1e-5, {}"),
    ("cost", "bracket_rtol 1e-3; σ 0.5, q 1e-6, 10⁴ steps, δ 1e-9",
     "SubsampledGaussian(0.5, 1e-6), 10**4, 1e-9, {'bracket_rtol': 1e-3}"),
    ("cost", "bracket_rtol 1e-4; σ 0.5, q 1e-6, 10⁴ steps, δ 1e-9",
     "SubsampledGaussian(0.5, 1e-6), 10**4, 1e-9, {'bracket_rtol': 1e-4}"),
    ("cost", "random allocation σ 0.05, 10 steps, 1 epoch, δ 1e-5", "RandomAllocationGaussian(0.05, 10), 1, 1e-5, {}"),
]

_CHILD = r"""
import json, resource, sys, time
if sys.argv[1] != '-':
    sys.path.insert(0, sys.argv[1])
import dpmath
from dpmath import *   # noqa: F403  (the row's expression names the mechanisms)
try:
    mechanism, count, delta, kwargs = eval(sys.argv[2])
except TypeError as exc:   # an argument this checkout does not have
    print(json.dumps({"skip": str(exc)}))
    sys.exit(0)
start = time.perf_counter()
try:
    lo, hi = PLDAccountant(**kwargs).compose(mechanism, count).epsilon_bracket(delta)
    out = {"lo": lo, "hi": hi}
except Exception as exc:   # a typed refusal is a result too
    out = {"error": f"{type(exc).__name__}: {str(exc)[:90]}"}
out["s"] = time.perf_counter() - start
out["mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
if sys.argv[3] == "warm" and "error" not in out:   # the same call on a new accountant: the module caches warm
    start = time.perf_counter()
    PLDAccountant(**kwargs).compose(mechanism, count).epsilon_bracket(delta)
    out["warm"] = time.perf_counter() - start
out["file"] = dpmath.__file__
print(json.dumps(out))
"""


def run(row: str, checkout: str, timeout: float, warm: bool = False) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        res = subprocess.run([sys.executable, "-c", _CHILD, checkout, row, "warm" if warm else "cold"],
                             capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"timeout": timeout}
    if res.returncode:
        return {"error": res.stderr.strip().splitlines()[-1][:90]}
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if "file" in out and not out["file"].startswith(os.path.abspath(checkout)):
        raise RuntimeError(f"the row imported {out['file']}, not the checkout {checkout}")
    return out


def cell(r: dict | None) -> str:
    if r is None:
        return "|  |  |  |"
    if "skip" in r:
        return "| (not expressible) |  |  |"
    if "timeout" in r:
        return f"| over {r['timeout']:.0f} s |  |  |"
    if "error" in r:
        return f"| {r['error']} | {r.get('s', 0):.1f} s | {r.get('mb', 0):.0f} MB |"
    lo, hi = r["lo"], r["hi"]
    width = (hi - lo) / hi * 100 if 0 < hi < float("inf") else float("nan")
    warm = f" (warm {r['warm']:.1f} s)" if "warm" in r else ""
    return f"| [{lo:.6g}, {hi:.6g}] {width:.3g} % | {r['s']:.1f} s{warm} | {r['mb']:.0f} MB |"


def sweep(count: int, seed: int) -> list[tuple[str, str, str]]:
    """``count`` random DP-SGD and ``count`` random randomized-clipping (Hutch) rows, from ``seed``: off the table,
    where the default's targets are checked beyond the configurations it was tuned on."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        sigma = float(np.exp(rng.uniform(np.log(0.3), np.log(3))))
        q = float(10 ** rng.uniform(-5, -1))
        if rng.random() < 0.5:   # the round sample rates users pick, where a grid can resonate with q
            q = float(rng.choice([1e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 1e-2, 0.02, 0.05]))
        n, delta = int(10 ** rng.uniform(1, 5.5)), float(10 ** rng.uniform(-12, -4))
        rows.append(("dpsgd", f"σ {sigma:.3f}, q {q:.3g}, {n} steps, δ {delta:.2g}",
                     f"SubsampledGaussian({sigma!r}, {q!r}), {n}, {delta!r}, {{}}"))
    for _ in range(count):
        k, d = int(rng.choice([4, 8, 16, 32, 64])), int(rng.choice([64, 256, 1024, 2048]))
        sigma, q = float(np.exp(rng.uniform(np.log(0.6), np.log(3)))), float(10 ** rng.uniform(-3.5, -1.3))
        n, delta = int(10 ** rng.uniform(1, 5)), float(10 ** rng.uniform(-9, -5))
        rows.append(("rc", f"Hutch k {k}, d {d}; σ {sigma:.3f}, q {q:.3g}, {n} steps, δ {delta:.2g}",
                     f"SubsampledGaussian({sigma!r}, {q!r}, HutchEnvelope({k}, {d})), {n}, {delta!r}, {{}}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", metavar="DIR", help="another checkout, run alternated with this one")
    parser.add_argument("--families", nargs="*", help="only these families (dpsgd rc alloc fixed truncated cost)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per call (default 300)")
    parser.add_argument("--sweep", type=int, metavar="N", help="instead of the table: N random DP-SGD and N random "
                        "randomized-clipping rows")
    parser.add_argument("--seed", type=int, default=0, help="the sweep's seed (default 0)")
    parser.add_argument("--warm", action="store_true", help="also time the same call again in the same process, on a "
                        "new accountant (the module-level caches warm: random allocation's epoch laws)")
    args = parser.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = sweep(args.sweep, args.seed) if args.sweep else ROWS
    rows = [r for r in rows if not args.families or r[0] in args.families]
    head = "| family | configuration | after: bracket, width | s | peak |"
    if args.compare:
        head += " before: bracket, width | s | peak |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for family, label, expr in rows:
        after = run(expr, here, args.timeout, args.warm)
        before = run(expr, args.compare, args.timeout, args.warm) if args.compare else None
        line = f"| {family} | {label} {cell(after)}"
        if args.compare:
            line += cell(before)[1:]
        print(line, flush=True)


if __name__ == "__main__":
    main()

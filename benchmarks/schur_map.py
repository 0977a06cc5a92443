"""Where is g_t(lam) = P(X(lam) <= t) Schur-convex or Schur-concave?  (paper 000, Props. B.11, B.12)

X(lam) = sum_i lam_i chi2_k / k on the simplex.  The paper says g_1 is Schur-convex (Prop. B.12) and g_t
Schur-concave for t >= 2 (Prop. B.11).  For each (k, d) and t on a grid this runs dpmath.schur.check_schur
both ways (points with entries >= 0.02, 20 points x 3 coordinate pairs, 20 majorization pairs, chains,
rtol 1e-8, atol 1e-10) and records the verdict: "convex", "concave", "neither" (both refuted).  Results
go to benchmarks/results/schur_map.json, which docs/_scripts/make_figures.py plots.

    python benchmarks/schur_map.py
"""

import json
import pathlib
import time

import numpy as np

from dpmath.chi2mix import chi2_mixture_cdf
from dpmath.schur import check_schur

CASES = [(1, 2), (4, 2), (1, 3), (4, 3), (32, 3), (32, 4), (32, 8)]
TS = np.round(np.arange(0.5, 3.01, 0.1), 2)
KW = dict(points=20, pairs=20, symmetry=3, coordinate_pairs=3, rtol=1e-8, atol=1e-10, min_entry=0.02)
OUT = pathlib.Path(__file__).parent / "results" / "schur_map.json"


def verdict(k: int, d: int, t: float) -> tuple[str, float, float]:
    def g(lam: np.ndarray) -> float:
        return float(chi2_mixture_cdf(t, lam / k, k))
    cvx = check_schur(g, d, "convex", **KW)
    ccv = check_schur(g, d, "concave", **KW)
    name = {(True, False): "convex", (False, True): "concave", (False, False): "neither"}.get(
        (cvx.holds, ccv.holds), "both")
    return name, cvx.worst_violation, ccv.worst_violation


def main() -> None:
    t0 = time.perf_counter()
    res = {"t": TS.tolist(), "cases": {}}
    print(f"{'k':>3} {'d':>3}  " + " ".join(f"{t:>4.1f}" for t in TS))
    for k, d in CASES:
        rows = [verdict(k, d, float(t)) for t in TS]
        res["cases"][f"{k},{d}"] = {"k": k, "d": d, "verdict": [r[0] for r in rows],
                                    "convex_violation": [r[1] for r in rows], "concave_violation": [r[2] for r in rows]}
        print(f"{k:>3} {d:>3}  " + " ".join(f"{r[0][:4]:>4}" for r in rows), flush=True)
        OUT.write_text(json.dumps(res, indent=1))
    print(f"({time.perf_counter() - t0:.0f} s; convex / concave / neither = no violation found as Schur-convex / "
          f"as Schur-concave / both refuted)")


if __name__ == "__main__":
    main()

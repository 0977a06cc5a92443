"""Noise multiplier of DP-SGD-RC as a function of the projection dimension k and the layer size d.

The analogue of paper 000's Fig. 11b (sigma against k, d = 2048) and Fig. 12 (sigma against d, k = 32),
for Hutch and Hutch++, at epsilon = 2, delta = 1e-5, batch 64 of 1,139 examples, 10 epochs (180 steps;
the Table 4 setting, see docs/accountants.md).  Every sigma is the smallest whose PLD upper bound meets
the target (rtol 1e-3).  Small k has polynomial tails (P(a > s) ~ s^-k) and is slow (minutes per point
for k <= 4; k = 1 takes more than 10 minutes per estimator), so those come last; results are written after
every point to benchmarks/results/noise_curves.json, which the docs plot (the committed file stops at k = 2).

    python benchmarks/noise_curves.py
"""

import json
import math
import pathlib
import time

from dpmath import calibrate_noise_multiplier, estimator_envelope

EPS, DELTA, N, BATCH, EPOCHS = 2.0, 1e-5, 1139, 64, 10
Q, STEPS = BATCH / N, EPOCHS * math.ceil(N / BATCH)
OUT = pathlib.Path(__file__).parent / "results" / "noise_curves.json"


def main() -> None:
    t0 = time.perf_counter()
    base = calibrate_noise_multiplier(EPS, DELTA, Q, STEPS, rtol=1e-4)
    res = {"setting": {"epsilon": EPS, "delta": DELTA, "q": Q, "steps": STEPS}, "dpsgd": base,
           "by_k": {"d": 2048, "k": [], "hutch": [], "hutchpp": []},
           "by_d": {"k": 32, "d": [], "hutch": [], "hutchpp": []}}
    print(f"DP-SGD: sigma = {base:.4f}")
    print(f"{'k':>6} {'d':>6} {'Hutch':>10} {'Hutch++':>10} {'time s':>8}")
    # the heavy-tailed small k last: they take minutes each
    sweeps = [("by_k", k, 2048) for k in (1024, 512, 256, 128, 64, 32, 16, 8)]
    sweeps += [("by_d", 32, d) for d in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)]
    sweeps += [("by_k", k, 2048) for k in (4, 2, 1)]
    for key, k, d in sweeps:
        t = time.perf_counter()
        row = {}
        for est in ("hutch", "hutchpp"):
            row[est] = calibrate_noise_multiplier(EPS, DELTA, Q, STEPS, envelope=estimator_envelope(est, k, d),
                                                  rtol=1e-3)
        res[key]["k" if key == "by_k" else "d"].append(k if key == "by_k" else d)
        res[key]["hutch"].append(row["hutch"])
        res[key]["hutchpp"].append(row["hutchpp"])
        print(f"{k:>6} {d:>6} {row['hutch']:>10.4f} {row['hutchpp']:>10.4f} {time.perf_counter() - t:>8.1f}",
              flush=True)
        OUT.write_text(json.dumps(res, indent=1))
    print(f"total {time.perf_counter() - t0:.0f} s; wrote {OUT}")


if __name__ == "__main__":
    main()

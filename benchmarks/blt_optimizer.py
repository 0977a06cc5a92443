"""BLTStrategy.optimized against jax_privacy 2.0's BLT optimizer on shared settings.

Run from the repository root with the main virtualenv:

    python benchmarks/blt_optimizer.py [--peer-python /work/jpvenv/bin/python] [--out FILE] [--quick]

jax_privacy lives in its own virtualenv (never this one); this script runs that interpreter on itself
(``--peer-worker``, JSON on stdin and stdout), as ``correlated_peers.py`` does, so the peer side imports nothing
from dpmath.  Install the peer with

    python3 -m venv /work/jpvenv && /work/jpvenv/bin/pip install jax jaxlib jax-privacy==2.0.0

What is compared (jax_privacy 2.0 source, ``matrix_factorization/buffered_toeplitz.py``):

* **Theirs.**  ``buffered_toeplitz.optimize(n=n, min_sep=s, max_participations=k, error=..., min_buffers=d,
  max_buffers=d)``: a fixed number ``d`` of buffers (``min_buffers = max_buffers``, so their search over buffer
  counts is off), optax L-BFGS (600 steps, zoom line search) on the pair of decays of ``C`` and ``C^-1``, barrier
  penalties keeping weights > 0, decays in (0, 1) and the Pillutla score below 1, started from a rational
  approximation of ``1 / sqrt(1 - x)``.  One participation and max error: closed forms (time independent of
  ``n``); mean error or several participations: ``C^-1``'s coefficients materialized and
  ``toeplitz.per_query_error``, sensitivity ``toeplitz.minsep_sensitivity_squared`` (exact for non-negative,
  non-increasing coefficients) for ``k = ceil(n / s)`` participations ``s`` apart **over a run of n steps**.
  Their BLT's ``(buf_decay, output_scale)`` is our ``(decays, weights)``: the same ``c_k``.
* **Ours.**  ``BLTStrategy.optimized(d, n, error, min_separation=None or s)``: scipy L-BFGS-B on interlaced decays
  (the same feasible set), analytic gradient, two starts; the sensitivity is the module's closed form **in the
  limit of long runs**: ``column_norm**2`` for one participation, ``k * sensitivity_per_participation(s)`` for
  ``k`` participations ``s`` apart (the bound ``BLTNoise`` is charged).
* **Two measures**, each strategy scored by both: *ours* = ``prefix_sum_errors`` mean / max (times
  ``k * per(s) / column_norm**2`` with participations), *theirs* = their ``LossFn.build_min_sep(n, error, s,
  k).loss(blt)`` (error times the exact finite-``n`` squared sensitivity), computed with their
  ``toeplitz.per_query_error`` and ``minsep_sensitivity_squared`` on the materialized coefficients (it equals
  their ``LossFn.loss`` on their BLTs; ``LossFn.loss`` itself refuses a BLT whose decays are closer than 1e-9,
  which ours can be).  The error factor is the same in both measures; they differ only in the sensitivity, ours
  an upper bound on theirs (equal as ``n`` grows).  Each optimizer is expected to win on its own measure;
  ``ratio`` columns are ours / theirs (below 1: ours better).
* **Time**: wall clock on a 2-core CPU shared with other work: ours the best of three calls, theirs one call,
  including jax tracing and compilation, which each call repeats (a second identical call took about as long in a
  spot check: 4.7 vs 6.3 s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from peer_process import call_peer

DEFAULT_PEER = "/work/jpvenv/bin/python"
BUFFERS = (2, 3, 4, 5)
SINGLE_STEPS = (64, 256, 2000)
MULTI = [(256, 32), (2000, 250)]          # (steps, min_separation): 8 participations
QUICK_BUFFERS, QUICK_SINGLE, QUICK_MULTI = (3,), (256,), [(256, 32)]
REPEATS = 3


def settings(quick: bool) -> list[dict]:
    buffers = QUICK_BUFFERS if quick else BUFFERS
    rows = []
    for n in QUICK_SINGLE if quick else SINGLE_STEPS:
        for error in ("mean", "max"):
            for d in buffers:
                rows.append({"d": d, "n": n, "error": error, "s": None})
    for n, s in QUICK_MULTI if quick else MULTI:
        for d in buffers:
            rows.append({"d": d, "n": n, "error": "mean", "s": s})
    for i, row in enumerate(rows):
        row["id"] = i
    return rows


# ----------------------------------------------------------------------------------------------------------------
# peer side: runs under the jax_privacy virtualenv's interpreter, imports nothing from this repository
# ----------------------------------------------------------------------------------------------------------------

def peer_worker() -> None:
    request = json.load(sys.stdin)
    import importlib.metadata as md

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from jax_privacy.matrix_factorization import buffered_toeplitz as bt
    from jax_privacy.matrix_factorization import sensitivity, toeplitz

    out: dict = {"versions": {p: md.version(p) for p in ("jax", "jaxlib", "jax-privacy", "numpy")},
                 "rows": []}
    out["versions"]["python"] = platform.python_version()
    for row in request["rows"]:
        n, d, error = row["n"], row["d"], row["error"]
        s, k = (1, 1) if row["s"] is None else (row["s"], None)
        loss_fn = bt.LossFn.build_min_sep(n=n, error=error, min_sep=s, max_participations=k)

        def score(decays, weights, n=n, s=s, k=k, error=error):
            # their Toeplitz functions on the materialized coefficients (LossFn.loss's quantity without its
            # eigen-decomposed inverse, which refuses decays closer than 1e-9, as a near-collision can leave)
            coef = jnp.asarray(bt.BufferedToeplitz.build(buf_decay=decays, output_scale=weights).toeplitz_coefs(n))
            errors = toeplitz.per_query_error(strategy_coef=coef, n=n)
            err = errors[-1] if error == "max" else jnp.mean(errors)
            return float(err * toeplitz.minsep_sensitivity_squared(coef, s, k, n=n))

        t = time.perf_counter()
        try:
            blt = bt.optimize(n=n, min_sep=s, max_participations=k, error=error, min_buffers=d, max_buffers=d)
            seconds = time.perf_counter() - t
            theirs = {"decays": np.asarray(blt.buf_decay).tolist(), "weights": np.asarray(blt.output_scale).tolist()}
            theirs_score = score(theirs["decays"], theirs["weights"])
            check = float(loss_fn.loss(blt))   # their own loss of their BLT: the same number
        except Exception as e:  # noqa: BLE001 - report, do not stop the table
            seconds, theirs, theirs_score, check = time.perf_counter() - t, None, f"failed: {str(e)[:80]}", None
        out["rows"].append({
            "id": row["id"], "seconds": seconds, "theirs": theirs, "theirs_score": theirs_score, "check": check,
            "ours_score": score(row["ours"]["decays"], row["ours"]["weights"]),
            "k": int(sensitivity.minsep_true_max_participations(n=n, min_sep=s, max_participations=k))})
    json.dump(out, sys.stdout)


# ----------------------------------------------------------------------------------------------------------------
# our side
# ----------------------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", default=DEFAULT_PEER, help="the jax_privacy virtualenv's python")
    parser.add_argument("--out", help="also write the markdown report here")
    parser.add_argument("--quick", action="store_true", help="one setting of each kind (a smoke test)")
    parser.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_worker:
        peer_worker()
        return

    import importlib.metadata as md

    import numpy as np

    from dpmath.correlated import BLTStrategy, prefix_sum_errors

    lines: list[str] = []

    def emit(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    t_start = time.perf_counter()
    rows = settings(args.quick)
    for row in rows:
        times = []
        for _ in range(REPEATS):   # the best of a few calls: the machine is shared, and ours are cheap
            t = time.perf_counter()
            blt = BLTStrategy.optimized(row["d"], row["n"], row["error"], min_separation=row["s"])
            times.append(time.perf_counter() - t)
        row["ours_seconds"] = min(times)
        row["ours"] = {"decays": list(blt.decays), "weights": list(blt.weights)}
    if not os.path.exists(args.peer_python):
        sys.exit(f"no jax_privacy interpreter at {args.peer_python}; install it with the command in the docstring")
    t = time.perf_counter()
    peer = call_peer(args.peer_python, __file__, {"rows": rows})
    peer_seconds = time.perf_counter() - t
    answers = {a["id"]: a for a in peer["rows"]}

    def our_measure(decays, weights, row, k):
        blt = BLTStrategy(tuple(weights), tuple(decays))
        value = prefix_sum_errors(blt, row["n"])[0 if row["error"] == "mean" else 1]
        if row["s"] is not None:
            value *= k * blt.sensitivity_per_participation(row["s"]) / blt.column_norm ** 2
        return value

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip() or "?"
    emit("# BLT optimizer: dpmath against jax_privacy")
    emit()
    emit("Command: `python benchmarks/blt_optimizer.py" + (" --quick" if args.quick else "")
         + (f" --out {args.out}" if args.out else "") + "` (from the repository root, main virtualenv)")
    emit()
    emit(f"Commit {commit}; Python {platform.python_version()}, numpy {md.version('numpy')}, scipy "
         f"{md.version('scipy')}; peer: " + ", ".join(f"{k} {v}" for k, v in peer["versions"].items())
         + f"; {os.cpu_count()}-core CPU, shared.")
    emit()
    emit("Loss = squared error of the prefix sums (mean over steps, or max) times squared sensitivity; *our "
         "measure* charges the module's closed-form sensitivity (limit of long runs: `column_norm**2`, or `k * "
         "sensitivity_per_participation(s)`), *their measure* the exact sensitivity over the run's n steps "
         "(`LossFn.build_min_sep(...).loss`).  ratio = ours / theirs (below 1: ours better).  k participations "
         "s apart (`-`: one).  Times: ours the best of 3 calls, theirs one call including jax tracing and "
         "compilation.")
    emit()
    emit("| d | n | error | s | k | ours, our measure | theirs, our measure | ratio | ours, their measure "
         "| theirs, their measure | ratio | our time | their time |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    summary = {"ours_measure": [], "their_measure": [], "ours_s": [], "theirs_s": []}
    for row in rows:
        a = answers[row["id"]]
        k = a["k"]
        ours_ours = our_measure(row["ours"]["decays"], row["ours"]["weights"], row, k)
        ours_theirs = a["ours_score"]
        if a["theirs"] is None:
            emit(f"| {row['d']} | {row['n']} | {row['error']} | {row['s'] or '-'} | {k} | {ours_ours:.6f} | "
                 f"{a['theirs_score']} | | {ours_theirs:.6f} | | | {row['ours_seconds']:.2f} s | "
                 f"{a['seconds']:.1f} s |")
            continue
        theirs_ours = our_measure(a["theirs"]["decays"], a["theirs"]["weights"], row, k)
        theirs_theirs = a["theirs_score"]
        r1, r2 = ours_ours / theirs_ours, ours_theirs / theirs_theirs
        summary["ours_measure"].append((r1, row))
        summary["their_measure"].append((r2, row))
        summary["ours_s"].append(row["ours_seconds"])
        summary["theirs_s"].append(a["seconds"])
        emit(f"| {row['d']} | {row['n']} | {row['error']} | {row['s'] or '-'} | {k} | {ours_ours:.6f} | "
             f"{theirs_ours:.6f} | {r1:.6f} | {ours_theirs:.6f} | {theirs_theirs:.6f} | {r2:.6f} | "
             f"{row['ours_seconds']:.2f} s | {a['seconds']:.1f} s |")
    emit()
    for key, name in (("ours_measure", "our measure"), ("their_measure", "their measure")):
        ratios = summary[key]
        if ratios:
            lo, hi = min(ratios, key=lambda x: x[0]), max(ratios, key=lambda x: x[0])
            better = sum(r < 1 - 1e-9 for r, _ in ratios)
            worse = sum(r > 1 + 1e-9 for r, _ in ratios)
            emit(f"- On {name}: ours / theirs from {lo[0]:.6f} to {hi[0]:.6f} over {len(ratios)} settings; ours "
                 f"lower in {better}, higher in {worse} (by more than 1e-9).  Largest: d={hi[1]['d']}, "
                 f"n={hi[1]['n']}, {hi[1]['error']}, s={hi[1]['s'] or '-'}.")
    if summary["ours_s"]:
        emit(f"- Time per setting: ours median {np.median(summary['ours_s']):.2f} s (max "
             f"{max(summary['ours_s']):.2f} s), theirs median {np.median(summary['theirs_s']):.1f} s (max "
             f"{max(summary['theirs_s']):.1f} s); peer subprocess {peer_seconds:.0f} s in all.")
    checks = [abs(a["check"] - a["theirs_score"]) / a["check"] for a in answers.values() if a["check"] is not None]
    if checks:
        emit(f"- Their measure as computed here vs their `LossFn.loss` on their BLTs: largest relative difference "
             f"{max(checks):.1e} ({len(checks)} settings).")
    emit(f"- Total {time.perf_counter() - t_start:.0f} s.")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

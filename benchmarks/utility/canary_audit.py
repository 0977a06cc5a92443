r"""The canary audit of a real run: the digits study's CNN trained on real digits with canaries, per method.

Each method trains :mod:`verify.training`'s ``"digits-cnn"`` backbone (the CNN of
``benchmarks/utility/digits.py``'s task: Conv2d + GroupNorm on scikit-learn's 8x8 handwritten digits, true
labels) with ``dpsgd`` on ``--ordinary`` real images plus ``--canaries`` gradient-canary slots (each filled with
probability 1/2) and ``--input-canaries`` mislabeled real images (each included with probability 1/2).  The
auditor sees every noisy update and scores each canary by the subsampled Gaussian's log-likelihood ratio;
:class:`verify.auditing.CanaryScoreAuditor` turns the pooled scores of ``--runs`` runs into an epsilon lower bound
(Clopper-Pearson, a threshold chosen on half the scores), and the first run's scores into the one-run bound of
Steinke, Nasr and Jagielski (2023).  Each bound holds with probability ``--confidence``; the engine's reported
epsilon must lie above it.

The audit has power only where few steps at a large sampling rate spend a moderate epsilon: it runs at
``q = 0.5``, 2 steps, ``sigma = 1`` and reads epsilon at ``delta = 0.05`` (the trainer audit's settings), not at
the study's calibrated settings (hundreds of steps at ``q`` about 0.04, where a few thousand canaries cannot
bound epsilon away from 0).  LAP2 is not audited here: the scores are the Gaussian's likelihood ratio.

    python benchmarks/utility/canary_audit.py                 # 4 methods, 12 runs each: about 30 seconds
    python benchmarks/utility/canary_audit.py --small         # 2 methods, 1 run, fewer canaries: seconds

Writes ``canary_audit.json`` under ``--out`` (default ``benchmarks/results/utility``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

METHODS = ("exact", "ghost", "hutch", "hutchpp")


def main(argv: list[str] | None = None) -> dict:
    import torch
    from study_common import machine

    from verify.training import TrainerConfig, audit_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--runs", type=int, default=12, help="training runs pooled per method")
    ap.add_argument("--canaries", type=int, default=4000)
    ap.add_argument("--input-canaries", type=int, default=200)
    ap.add_argument("--ordinary", type=int, default=1000, help="real digit images per run")
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="2 methods, 1 run, 400 canaries: the smoke setting")
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="default benchmarks/results/utility; with --small its untracked small/ folder")
    args = ap.parse_args(argv)
    if args.small:
        args.methods, args.runs, args.canaries, args.input_canaries, args.ordinary = ["exact", "hutch"], 1, 400, 40, 100
    torch.set_num_threads(1)
    delta = 0.05
    rows = []
    for method in args.methods:
        t0 = time.perf_counter()
        r = audit_config(TrainerConfig(f"digits CNN, {method}", "digits-cnn", method), runs=args.runs, delta=delta,
                         confidence=args.confidence, seed=args.seed, canaries=args.canaries,
                         input_canaries=args.input_canaries, ordinary=args.ordinary)
        row = {"method": method, "reported_epsilon": r["reported"],
               "lower_bound_clopper_pearson": r["clopper_pearson"].epsilon, "lower_bound_one_run": r["one_run"].epsilon,
               "lower_bound_input_canaries": r["input_one_run"].epsilon, "tpr_at_1pct_fpr": r["tpr_at_1pct_fpr"],
               "seconds": time.perf_counter() - t0}
        row["holds"] = max(row["lower_bound_clopper_pearson"], row["lower_bound_one_run"],
                           row["lower_bound_input_canaries"]) <= row["reported_epsilon"]
        rows.append(row)
        print(f"{method:8s} reported {row['reported_epsilon']:.3f}  lower bounds: Clopper-Pearson "
              f"{row['lower_bound_clopper_pearson']:.3f}, one run {row['lower_bound_one_run']:.3f}, input canaries "
              f"{row['lower_bound_input_canaries']:.3f}  ({row['seconds']:.0f} s)", flush=True)
    result = {"command": " ".join([pathlib.Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
              "machine": machine(),
              "settings": {"sample_rate": 0.5, "steps": 2, "noise_multiplier": 1.0, "max_grad_norm": 1.0, "k": 32,
                           "delta": delta, "confidence": args.confidence, "runs": args.runs,
                           "canaries": args.canaries, "input_canaries": args.input_canaries,
                           "ordinary": args.ordinary},
              "rows": rows}
    if args.out is None:   # a smoke run never overwrites the tracked results
        args.out = pathlib.Path("benchmarks/results/utility") / ("small" if args.small else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ("canary_audit_small.json" if args.small else "canary_audit.json")).write_text(
        json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

"""``python -m verify``: run the audits, print a summary, write a report with plots; exit 1 on a failed check.

Each audit's start and end (with its seconds) and the long audits' progress are log records of the
``"verify"`` logger, shown on stderr when run as a command; the summary and the verdict go to stdout.

    python -m verify --quick                 # the README's main job (about 45 s on 2 cores)
    python -m verify --full --report out/    # more draws and cases
    python -m verify --only envelope --seed 3
"""

from __future__ import annotations

import argparse
import inspect
import logging
import pathlib
import sys
import time

from dpsgd.cli import show_progress

from .audits import AUDITS
from .report import write_report

logger = logging.getLogger("verify")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verify",
                                 description="Audits of estimators, envelopes, accountants and published claims.")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small draws (the default)")
    mode.add_argument("--full", action="store_true", help="large draws and more cases")
    ap.add_argument("--only", choices=list(AUDITS), action="append", help="run only this audit (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="seed of every random draw (default 0)")
    ap.add_argument("--report", type=pathlib.Path, default=pathlib.Path("verify-report"),
                    help="folder for report.md and its plots (default verify-report/)")
    args = ap.parse_args(argv)
    mode_name = "full" if args.full else "quick"
    results, seconds = [], {}
    names = args.only or list(AUDITS)
    for i, name in enumerate(names, 1):
        fn, quick_kw, full_kw = AUDITS[name]
        kw = dict(full_kw if args.full else quick_kw)
        if "seed" in inspect.signature(fn).parameters:
            kw["seed"] = args.seed
        logger.info("[%d/%d] %s ...", i, len(names), name)
        t0 = time.perf_counter()
        r = fn(**kw)
        seconds[r.name] = time.perf_counter() - t0
        logger.info("[%d/%d] %s (%s): %s - %s (%.1f s)", i, len(names), name, r.kind, r.verdict, r.summary,
                    seconds[r.name])
        results.append(r)
    print("\nsummary")
    print(f"{'audit':<16} {'kind':<8} {'verdict':<8} seconds")
    for r in results:
        print(f"{r.name:<16} {r.kind:<8} {r.verdict:<8} {seconds[r.name]:7.1f}")
    refuted = [row for r in results if r.kind == "finding" for row in r.failures]
    if refuted:
        print(f"\nREFUTED published claims ({len(refuted)}; findings, they do not fail the run):")
        for row in refuted:
            print(f"  - {row['claim']}: {row['numbers']}")
    failed = [r for r in results if r.kind == "check" and not r.holds]
    for r in failed:
        print(f"\nFAILED check {r.name}:")
        for row in r.failures:
            print("  - " + ", ".join(f"{k}: {v}" for k, v in row.items() if k != "holds"))
    path = write_report(results, args.report, mode_name, args.seed, seconds)
    verdict = "FAIL (" + ", ".join(r.name for r in failed) + ")" if failed else "PASS"
    skipped = [r for r in results if r.skipped]
    for r in skipped:
        print(f"\nSKIPPED {r.name}: {r.skipped}")
    if skipped:
        verdict += f" ({len(skipped)} skipped: {', '.join(r.name for r in skipped)})"
    print(f"\nreport: {path}; verdict: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    show_progress()
    sys.exit(main())

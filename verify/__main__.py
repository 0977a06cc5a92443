"""``python -m verify``: run the audits, print a summary, write a markdown report; non-zero exit on a failed check.

    python -m verify --quick                 # the README's main job (well under 3 minutes on 2 cores)
    python -m verify --full --report out/    # more draws and cases
    python -m verify --only envelope --seed 3
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from .audits import AUDITS, AuditResult


def _report(results: list[AuditResult], path: pathlib.Path, mode: str, seed: int) -> None:
    lines = [f"# verify report ({mode}, seed {seed})", ""]
    sections = (("check", "Checks of this library's guarantees"), ("finding", "Findings about published claims"))
    for kind, title in sections:
        lines += [f"## {title}", ""]
        for r in (r for r in results if r.kind == kind):
            verdict = ("PASS" if r.holds else "FAIL") if kind == "check" else \
                ("all claims hold" if r.holds else "claims refuted")
            lines += [f"### {r.name}: {verdict}", "", r.summary, ""]
            if r.rows:
                keys = list(r.rows[0])
                lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
                lines += ["| " + " | ".join(str(row[k_]) for k_ in keys) + " |" for row in r.rows]
                lines.append("")
    path.mkdir(parents=True, exist_ok=True)
    (path / "report.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verify", description="Audits of estimators, envelopes and claims.")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small draws (default)")
    mode.add_argument("--full", action="store_true", help="large draws and more cases")
    ap.add_argument("--only", choices=sorted(AUDITS), action="append", help="run only this audit (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", type=pathlib.Path, default=pathlib.Path("verify-report"))
    args = ap.parse_args(argv)
    full = bool(args.full)
    results = []
    for name in args.only or list(AUDITS):
        fn, quick_kw, full_kw = AUDITS[name]
        kw = dict(full_kw if full else quick_kw)
        if "seed" in fn.__code__.co_varnames:
            kw["seed"] = args.seed
        t0 = time.perf_counter()
        print(f"[{name}] running ...", flush=True)
        r = fn(**kw)
        print(f"[{name}] {r.kind}: {'holds' if r.holds else ('FAILED' if r.kind == 'check' else 'REFUTED')} - "
              f"{r.summary} ({time.perf_counter() - t0:.1f} s)", flush=True)
        results.append(r)
    print("\nsummary")
    print(f"{'audit':<12} {'kind':<8} verdict")
    for r in results:
        verdict = ("pass" if r.holds else "FAIL") if r.kind == "check" else ("holds" if r.holds else "refuted")
        print(f"{r.name:<12} {r.kind:<8} {verdict}")
    for r in results:
        if r.kind == "finding":
            for row in r.rows:
                if not row.get("holds", True):
                    print(f"  refuted: {row['claim']}: {row['numbers']}")
    _report(results, args.report, "full" if full else "quick", args.seed)
    failed = [r.name for r in results if r.kind == "check" and not r.holds]
    verdict = "FAIL (" + ", ".join(failed) + ")" if failed else "PASS"
    print(f"\nreport: {args.report / 'report.md'}; verdict: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The audit report: a markdown file with PNG plots (matplotlib, when installed), readable on its own and
as a page of the Sphinx site."""

from __future__ import annotations

import pathlib
import platform
import time

from .result import AuditResult

__all__ = ["write_report"]


def _cell(value: object) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict]) -> list[str]:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    out += ["| " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |" for row in rows]
    return out + [""]


def _plots(result: AuditResult, folder: pathlib.Path) -> list[str]:
    if not result.figures:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(plots need matplotlib: `pip install matplotlib`)", ""]
    lines = []
    for fig in result.figures:
        f, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        fig.draw(ax)
        f.tight_layout()
        f.savefig(folder / f"{fig.name}.png")
        plt.close(f)
        lines += [f"![{fig.caption}]({fig.name}.png)", "", f"*{fig.caption}*", ""]
    return lines


def write_report(results: list[AuditResult], folder: pathlib.Path, mode: str, seed: int,
                 seconds: dict[str, float]) -> pathlib.Path:
    """Write ``folder/report.md`` and its PNGs; return the markdown path.

    Checks and findings are kept apart; refuted claims are listed first under the findings, with their numbers.
    """
    folder.mkdir(parents=True, exist_ok=True)
    import numpy
    import scipy

    checks = [r for r in results if r.kind == "check"]
    findings = [r for r in results if r.kind == "finding"]
    failed = [r.name for r in checks if not r.holds]
    n_skipped = sum(bool(r.skipped) for r in checks)
    skipped_note = f", {n_skipped} skipped" if n_skipped else ""
    lines = [f"# Audit report ({mode} run)", "",
             f"`python -m verify --{mode} --seed {seed}` on {time.strftime('%Y-%m-%d')}, Python "
             f"{platform.python_version()}, numpy {numpy.__version__}, scipy {scipy.__version__}, "
             f"{sum(seconds.values()):.0f} s in all.", "",
             f"**Verdict: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}**: "
             f"{sum(r.holds and not r.skipped for r in checks)} of {len(checks)} checks of this library's guarantees "
             f"pass{skipped_note}; "
             f"{sum(len(r.failures) for r in findings)} published claims are refuted (findings do not fail the run).",
             "", "| audit | kind | verdict | seconds | summary |", "|---|---|---|---|---|"]
    lines += [f"| {r.name} | {r.kind} | {r.verdict} | {seconds.get(r.name, 0):.1f} | {_cell(r.summary)} |"
              for r in results]
    lines += ["", "## Checks of this library's guarantees", "",
              "A check fails the run (non-zero exit status).  Each states its confidence; Monte Carlo checks use "
              "fixed seeds.", ""]
    for r in checks:
        lines += [f"### {r.name}: {r.verdict}", "", _cell(r.summary), ""]
        bad = r.failures
        if bad:
            lines += ["**Failed rows:**", ""] + _table(bad)
        lines += _table(r.rows) if r.rows else []
        lines += _plots(r, folder)
    lines += ["## Findings about published claims", "",
              "A refuted claim is reported with its counterexample and does not fail the run.", ""]
    refuted = [row for r in findings for row in r.failures]
    if refuted:
        lines += ["**Refuted:**", ""] + [f"- {row['claim']}: {row['numbers']}" for row in refuted] + [""]
    for r in findings:
        lines += [f"### {r.name}: {r.verdict}", "", _cell(r.summary), ""]
        lines += _table(r.rows) if r.rows else []
        lines += _plots(r, folder)
    path = folder / "report.md"
    path.write_text("\n".join(lines))
    return path

"""The "Supported models" tables of huggingface.md, rendered at build time from benchmarks/results/support_matrix.json
(written by benchmarks/support_matrix.py): nothing in them is typed by hand."""

from __future__ import annotations

import json
import pathlib

SOURCE = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "support_matrix.json"


def _table(rows: list[dict]) -> list[str]:
    lines = ["| model | class | handlers (modules) | `hutch` terms | max rel. error vs brute force (B = 1, 3, T) "
             "| trains: float32 | bf16 autocast |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        handlers = ", ".join(f"{h.removesuffix('Handler')} {n}" for h, n in r["handlers"].items())
        errors = " / ".join(f"{e:.0e}" for e in r["max_rel_error"].values())
        terms = f"{r['terms']}" + (" + exact parts" if r["exact_parts"] else "")
        lines.append(f"| `{r['name']}` | `{r['model']}` | {handlers} | {terms} | {errors} | {r['float32']} "
                     f"| {r['bf16_autocast']} |")
    return lines


def main(out_dir: str) -> None:
    data = json.loads(SOURCE.read_text())
    lines = [f"Measured by `benchmarks/support_matrix.py` (torch {data['torch']}, transformers "
             f"{data['transformers']}; T = {data['T']}): tiny random-weight models built from their configs.  "
             f"Errors are the largest relative difference of exact per-example gradient norms from brute force "
             f"(one backward per example) in float64 with dropout off; *trains* is three private `hutch` steps with "
             f"the row check on every step.", "", "**Families and adapters**", "", *_table(data["families"]), "",
             "**Idioms**: positions from `torch.arange`, parameters of the model itself, T5's relative position "
             "bias, BART's positions at B = T, PEFT prompt tuning, parametrizations", "", *_table(data["idioms"]), ""]
    path = pathlib.Path(out_dir) / "support_matrix.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))

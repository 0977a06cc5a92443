"""The README's stated times: its main job and its test command, timed on this machine.

Run: ``python benchmarks/readme_times.py [--write benchmarks/results/readme_times.md]`` from the repository root, in
an environment with ``.[test,docs]`` installed (the installs themselves are not timed: they depend on the network and
the wheel cache).  Each command runs as the README writes it, under GNU ``time``; the table gives wall seconds, CPU
seconds (user + system, the processes it started included: the test workers, the docs build) and the peak memory of
its largest process, with the machine's load average before it.  The README quotes the CPU seconds, which depend
least on how busy the machine is.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commands(scratch: str) -> list[tuple[str, str]]:
    return [
        ("main job: python -m verify --quick", f"python -m verify --quick --report {scratch}/report"),
        ("lint: ruff check .", "ruff check ."),
        ("tests: python -m pytest", "python -m pytest -q -p no:cacheprovider"),
        ("docs: python -m sphinx -W -q -b html docs ...", f"python -m sphinx -W -q -b html docs {scratch}/html"),
    ]


def timed(command: str) -> dict:
    fmt = "TIMED %e %U %S %M"
    out = subprocess.run(["/usr/bin/time", "-f", fmt, "bash", "-c", command], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    line = [x for x in out.stderr.splitlines() if x.startswith("TIMED ")][-1].split()
    wall, user, system, rss_kb = float(line[1]), float(line[2]), float(line[3]), int(line[4])
    tail = (out.stdout.strip().splitlines() or [""])[-1]
    return {"rc": out.returncode, "wall": wall, "cpu": user + system, "gb": rss_kb / 1e6, "tail": tail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="also write the table (markdown) to this file")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, command in commands(scratch):
            load = os.getloadavg()[0]
            r = timed(command)
            rows.append((name, load, r))
            print(f"{name}: rc {r['rc']}, {r['wall']:.0f} s wall, {r['cpu']:.0f} CPU-s, {r['gb']:.2f} GB; {r['tail']}",
                  flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [f"README times at {commit}: {os.cpu_count()} cores, Python {platform.python_version()}, "
             f"`python benchmarks/readme_times.py`", "",
             "| command | load before | wall s | CPU s | peak GB (largest process) | exit | last line |",
             "|---|---|---|---|---|---|---|"]
    for name, load, r in rows:
        lines.append(f"| {name} | {load:.2f} | {r['wall']:.0f} | {r['cpu']:.0f} | {r['gb']:.2f} | {r['rc']} | "
                     f"{r['tail'][:90]} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        args.write.write_text(text)
    sys.exit(max(r["rc"] for _, _, r in rows))


if __name__ == "__main__":
    main()

"""Smoke test of benchmarks/correlated_cost.py: at tiny sizes it runs end to end (noise step, whole private step with
Gaussian and banded noise, the primitives) and prints and writes its tables.  No timing is asserted."""

import pathlib
import sys

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import correlated_cost  # noqa: E402

TINY = ["--quick", "--rounds", "1", "--noise-layers", "0", "--noise-vocab", "1000", "--cycles", "1",
        "--step-embd", "48", "--step-vocab", "100", "--seq-len", "8", "--batch", "2"]


def test_tiny_run_prints_and_writes_its_tables(tmp_path, capsys):
    out = tmp_path / "correlated_cost.md"
    result = correlated_cost.main([*TINY, "--out", str(out)])
    printed = capsys.readouterr().out
    text = out.read_text()
    assert text in printed
    for heading in ("## 1. The noise step alone", "## 2. A whole private training step", "## 3. Where the"):
        assert heading in text
    for row in ("| gaussian |", "| banded b=2 |", "| banded b=4 |", "| banded b=8 |", "| blt d=3 |",
                "| gaussian, poisson (baseline) |", "| gaussian, cyclic_poisson(4) |",
                "| banded b=4, cyclic_poisson(4) |"):
        assert row in text
    assert "nproc" in text and "torch" in text and "load average" in text
    rows = result["noise_step"]["rows"]
    # (b - 1) parameter copies for banded noise, d buffers for BLT
    assert [r["history_x_params"] for r in rows] == pytest.approx([0, 1, 3, 7, 3])
    assert all(r["mean_batch"] == 2 for r in result["training_step"]["rows"])

"""Smoke test of benchmarks/utility/digits.py: its --small setting end to end (train, tables, JSON, plot) in seconds,
and its tuning on a one-point grid."""

import json
import math
import pathlib
import sys

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "utility"))

import digits  # noqa: E402


def test_small_setting_writes_sane_results(tmp_path):
    out = tmp_path / "digits.json"
    digits.main(["--small", "--out", str(out)])
    assert out.exists() and out.with_suffix(".png").stat().st_size > 0
    data = json.loads(out.read_text())
    small = digits.SMALL
    assert data["settings"]["methods"] == small["methods"] and data["settings"]["epsilons"] == small["epsilons"]
    assert data["machine"]["torch"] and data["command"].endswith("--small --out " + str(out))
    assert len(data["runs"]) == len(small["methods"]) * len(small["epsilons"]) * small["seeds"]
    for r in data["runs"]:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["sigma"] > 0 and math.isfinite(r["s_per_step"]) and r["steps"] > 0
        assert 0.0 < r["epsilon_reported"] <= r["epsilon"] * (1 + 1e-9), r
    # the randomized-clipping envelope costs noise: hutch's sigma is at least exact's at every epsilon
    for eps in small["epsilons"]:
        assert data["sigma"]["hutch-k32"][f"{eps:g}"] >= data["sigma"]["exact"][f"{eps:g}"]
    assert {s["method"] for s in data["summary"]} == set(small["methods"])
    assert all(v.startswith("ValueError") for v in data["refused"].values()), data["refused"]


def test_tuning_picks_the_best_validation_accuracy(monkeypatch):
    monkeypatch.setattr(digits, "GRID_C", (1.0,))
    monkeypatch.setattr(digits, "GRID_LR", (0.5, 1.0))
    monkeypatch.setattr(digits, "TUNING_SEEDS", (0,))
    record = digits.tune(digits.argparse.Namespace(epochs=1, batch_size=64))
    assert [r["method"] for r in record["results"]] == ["exact", "exact", "non-private", "non-private"]
    best = max(record["results"][:2], key=lambda r: r["mean"])
    best_np = max(record["results"][2:], key=lambda r: r["mean"])
    assert record["chosen"] == {"max_grad_norm": best["max_grad_norm"], "lr": best["lr"],
                                "lr_non_private": best_np["lr"]}

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


@pytest.mark.slow   # 16 s end to end: run with -m slow
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
    # banded noise: its strategy optimized for the steps the cyclic loader runs, sigma = ||c|| x the accountant's
    banded = [r for r in data["runs"] if r["method"] == "banded-b4"]
    groups, kind, bands = digits.CYCLIC["banded-b4"]
    assert kind == "banded"
    assert banded and all(r["steps"] == digits.planned_steps(groups, data["settings"]["train"], 128, small["epochs"])
                          == data["settings"]["cyclic"]["banded-b4"]["steps"] for r in banded)
    for r in banded:
        norm = math.sqrt(sum(c * c for c in r["coefficients"]))
        assert len(r["coefficients"]) == bands and r["groups"] == groups
        assert r["accounting_noise_multiplier"] * norm == pytest.approx(r["sigma"])


@pytest.mark.slow
def test_merge_adds_methods_and_keeps_the_others(tmp_path):
    out = tmp_path / "digits.json"
    digits.main(["--small", "--methods", "exact", "hutch-k32", "--out", str(out)])
    first = json.loads(out.read_text())
    merged = digits.main(["--merge", "--methods", "exact", "cyclic", "--out", str(out)])
    assert merged == json.loads(out.read_text())
    assert merged["settings"]["methods"] == ["exact", "hutch-k32", "cyclic"]
    for key in digits.MERGE_FIXED:   # the file's settings, not the defaults
        assert merged["settings"][key] == first["settings"][key]
    assert [r for r in merged["runs"] if r["method"] == "hutch-k32"] == [
        r for r in first["runs"] if r["method"] == "hutch-k32"]
    assert merged["command"] == first["command"] and merged["tuning"] == first["tuning"]
    (record,) = merged["merges"]
    assert record["methods"] == ["exact", "cyclic"] and record["replaced_max_accuracy_change"] == {"exact": 0.0}
    cells = {(s["method"], s["epsilon"]): s for s in merged["summary"]}
    assert all("diff_vs_exact_mean" in cells[("cyclic", e)] for e in first["settings"]["epsilons"])
    with pytest.raises(SystemExit):   # another schedule would break the pairing
        digits.main(["--merge", "--methods", "cyclic", "--epochs", "2", "--out", str(out)])


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

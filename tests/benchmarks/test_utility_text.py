"""Smoke test of benchmarks/utility/text.py: its tiny setting runs end to end on the real gensim text, and the JSON
and the plot it writes are complete and sane (every epsilon the engine reports within its target)."""

import json
import math
import pathlib
import sys

import pytest

pytest.importorskip("gensim")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("matplotlib")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "utility"))

import text as study  # noqa: E402


@pytest.mark.slow   # 18 s end to end: run with -m slow
def test_the_small_setting_writes_a_complete_and_sane_result(tmp_path):
    result = study.main(["--small", "--out", str(tmp_path)])
    assert (tmp_path / "text_small.png").stat().st_size > 0
    assert json.loads((tmp_path / "text_small.json").read_text()) == json.loads(json.dumps(result))
    assert set(result["machine"]) >= {"platform", "torch", "torch_threads"} and "--small" in result["command"]
    assert list(tmp_path.glob("text_pretrained_*.pt"))
    info = result["data"]
    assert info["private_train_chunks"] > 0 and info["private_test_chunks"] > 0
    assert result["delta"] <= info["private_train_chunks"] ** -1.5
    assert math.isfinite(result["zero_shot_test_ppl"]) and 1 < result["zero_shot_test_ppl"] < info["vocab_size"]

    runs = result["runs"]
    dp_methods = set(study.DP_METHODS)
    assert {(r["mode"], r["method"]) for r in runs} == {(m, x) for m in study.MODES for x in study.METHODS}
    assert {r["seed"] for r in runs} == {0, 1}
    for r in runs:
        assert math.isfinite(r["test_ppl"]) and r["test_ppl"] > 1 and r["seconds_per_step"] > 0 and r["steps"] >= 1
        if r["method"] in dp_methods:
            assert r["sigma"] > 0 and r["steps"] == r["planned_steps"]
            assert 0 < r["epsilon_reported"] <= r["epsilon_target"] * (1 + 1e-9)
        else:
            assert r["sigma"] is None and r["epsilon_reported"] is None
    # randomized clipping pays a larger sigma for its envelope; exact and ghost share one
    sigma = {(r["mode"], r["method"]): r["sigma"] for r in runs}
    for mode in study.MODES:
        assert sigma[(mode, "exact")] == sigma[(mode, "ghost")] < sigma[(mode, "hutch")]

    assert len(result["summary"]) == len({(r["mode"], r["method"], r["epsilon_target"]) for r in runs})
    for s in result["summary"]:
        assert s["seeds"] == 2 and math.isfinite(s["test_ppl_mean"]) and s["test_ppl_ci95"] >= 0
    assert {(p["mode"], p["method"]) for p in result["paired_to_exact"]} == {
        (m, x) for m in study.MODES for x in ("hutch", "hutchpp")}

"""Smoke test of benchmarks/utility/shift.py: its tiny setting runs end to end on the real gensim text (Wikipedia
markup cleaned, news split three ways), tunes each method on the validation split, and writes a complete and sane
JSON and plot."""

import json
import math
import pathlib
import sys

import pytest

pytest.importorskip("gensim")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "utility"))

import shift as study  # noqa: E402


def test_wiki_markup_is_reduced_to_its_prose():
    markup = ("'''Anarchism''' is a [[political philosophy]] that advocates [[Self-governance|self-governed]] "
              "societies.<ref>Kropotkin, p. 14</ref>{{citation needed|date=2020}}\n== History ==\n"
              "{| class=wikitable\n| a || b\n|}\n[[Category:Anarchism]]\n* [http://x.org/a An external link]")
    assert study.clean_wiki(markup) == "Anarchism is a political philosophy that advocates self-governed societies."


@pytest.mark.slow   # 40 s end to end: run with -m slow
def test_the_small_setting_tunes_each_method_and_writes_a_complete_and_sane_result(tmp_path):
    result = study.main(["--small", "--out", str(tmp_path)])
    assert (tmp_path / "shift_small.png").stat().st_size > 0
    assert json.loads((tmp_path / "shift_small.json").read_text()) == json.loads(json.dumps(result))
    assert list(tmp_path.glob("shift_pretrained_*.pt")) and "--small" in result["command"]
    info, setting = result["data"], result["setting"]
    assert info["public_characters"] > 10**6 and min(info["private_chunks"].values()) > 0
    assert result["delta"] <= info["private_chunks"]["train"] ** -1.5
    for ppl in result["pretrained_ppl"].values():
        assert 1 < ppl < info["vocab_size"]
    assert all(1 <= r["rank_min"] <= r["rank_max"] <= min(r["shape"]) for r in result["gradient_ranks"])

    dp = [m for m in study.DP_METHODS if m not in study.TUNED_AS]
    grid = len(setting["grid_c"]) * len(setting["grid_lr"])
    assert len(result["tuning"]) == len(dp) * grid + len(setting["grid_lr"])
    assert all(r["split"] == "validation" and r["seed"] == study.TUNE_SEED for r in result["tuning"])
    for c in result["chosen"]:
        assert c["lr"] in setting["grid_lr"]
        if c["epsilon_target"] is not None:
            assert c["max_grad_norm"] in setting["grid_c"] and c["tuning_runs"] == grid
            # tuning reads the private data: the whole procedure costs more than one run's target
            assert c["procedure_epsilon"] > c["epsilon_target"]
    for r in result["runs"]:
        assert r["split"] == "test" and math.isfinite(r["test_ppl"]) and r["test_ppl"] > 1
        if r["method"] != "non-private":
            assert 0 < r["epsilon_reported"] <= r["epsilon_target"] * (1 + 1e-9)
    by = {(r["method"], r["seed"]): r for r in result["runs"]}
    assert by[("ghost", 1)]["test_ppl"] == pytest.approx(by[("exact", 1)]["test_ppl"], rel=1e-4)
    assert {p["method"] for p in result["paired_to_exact"]} == set(study.PAIRED)

    # --merge reruns the methods named and keeps the rest: exact's runs reproduce bit for bit
    merged = study.main(["--small", "--out", str(tmp_path), "--merge", "--methods", "exact"])
    assert result["earlier_commands"] == []
    assert [c["command"] for c in merged["earlier_commands"]] == [result["command"]]
    key = ("method", "epsilon_target", "seed", "split", "max_grad_norm", "lr", "ppl")
    for part in ("tuning", "runs"):
        assert sorted(tuple(r[k] for k in key) for r in merged[part]) == sorted(
            tuple(r[k] for k in key) for r in result[part])
    assert {c["method"]: c["procedure_epsilon"] for c in merged["chosen"] if c["epsilon_target"]} == {
        c["method"]: c["procedure_epsilon"] for c in result["chosen"] if c["epsilon_target"]}

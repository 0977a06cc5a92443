"""The support matrix the docs render (benchmarks/results/support_matrix.json) is current: it lists every family of
verify/hf_families.py and every idiom of verify.workloads.SHARED_OUTPUTS, each matching brute force and training."""

import json
import pathlib

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from verify.hf_families import FAMILIES  # noqa: E402
from verify.workloads import SHARED_OUTPUTS  # noqa: E402

MATRIX = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "support_matrix.json"


def test_the_documented_support_matrix_lists_every_tested_model_exact_and_training():
    data = json.loads(MATRIX.read_text())
    assert [r["name"] for r in data["families"]] == list(FAMILIES), "re-run benchmarks/support_matrix.py"
    assert set(SHARED_OUTPUTS) <= {r["name"] for r in data["idioms"]}, "re-run benchmarks/support_matrix.py"
    for r in data["families"] + data["idioms"]:
        assert max(r["max_rel_error"].values()) < 1e-6, r["name"]
        assert r["float32"] == "yes" and r["bf16_autocast"] == "yes", r["name"]

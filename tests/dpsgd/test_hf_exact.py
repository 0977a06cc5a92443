"""The family matrix, exactly: every stock Hugging Face family of ``verify/hf_families.py`` (and its adapters), built
tiny in float64 with dropout off, gives per-example gradient norms equal to brute force (one backward per example)
to 1e-6 relative at B = 1, B = T (the row count of a sequence, where shapes are ambiguous) and another B."""

import logging

import pytest
import torch

from dpsgd import per_sample_sq_norms

pytest.importorskip("transformers")
pytest.importorskip("peft")

from verify.hf_families import FAMILIES, exact_ready  # noqa: E402
from verify.workloads import VOCAB, brute_force_sq_norms  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
T = 8


@pytest.mark.parametrize("b", [1, 3, T], ids=["B=1", "B=3", "B=T"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_gives_per_example_norms_equal_to_brute_force(name, b):
    torch.manual_seed(0)
    model, inputs, losses = FAMILIES[name]()
    model = exact_ready(model)
    ids = torch.randint(1, VOCAB, (b, T), generator=torch.Generator().manual_seed(b))
    float64 = inputs

    def inputs(x):
        return {k: v.double() if v.is_floating_point() else v for k, v in float64(x).items()}
    ref = brute_force_sq_norms(model, lambda m, i: losses(m, inputs(ids))[i], b)
    got = per_sample_sq_norms(model, lambda m: losses(m, inputs(ids)), "exact")
    assert torch.allclose(got, ref, rtol=1e-6, atol=0), (got, ref)

"""The family matrix, exactly: every stock Hugging Face family of ``tests/hf_families.py`` (and its adapters), built
tiny in float64 with dropout off, gives per-example gradient norms equal to brute force (one backward per example)
to 1e-6 relative at B = 1, B = T (the row count of a sequence, where shapes are ambiguous) and another B."""

import logging

import pytest
import torch
from torch import nn

from dpsgd import per_sample_sq_norms

pytest.importorskip("transformers")
pytest.importorskip("peft")

from .hf_families import FAMILIES  # noqa: E402
from .workloads import VOCAB, brute_force_sq_norms  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
T = 8


def exact_ready(model: nn.Module) -> nn.Module:
    """float64, dropout off (brute force and the private pass must see one function), eager mixture-of-experts
    kernels (the grouped matmul has no float64 kernel on CPU), and every adapter factor non-zero."""
    model = model.double().train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name, value in list(vars(m).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(m, name, 0.0)
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "_experts_implementation", None) not in (None, "eager"):
            cfg._experts_implementation = "eager"
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


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

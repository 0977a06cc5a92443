"""Every stock Hugging Face family that trains privately keeps training with the example-isolation check on every
step, in float32 and under bf16 autocast at batches above one (no false refusal of the most common LLM setting)."""

import logging

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dpsgd import PrivacyEngine

pytest.importorskip("transformers")
pytest.importorskip("peft")

from verify.hf_families import FAMILIES  # noqa: E402
from verify.workloads import VOCAB, brute_force_sq_norms  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_stock_family_trains_with_the_row_check_on_every_step(name, autocast):
    torch.manual_seed(0)
    model, inputs, losses = FAMILIES[name]()
    model.train()
    ids = torch.randint(1, VOCAB, (12, 10), generator=torch.Generator().manual_seed(1))
    engine = PrivacyEngine()
    engine.check_every_step = True
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=DataLoader(TensorDataset(ids), batch_size=4), max_grad_norm=1.0, noise_multiplier=1.0,
        estimator="hutch", projection_dim=8, seed=0)
    sizes = []
    for (x,) in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            per = losses(model, inputs(x))
        engine.private_loss(per.float()).backward()
        opt.step()
        sizes.append(x.shape[0])
    assert engine.steps == len(loader) and max(sizes) > 1


@pytest.mark.parametrize("b", [1, 3, 6])
def test_rows_that_flatten_the_batch_give_exact_per_example_norms(b):
    """OPT runs its MLP and final layer norms on ``(B * T, d)`` rows: read as B examples of T rows each,
    brute force to 1e-10 in float64 at B = 1, B = T (6) and B = 3."""
    from dpsgd import per_sample_sq_norms
    from verify.hf_families import opt

    torch.manual_seed(0)
    model, inputs, losses = opt(dropout=0.0)   # no dropout: brute force and the private pass see one function
    model = model.double().train()
    ids = torch.randint(1, VOCAB, (b, 6), generator=torch.Generator().manual_seed(b))
    ref = brute_force_sq_norms(model, lambda m, i: losses(m, inputs(ids))[i], b)
    got = per_sample_sq_norms(model, lambda m: losses(m, inputs(ids)), "exact")
    assert torch.allclose(got, ref, rtol=1e-10, atol=0)


@pytest.mark.parametrize("name", ["ia3_llama", "lora_embedding_llama"])
@pytest.mark.parametrize("b", [1, 3, 10])
def test_adapters_kept_in_parameter_dicts_give_exact_per_example_norms(name, b):
    """PEFT's IA3 scales and LoRA-on-embedding factors live in nn.ParameterDict children used by the parent's
    forward (a leak error before): exact norms match brute force to 1e-10 in float64 at B = 1, 3 and T (10)."""
    from dpsgd import per_sample_sq_norms

    torch.manual_seed(0)
    model, inputs, losses = FAMILIES[name]()
    model = model.double().train()
    with torch.no_grad():   # LoRA's B starts at zero: give every factor a gradient
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(1, VOCAB, (b, 10), generator=torch.Generator().manual_seed(b))
    ref = brute_force_sq_norms(model, lambda m, i: losses(m, inputs(ids))[i], b)
    got = per_sample_sq_norms(model, lambda m: losses(m, inputs(ids)), "exact")
    assert torch.allclose(got, ref, rtol=1e-10, atol=0)

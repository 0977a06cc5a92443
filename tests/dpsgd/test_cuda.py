"""The trainer's workloads on a CUDA GPU (skipped without one): exact norms against brute force, the clip
bound in bf16 and under autocast, and a private training loop with Hutchinson projections drawn on the GPU."""

import math

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

pytest.importorskip("transformers")
pytest.importorskip("peft")

from dpsgd import NormPlan, per_sample_sq_norms  # noqa: E402
from dpsgd.capture import Capture  # noqa: E402
from dpsgd.clipping import clipped_backward  # noqa: E402
from verify.hf_families import FAMILIES, exact_ready  # noqa: E402
from verify.workloads import VOCAB, brute_force_sq_norms, data, gpt2, lm_losses, make  # noqa: E402

from ..helpers import assert_holds_no_generator_state, engine_generators, private_lora_run  # noqa: E402


@pytest.mark.parametrize("name", ["gpt2_tied", "llama_tied", "bert", "lora_gpt2", "multihead_attention", "lstm",
                                  "llama_checkpointing"])
def test_exact_norms_on_cuda_equal_brute_force(name):
    model = make(name).cuda()
    ids = data(3).cuda()
    ref = brute_force_sq_norms(model, lambda m, i: lm_losses(m, ids[i:i + 1])[0], 3)
    for estimator in ("exact", "ghost"):
        got = per_sample_sq_norms(model, lambda m: lm_losses(m, ids), estimator)
        assert torch.allclose(got, ref, rtol=1e-6), (estimator, got, ref)


@pytest.mark.parametrize("estimator", ["ghost", "exact"])
@pytest.mark.parametrize("variant", ["bf16", "autocast"])
def test_cuda_bf16_clipped_contributions_stay_within_c(variant, estimator):
    # with exact norms the clipped contribution is at most C (hutch's estimated norms bound it only in the
    # randomized-clipping sense that the envelope accounts for, so it is not asserted here)
    torch.manual_seed(0)
    model = gpt2().cuda().train()
    if variant == "bf16":
        model = model.to(torch.bfloat16)
    plan = NormPlan.build(model, estimator)
    ids = data(4).cuda()
    for i in range(4):
        capture = Capture(plan)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=variant == "autocast"):
                losses = lm_losses(model, ids[i:i + 1])
            gen = torch.Generator(device="cuda").manual_seed(i)
            out = clipped_backward(capture, losses.float(), 1e-2, 8, gen)
        finally:
            capture.remove()
        total = math.sqrt(sum(float(s.double().square().sum()) for s in out.sums.values()))
        assert total <= 1e-2 * (1 + 1e-6)


def test_cuda_private_training_loop_with_hutch_under_autocast():
    engine, model, loader = private_lora_run("cuda", autocast=True)
    assert engine.steps == len(loader)
    assert all(p.device.type == "cuda" for p in model.parameters())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_gives_exact_per_example_norms_on_cuda(name):
    torch.manual_seed(0)
    model, inputs, losses = FAMILIES[name]()
    model = exact_ready(model).cuda()
    ids = torch.randint(1, VOCAB, (3, 8), generator=torch.Generator().manual_seed(3))

    def on_gpu(x):
        return {k: (v.double() if v.is_floating_point() else v).cuda() for k, v in inputs(x).items()}
    ref = brute_force_sq_norms(model, lambda m, i: losses(m, on_gpu(ids))[i], 3)
    got = per_sample_sq_norms(model, lambda m: losses(m, on_gpu(ids)), "exact")
    assert torch.allclose(got, ref, rtol=1e-6, atol=0), (got, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_precision_sums_use_the_wide_kernel_and_equal_float32_arithmetic(dtype):
    from dpsgd.handler import weighted_products, wide_kernel_available

    gen = torch.Generator().manual_seed(0)
    g, a = torch.randn(4, 64, 48, generator=gen).to(dtype), torch.randn(4, 64, 40, generator=gen).to(dtype)
    w = torch.tensor([1.0, 0.3, 0.0, 1e-3])
    assert wide_kernel_available(torch.device("cuda", torch.cuda.current_device()), dtype)
    got = weighted_products(g.cuda(), a.cuda(), w.cuda(), torch.float32).double().cpu()
    ref = torch.einsum("b,bto,bti->oi", w.double(), g.double(), a.double())
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_cuda_noise_is_drawn_on_the_gpu():
    engine, model, loader = private_lora_run("cuda", autocast=True)
    assert {g.device.type for g in engine_generators(engine)[1:]} == {"cuda"}


def test_a_cuda_runs_state_dict_holds_no_generator_state_and_a_resume_reseeds_the_gpu_generators():
    engine, model, loader = private_lora_run("cuda")
    state = engine.state_dict()
    assert_holds_no_generator_state(state, engine)
    cuda = [g for g in engine_generators(engine) if g.device.type == "cuda"]
    assert cuda   # projections and noise, drawn on the GPU
    before = [g.get_state().clone() for g in cuda]
    engine.load_state_dict(state)
    assert all(not torch.equal(g.get_state(), b) for g, b in zip(cuda, before, strict=True))

"""The trainer's workloads on a CUDA GPU (skipped without one): exact norms against brute force, the clip
bound in bf16 and under autocast, and a private training loop with Hutchinson projections drawn on the GPU."""

import math

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

pytest.importorskip("transformers")
pytest.importorskip("peft")

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from dpsgd import NormPlan, PrivacyEngine, per_sample_sq_norms  # noqa: E402
from dpsgd.engine import Capture, clipped_backward  # noqa: E402

from .workloads import brute_force_sq_norms, data, gpt2, lm_losses, make  # noqa: E402


@pytest.mark.parametrize("name", ["gpt2_tied", "llama_tied", "bert", "lora_gpt2", "multihead_attention", "lstm",
                                  "llama_checkpointing"])
def test_exact_norms_on_cuda_equal_brute_force(name):
    model = make(name).cuda()
    ids = data(3).cuda()
    ref = brute_force_sq_norms(model, lambda m, i: lm_losses(m, ids[i:i + 1])[0], 3)
    for estimator in ("exact", "ghost"):
        got = per_sample_sq_norms(model, lambda m: lm_losses(m, ids), estimator)
        assert torch.allclose(got, ref, rtol=1e-6), (estimator, got, ref)


@pytest.mark.parametrize("variant", ["bf16", "autocast"])
def test_cuda_bf16_clipped_contributions_stay_within_c(variant):
    torch.manual_seed(0)
    model = gpt2().cuda().train()
    if variant == "bf16":
        model = model.to(torch.bfloat16)
    plan = NormPlan.build(model, "hutch")
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


def test_cuda_private_training_loop_with_hutch():
    torch.manual_seed(0)
    model = make("lora_gpt2", dtype=torch.float32).cuda()
    ids = torch.randint(1, 40, (64, 8))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(ids, ids), batch_size=16),
        criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=1.0, estimator="hutch", k=8, seed=0)
    for x, y in loader:
        x, y = x.cuda(), y.cuda()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x).logits
        crit(logits[:, :-1].float(), y[:, 1:]).backward()
        opt.step()
    assert engine.steps == len(loader)
    assert all(p.device.type == "cuda" for p in model.parameters())

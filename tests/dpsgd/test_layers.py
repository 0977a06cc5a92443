"""Native handlers (convolutions, normalization layers, Hugging Face RMSNorm): per-example norms equal brute-force
per-example gradients for every estimator that is exact, randomized ones are unbiased, and each handler's
chi-square term count is what the envelope is given."""

import pytest
import torch
from torch import nn

from dpsgd import NormPlan, per_sample_sq_norms
from dpsgd.layers import ConvHandler, handler_for
from dpsgd.materialized import FunctionalHandler, NormalizationHandler, ScaledRMSNormHandler
from verify.workloads import brute_force_sq_norms, sem


def brute(model, x, b):
    ps = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(b):
        gs = torch.autograd.grad(model(x[i:i + 1]).square().sum(), ps, allow_unused=True)
        out.append(sum(g.double().square().sum() for g in gs if g is not None))
    return torch.stack(out)


class OffsetRMSNorm(nn.Module):
    """Gemma's form, ``(1 + w) * x_hat``: looks like a Hugging Face RMSNorm by name but is not ``w * x_hat``."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(dim))
        self.eps = 1e-6

    def forward(self, x):
        return (1 + self.weight) * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps))


class LlamaLikeRMSNorm(OffsetRMSNorm):
    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Tokens(nn.Module):
    """(B, C, L) -> (B, L, C) -> a norm over channels -> flat."""

    def __init__(self, conv, norm, out):
        super().__init__()
        self.conv, self.norm, self.head = conv, norm, nn.LazyLinear(out)

    def forward(self, x):
        return self.head(self.norm(self.conv(x).transpose(1, 2)).flatten(1))


CASES = {
    "conv2d_stride_dilation": (lambda: nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.GroupNorm(1, 5), nn.Tanh(),
                                                      nn.Conv2d(5, 4, (2, 3), stride=2, dilation=(1, 2)),
                                                      nn.Flatten(), nn.LazyLinear(2)), (4, 3, 7, 6)),
    "conv2d_same_reflect": (lambda: nn.Sequential(nn.Conv2d(3, 4, 4, padding="same", padding_mode="reflect"),
                                                   nn.GroupNorm(2, 4), nn.Flatten(), nn.LazyLinear(2)), (4, 3, 6, 6)),
    "conv2d_grouped_circular": (lambda: nn.Sequential(nn.Conv2d(4, 4, 3, groups=2, padding=1,
                                                                padding_mode="circular"),
                                                      nn.Flatten(), nn.LazyLinear(2)), (4, 4, 5, 5)),
    "conv1d_layernorm": (lambda: Tokens(nn.Conv1d(3, 6, 3, padding="same"), nn.LayerNorm(6), 2), (4, 3, 8)),
    "conv1d_replicate_rmsnorm": (lambda: Tokens(nn.Conv1d(3, 6, 2, stride=2, padding=1, padding_mode="replicate",
                                                          bias=False), nn.RMSNorm(6), 2), (4, 3, 9)),
    "layernorm_no_bias": (lambda: Tokens(nn.Conv1d(3, 6, 1), nn.LayerNorm(6, bias=False), 2), (4, 3, 5)),
    "hf_style_rmsnorm": (lambda: Tokens(nn.Conv1d(3, 6, 1), LlamaLikeRMSNorm(6), 2), (4, 3, 5)),
    "offset_rmsnorm": (lambda: Tokens(nn.Conv1d(3, 6, 1), OffsetRMSNorm(6), 2), (4, 3, 5)),
}


def build(name, dtype=torch.float64):
    torch.manual_seed(0)
    make, shape = CASES[name]
    model = make()
    x = torch.randn(*shape)
    model(x)                       # materialize the lazy head
    return model.to(dtype).train(), x.to(dtype)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("estimator", ["exact", "ghost"])
def test_native_handler_norms_equal_brute_force(name, estimator):
    model, x = build(name)
    ref = brute(model, x, x.shape[0])
    got = per_sample_sq_norms(model, lambda m: m(x).square().sum(1), estimator)
    assert torch.allclose(got, ref, rtol=1e-10, atol=0)


@pytest.mark.parametrize("name", ["conv2d_stride_dilation", "conv1d_replicate_rmsnorm"])
@pytest.mark.parametrize("estimator", ["hutch", "hutchpp"])
def test_convolution_norm_estimates_are_unbiased(name, estimator):
    """Mean of 400 estimates within 5 standard errors of the brute-force norm (two-sided z-test at about 6e-7 per
    example; fixed seeds)."""
    model, x = build(name)
    ref = brute(model, x, x.shape[0])
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack([per_sample_sq_norms(model, lambda m: m(x).square().sum(1), estimator, k=2, generator=gen)
                         for _ in range(400)])
    assert torch.all((draws.mean(0) - ref).abs() < 5 * sem(draws) + 1e-9 * ref)


def test_handler_choice_and_term_counts():
    model, _ = build("conv2d_stride_dilation")
    assert isinstance(handler_for(model[0]), ConvHandler) and isinstance(handler_for(model[1]), NormalizationHandler)
    plan = NormPlan.build(model, "hutch")
    # Conv2d(3 -> 5, 3x3): weight 5 x 27, min = 5, bias 1; Conv2d(5 -> 4, 2x3): 4 x 30, min = 4, bias 1
    assert plan.terms["0.weight"] == 5 and plan.terms["0.bias"] == 1 and plan.terms["3.weight"] == 4
    assert plan.terms["1.weight"] is None                   # GroupNorm: exact
    grouped, _ = build("conv2d_grouped_circular")
    assert NormPlan.build(grouped, "hutch").terms["0.weight"] is None   # grouped: exact by torch.func
    assert isinstance(handler_for(LlamaLikeRMSNorm(4)), ScaledRMSNormHandler)
    assert isinstance(handler_for(OffsetRMSNorm(4)), ScaledRMSNormHandler)       # checked per call, see below


def test_an_rmsnorm_of_another_form_falls_back_to_exact_per_example_gradients(monkeypatch):
    model, x = build("offset_rmsnorm")
    used = []
    original = FunctionalHandler._vmap
    monkeypatch.setattr(FunctionalHandler, "_vmap", lambda self, call: used.append(call) or original(self, call))
    got = per_sample_sq_norms(model, lambda m: m(x).square().sum(1), "exact")
    assert used and torch.allclose(got, brute(model, x, x.shape[0]), rtol=1e-10, atol=0)
    used.clear()
    model, x = build("hf_style_rmsnorm")
    per_sample_sq_norms(model, lambda m: m(x).square().sum(1), "exact")
    assert not used                                         # the closed form matched the recorded output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_handlers_in_lower_precision_are_close_to_float64(dtype):
    model, x = build("conv2d_stride_dilation")
    ref = brute(model, x, x.shape[0])
    low, xl = build("conv2d_stride_dilation", dtype)
    got = per_sample_sq_norms(low, lambda m: m(xl).float().square().sum(1), "exact")
    assert got.dtype == torch.float64
    assert torch.allclose(got, ref, rtol=1e-4 if dtype == torch.float32 else 0.1)


class BatchCentered(nn.Module):
    """A parameterized module that subtracts the batch mean: example i's output depends on the others."""

    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.scale * (x - x.mean(0, keepdim=True))


def test_a_module_that_mixes_examples_is_refused_at_the_backward():
    """The row check's exact zeros place the mixing between the output of 0 and that of 1 (module 1 itself)."""
    from dpsgd import ExampleMixingError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), BatchCentered(6), nn.Linear(6, 1)).double().train()
    x = torch.randn(5, 4, dtype=torch.float64)
    with pytest.raises(ExampleMixingError, match="after 0's output and before the output of 1"):
        per_sample_sq_norms(model, lambda m: m(x).square().sum(1), "exact")


class _Seeded(nn.Module):
    """An LSTM or GRU given an initial state computed from the input (``(layers, B, H)``: batch in dim 1)."""

    def __init__(self, cls):
        super().__init__()
        self.cls = cls
        self.rnn = cls(3, 4, num_layers=2, batch_first=True)
        self.init = nn.Linear(3, 16 if cls is nn.LSTM else 8)

    def forward(self, x):
        h = self.init(x[:, 0]).reshape(x.shape[0], 2, -1, 4).permute(1, 2, 0, 3)   # (layers, k, B, H)
        hx = (h[:, 0].contiguous(), h[:, 1].contiguous()) if self.cls is nn.LSTM else h[:, 0].contiguous()
        y, _ = self.rnn(x, hx)
        return y.square().sum((1, 2))


class _Masked(nn.Module):
    """nn.MultiheadAttention with a causal (T, T) mask, or the same mask per head as (B * heads, T, T)."""

    def __init__(self, per_head):
        super().__init__()
        self.attn, self.per_head = nn.MultiheadAttention(8, 2, batch_first=True), per_head

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        if self.per_head:
            mask = mask.expand(x.shape[0] * 2, t, t)
        y, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        return y.square().sum((1, 2))


@pytest.mark.parametrize("make", [lambda: _Seeded(nn.LSTM), lambda: _Seeded(nn.GRU), lambda: _Masked(False),
                                  lambda: _Masked(True)], ids=["lstm-h0-c0", "gru-h0", "mha-2d-mask", "mha-3d-mask"])
def test_initial_states_and_attention_masks_give_exact_per_example_norms(make):
    """States batched in their second dimension and masks shared by the batch (even when T equals B) or given
    per head are sliced per example as the module reads them: brute force to 1e-12, at B = 1, B = T and B = 3."""
    torch.manual_seed(0)
    model = make().double().train()
    for b in (1, 4, 3):
        x = torch.randn(b, 4, 3 if isinstance(model, _Seeded) else 8, dtype=torch.float64)
        got = per_sample_sq_norms(model, lambda m, x=x: m(x), "exact")
        ref = brute_force_sq_norms(model, lambda m, i, x=x: m(x)[i], b)
        assert torch.allclose(got, ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weighted_products_of_half_inputs_are_the_wide_arithmetic_of_the_same_values(dtype):
    from dpsgd.handler import weighted_products

    gen = torch.Generator().manual_seed(0)
    g, a = torch.randn(4, 16, 6, generator=gen).to(dtype), torch.randn(4, 16, 5, generator=gen).to(dtype)
    w = torch.tensor([1.0, 0.3, 0.0, 1e-3])
    got = weighted_products(g, a, w, torch.float32)
    ref = torch.einsum("b,bto,bti->oi", w.double(), g.double(), a.double())
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), ref, rtol=1e-6, atol=1e-6)


def test_full_float32_turns_tf32_off_inside_and_restores_the_settings():
    from dpsgd.handler import full_float32

    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision
    with full_float32():
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.backends.cudnn.fp32_precision == "ieee"
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision) == before

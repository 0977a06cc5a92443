"""The DP-SGD-RC step: whole-model per-sample norms against torch.func, and the trainer's step (one step of
:class:`dpsgd.PrivacyEngine` on a whole batch): clipping, noise-free equivalence, atomicity on bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpsgd import per_sample_sq_norms

from ..helpers import private_update


@pytest.fixture(autouse=True)
def _float64():
    """float64 inside this module only, so comparisons with torch.func are tight."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


class TinyDecoder(nn.Module):
    """Embedding, one causal self-attention block (Linear q/k/v/o), LayerNorm, MLP, untied head."""

    def __init__(self, vocab=11, dim=8, hidden=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        t = idx.shape[1]
        att = (self.q(x) @ self.k(x).transpose(1, 2)) / math.sqrt(x.shape[-1])
        att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        x = x + self.o(att @ self.v(x))
        x = x + self.down(torch.tanh(self.up(self.norm(x))))
        return self.head(x)


def _data(b=4, t=6, vocab=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=gen), torch.randint(0, vocab, (b, t), generator=gen)


def _loss_fn(idx, tgt):
    return lambda m: F.cross_entropy(m(idx).transpose(1, 2), tgt, reduction="none").sum(1)


def _losses(tgt):
    """``losses(model, rows)`` for :func:`private_update` (its rows are the batch, in order)."""
    return lambda m, idx: F.cross_entropy(m(idx).transpose(1, 2), tgt, reduction="none").sum(1)


def _reference_norms(model, idx, tgt):
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss_one(p, i, y):
        out = torch.func.functional_call(model, p, (i.unsqueeze(0),))
        return F.cross_entropy(out.transpose(1, 2), y.unsqueeze(0), reduction="sum")

    grads = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(params, idx, tgt)
    return sum(g.reshape(g.shape[0], -1).square().sum(1) for g in grads.values())


def test_exact_and_ghost_whole_model_norms_equal_torch_func():
    torch.manual_seed(0)
    model = TinyDecoder()
    idx, tgt = _data()
    ref = _reference_norms(model, idx, tgt)
    for est in ("exact", "ghost"):
        got = per_sample_sq_norms(model, _loss_fn(idx, tgt), est)
        assert torch.allclose(got.double(), ref, rtol=1e-5), est
    assert all(p.grad is None for p in model.parameters())  # the first pass leaves .grad alone


# Hutch++ with -m slow (10 s each; Hutch++'s unbiasedness on HF models is also in test_trainer_workloads)
@pytest.mark.parametrize("estimator", ["hutch", pytest.param("hutchpp", marks=pytest.mark.slow)])
def test_randomized_whole_model_norms_agree_in_expectation(estimator):
    """Mean of 500 estimates within 4.5 standard errors of torch.func's exact norms (4 examples; a two-sided z-test
    at about 7e-6 per example, fixed seeds)."""
    torch.manual_seed(1)
    model = TinyDecoder()
    idx, tgt = _data(seed=1)
    ref = _reference_norms(model, idx, tgt)
    gen = torch.Generator().manual_seed(2)
    draws = torch.stack([per_sample_sq_norms(model, _loss_fn(idx, tgt), estimator, k=2, generator=gen)
                         for _ in range(500)]).double()
    se = draws.std(0) / math.sqrt(draws.shape[0])
    assert torch.all((draws.mean(0) - ref).abs() < 4.5 * se + 1e-6 * ref)


def test_noise_free_step_with_huge_threshold_is_the_non_private_step():
    torch.manual_seed(2)
    model = TinyDecoder()
    ref_model = TinyDecoder()
    ref_model.load_state_dict(model.state_dict())
    idx, tgt = _data(b=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    private_update(model, idx, _losses(tgt), max_grad_norm=1e9, optimizer=opt, estimator="hutch", projection_dim=4)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5)
    (_loss_fn(idx, tgt)(ref_model).sum() / 5).backward()
    ref_opt.step()
    for p, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.allclose(p, r, atol=1e-12)


def test_exact_clipping_bounds_every_example_by_c():
    """One example per step, sigma = 0, SGD with lr 1 and expected batch 1: the update is the clipped
    gradient, whose norm is min(||g||, C)."""
    torch.manual_seed(3)
    idx, tgt = _data(b=6, seed=3)
    for i in range(6):
        model = TinyDecoder()
        norm = _reference_norms(model, idx[i:i + 1], tgt[i:i + 1]).sqrt().item()
        c = 0.5 * norm if i % 2 else 2 * norm
        moved = private_update(model, idx[i:i + 1], _losses(tgt[i:i + 1]), max_grad_norm=c).norm().item()
        assert moved <= c * (1 + 1e-9)
        assert moved == pytest.approx(min(norm, c), rel=1e-9)


def test_noise_has_the_stated_scale():
    """A zero-gradient model: the update is sigma C xi / B-bar (B-bar = 3); its per-coordinate std within 5%."""
    model = nn.Linear(50, 40)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    x = torch.zeros(3, 50)
    private_update(model, x, lambda m, x: m(x).sum(1) * 0.0, max_grad_norm=2.0, noise_multiplier=1.5, lr=1.0)
    std = torch.cat([model.weight.flatten(), model.bias]).std().item()
    assert std == pytest.approx(1.5 * 2.0 / 3, rel=0.05)


def test_non_finite_loss_leaves_everything_unchanged():
    torch.manual_seed(4)
    model = TinyDecoder()
    idx, tgt = _data()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    private_update(model, idx, _losses(tgt), max_grad_norm=1.0, noise_multiplier=1.0, optimizer=opt)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for s in opt.state.values()]

    def bad(m, rows):
        return _losses(tgt)(m, rows) * torch.tensor([1.0, float("nan"), 1.0, 1.0])
    with pytest.raises(FloatingPointError, match="not finite|NaN"):
        private_update(model, idx, bad, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=opt)
    for k_, v in model.state_dict().items():
        assert torch.equal(v, state[k_])
    for s, ref in zip(opt.state.values(), opt_state, strict=True):
        for k_, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(ref[k_]))
    assert all(p.grad is None for p in model.parameters())


def test_refusals_and_bad_arguments():
    idx, tgt = _data()
    model = TinyDecoder()
    kw = dict(max_grad_norm=1.0, noise_multiplier=1.0)
    for bad, match in [(dict(max_grad_norm=0.0), "max_grad_norm"), (dict(noise_multiplier=-1.0), "noise_multiplier"),
                       (dict(estimator="hutch", projection_dim=0), "projection_dim"),
                       (dict(estimator="jl"), "estimator")]:
        with pytest.raises(ValueError, match=match):
            private_update(model, idx, _losses(tgt), **{**kw, **bad})
    frozen = nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        per_sample_sq_norms(frozen, lambda m: m(torch.ones(2, 3)).sum(1))


class Conv1D(nn.Module):
    """GPT-2's Conv1D layout (transformers.pytorch_utils.Conv1D): weight (d, p), y = x W + b."""

    def __init__(self, nf, nx):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


def test_gpt2_conv1d_is_handled_like_linear():
    torch.manual_seed(5)
    model = nn.Sequential(Conv1D(7, 4), nn.Tanh(), Conv1D(3, 7))
    x, y = torch.randn(5, 6, 4), torch.randn(5, 6, 3)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss_one(p, xi, yi):
        return ((torch.func.functional_call(model, p, (xi.unsqueeze(0),)) - yi) ** 2).sum()
    grads = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    ref = sum(g.reshape(5, -1).square().sum(1) for g in grads.values())
    got = per_sample_sq_norms(model, lambda m: ((m(x) - y) ** 2).sum((1, 2)), "ghost")
    assert torch.allclose(got.double(), ref, rtol=1e-6)


def test_noisy_gradients_in_place_overwrite_the_sums_and_otherwise_leave_them():
    """The trainer's step adds noise into the clipped sums themselves: no second parameter-sized buffer."""
    from dpsgd.noise import noisy_gradients

    sums = [torch.ones(3, 2), torch.full((4,), 2.0)]
    kept = [s.clone() for s in sums]
    out = noisy_gradients(sums, 0.5, 4.0, torch.Generator().manual_seed(0))
    assert all(torch.equal(s, k) for s, k in zip(sums, kept, strict=True))
    again = noisy_gradients(sums, 0.5, 4.0, torch.Generator().manual_seed(0), in_place=True)
    assert all(a.data_ptr() == s.data_ptr() for a, s in zip(again, sums, strict=True))
    assert all(torch.equal(a, o) for a, o in zip(again, out, strict=True))


def test_noise_drawn_into_a_reused_buffer_is_the_generators_gaussian_stream():
    # the same draws as torch.randn from the same generator state, tensor after tensor (a checkpoint's generator
    # state continues the same noise)
    from dpsgd.noise import noisy_gradients

    shapes = [(3, 5), (7,), (), (2, 2)]
    got = noisy_gradients([torch.zeros(s) for s in shapes], 1.0, 1.0, torch.Generator().manual_seed(3))
    ref = torch.Generator().manual_seed(3)
    for g, s in zip(got, shapes, strict=True):
        assert torch.equal(g, torch.randn(s, generator=ref))


def test_noise_for_a_tensor_larger_than_a_chunk_is_drawn_chunk_by_chunk_from_one_small_buffer(monkeypatch):
    """With chunks of 64 draws, a 1000-element sum gets the generator's draws chunk after chunk (no 1000-element
    noise tensor), and they are standard normal: mean within 5 standard errors of 0, variance within 5 of 1."""
    import dpsgd.noise as engine

    monkeypatch.setattr(engine, "NOISE_CHUNK", 64)
    made = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(a) or real_empty(*a, **k))
    got = engine.noisy_gradients([torch.zeros(10, 100)], 1.0, 1.0, torch.Generator().manual_seed(5))[0].flatten()
    monkeypatch.setattr(torch, "empty", real_empty)
    assert made == [(64,)]
    ref, gen = [], torch.Generator().manual_seed(5)
    for start in range(0, 1000, 64):
        ref.append(torch.empty(min(64, 1000 - start)).normal_(generator=gen))
    assert torch.equal(got, torch.cat(ref))
    assert abs(float(got.mean())) < 5 / 1000 ** 0.5 and abs(float(got.var()) - 1) < 5 * (2 / 1000) ** 0.5

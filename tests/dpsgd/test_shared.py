"""Outputs shared by the batch (positions from torch.arange, T5's relative position bias, prompt tuning, BART's
positions when the batch equals the length, parameters of the model itself) and decoder inputs the model computes
from the labels: exact per-example norms against brute force in float64 at B = 1, B = T and another B, training
through make_private, and refusals that name the fix."""

import logging

import pytest
import torch
from torch import nn

from dpsgd import IncompleteGradientError, PrivacyEngine, per_sample_sq_norms
from dpsgd.materialized import RootParameterHandler
from verify.workloads import SHARED_OUTPUTS, VOCAB, OwnParameters, brute_force_sq_norms, token_losses

from ..helpers import private_update

logging.getLogger("transformers").setLevel(logging.ERROR)
T = 6


@pytest.mark.parametrize("b", [1, 3, T], ids=["B=1", "B=3", "B=T"])
@pytest.mark.parametrize("name", list(SHARED_OUTPUTS))
def test_outputs_shared_by_the_batch_give_exact_per_example_norms(name, b):
    if name not in ("nanogpt-arange", "own-parameters"):
        pytest.importorskip("transformers")
        pytest.importorskip("peft")
    build, losses = SHARED_OUTPUTS[name]
    torch.manual_seed(0)
    model = build().double().train()
    ids = torch.randint(1, VOCAB, (b, T), generator=torch.Generator().manual_seed(b))
    ref = brute_force_sq_norms(model, lambda m, i: losses(m, ids)[i], b)
    got = per_sample_sq_norms(model, lambda m: losses(m, ids), "exact")
    assert torch.allclose(got, ref, rtol=1e-10, atol=0)


def test_parameters_of_the_model_itself_get_their_own_handler_and_train_without_a_re_run():
    engine = PrivacyEngine()
    model = OwnParameters()
    ids = torch.randint(1, VOCAB, (32, T))
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8),
        max_grad_norm=1.0, noise_multiplier=1.0, estimator="hutch", projection_dim=4, seed=0)
    assert any(isinstance(u.handler, RootParameterHandler) and not u.path for u in engine.plan.units)
    assert "RootParameterHandler" in str(engine.plan)
    before = model.pos.detach().clone()
    for (x,) in loader:
        engine.private_loss(token_losses(model(x), x)).backward()
        opt.step()
    assert engine.steps == len(loader) and not torch.equal(before, model.pos)


class NeverMeets(nn.Module):
    """A shared output that becomes the loss of some examples without meeting any example's rows."""

    def __init__(self):
        super().__init__()
        self.lin, self.bias = nn.Linear(4, 1), nn.Embedding(3, 1)

    def forward(self, x):
        return torch.cat([self.lin(x).squeeze(1)[:2], self.bias(torch.arange(3)).squeeze(1)])


def test_a_shared_output_that_never_meets_the_batch_is_refused():
    with pytest.raises(ValueError, match=r"bias's output has shape \(3, 1\), which does not start with the batch"):
        per_sample_sq_norms(NeverMeets(), lambda m: m(torch.randn(5, 4)), "exact")


class Escapes(nn.Module):
    """Part of a shared output's gradient goes around the tracked operations (computed with torch function
    handling switched off)."""

    def __init__(self):
        super().__init__()
        self.pos, self.head = nn.Embedding(4, 3), nn.Linear(3, 2)

    def forward(self, x):
        p = self.pos(torch.arange(4))                       # (4, 3), shared
        with torch._C.DisableTorchFunctionSubclass():
            hidden = (x * p).sum((1, 2))                    # not seen meeting the batch
        return self.head(x + p).square().mean((1, 2)) + hidden


def test_a_shared_output_whose_gradient_goes_around_the_meetings_is_refused():
    with pytest.raises(IncompleteGradientError, match=r"pos's output is shared by the batch, and part of its gradient"):
        per_sample_sq_norms(Escapes(), lambda m: m(torch.randn(5, 4, 3)), "exact")


class _ScaledLinear(nn.Linear):
    """A subclass of nn.Linear whose forward is not x @ W.T + b."""

    def forward(self, x):
        return 2 * super().forward(x)


class _AddsInPlace(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.a, self.b, self.op = nn.Linear(4, 4), nn.Linear(4, 4), op
        self.g = nn.Parameter(torch.tensor(0.0))

    def forward(self, x):
        out = self.a(x)
        if self.op == "add":
            out += self.b(x)        # Falcon's parallel attention: the gradient of `out` is unchanged
        elif self.op == "mul":
            out *= 2                # changes the gradient with respect to the recorded output: refused
        else:
            # an addition computed from the output itself (here a batch statistic behind a gate at zero): its
            # gradient would reach the output behind the row check's hooks, which sit on the sum: refused
            out += self.g * out.sum(0)
        return out.sum(1)


def test_a_linear_subclass_is_read_as_linear_only_when_its_forward_is_x_w_plus_b():
    from dpsgd.validator import UnsupportedModuleError

    x = torch.randn(5, 4)
    with pytest.raises(UnsupportedModuleError, match=r"_ScaledLinear subclasses nn.Linear .* register a handler"):
        per_sample_sq_norms(nn.Sequential(_ScaledLinear(4, 3)), lambda m: m(x).sum(1), "exact")


@pytest.mark.parametrize("op", ["add", "mul", "add-of-itself"])
def test_a_layer_output_added_to_in_place_keeps_exact_norms_and_other_in_place_ops_are_refused(op):
    torch.manual_seed(0)
    model = _AddsInPlace(op).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    if op != "add":
        with pytest.raises(IncompleteGradientError, match="modified in place"):
            per_sample_sq_norms(model, lambda m: m(x), "exact")
        return
    ref = brute_force_sq_norms(model, lambda m, i: m(x)[i], 5)
    assert torch.allclose(per_sample_sq_norms(model, lambda m: m(x), "exact"), ref, rtol=1e-10, atol=0)


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum()


class _OwnThroughFunction(nn.Module):
    """Two parameters of the model itself: one meets the batch in a followed operation, the other only inside a
    custom autograd.Function, whose operations the trainer cannot follow."""

    def __init__(self):
        super().__init__()
        self.scale, self.w = nn.Parameter(torch.tensor(1.5)), nn.Parameter(torch.tensor(0.7))
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        return _Scale.apply(self.lin(x).squeeze(1) * self.scale, self.w)


@pytest.mark.parametrize("b", [1, 3])
def test_a_parameter_of_the_model_used_only_where_the_trainer_cannot_follow_is_refused(b):
    with pytest.raises(IncompleteGradientError, match="shared by the batch reached the losses without meeting"):
        per_sample_sq_norms(_OwnThroughFunction(), lambda m: m(torch.randn(b, 4)), "exact")


class _ClassToken(nn.Module):
    """A ViT-style class token: ``torch.cat([cls.expand(B, -1, -1), x], 1)``."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 4))
        self.proj, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.proj(x)], 1)
        return self.head(torch.tanh(h)).square().mean((1, 2))


@pytest.mark.parametrize("b", [1, 3, 5])
def test_a_class_token_expanded_to_the_batch_gives_exact_per_example_norms(b):
    torch.manual_seed(0)
    model = _ClassToken().double()
    x = torch.randn(b, 5, 4, dtype=torch.float64)
    ref = brute_force_sq_norms(model, lambda m, i: m(x)[i], b)
    assert torch.allclose(per_sample_sq_norms(model, lambda m: m(x), "exact"), ref, rtol=1e-10, atol=0)


class _GatedLinear(nn.Linear):
    """A subclass of nn.Linear with a parameter of its own beyond weight and bias."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gate = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return super().forward(x) * (1 + self.gate)


def test_a_linear_subclass_with_parameters_of_its_own_goes_to_the_exact_fallback():
    from dpsgd.layers import handler_for
    from dpsgd.materialized import FunctionalHandler

    assert type(handler_for(_GatedLinear(4, 3))) is FunctionalHandler
    torch.manual_seed(0)
    model = nn.Sequential(_GatedLinear(4, 3)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    ref = brute_force_sq_norms(model, lambda m, i: m(x).sum(1)[i], 3)
    assert torch.allclose(per_sample_sq_norms(model, lambda m: m(x).sum(1), "exact"), ref, rtol=1e-10, atol=0)


@pytest.mark.parametrize("name", ["nanogpt-arange", "own-parameters"])
def test_adding_one_example_moves_the_clipped_sum_by_at_most_c_through_shared_outputs(name):
    """The bound itself, through outputs every example reads: with sigma = 0 and lr = 1, the update of a batch and of
    the same batch plus one example differ by at most C (float64), the added example's whole gradient (its part
    through the shared positions and the model's own parameters included) clipped once."""
    build, losses = SHARED_OUTPUTS[name]
    c = 0.05
    ids = torch.randint(1, VOCAB, (6, T), generator=torch.Generator().manual_seed(3))

    def update(batch):
        torch.manual_seed(0)
        model = build().double().train()
        return private_update(model, batch, losses, max_grad_norm=c)

    gap = float((update(ids) - update(ids[:-1])).norm())
    assert 0 < gap <= c * (1 + 1e-9)

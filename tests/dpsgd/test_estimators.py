"""Per-sample norm estimators: exact == ghost == torch.func; Hutch and Hutch++ unbiased; Hutch's variance."""

import math

import pytest
import torch
from torch import nn

from dpsgd.estimators import ESTIMATORS, exact, ghost, hutch, hutchpp


def _inputs(b=3, t=7, d=5, p=6, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, d, generator=gen, dtype=dtype), torch.randn(b, t, p, generator=gen, dtype=dtype)


@pytest.mark.parametrize("shape", [(3, 7, 5, 6), (2, 1, 8, 3), (4, 12, 2, 2)],
                         ids=["ghost-materializes", "ghost-gram", "ghost-materializes-narrow"])
def test_exact_equals_ghost_equals_torch_func(shape):
    b, t, d, p = shape
    layer = nn.Linear(d, p, bias=False).double()
    x = torch.randn(b, t, d, dtype=torch.float64)
    target = torch.randn(b, t, p, dtype=torch.float64)

    def loss_one(w, xi, yi):
        out = torch.func.functional_call(layer, {"weight": w}, (xi.unsqueeze(0),))
        return ((out - yi.unsqueeze(0)) ** 2).sum()

    grads = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(layer.weight, x, target)
    ref = grads.square().sum(dim=(1, 2))
    out = layer(x)
    g = 2 * (out - target)  # dL_i/dS_i for the per-sample squared error
    assert torch.allclose(exact(x, g), ref, rtol=1e-12)
    assert torch.allclose(ghost(x, g), ref, rtol=1e-12)


def test_two_dimensional_inputs_are_t_equal_one():
    a, g = _inputs(t=1)
    for name in ("exact", "ghost"):
        assert torch.allclose(ESTIMATORS[name](a[:, 0], g[:, 0]), ESTIMATORS[name](a, g))
    gen1, gen2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.allclose(hutch(a[:, 0], g[:, 0], 4, gen1), hutch(a, g, 4, gen2))


@pytest.mark.parametrize("estimator", [hutch, hutchpp])
@pytest.mark.parametrize("d, p", [(3, 8), (8, 3), (6, 6)])
def test_randomized_estimators_are_unbiased(estimator, d, p):
    """Mean of N = 6000 independent estimates within 4.5 standard errors of the exact value
    (a two-sided normal bound of confidence 1 - 7e-6 per example; 3 examples x 6 cases)."""
    a, g = _inputs(d=d, p=p)
    truth = exact(a, g)
    gen = torch.Generator().manual_seed(11)
    draws = torch.stack([estimator(a, g, 2, gen) for _ in range(6000)])
    se = draws.std(0) / math.sqrt(draws.shape[0])
    assert torch.all((draws.mean(0) - truth).abs() < 4.5 * se + 1e-12)


def test_hutch_variance_is_two_frobenius_squared_over_k():
    """Var = 2 ||M^T M||_F^2 / k for Gaussian probes; the sample variance of N = 20000 draws is within 6%
    (its relative standard error is about sqrt(2/N) (1 + kurtosis term) < 2%, so this is a > 3 SE bound)."""
    a, g = _inputs(b=2, d=4, p=9)
    m = torch.einsum("btd,btp->bdp", a, g)
    k = 3
    expected = 2 * torch.linalg.matrix_norm(m.transpose(1, 2) @ m).square() / k
    gen = torch.Generator().manual_seed(3)
    draws = torch.stack([hutch(a, g, k, gen) for _ in range(20000)])
    assert torch.allclose(draws.var(0), expected, rtol=0.06)


def test_hutchpp_is_exact_when_the_rank_fits_in_the_sketch():
    a, g = _inputs(d=3, p=10)
    gen = torch.Generator().manual_seed(0)
    assert torch.allclose(hutchpp(a, g, 3, gen), exact(a, g), rtol=1e-10)
    assert torch.allclose(hutchpp(g, a, 4, gen), exact(a, g), rtol=1e-10)  # transposed roles


def test_hutchpp_beats_hutch_on_a_dominant_direction():
    """One dominant singular value: Hutch++ captures it in the head, so its spread is far smaller."""
    gen = torch.Generator().manual_seed(2)
    b, t, d, p = 2, 16, 12, 12
    u, v = torch.randn(b, t, 1, generator=gen, dtype=torch.float64), torch.randn(b, 1, d, generator=gen,
                                                                                 dtype=torch.float64)
    a = 10 * u @ v + 0.1 * torch.randn(b, t, d, generator=gen, dtype=torch.float64)
    g = torch.randn(b, t, p, generator=gen, dtype=torch.float64)
    h = torch.stack([hutch(a, g, 4, gen) for _ in range(500)])
    hp = torch.stack([hutchpp(a, g, 4, gen) for _ in range(500)])
    assert torch.all(hp.std(0) < 0.2 * h.std(0))


def test_low_precision_inputs_are_computed_in_float32():
    a, g = _inputs(dtype=torch.float64)
    ref = exact(a, g)
    for dt in (torch.bfloat16, torch.float16):
        out = exact(a.to(dt), g.to(dt))
        assert out.dtype == torch.float32
        assert torch.allclose(out.double(), ref, rtol=3e-2)
        assert hutch(a.to(dt), g.to(dt), 4).dtype == torch.float32


def test_generator_makes_estimates_reproducible():
    a, g = _inputs()
    one = hutchpp(a, g, 2, torch.Generator().manual_seed(9))
    two = hutchpp(a, g, 2, torch.Generator().manual_seed(9))
    assert torch.equal(one, two)


@pytest.mark.parametrize("call, match", [
    (lambda a, g: hutch(a, g, 0), "projection_dim .k. must be a positive integer"),
    (lambda a, g: hutchpp(a, g, 2.5), "projection_dim .k. must be a positive integer"),
    (lambda a, g: exact(a[:2], g), "agree in batch"),
    (lambda a, g: ghost(a[0, 0], g), "shapes"),
    (lambda a, g: exact(a.numpy(), g), "torch tensors"),
])
def test_bad_input(call, match):
    a, g = _inputs()
    with pytest.raises(ValueError, match=match):
        call(a, g)

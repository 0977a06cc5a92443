"""Paper 004's spectrum tools: orthogonal iteration, decay fit, restricted-Lipschitz proxies, recorder."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpsgd.spectrum import GradientRecorder, decay_fit, restricted_lipschitz, top_singular


def _planted(r, p, values, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = len(values)
    u, _ = torch.linalg.qr(torch.randn(r, m, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(p, m, generator=gen, dtype=torch.float64))
    return u @ torch.diag(torch.as_tensor(values, dtype=torch.float64)) @ v.T, v


def test_orthogonal_iteration_recovers_a_planted_low_rank_spectrum_to_1e6():
    values = [10.0, 7.0, 4.0, 2.5, 1.0, 0.5, 0.2, 0.05]
    H, v = _planted(60, 500, values)
    top = top_singular(H, 5, iters=3, oversample=3, method="iteration",   # rank 8 = the block: exact
                       generator=torch.Generator().manual_seed(1))
    assert torch.allclose(top.values, torch.tensor(values[:5], dtype=torch.float64), rtol=1e-6)
    # the right vectors span the planted ones (up to sign) and are orthonormal
    assert torch.allclose(top.vectors.T @ top.vectors, torch.eye(5, dtype=torch.float64), atol=1e-10)
    assert torch.allclose((v[:, :5].T @ top.vectors).abs(), torch.eye(5, dtype=torch.float64), atol=1e-6)


def test_orthogonal_iteration_converges_on_a_full_rank_decaying_spectrum():
    values = [k ** -0.6 for k in range(1, 81)]
    H, _ = _planted(80, 400, values, seed=3)
    exact = torch.linalg.svdvals(H)[:10]
    top = top_singular(H, 10, iters=40, oversample=20, method="iteration", generator=torch.Generator().manual_seed(2))
    assert torch.allclose(top.values, exact, rtol=1e-6)
    gram = top_singular(H, 10, method="gram")
    assert torch.allclose(gram.values, exact, rtol=1e-10)
    # the same subspace: projections onto the two bases agree
    assert torch.allclose(gram.vectors @ gram.vectors.T @ top.vectors, top.vectors, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(c=st.floats(0.1, 2.0), a=st.floats(-3.0, 3.0))
def test_decay_fit_recovers_a_planted_exponent(c, a):
    fit = decay_fit([math.exp(a) * k ** -c for k in range(1, 200)])
    assert fit.exponent == pytest.approx(c, abs=1e-9) and fit.intercept == pytest.approx(a, abs=1e-9)
    assert fit.stderr < 1e-9


def test_decay_fit_interval_covers_the_exponent_under_noise():
    # multiplicative log-normal noise on a k^{-0.6} spectrum: the 95 % interval covers 0.6 in about 95 % of
    # fixed-seed draws (binomial: >= 85 of 100 at far beyond 3 standard deviations of 95)
    gen = torch.Generator().manual_seed(4)
    ks = torch.arange(1, 301, dtype=torch.float64)
    covered = 0
    for _ in range(100):
        noisy = ks ** -0.6 * torch.exp(0.2 * torch.randn(300, generator=gen, dtype=torch.float64))
        lo, hi = decay_fit(noisy).ci95
        covered += lo <= 0.6 <= hi
    assert covered >= 85


def test_restricted_lipschitz_proxies_are_the_tail_norms():
    H, v = _planted(30, 200, [5.0, 3.0, 1.0, 0.5])
    out = restricted_lipschitz(H, v)
    norms = H.norm(dim=1)
    assert torch.allclose(out["max"][0], norms.max()) and torch.allclose(out["rms"][0], norms.pow(2).mean().sqrt())
    # the whole planted basis leaves nothing (to the stated 1e-8 of the norm: a difference of squares)
    assert out["max"][-1] < 1e-7 * norms.max() and torch.all(out["max"][1:] <= out["max"][:-1] + 1e-12)
    tail2 = H - (H @ v[:, :2]) @ v[:, :2].T
    assert torch.allclose(out["max"][2], tail2.norm(dim=1).max(), rtol=1e-10)
    # rms of the tail is sqrt(sum of the dropped squared singular values / r)
    assert out["rms"][1] == pytest.approx(math.sqrt((9 + 1 + 0.25) / 30), rel=1e-10)


def test_recorder_keeps_every_nth_gradient_and_refuses_missing_ones():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    rec = GradientRecorder(model.parameters(), every=3, max_rows=2)
    with pytest.raises(ValueError, match="no .grad"):
        rec.record()
    grads = []
    for step in range(7):
        model.zero_grad()
        model(torch.full((1, 4), float(step))).sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        rec.record()
    H = rec.matrix()                      # steps 0, 3, 6 recorded; the oldest dropped
    assert H.shape == (2, 4 * 3 + 3 + 3 + 1)
    assert torch.equal(H[0], grads[3]) and torch.equal(H[1], grads[6])


@pytest.mark.parametrize(("call", "name"), [
    (lambda: top_singular(torch.ones(3), 1), "H"),
    (lambda: top_singular(torch.ones(3, 4), 4), "k"),
    (lambda: top_singular(torch.ones(3, 4), 1, iters=0), "iters"),
    (lambda: top_singular(torch.ones(3, 4), 1, method="lanczos"), "method"),
    (lambda: top_singular(torch.full((3, 4), float("nan")), 1), "H"),
    (lambda: decay_fit([1.0, 0.5]), "ks"),
    (lambda: decay_fit([1.0, 0.0, 0.3, 0.2]), "values"),
    (lambda: restricted_lipschitz(torch.ones(3, 4), torch.ones(5, 2)), "vectors"),
    (lambda: GradientRecorder([], every=1), "parameters"),
    (lambda: GradientRecorder(torch.nn.Linear(2, 2).parameters(), every=0), "every"),
])
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_an_attached_recorder_sees_the_released_noisy_gradient_of_a_private_step():
    from torch.utils.data import DataLoader, TensorDataset

    from dpsgd import PrivacyEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    data = TensorDataset(torch.randn(40, 5), torch.randint(0, 2, (40,)))
    engine = PrivacyEngine()
    before = [p.detach().clone() for p in model.parameters()]
    m, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=8),
        criterion=torch.nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=1.0, seed=3)
    rec = GradientRecorder(model.parameters())
    handle = rec.attach(opt)
    x, y = next(iter(loader))
    opt.zero_grad()
    crit(m(x), y).backward()
    opt.step()
    handle.remove()
    (row,) = rec.rows
    update = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters(), strict=True)])
    assert torch.allclose(0.1 * row, update, atol=1e-6)      # SGD applied exactly the recorded gradient
    assert all(p.grad is None for p in model.parameters())   # the private optimizer cleared it afterwards


def _private_linear(projection=None, sigma=0.0):
    from torch.utils.data import DataLoader, TensorDataset

    from dpsgd import PrivacyEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    data = TensorDataset(torch.randn(40, 5, generator=torch.Generator().manual_seed(1)),
                         torch.randint(0, 2, (40,), generator=torch.Generator().manual_seed(2)))
    engine = PrivacyEngine()
    m, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=DataLoader(data, batch_size=8),
        criterion=torch.nn.CrossEntropyLoss(), max_grad_norm=0.5, noise_multiplier=sigma, estimator="exact", seed=3,
        gradient_projection=projection)
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    x, y = next(iter(loader))
    opt.zero_grad()
    crit(m(x), y).backward()
    opt.step()
    return before - torch.cat([p.detach().reshape(-1) for p in model.parameters()]), engine


def test_projected_step_applies_the_projection_of_the_clipped_mean_and_keeps_the_accounting():
    plain, _ = _private_linear()
    gen = torch.Generator().manual_seed(5)
    basis = torch.randn(plain.numel(), 6, generator=gen, dtype=torch.float64) * 3.0   # not orthonormal: fixed here
    projected, _ = _private_linear(basis)
    q, _ = torch.linalg.qr(basis)
    expected = (q @ (q.T @ plain.double())).float()
    assert torch.allclose(projected, expected, atol=1e-6)
    assert projected.norm() < plain.norm()                       # a contraction of the clipped sum
    # with noise, the ledger is the same as without the projection
    assert _private_linear(sigma=1.0)[1].accountant().events == _private_linear(basis, 1.0)[1].accountant().events


@pytest.mark.parametrize(("basis", "match"), [
    (torch.ones(7, 2), "gradient_projection must be a"),
    (torch.full((34, 2), float("nan")), "finite"),
    (torch.ones(34, 2), "linearly dependent"),
])
def test_a_bad_projection_basis_is_refused_with_the_reason(basis, match):
    with pytest.raises(ValueError, match=match):
        _private_linear(basis)


def test_an_ill_conditioned_projection_basis_cannot_lengthen_the_clipped_update():
    # columns nearly parallel (condition ~1e8, above the rank threshold) and scaled by 1e3: a projection built
    # from it as given (V V^T) would stretch the update; the orthonormalized one only shortens it
    plain, _ = _private_linear()
    gen = torch.Generator().manual_seed(7)
    u = torch.randn(plain.numel(), 1, generator=gen, dtype=torch.float64)
    basis = 1e3 * torch.cat([u, u + 1e-8 * torch.randn(plain.numel(), 1, generator=gen, dtype=torch.float64)], 1)
    assert (basis @ (basis.T @ plain.double())).norm() > 1e3 * plain.norm()
    projected, _ = _private_linear(basis)
    assert projected.norm() <= plain.norm() * (1 + 1e-6)

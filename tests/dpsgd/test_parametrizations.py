"""torch.nn.utils.parametrizations (weight_norm, orthogonal, spectral_norm) on linear, convolution and embedding
layers: per-example gradients of the original parameters equal brute force in float64 at B = 1, 3 and T, under
make_private they train; a parametrized module of another kind is refused by path."""

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations as P

from dpsgd import PrivacyEngine, per_sample_sq_norms
from dpsgd.validator import UnsupportedModuleError
from verify.workloads import VOCAB, Parametrized, brute_force_sq_norms, parametrized_losses

T = 6


@pytest.mark.parametrize("b", [1, 3, T])
@pytest.mark.parametrize("kind", ["weight_norm", "orthogonal", "spectral_norm"])
def test_parametrized_layers_give_exact_per_example_norms_of_their_original_parameters(kind, b):
    torch.manual_seed(0)
    model = Parametrized(kind).double().train()
    if kind == "spectral_norm":
        # brute force runs one forward per example, each a power-iteration step: converge it first, so that every
        # forward sees the same normalization (the private pass reuses the forward's vectors exactly)
        with torch.no_grad():
            for _ in range(300):
                model(torch.zeros(1, 2, dtype=torch.long))
    ids = torch.randint(1, VOCAB, (b, T), generator=torch.Generator().manual_seed(b))
    ref = brute_force_sq_norms(model, lambda m, i: parametrized_losses(m, ids)[i], b)
    got = per_sample_sq_norms(model, lambda m: parametrized_losses(m, ids), "exact")
    assert torch.allclose(got, ref, rtol=1e-6 if kind == "spectral_norm" else 1e-10, atol=0)


def test_spectral_norm_trains_privately_its_power_iteration_is_not_a_state_change():
    torch.manual_seed(0)
    model = Parametrized("spectral_norm")
    ids = torch.randint(1, VOCAB, (32, T))
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8),
        max_grad_norm=1.0, noise_multiplier=1.0, estimator="hutch", projection_dim=4, seed=0)
    for (x,) in loader:
        engine.private_loss(parametrized_losses(model, x)).backward()
        opt.step()
    assert engine.steps == len(loader)
    assert "ParametrizedHandler" in str(engine.plan)


def test_a_parametrized_module_without_a_handler_of_its_own_is_refused_by_path():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.w

    model = nn.Sequential(P.weight_norm(Scale(), name="w", dim=0), nn.Linear(4, 1))
    with pytest.raises(UnsupportedModuleError, match=r"0.parametrizations.w: .*linear, convolution or embedding"):
        per_sample_sq_norms(model, lambda m: m(torch.randn(3, 4)).squeeze(1), "exact")


def test_a_parametrized_layer_runs_without_torch_batching_notices():
    """weight_norm's backward has no vmap batching rule: torch's performance notice is not shown in every run."""
    import warnings

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), P.weight_norm(nn.Linear(4, 1)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        per_sample_sq_norms(model, lambda m: m(torch.randn(3, 4)).squeeze(1), "exact")
    assert not [w for w in caught if "performance drop" in str(w.message)]

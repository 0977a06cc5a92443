"""``estimator="auto"`` (make_private's default): the plan estimates a weight only where its exact norm costs at
least AUTO_COST_RATIO times the estimate's, the step computes the other norms exactly, the accountant's envelope
covers only what is estimated, and make_private logs the choice and its price in noise."""

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpmath import HutchPPEnvelope
from dpsgd import PrivacyEngine
from dpsgd.clipping import per_sample_sq_norms
from dpsgd.plan import AUTO_COST_RATIO, NormPlan, worth_estimating


def _wide():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 2))


def _private(model, **kw):
    data = TensorDataset(torch.randn(200, 20), torch.randint(0, 2, (200,)))
    engine = PrivacyEngine()
    out = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              data_loader=DataLoader(data, batch_size=10), criterion=nn.CrossEntropyLoss(),
                              max_grad_norm=1.0, **kw)
    return engine, out


@pytest.mark.parametrize("rows, cols, k", [(512, 512, 32), (256, 256, 16), (4096, 1024, 32), (100, 30, 4)])
def test_a_weight_is_estimated_exactly_when_its_exact_norm_costs_the_ratio_times_more(rows, cols, k):
    assert AUTO_COST_RATIO == 8
    assert worth_estimating((rows, cols), k) is (rows * cols >= 8 * k * (rows + cols))
    assert not worth_estimating((rows,), k)   # a bias or a scale: never
    assert worth_estimating((rows, cols, 3, 3), k) is (rows * cols * 9 >= 8 * k * (rows + cols * 9))   # a conv


@pytest.mark.parametrize("k, width", [(32, 512), (16, 256), (64, 1024)])
def test_square_weights_are_estimated_from_width_16_k_on(k, width):
    assert worth_estimating((width, width), k) and not worth_estimating((width - 1, width - 1), k)


def test_a_narrow_model_gets_exact_norms_and_the_noise_of_dp_sgd(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
    with caplog.at_level(logging.INFO, logger="dpsgd"):
        engine, _ = _private(model, target_epsilon=2.0, target_delta=1e-5, epochs=1)
    exact, _ = _private(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)), target_epsilon=2.0,
                        target_delta=1e-5, epochs=1, estimator="exact")
    assert engine.estimator == "auto" and engine.envelope is None and engine.plan.all_exact
    assert engine.noise_multiplier == engine.exact_noise_multiplier == exact.noise_multiplier
    assert "norm plan: estimator auto: every norm exact (4 parameters), accounted as DP-SGD" in caplog.text


def test_only_the_wide_weight_is_estimated_and_the_log_prices_it_against_exact_norms(caplog):
    with caplog.at_level(logging.INFO, logger="dpsgd"):
        engine, _ = _private(_wide(), target_epsilon=2.0, target_delta=1e-5, epochs=1)
    plan = engine.plan
    assert [r.parameter for r in plan.table() if r.norm == "hutch"] == ["2.weight"]
    assert plan.norm("2.weight") == "hutch" and plan.norm("0.weight") == "ghost" and plan.norm("2.bias") == "ghost"
    # the exact parts are point masses: the Hutch++ form over the estimated weight's 1024 terms only
    assert engine.envelope == HutchPPEnvelope(32, 1024)
    assert engine.noise_multiplier > engine.exact_noise_multiplier
    price = 100 * (engine.noise_multiplier / engine.exact_noise_multiplier - 1)
    assert (f"estimator auto: 1 of 6 parameters estimated with hutch (D = 1024), 5 exact; noise_multiplier "
            f"{engine.noise_multiplier:.4g} with the estimate against {engine.exact_noise_multiplier:.4g} with exact "
            f"norms (+{price:.1f} % noise)") in caplog.text


def test_the_step_computes_the_norms_the_plan_leaves_exact_exactly():
    model = _wide()
    x, y = torch.randn(6, 20), torch.randint(0, 2, (6,))

    def losses(m):
        return nn.functional.cross_entropy(m(x), y, reduction="none")

    def exact_sq(names):   # each example's exact squared gradient norm over the parameters ``names``
        params = [p for n, p in model.named_parameters() if n in names]
        return torch.stack([sum(g.double().square().sum() for g in torch.autograd.grad(losses(model)[i], params))
                            for i in range(6)])

    names = [n for n, _ in model.named_parameters()]
    rest, wide = exact_sq([n for n in names if n != "2.weight"]), exact_sq(["2.weight"])
    torch.manual_seed(1)
    draws = torch.stack([per_sample_sq_norms(model, losses, "auto", k=32).double() - rest for _ in range(100)])
    # what is left after the exact part is 2.weight's Hutchinson estimate: never negative (a sum of squares), and
    # unbiased: its mean over 100 draws (relative sd sqrt(2/32) = 0.25 a draw, 0.025 for the mean) lies within
    # 6 standard errors of the exact norm (a miss probability below 1e-8 per example)
    assert torch.all(draws >= -1e-6 * rest)
    assert torch.allclose(draws.mean(0), wide, rtol=0.15)


def test_laplace_noise_makes_the_choice_exact_norms_throughout():
    engine, _ = _private(_wide(), noise_multiplier=1.0, noise="laplace")
    assert engine.estimator == "ghost" and engine.envelope is None


def test_auto_needs_the_projection_dimension():
    with pytest.raises(ValueError, match="estimator='auto' chooses per parameter at the projection dimension"):
        NormPlan.build(_wide(), "auto")
    with pytest.raises(ValueError, match=r"estimator must be one of \['auto', 'exact', 'ghost', 'hutch', 'hutchpp'\]"):
        NormPlan.build(_wide(), "automatic", 32)

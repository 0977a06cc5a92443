"""Adapters: dp_accounting events and accountant (dpmath.interop.dp_accounting), Opacus accountant (dpsgd.opacus)."""

import math

import numpy as np
import pytest

from dpmath import (
    Gaussian,
    HutchPPEnvelope,
    PLDAccountant,
    SubsampledGaussian,
    SubsampledL2Laplace,
)

dp_accounting = pytest.importorskip("dp_accounting")
from dpmath.interop.dp_accounting import (  # noqa: E402
    BracketPLDAccountant,
    RandomizedClipDpEvent,
    UnsupportedEventError,
    to_dp_event,
    to_mechanisms,
)

ENV = HutchPPEnvelope(32, 2048)  # the cheapest envelope to discretize: these tests check plumbing, not envelopes
Poisson, GaussianEvent = dp_accounting.PoissonSampledDpEvent, dp_accounting.GaussianDpEvent


@pytest.mark.parametrize("mechanism", [Gaussian(2.0), SubsampledGaussian(1.1, 0.01),
                                       SubsampledGaussian(1.0, 0.05, ENV), SubsampledGaussian(3.0, 1.0, ENV)])
@pytest.mark.parametrize("count", [1, 7])
def test_mechanisms_round_trip_through_dp_events(mechanism, count):
    assert to_mechanisms(to_dp_event(mechanism, count)) == [(mechanism, count)]


def test_nested_compositions_flatten_in_order():
    sg = Poisson(0.01, GaussianEvent(1.1))
    rc = Poisson(0.02, RandomizedClipDpEvent(0.9, ENV))
    event = dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(
        dp_accounting.ComposedDpEvent([sg, rc]), 3), dp_accounting.NoOpDpEvent(), GaussianEvent(5.0)])
    assert to_mechanisms(event) == [(SubsampledGaussian(1.1, 0.01), 3), (SubsampledGaussian(0.9, 0.02, ENV), 3),
                                    (Gaussian(5.0), 1)]


def test_the_adapter_gives_dpmaths_numbers_and_agrees_with_dp_accountings_pld():
    step = Poisson(256 / 60000, GaussianEvent(1.1))
    ours = BracketPLDAccountant().compose(dp_accounting.SelfComposedDpEvent(step, 14063))
    direct = PLDAccountant().compose(SubsampledGaussian(1.1, 256 / 60000), 14063)
    assert ours.get_epsilon(1e-5) == direct.epsilon(1e-5)
    assert ours.epsilon_bracket(1e-5) == direct.epsilon_bracket(1e-5)
    assert ours.get_delta(2.0) == direct.delta(2.0)
    peer = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    peer.compose(dp_accounting.SelfComposedDpEvent(step, 14063))
    lo, hi = ours.epsilon_bracket(1e-5)
    # referee truth 2.38168972 (docs/accountants.md): both peers and our bracket within 0.1 %
    assert lo <= 2.38168972 <= hi
    assert abs(peer.get_epsilon(1e-5) - hi) < 1e-3 * hi


def test_randomized_clipping_composes_with_a_dp_accounting_users_events():
    rc = dp_accounting.SelfComposedDpEvent(Poisson(0.01, RandomizedClipDpEvent(1.0, ENV)), 200)
    plain = dp_accounting.SelfComposedDpEvent(Poisson(0.01, GaussianEvent(1.0)), 200)
    acc = BracketPLDAccountant(discretization=1e-3)
    assert acc.supports(rc)
    eps_rc = acc.compose(rc).get_epsilon(1e-5)
    eps_plain = BracketPLDAccountant(discretization=1e-3).compose(plain).get_epsilon(1e-5)
    assert eps_rc > eps_plain  # randomized clipping costs privacy
    direct = PLDAccountant(1e-3).compose(SubsampledGaussian(1.0, 0.01, ENV), 200)
    assert eps_rc == direct.epsilon(1e-5)


def test_dp_accountings_own_accountants_refuse_the_randomized_clipping_event():
    rc = Poisson(0.01, RandomizedClipDpEvent(1.0, ENV))
    assert not dp_accounting.rdp.RdpAccountant().supports(rc)
    assert not dp_accounting.pld.PLDAccountant().supports(rc)


@pytest.mark.parametrize("event", [dp_accounting.LaplaceDpEvent(1.0),
                                   Poisson(0.1, dp_accounting.LaplaceDpEvent(1.0)),
                                   dp_accounting.SampledWithReplacementDpEvent(100, 10, GaussianEvent(1.0)),
                                   dp_accounting.ComposedDpEvent([GaussianEvent(1.0),
                                                                  dp_accounting.LaplaceDpEvent(1.0)])])
def test_unsupported_events_are_refused_with_nothing_composed(event):
    acc = BracketPLDAccountant().compose(GaussianEvent(3.0))
    before = acc.get_epsilon(1e-5)
    assert not acc.supports(event)
    with pytest.raises(dp_accounting.UnsupportedEventError):
        acc.compose(event)
    assert acc.get_epsilon(1e-5) == before
    assert acc.accountant.events == ((Gaussian(3.0), 1),)
    with pytest.raises(UnsupportedEventError):
        to_mechanisms(event)


def test_replace_one_refuses_randomized_clipping_but_accepts_gaussians():
    acc = BracketPLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    assert not acc.supports(Poisson(0.01, RandomizedClipDpEvent(1.0, ENV)))
    assert acc.supports(Poisson(0.01, GaussianEvent(1.0)))
    replace = acc.compose(Poisson(0.01, GaussianEvent(1.0)), 100).get_epsilon(1e-5)
    add_remove = BracketPLDAccountant().compose(Poisson(0.01, GaussianEvent(1.0)), 100).get_epsilon(1e-5)
    assert replace > add_remove


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="noise_multiplier"):
        RandomizedClipDpEvent(-1.0, ENV)
    with pytest.raises(ValueError, match="envelope"):
        RandomizedClipDpEvent(1.0, "hutch")
    with pytest.raises(ValueError, match="neighboring_relation"):
        BracketPLDAccountant(dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    with pytest.raises(ValueError, match="mechanism"):
        to_dp_event(SubsampledL2Laplace(1.0, 0.1))
    with pytest.raises(ValueError, match="count"):
        to_dp_event(Gaussian(1.0), 0)
    assert BracketPLDAccountant().get_epsilon(1e-5) == 0.0


# ---------------------------------------------------------------------------------------------------------
# Opacus


def _opacus():
    pytest.importorskip("opacus")
    import opacus

    from dpsgd.opacus import BracketAccountant, register
    return opacus, BracketAccountant, register


def test_opacus_privacy_engine_runs_with_the_registered_accountant():
    opacus, _, register = _opacus()
    import torch

    register("dpmath")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    data = torch.utils.data.TensorDataset(torch.randn(64, 6), torch.randint(0, 2, (64,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    engine = opacus.PrivacyEngine(accountant="dpmath")
    model, optimizer, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                   data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert engine.accountant.mechanism() == "dpmath"
    (sigma, q, steps), = engine.accountant.history
    assert (sigma, q, steps) == (1.0, 0.25, 4)
    expected = PLDAccountant().compose(SubsampledGaussian(1.0, 0.25), 4).epsilon(1e-5)
    assert engine.get_epsilon(1e-5) == expected


def test_opacus_calibration_through_the_registered_accountant_meets_the_target():
    opacus, BracketAccountant, register = _opacus()
    from opacus.accountants.utils import get_noise_multiplier

    register("dpmath-coarse", discretization=1e-3)
    sigma = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, steps=1000,
                                 accountant="dpmath-coarse", epsilon_tolerance=0.01)
    acc = BracketAccountant(discretization=1e-3)
    acc.history = [(sigma, 0.01, 1000)]
    eps = acc.get_epsilon(1e-5)
    assert 1.99 <= eps <= 2.0
    prv = opacus.accountants.PRVAccountant()
    prv.history = [(sigma, 0.01, 1000)]
    assert math.isclose(prv.get_epsilon(1e-5), eps, rel_tol=0.02)


def test_opacus_accountant_with_an_envelope_accounts_for_randomized_clipping():
    opacus, BracketAccountant, register = _opacus()
    cls = register("dpmath-hutch", envelope=ENV, discretization=1e-3)
    acc = opacus.accountants.create_accountant("dpmath-hutch")
    assert type(acc) is cls and acc.mechanism() == "dpmath-hutch"
    for _ in range(50):
        acc.step(noise_multiplier=1.0, sample_rate=0.05)
    lo, hi = acc.get_epsilon_bracket(1e-5)
    assert lo <= hi == acc.get_epsilon(delta=1e-5)  # the second query reuses the composed accountant
    assert hi == PLDAccountant(1e-3).compose(SubsampledGaussian(1.0, 0.05, ENV), 50).epsilon(1e-5)
    plain = BracketAccountant(discretization=1e-3)
    plain.history = [(1.0, 0.05, 50)]
    assert hi > plain.get_epsilon(1e-5)


def test_opacus_state_dict_round_trip_and_mechanism_check():
    opacus, BracketAccountant, register = _opacus()
    acc = BracketAccountant()
    for sigma in (1.0, 1.0, 2.0):
        acc.step(noise_multiplier=sigma, sample_rate=0.1)
    state = acc.state_dict()
    other = BracketAccountant()
    other.load_state_dict(state)
    assert other.history == [(1.0, 0.1, 2), (2.0, 0.1, 1)] and len(other) == 3
    rdp = opacus.accountants.RDPAccountant()
    with pytest.raises(ValueError, match="mechanism"):
        rdp.load_state_dict(state)


def test_opacus_bad_configuration_is_refused_at_construction():
    _, BracketAccountant, register = _opacus()
    with pytest.raises(ValueError, match="envelope"):
        BracketAccountant(envelope="hutch")
    with pytest.raises(ValueError, match="discretization"):
        register("bad", discretization=0.0)
    with pytest.raises(ValueError, match="name"):
        register("")
    assert BracketAccountant().get_epsilon(1e-5) == 0.0
    assert np.isfinite(BracketAccountant().get_epsilon_bracket(1e-5).upper)


@pytest.mark.parametrize("noise_multiplier, sample_rate, named", [
    (-1.0, 0.1, "noise_multiplier"), (0.0, 0.1, "noise_multiplier"), (math.nan, 0.1, "noise_multiplier"),
    (math.inf, 0.1, "noise_multiplier"), (True, 0.1, "noise_multiplier"), ("1.0x", 0.1, "noise_multiplier"),
    (1.0, 0.0, "sample_rate"), (1.0, -0.1, "sample_rate"), (1.0, 1.5, "sample_rate"), (1.0, math.nan, "sample_rate"),
    (1.0, math.inf, "sample_rate")])
def test_opacus_accountant_refuses_a_step_it_cannot_account_and_records_nothing(noise_multiplier, sample_rate,
                                                                                 named):
    _, BracketAccountant, _ = _opacus()
    acc = BracketAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(ValueError, match=rf"BracketAccountant.step\(\): {named} must"):
        acc.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    assert acc.history == [(1.0, 0.1, 1)]
    assert acc.get_epsilon(1e-5) == PLDAccountant().compose(SubsampledGaussian(1.0, 0.1), 1).epsilon(1e-5)


def test_opacus_accountant_refuses_a_history_set_wholesale_that_it_cannot_account():
    _, BracketAccountant, _ = _opacus()
    for history, match in [([(1.0, 0.1, 5), (-2.0, 0.1, 3)], r"history\[1\]: noise_multiplier"),
                           ([(1.0, 2.0, 5)], r"history\[0\]: sample_rate"),
                           ([(1.0, 0.1, 0)], r"history\[0\]: the step count")]:
        acc = BracketAccountant()
        acc.load_state_dict({"history": history, "mechanism": "dpmath"})
        with pytest.raises(ValueError, match=match):
            acc.get_epsilon(1e-5)

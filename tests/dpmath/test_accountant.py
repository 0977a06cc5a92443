"""The accountants' common interface: ``supports`` for every mechanism under each relation, the typed refusal of
``compose``, and the neighbouring relation as an enum or its string value."""

import pytest

from dpmath import (
    Accountant,
    EpsilonSchedule,
    FixedSizeSubsampledGaussian,
    Gaussian,
    HutchPPEnvelope,
    Neighboring,
    PLDAccountant,
    PointMassEnvelope,
    RandomAllocationGaussian,
    RDPAccountant,
    ShuffledGaussian,
    SubsampledGaussian,
    SubsampledL2Laplace,
    TruncatedSubsampledGaussian,
    UnsupportedMechanismError,
)
from dpmath.mechanisms import MECHANISMS
from dpmath.pld.steps import is_gaussian_step, random_scale
from dpmath.twice_sampling import TwiceSampledGaussian

ENV = HutchPPEnvelope(projection_dim=4, dim=16)
ACCOUNTANTS = {"pld add_or_remove": lambda: PLDAccountant(),
               "pld replace_one": lambda: PLDAccountant(neighboring="replace_one"),
               "rdp": lambda: RDPAccountant()}

# mechanism, then whether (pld add_or_remove, pld replace_one, rdp) supports it
SUPPORT = [
    (Gaussian(2.0), (True, True, True)),
    (SubsampledGaussian(1.0, 0.01), (True, True, True)),
    (SubsampledGaussian(1.0, 0.01, ENV), (True, False, False)),
    (SubsampledGaussian(1.0, 0.01, PointMassEnvelope()), (True, False, False)),
    (SubsampledL2Laplace(2.0, 0.01), (True, False, True)),
    (FixedSizeSubsampledGaussian(2.0, 100, 10_000), (False, True, False)),
    (FixedSizeSubsampledGaussian(2.0, 100, 10_000, ENV), (False, True, False)),
    (TruncatedSubsampledGaussian(1.0, 0.01, 110, 10_000), (True, False, False)),
    (TruncatedSubsampledGaussian(1.0, 0.01, 150, 10_000, ENV), (True, False, False)),
    (RandomAllocationGaussian(2.0, 50), (True, True, False)),
    (RandomAllocationGaussian(2.0, 50, ENV), (True, False, False)),
    (ShuffledGaussian(4.0, 100), (False, True, False)),
    (ShuffledGaussian(4.0, 100, ENV), (False, True, False)),
    (TwiceSampledGaussian(noise_std=0.5, sample_rate=0.01, coordinate_rate=0.5), (False, False, True)),
    ("gaussian", (False, False, False)),
]
CASES = [pytest.param(name, mechanism, supported[i], id=f"{name}-{type(mechanism).__name__}-{j}")
         for j, (mechanism, supported) in enumerate(SUPPORT) for i, name in enumerate(ACCOUNTANTS)]


def test_the_support_table_covers_every_registered_mechanism():
    assert set(MECHANISMS) <= {type(m) for m, _ in SUPPORT}


def test_poisson_randomized_clipping_is_the_envelope_field_and_the_steps_dispatch_on_it():
    plain, rc = SubsampledGaussian(1.0, 0.01), SubsampledGaussian(1.0, 0.01, ENV)
    assert plain.envelope is None and plain == SubsampledGaussian(1.0, 0.01, None) != rc
    assert repr(plain) == "SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.01)"
    assert repr(rc) == f"SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.01, envelope={ENV!r})"
    # a point mass is still randomized clipping: a scale grid of one scale, never the closed-form Gaussian
    point = SubsampledGaussian(1.0, 1.0, PointMassEnvelope())
    assert random_scale(rc) and random_scale(point) and not random_scale(plain)
    assert is_gaussian_step(SubsampledGaussian(1.0, 1.0)) and not is_gaussian_step(point)
    with pytest.raises(ValueError, match="scale_resolution"):
        SubsampledGaussian(1.0, 0.01, scale_resolution=0.2)
    with pytest.raises(ValueError, match="envelope"):
        SubsampledGaussian(1.0, 0.01, "hutch")


@pytest.mark.parametrize(("accountant", "mechanism", "supported"), CASES)
def test_supports_says_whether_compose_accepts_the_mechanism(accountant, mechanism, supported):
    acc = ACCOUNTANTS[accountant]()
    assert isinstance(acc, Accountant)
    assert acc.supports(mechanism) is supported
    assert (acc.refusal(mechanism) is None) is supported
    if supported:
        assert acc.compose(mechanism, 3).events == ((mechanism, 3),)


@pytest.mark.parametrize(("accountant", "mechanism", "supported"), [c for c in CASES if not c.values[2]])
def test_composing_an_unsupported_mechanism_raises_the_typed_error_naming_it_with_nothing_composed(
        accountant, mechanism, supported):
    acc = ACCOUNTANTS[accountant]().compose(Gaussian(3.0))
    with pytest.raises(UnsupportedMechanismError, match=type(mechanism).__name__) as caught:
        acc.compose(mechanism, 2)
    assert isinstance(caught.value, ValueError) and caught.value.mechanism is mechanism
    assert str(caught.value) == acc.refusal(mechanism)
    assert acc.events == ((Gaussian(3.0), 1),)


def test_a_refusal_says_why_and_which_relation_covers_the_mechanism():
    fixed = FixedSizeSubsampledGaussian(2.0, 100, 10_000)
    assert PLDAccountant().refusal(fixed) == (
        "neighboring='add_or_remove' is not supported for FixedSizeSubsampledGaussian: its batches have a fixed size, "
        "so a data set with one example more or less is not a neighbour it covers; use neighboring='replace_one'")
    assert "infinite for every order" in RDPAccountant().refusal(SubsampledGaussian(1.0, 0.01, ENV))
    assert "independent random scales" in PLDAccountant(neighboring="replace_one").refusal(
        RandomAllocationGaussian(2.0, 50, ENV))


@pytest.mark.parametrize("relation", list(Neighboring))
def test_neighboring_is_accepted_as_the_enum_or_its_string_value(relation):
    by_enum = PLDAccountant(1e-3, neighboring=relation).compose(SubsampledGaussian(1.0, 0.01), 20)
    by_value = PLDAccountant(1e-3, neighboring=relation.value).compose(SubsampledGaussian(1.0, 0.01), 20)
    assert by_enum.neighboring is relation and by_value.neighboring is relation
    assert by_enum.epsilon(1e-5) == by_value.epsilon(1e-5)
    assert repr(by_enum) == repr(by_value) == (f"PLDAccountant(discretization=0.001, neighboring='{relation.value}', "
                                               f"events=1)")
    schedule = EpsilonSchedule(Gaussian(2.0), 10, neighboring=relation)
    assert schedule.neighboring is EpsilonSchedule(Gaussian(2.0), 10, neighboring=relation.value).neighboring


def test_the_rdp_accountant_is_for_adding_or_removing_one_example():
    assert RDPAccountant().neighboring is Neighboring.ADD_OR_REMOVE


@pytest.mark.parametrize("bad", ["swap", "ADD_OR_REMOVE", "add", None, 1])
@pytest.mark.parametrize("build", [lambda v: PLDAccountant(neighboring=v),
                                   lambda v: EpsilonSchedule(Gaussian(2.0), 10, neighboring=v)],
                         ids=["PLDAccountant", "EpsilonSchedule"])
def test_a_bad_neighbouring_relation_is_refused_naming_the_argument_and_the_values(build, bad):
    with pytest.raises(ValueError, match=r"^neighboring must be one of 'add_or_remove', 'replace_one' \(or a "
                                         rf"Neighboring member\), got {bad!r}$"):
        build(bad)

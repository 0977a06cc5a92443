"""The sampling schemes' mechanisms (truncated Poisson, fixed-size, balls in bins, shuffling) in the PLD accountant:
each against an independent computation (the referee, a closed form, a direct integration of a realized pair) and
against dp_accounting where it has the event."""

import math

import numpy as np
import pytest
from scipy import integrate, stats

from dpmath import (
    DiscreteEnvelope,
    FixedSizeSubsampledGaussian,
    Gaussian,
    GridTooLargeError,
    HutchEnvelope,
    PLDAccountant,
    RandomAllocationGaussian,
    ShuffledGaussian,
    SubsampledGaussian,
    TruncatedSubsampledGaussian,
)
from dpmath.pld import EpsilonSchedule
from dpmath.referee import referee_epsilon
from verify.allocation import allocation_delta_estimate, allocation_rdp_epsilon


def _hockey_stick(p_pdf, q_pdf, alpha: float, lo: float = -40.0, hi: float = 40.0) -> float:
    """``int (p - alpha q)_+`` by adaptive quadrature (1-D densities)."""
    value, _ = integrate.quad(lambda x: max(p_pdf(x) - alpha * q_pdf(x), 0.0), lo, hi, limit=400, points=[0.0])
    return value


def _mixture(q: float, a: float, b: float):
    """``(1-q) N(a, 1) + q N(b, 1)``."""
    return lambda x: (1 - q) * stats.norm.pdf(x - a) + q * stats.norm.pdf(x - b)


# ------------------------------------------------------------------------------------------------ fixed-size batches
def test_fixed_size_batches_are_accounted_as_the_poisson_pair_at_half_the_noise():
    fixed = PLDAccountant(neighboring="replace_one").compose(FixedSizeSubsampledGaussian(1.0, 100, 10_000), 1000)
    poisson = PLDAccountant().compose(SubsampledGaussian(0.5, 0.01), 1000)
    assert fixed.epsilon_bracket(1e-6) == poisson.epsilon_bracket(1e-6)


def test_fixed_size_upper_end_lies_above_the_referee():
    lo, hi = PLDAccountant(neighboring="replace_one").compose(
        FixedSizeSubsampledGaussian(2.0, 64, 6400), 2000).epsilon_bracket(1e-5)
    r_lo, r_hi = referee_epsilon([(1.0, 0.01, 2000)], 1e-5)
    assert lo <= r_hi and hi >= r_lo
    assert hi - lo <= 1e-3 * hi


def test_one_fixed_size_step_is_reached_by_two_neighbouring_data_sets():
    # every other example's clipped gradient C e, x' = C e, x = -C e: the batch sums differ by 2 C with probability q,
    # so the step's curve is the accountant's (not only below it)
    sigma, b, n = 1.5, 10, 200
    q = b / n
    mu = 1 / sigma
    acc = PLDAccountant(neighboring="replace_one").compose(FixedSizeSubsampledGaussian(sigma, b, n))
    for eps in (0.0, 0.05, 0.2):
        realized = _hockey_stick(_mixture(q, 0.0, -2 * mu), _mixture(0.0, 0.0, 0.0), math.exp(eps))
        lo, hi = acc.delta_bracket(eps)
        assert lo - 1e-9 <= realized <= hi + 1e-9


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_no_configuration_of_three_gradients_beats_the_fixed_size_pair(seed):
    # the coupling that keeps the batch's other examples: x in it (probability q) or an example y instead, so a
    # replaced step is ((1-q) N(g_y) + q N(g_x), (1-q) N(g_y) + q N(g_x')) with every |g| <= mu; in one dimension no
    # such pair exceeds the accountant's curve (24 random configurations per seed, 3 epsilons each)
    rng = np.random.default_rng(seed)
    sigma, q = 1.0, 0.05
    mu = 1 / sigma
    acc = PLDAccountant(neighboring="replace_one").compose(FixedSizeSubsampledGaussian(sigma, 5, 100))
    bound = {eps: acc.delta(eps) for eps in (0.0, 0.1, 0.3)}
    for _ in range(24):
        gy, gx, gx2 = rng.uniform(-mu, mu, 3)
        for eps, top in bound.items():
            value = _hockey_stick(_mixture(q, gy, gx), _mixture(q, gy, gx2), math.exp(eps))
            assert value <= top + 1e-9


def test_fixed_size_batches_are_refused_for_adding_or_removing_an_example():
    with pytest.raises(ValueError, match="replace_one"):
        PLDAccountant().compose(FixedSizeSubsampledGaussian(1.0, 10, 100))


def test_fixed_size_batch_larger_than_the_data_set_is_refused():
    with pytest.raises(ValueError, match="batch_size must be at most dataset_size"):
        FixedSizeSubsampledGaussian(1.0, 101, 100)


# ------------------------------------------------------------------------------------------------ truncated Poisson
def test_truncation_and_overflow_probabilities_are_the_binomial_tails():
    m = TruncatedSubsampledGaussian(1.0, 0.05, max_batch_size=12, dataset_size=100)
    cut = math.fsum(math.comb(100, k) * 0.05 ** k * 0.95 ** (100 - k) for k in range(12, 101))
    assert cut <= m.truncation_probability() <= cut * (1 + 1e-8)
    over = math.fsum(math.comb(101, k) * 0.05 ** k * 0.95 ** (101 - k) for k in range(13, 102))
    assert over <= m.overflow_probability() <= over * (1 + 1e-8)


def test_exact_norm_truncation_is_the_scale_one_scale_two_mixture():
    m = TruncatedSubsampledGaussian(1.0, 0.01, max_batch_size=110, dataset_size=10_000)
    p = m.truncation_probability()
    assert m.dominating() == SubsampledGaussian(1.0, 0.01, DiscreteEnvelope([0.25, 1.0], [p, 1 - p]))
    lo, hi = PLDAccountant().compose(m, 200).epsilon_bracket(1e-5)
    plain = PLDAccountant().compose(SubsampledGaussian(1.0, 0.01), 200).epsilon(1e-5)
    doubled = PLDAccountant().compose(SubsampledGaussian(0.5, 0.01), 200).epsilon(1e-5)
    assert plain < lo <= hi < doubled and hi - lo <= 1e-3 * hi


def test_a_cap_far_above_the_mean_costs_nothing_measurable():
    m = TruncatedSubsampledGaussian(1.0, 0.01, max_batch_size=180, dataset_size=10_000)
    assert m.truncation_probability() < 1e-12
    hi = PLDAccountant().compose(m, 500).epsilon(1e-6)
    assert hi == pytest.approx(PLDAccountant().compose(SubsampledGaussian(1.0, 0.01), 500).epsilon(1e-6), rel=1e-6)


def test_randomized_clipping_truncation_charges_the_overflow_to_delta():
    env = HutchEnvelope(projection_dim=16, dim=1000)
    m = TruncatedSubsampledGaussian(2.0, 0.01, 300, 10_000, envelope=env)
    assert m.charged and m.dominating() == SubsampledGaussian(2.0, 0.01, env)
    eta = 100 * m.overflow_probability()
    lo, hi = PLDAccountant().compose(m, 100).epsilon_bracket(1e-5)
    plain = PLDAccountant().compose(SubsampledGaussian(2.0, 0.01, env), 100)
    r_lo, r_hi = plain.epsilon_bracket(1e-5)
    assert lo <= r_lo and hi >= r_hi and hi <= r_hi * (1 + 1e-6)
    # delta: the plain bracket widened by eta (1 + e^eps) on each side
    d_lo, d_hi = PLDAccountant().compose(m, 100).delta_bracket(2.0)
    p_lo, p_hi = plain.delta_bracket(2.0)
    assert d_hi == pytest.approx(p_hi + eta * (1 + math.e ** 2), rel=1e-12)
    assert d_lo == pytest.approx(max(0.0, p_lo - eta * (1 + math.e ** 2)), rel=1e-12)


def test_max_batch_size_for_is_the_smallest_that_meets_the_budget():
    cap = TruncatedSubsampledGaussian.max_batch_size_for(0.01, 10_000, 1000, 1e-8)
    fits = [1000 * TruncatedSubsampledGaussian(1.0, 0.01, c, 10_000).overflow_probability() for c in (cap - 1, cap)]
    assert fits[0] > 1e-8 >= fits[1]


def test_a_charge_above_delta_gives_infinite_epsilon_and_tradeoff_is_refused():
    env = HutchEnvelope(projection_dim=16, dim=1000)
    m = TruncatedSubsampledGaussian(1.0, 0.01, max_batch_size=100, dataset_size=10_000, envelope=env)
    acc = PLDAccountant().compose(m, 10)   # overflows about half the time
    assert acc.epsilon(1e-6) == math.inf
    with pytest.raises(ValueError, match="tradeoff is not available"):
        acc.tradeoff(0.1)


def test_truncated_poisson_is_refused_for_replacing_one_example():
    with pytest.raises(ValueError, match="adding or removing"):
        PLDAccountant(neighboring="replace_one").compose(TruncatedSubsampledGaussian(1.0, 0.01, 150, 10_000))


def test_the_schedule_brackets_truncated_steps_as_the_accountant_does():
    m = TruncatedSubsampledGaussian(1.0, 0.01, 110, 10_000)
    lo, hi = PLDAccountant().compose(m, 100).epsilon_bracket(1e-6)
    s_lo, s_hi = EpsilonSchedule(m, 200).epsilon_bracket(100, 1e-6)
    assert s_lo <= hi and lo <= s_hi <= hi * (1 + 1e-3)


# --------------------------------------------------------------------------------- balls in bins and shuffling
@pytest.mark.parametrize("sigma, steps, eps", [
    pytest.param(1.5, 20, (0.1, 0.3, 0.6, 1.0), marks=pytest.mark.slow),   # one grid
    pytest.param(0.6, 10, (0.5, 1.0, 2.0, 3.0), marks=pytest.mark.slow),   # heavy tails: octave bands
    # tails too heavy for one grid (13 decades), where the grids gave up before; the default run's Monte Carlo of
    # balls in bins is verify.allocation's (its doctest)
    pytest.param(0.35, 20, (1.0, 2.0, 4.0, 6.0), marks=pytest.mark.slow),
])
def test_balls_in_bins_bracket_holds_a_monte_carlo_delta_of_the_dominating_pair(sigma, steps, eps):
    # 400,000 draws of the pair (verify.allocation: importance-sampled for removing), fixed seed; each estimate within
    # 5 standard errors of the bracket (a bounded integrand: a miss by chance has probability below 1e-6 per point)
    eps = np.array(eps)
    acc = PLDAccountant().compose(RandomAllocationGaussian(sigma, steps))
    est, se = allocation_delta_estimate(sigma, steps, eps, 400_000, seed=7)
    for e, m, s in zip(eps, est, se, strict=True):
        lo, hi = acc.delta_bracket(float(e))
        assert lo - 5 * s <= m <= hi + 5 * s
        assert hi - lo <= 0.01 * hi


@pytest.mark.parametrize("sigma, steps, epochs", [(2.0, 50, 9), pytest.param(1.0, 100, 3, marks=pytest.mark.slow)])
def test_balls_in_bins_lies_below_its_renyi_bound_and_the_unamplified_one_and_near_poisson(sigma, steps, epochs):
    lo, hi = PLDAccountant().compose(RandomAllocationGaussian(sigma, steps), epochs).epsilon_bracket(1e-6)
    assert hi - lo <= 0.01 * hi
    assert hi <= allocation_rdp_epsilon(sigma, steps, epochs, 1e-6)
    assert hi < PLDAccountant().compose(Gaussian(sigma / math.sqrt(epochs))).epsilon(1e-6) / 3
    poisson = PLDAccountant().compose(SubsampledGaussian(sigma, 1 / steps), steps * epochs).epsilon(1e-6)
    assert 0.8 * poisson <= hi <= 1.02 * poisson


@pytest.mark.slow
def test_small_noise_epochs_stay_amplified_with_a_narrow_bracket_below_poisson_and_renyi():
    # sigma = 0.3: the terms span 13 decades; the octave bands resolve them, so the unamplified Gaussian step
    # (the last resort, 19.13 here) is not used: before the bands the bracket was [14.52, 19.13]
    lo, hi = PLDAccountant().compose(RandomAllocationGaussian(0.3, steps=100)).epsilon_bracket(1e-5)
    assert hi - lo <= 0.005 * hi
    assert hi < 0.8 * PLDAccountant().compose(Gaussian(0.3)).epsilon(1e-5)
    assert hi < allocation_rdp_epsilon(0.3, 100, 1, 1e-5)
    assert hi < PLDAccountant().compose(SubsampledGaussian(0.3, 1 / 100), 100).epsilon(1e-5)


@pytest.mark.slow
def test_small_noise_over_several_epochs_is_amplified_to_the_bands_share_of_the_width():
    # [24.26, 50.03] with the unamplified step; the bands' share of the width is 0.05 % (fitted_band_laws): 0.012 %
    lo, hi = PLDAccountant().compose(RandomAllocationGaussian(0.35, 200), 5).epsilon_bracket(1e-6)
    assert hi - lo <= 5e-4 * hi
    assert hi < 0.8 * PLDAccountant().compose(SubsampledGaussian(0.35, 1 / 200), 1000).epsilon(1e-6)


def test_a_one_step_epoch_and_replacing_an_example_keep_the_gaussian_bound():
    one = PLDAccountant().compose(RandomAllocationGaussian(2.0, steps=1), 9).epsilon_bracket(1e-6)
    assert one == PLDAccountant().compose(Gaussian(2.0 / 3.0)).epsilon_bracket(1e-6)
    assert RandomAllocationGaussian(2.0, 1).amplified is False
    replaced = PLDAccountant(neighboring="replace_one").compose(RandomAllocationGaussian(2.0, 50), 4).epsilon(1e-6)
    assert replaced == PLDAccountant().compose(Gaussian(0.5)).epsilon(1e-6)


def test_balls_in_bins_with_randomized_clipping_is_the_envelope_step_at_rate_one():
    env = HutchEnvelope(projection_dim=16, dim=1000)
    a = PLDAccountant().compose(RandomAllocationGaussian(3.0, 20, env), 4).epsilon_bracket(1e-5)
    b = PLDAccountant().compose(SubsampledGaussian(3.0, 1.0, env), 4).epsilon_bracket(1e-5)
    assert a == b


def test_shuffled_epochs_are_the_gaussian_at_half_the_noise_and_need_replace_one():
    acc = PLDAccountant(neighboring="replace_one").compose(ShuffledGaussian(4.0, steps=100), 16)
    assert acc.epsilon(1e-5) == PLDAccountant().compose(Gaussian(2.0), 16).epsilon(1e-5)
    assert acc.epsilon(1e-5) == PLDAccountant(neighboring="replace_one").compose(Gaussian(4.0), 16).epsilon(1e-5)
    with pytest.raises(ValueError, match="replace_one"):
        PLDAccountant().compose(ShuffledGaussian(4.0, steps=100))


def test_replace_one_mixes_poisson_and_fixed_size_events_direction_by_direction():
    acc = PLDAccountant(neighboring="replace_one")
    acc.compose(SubsampledGaussian(1.0, 0.01), 500).compose(FixedSizeSubsampledGaussian(2.0, 100, 10_000), 500)
    lo, hi = acc.epsilon_bracket(1e-6)
    alone = [PLDAccountant(neighboring="replace_one").compose(m, 500).epsilon(1e-6)
             for m in (SubsampledGaussian(1.0, 0.01), FixedSizeSubsampledGaussian(2.0, 100, 10_000))]
    assert max(alone) < hi < sum(alone)


@pytest.mark.parametrize("bad", [
    lambda: TruncatedSubsampledGaussian(1.0, 1.0, 10, 100),
    lambda: TruncatedSubsampledGaussian(1.0, 0.1, 0, 100),
    lambda: TruncatedSubsampledGaussian(1.0, 0.1, 10, 100, envelope="hutch"),
    lambda: RandomAllocationGaussian(1.0, 0),
    lambda: ShuffledGaussian(-1.0, 10),
    lambda: FixedSizeSubsampledGaussian(1.0, 2.5, 10),
])
def test_bad_sampling_arguments_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="must"):
        bad()


# ------------------------------------------------------------------------------------------------ dp_accounting
dp_accounting = pytest.importorskip("dp_accounting")


def test_dp_events_convert_both_ways():
    from dpmath.interop.dp_accounting import to_dp_event, to_mechanisms

    for m in (TruncatedSubsampledGaussian(1.0, 0.01, 174, 10_000), FixedSizeSubsampledGaussian(1.0, 100, 10_000)):
        assert to_mechanisms(to_dp_event(m, 7)) == [(m, 7)]


@pytest.mark.parametrize("cap", [105, 115])
def test_truncated_poisson_is_within_two_percent_of_dp_accountings_analysis(cap):
    # dp_accounting mixes the same two pairs, with the cut's rate conditioned on the cut (ours bounds it by q)
    from dpmath.interop.dp_accounting import to_dp_event

    m = TruncatedSubsampledGaussian(1.0, 0.01, cap, 10_000)
    theirs = dp_accounting.pld.PLDAccountant()
    theirs.compose(to_dp_event(m, 300))
    ours = PLDAccountant().compose(m, 300).epsilon(1e-5)
    assert ours == pytest.approx(theirs.get_epsilon(1e-5), rel=0.02)


def test_dp_accounting_rdp_of_the_same_fixed_size_event_lies_above_our_upper_end():
    from dpmath.interop.dp_accounting import to_dp_event

    m = FixedSizeSubsampledGaussian(2.0, 100, 10_000)
    rdp = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    rdp.compose(to_dp_event(m, 1000))
    ours = PLDAccountant(neighboring="replace_one").compose(m, 1000).epsilon(1e-6)
    assert ours <= rdp.get_epsilon(1e-6)


def test_the_dp_accounting_adapter_takes_fixed_size_events_only_for_replacing_one_example():
    from dpmath.interop.dp_accounting import BracketPLDAccountant

    event = dp_accounting.SampledWithoutReplacementDpEvent(10_000, 100, dp_accounting.GaussianDpEvent(0.5))
    assert not BracketPLDAccountant().supports(event)
    replace = BracketPLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE).compose(event, 1000)
    assert replace.get_epsilon(1e-6) == PLDAccountant(neighboring="replace_one").compose(
        FixedSizeSubsampledGaussian(1.0, 100, 10_000), 1000).epsilon(1e-6)


@pytest.mark.parametrize("make", [
    lambda: FixedSizeSubsampledGaussian(1.0, np.int64(10), np.int64(100)),
    lambda: TruncatedSubsampledGaussian(1.0, np.float64(0.1), np.int64(20), np.int64(100)),
    lambda: RandomAllocationGaussian(np.float32(1.0), np.int64(10)),
])
def test_numpy_scalars_are_accepted_wherever_python_numbers_are(make):
    m = make()
    assert all(type(v) in (int, float) for v in vars(m).values() if isinstance(v, (int, float, np.generic)))


@pytest.mark.parametrize("make,match", [
    (lambda: Gaussian(None), "noise_multiplier must be a real number, got None"),
    (lambda: SubsampledGaussian(1.0, None), "sample_rate must be a real number, got None"),
    (lambda: RandomAllocationGaussian(1.0, None), "steps must be a positive integer"),
])
def test_none_is_refused_by_name_not_as_nan(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_random_allocation_with_tiny_noise_is_a_typed_error_that_says_why():
    with pytest.raises(GridTooLargeError, match="too small for the random-allocation PLD"):
        PLDAccountant().compose(RandomAllocationGaussian(1e-3, 10)).epsilon(1e-5)


def test_an_infinite_epsilon_from_truncation_overflow_says_why():
    """A cap at the expected batch size overflows about half the time: no epsilon meets delta, and the accountant
    says so instead of returning infinity silently."""
    step = TruncatedSubsampledGaussian(1.0, 0.1, 10, 100, HutchEnvelope(4, 8))
    with pytest.warns(RuntimeWarning, match="overflow probability.*raise max_batch_size"):
        assert PLDAccountant().compose(step, 10).epsilon(1e-5) == math.inf

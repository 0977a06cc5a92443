"""Random allocation of k of T steps: each example in a uniformly random k-subset of an epoch's steps."""

import numpy as np
import pytest

from dpmath import (
    Gaussian,
    HutchEnvelope,
    PLDAccountant,
    RandomAllocationGaussian,
    SubsampledGaussian,
)
from dpmath.pld import EpsilonSchedule
from verify.allocation import allocation_delta_estimate


def test_an_epoch_of_k_participations_is_composed_as_k_epochs_of_one_in_a_kth_of_the_steps():
    epoch = RandomAllocationGaussian(2.0, steps=103, participations=4)
    assert epoch.decomposed() == (RandomAllocationGaussian(2.0, 25), 4)   # floor(103 / 4): 3 steps left over
    acc = PLDAccountant().compose(epoch, 3)
    assert acc.events == ((RandomAllocationGaussian(2.0, 25), 12),)
    assert RandomAllocationGaussian(2.0, 10).decomposed() == (RandomAllocationGaussian(2.0, 10), 1)


@pytest.mark.parametrize("sigma, steps, k", [(1.0, 8, 2), pytest.param(1.5, 12, 3, marks=pytest.mark.slow)])
def test_k_of_t_bound_holds_a_monte_carlo_delta_of_the_epochs_own_pair_and_is_near_it(sigma, steps, k):
    # 400,000 plain draws of the k-of-T pair itself (likelihood ratio e_k(W) / C(t, k)), fixed seed; a bounded
    # integrand, so 5 standard errors leave a miss by chance below 1e-6 per point.  The bound is the composition of
    # k one-of-(t/k) epochs: above the truth, and (measured) at most 18 % above it at these epsilons
    eps = np.array([0.25, 0.5, 1.0, 1.5])
    est, se = allocation_delta_estimate(sigma, steps, eps, 400_000, seed=3, participations=k)
    acc = PLDAccountant().compose(RandomAllocationGaussian(sigma, steps, participations=k))
    for e, m, s in zip(eps, est, se, strict=True):
        hi = acc.delta(float(e))
        assert m - 5 * s <= hi <= 1.25 * m


def test_k_of_t_is_below_poisson_sampling_at_the_same_rate_and_above_one_participation():
    # (sigma 2, 30 steps, k 3: 3.4 s; sigma 1.5 and 60 steps took 35 s for the same three numbers' order)
    poisson = PLDAccountant().compose(SubsampledGaussian(2.0, 3 / 30), 30 * 4).epsilon(1e-6)
    k_of_t = PLDAccountant().compose(RandomAllocationGaussian(2.0, 30, participations=3), 4).epsilon(1e-6)
    one = PLDAccountant().compose(RandomAllocationGaussian(2.0, 30), 4).epsilon(1e-6)
    assert one < k_of_t < poisson


def test_k_of_t_without_amplification_is_k_dominating_steps():
    env = HutchEnvelope(projection_dim=16, dim=1000)
    a = PLDAccountant().compose(RandomAllocationGaussian(3.0, 20, env, participations=2), 3).epsilon_bracket(1e-5)
    b = PLDAccountant().compose(SubsampledGaussian(3.0, 1.0, env), 6).epsilon_bracket(1e-5)
    assert a == b
    every = PLDAccountant().compose(RandomAllocationGaussian(2.0, 5, participations=5), 2).epsilon(1e-5)
    assert every == PLDAccountant().compose(Gaussian(2.0), 10).epsilon(1e-5)
    assert not RandomAllocationGaussian(2.0, 5, participations=3).amplified   # floor(5 / 3) = 1 step each


def test_the_epsilon_schedule_counts_k_participations_as_the_accountant_does():
    epoch = RandomAllocationGaussian(2.0, 40, participations=2)
    schedule = EpsilonSchedule(epoch, 3)
    for count in (1, 3):
        assert schedule.epsilon(count, 1e-6) == pytest.approx(
            PLDAccountant().compose(epoch, count).epsilon(1e-6), rel=1e-4)


@pytest.mark.parametrize("k, message", [(0, "participations must be a positive integer"),
                                        (11, r"participations must lie in \[1, steps=10\]"),
                                        (2.5, "participations must be a positive integer")])
def test_participations_outside_one_to_steps_are_refused_by_name(k, message):
    with pytest.raises(ValueError, match=message):
        RandomAllocationGaussian(1.0, 10, participations=k)


def test_participations_accepts_numpy_integers():
    assert RandomAllocationGaussian(1.0, 10, participations=np.int64(2)).participations == 2

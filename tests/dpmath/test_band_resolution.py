"""Octave bands are built as fine as the composed epochs need (:func:`dpmath.pld.allocation.fitted_band_laws`): the
probe that decides reads the epoch's own epsilon, a coarse build is still a bound, and few epochs keep the first
build."""

import math

import numpy as np
import pytest

from dpmath import PLDAccountant, RandomAllocationGaussian
from dpmath.pld import allocation

MU, T = 1.0, 10
CAP = math.exp(0.5 * MU * MU + allocation._CAP_Z * MU)


@pytest.fixture(scope="module")
def first_build():
    return allocation.band_laws(MU, T, "remove", CAP, allocation._BAND_TRY)


def test_the_probe_reads_the_epochs_own_epsilon(first_build):
    # the PLD built from the same laws on the loss grid 1e-4 (rounded up): its epsilon lies within a grid step or two
    upper = allocation.epoch_plds(1 / MU, T, "remove", 1e-4, (True,))[0]
    loss, m = allocation._band_losses(first_build.upper, T, "remove")
    probe = allocation._probe_epsilon(loss, m, first_build.upper.inf)
    assert probe == pytest.approx(upper.epsilon(allocation._BAND_PROBE), abs=3e-4)


def test_the_other_direction_read_from_one_law_is_that_directions_epsilon(first_build):
    cap = min(T * math.exp(allocation._ADD_CAP), 1e300)
    adding = allocation.band_laws(MU, T, "add", cap, allocation._BAND_TRY)
    own = allocation._probe_epsilon(*allocation._band_losses(adding.upper, T, "add"), adding.upper.inf)
    loss, m = allocation._band_losses(first_build.upper, T, "remove")
    other = allocation._probe_epsilon(-loss, m * np.exp(np.minimum(-loss, 700.0)), 0.0)
    assert other == pytest.approx(own, rel=1e-3)


def test_a_probe_above_the_mass_at_infinity_is_infinite_and_below_every_loss_is_zero():
    loss, m = np.array([1.0, 2.0]), np.array([0.5, 0.5])
    assert allocation._probe_epsilon(loss, m, 2e-6) == math.inf
    assert allocation._probe_epsilon(-loss, m, 0.0) == 0.0
    # one loss x with mass p: delta(eps) = p (1 - e^(eps - x)), so eps = x + log(1 - delta / p)
    assert allocation._probe_epsilon(np.array([3.0]), np.array([0.1]), 0.0) == pytest.approx(
        3.0 + math.log1p(-allocation._BAND_PROBE / 0.1), rel=1e-12)


def test_few_epochs_keep_the_first_build_and_many_build_finer(monkeypatch):
    sizes = []
    build = allocation.band_laws

    def counted(mu, steps, relation, cap, points=allocation._BAND_POINTS):
        sizes.append(points)
        return build(mu, steps, relation, cap, points)

    monkeypatch.setattr(allocation, "band_laws", counted)
    allocation.fitted_band_laws(MU, T, "remove", CAP, 3)
    assert sizes == [allocation._BAND_TRY]
    sizes.clear()
    monkeypatch.setattr(allocation, "_BAND_POINTS", 2 * allocation._BAND_TRY)   # the finer build, kept cheap here
    allocation.fitted_band_laws(MU, T, "remove", CAP, 200)
    assert sizes == [allocation._BAND_TRY, 2 * allocation._BAND_TRY]


def test_a_coarse_and_a_fine_build_hold_each_other_and_the_fine_one_is_narrower(monkeypatch):
    monkeypatch.setattr(allocation, "_BAND_POINTS", 4 * allocation._BAND_TRY)

    def bracket(first: bool) -> tuple[float, float]:
        allocation.sum_laws.cache_clear()
        monkeypatch.setattr(allocation, "_BAND_SHARE", 1.0 if first else 1e-9)   # the first build, or the finest
        acc = PLDAccountant(bracket_rtol=None).compose(RandomAllocationGaussian(1 / MU, T), 3)
        return acc.epsilon_bracket(1e-6)

    coarse, fine = bracket(True), bracket(False)
    allocation.sum_laws.cache_clear()
    assert coarse[0] <= fine[1] and fine[0] <= coarse[1]
    assert fine[1] - fine[0] < coarse[1] - coarse[0]


def test_a_long_epochs_finest_build_is_capped_by_the_doublings_of_its_sum():
    # the finest build costs its points times the doublings: 10^5 steps (17 doublings) stop at 2^20 points, where
    # 2^21 doubled the time for a tenth of the width; epochs up to 2^16 steps keep the finest
    assert allocation.finest_band_points(100_000) == 1 << 20
    assert allocation.finest_band_points(1_000) == allocation._BAND_POINTS
    assert allocation.finest_band_points(2) == allocation._BAND_POINTS


def test_the_doubled_sums_stop_at_their_mass_and_only_a_small_share_is_charged(monkeypatch):
    mu, t = 2.0, 1000
    cap = math.exp(0.5 * mu * mu + allocation._CAP_Z * mu)
    unit, shape = allocation._BAND_FLOOR / 2**10, (2 + math.ceil(math.log2(cap / allocation._BAND_FLOOR)), 2**10 + 1)
    allocated = allocation._band_term(mu, True, unit, shape, True, True).inf
    trimmed = allocation.band_laws.__wrapped__(mu, t, "remove", cap, allocation._BAND_TRY)
    charge = allocation._TRIM_CHARGED
    monkeypatch.setattr(allocation, "_TRIM_CHARGED", 0.0)
    whole = allocation.band_laws.__wrapped__(mu, t, "remove", cap, allocation._BAND_TRY)
    # a doubled sum stops below its far octaves (charged), the allocated term's octaves reach
    # twice the cap, and each doubling charges at most 1e-3 of that term's +inf mass
    term = allocation._band_term(mu, False, unit, shape, True, True)
    two = allocation._band_add(term, term, "upper")
    fitted = [allocation._band_fit(two, "upper", 0.0, allocation._BAND_TRY, c) for c in (charge * allocated, 0.0)]
    assert fitted[0].mass.shape[0] < fitted[1].mass.shape[0]
    assert trimmed.upper.values().max() >= 2.0 * cap
    assert allocated <= trimmed.upper.inf <= whole.upper.inf + 10 * charge * allocated
    for law, other in ((trimmed.upper, whole.upper), (trimmed.lower, whole.lower)):
        eps = allocation._probe_epsilon(*allocation._band_losses(law, t, "remove"), law.inf)
        ref = allocation._probe_epsilon(*allocation._band_losses(other, t, "remove"), other.inf)
        assert eps == pytest.approx(ref, rel=1e-4)


def test_the_allocated_terms_octaves_share_the_points_budget():
    # at sigma 0.05 the doubled sums hold their mass in few octaves (finer steps), but the allocated term spans about
    # 500: adding it on the sums' step took 80 s and 6.7 GB; the extended law goes back to the budget
    mu = 20.0
    cap = math.exp(0.5 * mu * mu + allocation._CAP_Z * mu)
    pair = allocation.band_laws.__wrapped__(mu, 10, "remove", cap, allocation._BAND_TRY)
    for law in (pair.upper, pair.lower):
        assert law.values().max() >= 2.0 * cap
        assert law.mass.shape[1] == (1 << allocation._BAND_MIN_BITS) + 1

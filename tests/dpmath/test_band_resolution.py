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

"""EpsilonSchedule: the epsilon at many counts from a step built once, against fresh accountants and the referee;
the engine's get_epsilon on it.

Tolerance: the schedule's upper end is a certified bound (at least the fresh accountant's lower end, at least the
referee's low end), and at most the fresh accountant's upper end at ``delta (1 - 2e-3)``: its untilted pass is
accepted, like the accountant's passes, where its error bounds move delta by at most 1e-3 of it, and the cut of the
step's largest losses moves it by at most 1e-6 of it.
"""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpmath.pld.schedule as schedule_module
from dpmath import (
    EpsilonSchedule,
    Gaussian,
    HutchEnvelope,
    PLDAccountant,
    SubsampledGaussian,
    SubsampledL2Laplace,
)
from dpmath.pld.compose import Composition, Spectra
from dpmath.pld.steps import step_plds
from dpmath.referee import referee_epsilon
from dpsgd import PrivacyEngine

DELTA = 1e-5
RC = SubsampledGaussian(2.0, 0.01, HutchEnvelope(projection_dim=16, dim=64))
# k = 8's heavier tail needs 2.3 GB of grids: the slow run only (the default suite has a 3 GB budget)
RC8 = SubsampledGaussian(2.0, 0.01, HutchEnvelope(projection_dim=8, dim=64))
SG = SubsampledGaussian(1.0, 0.01)


def _within_fresh(mechanism, count, bracket, delta=DELTA):
    """The schedule's bracket against a fresh accountant's (module docstring: the tolerance)."""
    fresh = PLDAccountant().compose(mechanism, count)
    lo, hi = fresh.epsilon_bracket(delta)
    slack = fresh.epsilon(delta * (1 - 2e-3))   # the same composition, read at a 0.2 % smaller delta
    s_lo, s_hi = bracket
    assert lo <= s_hi <= slack, (count, (lo, hi), slack, bracket)
    assert s_lo <= hi and s_lo <= s_hi


@pytest.mark.parametrize(("mechanism", "max_count", "counts"), [
    (SG, 300, (1, 7, 100, 300)), (RC, 100, (1, 7, 100)), pytest.param(RC8, 100, (1, 7, 100), marks=pytest.mark.slow)])
def test_the_schedules_bracket_meets_a_fresh_accountants_at_every_count(mechanism, max_count, counts):
    """One schedule for ``max_count`` answers at smaller counts too: the step built for ``max_count`` is sound at
    each (its mass beyond the grid is held exactly)."""
    schedule = EpsilonSchedule(mechanism, max_count)
    for count in counts:
        _within_fresh(mechanism, count, schedule.epsilon_bracket(count, DELTA))


@pytest.mark.parametrize("count", [100, 300])
def test_the_schedules_upper_end_is_never_below_the_referees_truth(count):
    lo, hi = EpsilonSchedule(SG, 300).epsilon_bracket(count, DELTA)
    ref_lo, ref_hi = referee_epsilon([(SG.noise_multiplier, SG.sample_rate, count)], DELTA)
    assert hi >= ref_lo and lo <= ref_hi
    assert hi - ref_hi < 1e-5 * ref_hi   # and close: a subsampled Gaussian's bracket is tight


def test_later_counts_reuse_the_step_and_its_transform(monkeypatch):
    """The step is built once per direction and its transform once per bound, whatever the counts asked."""
    built, shared = [], []

    class Recorded(Spectra):
        def __init__(self, size):
            super().__init__(size)
            shared.append(self)

    monkeypatch.setattr(schedule_module, "step_plds", lambda *a, **kw: built.append(a[1]) or step_plds(*a, **kw))
    monkeypatch.setattr(schedule_module, "Spectra", Recorded)
    # one grid (the default also builds a finer schedule, once, where a count's bracket is wider than 0.1 %)
    schedule = EpsilonSchedule(SG, 1000, bracket_rtol=None)
    values = [schedule.epsilon(n, DELTA) for n in (5, 50, 500, 1000, 20)]
    assert built == ["remove", "add"]   # the add direction is built once, for its Chernoff check
    assert values[:4] == sorted(values[:4]) and values[4] < values[1]
    # one transform per direction: the removal's, used by every count (the addition's is only Chernoff-bounded)
    assert len(shared) == 2 and [len(s.transforms) for s in shared] == [1, 0]
    # a value is kept: asking again computes nothing
    assert schedule.epsilon(500, DELTA) == values[2] and built == ["remove", "add"]


@pytest.mark.parametrize("mechanism", [SG, RC])
def test_the_untilted_window_never_widens_as_the_count_shrinks(mechanism):
    """Why one FFT size serves every count up to the largest (``Spectra``)."""
    step, = step_plds(mechanism, "remove", 1e-4, (True,), 1000)
    widths = [Composition([(step, n)], 1e-18).hi - Composition([(step, n)], 1e-18).lo for n in (2, 10, 100, 1000)]
    assert widths == sorted(widths)


def test_a_shared_transform_gives_the_composition_alones_answer_to_its_error():
    """The same pass on a wider FFT: the answers differ by their error bounds only (1e-8 relative here)."""
    step, = step_plds(SG, "remove", 1e-4, (True,))
    largest = Composition([(step, 1000)], 1e-18)
    shared = Spectra(largest.hi - largest.lo + 1)
    for n in (3, 30, 300):
        alone = Composition([(step, n)], 1e-18)
        eps, resolved = Composition([(step, n)], 1e-18, spectra=shared).pass_epsilon(DELTA)
        assert resolved and eps == pytest.approx(alone.pass_epsilon(DELTA)[0], rel=1e-6)
    assert len(shared.transforms) == 1
    too_small = Spectra(10)   # a window wider than the size is computed afresh, nothing kept
    Composition([(step, 30)], 1e-18, spectra=too_small).pass_epsilon(DELTA)
    assert not too_small.transforms


def test_gaussian_steps_are_read_in_closed_form_and_lap2_as_its_dominating_gaussian():
    assert EpsilonSchedule(Gaussian(2.0), 50).epsilon_bracket(20, DELTA) == \
        PLDAccountant().compose(Gaussian(2.0), 20).epsilon_bracket(DELTA)
    lap2 = SubsampledL2Laplace.for_noise_multiplier(1.0, 0.01)
    assert EpsilonSchedule(lap2, 300).epsilon(100, DELTA) == EpsilonSchedule(lap2.dominating(), 300).epsilon(100, DELTA)


def test_replace_one_neighbouring_meets_a_fresh_accountants_bracket():
    schedule = EpsilonSchedule(SG, 200, neighboring="replace_one")
    fresh = PLDAccountant(neighboring="replace_one").compose(SG, 200)
    lo, hi = fresh.epsilon_bracket(DELTA)
    s_lo, s_hi = schedule.epsilon_bracket(200, DELTA)
    assert lo <= s_hi <= fresh.epsilon(DELTA * (1 - 2e-3)) and s_lo <= hi


def test_a_lower_end_far_below_the_upper_end_takes_the_fresh_accountants():
    """A step whose losses sit below the grid (q mu << h): the fresh accountant's two-scale lower end."""
    tiny = SubsampledGaussian(1.0, 1e-6)
    lo, hi = EpsilonSchedule(tiny, 20).epsilon_bracket(20, DELTA)
    f_lo, f_hi = PLDAccountant().compose(tiny, 20).epsilon_bracket(DELTA)
    assert f_lo <= lo <= hi <= f_hi * (1 + 1e-9) and lo >= 0.5 * hi


def test_counts_outside_one_to_max_count_and_bad_deltas_are_refused():
    schedule = EpsilonSchedule(SG, 10)
    with pytest.raises(ValueError, match="count must be at most max_count=10"):
        schedule.epsilon(11, DELTA)
    with pytest.raises(ValueError, match="count"):
        schedule.epsilon(0, DELTA)
    with pytest.raises(ValueError, match="delta"):
        schedule.epsilon(5, 1.5)
    with pytest.raises(ValueError, match="max_count"):
        EpsilonSchedule(SG, 0)
    with pytest.raises(ValueError, match="replace_one"):
        EpsilonSchedule(RC, 10, neighboring="replace_one")


# --------------------------------------------------------------------------------------------- the engine

def _engine(n=48, batch=8, **kw):
    torch.manual_seed(0)
    x = torch.randn(n, 5)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    engine = PrivacyEngine()
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=batch), criterion=nn.CrossEntropyLoss(),
                max_grad_norm=1.0, estimator="hutch", projection_dim=16, seed=0)
    args.update(kw if "target_epsilon" in kw else {"noise_multiplier": 2.0, **kw})
    return engine, *engine.make_private(**args)


def test_get_epsilon_at_every_step_meets_a_fresh_accountant_and_builds_the_step_once(monkeypatch):
    built = []
    monkeypatch.setattr(schedule_module, "step_plds", lambda *a, **kw: built.append(a[1]) or step_plds(*a, **kw))
    engine, model, opt, crit, loader = _engine()
    mechanism = None
    logged = {}
    for xb, yb in loader:
        crit(model(xb), yb).backward()
        opt.step()
        logged[engine.steps] = engine.get_epsilon(DELTA)
        mechanism = mechanism or engine.accountant().events[0][0]
    assert isinstance(mechanism, SubsampledGaussian) and mechanism.envelope is not None and len(logged) == 6
    assert built == ["remove", "add"]   # once per run (and direction), not once per log
    assert list(logged.values()) == sorted(logged.values())
    for steps in (3, 6):
        fresh = PLDAccountant().compose(mechanism, steps)
        assert fresh.epsilon_bracket(DELTA)[0] <= logged[steps] <= fresh.epsilon(DELTA * (1 - 2e-3))


def test_get_epsilon_at_the_calibrated_count_is_the_fresh_accountants_and_meets_the_target():
    engine, model, opt, crit, loader = _engine(estimator="exact", target_epsilon=2.0, target_delta=DELTA, steps=6)
    logged = []
    for xb, yb in loader:
        crit(model(xb), yb).backward()
        opt.step()
        logged.append(engine.get_epsilon(DELTA))
        if engine.steps == 6:
            break
    assert logged[-1] == engine.accountant().epsilon(DELTA) <= 2.0
    assert logged == sorted(logged)


def test_the_default_takes_a_coarse_grids_bracket_only_where_it_is_within_1e_5():
    """The default first asks a grid 16 times coarser and keeps its bracket where it is within 1e-5 (relative):
    then a bound of the truth no looser than the default grid's own bracket; elsewhere the default grid answers."""
    trainer_like = SubsampledGaussian(1.0, 0.25)    # the docs' tiny DPTrainer run: 20 steps at q = 1/4
    schedule = EpsilonSchedule(trainer_like, 20)
    lo, hi = schedule.epsilon_bracket(10, DELTA)
    assert hi - lo <= 1e-5 * hi
    _within_fresh(trainer_like, 10, (lo, hi))
    coarse = EpsilonSchedule(trainer_like, 20, discretization=1.6e-3, bracket_rtol=None)
    assert (lo, hi) == coarse.epsilon_bracket(10, DELTA)
    # q = 0.01 over 300 steps: the coarse grid's bracket is wider than 1e-5, so the default grid answers
    wide = EpsilonSchedule(SG, 300, discretization=1.6e-3, bracket_rtol=None).epsilon_bracket(300, DELTA)
    assert wide[1] - wide[0] > 1e-5 * wide[1]
    assert EpsilonSchedule(SG, 300).epsilon(300, DELTA) < wide[1]


@pytest.mark.parametrize("discretization", [0.1, 0.5, 1.0])
def test_a_coarse_discretization_answers_without_trying_a_grid_beyond_a_loss_step_of_1(discretization):
    """The default's first try, 16 times coarser, would pass the accountant's largest loss step: it is skipped, and
    the schedule's own grid answers (it raised ``ValueError`` for a discretization above 1/16)."""
    step = SubsampledGaussian(1.0, 0.25)
    fine_lo, _ = EpsilonSchedule(step, 20, bracket_rtol=None).epsilon_bracket(10, DELTA)
    assert fine_lo <= EpsilonSchedule(step, 20, discretization=discretization).epsilon(10, DELTA) < math.inf

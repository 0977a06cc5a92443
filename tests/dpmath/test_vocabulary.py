"""dpmath's public names: the Opacus vocabulary only.  Nothing was released under the paper's names (``sigma``,
``q``, ``k``, ``d``), so they are plain errors, not deprecated spellings."""

import pickle

import pytest

import dpmath
from dpmath import HutchEnvelope, SubsampledGaussian, SubsampledL2Laplace, dpsgd_epsilon, dpsgd_epsilon_bracket
from dpmath.__main__ import main


def test_mechanisms_show_the_new_names():
    assert repr(SubsampledGaussian(1.1, 0.01)) == "SubsampledGaussian(noise_multiplier=1.1, sample_rate=0.01)"
    assert repr(HutchEnvelope(32, 2048)) == "HutchEnvelope(projection_dim=32, dim=2048, family='heavy-light')"


@pytest.mark.parametrize("call, kwargs", [
    (SubsampledGaussian, {"sigma": 1.0, "sample_rate": 0.01}),
    (SubsampledGaussian, {"noise_multiplier": 1.0, "q": 0.01}),
    (HutchEnvelope, {"k": 8, "dim": 16}),
    (dpmath.calibrate_noise_multiplier, {"target_epsilon": 1.0, "delta": 1e-5, "sample_rate": 0.01, "steps": 10}),
])
def test_the_papers_names_are_unknown_keywords(call, kwargs):
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        call(**kwargs)


def test_no_old_aliases_remain():
    assert not hasattr(dpmath, "calibrate_sigma") and not hasattr(SubsampledL2Laplace, "for_sigma")
    assert not hasattr(SubsampledGaussian(1.0, 0.01), "sigma")


def test_dpsgd_epsilon_is_the_float_upper_end_of_the_bracket():
    bracket = dpsgd_epsilon_bracket(1.0, 0.01, 200, 1e-5)
    eps = dpsgd_epsilon(1.0, 0.01, 200, 1e-5)
    assert type(eps) is float and eps == bracket.upper and bracket.lower <= bracket.upper
    assert type(pickle.loads(pickle.dumps(eps))) is float
    with pytest.raises(TypeError):
        lo, hi = eps


@pytest.mark.parametrize("argv", [
    ["epsilon", "--sigma", "1.1", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5"],
    ["sigma", "--target-epsilon", "1", "--sample-rate", "0.01", "--steps", "10", "--target-delta", "1e-5"],
])
def test_the_command_line_refuses_the_old_spellings(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_the_trainer_has_no_k_argument():
    pytest.importorskip("torch")
    from torch import nn

    from dpsgd import PrivacyEngine

    with pytest.raises(TypeError, match="unexpected keyword argument 'k'"):
        PrivacyEngine().make_private(module=nn.Linear(3, 2), optimizer=None, data_loader=None, max_grad_norm=1.0,
                                     k=3)

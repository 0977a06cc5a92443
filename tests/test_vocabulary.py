"""dpmath's public names: the Opacus vocabulary, with the paper's old names working, and warning, for one release."""

import pickle
import warnings

import numpy as np
import pytest

from dpmath import (
    Gaussian,
    HutchEnvelope,
    HutchPPEnvelope,
    RandomizedClipGaussian,
    SubsampledGaussian,
    SubsampledL2Laplace,
    calibrate_noise_multiplier,
    calibrate_sigma,
    dpsgd_epsilon,
    dpsgd_epsilon_bracket,
)
from dpmath.lap2 import joint_log_moment, published_epsilon, published_log_moment, univariate_log_moment
from dpmath.rdp import subsampled_gaussian_rdp
from dpmath.referee import referee_rc_delta, referee_rc_epsilon
from dpmath.twice_sampling import (
    CoordinateSampledGaussian,
    HybridTwiceSampledGaussian,
    TwiceSampledGaussian,
    coordinate_sampling_rdp,
    twice_sampling_rdp,
)

ENV = HutchEnvelope(4, 8)


def _gauss(orders):
    return [a / 2.0 for a in orders]


# (callable, positional arguments, old keywords, the same keywords under their new names)
RENAMED = [
    (Gaussian, (), {"sigma": 2.0}, {"noise_multiplier": 2.0}),
    (SubsampledGaussian, (), {"sigma": 1.1, "q": 0.01}, {"noise_multiplier": 1.1, "sample_rate": 0.01}),
    (RandomizedClipGaussian, (), {"sigma": 1.0, "q": 0.1, "envelope": ENV},
     {"noise_multiplier": 1.0, "sample_rate": 0.1, "envelope": ENV}),
    (SubsampledL2Laplace, (2.0,), {"q": 0.01}, {"sample_rate": 0.01}),
    (HutchEnvelope, (), {"k": 4, "d": 8}, {"projection_dim": 4, "dim": 8}),
    (HutchPPEnvelope, (), {"k": 4, "d": 8}, {"projection_dim": 4, "dim": 8}),
    (calibrate_noise_multiplier, (1.0,), {"delta": 1e-5, "q": 0.05, "steps": 20, "discretization": 1e-3},
     {"target_delta": 1e-5, "sample_rate": 0.05, "steps": 20, "discretization": 1e-3}),
    (subsampled_gaussian_rdp, (), {"sigma": 2.0, "q": 0.01, "orders": [2.5, 3]},
     {"noise_multiplier": 2.0, "sample_rate": 0.01, "orders": [2.5, 3]}),
    (coordinate_sampling_rdp, (), {"sigma": 1.0, "q": 0.1, "c2": 1.0, "c_inf": 0.5, "orders": [2, 3]},
     {"noise_std": 1.0, "coordinate_rate": 0.1, "c2": 1.0, "c_inf": 0.5, "orders": [2, 3]}),
    (twice_sampling_rdp, (), {"q1": 0.1, "base_rdp": _gauss, "orders": [4]},
     {"sample_rate": 0.1, "base_rdp": _gauss, "orders": [4]}),
    (CoordinateSampledGaussian, (), {"sigma": 0.5, "q": 0.01}, {"noise_std": 0.5, "coordinate_rate": 0.01}),
    (TwiceSampledGaussian, (), {"sigma": 0.5, "q1": 0.01, "q2": 0.5}, {"noise_std": 0.5, "sample_rate": 0.01,
                                                                        "coordinate_rate": 0.5}),
    (HybridTwiceSampledGaussian, (), {"sigmas": (0.5,), "q1": 0.02, "q2": 0.5, "c2": (1.0,), "c_inf": (0.1,)},
     {"noise_stds": (0.5,), "sample_rate": 0.02, "coordinate_rate": 0.5, "c2": (1.0,), "c_inf": (0.1,)}),
    (univariate_log_moment, (1.0, 2), {"q": 0.1}, {"sample_rate": 0.1}),
    (published_log_moment, (4,), {"q": 0.01, "scale": 0.5, "clip_norm": 1.0, "dim": 100},
     {"sample_rate": 0.01, "scale": 0.5, "clip_norm": 1.0, "dim": 100}),
    (published_epsilon, (1e-5,), {"q": 0.01, "steps": 10, "scale": 2.0, "clip_norm": 1.0, "dim": 10, "orders": [2, 4]},
     {"sample_rate": 0.01, "steps": 10, "scale": 2.0, "clip_norm": 1.0, "dim": 10, "orders": [2, 4]}),
    (joint_log_moment, ([0.5, 0.5], 2), {"q": 0.1}, {"sample_rate": 0.1}),
    (referee_rc_delta, (), {"sigma": 2.0, "q": 0.1, "envelope": ENV, "steps": 1, "epsilon": 0.5},
     {"noise_multiplier": 2.0, "sample_rate": 0.1, "envelope": ENV, "steps": 1, "epsilon": 0.5}),
    (referee_rc_epsilon, (), {"sigma": 2.0, "q": 0.1, "envelope": ENV, "steps": 1, "delta": 1e-5, "rtol": 1e-3},
     {"noise_multiplier": 2.0, "sample_rate": 0.1, "envelope": ENV, "steps": 1, "delta": 1e-5, "rtol": 1e-3}),
]


def _same(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def _new_names_do_not_warn(call, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return call(*args, **kwargs)


@pytest.mark.parametrize(("call", "args", "old", "new"), RENAMED, ids=[c[0].__name__ for c in RENAMED])
def test_each_old_keyword_warns_names_its_replacement_and_gives_the_same_result(call, args, old, new):
    expected = _new_names_do_not_warn(call, *args, **new)
    with pytest.warns(DeprecationWarning) as caught:
        got = call(*args, **old)
    assert _same(got, expected)
    renamed = {o: n for o, n in zip(old, new, strict=True) if o != n}
    messages = [str(w.message) for w in caught]
    assert len(messages) == len(renamed)
    for o, n in renamed.items():
        assert any(f"({o}=...)" in m and f"({n}=...)" in m for m in messages), (o, messages)
    # the warning points at the line that used the old name, not into dpmath
    assert all(w.filename == __file__ for w in caught)


@pytest.mark.parametrize(("call", "args", "old", "new"), RENAMED, ids=[c[0].__name__ for c in RENAMED])
def test_passing_both_names_is_a_type_error_naming_both(call, args, old, new):
    o, n = next((o, n) for o, n in zip(old, new, strict=True) if o != n)
    with pytest.raises(TypeError, match=rf"'{o}' \(deprecated\) and '{n}'"):
        call(*args, **old, **{n: new[n]})


@pytest.mark.parametrize(("obj", "old", "new"), [
    (Gaussian(2.0), "sigma", "noise_multiplier"),
    (Gaussian(2.0), "q", "sample_rate"),
    (SubsampledGaussian(1.1, 0.01), "sigma", "noise_multiplier"),
    (SubsampledGaussian(1.1, 0.01), "q", "sample_rate"),
    (RandomizedClipGaussian(1.0, 0.1, ENV), "q", "sample_rate"),
    (SubsampledL2Laplace(2.0, 0.01), "q", "sample_rate"),
    (HutchEnvelope(4, 8), "k", "projection_dim"),
    (HutchPPEnvelope(4, 8), "d", "dim"),
    (CoordinateSampledGaussian(0.5, 0.01), "sigma", "noise_std"),
    (TwiceSampledGaussian(0.5, 0.01, 0.5), "q1", "sample_rate"),
    (TwiceSampledGaussian(0.5, 0.01, 0.5), "q2", "coordinate_rate"),
    (HybridTwiceSampledGaussian((0.5,), 0.02, 0.5, (1.0,), (0.1,)), "sigmas", "noise_stds"),
])
def test_old_attribute_names_stay_readable_with_a_warning(obj, old, new):
    with pytest.warns(DeprecationWarning, match=rf"\.{old} is deprecated .* use \w+\.{new}"):
        value = getattr(obj, old)
    assert value == getattr(obj, new)


def test_mechanisms_show_the_new_names():
    assert repr(SubsampledGaussian(1.1, 0.01)) == "SubsampledGaussian(noise_multiplier=1.1, sample_rate=0.01)"
    assert repr(HutchEnvelope(32, 2048)) == "HutchEnvelope(projection_dim=32, dim=2048, family='heavy-light')"


def test_calibrate_sigma_is_a_deprecated_alias():
    expected = _new_names_do_not_warn(calibrate_noise_multiplier, 1.0, 1e-5, 0.05, 20, discretization=1e-3)
    with pytest.warns(DeprecationWarning, match="calibrate_sigma is deprecated .* use calibrate_noise_multiplier"):
        assert calibrate_sigma(1.0, 1e-5, 0.05, 20, discretization=1e-3) == expected


def test_laplace_for_sigma_is_a_deprecated_alias():
    expected = _new_names_do_not_warn(SubsampledL2Laplace.for_noise_multiplier, 1.0, 0.01)
    with pytest.warns(DeprecationWarning, match="for_sigma is deprecated .* use SubsampledL2Laplace.for_noise_mult"):
        assert SubsampledL2Laplace.for_sigma(1.0, 0.01) == expected


def test_dpsgd_epsilon_is_the_float_upper_end_of_the_bracket():
    bracket = _new_names_do_not_warn(dpsgd_epsilon_bracket, 1.0, 0.01, 200, 1e-5)
    eps = _new_names_do_not_warn(dpsgd_epsilon, 1.0, 0.01, 200, 1e-5)
    assert isinstance(eps, float) and eps == bracket.upper and bracket.lower <= bracket.upper
    assert type(eps + 0.0) is float and type(pickle.loads(pickle.dumps(eps))) is float
    assert f"{eps:.6f}" == f"{bracket.upper:.6f}"


def test_the_old_bracket_uses_of_dpsgd_epsilon_still_work_with_a_warning():
    bracket = dpsgd_epsilon_bracket(1.0, 0.01, 200, 1e-5)
    eps = dpsgd_epsilon(1.0, 0.01, 200, 1e-5)
    with pytest.warns(DeprecationWarning, match="unpacking dpsgd_epsilon.* use dpsgd_epsilon_bracket"):
        lo, hi = eps
    assert (lo, hi) == tuple(bracket)
    with pytest.warns(DeprecationWarning, match=r"dpsgd_epsilon\(\.\.\.\)\.lower"):
        assert eps.lower == bracket.lower
    with pytest.warns(DeprecationWarning, match=r"dpsgd_epsilon\(\.\.\.\)\.upper"):
        assert eps.upper == bracket.upper


def test_the_trainers_old_projection_argument_warns_and_means_projection_dim():
    torch = pytest.importorskip("torch")
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from dpsgd import PrivacyEngine

    data = TensorDataset(torch.randn(20, 3), torch.randint(0, 2, (20,)))
    model = nn.Linear(3, 2)
    engine = PrivacyEngine()
    with pytest.warns(DeprecationWarning, match=r"make_private\(projection_dim=...\)"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            data_loader=DataLoader(data, batch_size=5), max_grad_norm=1.0, noise_multiplier=1.0,
                            k=7)
    assert engine.projection_dim == 7
    with pytest.warns(DeprecationWarning, match="projection_dim"):
        assert engine.k == 7
    with pytest.raises(TypeError, match="both 'k'"):
        PrivacyEngine().make_private(module=nn.Linear(3, 2), optimizer=None, data_loader=None, max_grad_norm=1.0,
                                     k=3, projection_dim=3)


def test_the_hf_privacy_arguments_old_k_warns():
    pytest.importorskip("transformers")
    from dpsgd.hf import PrivacyArguments

    with pytest.warns(DeprecationWarning, match="projection_dim"):
        args = PrivacyArguments(k=16)
    assert args.projection_dim == 16


def test_dpsgd_epsilon_works_where_python_rebuilds_a_float_from_its_type():
    import statistics

    e = dpsgd_epsilon(1.1, 0.01, 100, 1e-5)
    assert statistics.mean([e, e]) == float(e)
    assert type(e)(2.5) == 2.5 and type(type(e)(2.5)) is float

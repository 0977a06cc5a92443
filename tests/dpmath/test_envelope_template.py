"""The envelopes' public distribution functions are the base class's: every subclass's ``cdf``, ``sf`` and ``ppf``
refuse bad input, naming the argument, before its implementation runs, hand it one float64 array, and return a scalar
for a scalar; each keeps its own docstring."""

import numpy as np
import pytest

from dpmath import (
    DiscreteEnvelope,
    Envelope,
    HutchEnvelope,
    HutchPPEnvelope,
    PointMassEnvelope,
    ReplacementEnvelope,
)

ENVELOPES = [HutchEnvelope(4, 16), HutchPPEnvelope(4, 16), PointMassEnvelope(0.5),
             DiscreteEnvelope([0.25, 1.0], [0.3, 0.7]), ReplacementEnvelope(HutchPPEnvelope(4, 16))]
IDS = [type(e).__name__ for e in ENVELOPES]
BAD = [("cdf", float("nan"), "x must not contain NaN"),
       ("sf", [1.0, float("nan")], "x must not contain NaN"),
       ("cdf", "a", "x must be real numbers"),
       ("sf", object(), "x must be real numbers"),
       ("ppf", 1.5, r"q must lie in \[0, 1\]"),
       ("ppf", [0.5, -0.1], r"q must lie in \[0, 1\]"),
       ("ppf", float("nan"), "q must not contain NaN")]


def _spy(monkeypatch, env, calls):
    """Record what each implementation (``_cdf``, ``_sf``, ``_ppf``) of ``env``'s class is called with."""
    for name in ("_cdf", "_sf", "_ppf"):
        impl = getattr(type(env), name)

        def spy(self, value, _impl=impl, _name=name):
            calls.append((_name, value))
            return _impl(self, value)
        monkeypatch.setattr(type(env), name, spy)


@pytest.mark.parametrize("env", ENVELOPES, ids=IDS)
@pytest.mark.parametrize(("function", "value", "message"), BAD)
def test_bad_input_is_refused_naming_the_argument_before_the_implementation_runs(monkeypatch, env, function, value,
                                                                                 message):
    calls = []
    _spy(monkeypatch, env, calls)
    with pytest.raises(ValueError, match=message):
        getattr(env, function)(value)
    assert calls == []


@pytest.mark.parametrize("env", ENVELOPES, ids=IDS)
@pytest.mark.parametrize(("function", "value"), [("cdf", [[0.3, 0.9], [1.0, 2]]), ("sf", (0.5, 1.5)),
                                                 ("ppf", [0.1, 0.6])])
def test_the_implementation_gets_one_float64_array_of_the_arguments_shape(monkeypatch, env, function, value):
    calls = []
    _spy(monkeypatch, env, calls)
    out = getattr(env, function)(value)
    name, arg = calls[0]
    assert name == f"_{function}"
    assert type(arg) is np.ndarray and arg.dtype == np.float64 and arg.shape == np.shape(value)
    assert isinstance(out, np.ndarray) and out.shape == np.shape(value)


@pytest.mark.parametrize("env", ENVELOPES, ids=IDS)
@pytest.mark.parametrize(("function", "value"), [("cdf", 0.7), ("sf", 1), ("ppf", 0.3)])
def test_a_scalar_argument_gives_a_numpy_scalar(env, function, value):
    out = getattr(env, function)(value)
    assert type(out) is np.float64
    assert out == getattr(env, function)([value])[0]


@pytest.mark.parametrize("cls", [type(e) for e in ENVELOPES], ids=IDS)
@pytest.mark.parametrize("function", ["cdf", "sf", "ppf"])
def test_each_envelope_keeps_its_own_docstring_on_the_public_function(cls, function):
    public = getattr(cls, function)
    if f"_{function}" in vars(cls):   # the subclass implements it: its docstring documents the public function
        assert public is not getattr(Envelope, function) and public.__doc__ and public.__qualname__ == (
            f"{cls.__name__}.{function}")
    else:
        assert public is getattr(Envelope, function)

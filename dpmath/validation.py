"""Argument checks shared by the public functions of :mod:`dpmath`.

Every check raises :class:`ValueError` naming the argument and the allowed range, so that a
caller sees *which* input was wrong rather than a NaN three calls later.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["positive_int", "real_array", "real_number", "probability_array", "positive_real", "sample_rate",
           "open_probability", "non_negative"]


def _unwrap_scalar(value: object, name: str, kind: str, cast: str = "float") -> object:
    """``value`` as a Python scalar where it is a NumPy scalar or 0-d array (the result of indexing or reducing an
    array, a number to the caller); an array with any axis is refused, naming its shape, and so is ``None``."""
    if value is None:
        raise ValueError(f"{name} must be {kind}, got None")
    if isinstance(value, np.ndarray) and value.ndim > 0:
        raise ValueError(f"{name} must be {kind}, got an array of shape {value.shape}; pass one value "
                         f"(e.g. {name}={cast}(x[0])), or call once per value")
    if isinstance(value, (np.ndarray, np.generic)):
        return value.item()
    return value


def positive_int(value: object, name: str) -> int:
    """Return ``value`` as an ``int`` if it is an integer >= 1 (a NumPy integer or 0-d array too), else raise
    ValueError."""
    value = _unwrap_scalar(value, name, "a positive integer (>= 1)", "int")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and value.is_integer() and value >= 1:
            return int(value)
        raise ValueError(f"{name} must be a positive integer (>= 1), got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer (>= 1), got {value!r}")
    return int(value)


def real_array(value: object, name: str, *, allow_inf: bool = True) -> np.ndarray:
    """Return ``value`` as a float64 array; NaN (and, optionally, infinities) raise ValueError."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be real numbers, got {value!r}") from exc
    if np.isnan(arr).any():
        raise ValueError(f"{name} must not contain NaN")
    if not allow_inf and np.isinf(arr).any():
        raise ValueError(f"{name} must be finite")
    return arr


def real_number(value: object, name: str, *, allow_inf: bool = True) -> float:
    """Return ``value`` as one float (a NumPy scalar or 0-d array too); NaN, (optionally) infinities and arrays with
    an axis raise ValueError, the last naming their shape."""
    arr = real_array(_unwrap_scalar(value, name, "a real number"), name, allow_inf=allow_inf)
    if arr.ndim > 0:   # a list or tuple: NumPy arrays were refused above
        raise ValueError(f"{name} must be a real number, got a sequence of shape {arr.shape}; pass one value, "
                         f"or call once per value")
    return float(arr)


def probability_array(value: object, name: str) -> np.ndarray:
    """Return ``value`` as a float64 array with every entry in [0, 1], else raise ValueError."""
    arr = real_array(value, name)
    if ((arr < 0) | (arr > 1)).any():
        raise ValueError(f"{name} must lie in [0, 1]")
    return arr


def positive_real(value: object, name: str) -> float:
    """Return ``value`` as a finite float > 0, else raise ValueError (e.g. ``sigma``)."""
    v = real_number(value, name, allow_inf=False)
    if not v > 0:
        raise ValueError(f"{name} must be positive (> 0), got {value!r}")
    return v


def sample_rate(value: object, name: str = "sample_rate") -> float:
    """Return ``value`` as a sampling probability in (0, 1], else raise ValueError."""
    v = real_number(value, name, allow_inf=False)
    if not 0 < v <= 1:
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
    return v


def open_probability(value: object, name: str) -> float:
    """Return ``value`` as a float in (0, 1), else raise ValueError (e.g. ``delta``)."""
    v = real_number(value, name, allow_inf=False)
    if not 0 < v < 1:
        raise ValueError(f"{name} must lie in (0, 1), got {value!r}")
    return v


def non_negative(value: object, name: str) -> float:
    """Return ``value`` as a finite float >= 0, else raise ValueError (e.g. ``epsilon``)."""
    v = real_number(value, name, allow_inf=False)
    if v < 0:
        raise ValueError(f"{name} must be non-negative (>= 0), got {value!r}")
    return v

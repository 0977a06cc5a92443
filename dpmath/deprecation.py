"""Old argument and attribute names that keep working, with a warning, for one release.

dpmath's public arguments use the words Opacus users meet (``noise_multiplier``, ``sample_rate``,
``projection_dim``, ``dim``, ``target_epsilon``, ``target_delta``).  The paper symbols they replace
(``sigma``, ``q``, ``k``, ``d``, ...) are accepted until release :data:`REMOVAL` by
:func:`renamed_arguments`, which every renamed function and class uses, and old function names by
:func:`deprecated_alias`.  Each use of an old name emits one :class:`DeprecationWarning` naming its
replacement; positional calls are unaffected.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["REMOVAL", "renamed_arguments", "deprecated_alias", "warn_renamed"]

REMOVAL = "0.3"
"""The release that drops the old names."""

T = TypeVar("T")


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Emit the :class:`DeprecationWarning` for one use of the old name ``old`` of ``new``.

    ``stacklevel`` counts from the caller of this function, as :func:`warnings.warn` does; the
    default ``3`` points at whoever called the function that calls this one.
    """
    warnings.warn(f"{old} is deprecated and will be removed in dpmath {REMOVAL}; use {new}",
                  DeprecationWarning, stacklevel=stacklevel)


def _renamed_property(owner: str, old: str, new: str) -> property:
    def get(self: Any) -> Any:
        warn_renamed(f"{owner}.{old}", f"{owner}.{new}")
        return getattr(self, new)

    get.__doc__ = f"Deprecated name of :attr:`{new}` (warns; removed in dpmath {REMOVAL})."
    return property(get)


def renamed_arguments(renames: Mapping[str, str]) -> Callable[[T], T]:
    """Decorator: accept each old keyword ``old`` of ``renames`` as its new name ``renames[old]``.

    On a function, a call with an old keyword warns and is forwarded with the new one.  On a class
    the same applies to its constructor, and each old name also becomes a read-only property that
    warns and returns the attribute of the new name.  Passing an argument under both names is a
    :class:`TypeError` naming both.

    Parameters
    ----------
    renames : mapping of str to str
        Old keyword name to new keyword name.

    Returns
    -------
    callable
        The decorator; it returns the function (wrapped) or the class (modified in place).

    Examples
    --------
    >>> import warnings
    >>> from dpmath.deprecation import renamed_arguments
    >>> @renamed_arguments({"sigma": "noise_multiplier"})
    ... def half(noise_multiplier):
    ...     return noise_multiplier / 2
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     half(sigma=3.0), str(caught[0].message)
    (1.5, 'half(sigma=...) is deprecated and will be removed in dpmath 0.3; use half(noise_multiplier=...)')
    >>> half(sigma=1.0, noise_multiplier=1.0)
    Traceback (most recent call last):
    ...
    TypeError: half() got both 'sigma' (deprecated) and 'noise_multiplier'; pass only 'noise_multiplier'
    """
    renames = dict(renames)

    def decorate(obj: T) -> T:
        if isinstance(obj, type):
            obj.__init__ = decorate_function(obj.__init__, obj.__name__)
            for old, new in renames.items():
                setattr(obj, old, _renamed_property(obj.__name__, old, new))
            return obj
        return decorate_function(obj, obj.__qualname__)

    def decorate_function(function: Callable, name: str) -> Callable:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            used = [old for old in renames if old in kwargs]
            for old in used:   # refuse before warning about anything
                if renames[old] in kwargs:
                    new = renames[old]
                    raise TypeError(f"{name}() got both {old!r} (deprecated) and {new!r}; pass only {new!r}")
            for old in used:
                warn_renamed(f"{name}({old}=...)", f"{name}({renames[old]}=...)")
                kwargs[renames[old]] = kwargs.pop(old)
            return function(*args, **kwargs)

        return call

    return decorate


def deprecated_alias(function: Callable[..., T], old_name: str) -> Callable[..., T]:
    """``function`` under its old name ``old_name``: the same call, with a :class:`DeprecationWarning`.

    Examples
    --------
    >>> import warnings
    >>> from dpmath.deprecation import deprecated_alias
    >>> twice = deprecated_alias(lambda x: 2 * x, "double")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     twice(2), caught[0].category.__name__
    (4, 'DeprecationWarning')
    """
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> T:
        warn_renamed(old_name, function.__name__)
        return function(*args, **kwargs)

    call.__name__ = call.__qualname__ = old_name
    call.__doc__ = f"Deprecated alias of :func:`{function.__name__}` (warns; removed in dpmath {REMOVAL})."
    return call

"""The result of an audit, its figures, the progress records long audits log, and the result of an audit
whose optional dependency is missing."""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["AuditResult", "Figure", "INSTALL", "progress", "skipped_without", "slug"]

T = TypeVar("T")

logger = logging.getLogger("verify")

INSTALL = 'pip install torch==2.13.0 && pip install -e ".[verify]"'
"""What every audit needs (torch, sympy, transformers, the peer accountants): the README's install line."""


@dataclass(frozen=True)
class Figure:
    """A plot an audit offers to the report: ``draw(ax)`` fills one matplotlib ``Axes``.

    Audits never import matplotlib; :mod:`verify.report` does, and calls ``draw`` when it is installed.

    Attributes
    ----------
    name : str
        File stem of the PNG (letters, digits, ``_`` and ``-``).
    caption : str
        One sentence under the plot.
    draw : callable
        ``draw(ax) -> None``.
    """

    name: str
    caption: str
    draw: Callable[[Any], None]


@dataclass
class AuditResult:
    """The outcome of one audit.

    Attributes
    ----------
    name : str
    kind : str
        ``"check"`` (a guarantee of this library: a failure fails ``python -m verify``) or ``"finding"``
        (claims of a paper: ``holds=False`` means at least one is refuted; the run still succeeds).
    holds : bool
        The check passed / every claim survived.
    summary : str
        One line.
    rows : list of dict
        The numbers behind it, one row per test or claim; a row with ``holds`` False is a failure (check)
        or a refuted claim (finding).
    figures : list of Figure
        Plots for the report.
    skipped : str, optional
        Why the audit did not run (a missing optional dependency) and how to install it; its verdict is then
        ``SKIPPED``, never ``PASS``.
    """

    name: str
    kind: str
    holds: bool
    summary: str
    rows: list[dict] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    skipped: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("check", "finding"):
            raise ValueError(f"kind must be 'check' or 'finding', got {self.kind!r}")

    @property
    def verdict(self) -> str:
        """``PASS``/``FAIL`` for a check, ``holds``/``refuted`` for a finding, ``SKIPPED`` if it did not run."""
        if self.skipped:
            return "SKIPPED"
        if self.kind == "check":
            return "PASS" if self.holds else "FAIL"
        return "holds" if self.holds else "refuted"

    @property
    def failures(self) -> list[dict]:
        """Rows whose ``holds`` is False."""
        return [r for r in self.rows if r.get("holds") is False]


def slug(text: str, limit: int = 48) -> str:
    """A file stem from free text: lower case, each run of other characters one ``-``.

    Examples
    --------
    >>> from verify.result import slug
    >>> slug("DP-SGD (q = 1)")
    'dp-sgd-q-1'
    """
    return re.sub(r"[^a-z0-9]+", "-", text.lower())[:limit].strip("-")


#: an audit called from Python with no handler for the ``"verify"`` logger prints its progress to stderr once it has
#: run this long (seconds)
QUIET_FOR = 2.0


def progress(items: Iterable[T], label: str, total: int | None = None) -> Iterator[T]:
    """Yield ``items``, reporting ``[label] i/total (seconds)`` at each quarter of them, so that a long audit shows
    it is alive in a few lines: INFO records of the ``"verify"`` logger where something shows them (``python -m
    verify`` does, on stderr), else, once it has run :data:`QUIET_FOR` seconds, lines on stderr (an audit called
    from Python with logging left unconfigured).

    Examples
    --------
    >>> from verify.result import progress
    >>> list(progress(range(3), "demo"))
    [0, 1, 2]
    """
    items = list(items) if total is None and not hasattr(items, "__len__") else items
    n = len(items) if total is None else total  # type: ignore[arg-type]
    start, marks = time.perf_counter(), set()
    shown = logger.isEnabledFor(logging.INFO) and logger.hasHandlers()
    for i, item in enumerate(items, 1):
        yield item
        if n and (q := 4 * i // n) not in marks and q > 0:
            marks.add(q)
            elapsed = time.perf_counter() - start
            if shown:
                logger.info("  [%s] %d/%d (%.1f s)", label, i, n, elapsed)
            elif elapsed > QUIET_FOR:
                print(f"verify: [{label}] {i}/{n} ({elapsed:.1f} s)", file=sys.stderr, flush=True)


def skipped_without(module: str, name: str, kind: str = "check") -> AuditResult | None:
    """``None`` if ``module`` is installed; else audit ``name``'s ``SKIPPED`` result, naming the module and
    :data:`INSTALL`, so that ``python -m verify`` runs on ``pip install -e .`` alone instead of failing with a
    ``ModuleNotFoundError``.

    Parameters
    ----------
    module : str
        The top-level module the audit imports (``"torch"``, ``"sympy"``).
    name, kind
        The audit's :class:`AuditResult` name and kind.

    Returns
    -------
    AuditResult or None

    Examples
    --------
    >>> from verify.result import skipped_without
    >>> skipped_without("math", "demo") is None
    True
    >>> r = skipped_without("no_such_module", "demo")
    >>> r.verdict, r.skipped
    ('SKIPPED', 'needs no_such_module, which is not installed: pip install torch==2.13.0 && pip install -e ".[verify]"')
    """
    if importlib.util.find_spec(module) is not None:
        return None
    why = f"needs {module}, which is not installed: {INSTALL}"
    return AuditResult(name, kind, True, f"skipped: {why}", skipped=why)

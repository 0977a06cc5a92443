"""What the command-line tools share: showing the libraries' progress records (no torch needed).

The packages only emit :mod:`logging` records, on the loggers ``"dpsgd"`` (calibration in ``make_private``,
the demo's epochs), ``"dpmath"`` and ``"verify"`` (each audit as it starts and ends), and leave showing them
to the application, as a library should.  ``python -m dpsgd``, ``python -m dpsgd.demo`` and
``python -m verify`` call :func:`show_progress` when run as commands (not when their ``main`` is called from
Python) so that INFO records reach stderr by default; in your own
program, ``logging.basicConfig(level=logging.INFO)`` shows them (or ``logging.getLogger("dpsgd")
.setLevel(logging.INFO)`` with a handler of your own).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = ["LOGGERS", "show_progress"]

#: The loggers whose records the command-line tools show.
LOGGERS = ("dpsgd", "dpmath", "verify")

_HANDLER = "dpsgd.cli"   # the name of show_progress's handler, so that a second call finds the first one's


def show_progress(level: int = logging.INFO, stream: TextIO | None = None) -> None:
    r"""Send the records of :data:`LOGGERS` at ``level`` and above to ``stream``, one line each with the time.

    Only these loggers get the handler (other libraries' INFO records stay hidden), and a second call replaces
    the first one's handler instead of adding another (no line is shown twice).

    Parameters
    ----------
    level : int
        The lowest level shown (default ``logging.INFO``).
    stream : file-like, optional
        Where the lines go (default ``sys.stderr``, so that a command's results on stdout stay clean).

    Examples
    --------
    >>> import io, logging
    >>> from dpsgd.cli import show_progress
    >>> out = io.StringIO()
    >>> show_progress(stream=out)
    >>> logging.getLogger("verify").info("[1/11] estimators ...")
    >>> out.getvalue()[9:]    # after the time of day
    'verify: [1/11] estimators ...\n'
    """
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    handler.set_name(_HANDLER)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for old in [h for h in logger.handlers if h.get_name() == _HANDLER]:
            logger.removeHandler(old)
        logger.addHandler(handler)

"""What the command-line tools share: showing the libraries' progress records, and the norm plan report of
``python -m dpsgd plan`` (importing this module needs no torch).

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

__all__ = ["LOGGERS", "plan_report", "show_progress"]

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


def plan_report(model, estimator: str, projection_dim: int,
                target: tuple[float, float, float, int] | None = None) -> str:
    """The text ``python -m dpsgd plan`` prints after its first line: the table, ``D``, the accounting and, with a
    ``target``, the noise the plan needs against exact norms' (what ``make_private`` logs).

    Parameters
    ----------
    model : torch.nn.Module
    estimator : {"auto", "hutch", "hutchpp", "ghost", "exact"}
    projection_dim : int
        ``k`` of ``hutch``/``hutchpp``.
    target : tuple, optional
        ``(target_epsilon, target_delta, sample_rate, steps)``: calibrate the noise multiplier with this plan's
        envelope and with exact norms.

    Returns
    -------
    str

    Examples
    --------
    >>> from torch import nn
    >>> from dpsgd.cli import plan_report
    >>> print(plan_report(nn.Sequential(nn.Linear(8, 3), nn.ReLU(), nn.Linear(3, 2)), "hutch", 4))
    parameter  module  shape  handler        norm   terms
    ---------  ------  -----  -------------  -----  -----
    0.weight   Linear  3x8    LinearHandler  hutch      3
    0.bias     Linear  3      LinearHandler  hutch      1
    2.weight   Linear  2x3    LinearHandler  hutch      2
    2.bias     Linear  2      LinearHandler  hutch      1
    <BLANKLINE>
    estimator hutch: 4 of 4 parameters estimated with hutch (D = 7), 0 exact
    envelope dimension D = 7: the terms column summed over all 4 trainable parameters
      (min(rows, cols) per estimated weight, 1 per estimated bias; not the widest layer's)
    accountant's envelope: HutchEnvelope(projection_dim=4, dim=7, family='heavy-light')
    epsilon: python -m dpmath epsilon --estimator hutch --projection-dim 4 --dim 7 --noise-multiplier SIGMA ...
    """
    from dpmath import HutchPPEnvelope

    from .plan import NormPlan

    plan = NormPlan.build(model, estimator, projection_dim)
    envelope = plan.envelope(projection_dim)
    d, exact = plan.envelope_dimension()
    lines = [str(plan.table()), "", plan.summary()]
    if target is not None:
        from dpmath import calibrate_noise_multiplier

        sigma_exact = calibrate_noise_multiplier(*target)
        if envelope is None:
            lines.append(f"noise_multiplier {sigma_exact:.4g} for epsilon {target[0]:g} at delta {target[1]:g}")
        else:
            sigma = calibrate_noise_multiplier(*target, envelope=envelope)
            lines.append(f"noise_multiplier {sigma:.4g} with the estimate against {sigma_exact:.4g} with exact norms "
                         f"(+{100 * (sigma / sigma_exact - 1):.1f} % noise) for epsilon {target[0]:g} at delta "
                         f"{target[1]:g}")
    sampling = "--noise-multiplier SIGMA --delta DELTA --sample-rate Q --steps STEPS"
    if envelope is None:
        lines += ["every per-example norm is exact: the accountant charges DP-SGD's subsampled Gaussian (no envelope)",
                  f"epsilon: python -m dpmath epsilon {sampling}"]
        return "\n".join(lines)
    form = "hutchpp" if isinstance(envelope, HutchPPEnvelope) else "hutch"
    lines += [f"envelope dimension D = {d}: the terms column summed over all {len(plan.params)} trainable parameters",
              "  (min(rows, cols) per estimated weight, 1 per estimated bias; not the widest layer's)",
              f"accountant's envelope: {envelope!r}"]
    if exact:
        lines.append("  (exact parts are point masses, the d -> inf limit: the Hutch++ form with d = max(D, k + 1))")
    lines.append(f"epsilon: python -m dpmath epsilon --estimator {form} --projection-dim {projection_dim} "
                 f"--dim {envelope.dim} {sampling}")
    if form != plan.estimated_with:
        lines.append(f"  (--estimator {form} names the envelope's form, which the exact parts give it; the weights are "
                     f"estimated with {plan.estimated_with})")
    return "\n".join(lines)

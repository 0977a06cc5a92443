"""verify: audits of estimators, envelopes and published claims; ``python -m verify`` prints a verdict.

Checks of this library's guarantees fail the run; findings about papers are reported, never hidden.
So far: estimator bias, envelope domination, one-step privacy audits and the papers' claims
(:mod:`verify.audits`); multi-step audits, plots and peer cross-checks of the issue "verify: Monte Carlo and
property audits ..." are to come.
"""

__all__ = ["AUDITS", "AuditResult"]


def __getattr__(name: str):
    if name in __all__:
        from . import audits

        return getattr(audits, name)
    raise AttributeError(f"module 'verify' has no attribute {name!r}")

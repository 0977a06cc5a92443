"""verify: audits of estimators, envelopes, accountants and published claims; ``python -m verify`` prints a verdict.

*Checks* test this library's guarantees and fail the run; *findings* test papers' claims and are reported,
never hidden.  Every audit is a function returning an :class:`AuditResult`:

========================================================  ======================================================
:func:`~verify.estimators.estimator_audit`                bias, law and variance of Hutch / Hutch++; whole-model
                                                          norms against torch.func
:func:`~verify.envelope.envelope_audit`                   envelope domination: exact CDFs, adversarial search,
                                                          Monte Carlo bounds
:func:`~verify.divergences.divergence_audit`              closed forms, quadrature and exact moments against
                                                          the accountants
:func:`~verify.privacy.privacy_audit`                     simulated mechanisms, certified epsilon lower bounds
:func:`~verify.symbolic.symbolic_audit`                   sympy derivations and our numbers against them
:func:`~verify.peers.peer_audit`                          dp_accounting and prv_accountant, when installed
:func:`~verify.envelope.envelope_claims`                  paper 000's ``x_-``, ``x_+``, extremes (finding)
:func:`~verify.schur_claims.schur_audit`                  Props. B.11/B.12, Thms III.5/III.7 (finding)
:func:`~verify.claims.claims_audit`                       paper 002's numbers, LAP2's published epsilon (finding)
========================================================  ======================================================
"""

__all__ = ["AUDITS", "AuditResult", "Figure"]


def __getattr__(name: str):
    if name == "AUDITS":
        from .audits import AUDITS

        return AUDITS
    if name in ("AuditResult", "Figure"):
        from . import result

        return getattr(result, name)
    raise AttributeError(f"module 'verify' has no attribute {name!r}")

"""The registry of audits that ``python -m verify`` runs, with their quick and full settings.

Each entry is ``name -> (function, quick kwargs, full kwargs)``; every function returns an
:class:`~verify.result.AuditResult` and can be called on its own.  The ``seed`` given on the command line
is passed to the functions that take one.
"""

from __future__ import annotations

from collections.abc import Callable

from .allocation import ALLOCATION_CONFIGS, allocation_audit
from .claims import claims_audit
from .correlated import CORRELATED_CONFIGS, correlated_audit
from .divergences import divergence_audit
from .envelope import envelope_audit, envelope_claims
from .estimators import estimator_audit
from .peers import PEER_CONFIGS, REFEREE_CONFIGS, REFEREE_RC_CONFIGS, peer_audit, referee_audit
from .privacy import QUICK_MECHANISMS, privacy_audit
from .result import AuditResult
from .schur_claims import schur_audit
from .symbolic import symbolic_audit
from .training import CONFIGS, sampler_audit, trainer_audit

__all__ = ["AUDITS"]

AUDITS: dict[str, tuple[Callable[..., AuditResult], dict, dict]] = {
    "estimators": (estimator_audit, {"draws": 500, "model_draws": 100}, {"draws": 20_000, "model_draws": 2000}),
    "envelope": (envelope_audit, {"lambdas": 6, "draws": 40_000, "starts": 1},
                 {"cases": ((4, 6), (32, 8), (1, 5), (8, 16)), "lambdas": 200, "draws": 1_000_000, "starts": 4}),
    "divergences": (divergence_audit, {"quad_points": 50_001, "mc_draws": 100_000},
                    {"quad_points": 400_001, "mc_draws": 2_000_000}),
    "privacy": (privacy_audit, {"samples": 100_000, "y_pool": 5_000, "pilot": 500, "mechanisms": QUICK_MECHANISMS},
                {"samples": 2_000_000, "y_pool": 400_000, "pilot": 20_000}),
    "symbolic": (symbolic_audit, {}, {}),
    "trainer": (trainer_audit, {}, {"configs": CONFIGS, "runs": 3}),
    "samplers": (sampler_audit, {}, {"runs": 3}),
    "peers": (peer_audit, {"configs": [PEER_CONFIGS[i] for i in (0, 7, 15)]}, {"configs": PEER_CONFIGS}),
    "referee": (referee_audit, {}, {"configs": REFEREE_CONFIGS, "rc_configs": REFEREE_RC_CONFIGS}),
    "allocation": (allocation_audit, {"draws": 200_000}, {"configs": ALLOCATION_CONFIGS, "draws": 2_000_000}),
    "correlated": (correlated_audit, {"draws": 100_000}, {"configs": CORRELATED_CONFIGS, "draws": 2_000_000}),
    "envelope_claims": (envelope_claims, {"ks": (32, 128), "ds": (2, 8, 64)}, {"ks": (1, 4, 32, 128, 512)}),
    "schur": (schur_audit, {"cases": ((4, 2, 1.0), (4, 3, 1.0))},
              {"cases": ((1, 2, 1.0), (4, 2, 1.0), (4, 3, 1.0), (32, 3, 1.0), (32, 4, 1.0), (4, 3, 2.0),
                         (32, 3, 2.0), (32, 4, 2.5), (1, 3, 3.0))}),
    "claims": (claims_audit, {"samples": 100_000}, {"samples": 2_000_000}),
}
"""Registered audits: ``name -> (function, quick kwargs, full kwargs)``; checks first, then findings."""

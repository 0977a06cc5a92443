"""verify: Monte Carlo and property audits of estimators and privacy bounds.

Not implemented yet (tracked by the issue "verify: Monte Carlo and property audits ...").  Until it
lands, the envelope audits live in ``tests/`` and the demo is ``python -m dpmath envelope``.
"""

__all__: list[str] = []

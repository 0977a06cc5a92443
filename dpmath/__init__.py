"""dpmath: high-precision mathematics of differential privacy with randomized clipping.

No torch here: chi-square mixture distribution functions (:mod:`dpmath.chi2mix`), the envelope
distributions that make randomized clipping private (:mod:`dpmath.envelope`), and their pessimistic
discretization for privacy accountants.
"""

from .chi2mix import chi2_mixture_cdf, chi2_mixture_pdf, chi2_mixture_sf, two_block_cdf
from .envelope import (
    Envelope,
    HutchEnvelope,
    HutchPPEnvelope,
    Maximizer,
    ScaleDistribution,
    pessimistic_discretization,
)

__all__ = [
    "chi2_mixture_cdf",
    "chi2_mixture_sf",
    "chi2_mixture_pdf",
    "two_block_cdf",
    "Envelope",
    "HutchEnvelope",
    "HutchPPEnvelope",
    "Maximizer",
    "ScaleDistribution",
    "pessimistic_discretization",
]
__version__ = "0.1.0"

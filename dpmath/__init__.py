"""dpmath: high-precision mathematics of differential privacy with randomized clipping.

No torch here: chi-square mixture distribution functions (:mod:`dpmath.chi2mix`), the envelope
distributions that make randomized clipping private (:mod:`dpmath.envelope`, :mod:`dpmath.hutch`) and their
pessimistic discretization (:mod:`dpmath.discretization`), mechanisms (:mod:`dpmath.mechanisms`), privacy
accountants (:mod:`dpmath.pld`, :mod:`dpmath.rdp`, on the common base of :mod:`dpmath.accountant`) and noise
calibration (:mod:`dpmath.calibration`); majorization and Schur checks (:mod:`dpmath.majorization`,
:mod:`dpmath.schur`), LAP2 (:mod:`dpmath.lap2`) and twice sampling (:mod:`dpmath.twice_sampling`).
"""

from .accountant import Accountant, Neighboring, UnsupportedMechanismError
from .calibration import (
    Bracket,
    calibrate_noise,
    calibrate_noise_multiplier,
    dpsgd_epsilon,
    dpsgd_epsilon_bracket,
    estimator_envelope,
)
from .chi2mix import chi2_mixture_cdf, chi2_mixture_pdf, chi2_mixture_sf, two_block_cdf
from .discretization import ScaleDistribution, pessimistic_discretization
from .envelope import DiscreteEnvelope, Envelope, PointMassEnvelope, ReplacementEnvelope
from .hutch import HutchEnvelope, HutchPPEnvelope, Maximizer
from .mechanisms import (
    FixedSizeSubsampledGaussian,
    Gaussian,
    RandomAllocationGaussian,
    ShuffledGaussian,
    SubsampledGaussian,
    SubsampledL2Laplace,
    TruncatedSubsampledGaussian,
)
from .pld import EpsilonSchedule, GridTooLargeError, PLDAccountant
from .rdp import RDPAccountant

__all__ = [
    "chi2_mixture_cdf",
    "chi2_mixture_sf",
    "chi2_mixture_pdf",
    "two_block_cdf",
    "Envelope",
    "HutchEnvelope",
    "HutchPPEnvelope",
    "Maximizer",
    "PointMassEnvelope",
    "DiscreteEnvelope",
    "ReplacementEnvelope",
    "ScaleDistribution",
    "pessimistic_discretization",
    "Gaussian",
    "SubsampledGaussian",
    "SubsampledL2Laplace",
    "TruncatedSubsampledGaussian",
    "FixedSizeSubsampledGaussian",
    "RandomAllocationGaussian",
    "ShuffledGaussian",
    "Accountant",
    "Neighboring",
    "UnsupportedMechanismError",
    "PLDAccountant",
    "EpsilonSchedule",
    "GridTooLargeError",
    "RDPAccountant",
    "Bracket",
    "calibrate_noise",
    "calibrate_noise_multiplier",
    "dpsgd_epsilon",
    "dpsgd_epsilon_bracket",
    "estimator_envelope",
]
__version__ = "0.1.0"

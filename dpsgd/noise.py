r"""The noise of the private step, as an object that pairs its draws with its accounting.

A step adds noise of scale ``noise_multiplier * C`` to every coordinate of the clipped sum.  Which
distribution that is decides both what the step draws and which dpmath mechanism the accountant composes,
so both come from one object, chosen in :meth:`dpsgd.PrivacyEngine.make_private` (``noise=``):

* :class:`GaussianNoise` (default): ``N(0, (sigma C)^2)`` per coordinate; accounted as
  :class:`dpmath.SubsampledGaussian`, with the estimator's envelope where norms are estimated.
* :class:`LaplaceNoise`: LAP2 (paper 003), ``Laplace(b)`` per coordinate with ``b = noise_multiplier * C``
  on the l2-clipped sum; accounted as :class:`dpmath.SubsampledL2Laplace` through its sound Gaussian
  domination (never the paper's Thm III.7 bound, which :doc:`/majorization` refutes).  Exact norms only:
  no accountant here covers Laplace noise on a randomly scaled (estimated-norm) clipped gradient.

* :class:`BandedNoise`: correlated noise, banded matrix factorization (:mod:`dpmath.correlated`): step ``t``
  adds :math:`(C^{-1} z)_t`, made from fresh Gaussian draws and the last ``b - 1`` steps' noise, which the step
  keeps in memory only (:class:`CorrelatedStream`: never in a checkpoint, so a run with it cannot be resumed).
  Accounted under cyclic Poisson sampling (:class:`dpsgd.samplers.CyclicPoisson` with at least ``b`` groups) as
  one subsampled-Gaussian step per cycle at ``sigma / ||c||``.

The strings ``"gaussian"`` and ``"laplace"`` name the first two (:func:`as_noise`).  A noise object refuses,
the reason its accounting does not cover an estimator (:meth:`StepNoise.refusal`), and
calibrates its own scale to a target epsilon (:meth:`StepNoise.calibrate`).

Examples
--------
>>> from dpsgd.noise import LaplaceNoise
>>> LaplaceNoise().mechanism(2.0, 0.01)
SubsampledL2Laplace(scale=2.0, sample_rate=0.01)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from dpmath import (
    Envelope,
    Gaussian,
    SubsampledGaussian,
    SubsampledL2Laplace,
    calibrate_noise_multiplier,
)
from dpmath.correlated import BandedStrategy, BLTStrategy

from .distributed import is_sharded, local_part
from .handler import all_finite

__all__ = ["StepNoise", "GaussianNoise", "LaplaceNoise", "CorrelatedNoise", "BandedNoise", "BLTNoise",
           "CorrelatedStream", "BufferedStream", "as_noise"]


class StepNoise(ABC):
    """What the private step needs of a noise distribution: its unit draws, its mechanism, what it refuses.

    A subclass sets ``name`` (recorded in the privacy ledger) and must draw exactly what its
    :meth:`mechanism` accounts for: the accountant trusts it.
    """

    name: str
    #: whether each step's noise depends on earlier steps' (:meth:`stream`): such a run cannot be resumed
    correlated: ClassVar[bool] = False

    @abstractmethod
    def sample(self, shape: torch.Size, generator: torch.Generator | None, device: torch.device,
               dtype: torch.dtype) -> torch.Tensor:
        """Independent draws of unit scale (the step multiplies them by ``noise_multiplier * C``)."""

    def sample_into(self, out: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """:meth:`sample` written into ``out`` (its shape, device and dtype); returns ``out``.  A subclass that can
        draw in place overrides it (a reused buffer is filled without the page faults of a fresh allocation)."""
        return out.copy_(self.sample(out.shape, generator, out.device, out.dtype))

    @abstractmethod
    def mechanism(self, noise_multiplier: float, sample_rate: float, envelope: Envelope | None = None):
        """The dpmath mechanism of one Poisson-sampled step with this noise at ``noise_multiplier``
        (``envelope``: the norm estimator's, ``None`` for exact norms)."""

    def refusal(self, estimator: str) -> str | None:
        """Why this noise's accounting does not cover ``estimator``'s norms, or ``None`` where it does (by default
        it covers every estimator); :data:`dpsgd.accounting.REFUSED` asks it."""
        return None

    @abstractmethod
    def calibrate(self, target_epsilon: float, target_delta: float, sample_rate: float, steps: int,
                  envelope: Envelope | None = None) -> float:
        """The smallest ``noise_multiplier`` whose accounted epsilon after ``steps`` is at most the target."""

    def settings(self) -> str | dict:
        """What the ledger records of the noise (a resumed run must match): its name."""
        return self.name

    def cycle_mechanism(self, noise_multiplier: float, sample_rate: float, envelope: Envelope | None,
                        groups: int):
        """The mechanism of one cycle of :class:`~dpsgd.samplers.CyclicPoisson` with ``groups`` groups (each example
        eligible once): by default :meth:`mechanism`, one Poisson-sampled step."""
        return self.mechanism(noise_multiplier, sample_rate, envelope)

    def stream(self) -> CorrelatedStream | BufferedStream | None:
        """The per-run state of noise correlated across steps (``None``: each step's draws are independent).  The
        step keeps it in memory only."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(frozen=True, repr=False)
class GaussianNoise(StepNoise):
    r"""``N(0, (\sigma C)^2)`` on every coordinate: DP-SGD, and DP-SGD-RC with estimated norms.

    Examples
    --------
    >>> from dpmath import estimator_envelope
    >>> GaussianNoise().mechanism(1.0, 0.01)
    SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.01)
    >>> GaussianNoise().mechanism(1.0, 0.01, estimator_envelope("hutch", 8, 100))
    SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.01,
                       envelope=HutchEnvelope(projection_dim=8, dim=100, family='heavy-light'))
    """

    name = "gaussian"

    def sample(self, shape, generator, device, dtype):
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    def sample_into(self, out, generator):
        return out.normal_(generator=generator)   # the same draws as torch.randn from the same generator state

    def mechanism(self, noise_multiplier, sample_rate, envelope=None):
        return SubsampledGaussian(noise_multiplier, sample_rate, envelope)

    def calibrate(self, target_epsilon, target_delta, sample_rate, steps, envelope=None):
        return calibrate_noise_multiplier(target_epsilon, target_delta, sample_rate, steps, envelope=envelope)


@dataclass(frozen=True, repr=False)
class LaplaceNoise(StepNoise):
    r"""LAP2 (paper 003): ``Laplace(b)``, ``b = noise_multiplier * C``, on every coordinate of the l2-clipped sum.

    Accounted as :class:`dpmath.SubsampledL2Laplace` (its Gaussian domination: each step is at least as
    private as a subsampled Gaussian of ``sigma = (b / C) / sqrt(pi / 2)``), so a target epsilon calibrates
    ``b / C = sqrt(pi / 2) sigma`` from the dominating Gaussian's ``sigma``.

    Examples
    --------
    >>> LaplaceNoise().refusal("hutch")[:69]
    "LaplaceNoise needs exact norms (estimator 'ghost' or 'exact'), got es"
    """

    name = "laplace"

    def sample(self, shape, generator, device, dtype):
        # the difference of two standard exponentials is standard Laplace
        return (torch.empty(shape, device=device, dtype=dtype).exponential_(generator=generator)
                - torch.empty(shape, device=device, dtype=dtype).exponential_(generator=generator))

    def mechanism(self, noise_multiplier, sample_rate, envelope=None):
        if envelope is not None:
            raise ValueError("LaplaceNoise has no accountant for estimated norms (an envelope was given)")
        return SubsampledL2Laplace(noise_multiplier, sample_rate)

    def refusal(self, estimator):
        if estimator not in ("ghost", "exact"):
            return (f"LaplaceNoise needs exact norms (estimator 'ghost' or 'exact'), got estimator={estimator!r}: the "
                    f"randomized-clipping envelope accounts Gaussian noise only, and no accountant here covers Laplace "
                    f"noise on an estimated-norm clipped gradient")
        return None

    def calibrate(self, target_epsilon, target_delta, sample_rate, steps, envelope=None):
        if envelope is not None:
            raise ValueError("LaplaceNoise has no accountant for estimated norms (an envelope was given)")
        sigma = calibrate_noise_multiplier(target_epsilon, target_delta, sample_rate, steps)
        return SubsampledL2Laplace.for_noise_multiplier(sigma, sample_rate).scale


class CorrelatedNoise(StepNoise):
    """What the correlated noises share: Gaussian unit draws ``z``, correlated across steps by the run's
    :meth:`~StepNoise.stream`, and an accounting per cycle of :class:`~dpsgd.samplers.CyclicPoisson` sampling only
    (so no Poisson-batch calibration: ``make_private`` calibrates through the cycles' accounting)."""

    correlated = True

    def sample(self, shape, generator, device, dtype):
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    def sample_into(self, out, generator):
        return out.normal_(generator=generator)

    def calibrate(self, target_epsilon, target_delta, sample_rate, steps, envelope=None):
        raise ValueError(f"{type(self).__name__} is calibrated through its CyclicPoisson accounting (make_private "
                         f"does it), not as Poisson batches")


@dataclass(frozen=True, repr=False)
class BandedNoise(CorrelatedNoise):
    r"""Banded matrix-factorization noise (DP-FTRL): step ``t`` adds ``noise_multiplier * max_grad_norm`` times
    :math:`w_t`, :math:`w = C^{-1} z` for the banded Toeplitz ``strategy`` :math:`C` and independent
    :math:`z_t \sim N(0, I)`, so much of the noise cancels in the sums of updates that training applies
    (:mod:`dpmath.correlated`).

    :math:`w_t = (z_t - \sum_{j=1}^{b-1} c_j w_{t-j}) / c_0` is made as the step draws ``z_t``, from the last
    ``b - 1`` noise tensors of each parameter (``b - 1`` parameter-sized copies, held by the run's
    :class:`CorrelatedStream`, never saved: a run with banded noise cannot be resumed from a checkpoint).  The
    accountant composes one subsampled-Gaussian step at ``sigma / ||c||`` per cycle of
    :class:`~dpsgd.samplers.CyclicPoisson` sampling with at least ``b`` groups (one randomized-clipping step with
    estimated norms); any other batch sampling is refused.

    Parameters
    ----------
    strategy : dpmath.correlated.BandedStrategy

    Examples
    --------
    >>> from dpmath.correlated import BandedStrategy
    >>> noise = BandedNoise(BandedStrategy((1.0, 0.5)))
    >>> noise.mechanism(1.0, 0.04)
    SubsampledGaussian(noise_multiplier=0.8944271909999159, sample_rate=0.04)
    """

    strategy: BandedStrategy

    name = "banded"

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, BandedStrategy):
            raise ValueError(f"strategy must be a dpmath.correlated.BandedStrategy, got "
                             f"{type(self.strategy).__name__}")

    def mechanism(self, noise_multiplier, sample_rate, envelope=None):
        return GaussianNoise().mechanism(noise_multiplier / self.strategy.column_norm, sample_rate, envelope)

    def settings(self):
        return {"name": self.name, "coefficients": list(self.strategy.coefficients)}

    def stream(self):
        return CorrelatedStream(self.strategy)

    def __repr__(self) -> str:
        return f"BandedNoise({self.strategy.coefficients})"


@dataclass(frozen=True, repr=False)
class BLTNoise(CorrelatedNoise):
    r"""Buffered linear Toeplitz (BLT) matrix-factorization noise: step ``t`` adds ``noise_multiplier *
    max_grad_norm`` times :math:`w_t`, :math:`w = C^{-1} z` for the BLT ``strategy`` (:class:`dpmath.correlated.
    BLTStrategy`), made with ``d`` buffers per coordinate (``d`` parameter-sized tensors held by the run's
    :class:`BufferedStream`, never saved: a run with it cannot be resumed), whatever the run's length.

    Accounted without amplification under :class:`~dpsgd.samplers.CyclicPoisson` with ``groups`` groups: each cycle
    as one Gaussian step at ``sigma / sqrt(per)``, ``per`` the strategy's sensitivity per participation at
    separation ``groups`` (every eligible step charged as taken; no sampling amplification is proved for a strategy
    whose columns overlap).  Exact norms only; any other batch sampling is refused.

    Examples
    --------
    >>> from dpmath.correlated import BLTStrategy
    >>> noise = BLTNoise(BLTStrategy((0.5,), (0.5,)))
    >>> noise.cycle_mechanism(1.0, 0.5, None, groups=2)
    Gaussian(noise_multiplier=0.6708203932499369)
    """

    strategy: BLTStrategy

    name = "blt"

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, BLTStrategy):
            raise ValueError(f"strategy must be a dpmath.correlated.BLTStrategy, got {type(self.strategy).__name__}")

    def mechanism(self, noise_multiplier, sample_rate, envelope=None):
        raise ValueError("BLTNoise is accounted per cycle of CyclicPoisson sampling only (cycle_mechanism)")

    def cycle_mechanism(self, noise_multiplier, sample_rate, envelope, groups):
        if envelope is not None:
            raise ValueError("BLTNoise has no accountant for estimated norms (an envelope was given)")
        return Gaussian(self.strategy.participation_noise(noise_multiplier, groups))

    def refusal(self, estimator):
        if estimator not in ("ghost", "exact"):
            return (f"BLTNoise needs exact norms (estimator 'ghost' or 'exact'), got estimator={estimator!r}: its "
                    f"participations overlap, and no accountant here covers random scales across them")
        return None

    def settings(self):
        return {"name": self.name, "weights": list(self.strategy.weights), "decays": list(self.strategy.decays)}

    def stream(self):
        return BufferedStream(self.strategy)

    def __repr__(self) -> str:
        return f"BLTNoise(weights={self.strategy.weights}, decays={self.strategy.decays})"


class BufferedStream:
    r"""A run's BLT-noise state: for each tensor (and chunk) its ``d`` buffers :math:`b_i`, so that
    :math:`w_t = z_t - \sum_i \omega_i b_{i,t}` and :math:`b_{i,t+1} = \theta_i b_{i,t} + w_t`.  In the private
    step only (no ``state_dict``), as secret as the noise generator.

    Examples
    --------
    >>> import torch
    >>> from dpmath.correlated import BLTStrategy
    >>> stream = BufferedStream(BLTStrategy((0.5,), (0.5,)))
    >>> [stream.correlate(0, torch.ones(1)).item() for _ in range(3)]
    [1.0, 0.5, 0.5]
    """

    def __init__(self, strategy: BLTStrategy) -> None:
        self.strategy = strategy
        self._buffers: dict = {}

    def correlate(self, key: object, z: torch.Tensor) -> torch.Tensor:
        """:math:`w_t` of the tensor (or chunk) ``key`` from this step's unit draws ``z``, in place."""
        buffers = self._buffers.get(key)
        if buffers is None:
            buffers = self._buffers[key] = [torch.zeros_like(z) for _ in self.strategy.weights]
        for omega, b in zip(self.strategy.weights, buffers, strict=True):
            z.sub_(b.to(z.device), alpha=omega)
        for theta, b in zip(self.strategy.decays, buffers, strict=True):
            b.mul_(theta).add_(z.to(b.device))
        return z


class CorrelatedStream:
    r"""A run's banded-noise state: for each tensor (and chunk) the noise of its last ``b - 1`` steps.  It lives in
    the private step only (no ``state_dict``): the noise of the steps to come is a function of it, so it is as
    secret as the noise generator.

    Examples
    --------
    >>> import torch
    >>> from dpmath.correlated import BandedStrategy
    >>> stream = CorrelatedStream(BandedStrategy((1.0, 0.5)))
    >>> [stream.correlate(0, torch.ones(1)).item() for _ in range(3)]
    [1.0, 0.5, 0.75]
    """

    def __init__(self, strategy: BandedStrategy) -> None:
        self.strategy = strategy
        self._past: dict = {}

    def correlate(self, key: object, z: torch.Tensor) -> torch.Tensor:
        """:math:`w_t` of the tensor (or chunk) ``key`` from this step's unit draws ``z``, in place (``z`` is
        returned); the history keeps a copy."""
        c = self.strategy.coefficients
        past = self._past.setdefault(key, [])
        for j in range(1, min(len(c), len(past) + 1)):
            z.sub_(past[-j].to(z.device), alpha=c[j])
        if c[0] != 1.0:
            z.div_(c[0])
        if len(c) > 1:
            if len(past) == len(c) - 1:   # the oldest step's tensor is reused (no allocation a step)
                oldest = past.pop(0)
                past.append(oldest.copy_(z))
            else:
                past.append(z.clone())
        return z


_NAMED = {"gaussian": GaussianNoise(), "laplace": LaplaceNoise()}


def as_noise(noise: StepNoise | str) -> StepNoise:
    """``noise`` itself if a :class:`StepNoise`, else the one its name (``"gaussian"``, ``"laplace"``) names.

    >>> as_noise("laplace")
    LaplaceNoise()
    """
    if isinstance(noise, StepNoise):
        if not isinstance(getattr(noise, "name", None), str) or not noise.name:
            raise ValueError(f"noise {type(noise).__name__} must set a class attribute name (a non-empty str): the "
                             f"ledger records it, so a resumed run must use the same noise")
        return noise
    if isinstance(noise, str) and noise in _NAMED:
        return _NAMED[noise]
    raise ValueError(f"noise must be a dpsgd.noise.StepNoise (GaussianNoise(), LaplaceNoise()) or one of "
                     f"{sorted(_NAMED)}, got {noise!r}")



NOISE_CHUNK = 1 << 22
"""Draws per refill of the noise buffer (16 MB in float32): the step never holds a parameter-sized noise tensor
(an embedding of 32000 x 2048 would need 262 MB), and a chunk is large enough that the draws run at full speed."""


def noisy_gradients(sums: list[torch.Tensor], noise_std: float | list[float], expected_batch_size: float,
                    noise_generator: torch.Generator | Callable[[torch.device], torch.Generator] | None,
                    params: list | None = None,
                    noise: StepNoise | None = None, in_place: bool = False,
                    stream: CorrelatedStream | BufferedStream | None = None) -> list[torch.Tensor]:
    """``(sum + noise_std * xi) / expected_batch_size`` per tensor, in the sums' (wide) dtype, with ``xi`` unit
    draws of ``noise`` (:mod:`dpsgd.noise`; Gaussian by default: ``N(0, noise_std^2 I)``).  ``noise_std`` may
    be a list, one per tensor (hybrid clipping's per-group noise).  ``noise_generator`` is one generator (the
    noise is drawn on its device and moved), a function from a device to the generator that draws there (each
    tensor's noise is drawn on its own device), or ``None`` (torch's default generator of each tensor's device).

    With ``params``, the noise of each is drawn at the parameter's full shape and restricted to this rank's
    shard (:func:`dpsgd.distributed.local_part`; the sums are then the shards' sums).  With ``in_place`` the
    sums themselves are overwritten (no second parameter-sized buffer: the step's peak memory holds the sums and
    a buffer of at most :data:`NOISE_CHUNK` draws, refilled for each chunk of each tensor; a sharded
    parameter's noise is drawn whole, then restricted).  A tensor of at most :data:`NOISE_CHUNK` elements gets
    the draws of ``torch.randn`` from the same generator state."""
    out = []
    noise = GaussianNoise() if noise is None else noise
    stds = noise_std if isinstance(noise_std, list) else [noise_std] * len(sums)
    scratch: dict = {}   # one buffer per device and dtype, reused for every chunk of every tensor
    for i, g in enumerate(sums):
        std = stds[i]
        if not in_place:
            g = g.clone()
        if std > 0:
            p = params[i] if params is not None else None
            gen = noise_generator(g.device) if callable(noise_generator) else noise_generator
            device = gen.device if gen is not None else g.device
            sharded = p is not None and is_sharded(p)   # drawn at the full shape, then this rank's part taken
            whole = sharded or not g.is_contiguous()
            shape = p.shape if sharded else g.shape
            n = math.prod(shape)
            key = (torch.device(device), g.dtype)
            if key not in scratch or scratch[key].numel() < (n if whole else min(n, NOISE_CHUNK)):
                scratch[key] = torch.empty(n if whole else min(n, NOISE_CHUNK), device=device, dtype=g.dtype)
            if whole:
                xi = noise.sample_into(scratch[key][:n].view(shape), gen)
                xi = local_part(p, xi) if sharded else xi
                if stream is not None:
                    xi = stream.correlate((i if p is None else id(p), 0), xi)
                g.add_(xi.to(g.device), alpha=std)
                del xi
            else:
                flat = g.view(-1)
                for start in range(0, n, NOISE_CHUNK):
                    xi = noise.sample_into(scratch[key][:min(NOISE_CHUNK, n - start)], gen)
                    if stream is not None:   # a parameter's own history, whatever its place in the list
                        xi = stream.correlate((i if p is None else id(p), start), xi)
                    flat[start:start + xi.numel()].add_(xi.to(g.device), alpha=std)
                    del xi
        out.append(g.div_(expected_batch_size))
    del scratch
    if not all_finite(*out):
        raise FloatingPointError("the noisy gradient is not finite; the step was not taken")
    return out

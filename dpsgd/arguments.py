"""``make_private``'s arguments, checked one by one and mapped onto what the engine builds before anything is
built (:class:`~dpsgd.privacy_engine.PrivacyEngine` is the wiring): the estimator from Opacus'
``grad_sample_mode`` (:func:`estimator_of`), the noise, clipping and noise multiplier (:func:`checked_arguments`),
the steps a target epsilon is calibrated for (:func:`planned_steps`) and the basis of ``gradient_projection``
(:func:`projection_basis`).  Each refusal is a ``ValueError`` naming the argument.
"""

from __future__ import annotations

import math

import torch

from .clipping import check_clipping_pass
from .distributed import is_sharded
from .noise import StepNoise, as_noise
from .plan import check_estimator
from .strategies import HybridClipping, L2Clipping, TwiceSampling
from .validator import check_positive

__all__ = ["GRAD_SAMPLE_MODES", "estimator_of", "checked_arguments", "planned_steps", "projection_basis"]


#: Opacus' ``grad_sample_mode`` values, and this library's estimators, by the estimator they mean here
GRAD_SAMPLE_MODES = {"hooks": "exact", "functorch": "exact", "ew": "exact", "ghost": "ghost", "auto": "auto",
                     "hutch": "hutch", "hutchpp": "hutchpp", "exact": "exact"}


def estimator_of(estimator: str, grad_sample_mode: str | None) -> str:
    """``make_private``'s estimator from ``estimator`` or Opacus' ``grad_sample_mode`` (``ValueError`` naming both
    if they disagree, or an unknown mode)."""
    if grad_sample_mode is None:
        return estimator
    if grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise ValueError(f"grad_sample_mode must be one of {sorted(GRAD_SAMPLE_MODES)}, got {grad_sample_mode!r}")
    mapped = GRAD_SAMPLE_MODES[grad_sample_mode]
    if estimator not in ("auto", mapped):
        raise ValueError(f"give estimator or grad_sample_mode, not both: estimator={estimator!r} and "
                         f"grad_sample_mode={grad_sample_mode!r} (which means estimator={mapped!r})")
    return mapped


def planned_steps(epochs: float | None, steps: int | None, batches: int) -> int:
    """The steps a target epsilon is calibrated for: ``steps``, or ``ceil(epochs x batches)`` (``ValueError``
    unless positive)."""
    if steps is None:
        return math.ceil(check_positive(epochs, "epochs") * batches)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    return steps


def checked_arguments(optimizer: torch.optim.Optimizer, max_grad_norm: float, noise_multiplier: float | None,
                      target_epsilon: float | None, target_delta: float | None, epochs: float | None,
                      steps: int | None, estimator: str, k: int, clipping_pass: str, noise: StepNoise | str,
                      clipping: L2Clipping | TwiceSampling | HybridClipping | None,
                      ) -> tuple[StepNoise, L2Clipping | TwiceSampling | HybridClipping, float,
                                 float | None]:
    """``make_private``'s arguments checked one by one before anything is built (``ValueError`` naming the
    first one wrong): ``(noise, clipping, max_grad_norm, noise_multiplier)``, the noise and clipping as
    objects and the noise multiplier ``None`` when it is to be calibrated from the targets.  Their
    combinations are :data:`dpsgd.accounting.REFUSED`'s."""
    check_estimator(estimator, k)
    check_clipping_pass(clipping_pass)
    noise = as_noise(noise)
    if clipping is None:
        clipping = L2Clipping()
    if not isinstance(clipping, (L2Clipping, TwiceSampling, HybridClipping)):
        raise ValueError(f"clipping must be a dpsgd.strategies.L2Clipping, TwiceSampling, HybridClipping or "
                         f"None, got {type(clipping).__name__}")
    c = check_positive(max_grad_norm, "max_grad_norm")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    sigma = None
    if noise_multiplier is not None:
        sigma = check_positive(noise_multiplier, "noise_multiplier", allow_zero=True)
        if target_epsilon is not None:
            raise ValueError("give either noise_multiplier or target_epsilon, not both")
    elif target_epsilon is None or target_delta is None or (epochs is None) == (steps is None):
        raise ValueError("without noise_multiplier, target_epsilon, target_delta and one of epochs or steps are "
                         "required")
    return noise, clipping, c, sigma


def projection_basis(basis: torch.Tensor, params: list[torch.Tensor], world: int) -> torch.Tensor:
    """``gradient_projection`` checked against the trainable parameters ``params`` (the norm plan's, in the model's
    order) and orthonormalized (float64, on the first parameter's device)."""
    if world > 1 or any(is_sharded(p) for p in params):
        raise ValueError("gradient_projection is supported in a single process only (every rank would "
                         "need the same basis over the full, unsharded parameter vector)")
    total = sum(p.numel() for p in params)
    if not isinstance(basis, torch.Tensor) or basis.ndim != 2 or basis.shape[0] != total or basis.shape[1] < 1:
        raise ValueError(f"gradient_projection must be a ({total}, k) tensor with k >= 1 (one row per trainable "
                         f"parameter entry, in the model's parameter order), got "
                         f"{tuple(getattr(basis, 'shape', ())) or type(basis).__name__}")
    if not torch.isfinite(basis).all():
        raise ValueError("gradient_projection must be finite")
    q, r = torch.linalg.qr(basis.detach().to(params[0].device, torch.float64))
    diag = r.diagonal().abs()
    if diag.min() <= 1e-10 * diag.max():
        raise ValueError("gradient_projection's columns are linearly dependent (rank below k)")
    return q

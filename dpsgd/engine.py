r"""The DP-SGD-RC step (paper 000, Alg. 1): per-sample norms in a first backward, rescaled loss in a second.

One step, for per-example losses ``L_i``:

1. forward with hooks that keep every parameterized module's inputs and outputs;
2. first backward, ``autograd.grad(sum_i L_i, outputs)``: the output gradients ``G``, from which each
   layer's handler (:mod:`dpsgd.layers`) returns per-example squared norms; their sum over layers is
   ``n_i`` (parameters' ``.grad`` are not touched);
3. weights ``c_i = min(1, C / sqrt(n_i))``; second backward of ``sum_i c_i L_i`` into ``.grad``;
4. Gaussian noise of standard deviation ``sigma C`` on the summed gradient, division by the expected
   batch size, then the optimizer's step.

If a loss, a norm or a gradient is not finite, the step raises ``FloatingPointError`` before anything is
written: parameters, their ``.grad`` and the optimizer state are as before (:func:`private_step`).

Parameters shared by two modules (tied embeddings) or a module called twice in one forward would make
per-layer norms non-additive; both are refused with a clear error rather than silently under-counted.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .estimators import ESTIMATORS, _check_k
from .layers import HANDLERS, embedding_norms, functional_norms, is_conv1d, linear_norms

__all__ = ["per_sample_sq_norms", "private_step", "StepResult"]


def _own_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def _check_model(model: nn.Module) -> list[nn.Module]:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = [m for m in model.modules() if _own_params(m)]
    if not modules:
        raise ValueError("model has no trainable parameters (every parameter has requires_grad=False)")
    seen: dict[int, str] = {}
    for name, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            if p.requires_grad and id(p) in seen:
                raise ValueError(f"parameter {name}.{pname} is shared with {seen[id(p)]} (tied weights): per-layer "
                                 f"norms would not add up; untie them or freeze one copy")
            seen[id(p)] = f"{name}.{pname}"
    return modules


class _Capture:
    """Forward hooks that keep each parameterized module's tensor inputs and its output."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.records: dict[nn.Module, tuple[tuple, torch.Tensor]] = {}
        self.enabled = True  # off while norms are computed (functional_call re-runs modules' forwards)
        self._handles = [m.register_forward_hook(self._hook) for m in modules]

    def _hook(self, module: nn.Module, inputs: tuple, output: object) -> None:
        if not self.enabled:
            return
        if module in self.records:
            raise ValueError(f"module {type(module).__name__} was called twice in one forward pass; per-example "
                             f"norms of a reused module are not supported")
        if not isinstance(output, torch.Tensor):
            raise ValueError(f"module {type(module).__name__} has trainable parameters but returns "
                             f"{type(output).__name__}, not a tensor; wrap it or freeze its parameters")
        self.records[module] = (tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in inputs), output)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


@contextlib.contextmanager
def _capturing(model: nn.Module) -> Iterator[_Capture]:
    cap = _Capture(_check_model(model))
    try:
        yield cap
    finally:
        cap.close()


@dataclass(frozen=True)
class _FirstPass:
    losses: torch.Tensor      # (B,), with graph
    sq_norms: torch.Tensor    # (B,), detached
    exact_fraction: float     # share of parameters whose norm was computed exactly (point masses)


def _check_estimator(estimator: str, k: object) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {sorted(ESTIMATORS)}, got {estimator!r}")
    _check_k(k)


def _norms(cap: _Capture, losses: torch.Tensor, estimator: str, k: int, generator: torch.Generator | None
           ) -> _FirstPass:
    """Per-example squared norms from a finished forward pass whose modules ``cap`` recorded."""
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
        raise ValueError("the per-example losses must be a 1-D tensor")
    if not torch.isfinite(losses).all():
        raise FloatingPointError("a per-example loss is NaN or infinite; the step was not taken")
    cap.enabled = False
    try:
        return _sum_norms(cap, losses, estimator, k, generator)
    finally:
        cap.enabled = True


def _sum_norms(cap: _Capture, losses: torch.Tensor, estimator: str, k: int, generator: torch.Generator | None
               ) -> _FirstPass:
    modules = list(cap.records)
    outputs = [cap.records[m][1] for m in modules]
    grads = torch.autograd.grad(losses.sum(), outputs, retain_graph=True, allow_unused=True) if modules else ()
    total = torch.zeros(losses.shape[0], device=losses.device, dtype=torch.float32)
    exact_params = all_params = 0
    for m, g in zip(modules, grads, strict=True):
        if g is None:
            continue
        if g.dim() == 0 or g.shape[0] != losses.shape[0]:
            raise ValueError(f"the output of {type(m).__name__} does not start with the batch dimension "
                             f"({tuple(g.shape)} for {losses.shape[0]} examples): per-example norms need it")
        inputs = cap.records[m][0]
        count = sum(p.numel() for p in _own_params(m))
        all_params += count
        handler = linear_norms if is_conv1d(m) else HANDLERS.get(type(m))
        if handler is embedding_norms:
            part = embedding_norms(m, inputs[0], g, estimator, k, generator)
            exact_params += count if estimator != "hutch" else 0
        elif handler is not None:
            part = handler(m, inputs[0], g, estimator, k, generator)
            exact_params += count if estimator in ("exact", "ghost") else 0
        else:
            part = functional_norms(m, tuple(x for x in inputs if isinstance(x, torch.Tensor)), g)
            exact_params += count
        total = total + part.to(total.dtype)
    if not torch.isfinite(total).all():
        raise FloatingPointError("a per-example gradient norm is NaN or infinite; the step was not taken")
    return _FirstPass(losses, total.detach(), exact_params / max(all_params, 1))


def _first_pass(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], estimator: str, k: int,
                generator: torch.Generator | None) -> _FirstPass:
    _check_estimator(estimator, k)
    with _capturing(model) as cap:
        losses = loss_fn(model)
    return _norms(cap, losses, estimator, k, generator)


def _clipped_sum(first: _FirstPass, params: list[nn.Parameter], max_grad_norm: float) -> tuple[list, torch.Tensor]:
    """Second backward: ``sum_i min(1, C / sqrt(n_i)) grad L_i`` for each parameter, and the weights."""
    weights = torch.clamp(max_grad_norm / first.sq_norms.sqrt().clamp_min(1e-30), max=1.0)
    if first.losses.shape[0] == 0:
        return [torch.zeros_like(p) for p in params], weights
    grads = torch.autograd.grad((weights.to(first.losses.dtype) * first.losses).sum(), params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)], weights


def _noisy(grads: list[torch.Tensor], noise_std: float, expected_batch_size: float,
           noise_generator: torch.Generator | None) -> list[torch.Tensor]:
    out = []
    for g in grads:
        if noise_std > 0:
            g = g + noise_std * torch.randn(g.shape, generator=noise_generator, device=g.device, dtype=g.dtype)
        out.append(g / expected_batch_size)
    if not all(torch.isfinite(g).all() for g in out):
        raise FloatingPointError("the noisy gradient is not finite; the step was not taken")
    return out


def per_sample_sq_norms(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], estimator: str = "hutch",
                        k: int = 32, generator: torch.Generator | None = None) -> torch.Tensor:
    r"""First-pass estimate of each example's squared gradient norm over the whole model.

    .. math:: \hat n_i = \sum_{\text{layers } l} \hat n_{i,l}, \qquad
              E[\hat n_i] = \|\nabla_\theta L_i\|_2^2 \ \text{(unbiased estimators)}

    Parameters
    ----------
    model : torch.nn.Module
        The model; parameters with ``requires_grad=False`` are ignored.
    loss_fn : callable
        ``loss_fn(model) -> (B,)`` tensor of per-example losses (runs the forward pass).
    estimator : {"hutch", "hutchpp", "ghost", "exact"}
        Per-layer estimator for linear-like layers (see :mod:`dpsgd.layers` for the others).
    k : int
        Projection dimension of ``hutch``/``hutchpp``.
    generator : torch.Generator, optional
        Source of the projections.

    Returns
    -------
    torch.Tensor
        ``(B,)`` float32, detached; no parameter's ``.grad`` is modified.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from dpsgd import per_sample_sq_norms
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> x, y = torch.randn(5, 4), torch.randn(5, 1)
    >>> loss_fn = lambda m: ((m(x) - y) ** 2).sum(1)
    >>> per_sample_sq_norms(model, loss_fn, "exact").shape
    torch.Size([5])
    """
    return _first_pass(model, loss_fn, estimator, k, generator).sq_norms


@dataclass(frozen=True)
class StepResult:
    """What one :func:`private_step` did.

    Attributes
    ----------
    batch_size : int
        Examples in the batch (Poisson: random).
    clipped_fraction : float
        Share of examples whose weight ``min(1, C / sqrt(n_i))`` was below 1.
    mean_loss : float
        Mean per-example loss before the step.
    exact_fraction : float
        Share of trainable parameters whose norm was exact (see :mod:`dpsgd.layers`).
    """

    batch_size: int
    clipped_fraction: float
    mean_loss: float
    exact_fraction: float


def private_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[[nn.Module], torch.Tensor], *,
                 max_grad_norm: float, noise_multiplier: float, expected_batch_size: float,
                 estimator: str = "hutch", k: int = 32, generator: torch.Generator | None = None,
                 noise_generator: torch.Generator | None = None) -> StepResult:
    r"""One DP-SGD-RC step: estimate norms, clip by loss rescaling, add noise, let ``optimizer`` step.

    .. math::

        \tilde g = \frac{1}{\bar B}\Big(\sum_i \min\big(1, C/\sqrt{\hat n_i}\big)\nabla L_i
        + \sigma C\, \xi\Big), \qquad \xi \sim \mathcal N(0, I),

    with ``B-bar`` the expected batch size (Poisson sampling normalizes by it, not by the realized size).
    An empty batch (``loss_fn`` returns no losses) still adds the noise and steps.  Atomic: on a
    non-finite loss, norm or gradient it raises ``FloatingPointError`` with parameters, ``.grad`` and the
    optimizer state unchanged.

    Parameters
    ----------
    model, optimizer
        The model and any ``torch.optim`` optimizer over its parameters.
    loss_fn : callable
        ``loss_fn(model) -> (B,)`` per-example losses of this step's batch.
    max_grad_norm : float
        Clipping threshold ``C > 0``.
    noise_multiplier : float
        ``sigma >= 0``.
    expected_batch_size : float
        ``q N > 0``.
    estimator, k, generator
        As in :func:`per_sample_sq_norms`.
    noise_generator : torch.Generator, optional
        Source of the Gaussian noise.

    Returns
    -------
    StepResult

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from dpsgd.engine import private_step
    >>> model = nn.Linear(3, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
    >>> r = private_step(model, opt, lambda m: ((m(x) - y) ** 2).sum(1), max_grad_norm=1.0,
    ...                  noise_multiplier=1.0, expected_batch_size=8, estimator="exact")
    >>> r.batch_size
    8
    """
    c = float(max_grad_norm)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"max_grad_norm must be positive (> 0), got {max_grad_norm!r}")
    sigma = float(noise_multiplier)
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"noise_multiplier must be non-negative (>= 0), got {noise_multiplier!r}")
    b_bar = float(expected_batch_size)
    if not (math.isfinite(b_bar) and b_bar > 0):
        raise ValueError(f"expected_batch_size must be positive (> 0), got {expected_batch_size!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    first = _first_pass(model, loss_fn, estimator, k, generator)
    grads, weights = _clipped_sum(first, params, c)
    new = _noisy(grads, sigma * c, b_bar, noise_generator)
    for p, g in zip(params, new, strict=True):
        p.grad = g
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    n = first.losses.shape[0]
    return StepResult(n, float((weights < 1).float().mean()) if n else 0.0,
                      float(first.losses.detach().mean()) if n else float("nan"), first.exact_fraction)

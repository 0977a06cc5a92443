r"""The private loss: :class:`DPLoss` (per-example losses whose ``backward()`` is the private backward) and
:class:`DPCriterion` (a loss module or function made per-example), which ``make_private`` returns.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from .step import PrivateStep

__all__ = ["DPLoss", "DPCriterion"]



class DPLoss:
    r"""Per-example losses of one batch; ``backward()`` is the private backward.

    It behaves like the scalar loss for logging (``item()``, ``float()``, ``detach()``, ``mean()``,
    f-strings: the mean of the per-example losses).  Arithmetic on it is refused: scaling a loss before
    clipping does not scale the clipped gradient (each example is clipped to ``max_grad_norm`` and the sum
    is divided by the expected batch size at ``step()``), so ``loss / accumulation_steps`` would silently do
    nothing useful.  Combine per-example terms *before* making the loss private
    (:meth:`PrivacyEngine.private_loss`).

    Attributes
    ----------
    losses : torch.Tensor
        ``(B,)`` per-example losses, with their graph.
    """

    def __init__(self, losses: torch.Tensor, step: PrivateStep) -> None:
        self.losses = losses
        self._step = step
        self._done = False

    def backward(self, gradient: object = None, retain_graph: bool | None = None, create_graph: bool = False,
                 inputs: object = None) -> None:
        """Per-example norms, clip weights and clipped sums (held until ``step()``), in one backward.

        Each private loss is backpropagated once: the backward consumes the module calls its forward
        recorded.  ``torch.Tensor.backward``'s arguments are accepted only at their defaults (a weighted or
        partial backward would not be the clipped per-example sum), and each refusal says so.
        """
        if gradient is not None or retain_graph or create_graph or inputs is not None:
            raise TypeError("DPLoss.backward() takes no gradient, retain_graph, create_graph or inputs: the private "
                            "backward clips each example's whole gradient once and consumes the recorded forward. "
                            "Combine per-example terms into one loss per example first (PrivacyEngine."
                            "private_loss), then call backward() once.")
        if self._done:
            raise RuntimeError("this private loss was already backpropagated: each example contributes one clipped "
                               "gradient per step, and the recorded forward was consumed. Run a new forward for "
                               "a new backward.")
        self._step.backward(self.losses)
        self._done = True

    def detach(self) -> torch.Tensor:
        """The mean per-example loss as a detached 0-d tensor (NaN for an empty batch)."""
        tracker = self._step.tracker
        with tracker.suspended() if tracker is not None else contextlib.nullcontext():
            d = self.losses.detach()
            return d.mean() if d.numel() else torch.tensor(float("nan"))

    def item(self) -> float:
        """Mean per-example loss (for logging)."""
        return float(self.detach())

    def mean(self) -> DPLoss:
        """Itself: it already stands for the mean (so ``criterion(out, y).mean().backward()`` works)."""
        return self

    def sum(self) -> DPLoss:
        """Itself: the private backward sums the clipped per-example gradients whatever the reduction."""
        return self

    @property
    def shape(self) -> torch.Size:
        return torch.Size([])

    def __float__(self) -> float:
        return self.item()

    def __format__(self, spec: str) -> str:
        return format(self.item(), spec)

    def __repr__(self) -> str:
        return f"DPLoss({self.item():.6g}, batch_size={self.losses.shape[0]})"

    def _refuse(self, *_args):
        raise TypeError("arithmetic on a private loss is refused: each example's gradient is clipped to "
                        "max_grad_norm and the clipped sum is divided by the expected batch size at step(), so "
                        "scaling the loss (e.g. / gradient_accumulation_steps) would not scale the update. Combine "
                        "per-example terms first and pass them to PrivacyEngine.private_loss(losses).")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __neg__ = _refuse
    __pow__ = __iadd__ = __imul__ = __itruediv__ = _refuse


class DPCriterion:
    r"""Wraps a loss module, or a loss function that takes ``reduction=`` (``F.cross_entropy``, ``F.nll_loss``,
    ``F.mse_loss``, a ``functools.partial`` of one): ``criterion(output, target)`` returns a :class:`DPLoss` of
    per-example losses.  A function is called with ``reduction="none"``; its own default ``reduction`` and
    ``ignore_index`` (read from its signature) play the part of a module's attributes.

    ``output`` may be a tensor, a Hugging Face output object (its ``logits`` are used) or a tuple (its first
    element).  Token-level targets are accepted in either layout, ``(B, T, V)`` logits with ``(B, T)``
    targets (the Hugging Face layout) or ``(B, V, T)``.  Each example's loss is the **mean over its
    non-ignored elements** (``ignore_index``, e.g. padding and ``-100``) when the criterion's reduction is
    ``"mean"``, and their sum for ``"sum"``; an example whose targets are all ignored has loss 0.  Causal
    language models: shift yourself, ``criterion(out.logits[:, :-1], input_ids[:, 1:])``.
    """

    def __init__(self, criterion: nn.Module, step: PrivateStep) -> None:
        if not callable(criterion):
            raise ValueError(f"criterion must be a loss module, got {type(criterion).__name__}")
        self._criterion = criterion
        self._step = step
        # a loss function: its signature's defaults stand for a module's attributes
        self._defaults = None if isinstance(criterion, nn.Module) else _loss_defaults(criterion)
        self.reduction = getattr(criterion, "reduction", "mean") if self._defaults is None \
            else self._defaults["reduction"]
        if self.reduction not in ("mean", "sum"):
            raise ValueError(f"criterion.reduction must be 'mean' or 'sum', got {self.reduction!r}")

    def _elementwise(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The criterion's unreduced losses (a module's ``reduction`` set to ``"none"`` for the call)."""
        if self._defaults is not None:
            return self._criterion(logits, target, reduction="none")
        old = self._criterion.reduction
        self._criterion.reduction = "none"
        try:
            return self._criterion(logits, target)
        finally:
            self._criterion.reduction = old

    def __call__(self, output: object, target: torch.Tensor) -> DPLoss:
        logits = _logits(output)
        ignore = getattr(self._criterion, "ignore_index", None) if self._defaults is None \
            else self._defaults["ignore_index"]
        if not isinstance(target, torch.Tensor):
            raise ValueError(f"target must be a tensor, got {type(target).__name__}")
        if logits.dim() == 0 or target.dim() == 0 or logits.shape[0] != target.shape[0]:
            raise ValueError(f"output and target must start with the same batch dimension, got shapes "
                             f"{tuple(logits.shape)} and {tuple(target.shape)}")
        class_last = (ignore is not None and logits.dim() >= 3 and not target.is_floating_point()
                      and tuple(target.shape) == tuple(logits.shape[:-1]))
        if class_last and tuple(target.shape) == (logits.shape[0], *logits.shape[2:]):
            raise ValueError(f"logits of shape {tuple(logits.shape)} with targets {tuple(target.shape)} fit both "
                             f"(B, T, classes) and (B, classes, T): the classes are ambiguous. Make the per-example "
                             f"losses yourself and pass them to PrivacyEngine.private_loss(losses)")
        if class_last:
            per = self._elementwise(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)).reshape(target.shape)
        else:
            per = self._elementwise(logits, target)
        b = logits.shape[0]
        per = per.reshape(b, -1)
        if ignore is not None and not target.is_floating_point() and target.reshape(b, -1).shape == per.shape:
            keep = (target.reshape(b, -1) != ignore).to(per.dtype)
            total = (per * keep).sum(1)
            losses = total / keep.sum(1).clamp_min(1) if self.reduction == "mean" else total
        else:
            losses = per.mean(1) if self.reduction == "mean" else per.sum(1)
        return DPLoss(losses, self._step)


def _loss_defaults(criterion) -> dict:
    """``{"reduction": ..., "ignore_index": ...}`` of a loss function, from its signature (``"mean"`` and ``None``
    where it gives no default, or has no ``ignore_index``); ``TypeError`` unless it takes ``reduction`` by name."""
    try:
        params = inspect.signature(criterion).parameters
    except (TypeError, ValueError):
        params = {}
    named = {n: p.default for n, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    if "reduction" not in named:
        raise TypeError(f"criterion {getattr(criterion, '__name__', type(criterion).__name__)} is a function "
                        f"without a reduction keyword, so its per-example losses cannot be asked for: pass a loss "
                        f"module (nn.CrossEntropyLoss()) or a torch.nn.functional loss (F.cross_entropy, which is "
                        f"called with reduction='none'); or make the per-example losses yourself and backpropagate "
                        f"engine.private_loss(losses)")
    empty = inspect.Parameter.empty
    return {"reduction": "mean" if named["reduction"] is empty else named["reduction"],
            "ignore_index": None if named.get("ignore_index", empty) is empty else named["ignore_index"]}


def _logits(output: object) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ValueError(f"output must be a tensor, an object with .logits or a tuple of tensors, got "
                     f"{type(output).__name__}")

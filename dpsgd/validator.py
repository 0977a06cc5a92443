r"""``ModuleValidator``: refuse modules whose output for one example depends on other examples.

DP-SGD bounds each example's contribution to the update; a module that mixes examples lets one example
move every other example's gradient, and the bound no longer holds.  Refused, with the module's path and
the fix (in the spirit of Opacus' ``ModuleValidator``):

* the batch-norm family (``BatchNorm1d/2d/3d``, ``LazyBatchNorm*``, ``SyncBatchNorm``) unless it is *frozen*
  (:func:`frozen_batch_norm`: running statistics, every parameter ``requires_grad=False`` or ``affine=False``):
  a trainable one would be trained through batch statistics in training mode, or through running statistics
  the step never privatizes; :meth:`ModuleValidator.fix` replaces it with ``GroupNorm``.  A frozen one is a fixed
  per-channel affine map of each example in evaluation mode, and trains there (pretrained statistics, as
  fine-tuning keeps them); the engine refuses it at a training forward that finds it in training mode
  (batch statistics, which mix the examples);
* ``InstanceNorm*`` with ``track_running_stats=True`` (the running statistics; ``fix`` turns them off);
* ``nn.Embedding`` with ``scale_grad_by_freq`` (scales by token frequency *in the batch*), ``sparse``, or
  ``max_norm`` (renormalizes the looked-up rows of the weight in place during forward);
* ``nn.MultiheadAttention``, ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` with ``batch_first=False`` (the trainer
  needs the batch as the leading dimension of every recorded input and output);
* parametrized tensors (``torch.nn.utils.parametrizations``) of modules other than linear, convolution and embedding
  layers (the message says what to do instead).

A ``torch.compile``'d model is checked as the model it compiles (:func:`uncompiled`).  Hugging Face
mixture-of-experts models are switched to their per-token experts (:func:`per_token_experts`): their grouped
implementations sort the batch's tokens by expert, which the isolation tracker cannot tell from mixing.

:func:`validate` is called by :meth:`dpsgd.PrivacyEngine.make_private` and by the engine's norm plan.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from torch import nn
from torch.nn.utils import parametrize

__all__ = ["ModuleValidator", "UnsupportedModuleError", "BATCH_NORMS", "frozen_batch_norm", "uncompiled",
           "per_token_experts"]

logger = logging.getLogger("dpsgd")

#: the batch norm classes (they mix a batch's rows in training mode)
BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)
_INSTANCE_NORMS = (nn.modules.instancenorm._InstanceNorm,)
_BATCH_FIRST = (nn.MultiheadAttention, nn.RNNBase)


class UnsupportedModuleError(ValueError):
    """A module the private trainer refuses; ``path`` names it, the message says why and how to fix it."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"{path or '<root>'}: {reason}")


@dataclass(frozen=True)
class _Problem:
    path: str
    reason: str


def _parametrizable(model: nn.Module, path: str) -> bool:
    """Whether the ParametrizationList at ``path`` belongs to a linear, convolution or embedding layer."""
    owner = model.get_submodule(".".join(path.split(".")[:-2]))
    base = type(owner).__bases__[0] if parametrize.is_parametrized(owner) else type(owner)
    return base in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)


def frozen_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a batch norm that mixes nothing and trains nothing in evaluation mode: it keeps running
    statistics (``track_running_stats=True``, initialized: not a lazy one still uninitialized) and none of its
    parameters requires grad (or it has none, ``affine=False``).  In evaluation mode it then maps each example alone
    through fixed statistics; in training mode it would normalize with the batch's statistics, which the engine
    refuses at the forward."""
    if not isinstance(module, BATCH_NORMS) or not module.track_running_stats:
        return False
    if module.running_mean is None or module.running_var is None:
        return False
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        return False
    return not any(p.requires_grad for p in module.parameters())


def _problems(model: nn.Module) -> list[_Problem]:
    out = []
    for path, m in model.named_modules():
        if isinstance(m, parametrize.ParametrizationList) and not _parametrizable(model, path):
            out.append(_Problem(path, "a parametrized tensor (torch.nn.utils.parametrizations) of a module other "
                                      "than nn.Linear, nn.Conv1d/2d or nn.Embedding: the per-example gradients of its "
                                      "original parameters are found through the layer's own handler, which this "
                                      "module has none of; parametrize a linear, convolution or embedding layer, or "
                                      "remove the parametrization "
                                      "(torch.nn.utils.parametrize.remove_parametrizations)"))
        elif isinstance(m, BATCH_NORMS) and not frozen_batch_norm(m):
            what = ("normalizes with the batch's statistics in every mode (track_running_stats=False)"
                    if not m.track_running_stats or m.running_mean is None else
                    "has trainable parameters (trained through batch statistics in training mode, which mix the "
                    "examples, or through running statistics the step does not privatize)")
            out.append(_Problem(path, f"{type(m).__name__} {what}; replace it with GroupNorm "
                                      "(ModuleValidator.fix(model) does), or, with pretrained running statistics, "
                                      "freeze it (requires_grad_(False)) and keep it in eval() mode"))
        elif isinstance(m, _INSTANCE_NORMS) and m.track_running_stats:
            out.append(_Problem(path, f"{type(m).__name__} with track_running_stats=True learns running statistics "
                                      "from the whole batch; construct it with track_running_stats=False "
                                      "(ModuleValidator.fix(model) does)"))
        elif isinstance(m, nn.Embedding) and m.max_norm is not None:
            out.append(_Problem(path, f"Embedding with max_norm={m.max_norm} renormalizes the looked-up rows of its "
                                      "weight in place during forward, so the weight would record which tokens the "
                                      "batch used, without noise; construct it with max_norm=None"))
        elif isinstance(m, nn.Embedding) and (m.scale_grad_by_freq or m.sparse):
            what = "scale_grad_by_freq=True scales gradients by token frequency in the batch (mixes examples)" \
                if m.scale_grad_by_freq else "sparse=True gradients are not supported"
            out.append(_Problem(path, f"Embedding with {what}; construct it without"))
        elif isinstance(m, _BATCH_FIRST) and not m.batch_first and any(p.requires_grad for p in m.parameters()):
            out.append(_Problem(path, f"{type(m).__name__} with batch_first=False: per-example gradients need the "
                                      "batch as the leading dimension; construct it with batch_first=True"))
    return out


def uncompiled(model: nn.Module) -> nn.Module:
    """The model a ``torch.compile`` wrapper (``OptimizedModule``, recognised by name: no dynamo import) runs, or
    ``model`` itself: hooks and checks go on the original modules, which the compiled forward calls."""
    if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        return model._orig_mod
    return model


def per_token_experts(module: nn.Module) -> None:
    """Hugging Face mixture-of-experts models run their experts per token (``batched_mm``): the grouped and
    eager implementations sort or count the tokens of the whole batch by expert, which the isolation tracker
    (rightly) cannot tell from mixing.  The same function per token, so the same training."""
    for m in module.modules():
        config = getattr(m, "config", None)
        current = getattr(config, "_experts_implementation", None)
        if hasattr(m, "set_experts_implementation") and current not in (None, "batched_mm"):
            m.set_experts_implementation("batched_mm")
            logger.info("mixture of experts: experts_implementation %r -> 'batched_mm' (per token, so each "
                        "example's loss is computed from its own tokens alone)", current)


class ModuleValidator:
    """Checks (and fixes) a model for private training.

    Examples
    --------
    >>> from torch import nn
    >>> from dpsgd import ModuleValidator
    >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    >>> [e.path for e in ModuleValidator.validate(model)]
    ['1']
    >>> fixed = ModuleValidator.fix(model)
    >>> type(fixed[1]).__name__, ModuleValidator.validate(fixed)
    ('GroupNorm', [])
    """

    @staticmethod
    def validate(model: nn.Module) -> list[UnsupportedModuleError]:
        """Every refused module, as errors naming its path and the fix (empty when the model is fine)."""
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        return [UnsupportedModuleError(p.path, p.reason) for p in _problems(model)]

    @staticmethod
    def is_valid(model: nn.Module) -> bool:
        """Whether :meth:`validate` finds nothing."""
        return not ModuleValidator.validate(model)

    @staticmethod
    def check(model: nn.Module) -> None:
        """Raise the first :class:`UnsupportedModuleError` (all of them listed in its message)."""
        errors = ModuleValidator.validate(model)
        if errors:
            listed = "\n  ".join(str(e) for e in errors)
            first = errors[0]
            raise UnsupportedModuleError(first.path, f"{str(first).split(': ', 1)[1]}\nall refused modules:\n  "
                                                     f"{listed}")

    @staticmethod
    def fix(model: nn.Module) -> nn.Module:
        """Replace batch norms by ``GroupNorm(min(32, C), C)`` (affine as before) and turn off instance norms'
        running statistics, in place; returns ``model`` (or the replacement when ``model`` itself is one).  A frozen
        batch norm (:func:`frozen_batch_norm`), which the validator accepts, is kept with its statistics."""
        if isinstance(model, BATCH_NORMS) and not frozen_batch_norm(model):
            return _group_norm(model)
        for name, child in list(model.named_children()):
            setattr(model, name, ModuleValidator.fix(child))
        if isinstance(model, _INSTANCE_NORMS) and model.track_running_stats:
            model.track_running_stats = False
            model.running_mean = model.running_var = model.num_batches_tracked = None
        return model


def _group_norm(bn: nn.Module) -> nn.GroupNorm:
    c = bn.num_features
    groups = next(g for g in range(min(32, c), 0, -1) if c % g == 0)
    gn = nn.GroupNorm(groups, c, eps=bn.eps, affine=bn.affine)
    if bn.affine:
        gn.to(device=bn.weight.device, dtype=bn.weight.dtype)
    return gn



def check_positive(value: object, name: str, allow_zero: bool = False) -> float:
    """``float(value)``, or ``ValueError`` naming ``name`` unless finite and positive (or zero if allowed)."""
    v = float(value)
    if not (math.isfinite(v) and (v >= 0 if allow_zero else v > 0)):
        raise ValueError(f"{name} must be {'non-negative (>= 0)' if allow_zero else 'positive (> 0)'}, got {value!r}")
    return v

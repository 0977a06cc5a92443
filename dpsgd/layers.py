r"""Per-layer-type handlers: a module's contribution to each example's squared gradient norm.

A handler gets the module, its captured input activations and output gradients, and returns a
``(B,)`` tensor: the (estimated) ``||grad_i||^2`` of the module's *own* trainable parameters for each
example.  :data:`HANDLERS` maps module types to handlers (:func:`register_handler` adds one, like
Opacus' grad-sampler registry).  Built in:

* ``nn.Linear`` (2-D and 3-D inputs) and GPT-2's ``Conv1D`` (weight ``d x p``, ``y = x W + b``): the
  weight through the chosen estimator on ``(A, G)``; the bias as a linear layer with ``A = 1``, so with a
  randomized estimator it too is a mixture of ``chi2(k)/k`` terms;
* ``nn.Embedding``: the gradient is ``onehot(idx)^T G``; ``exact``/``ghost`` sum ``G`` rows per token id
  (index-based, never a ``V x p`` matrix per example), ``hutch``/``hutchpp`` project ``G`` first and then
  sum per token id (``hutchpp`` falls back to the exact index-based norm, see :func:`embedding_norms`).

Every other module with trainable parameters of its own is handled by :func:`functional_norms`: exact
per-example gradients by ``torch.func`` (vmap of a vector-Jacobian product), so any model is private.
Exact contributions are point masses in the estimate's law; :meth:`dpsgd.engine.Norms.exact_fraction`
lets the accountant choose an envelope that covers them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .estimators import ESTIMATORS, _gaussian

__all__ = ["HANDLERS", "register_handler", "linear_norms", "embedding_norms", "functional_norms", "is_conv1d"]

Handler = Callable[..., torch.Tensor]
HANDLERS: dict[type, Handler] = {}


def register_handler(module_type: type) -> Callable[[Handler], Handler]:
    """Decorator: use ``fn(module, activations, output_grads, estimator, k, generator)`` for ``module_type``.

    The handler must return exact squared norms or Hutchinson-type estimates (sums of ``chi2(k)/k``-weighted
    terms); the accountant then uses the ``d -> inf`` envelope for the model (see :mod:`dpsgd.privacy_engine`).

    Examples
    --------
    >>> from torch import nn
    >>> from dpsgd.layers import HANDLERS, register_handler
    >>> @register_handler(nn.Bilinear)
    ... def bilinear(module, a, g, estimator, k, generator):
    ...     raise NotImplementedError
    >>> nn.Bilinear in HANDLERS
    True
    >>> del HANDLERS[nn.Bilinear]
    """
    def wrap(fn: Handler) -> Handler:
        HANDLERS[module_type] = fn
        return fn
    return wrap


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` (transformers), recognised by name and weight layout, without importing it."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "weight") and module.weight.dim() == 2


def _estimate(estimator: str, a: torch.Tensor, g: torch.Tensor, k: int, generator) -> torch.Tensor:
    fn = ESTIMATORS[estimator]
    return fn(a, g) if estimator in ("exact", "ghost") else fn(a, g, k, generator)


@register_handler(nn.Linear)
def linear_norms(module: nn.Module, activations: torch.Tensor, output_grads: torch.Tensor, estimator: str,
                 k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Weight (and bias) contribution of ``nn.Linear`` or ``Conv1D``.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from dpsgd.layers import linear_norms
    >>> lin = nn.Linear(3, 2)
    >>> a, g = torch.ones(1, 4, 3), torch.ones(1, 4, 2)      # weight grad entries 4, bias grad entries 4
    >>> linear_norms(lin, a, g, "exact", 1)
    tensor([128.])
    """
    out = torch.zeros(activations.shape[0], device=activations.device, dtype=torch.float32)
    if module.weight.requires_grad:
        out = out + _estimate(estimator, activations, output_grads, k, generator)
    bias = getattr(module, "bias", None)
    if bias is not None and bias.requires_grad:
        ones = torch.ones(*output_grads.shape[:-1], 1, device=output_grads.device, dtype=output_grads.dtype)
        out = out + _estimate(estimator, ones, output_grads, k, generator)
    return out


def embedding_norms(module: nn.Embedding, indices: torch.Tensor, output_grads: torch.Tensor, estimator: str,
                    k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    r"""``||onehot(idx_i)^T G_i||_F^2`` of ``nn.Embedding`` from the token ids, per example.

    Rows of ``G_i`` (or of ``G_i P`` for ``hutch``) are summed per distinct id with ``index_add``; the
    ``V x p`` per-example gradient is never formed.  ``hutchpp`` uses the exact index-based norm (its
    sketch buys nothing here and the exact value is cheap).

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from dpsgd.layers import embedding_norms
    >>> emb = nn.Embedding(5, 2)
    >>> idx = torch.tensor([[1, 1, 3]])                 # id 1 twice: its gradient row is 2 g
    >>> embedding_norms(emb, idx, torch.ones(1, 3, 2), "exact", 1)
    tensor([10.])
    """
    b = indices.shape[0]
    idx = indices.reshape(b, -1)
    g = output_grads.reshape(b, idx.shape[1], -1).to(torch.promote_types(output_grads.dtype, torch.float32))
    if estimator == "hutch":
        g = g @ _gaussian(g.shape[-1], k, g, generator)
    # one key per (example, token id): the rows of each example's gradient, summed for the whole batch at once
    keys = idx + module.num_embeddings * torch.arange(b, device=idx.device).unsqueeze(1)
    uniq, inverse = torch.unique(keys.flatten(), return_inverse=True)
    rows = torch.zeros(uniq.numel(), g.shape[-1], device=g.device, dtype=g.dtype)
    rows.index_add_(0, inverse, g.reshape(-1, g.shape[-1]))
    out = torch.zeros(b, device=g.device, dtype=g.dtype)
    return out.index_add_(0, uniq // module.num_embeddings, rows.square().sum(1))


HANDLERS[nn.Embedding] = embedding_norms


def functional_norms(module: nn.Module, inputs: tuple, output_grads: torch.Tensor) -> torch.Tensor:
    """Exact per-example squared norms of ``module``'s own trainable parameters, by ``torch.func``.

    Each example's gradient is the vector-Jacobian product of ``module(x_i)`` with ``G_i``, vmapped over
    the batch; valid for modules that treat examples independently (layer norms, RMS norms, ...).
    """
    params = {n: p.detach() for n, p in module.named_parameters(recurse=False) if p.requires_grad}
    if not params:
        return torch.zeros(output_grads.shape[0], device=output_grads.device)

    def one(prm, g_i, *x_i):
        def f(pp):
            return torch.func.functional_call(module, pp, tuple(x.unsqueeze(0) for x in x_i)).squeeze(0)
        _, vjp = torch.func.vjp(f, prm)
        return vjp(g_i)[0]

    grads = torch.func.vmap(one, in_dims=(None, 0) + (0,) * len(inputs))(params, output_grads, *inputs)
    return sum(v.reshape(v.shape[0], -1).float().square().sum(1) for v in grads.values())


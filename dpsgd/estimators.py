r"""Per-sample squared gradient norms of a linear-like layer: exact, ghost, Hutchinson and Hutch++.

A linear-like layer maps activations ``A`` (``B x T x d``) to outputs ``S = A W`` (``B x T x p``); with
output gradients ``G = dL/dS``, example ``i``'s weight gradient is ``M_i = A_i^T G_i`` (``d x p``).  Every
function here returns the ``(B,)`` vector of (estimates of) ``||M_i||_F^2``:

* :func:`exact`: materializes every ``M_i`` (fast gradient clipping, memory ``O(B d p)``);
* :func:`ghost`: ``vec(A_i A_i^T) . vec(G_i G_i^T)`` (ghost clipping, memory ``O(B T^2)``);
* :func:`hutch`: ``||M_i P||_F^2`` with ``P`` a ``p x k`` matrix of i.i.d. ``N(0, 1/k)`` entries
  (paper 000, Alg. 2), computed as ``A_i^T (G_i P)`` in memory ``O(B k (T + d) + p k)``;
* :func:`hutchpp`: Hutch++ (Meyer et al. 2021): the head ``||M_i Q_i||^2`` on the orthonormal basis
  ``Q_i`` of ``M_i^T M_i S`` plus Hutchinson's estimate of the rest with ``P``, both ``p x k``.

The randomized estimators project along the larger of ``p`` and ``d`` (the transpose ``G_i^T A_i`` has
the same norm), so ``Y = n_hat / ||M||^2`` has ``min(p, d)`` chi-square terms: the ``d`` of
:class:`dpmath.HutchEnvelope`.  For a whole model the layers' independent projections add up, so the
model's ``Y`` mixes ``sum_l min(p_l, d_l)`` chi-square terms and its envelope needs that total as ``d``
(an envelope can only grow with ``d``: a smaller simplex embeds in a larger one; the noise it costs is
small, see the accountants page).  Both are unbiased; Hutchinson's variance with Gaussian probes is
``2 ||M^T M||_F^2 / k``.  The projections are drawn from ``generator`` (fresh per call: per layer and
step), shared by the batch, and independent of the data, which is all the privacy analysis needs.
Inputs of 2 dimensions are treated as ``T = 1``; half-precision inputs are computed in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["exact", "ghost", "hutch", "hutchpp", "hutchpp_operator", "ESTIMATORS", "check_k", "gaussian_projection"]


def _prepare(activations: torch.Tensor, output_grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, g = activations, output_grads
    if not isinstance(a, torch.Tensor) or not isinstance(g, torch.Tensor):
        raise ValueError("activations and output_grads must be torch tensors")
    if a.dim() == 2:
        a = a.unsqueeze(1)
    if g.dim() == 2:
        g = g.unsqueeze(1)
    if a.dim() != 3 or g.dim() != 3:
        raise ValueError(f"activations and output_grads must be (B, T, d) and (B, T, p) (or (B, d), (B, p)), "
                         f"got shapes {tuple(activations.shape)} and {tuple(output_grads.shape)}")
    if a.shape[:2] != g.shape[:2]:
        raise ValueError(f"activations and output_grads must agree in batch and sequence dimensions, got "
                         f"{tuple(a.shape)} and {tuple(g.shape)}")
    dtype = torch.promote_types(torch.promote_types(a.dtype, g.dtype), torch.float32)
    return a.to(dtype), g.to(dtype)


def check_k(k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"projection_dim (k) must be a positive integer (>= 1), got {k!r}")
    return k


def gaussian_projection(rows: int, k: int, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``rows x k`` i.i.d. ``N(0, 1/k)``, on ``like``'s device and dtype."""
    z = torch.randn(rows, k, generator=generator, device=like.device, dtype=like.dtype)
    return z / math.sqrt(k)


def exact(activations: torch.Tensor, output_grads: torch.Tensor) -> torch.Tensor:
    r"""``||A_i^T G_i||_F^2`` by materializing each per-sample gradient (fast gradient clipping).

    Parameters
    ----------
    activations : torch.Tensor
        ``A``, shape ``(B, T, d)`` or ``(B, d)``.
    output_grads : torch.Tensor
        ``G``, shape ``(B, T, p)`` or ``(B, p)``.

    Returns
    -------
    torch.Tensor
        Shape ``(B,)``, float32 or wider.

    Examples
    --------
    >>> import torch
    >>> from dpsgd.estimators import exact
    >>> a, g = torch.ones(1, 2, 3), torch.ones(1, 2, 4)       # M = A^T G has entries 2
    >>> exact(a, g)
    tensor([48.])
    """
    a, g = _prepare(activations, output_grads)
    return torch.einsum("btd,btp->bdp", a, g).square().sum(dim=(1, 2))


def ghost(activations: torch.Tensor, output_grads: torch.Tensor) -> torch.Tensor:
    r"""``vec(A_i A_i^T) . vec(G_i G_i^T)`` (ghost clipping): ``||A_i^T G_i||_F^2`` in ``O(T^2)`` memory.

    Where the two ``T x T`` Gram matrices cost more than the per-example gradient itself (``2 T^2 > d p``: long
    sequences into narrow layers, convolutions' many positions), the gradient is materialized instead, as
    :func:`exact` does: the same value in less time and memory (the per-layer choice of fastDP, Bu et al. 2023).

    Parameters
    ----------
    activations, output_grads : torch.Tensor
        As in :func:`exact`.

    Returns
    -------
    torch.Tensor
        Shape ``(B,)``.

    Examples
    --------
    >>> import torch
    >>> from dpsgd.estimators import ghost
    >>> ghost(torch.ones(1, 2, 3), torch.ones(1, 2, 4))
    tensor([48.])
    """
    a, g = _prepare(activations, output_grads)
    t, d, p = a.shape[1], a.shape[2], g.shape[2]
    if 2 * t * t > d * p:
        return torch.einsum("btd,btp->bdp", a, g).square().sum(dim=(1, 2))
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum(dim=(1, 2))


def _oriented(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, G)`` such that the projection runs along ``G``'s last (the larger) dimension."""
    return (a, g) if g.shape[-1] >= a.shape[-1] else (g, a)


def hutch(activations: torch.Tensor, output_grads: torch.Tensor, k: int,
          generator: torch.Generator | None = None) -> torch.Tensor:
    r"""Hutchinson's estimate of ``||A_i^T G_i||_F^2`` with ``k`` Gaussian probes (paper 000, Alg. 2).

    .. math:: \hat n_i = \|A_i^\top (G_i P)\|_F^2, \qquad P \in \mathbb R^{p \times k},\ P_{uv} \sim \mathcal N(0, 1/k),

    projected along the larger of ``p`` and ``d``.  ``E[n_hat] = ||M||_F^2`` and
    ``Var[n_hat] = 2 ||M^T M||_F^2 / k``.  Never forms a ``d x p`` or ``T x T`` matrix.

    Parameters
    ----------
    activations, output_grads : torch.Tensor
        As in :func:`exact`.
    k : int
        Projection dimension, ``>= 1``.
    generator : torch.Generator, optional
        Source of the projection (on the inputs' device); the default generator if omitted.

    Returns
    -------
    torch.Tensor
        Shape ``(B,)``.

    Examples
    --------
    >>> import torch
    >>> from dpsgd.estimators import exact, hutch
    >>> gen = torch.Generator().manual_seed(0)
    >>> a, g = torch.randn(2, 5, 3, generator=gen), torch.randn(2, 5, 4, generator=gen)
    >>> est = torch.stack([hutch(a, g, 8, gen) for _ in range(4000)]).mean(0)
    >>> bool(((est - exact(a, g)).abs() / exact(a, g)).max() < 0.05)
    True
    """
    k = check_k(k)
    a, g = _oriented(*_prepare(activations, output_grads))
    p = gaussian_projection(g.shape[-1], k, g, generator)
    return torch.bmm(a.transpose(1, 2), g @ p).square().sum(dim=(1, 2))


def hutchpp(activations: torch.Tensor, output_grads: torch.Tensor, k: int,
            generator: torch.Generator | None = None) -> torch.Tensor:
    r"""Hutch++ estimate of ``||A_i^T G_i||_F^2`` (Meyer et al. 2021; paper 000, Alg. 2).

    With ``M = A_i^T G_i`` and ``S, P`` two ``p x k`` matrices of i.i.d. ``N(0, 1/k)`` entries,
    ``Q_i`` an orthonormal basis of ``M^T M S`` (per example),

    .. math:: \hat n_i = \|M Q_i\|_F^2 + \|M P - (M Q_i)(Q_i^\top P)\|_F^2,

    the exact norm of the sketched head plus Hutchinson's estimate of the rest (unbiased, and exact
    when ``min(p, d) <= k``).  Memory ``O(B k (T + d + p))``.

    Parameters
    ----------
    activations, output_grads : torch.Tensor
        As in :func:`exact`.
    k : int
        Columns of each of ``S`` and ``P``, ``>= 1``.
    generator : torch.Generator, optional
        Source of ``S`` then ``P`` (on the inputs' device).

    Returns
    -------
    torch.Tensor
        Shape ``(B,)``.

    Examples
    --------
    >>> import torch
    >>> from dpsgd.estimators import exact, hutchpp
    >>> gen = torch.Generator().manual_seed(0)
    >>> a, g = torch.randn(2, 5, 3, dtype=torch.float64), torch.randn(2, 5, 9, dtype=torch.float64)
    >>> bool(torch.allclose(hutchpp(a, g, 4, gen), exact(a, g)))   # min(p, d) = 3 <= k: exact
    True
    """
    k = check_k(k)
    a, g = _oriented(*_prepare(activations, output_grads))
    at = a.transpose(1, 2)
    return hutchpp_operator(lambda x: torch.bmm(at, torch.matmul(g, x)),     # M x = A^T (G x)
                            lambda y: torch.bmm(g.transpose(1, 2), torch.bmm(a, y)),   # M^T y = G^T (A y)
                            g.shape[-1], k, g, generator)


def hutchpp_operator(apply: Callable[[torch.Tensor], torch.Tensor],
                     apply_transposed: Callable[[torch.Tensor], torch.Tensor],
                     cols: int, k: int, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    r"""The Hutch++ estimate of :func:`hutchpp` for per-example matrices ``M_i`` (``rows x cols``) given only as
    products: ``apply(X)`` is ``M_i X_i`` and ``apply_transposed(Y)`` is ``M_i^T Y_i``.

    ``X`` is ``cols x k`` (shared by the batch) or ``B x cols x k``; ``Y`` is ``B x rows x k``.  A parameter used
    by several calls (tied embeddings) has ``M_i = sum_u M_{i,u}``: both products are sums of each use's, so
    the estimate of the summed gradient never forms it.  Draws ``S`` then ``P`` (``cols x k``, i.i.d.
    ``N(0, 1/k)``, on ``like``'s device and dtype) from ``generator``.

    Returns
    -------
    torch.Tensor
        Shape ``(B,)``: ``||M Q||_F^2 + ||M P - (M Q)(Q^T P)||_F^2`` with ``Q`` an orthonormal basis of
        ``M^T M S``.

    Examples
    --------
    >>> import torch
    >>> from dpsgd.estimators import exact, hutchpp_operator
    >>> a, g = torch.randn(2, 5, 3, dtype=torch.float64), torch.randn(2, 5, 2, dtype=torch.float64)
    >>> est = hutchpp_operator(lambda x: a.transpose(1, 2) @ (g @ x), lambda y: g.transpose(1, 2) @ (a @ y),
    ...                        2, 2, a, torch.Generator().manual_seed(0))   # rank 2 <= k: exact
    >>> bool(torch.allclose(est, exact(a, g)))
    True
    """
    s = gaussian_projection(cols, k, like, generator)
    p = gaussian_projection(cols, k, like, generator)
    q = torch.linalg.qr(apply_transposed(apply(s)), mode="reduced").Q   # (B, cols, k)
    mq = apply(q)                                                       # M Q: (B, rows, k)
    rest = apply(p) - torch.bmm(mq, torch.matmul(q.transpose(1, 2), p))
    return mq.square().sum(dim=(1, 2)) + rest.square().sum(dim=(1, 2))


ESTIMATORS = {"exact": exact, "ghost": ghost, "hutch": hutch, "hutchpp": hutchpp}
"""The estimators by name, as the trainer's ``estimator=`` argument spells them."""

r"""Gradient-spectrum tools of paper 004 (restricted Lipschitz continuity).

Paper 004 explains why DP fine-tuning need not suffer in high dimensions: if the gradients of the
empirical loss live mostly in a few directions, DP-SGD's error depends on the *restricted Lipschitz
coefficients*

.. math::

    G_k = \sup_x \big\|(I - P_k)\,\nabla F(x)\big\|_2,

for the best rank-``k`` orthogonal projection ``P_k``, rather than on the dimension.  Its Sec. 4.2 checks
this by stacking ``r`` gradients from a fine-tuning run as the rows of ``H`` (``r x p``), computing the top
singular values of ``H`` by orthogonal (subspace) iteration, fitting ``sigma_k ~ k^{-c}`` on log-log
axes (it reports ``c ~ 0.6``), and re-training with the gradient projected on the top-``k`` subspace.

This module gives the pieces, in torch, on any device:

* :class:`GradientRecorder` collects flattened gradients every ``every`` steps;
* :func:`top_singular` runs orthogonal iteration on ``H^T H`` with an oversampled block and a
  Rayleigh-Ritz step, returning the top ``k`` singular values and right singular vectors;
* :func:`decay_fit` fits the decay exponent with its standard error and a 95 % interval;
* :func:`restricted_lipschitz` gives two proxies of ``G_k`` for every ``k`` up to the basis size: the
  largest tail norm ``max_i ||(I - V_k V_k^T) h_i||`` (the paper's definition, over the recorded
  gradients) and the root-mean-square tail norm.

**Privacy.**  The paper analyses the *non-private* average clipped gradients.  :class:`GradientRecorder`
reads ``param.grad`` after the optimizer step, which under :class:`~dpsgd.PrivacyEngine` is the noisy
gradient the step released: the spectrum is then a post-processing and costs no privacy.  A basis
computed from gradients that were not privatized is private data; re-training with it is not covered by
the accountant.

Examples
--------
>>> import torch
>>> from dpsgd.spectrum import decay_fit, top_singular
>>> gen = torch.Generator().manual_seed(0)
>>> u, _ = torch.linalg.qr(torch.randn(40, 40, generator=gen, dtype=torch.float64))
>>> v, _ = torch.linalg.qr(torch.randn(300, 40, generator=gen, dtype=torch.float64))
>>> s = torch.arange(1, 41, dtype=torch.float64) ** -0.6          # a planted k^{-0.6} spectrum
>>> H = u @ torch.diag(s) @ v.T
>>> top = top_singular(H, 10, iters=20, generator=gen)
>>> bool(torch.allclose(top.values, s[:10], rtol=1e-6))
True
>>> round(decay_fit(top.values).exponent, 6)
0.6
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from scipy import stats

__all__ = ["GradientRecorder", "TopSingular", "DecayFit", "top_singular", "decay_fit", "restricted_lipschitz"]


@dataclass(frozen=True)
class TopSingular:
    """The top singular values of ``H`` (descending) and the matching right singular vectors (columns of
    ``vectors``, ``p x k``, orthonormal)."""

    values: torch.Tensor
    vectors: torch.Tensor


@dataclass(frozen=True)
class DecayFit:
    """Least-squares fit ``log sigma_k = intercept - exponent log k`` over ``ks``, with the exponent's
    standard error and a 95 % confidence interval (Student t, ``n - 2`` degrees of freedom)."""

    exponent: float
    intercept: float
    stderr: float
    ci95: tuple[float, float]
    ks: tuple[int, int]


def _matrix(H: torch.Tensor, keep_float32: bool = False) -> torch.Tensor:
    if not isinstance(H, torch.Tensor) or H.ndim != 2:
        raise ValueError(f"H must be a 2-D tensor (rows = gradients), got {type(H).__name__} "
                         f"{tuple(getattr(H, 'shape', ()))}")
    if not torch.isfinite(H).all():
        raise ValueError("H must be finite (a gradient had NaN or inf entries)")
    if H.dtype == torch.float64 or (keep_float32 and H.dtype == torch.float32):
        return H
    return H.to(torch.float64)


def top_singular(H: torch.Tensor, k: int, *, iters: int = 10, oversample: int = 10, method: str = "auto",
                 generator: torch.Generator | None = None) -> TopSingular:
    r"""Top ``k`` singular values and right singular vectors of ``H`` (``r x p``).

    ``method="gram"`` diagonalizes the ``r x r`` Gram matrix ``H H^T`` in float64 (``r^2 p`` flops, exact
    up to an absolute error near ``1e-16 sigma_1^2`` in ``sigma_j^2``).  ``method="iteration"`` is the
    orthogonal (or subspace) iteration on ``H^T H`` that paper 004 uses (Demmel 1997): a random
    ``p x (k + oversample)`` block ``Q`` is iterated as ``Q <- orth(H^T (H Q))``, then Rayleigh-Ritz: the
    singular values of ``H Q`` and their right vectors mapped back by ``Q``.  The error of ``sigma_j``
    falls like ``(sigma_{k + oversample + 1} / sigma_j)^{2 iters}``; a matrix of rank at most
    ``k + oversample`` is exact after one iteration.  Runs on ``H``'s device; the products with ``H`` are
    in its precision when it is float32 (recorded gradients; no float64 copy of a large ``H``) and in
    float64 otherwise, the rest in float64.  Each iteration costs two products with ``H``
    (``4 r p (k + oversample)`` flops).  ``"auto"`` (default) takes the Gram matrix when it is the cheaper,
    ``r < 4 iters (k + oversample)`` (a few hundred recorded gradients), else the iteration.

    Parameters
    ----------
    H : torch.Tensor
        The gradients as rows, ``r x p``.
    k : int
        How many singular values, ``1 <= k <= min(r, p)``.
    iters : int
        Iterations, ``>= 1`` (default 10, as the paper).
    oversample : int
        Extra block columns, ``>= 0`` (default 10); the block is capped at ``min(r, p)``.
    method : {"auto", "gram", "iteration"}
        How (see above).
    generator : torch.Generator, optional
        For the random start (on ``H``'s device).

    Examples
    --------
    >>> import torch
    >>> from dpsgd.spectrum import top_singular
    >>> H = torch.diag(torch.tensor([5.0, 3.0, 1.0]))
    >>> top_singular(H, 2).values.round(decimals=6).tolist()    # float32 H: products in float32
    [5.0, 3.0]
    """
    A = _matrix(H, keep_float32=True)
    r, p = A.shape
    if not isinstance(k, int) or not 1 <= k <= min(r, p):
        raise ValueError(f"k must be an integer in [1, min(r, p)] = [1, {min(r, p)}], got {k!r}")
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an integer >= 1, got {iters!r}")
    if not isinstance(oversample, int) or oversample < 0:
        raise ValueError(f"oversample must be an integer >= 0, got {oversample!r}")
    if method not in ("auto", "gram", "iteration"):
        raise ValueError(f"method must be 'auto', 'gram' or 'iteration', got {method!r}")
    b = min(k + oversample, r, p)
    if method == "gram" or (method == "auto" and r < 4 * iters * b):
        gram = torch.zeros(r, r, dtype=torch.float64, device=A.device)
        for j in range(0, p, 1 << 16):   # column blocks: no float64 copy of a float32 H
            block = A[:, j:j + (1 << 16)].double()
            gram += block @ block.T
        lam, U = torch.linalg.eigh(gram)
        lam, U = lam.flip(0)[:k].clamp_min(0.0), U.flip(1)[:, :k]
        s = lam.sqrt()
        V = torch.cat([(A[:, j:j + (1 << 16)].double().T @ U) for j in range(0, p, 1 << 16)])
        return TopSingular(s, V / torch.where(s > 0, s, torch.ones_like(s)))
    Q = torch.randn(p, b, generator=generator, dtype=torch.float64, device=A.device)
    Q, _ = torch.linalg.qr(Q)

    def times_a(X: torch.Tensor) -> torch.Tensor:   # products in H's precision, everything else in float64
        return (A @ X.to(A.dtype)).double()

    for _ in range(iters):
        Q, _ = torch.linalg.qr((A.T @ times_a(Q).to(A.dtype)).double())
    _, s, vh = torch.linalg.svd(times_a(Q), full_matrices=False)
    return TopSingular(s[:k], Q @ vh[:k].T)


def decay_fit(values: torch.Tensor | Iterable[float], ks: tuple[int, int] | None = None) -> DecayFit:
    r"""Fit ``sigma_k ~ e^{intercept} k^{-exponent}`` by least squares on ``(log k, log sigma_k)``.

    Parameters
    ----------
    values : tensor or iterable of float
        Singular values in rank order (``values[0]`` is ``sigma_1``), positive.
    ks : (int, int), optional
        The ranks ``(first, last)`` fitted, 1-based and inclusive (default: all; paper 004 fits the top
        1000).  At least three.

    Examples
    --------
    >>> from dpsgd.spectrum import decay_fit
    >>> fit = decay_fit([k ** -0.5 for k in range(1, 101)])
    >>> round(fit.exponent, 9), fit.ks
    (0.5, (1, 100))
    """
    v = torch.as_tensor(values, dtype=torch.float64).detach().cpu().ravel()
    first, last = (1, v.numel()) if ks is None else ks
    if not (isinstance(first, int) and isinstance(last, int) and 1 <= first and last <= v.numel()
            and last - first >= 2):
        raise ValueError(f"ks must be (first, last) with 1 <= first, last <= {v.numel()} and at least three "
                         f"ranks, got {ks!r}")
    y = v[first - 1:last]
    if not (torch.isfinite(y).all() and (y > 0).all()):
        raise ValueError("values must be positive and finite on the fitted ranks")
    x = torch.log(torch.arange(first, last + 1, dtype=torch.float64))
    ly = torch.log(y)
    xm, ym = x.mean(), ly.mean()
    sxx = ((x - xm) ** 2).sum()
    slope = float(((x - xm) * (ly - ym)).sum() / sxx)
    intercept = float(ym - slope * xm)
    n = x.numel()
    resid = ly - (intercept + slope * x)
    stderr = math.sqrt(float((resid ** 2).sum()) / (n - 2) / float(sxx))
    t = float(stats.t.ppf(0.975, n - 2))
    return DecayFit(-slope, intercept, stderr, (-slope - t * stderr, -slope + t * stderr), (first, last))


def restricted_lipschitz(H: torch.Tensor, vectors: torch.Tensor) -> dict[str, torch.Tensor]:
    r"""Proxies of the restricted Lipschitz coefficients ``G_0, ..., G_K`` from the recorded gradients.

    With ``V_k`` the first ``k`` columns of ``vectors`` (orthonormal, ``p x K``, e.g. from
    :func:`top_singular`) and ``h_i`` the rows of ``H``:

    * ``"max"``: ``max_i ||(I - V_k V_k^T) h_i||``, paper 004's ``G_k`` restricted to the recorded
      gradients and to this basis (an upper bound on the best rank-``k`` projection's value);
    * ``"rms"``: ``sqrt(mean_i ||(I - V_k V_k^T) h_i||^2)``, the tail energy per gradient.

    Both are tensors of length ``K + 1`` (``k = 0`` is the plain norm), non-increasing in ``k``.  A tail
    is ``||h||^2`` minus the captured energy, so it is accurate to about ``1e-8 ||h||`` (float64), not
    relatively when it is that small.

    Examples
    --------
    >>> import torch
    >>> from dpsgd.spectrum import restricted_lipschitz
    >>> H = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 1.0]])
    >>> restricted_lipschitz(H, torch.eye(3)[:, :2])["max"].tolist()
    [5.0, 4.0, 1.0]
    """
    A = _matrix(H)
    V = _matrix(vectors)
    if V.shape[0] != A.shape[1]:
        raise ValueError(f"vectors must have {A.shape[1]} rows (the gradient length), got {V.shape[0]}")
    coef2 = (A @ V.to(A.device)) ** 2                                   # r x K
    total = (A ** 2).sum(1, keepdim=True)
    tail = (total - torch.cat([torch.zeros_like(total), coef2.cumsum(1)], 1)).clamp_min(0.0)   # r x (K+1)
    return {"max": tail.max(0).values.sqrt(), "rms": tail.mean(0).sqrt()}


class GradientRecorder:
    """Collect the flattened gradients of ``parameters`` every ``every`` calls of :meth:`record`.

    :meth:`attach` it to the optimizer: it then records inside every ``step()``, just before the update.
    Under :class:`~dpsgd.PrivacyEngine` that is when ``.grad`` holds the noisy gradient the step
    releases (the private optimizer clears it afterwards), so the spectrum costs no privacy.  Without a
    private optimizer, :meth:`record` can also be called by hand after ``backward()``.  Rows are stored in
    ``dtype`` (default float32) on ``device`` (default the CPU), at most ``max_rows`` of them (the oldest
    are dropped).  :meth:`matrix` returns them as ``H``.

    Examples
    --------
    >>> import torch
    >>> from dpsgd.spectrum import GradientRecorder
    >>> model = torch.nn.Linear(3, 2)
    >>> rec = GradientRecorder(model.parameters(), every=2)
    >>> for step in range(5):
    ...     model(torch.ones(1, 3)).sum().backward()
    ...     _ = rec.record()
    >>> rec.matrix().shape
    torch.Size([3, 8])
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], *, every: int = 1, max_rows: int = 4000,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        if not self.parameters:
            raise ValueError("parameters must include at least one trainable parameter")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be an integer >= 1, got {max_rows!r}")
        self.every, self.max_rows, self.dtype, self.device = every, max_rows, dtype, torch.device(device)
        self.calls = 0
        self.rows: list[torch.Tensor] = []

    def attach(self, optimizer: torch.optim.Optimizer):
        """Record inside ``optimizer.step()`` (a step pre-hook on the optimizer that applies the update: a
        :class:`~dpsgd.optimizer.DPOptimizer`'s wrapped one).  Returns the hook's handle
        (``.remove()`` detaches it)."""
        target = getattr(optimizer, "original_optimizer", optimizer)
        if not isinstance(target, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        def hook(*_) -> None:
            self.record()

        return target.register_step_pre_hook(hook)

    def record(self) -> bool:
        """Store the current gradients if this call is due (the first, then every ``every``); returns whether
        it stored.  A parameter without a gradient is an error: the row would not be a gradient."""
        if self.calls % self.every != 0:
            self.calls += 1
            return False
        missing = [i for i, p in enumerate(self.parameters) if p.grad is None]
        if missing:   # refused before counting: the call did not happen
            raise ValueError(f"parameters {missing} have no .grad: record after backward/step, before zero_grad")
        self.calls += 1
        row = torch.cat([p.grad.detach().reshape(-1).to(self.device, self.dtype) for p in self.parameters])
        self.rows.append(row)
        del self.rows[:-self.max_rows]
        return True

    def matrix(self) -> torch.Tensor:
        """The recorded gradients as rows, ``r x p``."""
        if not self.rows:
            raise ValueError("no gradients recorded yet")
        return torch.stack(self.rows)

r"""Memory and FLOP models of per-sample norm computation for one linear layer (paper 000, App. E).

Sizes are in tensor elements; activations are ``B x T x d``, output gradients ("backprops")
``B x T x p``, the projection dimension is ``k``.  The initial memory of every method is ``BT(d + p)``.

:func:`memory_model` follows Table 6 (peak memory, and peak minus initial, with or without deleting the
backprops right after the norm is computed).  :func:`flop_model` counts multiplications and additions of
Table 8.  One correction: for DP-SGD-RC the table's "exact FLOPs" column,
``2BTk(p+d) + Bk(d-T) - B``, is not the sum of its own multiplication and addition columns,
``BTk(p+d) + Bdk`` and ``BTk(p+d-2) + Bdk - B``, which add up to ``2BTk(p+d) + 2Bk(d-T) - B``; we
return the sum.  The surrounding prose's overhead ``max(BTk + pk, Bk(d - p) + Bdk)`` also disagrees with
the table's ``max(BTk + pk, BT(k - p) + Bdk)``, which is what peak minus initial gives; we follow the table.
"""

from __future__ import annotations

__all__ = ["memory_model", "flop_model"]

_METHODS = ("fgc", "gc", "rc")


def _sizes(method: str, **dims: int) -> None:
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS} (fast gradient clipping, ghost clipping, randomized "
                         f"clipping), got {method!r}")
    for name, v in dims.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def memory_model(method: str, batch: int, seq_len: int, d: int, p: int, k: int = 32, *,
                 delete_backprops: bool = True) -> dict[str, int]:
    r"""Peak memory and overhead (peak minus the initial ``BT(d+p)``) of Table 6, in elements.

    ============  ===================  =======================================================
    method        backprops deleted    peak
    ============  ===================  =======================================================
    ``"fgc"``     either               ``BT(d+p) + Bpd``
    ``"gc"``      no                   ``BT(d+p) + 2BT^2``
    ``"gc"``      yes                  ``max(BT(d+p+T), BT(d+2T))``
    ``"rc"``      no                   ``BT(d+p+k) + pk + Bdk``
    ``"rc"``      yes                  ``max(BT(d+p+k) + pk, BT(d+k) + Bdk)``
    ============  ===================  =======================================================

    Parameters
    ----------
    method : {"fgc", "gc", "rc"}
        Fast gradient clipping, ghost clipping, or randomized clipping (Hutchinson).
    batch, seq_len, d, p, k : int
        ``B, T``, the layer's input and output widths, the projection dimension.
    delete_backprops : bool
        Whether output gradients are freed once the norm is computed (no book-keeping).

    Returns
    -------
    dict
        ``{"peak": ..., "overhead": ...}``.

    Examples
    --------
    >>> from dpsgd.cost import memory_model
    >>> memory_model("rc", 2, 4096, 2048, 8192)["overhead"] / memory_model("gc", 2, 4096, 2048, 8192)["overhead"]
    0.015625
    """
    _sizes(method, batch=batch, seq_len=seq_len, d=d, p=p, k=k)
    b, t = batch, seq_len
    initial = b * t * (d + p)
    if method == "fgc":
        peak = initial + b * p * d
    elif method == "gc":
        peak = max(b * t * (d + p + t), b * t * (d + 2 * t)) if delete_backprops else initial + 2 * b * t * t
    elif delete_backprops:
        peak = max(b * t * (d + p + k) + p * k, b * t * (d + k) + b * d * k)
    else:
        peak = b * t * (d + p + k) + p * k + b * d * k
    return {"peak": peak, "overhead": peak - initial}


def flop_model(method: str, batch: int, seq_len: int, d: int, p: int, k: int = 32) -> dict[str, int]:
    r"""Multiplications, additions and their total for per-sample norms of one linear layer (Table 8).

    ============  ==========================  ================================
    method        multiplications             additions
    ============  ==========================  ================================
    ``"fgc"``     ``BTpd``                    ``B(T-1)pd``
    ``"gc"``      ``BT^2(p+d+1)``             ``BT^2(p+d-1) - B``
    ``"rc"``      ``BTk(p+d) + Bdk``          ``BTk(p+d-2) + Bdk - B``
    ============  ==========================  ================================

    Parameters
    ----------
    method : {"fgc", "gc", "rc"}
    batch, seq_len, d, p, k : int

    Returns
    -------
    dict
        ``{"mul": ..., "add": ..., "total": ...}``.

    Examples
    --------
    >>> from dpsgd.cost import flop_model
    >>> gc, rc = flop_model("gc", 2, 4096, 2048, 2048), flop_model("rc", 2, 4096, 2048, 2048)
    >>> round(gc["total"] / rc["total"])          # about T / k, as the paper says
    128
    """
    _sizes(method, batch=batch, seq_len=seq_len, d=d, p=p, k=k)
    b, t = batch, seq_len
    if method == "fgc":
        mul, add = b * t * p * d, b * (t - 1) * p * d
    elif method == "gc":
        mul, add = b * t * t * (p + d + 1), b * t * t * (p + d - 1) - b
    else:
        mul, add = b * t * k * (p + d) + b * d * k, b * t * k * (p + d - 2) + b * d * k - b
    return {"mul": mul, "add": add, "total": mul + add}

"""torch.distributed for the private step: ranks, shared seeds, and clipped sums of replicated (DDP) or
sharded (FSDP2, ``torch.distributed.fsdp.fully_shard``) parameters.

Every rank clips its own examples.  A replicated parameter's clipped sums are all-reduced; a sharded
parameter's (a ``DTensor``, sharded along dimension 0 on a 1-D mesh) are reduce-scattered, so each rank
keeps the sum of its shard only.  The noise is drawn once, from a generator with the same seed on every
rank, at the parameter's full shape; a sharded parameter keeps the rows of its shard, so every coordinate
of the model gets noise of standard deviation ``sigma C`` exactly once, the same as without sharding.

Under FSDP2 every rank must issue the same collectives in the same order: its forward and backward gather the
sharded parameters together with the other ranks'.  So every rank runs a forward, the per-example row check and a
backward on every step, whatever the size of its part of the batch: :class:`~dpsgd.samplers.FilledParts`
completes a part of fewer than two examples with filler rows that the step weights 0, and the row check decides on
every rank together (:func:`max_over_ranks`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
except ImportError:   # a torch build without torch.distributed
    DTensor = ()

__all__ = ["rank_world", "broadcast_int", "all_sum", "check_same_on_ranks", "any_rank", "max_over_ranks",
           "is_sharded", "check_sharding", "reduce_sums", "local_part", "as_grad",
           "MIN_ROWS"]

#: the fewest rows a rank's forward holds under FSDP2: the row check compares two rows, so its backward, which
#: gathers parameters, runs on every rank only if every rank has two
MIN_ROWS = 2


def rank_world() -> tuple[int, int]:
    """``(rank, world size)``, ``(0, 1)`` without an initialized process group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _scalars(values: list, dtype: torch.dtype) -> torch.Tensor:
    """A small tensor for a collective, on the device the process group's backend needs (NCCL: the current GPU)."""
    nccl = torch.distributed.get_backend() == "nccl"
    return torch.tensor(values, dtype=dtype, device=torch.cuda.current_device() if nccl else "cpu")


def broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank (identity without torch.distributed)."""
    if rank_world()[1] == 1:
        return value
    t = _scalars([value], torch.int64)
    torch.distributed.broadcast(t, src=0)
    return int(t.item())


def all_sum(value: float) -> float:
    """The sum of ``value`` over ranks."""
    if rank_world()[1] == 1:
        return value
    t = _scalars([value], torch.float64)
    torch.distributed.all_reduce(t)
    return float(t.item())


def check_same_on_ranks(value: float, name: str) -> None:
    """``ValueError`` on every rank unless ``value`` is the same on all of them (no-op in one process)."""
    if rank_world()[1] == 1:
        return
    t = _scalars([float(value), -float(value)], torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    if t[0].item() != -t[1].item():
        raise ValueError(f"{name} differs between ranks (from {-t[1].item():g} to {t[0].item():g}); every rank must "
                         f"take the same steps with the same privacy settings")


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a ``DTensor`` (a parameter that FSDP2 shards)."""
    return isinstance(p, DTensor)


def check_sharding(name: str, p: torch.Tensor) -> None:
    """``ValueError`` unless a sharded parameter is FSDP2's layout: one mesh dimension, ``Shard(0)``."""
    if is_sharded(p) and (p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),)):
        raise ValueError(f"{name} is a DTensor with placements {tuple(p.placements)} on a {p.device_mesh.ndim}-D "
                         f"mesh; the private step supports FSDP2's (Shard(0),) on a 1-D mesh (fully_shard without "
                         f"HSDP or tensor parallelism)")


def reduce_sums(params: list, sums: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each rank's clipped sums (full shapes) added over ranks: all-reduced for a replicated parameter, the
    local shard of the reduce-scattered sum for a sharded one."""
    if rank_world()[1] == 1:
        return sums
    out = []
    for p, g in zip(params, sums, strict=True):
        if is_sharded(p):
            out.append(DTensor.from_local(g.contiguous(), p.device_mesh, [Partial()], run_check=False)
                       .redistribute(p.device_mesh, p.placements).to_local())
        else:
            # row-major on every rank: the all-reduce adds the ranks' buffers element by element in memory order,
            # and a handler's sum may be laid out otherwise (a convolution's) while a rank with no example sends
            # row-major zeros
            g = g.clone(memory_format=torch.contiguous_format)
            torch.distributed.all_reduce(g)
            out.append(g)
    return out


def local_part(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (the parameter's full shape, identical on every rank) restricted to this rank's shard of ``p``."""
    if not is_sharded(p):
        return full
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()


def as_grad(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient for ``p``: a ``DTensor`` with ``p``'s layout when ``p`` is sharded."""
    local = local.to(device=p.to_local().device if is_sharded(p) else p.device, dtype=p.dtype)
    if not is_sharded(p):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank (``flag`` itself without torch.distributed)."""
    return bool(max_over_ranks([int(bool(flag))])[0])


def max_over_ranks(values: Sequence[int]) -> list[int]:
    """Each of ``values``' entries maximized over ranks, in one all-reduce (``values`` itself in one process).

    Parameters
    ----------
    values : sequence of int
        The same number of integers on every rank.

    Returns
    -------
    list of int
        The elementwise maximum, the same on every rank (a minimum is ``-max(-v)``).
    """
    if rank_world()[1] == 1:
        return [int(v) for v in values]
    t = _scalars([int(v) for v in values], torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]



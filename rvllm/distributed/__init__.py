"""Tensor-parallel state. One process is tp_size=1; scale-out sets these at start-up."""

from __future__ import annotations

_TP_RANK = 0
_TP_SIZE = 1


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def set_tp(rank: int, size: int) -> None:
    global _TP_RANK, _TP_SIZE
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside world size {size}.")
    _TP_RANK, _TP_SIZE = rank, size


def all_reduce(x):  # noqa: ANN001, ANN201 - torch.Tensor in, out
    """Sum a partial result over the tensor-parallel group (a no-op at tp_size=1)."""
    if _TP_SIZE == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def all_gather_last_dim(x):  # noqa: ANN001, ANN201
    """Concatenate per-rank shards along the last dimension (a no-op at tp_size=1)."""
    if _TP_SIZE == 1:
        return x
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)

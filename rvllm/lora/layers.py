"""A step's LoRA: which rows of the step run with which adapter (set by the runner around
the forward pass), and the low-rank products the linear layers add to their outputs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# This step's rows by adapter id (None: every row), or None when no row has an adapter.
_ROWS: list[dict[int, torch.Tensor | None] | None] = [None]


@dataclass(frozen=True, slots=True)
class LoRASlice:
    """One adapter's product for ``size`` output features from ``start``: x A^T B^T, the
    scale folded into ``b``."""

    start: int
    size: int
    a: torch.Tensor  # [rank, input features]
    b: torch.Tensor  # [size, rank]


@contextmanager
def lora_rows(rows: dict[int, torch.Tensor | None] | None) -> Iterator[None]:
    """The step's rows of each adapter, for the linear layers inside."""
    _ROWS[0] = rows
    try:
        yield
    finally:
        _ROWS[0] = None


def lora_active() -> bool:
    """Whether this step runs any adapter: then no compiled or fused path that skips the
    linear layers' forward may run it."""
    return _ROWS[0] is not None


def apply_lora(weights: dict[int, list[LoRASlice]], x: torch.Tensor, y: torch.Tensor
               ) -> torch.Tensor:
    """``y`` (a linear layer's output for input ``x``) with each adapter's product added
    to its rows."""
    rows = _ROWS[0]
    if rows is None:
        return y
    x2 = x.reshape(-1, x.shape[-1])
    y2 = y.view(-1, y.shape[-1])
    for adapter_id, index in rows.items():
        slices = weights.get(adapter_id)
        if not slices:
            continue
        xs = x2 if index is None else x2.index_select(0, index)
        for s in slices:
            delta = (xs @ s.a.T) @ s.b.T
            target = y2.narrow(-1, s.start, s.size)
            if index is None:
                target += delta
            else:
                target.index_add_(0, index, delta)
    return y

"""Per-step attention metadata, set once by the model runner and read by every layer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillSeq:
    """One sequence computing more than one new token this step (prompt or chunk)."""

    token_start: int  # first row of this sequence in the flat token batch
    num_tokens: int  # new tokens this step
    context_len: int  # tokens already in the cache before this step
    slots: torch.Tensor | None  # cache slots of positions [0, context_len + num_tokens)
    mask: torch.Tensor | None  # [num_tokens, context_len + num_tokens] bool; None = plain causal


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to.

    The flat batch holds the decode tokens first (one per sequence), then the
    prefill chunks, one sequence after another.
    """

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    num_decode_tokens: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_len] gather index into the cache
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_len] bool, True = attend
    prefills: list[PrefillSeq]


_CONTEXT: AttentionMetadata | None = None


@contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, metadata
    try:
        yield
    finally:
        _CONTEXT = previous


def get_forward_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("attention ran outside set_forward_context().")
    return _CONTEXT

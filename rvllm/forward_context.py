"""Per-step attention metadata, set once by the model runner and read by every layer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillSeq:
    """One sequence computing more than one new token this step (prompt or chunk)."""

    token_start: int  # first row of this sequence in the flat token batch
    num_tokens: int  # new tokens this step
    context_len: int  # tokens already in the cache before this step
    slots: torch.Tensor  # cache slots of positions [0, context_len + num_tokens)
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[num_tokens, context_len + num_tokens] bool, True = attend; None when plain
        causal attention over this step's own tokens is all that is needed."""
        if self.context_len == 0 and window is None:
            return None
        if window not in self._masks:
            ctx, n = self.context_len, self.num_tokens
            q_pos = torch.arange(ctx, ctx + n, device=self.slots.device).unsqueeze(1)
            k_pos = torch.arange(ctx + n, device=self.slots.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            self._masks[window] = mask
        return self._masks[window]


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to.

    The flat batch holds the decode tokens first (one per sequence), then the
    prefill chunks, one sequence after another. Masks are built on first use for
    each sliding-window size, so models mixing local and global layers pay once.
    """

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    num_decode_tokens: int
    # [num_decodes, max_len] gather index into the cache; None until gather_slots() when the
    # runner leaves it to be built from the block tables (the numba kernels never read it).
    decode_slots: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None  # [num_decodes] context length including the new token
    prefills: list[PrefillSeq]
    _decode_masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    # The paged kernels' view of the same step: the model runner gives the decodes' block
    # tables (int64); add_block_tables fills the rest, all int32, for the Triton kernels.
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks]
    decode_lens_i32: torch.Tensor | None = None  # [num_decodes] int32
    prefill_block_tables: torch.Tensor | None = None  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor | None = None  # [num_prefills + 1] int32
    prefill_seq_lens: torch.Tensor | None = None  # [num_prefills] int32: cached + new
    max_prefill_len: int = 0
    # The numba decode kernel's per-step arrays (its step_arrays()), made by the first layer.
    cpu_decode_arrays: tuple | None = None
    # ragged_decode()'s answer, once computed: False = not computed yet.
    _ragged: tuple[torch.Tensor, list[int]] | None | bool = False
    block_size: int = 0  # the cache's, for gather_slots()

    def gather_slots(self) -> torch.Tensor | None:
        """``decode_slots``, built from the decodes' block tables on first use when the
        runner left it out."""
        if self.decode_slots is None and self.decode_block_tables is not None:
            assert self.decode_seq_lens is not None and self.block_size > 0
            self.decode_slots = decode_slots_from_tables(
                self.decode_block_tables, self.decode_seq_lens, self.block_size)
        return self.decode_slots

    def decode_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """[num_decodes, 1, 1, max_len] additive mask (0 = attend, -inf = not), or None when
        every decode attends to every gathered position (no padding, no window). Additive
        in the compute dtype because SDPA turns a bool mask into exactly that, once per
        call; here it is built once per step."""
        if window not in self._decode_masks:
            slots = self.gather_slots()
            assert slots is not None and self.decode_seq_lens is not None
            max_len = slots.shape[1]
            k_pos = torch.arange(max_len, device=slots.device).unsqueeze(0)
            last = (self.decode_seq_lens - 1).unsqueeze(1)
            mask = k_pos <= last
            if window is not None:
                mask &= k_pos > last - window
            if bool(mask.all()):
                self._decode_masks[window] = None
            else:
                additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
                additive.masked_fill_(~mask, float("-inf"))
                self._decode_masks[window] = additive[:, None, None, :]
        return self._decode_masks[window]

    def ragged_decode(self) -> tuple[torch.Tensor, list[int]] | None:
        """The decodes' context slots without the padding, one sequence after another, and
        each one's length; None when the padding costs less than attending to each sequence
        on its own (one call each instead of one for the batch)."""
        if self._ragged is False:
            self._ragged = None
            slots, lens = self.gather_slots(), self.decode_seq_lens
            # On a GPU one batched call wins whatever the padding (and tolist() would sync).
            if (slots is not None and lens is not None and slots.shape[0] > 1
                    and slots.device.type == "cpu"):
                lengths = lens.tolist()
                padding = slots.shape[0] * slots.shape[1] - sum(lengths)
                if padding > RAGGED_MIN_PADDING_PER_ROW * len(lengths):
                    keep = torch.arange(slots.shape[1], device=slots.device) < lens[:, None]
                    self._ragged = (slots[keep], lengths)
        return self._ragged  # type: ignore[return-value]


# Padding rows (tokens per decoding sequence, on average) past which the CPU attends to
# each sequence on its own: one SDPA call costs about as much as reading this many keys.
RAGGED_MIN_PADDING_PER_ROW = 64


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor of a step's inputs on ``device``. To a GPU it goes from pinned memory,
    so the copy is queued behind the work already on the stream (a step in flight, with
    ``--async-scheduling``) rather than waiting for it, as a copy from pageable memory
    does."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def decode_slots_from_tables(tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
                             ) -> torch.Tensor:
    """The cache slot of every context position of each decoding sequence, [num_decodes,
    max_len], from its block table and length. Padding repeats the sequence's last real
    slot, never uninitialised memory (a NaN there would poison the masked softmax)."""
    positions = torch.arange(int(seq_lens.max()), device=tables.device).unsqueeze(0)
    k_pos = torch.minimum(positions, (seq_lens - 1).unsqueeze(1))
    return torch.gather(tables, 1, k_pos // block_size) * block_size + k_pos % block_size


def decode_block_tables(md: AttentionMetadata, block_size: int) -> torch.Tensor:
    """The decodes' block tables, from the slot lists the torch path reads (so the
    tensor-parallel wire carries one form only). A decode row's padding repeats its last
    real slot, so its padded table entries name a real block."""
    assert md.decode_slots is not None
    return md.decode_slots[:, ::block_size] // block_size


def add_block_tables(md: AttentionMetadata, block_size: int) -> None:
    """Fill the block-table fields the paged Triton kernels read, all int32."""
    if md.num_decode_tokens:
        assert md.decode_seq_lens is not None
        md.decode_block_tables = decode_block_tables(md, block_size).int()
        md.decode_lens_i32 = md.decode_seq_lens.int()
    if md.prefills:
        device = md.slot_mapping.device
        width = max(-(-(p.context_len + p.num_tokens) // block_size) for p in md.prefills)
        tables = torch.zeros(len(md.prefills), width, dtype=torch.int32, device=device)
        for i, p in enumerate(md.prefills):
            blocks = p.slots[::block_size] // block_size
            tables[i, : blocks.shape[0]] = blocks.int()
        first = md.prefills[0].token_start
        starts = [p.token_start - first for p in md.prefills]
        starts.append(starts[-1] + md.prefills[-1].num_tokens)
        md.prefill_block_tables = tables
        md.prefill_query_start_loc = upload(torch.tensor(starts, dtype=torch.int32), device)
        md.prefill_seq_lens = upload(
            torch.tensor([p.context_len + p.num_tokens for p in md.prefills],
                         dtype=torch.int32), device)
        md.max_prefill_len = max(p.num_tokens for p in md.prefills)


# Per thread: data-parallel replicas run their step loops side by side in one process.
_LOCAL = threading.local()


@contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    previous = getattr(_LOCAL, "context", None)
    _LOCAL.context = metadata
    try:
        yield
    finally:
        _LOCAL.context = previous


def get_forward_context() -> AttentionMetadata:
    context = getattr(_LOCAL, "context", None)
    if context is None:
        raise RuntimeError("attention ran outside set_forward_context().")
    return context

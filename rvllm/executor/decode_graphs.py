"""The decode step as CUDA graphs: the model forward and the LM head of a batch of
decoding sequences, captured per batch size at start-up and replayed each step.

Only the Triton path is captured: its attention reads block tables and sequence lengths
from fixed-size buffers and sizes its grids from their shapes, and no kernel in it waits
on the host. Each captured size reads the leading rows of static buffers:

    input_ids, positions, slot_mapping [max_bs]; seq_lens [max_bs] int32;
    block_tables [max_bs, ceil(max_model_len / block_size)] int32

Padding rows write their K/V to a scratch block past the ones the block manager hands
out (so no live slot is touched) and, with seq_len 0, read nothing. Sampling stays
outside the graph and is graph-safe itself (the greedy kernel syncs nothing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import nn

from rvllm.executor.cuda_graphs import CUDAGraphRunner, GraphInputs, capture_sizes
from rvllm.forward_context import AttentionMetadata, set_forward_context, upload

logger = logging.getLogger("rvllm")


def parse_capture_sizes(text: str | None, max_num_seqs: int) -> list[int]:
    """``--cuda-graph-sizes``: "1,2,4,8,16" as given, or None for 1, 2, 4, 8 and every 8
    up to ``max_num_seqs``; sizes above ``max_num_seqs`` are dropped."""
    if not text:
        return capture_sizes(max_num_seqs)
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(
            f"--cuda-graph-sizes must be comma-separated integers, got {text!r}.") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--cuda-graph-sizes must be positive integers, got {text!r}.")
    kept = [s for s in sizes if s <= max_num_seqs]
    return kept or [min(sizes[0], max_num_seqs)]


class DecodeGraphs:
    """Static buffers, one captured graph per batch size, and the replay of a step."""

    def __init__(self, model: nn.Module, device: torch.device, block_size: int,
                 num_blocks: int, max_model_len: int, sizes: Sequence[int]) -> None:
        self.model = model
        self.block_size = block_size
        self.scratch_slot = num_blocks * block_size  # the extra block allocated past the rest
        self.table_width = -(-max_model_len // block_size)
        max_bs = max(sizes)
        long, i32 = dict(dtype=torch.long, device=device), dict(dtype=torch.int32,
                                                                 device=device)
        buffers: GraphInputs = {
            "input_ids": torch.zeros(max_bs, **long),
            "positions": torch.zeros(max_bs, **long),
            "slot_mapping": torch.full((max_bs,), self.scratch_slot, **long),
            "seq_lens": torch.zeros(max_bs, **i32),
            "block_tables": torch.zeros(max_bs, self.table_width, **i32),
        }
        self.runner = CUDAGraphRunner(self._forward, buffers, sizes,
                                      pad_values={"slot_mapping": self.scratch_slot})

    @property
    def max_batch(self) -> int:
        return self.runner.sizes[-1]

    def _forward(self, inputs: GraphInputs) -> torch.Tensor:
        batch = inputs["input_ids"].shape[0]
        metadata = AttentionMetadata(
            slot_mapping=inputs["slot_mapping"], num_decode_tokens=batch, decode_slots=None,
            decode_seq_lens=None, prefills=[], decode_block_tables=inputs["block_tables"],
            decode_lens_i32=inputs["seq_lens"])
        with set_forward_context(metadata):
            hidden = self.model(inputs["input_ids"], inputs["positions"])
            return self.model.compute_logits(hidden)

    def capture(self) -> None:
        start = time.perf_counter()
        try:
            with torch.inference_mode():  # as every step runs: no autograd state captured
                self.runner.capture()
        except Exception as exc:
            raise RuntimeError(
                f"capturing the decode step as CUDA graphs failed ({type(exc).__name__}: "
                f"{exc}); this model may synchronise with the host during decode. Start "
                "with --enforce-eager to run without graphs.") from exc
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1fs",
                    self.runner.sizes, time.perf_counter() - start)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            seq_lens: list[int], tables: list[list[int]],
            feed: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """Logits [B, V] of one decode step (a view: use it before the next replay).
        ``feed``: (the step before's tokens on the device, for each row the one of them
        that is its input, or -1 where ``input_ids`` has it): the input is read there,
        and the host need not have it."""
        batch = len(input_ids)
        width = max(len(t) for t in tables)
        # Every input in one host tensor and one copy to the device, from pinned memory
        # so that the copy is queued behind the step in flight rather than waiting for
        # it; the block tables padded with block 0.
        flat = [*input_ids, *positions, *slots, *seq_lens, *(feed[1] if feed else ())]
        for row in tables:
            flat += row
            flat += [0] * (width - len(row))
        device = self.runner.buffers["input_ids"].device
        packed = upload(torch.tensor(flat, dtype=torch.long), device)
        parts = packed.split([batch] * (5 if feed else 4) + [batch * width])
        ids, pos, slot, lens, table = *parts[:4], parts[-1]
        if feed is not None:
            source = parts[4]
            fed = feed[0].index_select(0, source.clamp(min=0)).to(ids.dtype)
            ids = torch.where(source >= 0, fed, ids)
        inputs = {"input_ids": ids, "positions": pos, "slot_mapping": slot,
                  "seq_lens": lens, "block_tables": table.view(batch, width)}
        return self.runner.run(inputs)

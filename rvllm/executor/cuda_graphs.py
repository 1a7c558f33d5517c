"""CUDA graph capture and replay of the decode step.

A decode step launches hundreds of small kernels; replaying them as one graph
removes the per-launch CPU cost that dominates at small batch sizes. A graph
fixes its tensor addresses and shapes, so the runner keeps static input
buffers sized for the largest batch, captures the forward once per batch size
in ``capture_sizes``, and at run time copies the real inputs into the buffers,
pads the batch up to the next captured size and replays that graph.

The forward being captured must read its inputs only from the buffers it is
given (plus state that lives as long as the runner, such as the KV cache), do
no host synchronisation, and size its kernel grids from buffer shapes rather
than from values (the decode attention kernel sizes its split-KV grid from the
block-table width, so give it a table as wide as max_model_len needs). Padding
rows must be harmless: slot -1 writes no KV, seq_len 0 reads none.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

GraphInputs = dict[str, torch.Tensor]
GraphOutputs = torch.Tensor | tuple[torch.Tensor, ...]


def capture_sizes(max_num_seqs: int, step: int = 8) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then the multiples of ``step`` up to ``max_num_seqs``,
    which is always included so every batch the scheduler forms has a graph."""
    if max_num_seqs < 1 or step < 1:
        raise ValueError(f"max_num_seqs and step must be positive, got {max_num_seqs}, {step}.")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(step, max_num_seqs + 1, step))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` (sorted ``sizes``); None if
    the batch is larger than every captured size (run it eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def fill_static_inputs(buffers: GraphInputs, inputs: GraphInputs, padded_size: int,
                       pad_values: dict[str, float]) -> None:
    """Copy each input into the leading corner of its buffer and fill the rows up to
    ``padded_size`` with the buffer's pad value (0 unless given).

    Columns past a narrower input (e.g. a block table) keep stale values: the
    forward must not read them (seq_lens bound every read).
    """
    for name, buf in buffers.items():
        value = inputs[name]
        n = value.shape[0]
        buf[(slice(0, n), *(slice(0, s) for s in value.shape[1:]))].copy_(value,
                                                                          non_blocking=True)
        if padded_size > n:
            buf[n:padded_size].fill_(pad_values.get(name, 0))


class CUDAGraphRunner:
    """Captures ``forward`` for each batch size and replays the right graph per step.

    ``forward(inputs)`` takes a dict of batch-first tensors (views of the static
    buffers, sliced to the captured batch size) and returns a tensor or a tuple of
    batch-first tensors (hidden states, or sampled token ids when sampling is in
    the graph). ``buffers`` hold the largest size; ``pad_values`` give the value
    of padding rows per input (e.g. ``{"slot_mapping": -1}``).
    """

    def __init__(self, forward: Callable[[GraphInputs], GraphOutputs], buffers: GraphInputs,
                 sizes: Sequence[int], pad_values: dict[str, float] | None = None) -> None:
        self.forward = forward
        self.buffers = buffers
        self.sizes = sorted(sizes)
        self.pad_values = pad_values or {}
        for name, buf in buffers.items():
            if buf.shape[0] < self.sizes[-1]:
                raise ValueError(f"buffer {name!r} holds {buf.shape[0]} rows; the largest "
                                 f"capture size is {self.sizes[-1]}.")
        self._replays: dict[int, tuple[Callable[[], None], GraphOutputs]] = {}
        self._pool: tuple[int, int] | None = None  # memory pool shared by all sizes

    def padded_batch_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of ``num_seqs`` replays at; None = run eagerly."""
        return padded_batch_size(num_seqs, self.sizes)

    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool."""
        for size in reversed(self.sizes):
            inputs = {name: buf[:size] for name, buf in self.buffers.items()}
            for name, buf in inputs.items():
                buf.fill_(self.pad_values.get(name, 0))
            self._replays[size] = self._capture_one(inputs)

    def _capture_one(self, inputs: GraphInputs) -> tuple[Callable[[], None], GraphOutputs]:
        # One eager run first: Triton compiles and cuBLAS picks its kernels outside the
        # capture, where neither is allowed.
        self.forward(inputs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self.forward(inputs)
        self._pool = graph.pool()
        return graph.replay, outputs

    def run(self, inputs: GraphInputs) -> GraphOutputs:
        """Replay the graph for this batch; returns outputs sliced to the real batch size.

        The outputs are views of the graph's static outputs: use (or copy) them
        before the next replay.
        """
        num_seqs = next(iter(inputs.values())).shape[0]
        size = self.padded_batch_size(num_seqs)
        if size is None or size not in self._replays:
            raise ValueError(f"no CUDA graph captured for a batch of {num_seqs}; "
                             f"captured: {sorted(self._replays)}.")
        fill_static_inputs(self.buffers, inputs, size, self.pad_values)
        replay, outputs = self._replays[size]
        replay()
        if isinstance(outputs, torch.Tensor):
            return outputs[:num_seqs]
        return tuple(out[:num_seqs] for out in outputs)

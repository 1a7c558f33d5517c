"""The work an engine's start leaves for the time it has nothing to step: the linear
weights' packing (``EngineArgs.defer_weight_packing``; under load ``LLMEngine.step`` does
it a layer at a time instead), the torch modules ``rvllm.deferred_imports`` left out of
the process's start, and the memory of the cache blocks to be handed out next."""

from __future__ import annotations

import time

from torch import nn

from rvllm import deferred_imports
from rvllm.engine.block_manager import BlockManager
from rvllm.executor.model_runner import ModelRunner
from rvllm.layers.cpu_linear import has_pending_reorders, reorder_pending

# How long an engine must have had nothing to step before it does its deferred work.
IDLE_WORK_AFTER_S = 0.25
# Idle work keeps the CPU cache memory of this many bytes of the blocks to be handed out
# next faulted in (``ModelRunner.populate_kv_cache``), this many at a time.
KV_POPULATE_AHEAD_BYTES = 64 << 20
KV_POPULATE_CHUNK_BYTES = 1 << 20


class IdleWork:
    """One engine's deferred work, done a slice at a time between its steps."""

    def __init__(self, model: nn.Module, runner: ModelRunner, block_manager: BlockManager,
                 kv_block_bytes: int) -> None:
        self.model = model
        self.runner = runner
        self.block_manager = block_manager
        self.kv_block_bytes = kv_block_bytes  # 0: no cache memory to fault in (a GPU's)
        # Cache blocks [0, kv_populated_to) have their memory (idle work, or their use).
        self.kv_populated_to = 0
        self._last_step = time.monotonic()

    def stepped(self) -> None:
        """The engine has just stepped."""
        self._last_step = time.monotonic()

    def pending(self) -> bool:
        """Whether ``run`` has something to do."""
        return (has_pending_reorders(self.model) or deferred_imports.has_deferred()
                or self._kv_blocks_to_populate()[1] > 0)

    def due_in(self) -> float:
        """Seconds until a loop with nothing to step should call ``run``: not before the
        engine has stepped nothing for ``IDLE_WORK_AFTER_S``. A client that sends its
        first request as the server comes up then finds the engine free, not in a layer's
        packing (the first took 60-100 ms); so does the next request of a busy client."""
        return max(0.0, self._last_step + IDLE_WORK_AFTER_S - time.monotonic())

    def run(self, seconds: float) -> None:
        """About ``seconds`` of it: the linear weights' packing, then one of the deferred
        torch modules (0.05-0.15 s each), then the next fresh cache blocks' memory."""
        if has_pending_reorders(self.model):
            reorder_pending(self.model, seconds=seconds)
        elif deferred_imports.has_deferred():
            deferred_imports.import_next()
        else:
            self._populate_kv_cache(seconds)

    def _kv_blocks_to_populate(self) -> tuple[int, int]:
        """The first and the count of the next fresh cache blocks (``BlockManager.fresh_from``
        on: those the free queue hands out first) not yet faulted in, up to
        ``KV_POPULATE_AHEAD_BYTES`` of them (a CPU cache only; a count of 0: none)."""
        if self.kv_block_bytes <= 0:
            return 0, 0
        bm = self.block_manager
        ahead = max(1, KV_POPULATE_AHEAD_BYTES // self.kv_block_bytes)
        first = max(self.kv_populated_to, bm.fresh_from)
        return first, max(0, min(bm.num_blocks, bm.fresh_from + ahead) - first)

    def _populate_kv_cache(self, seconds: float) -> None:
        """Fault in the memory of the next fresh cache blocks for about ``seconds``. On a
        virtual machine whose host takes back free memory, a block's first writes inside
        an N=1 decode step cost it 2-11 ms every fifth or sixth token (SmolLM2: 60 fresh
        pages at once, every layer's keys and values), 2-6% of the decode's time."""
        deadline = time.perf_counter() + seconds
        chunk = max(1, KV_POPULATE_CHUNK_BYTES // self.kv_block_bytes)
        while True:
            first, count = self._kv_blocks_to_populate()
            if count == 0:
                return
            count = min(chunk, count)
            if not self.runner.populate_kv_cache(first, count):
                self.kv_block_bytes = 0  # not on this system: nothing more to try
                return
            self.kv_populated_to = first + count
            if time.perf_counter() >= deadline:
                return

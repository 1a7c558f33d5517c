"""The JAX backend's model runner: the engine's ``ModelRunner`` interface (``execute``,
``allocate_kv_cache``, ...) over the jitted step of ``rvllm.jax.model``. The scheduler,
block manager, sampler and server are the torch backend's, unchanged: each step's
scheduled sequences become padded numpy arrays, the step runs on the JAX device, and the
logits come back through numpy as a torch tensor for the engine's sampler.

Every step is padded to a bucket: a power of two of tokens (at least
``MIN_TOKEN_BUCKET``, at most the first power of two at or above
``max_num_batched_tokens``; a step of decodes alone, fewer than that, to its sequence
bucket) and of sequences (up to ``max_num_seqs``'s). Allocating the cache compiles every
such pair, so serving compiles nothing; only a step that needs more logits rows than it
has sequences (prompt logprobs) compiles its shape when first met."""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import numpy as np
import torch

from rvllm.config import ModelConfig, SchedulerConfig
from rvllm.engine.scheduler import ScheduledSeq, SchedulerOutput
from rvllm.executor.model_runner import ModelRunner, SeqStepOutput, _plan_logits
from rvllm.jax import cache as kv_cache
from rvllm.jax.model import compile_count, jitted_step
from rvllm.jax.weights import DTYPES, load_weights

logger = logging.getLogger("rvllm")

# The fewest tokens a step with a prefill is padded to. A step of decodes alone (a token
# per sequence) below it is padded to its sequence bucket instead: one decoding sequence
# runs a one-token step.
MIN_TOKEN_BUCKET = 8


def power_buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from ``smallest`` up to the first at or above ``largest``."""
    sizes = [smallest]
    while sizes[-1] < largest:
        sizes.append(sizes[-1] * 2)
    return sizes


def bucket(n: int, smallest: int = 1) -> int:
    """The power of two at or above ``n`` (and ``smallest``)."""
    return max(smallest, 1 << max(0, n - 1).bit_length())


def jax_device(device: torch.device) -> jax.Device:
    """The JAX device of the engine's ``--device``: the CPU, or the CUDA GPU of that index."""
    platform = {"cpu": "cpu", "cuda": "gpu"}.get(device.type)
    if platform is None:
        raise ValueError(f"--model-impl jax runs on the CPU or a CUDA GPU, not {device}.")
    try:
        devices = jax.devices(platform)
    except RuntimeError as e:
        raise ValueError(f"--model-impl jax on {device}: this JAX has no {platform} backend "
                         "(for a GPU install jax[cuda12]).") from e
    return devices[device.index or 0]


class JaxModelRunner(ModelRunner):
    """Runs each scheduled step as the jitted JAX step and samples it with the engine's
    sampler. ``compile_buckets`` (called by ``allocate_kv_cache``) compiles every step
    shape the engine's limits allow."""

    def __init__(self, model_config: ModelConfig, scheduler_config: SchedulerConfig,
                 block_size: int, device: torch.device, progress: bool = False) -> None:
        super().__init__(None, block_size, device)  # type: ignore[arg-type]  # no torch model
        self.jax_device = jax_device(device)
        start = time.perf_counter()
        self.spec, self.weights = load_weights(model_config, self.jax_device, progress)
        self.load_seconds = time.perf_counter() - start
        self.table_width = -(-model_config.max_model_len // block_size)
        self.token_buckets = power_buckets(MIN_TOKEN_BUCKET,
                                           scheduler_config.max_num_batched_tokens)
        self.seq_buckets = power_buckets(1, scheduler_config.max_num_seqs)
        self.caches: list[kv_cache.KVCache] | None = None
        self.num_blocks = 0
        self.compile_seconds = 0.0
        # Process-wide compilation count after the buckets' warm-up (``compile_count``).
        self.compiles_after_warm_up: int | None = None

    # -- the cache ---------------------------------------------------------------------

    def allocate_kv_cache(self, num_blocks: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype, compile_buckets: bool = True) -> None:
        """The paged cache of every stack (``rvllm.jax.cache``), then (unless told not
        to) every bucket's step compiled. ``num_kv_heads`` and ``head_dim`` are the
        engine's; the stacks' own shapes are used."""
        if dtype not in DTYPES:
            raise ValueError(f"--model-impl jax stores the KV cache as float32, bfloat16 or "
                             f"float16, not {dtype}.")
        self.caches = kv_cache.allocate(self.spec, num_blocks, self.block_size, DTYPES[dtype],
                                        self.jax_device)
        self.num_blocks = num_blocks
        if compile_buckets:
            self.compile_buckets()

    def kv_cache_block_bytes(self) -> int:
        return kv_cache.block_bytes(self.caches) if self.caches else 0

    def populate_kv_cache(self, first: int, count: int) -> bool:
        return False  # JAX's zeroed cache has its memory from the start

    def profile_run(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("--model-impl jax does not profile the GPU's memory; give the cache "
                         "size with --num-gpu-blocks.")

    def allocate_swap_space(self, num_cpu_blocks: int) -> None:
        raise ValueError("--model-impl jax preempts by recompute only; leave "
                         "--num-cpu-blocks at 0.")

    def swap(self, blocks_to_swap_out: list[tuple[int, int]],
             blocks_to_swap_in: list[tuple[int, int]]) -> None:
        raise ValueError("--model-impl jax preempts by recompute only.")

    # -- compilation -------------------------------------------------------------------

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """Every (tokens, sequences) bucket pair a step can fall in."""
        decodes = [(s, s) for s in self.seq_buckets if s < MIN_TOKEN_BUCKET]
        return decodes + [(t, s) for t in self.token_buckets for s in self.seq_buckets
                          if s <= t]

    def compile_buckets(self) -> None:
        """Run the step once at every bucket shape with padding alone (no cache write, no
        attention), so each shape is compiled before the first request."""
        start = time.perf_counter()
        shapes = self.bucket_shapes()
        for tokens, seqs in shapes:
            logits = self._run(*self._padding(tokens, seqs, seqs))
        logits.block_until_ready()
        self.compile_seconds = time.perf_counter() - start
        self.compiles_after_warm_up = compile_count()
        logger.info("JAX step compiled for %d bucket shapes (tokens %s, sequences %s) in "
                    "%.1fs on %s", len(shapes), self.token_buckets,
                    self.seq_buckets, self.compile_seconds, self.jax_device)

    def step_args(self, tokens: int, seqs: int, rows: int | None = None) -> tuple[Any, ...]:
        """The step's arguments for a padding-only step of this shape (for inspecting its
        compilation: ``jitted_step.lower(*runner.step_args(...), spec=runner.spec)``)."""
        return (self.weights, self.caches, *self._padding(tokens, seqs, rows or seqs))

    def _padding(self, tokens: int, seqs: int, rows: int) -> tuple[np.ndarray, ...]:
        return (np.zeros(tokens, np.int32), np.zeros(tokens, np.int32),
                np.full(tokens, self.num_blocks * self.block_size, np.int32),
                np.zeros(seqs + 1, np.int32), np.zeros(seqs, np.int32),
                np.zeros((seqs, self.table_width), np.int32), np.zeros(rows, np.int32))

    def _run(self, *inputs: np.ndarray) -> jax.Array:
        """One step over the cache (donated, and replaced by the step's updated one)."""
        logits, self.caches = jitted_step(self.weights, self.caches, *inputs, spec=self.spec)
        return logits

    # -- a step ------------------------------------------------------------------------

    def execute(self, sched: SchedulerOutput) -> list[SeqStepOutput]:
        if sched.blocks_to_swap_out or sched.blocks_to_swap_in:
            raise ValueError("--model-impl jax preempts by recompute only.")
        decodes = [s for s in sched.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in sched.scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        plan = _plan_logits(ordered)
        logits = self._run(*self._prepare(ordered, plan.rows))
        if not plan.rows:
            return self._sample(ordered, plan, None)
        host = np.array(logits)[:len(plan.rows)]  # a writable copy, for torch
        with torch.inference_mode():
            return self._sample(ordered, plan, torch.from_numpy(host).to(self.device))

    def _prepare(self, ordered: list[ScheduledSeq], logit_rows: list[int]
                 ) -> tuple[np.ndarray, ...]:
        """The step's padded inputs (``rvllm.jax.model``) from the scheduled sequences."""
        bs, width = self.block_size, self.table_width
        num_tokens = sum(s.num_new_tokens for s in ordered)
        seqs = bucket(len(ordered))
        decodes_alone = num_tokens == len(ordered) and seqs < MIN_TOKEN_BUCKET
        tokens = seqs if decodes_alone else bucket(num_tokens, MIN_TOKEN_BUCKET)
        rows = max(seqs, bucket(len(logit_rows)))
        ids, pos, slots, query_start, seq_lens, tables, row_ids = self._padding(tokens, seqs,
                                                                                rows)
        start = 0
        for i, s in enumerate(ordered):
            seq, n = s.seq, s.num_new_tokens
            ctx = seq.num_computed_tokens
            table = np.asarray(seq.block_table[:width], np.int32)
            positions = np.arange(ctx, ctx + n, dtype=np.int32)
            ids[start:start + n] = seq.token_ids[ctx:ctx + n]
            pos[start:start + n] = positions
            slots[start:start + n] = table[positions // bs] * bs + positions % bs
            tables[i, :len(table)] = table
            seq_lens[i] = ctx + n
            start += n
            query_start[i + 1] = start
        query_start[len(ordered) + 1:] = start
        row_ids[:len(logit_rows)] = logit_rows
        return ids, pos, slots, query_start, seq_lens, tables, row_ids

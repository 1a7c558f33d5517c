"""The JAX backend's model runner: the engine's ``ModelRunner`` interface (``execute``,
``allocate_kv_cache``, ...) over the jitted step of ``rvllm.jax.model``. The scheduler,
block manager, sampler and server are the torch backend's, unchanged: each step's
scheduled sequences become padded numpy arrays and the step runs on the JAX device. When
each sampling row asks for nothing more than greedy, temperature, top-k, top-p, min-p and
a seed (``device_samples``), the rows are sampled on the device too
(``rvllm.jax.model.sample``) and only the tokens and their logprobs come back; otherwise
the logits come back through numpy as a torch tensor for the engine's sampler. A step
the scheduler lets run several decode steps ahead (``--num-scheduler-steps``), of plain
greedy decodes alone, runs them in one call (``rvllm.jax.model.greedy_steps``).

With ``tensor_parallel_size`` N above 1 the runner builds a mesh of N devices
(``rvllm.jax.sharding``), places the weights on it Megatron-style and the cache split by
KV head, and runs the same step functions jitted for the mesh (the caches coming back
with the shardings they came in with, so they stay donated); each step's inputs are
replicated, and its logits come back replicated, sampled as on one device.

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
from rvllm.engine.sequence import Sequence
from rvllm.executor.model_runner import ModelRunner, SeqStepOutput, _LogitsPlan, _plan_logits
from rvllm.jax import cache as kv_cache
from rvllm.jax import model as jax_model
from rvllm.jax import sharding
from rvllm.jax.model import compile_count, jitted_greedy_steps, jitted_sample, jitted_step
from rvllm.jax.weights import DTYPES, check_supported, load_weights, model_spec
from rvllm.layers.sampler import plain_greedy

logger = logging.getLogger("rvllm")

# The fewest tokens a step with a prefill is padded to. A step of decodes alone (a token
# per sequence) below it is padded to its sequence bucket instead: one decoding sequence
# runs a one-token step.
MIN_TOKEN_BUCKET = 8
# The width the multi-step decode's stop tokens are padded to (with -1): a step whose
# sequences have more stop tokens each pads to the next power of two, compiled when first
# met.
STOP_TOKEN_WIDTH = 8


def power_buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from ``smallest`` up to the first at or above ``largest``."""
    sizes = [smallest]
    while sizes[-1] < largest:
        sizes.append(sizes[-1] * 2)
    return sizes


def bucket(n: int, smallest: int = 1) -> int:
    """The power of two at or above ``n`` (and ``smallest``)."""
    return max(smallest, 1 << max(0, n - 1).bit_length())


def device_samples(seq: Sequence) -> bool:
    """Whether the step's own sampling (``rvllm.jax.model.sample``) draws this sequence's
    next token as the engine's sampler would: nothing but greedy, temperature, top-k,
    top-p, min-p and a seed asked of it (no logprobs, logit bias, penalties, min_tokens
    still to come, or grammar)."""
    params = seq.params
    return (params.logprobs is None and not params.edits_logits and not params.needs_penalties
            and seq.num_output_tokens >= params.min_tokens
            and params.structured_outputs is None and seq.grammar is None)


def jax_platform(device: torch.device, platform: str | None = None) -> str:
    """JAX's platform to run on: ``--jax-platform`` (cpu, gpu, tpu), else the one of the
    engine's ``--device``."""
    platform = platform or {"cpu": "cpu", "cuda": "gpu"}.get(device.type)
    if platform is None:
        raise ValueError(f"--model-impl jax runs on the CPU, a GPU or a TPU, not {device}.")
    return platform


def jax_device(device: torch.device, platform: str | None = None) -> jax.Device:
    """The JAX device to run on: ``platform``'s first (``--jax-platform``: cpu, gpu, tpu),
    else the one of the engine's ``--device``: the CPU, or the CUDA GPU of that index."""
    index = 0 if platform is not None else device.index or 0
    platform = jax_platform(device, platform)
    try:
        devices = jax.devices(platform)
    except RuntimeError as e:
        raise ValueError(f"--model-impl jax on the {platform}: this JAX has no {platform} "
                         "backend (for a GPU install jax[cuda12], for a TPU jax[tpu]).") from e
    return devices[index]


class JaxModelRunner(ModelRunner):
    """Runs each scheduled step as the jitted JAX step and samples it with the engine's
    sampler. ``compile_buckets`` (called by ``allocate_kv_cache``) compiles every step
    shape the engine's limits allow. With ``tensor_parallel_size`` above 1 the model runs
    over a mesh of that many devices (``mesh``; ``rvllm.jax.sharding``)."""

    def __init__(self, model_config: ModelConfig, scheduler_config: SchedulerConfig,
                 block_size: int, device: torch.device, progress: bool = False,
                 layout: str = "blocks", platform: str | None = None,
                 tensor_parallel_size: int = 1, quantization: str | None = None) -> None:
        super().__init__(None, block_size, device)  # type: ignore[arg-type]  # no torch model
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got "
                             f"{tensor_parallel_size}.")
        self.tensor_parallel_size = tensor_parallel_size
        self.mesh: jax.sharding.Mesh | None = None
        start = time.perf_counter()
        if tensor_parallel_size > 1:
            # Refused before anything loads: too few devices, KV heads that do not divide.
            self.mesh = sharding.make_mesh(tensor_parallel_size,
                                           jax_platform(device, platform))
            check_supported(model_config)
            sharding.check_divisible(model_spec(model_config, layout), tensor_parallel_size)
            self.jax_device = self.mesh.devices.flat[0]
            # Read onto the host, then each device takes its shards.
            load_device = jax.devices("cpu")[0]
        else:
            self.jax_device = load_device = jax_device(device, platform)
        # ``layout``: how the layers are scanned (``rvllm.jax.weights.LAYOUTS``);
        # ``quantization``: int8 or int4 linear weights (``rvllm.jax.quant``), or None.
        self.spec, self.weights = load_weights(model_config, load_device, progress, layout,
                                               quantization)
        if self.mesh is None:
            # The process's jitted functions: engines of the same shapes share compilations.
            self.step_fn, self.greedy_steps_fn = jitted_step, jitted_greedy_steps
        else:
            self.weights = sharding.shard_weights(self.weights, self.mesh)
            self.step_fn = sharding.jit_sharded(jax_model.step, self.spec, self.mesh, 2)
            self.greedy_steps_fn = sharding.jit_sharded(jax_model.greedy_steps, self.spec,
                                                        self.mesh, 4, ("spec", "max_steps"))
        self.load_seconds = time.perf_counter() - start
        self.table_width = -(-model_config.max_model_len // block_size)
        self.token_buckets = power_buckets(MIN_TOKEN_BUCKET,
                                           scheduler_config.max_num_batched_tokens)
        self.seq_buckets = power_buckets(1, scheduler_config.max_num_seqs)
        # Greedy decode steps one call may run (``--num-scheduler-steps``).
        self.max_steps = scheduler_config.num_scheduler_steps
        self.caches: list[kv_cache.KVCache] | None = None
        self.num_blocks = 0
        self.compile_seconds = 0.0
        # Process-wide compilation count after the buckets' warm-up (``compile_count``).
        self.compiles_after_warm_up: int | None = None
        # The keys of unseeded rows' draws.
        self.rng = np.random.default_rng()
        # Steps whose tokens were sampled on the device, and those the engine's sampler
        # sampled from the step's logits.
        self.device_sampled_steps = 0
        self.host_sampled_steps = 0
        # Calls of the multi-step greedy decode, and the decode steps they ran.
        self.multi_step_calls = 0
        self.multi_step_steps = 0

    # -- the cache ---------------------------------------------------------------------

    def allocate_kv_cache(self, num_blocks: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype, compile_buckets: bool = True) -> None:
        """The paged cache of every stack (``rvllm.jax.cache``), then (unless told not
        to) every bucket's step compiled. ``num_kv_heads`` and ``head_dim`` are the
        engine's; the stacks' own shapes are used."""
        if dtype not in DTYPES:
            raise ValueError(f"--model-impl jax stores the KV cache as float32, bfloat16 or "
                             f"float16, not {dtype}.")
        self.caches = kv_cache.allocate(
            self.spec, num_blocks, self.block_size, DTYPES[dtype],
            self.jax_device if self.mesh is None else sharding.cache_sharding(self.mesh))
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
        for rows in self.seq_buckets:  # the device's sampling of each row count
            # Placed as the step's logits are (replicated over a mesh): the same
            # compilation serves them.
            zeros = self._put(np.zeros((rows, self.spec.vocab_size), np.float32))
            sampled, _ = jitted_sample(zeros, *self._sampling_padding(rows))
            if self.max_steps > 1:  # the multi-step decode, of padding alone: no step runs
                self._run_greedy_steps(np.zeros(rows, np.int32), np.zeros(rows, np.int32),
                                       np.zeros((rows, self.table_width), np.int32), 0, 1,
                                       np.full((rows, STOP_TOKEN_WIDTH), -1, np.int32))
        logits.block_until_ready()
        sampled.block_until_ready()
        self.compile_seconds = time.perf_counter() - start
        self.compiles_after_warm_up = compile_count()
        logger.info("JAX step compiled for %d bucket shapes (tokens %s, sequences %s) in "
                    "%.1fs on %s", len(shapes), self.token_buckets,
                    self.seq_buckets, self.compile_seconds,
                    self.jax_device if self.mesh is None else
                    f"{self.tensor_parallel_size} devices ({self.mesh.devices.flat[0]}, ...)")

    def step_args(self, tokens: int, seqs: int, rows: int | None = None) -> tuple[Any, ...]:
        """The step's arguments for a padding-only step of this shape (for inspecting its
        compilation: ``runner.step_fn.lower(*runner.step_args(...), spec=runner.spec)``)."""
        return (self.weights, self.caches, *self._put(self._padding(tokens, seqs, rows or seqs)))

    def _put(self, arrays: Any) -> Any:
        """Host arrays as a step's inputs: replicated over the mesh (as they are, on one
        device: the jitted call places them)."""
        if self.mesh is None:
            return arrays
        return jax.device_put(arrays, sharding.replicated(self.mesh))

    def _padding(self, tokens: int, seqs: int, rows: int) -> tuple[np.ndarray, ...]:
        return (np.zeros(tokens, np.int32), np.zeros(tokens, np.int32),
                np.full(tokens, self.num_blocks * self.block_size, np.int32),
                np.zeros(seqs + 1, np.int32), np.zeros(seqs, np.int32),
                np.zeros((seqs, self.table_width), np.int32), np.zeros(rows, np.int32))

    @staticmethod
    def _sampling_padding(rows: int) -> tuple[np.ndarray, ...]:
        """Greedy rows: temperature, top_k, top_p, min_p, seeds, counters."""
        return (np.zeros(rows, np.float32), np.zeros(rows, np.int32),
                np.ones(rows, np.float32), np.zeros(rows, np.float32),
                np.zeros((rows, 2), np.uint32), np.zeros(rows, np.uint32))

    def _run_greedy_steps(self, ids: np.ndarray, pos: np.ndarray, tables: np.ndarray,
                          num_seqs: int, num_steps: int, stops: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray]:
        """The multi-step greedy decode (``rvllm.jax.model.greedy_steps``) over the cache
        (donated, and replaced): the tokens and logprobs [steps taken, S]."""
        inputs = self._put((ids, pos, tables, np.int32(num_seqs), np.int32(num_steps), stops))
        tokens, logprobs, taken, self.caches = self.greedy_steps_fn(
            self.weights, self.caches, *inputs, spec=self.spec, max_steps=self.max_steps)
        taken = int(taken)
        return np.asarray(tokens)[:taken], np.asarray(logprobs)[:taken]

    def _run(self, *inputs: np.ndarray) -> jax.Array:
        """One step over the cache (donated, and replaced by the step's updated one)."""
        logits, self.caches = self.step_fn(self.weights, self.caches, *self._put(inputs),
                                           spec=self.spec)
        return logits

    # -- a step ------------------------------------------------------------------------

    def execute(self, sched: SchedulerOutput) -> list[SeqStepOutput]:
        if sched.blocks_to_swap_out or sched.blocks_to_swap_in:
            raise ValueError("--model-impl jax preempts by recompute only.")
        decodes = [s for s in sched.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in sched.scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        plan = _plan_logits(ordered)
        if (sched.num_steps > 1 and not prefills and not plan.prompt and not plan.spec
                and plan.rows == list(range(len(decodes)))
                and all(plain_greedy(s.seq.params, s.seq.num_output_tokens) for s in decodes)):
            return self._greedy_steps(decodes, sched.num_steps)
        on_device = not plan.prompt and not plan.spec and all(
            device_samples(ordered[i].seq) for i in plan.sampling)
        inputs = self._prepare(ordered, plan.rows)
        logits = self._run(*inputs)
        if not plan.rows:
            return self._sample(ordered, plan, None)
        if on_device:
            tokens, logprobs = jitted_sample(
                logits, *self._sampling_inputs(ordered, plan, logits.shape[0]))
            self.device_sampled_steps += 1
            outputs = [SeqStepOutput(s.seq, s.num_new_tokens) for s in ordered]
            found = zip(np.asarray(tokens).tolist(), np.asarray(logprobs).tolist())
            for i, (token_id, logprob) in zip(plan.sampling, found):
                outputs[i].token_id, outputs[i].logprob = token_id, logprob
            return outputs
        self.host_sampled_steps += 1
        host = np.array(logits)[:len(plan.rows)]  # a writable copy, for torch
        with torch.inference_mode():
            return self._sample(ordered, plan, torch.from_numpy(host).to(self.device))

    def _greedy_steps(self, decodes: list[ScheduledSeq], num_steps: int
                      ) -> list[SeqStepOutput]:
        """Up to ``num_steps`` decode steps of plain greedy sequences in one call, each
        step's tokens the next one's input; the call stops early once every sequence has
        made one of its stop tokens (EOS or ``stop_token_ids``). Each output has the first
        step's token, and ``later_tokens`` the rest: the engine drops those after a
        sequence finishes. The scheduler gave each sequence the blocks of every step."""
        width, count = self.table_width, len(decodes)
        seqs = bucket(count)
        stop_sets = [s.seq.params.eos_token_ids.union(s.seq.params.stop_token_ids)
                     for s in decodes]
        stops = np.full((seqs, bucket(max(map(len, stop_sets)), STOP_TOKEN_WIDTH)), -1,
                        np.int32)
        ids, pos = np.zeros(seqs, np.int32), np.zeros(seqs, np.int32)
        tables = np.zeros((seqs, width), np.int32)
        for i, (s, stop) in enumerate(zip(decodes, stop_sets)):
            seq = s.seq
            ctx = seq.num_computed_tokens
            table = seq.block_table[:width]
            ids[i], pos[i] = seq.token_ids[ctx], ctx
            tables[i, :len(table)] = table
            stops[i, :len(stop)] = sorted(stop)
        tokens, logprobs = self._run_greedy_steps(ids, pos, tables, count, num_steps, stops)
        self.multi_step_calls += 1
        self.multi_step_steps += len(tokens)
        outputs = []
        for i, s in enumerate(decodes):
            out = SeqStepOutput(s.seq, 1, int(tokens[0, i]), float(logprobs[0, i]))
            out.later_tokens = tuple((int(t), float(lp)) for t, lp in
                                     zip(tokens[1:, i], logprobs[1:, i]))
            outputs.append(out)
        return outputs

    def _sampling_inputs(self, ordered: list[ScheduledSeq], plan: _LogitsPlan, rows: int
                         ) -> tuple[np.ndarray, ...]:
        """The sampling rows' parameters for the step's ``sample``: a seeded sequence's
        key is its seed (that of its generator: the request's seed plus its index among
        the request's samples) with its output count, an unseeded one's a fresh draw."""
        temperature, top_k, top_p, min_p, seeds, counters = self._sampling_padding(rows)
        for row, i in enumerate(plan.sampling):
            seq = ordered[i].seq
            params = seq.params
            if params.is_greedy:
                continue
            temperature[row], top_k[row] = params.temperature, max(params.top_k, 0)
            top_p[row], min_p[row] = params.top_p, params.min_p
            if seq.generator is not None:
                seed = seq.generator.initial_seed()
                seeds[row] = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
                counters[row] = seq.num_output_tokens
            else:
                seeds[row] = self.rng.integers(0, 2**32, 2, dtype=np.uint32)
        return temperature, top_k, top_p, min_p, seeds, counters

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

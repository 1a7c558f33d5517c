"""The synchronous engine: requests in, one batched forward pass per ``step``, outputs out."""

from __future__ import annotations

import itertools
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from rvllm.config import (
    CacheConfig,
    EngineArgs,
    ModelConfig,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from rvllm.deferred_imports import import_for_generators
from rvllm.engine.async_steps import (
    PLACEHOLDER,
    StepInFlight,
    StepWorker,
    strip_placeholders,
)
from rvllm.engine.block_manager import BlockManager
from rvllm.engine.engine_startup import (
    NoTorchModel,
    check_async_scheduling,
    check_jax_backend,
    check_lora,
    check_packed_activations,
    check_pooling,
    check_scheduler_steps,
    check_speculative,
    preemption_mode,
    report_fused_decode_gemv,
    resolve_quantization,
    scheduler_config,
    select_kernels,
    start_drafter,
    start_jax_runner,
    start_tensor_parallel,
)
from rvllm.engine.idle_work import IdleWork
from rvllm.engine.request import Request, logprob_entry, make_output
from rvllm.engine.scheduler import Scheduler, SchedulerOutput
from rvllm.engine.sequence import Sequence, SequenceStatus
from rvllm.engine.stop import check_stop
from rvllm.executor.device_tokens import resolve_outputs
from rvllm.executor.kv_cache import determine_num_blocks
from rvllm.executor.model_runner import ModelRunner, SeqStepOutput
from rvllm.generation_config import log_defaults
from rvllm.inputs import PromptType
from rvllm.layers.cpu_linear import (
    PACKED_QUANTIZATIONS,
    PENDING_GEMM_MAX_ROWS,
    finish_linear_weights,
    reorder_pending,
    set_packed_activations,
)
from rvllm.malloc import release_freed_memory
from rvllm.models.loader import load_model
from rvllm.outputs import RequestMetrics, RequestOutput
from rvllm.pooling_params import PoolerConfig, PoolingParams, matryoshka_dimensions
from rvllm.sampling_params import SamplingParams
from rvllm.spec_decode.speculator import SpecDecodeStats, Speculator
from rvllm.structured_output import StructuredOutputManager
from rvllm.structured_output.gate import GatedMatcher
from rvllm.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

logger = logging.getLogger("rvllm")


# A refused prompt this long (characters or token ids) has its memory returned to the
# system (malloc_trim): glibc keeps large freed arenas otherwise.
_TRIM_AFTER_PROMPT_LEN = 100_000

# How long a failed collective waits for a tensor-parallel worker's exit to be reported
# before the failure is taken for something other than a dead worker.
_WORKER_EXIT_GRACE_S = 5.0


class LLMEngine:
    """Holds the model, the KV cache, the scheduler and every live request."""

    def __init__(self, args: EngineArgs) -> None:
        start = time.perf_counter()
        if args.seed is not None:
            torch.manual_seed(args.seed)
        self.args = args
        self.device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, self.device)
        kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, self.device)
        # Seconds per start-up phase, for the benchmarks' reports.
        self.startup_phases: dict[str, float] = {}
        phase = time.perf_counter()
        # The numba kernels load from numba's cache on a thread of their own meanwhile.
        # What --quantization runs as (a quantized GGUF file: its blocks, packed).
        self.quantization = resolve_quantization(args.quantization, args.resolve_model(),
                                                 self.device, dtype,
                                                 args.tensor_parallel_size, args.load_format,
                                                 args.model_impl)
        packed = self.quantization in PACKED_QUANTIZATIONS and args.model_impl != "jax"
        # What packed weights multiply (--packed-activations); None where none run packed.
        self.packed_activations = args.packed_activations if packed else None
        self.kernel_backend, warming = select_kernels(
            args.kernel_backend, self.device, dtype, kv_dtype,
            self.quantization == "int8" and args.model_impl != "jax",
            args.num_scheduler_steps > 1, packed, self.quantization, args.fused_decode_gemv)
        check_scheduler_steps(args, self.kernel_backend)
        check_speculative(args)
        check_pooling(args)
        check_lora(args)
        check_async_scheduling(args)
        check_packed_activations(args, self.quantization, packed)
        if args.model_impl == "jax":  # before the weights load
            check_jax_backend(args, self.device, kv_dtype, self.quantization)
        self.startup_phases["kernels"] = time.perf_counter() - phase
        self.model_config = ModelConfig.from_path(args.resolve_model(), dtype, args.max_model_len)
        # generate (text), or pooling (embeddings, with this pooler).
        self.runner_type = args.runner_type()
        self.pooler = (PoolerConfig.resolve(self.model_config.path, args.pooler_config)
                       if self.runner_type == "pooling" else None)
        # What requests that leave a sampling field unset get (--generation-config).
        self.sampling_defaults = args.sampling_defaults()
        log_defaults(self.sampling_defaults)
        self.tokenizer: Tokenizer | None = None
        self.cache_config = CacheConfig(
            block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks,
            kv_cache_memory_gb=args.kv_cache_memory,
            cache_dtype=kv_dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            gpu_memory_reserve_gb=args.gpu_memory_reserve_gb,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        self.scheduler_config = scheduler_config(args, self.model_config.max_model_len)
        # One GPU, no block count given: size the cache from a profiling pass after loading.
        # Otherwise size it now: tensor-parallel workers need the count to start loading.
        profile = (self.device.type == "cuda" and args.num_gpu_blocks is None
                   and args.tensor_parallel_size == 1)
        num_blocks = 0
        if not profile:
            num_blocks = determine_num_blocks(self.model_config, self.cache_config,
                                              self.scheduler_config, self.device,
                                              tensor_parallel_size=args.tensor_parallel_size)
            self._check_capacity(num_blocks)
        # Under --model-impl jax no torch workers start: the JAX runner shards the model
        # over a mesh of JAX's devices in this process (rvllm.jax.sharding).
        self.tp_group = (None if args.model_impl == "jax" else
                         start_tensor_parallel(args, self.model_config, num_blocks, self.device))
        try:
            # fbgemm's packing of the linear weights (--quantization) goes on on threads
            # outside the GIL while the tokenizer loads: SmolLM2 int8's engine start
            # 1.9-2.6 s before, 1.9-2.2 s after.
            if args.model_impl == "jax":
                # The JAX runner reads the checkpoint into arrays of its own.
                self.model = NoTorchModel()
            else:
                self.model = load_model(self.model_config, self.device,
                                        progress=args.show_progress,
                                        load_format=args.load_format,
                                        cpu_linear_backend=args.cpu_linear_backend,
                                        quantization=self.quantization, wait_packing=False,
                                        defer_reorders=args.defer_weight_packing)
            if not args.skip_tokenizer_init:
                self.tokenizer = load_tokenizer(self.model_config.path,
                                                self.model_config.gguf_file, args.tokenizer,
                                                args.chat_template)
            phase = time.perf_counter()
            finish_linear_weights(self.model)  # before anything runs the model
            if args.fused_decode_gemv:
                report_fused_decode_gemv(self.model)
            if self.packed_activations not in (None, "int16"):
                set_packed_activations(self.model, self.packed_activations)
            self.startup_phases["packing_wait"] = time.perf_counter() - phase
            if args.model_impl == "jax":  # the JAX backend: its own runner, all else as is
                self.runner = start_jax_runner(args, self.model_config, self.scheduler_config,
                                               self.device)
                self.model.load_seconds = self.runner.load_seconds
            else:
                self.runner = ModelRunner(self.model, args.block_size, self.device)
            self.startup_phases["load"] = self.model.load_seconds
            if profile:
                phase = time.perf_counter()
                num_blocks = self._profile_num_blocks()
                self.startup_phases["profile"] = time.perf_counter() - phase
                self._check_capacity(num_blocks)
            use_graphs = self._use_cuda_graphs() and args.model_impl != "jax"
            # With graphs, one block past the managed ones takes the padding rows' writes.
            self.runner.allocate_kv_cache(num_blocks + int(use_graphs),
                                          self.model_config.num_kv_heads,
                                          self.model_config.head_dim, kv_dtype)
            if use_graphs:
                phase = time.perf_counter()
                self._capture_decode_graphs(num_blocks)
                self.startup_phases["cuda_graphs"] = time.perf_counter() - phase
            if self.tp_group is not None:
                self.tp_group.wait_ready()
                self.runner.tp_group = self.tp_group
            if warming is not None:
                phase = time.perf_counter()
                warming.join()  # what start-up waited for the kernels past the loading
                self.startup_phases["kernels"] += time.perf_counter() - phase
        except BaseException:
            if self.tp_group is not None:
                self.tp_group.shutdown()  # never leave workers or the process group behind
            raise
        # A draft model or self-draft (--speculative-config), over the same block ids.
        drafter = start_drafter(args, self.model, self.model_config,
                                num_blocks + int(use_graphs), kv_dtype, self.device)
        if args.speculative_config is not None and use_graphs:
            logger.info("speculative decoding: verifying steps (and a model proposer's "
                        "drafts) run eagerly; plain decode steps replay the CUDA graphs")
        mode = preemption_mode(args)
        if mode == "swap":
            self.runner.allocate_swap_space(args.num_cpu_blocks)
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching,
                                          num_cpu_blocks=args.num_cpu_blocks)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, mode)
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = frozenset(
            _as_list(self.model_config.generation_config.get("eos_token_id"))
            or _as_list(self.model_config.hf_config.get("eos_token_id"))
        )
        if self.tokenizer is not None:
            self.eos_token_ids |= frozenset(self.tokenizer.eos_token_ids)
        so = args.structured_outputs_config
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids),
            so.backend, so.disable_any_whitespace, so.disable_additional_properties)
        # Requests whose grammar is still compiling: the scheduler sees them once it is.
        self._grammar_wait: list[Request] = []
        # LoRA adapters (--enable-lora), each loaded on its first request.
        self.lora_manager = None
        if args.enable_lora:
            from rvllm.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, args.max_lora_rank, self.device,
                                            dtype, args.max_cpu_loras or args.max_loras)
            self.runner.lora_enabled = True
        self.speculative_config = args.speculative_config
        self.speculator = (None if self.speculative_config is None
                           else Speculator(self.speculative_config, drafter))
        self.spec_stats = (SpecDecodeStats(None) if self.speculator is None
                           else self.speculator.stats)
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0}
        self.idle = IdleWork(self.model, self.runner, self.block_manager,
                             self.runner.kv_cache_block_bytes()
                             if self.device.type == "cpu" and self.tp_group is None else 0)
        # --async-scheduling: the model's steps on a thread of their own, one in flight
        # while this thread schedules the next (engine.async_steps).
        self.step_worker = StepWorker(self.runner) if args.async_scheduling else None
        self._in_flight: StepInFlight | None = None
        self._held_outputs: list[RequestOutput] = []
        self.startup_seconds = time.perf_counter() - start
        linear = self.model.linear_backend
        if self.kernel_backend == "numba" and linear in ("onednn", "int8"):
            linear = f"{'float32' if linear == 'onednn' else 'int8'} panels"  # cpu_linear
        elif linear == "packed":
            linear = f"{self.quantization} blocks, packed"
        logger.info("engine ready in %.2fs: %s, %s, kernels: %s, linear layers: %s, %d KV "
                    "blocks of %d tokens in %s", self.startup_seconds,
                    self.model_config.architecture, dtype, self.kernel_backend, linear,
                    num_blocks, args.block_size, kv_dtype)

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    def settings(self) -> dict[str, Any]:
        """What this engine resolved from its arguments (``auto`` made concrete), as plain
        values: for the server's dashboard, which may run in another process."""
        spec = self.speculative_config
        return {
            "architecture": self.model_config.architecture,
            "dtype": str(self.model_config.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(self.cache_config.cache_dtype).removeprefix("torch."),
            "quantization": self.quantization,
            "packed_activations": self.packed_activations,
            "kernel_backend": self.kernel_backend,
            "linear_backend": getattr(self.model, "linear_backend", None),
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "max_num_seqs": self.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": self.scheduler_config.max_num_batched_tokens,
            "speculative": (None if spec is None
                            else f"{spec.method}, {spec.num_speculative_tokens} tokens"),
            "async_scheduling": self.step_worker is not None,
            "runner": self.runner_type,
            "pooling_type": None if self.pooler is None else self.pooler.pooling_type,
        }

    def _use_cuda_graphs(self) -> bool:
        args = self.args
        if self.device.type != "cuda" or args.enforce_eager:
            reason = "enforce-eager" if args.enforce_eager else "not on CUDA"
        elif self.kernel_backend != "triton":
            reason = "the torch kernel backend sizes its work from the batch on the host"
        elif args.tensor_parallel_size > 1:
            reason = "not with tensor parallelism yet"
        else:
            return True
        logger.info("CUDA graphs: off (%s)", reason)
        return False

    def _capture_decode_graphs(self, num_blocks: int) -> None:
        from rvllm.executor.decode_graphs import DecodeGraphs, parse_capture_sizes

        sizes = parse_capture_sizes(self.args.cuda_graph_sizes,
                                    self.scheduler_config.max_num_seqs)
        graphs = DecodeGraphs(self.model, self.device, self.cache_config.block_size,
                              num_blocks, self.model_config.max_model_len, sizes)
        graphs.capture()
        self.runner.decode_graphs = graphs

    def _profile_num_blocks(self) -> int:
        """Blocks that fit beside the weights and the activations of the largest step."""
        from rvllm.executor.kv_cache import measure_used_gpu_memory

        sched, mc = self.scheduler_config, self.model_config
        used = measure_used_gpu_memory(self.device, lambda: self.runner.profile_run(
            sched.max_num_batched_tokens, sched.max_num_seqs, mc.max_model_len,
            mc.num_kv_heads, mc.head_dim, mc.dtype))
        num_blocks = determine_num_blocks(mc, self.cache_config, sched, self.device,
                                          used_bytes=used)
        logger.info("profiled peak use %.2f GiB without the KV cache: %d KV blocks fit",
                    used / 2**30, num_blocks)
        return num_blocks

    def _check_capacity(self, num_blocks: int) -> None:
        capacity = num_blocks * self.cache_config.block_size
        if capacity < self.model_config.max_model_len:
            raise ValueError(
                f"The model's max_model_len ({self.model_config.max_model_len}) is larger than "
                f"the {capacity} tokens the KV cache can hold ({num_blocks} blocks of "
                f"{self.cache_config.block_size}). Raise --num-gpu-blocks or --kv-cache-memory, "
                "or lower --max-model-len."
            )

    # ----------------------------------------------------------------- requests

    def new_request_id(self) -> str:
        return str(next(self._request_ids))

    def tokenize_prompt(self, prompt: PromptType, limit: int | None
                        ) -> tuple[str | None, list[int]]:
        """A prompt may be text, a list of token ids, or {"prompt": ...} /
        {"prompt_token_ids": [...]}. Text longer than ``limit`` tokens (the model's
        context) is refused before it is all tokenized; None: no limit."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this engine was started "
                                 "with skip_tokenizer_init: send token ids.")
            if limit is None:
                return prompt, self.tokenizer.encode(prompt)
            ids = self.tokenizer.encode_bounded(prompt, limit)
            if ids is None:
                raise ValueError(
                    f"This model's maximum context length is {self.max_model_len} tokens, "
                    f"and the prompt ({len(prompt)} characters) is longer than that.")
            return prompt, ids
        if isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(
                        f"prompt token ids must be integers in [0, {vocab}); got {t!r}."
                    )
            return None, ids
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt)}.")

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None) -> str:
        """Validate and queue a request: SamplingParams to generate, PoolingParams for an
        embedding (of a pooling model). Raises ValueError (nothing is queued) when the
        prompt or the parameters are unusable."""
        try:
            return self._add_request(request_id, prompt, params, arrival_time)
        except ValueError:
            if isinstance(prompt, (str, list)) and len(prompt) > _TRIM_AFTER_PROMPT_LEN:
                # A large prompt refused: hand its memory back to the system.
                release_freed_memory()
            raise

    def _add_request(self, request_id: str | None, prompt: PromptType,
                     params: SamplingParams | PoolingParams | None,
                     arrival_time: float | None) -> str:
        if params is None:
            params = PoolingParams() if self.runner_type == "pooling" else SamplingParams()
        pooling = isinstance(params, PoolingParams)
        if pooling != (self.runner_type == "pooling"):
            raise ValueError(
                "this engine runs the model as a pooling model (runner='pooling'): it makes "
                "embeddings, not text." if not pooling else
                "embeddings need the engine started as a pooling model (--runner pooling "
                "or --convert embed); this one generates text.")
        params = params.clone()
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use.")
        text, prompt_ids = self._prompt_ids(prompt, params.truncate_prompt_tokens)
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(request_id, text, prompt_ids, params,
                                             arrival_time)
        max_tokens = self._max_tokens(len(prompt_ids), params)
        if params.lora_request is not None:
            if self.lora_manager is None:
                raise ValueError(f"lora_request {params.lora_request.lora_name!r}: LoRA "
                                 "adapters need the engine started with --enable-lora.")
            self.lora_manager.ensure(params.lora_request, {
                r.params.lora_request.lora_int_id for r in self.requests.values()
                if r.params.lora_request is not None})
        if params.priority != 0 and self.scheduler_config.policy != "priority":
            raise ValueError(f"priority {params.priority} needs the engine started with "
                             "--scheduling-policy priority.")
        vocab = self.model_config.vocab_size
        most = vocab if self.args.max_logprobs == -1 else self.args.max_logprobs
        for name in ("prompt_logprobs", "logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > most:
                raise ValueError(f"{name} must be at most {most} (--max-logprobs), got "
                                 f"{asked}.")
        spec = params.structured_outputs
        marker = spec.starts_after if spec is not None else None
        for t in [*(params.stop_token_ids or []), *(params.logit_bias or {}), *(marker or []),
                  *(params.allowed_token_ids or [])]:
            if t >= vocab:
                raise ValueError(f"token id {t} is outside the vocabulary (size {vocab}).")
        params.eos_token_ids = frozenset() if params.ignore_eos else self.eos_token_ids
        if spec is not None:
            self.structured_outputs.apply_defaults(spec)
            self.structured_outputs.validate(spec)
        now = time.time() if arrival_time is None else arrival_time
        seqs = [self._new_sequence(request_id, i, prompt_ids, params, now, max_tokens)
                for i in range(params.n)]
        request = Request(request_id, text, prompt_ids, params, seqs,
                          RequestMetrics(arrival_time=now), sent_tokens=[0] * params.n)
        self.requests[request_id] = request
        if spec is not None:
            # Compiled on the manager's threads; scheduled once compiled (_admit_grammars).
            request.grammar = self.structured_outputs.compile(spec)
            self._grammar_wait.append(request)
        else:
            for seq in seqs:
                self.scheduler.add(seq)
        self.stats["prompt_tokens"] += len(prompt_ids)
        return request_id

    def _prompt_ids(self, prompt: PromptType, keep: int | None
                    ) -> tuple[str | None, list[int]]:
        """The prompt's text (if it was text) and token ids; ``keep``: only its last
        ``keep`` tokens (-1: max_model_len). ValueError for an empty prompt."""
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            if keep > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens ({keep}) is greater than the "
                                 f"model's maximum context length ({self.max_model_len}).")
        # A prompt to truncate is tokenized whole, then cut to its last `keep` tokens.
        text, prompt_ids = self.tokenize_prompt(
            prompt, None if keep is not None else self.max_model_len)
        if keep is not None:
            prompt_ids = prompt_ids[-keep:]
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token.")
        return text, prompt_ids

    def _add_pooling_request(self, request_id: str, text: str | None, prompt_ids: list[int],
                             params: PoolingParams, arrival_time: float | None) -> str:
        """An embedding: the prompt through the model once, its hidden states pooled."""
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} "
                             f"tokens, and the prompt has {len(prompt_ids)} tokens.")
        self._check_dimensions(params.dimensions)
        now = time.time() if arrival_time is None else arrival_time
        # No sampling: the sequence ends once the prompt is through (max_tokens 0).
        seq_params = SamplingParams(detokenize=False)
        seq = self._new_sequence(request_id, 0, prompt_ids, seq_params, now, 0)
        assert self.pooler is not None
        seq.pooling = self.pooler.pooling_type
        request = Request(request_id, text, prompt_ids, seq_params, [seq],
                          RequestMetrics(arrival_time=now), sent_tokens=[0], pooling=params)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        self.stats["prompt_tokens"] += len(prompt_ids)
        return request_id

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        sizes = matryoshka_dimensions(self.model_config.hf_config)
        if sizes is None:
            raise ValueError("dimensions: this model does not support Matryoshka "
                             "representation, so its embeddings cannot be shortened.")
        hidden = self.model_config.hidden_size
        if dimensions > hidden or (sizes and dimensions not in sizes):
            allowed = ", ".join(map(str, sizes)) if sizes else f"1 to {hidden}"
            raise ValueError(f"dimensions {dimensions} is not one this model supports "
                             f"({allowed}).")

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if params.max_tokens is None:
            if prompt_len >= limit:
                raise ValueError(
                    f"This model's maximum context length is {limit} tokens, and the prompt "
                    f"has {prompt_len} tokens: no room is left for the completion."
                )
            return limit - prompt_len
        if prompt_len + params.max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, "
                f"{params.max_tokens} for the completion). Please reduce the prompt or "
                "max_tokens."
            )
        return params.max_tokens

    def _new_sequence(self, request_id: str, index: int, prompt_ids: list[int],
                      params: SamplingParams, now: float, max_tokens: int) -> Sequence:
        generator = None
        if params.seed is not None:
            # Sample i of a seeded request draws from seed + i, so n samples differ.
            import_for_generators()
            generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
        detok = None
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set); "
                             "use stop_token_ids.")
        if params.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        return Sequence(next(self._seq_ids), request_id, index, prompt_ids, params, now,
                        max_tokens, generator=generator, detokenizer=detok)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. False if it was not live."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request in self._grammar_wait:
            self._grammar_wait.remove(request)
        for seq in request.seqs:
            if not seq.status.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return True

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any. The engine cannot step afterwards."""
        self.structured_outputs.shutdown()
        if self.step_worker is not None:
            self.step_worker.shutdown()
        if self.tp_group is not None:
            self.tp_group.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --------------------------------------------------------------------- step

    @property
    def has_idle_work(self) -> bool:
        """Whether ``idle_work`` has something to do (``engine.idle_work.IdleWork``)."""
        return self.idle.pending()

    def idle_work_due_in(self) -> float:
        """Seconds until a loop with nothing to step should call ``idle_work``."""
        return self.idle.due_in()

    def idle_work(self, seconds: float = 0.02) -> None:
        """About ``seconds`` of the work start-up left for later, for a caller with no
        request to step (``engine.idle_work.IdleWork.run``). A step in flight ends first:
        idle work repacks weights that it reads."""
        self.finish_steps()
        self.idle.run(seconds)

    def finish_steps(self) -> None:
        """Wait for the step in flight (``--async-scheduling``), if any; the next
        ``step`` reports its outputs."""
        if self._in_flight is not None:
            self._held_outputs += self._finish_in_flight()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, and report every request that moved.
        With ``--async-scheduling`` the pass runs behind: this call starts one step and
        reports the one before it (``engine.async_steps``)."""
        held, self._held_outputs = self._held_outputs, []
        if self.step_worker is None:
            return held + self._step_sync()
        if self._grammar_wait or any(r.grammar is not None for r in self.requests.values()):
            # A grammar moves past each token before the next step's mask: no overlap.
            return held + self._finish_in_flight() + self._step_sync()
        return held + self._step_async()

    def _step_sync(self) -> list[RequestOutput]:
        failed = self._admit_grammars() if self._grammar_wait else []
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_model_len)
        sched = self.scheduler.schedule()
        started = time.perf_counter()
        if self.speculator is not None:
            self.speculator.trim(sched, [*self.scheduler.running, *sched.preempted,
                                         *self.scheduler.swapped])
            self.speculator.fill(sched, self.scheduler.running)
        if sched.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not place any waiting request.")
            if self._grammar_wait and not failed:
                # Nothing to run until a grammar is ready: wait for one, briefly.
                wait_futures([r.grammar for r in self._grammar_wait], timeout=0.01,
                             return_when=FIRST_COMPLETED)
            now = time.time()
            return [self._make_output(r, now) for r in failed]
        now = time.time()
        for s in sched.scheduled:
            metrics = self.requests[s.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        step_outputs = self._execute(sched)
        if self.speculator is not None:
            self.speculator.stats.time_step(sched, time.perf_counter() - started)
            self.speculator.settle(step_outputs)
        self.idle.stepped()
        if sched.num_batched_tokens > PENDING_GEMM_MAX_ROWS:
            # Deferred oneDNN packing, under load: a layer a step, on steps that a packed
            # weight makes faster; a first request with a short prompt does not wait for
            # a layer's packing (30-70 ms). The panels' huge pages wait for idle time.
            reorder_pending(self.model, limit=1, gemms_only=True)
        now = time.time()
        moved: dict[str, Request] = {r.request_id: r for r in failed}
        for out in step_outputs:
            seq = out.seq
            seq.num_computed_tokens += out.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if self._take_output(seq, out, now):
                moved[seq.request_id] = self.requests[seq.request_id]
        return [self._make_output(r, now) for r in moved.values()]

    def _take_output(self, seq: Sequence, out: SeqStepOutput, now: float) -> bool:
        """A step's prompt logprobs and tokens for ``seq``, appended and stop-checked;
        whether it sampled a token."""
        out.seq = seq
        if seq.pooling is not None:
            return self._take_pooled(seq, out)
        if out.prompt_logprobs is not None:
            self._add_prompt_logprobs(out)
        if out.token_id is None:
            return False
        if seq.max_tokens == 0:
            # Prompt scoring (echo + logprobs): done once the prompt is computed; the
            # token sampled from its last position is dropped.
            self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
        else:
            self._append_token(seq, out.token_id, out.logprob, out.top_ids,
                               out.top_logprobs, now)
            self._append_later_tokens(seq, out.later_tokens, now, out.later_tops)
        return True

    def _take_pooled(self, seq: Sequence, out: SeqStepOutput) -> bool:
        """A pooling sequence's chunk: its pooled positions added; once the prompt is
        through, the vector made and the sequence finished. Whether it finished."""
        if out.pool_count:
            assert out.pool_rows is not None
            if seq.pooling != "MEAN":
                seq.pool_sum, seq.pool_count = out.pool_rows[0], 1
            elif out.pool_first <= seq.pool_count < out.pool_first + out.pool_count:
                # Only the positions not pooled yet: a chunk recomputed after a preemption
                # (with a step in flight, planned before the last chunk was taken) may
                # repeat some.
                new = out.pool_rows[seq.pool_count - out.pool_first:].sum(0)
                seq.pool_sum = new if seq.pool_sum is None else seq.pool_sum + new
                seq.pool_count = out.pool_first + out.pool_count
        expected = seq.num_prompt_tokens if seq.pooling == "MEAN" else 1
        if not out.pool_done or seq.pool_count != expected:
            return False
        params = self.requests[seq.request_id].pooling
        assert params is not None and self.pooler is not None
        vector = seq.pool_sum / seq.pool_count
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        seq.pooled = vector.cpu().tolist()
        seq.pool_sum = None
        self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        return True

    def _step_async(self) -> list[RequestOutput]:
        """Schedule step t and hand it to the worker, then take step t - 1's outputs while
        step t runs."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self._in_flight is None and self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not place any waiting request.")
            return self._finish_in_flight()
        now = time.time()
        for s in sched.scheduled:
            metrics = self.requests[s.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        step = self.step_worker.submit(sched)  # type: ignore[union-attr]
        for seq, _ in step.placeholders:
            # Ends with the token in flight, whatever it is: not scheduled again.
            seq.ends_in_flight = (seq.num_output_tokens >= seq.max_tokens
                                  or seq.num_tokens >= self.max_model_len)
        try:
            outputs = self._finish_in_flight(step)
        except BaseException:
            self._abandon(step)
            raise
        self._in_flight = step
        return outputs

    def _finish_in_flight(self, next_step: StepInFlight | None = None
                          ) -> list[RequestOutput]:
        """Wait for the step in flight and take its outputs, as ``_step_sync`` does, with
        every placeholder out of the way meanwhile; put back those of ``next_step`` (just
        handed to the worker) for the sequences still running."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return []
        try:
            step_outputs = step.future.result()
            resolve_outputs(step_outputs)
        except BaseException:
            self._abandon(step)
            raise
        # No deferred weight packing between overlapped steps (the step in flight reads
        # the weights): it waits for idle time, which finishes the step first.
        self.idle.stepped()
        waiting = next_step.placeholders if next_step is not None else []
        for seq, _ in step.placeholders + waiting:
            strip_placeholders(seq)
        now = time.time()
        moved: dict[str, Request] = {}
        for out in step_outputs:
            seq = out.seq.live  # type: ignore[attr-defined]
            if seq.status.is_finished:
                continue  # aborted, or ended by the token before: this one is dropped
            if seq.status == SequenceStatus.RUNNING:  # not swapped or preempted since
                self.block_manager.cache_full_blocks(seq)
            self._take_output(seq, out, now)
            moved[seq.request_id] = self.requests[seq.request_id]
        outputs = [self._make_output(r, now) for r in moved.values()]
        for seq, index in waiting:
            if not seq.status.is_finished:
                if len(seq.token_ids) != index:
                    raise RuntimeError(f"sequence {seq.seq_id}: a placeholder at {index}, "
                                       f"after {len(seq.token_ids)} tokens")
                seq.token_ids.append(PLACEHOLDER)
        return outputs

    def _abandon(self, step: StepInFlight) -> None:
        """A step failed: wait out ``step`` (which takes the failed one's tokens) and take
        the placeholders off; the caller fails the requests."""
        try:
            step.future.result()
        except BaseException:  # noqa: S110 - the first failure is the one raised
            pass
        for seq, _ in step.placeholders:
            strip_placeholders(seq)
        self.step_worker.forget()  # type: ignore[union-attr]

    def _admit_grammars(self) -> list[Request]:
        """Schedule the requests whose grammar has compiled, each sample with a matcher of
        its own; finish those whose grammar failed. Returns the failed ones."""
        failed = []
        for request in [r for r in self._grammar_wait if r.grammar.done()]:
            self._grammar_wait.remove(request)
            try:
                compiled = request.grammar.result()
            except Exception as e:  # the backend's compile error, as the request's end
                logger.warning("request %s: its grammar did not compile: %s",
                               request.request_id, e)
                for seq in request.seqs:
                    seq.stop_reason = str(e)
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
                failed.append(request)
                continue
            marker = request.params.structured_outputs.starts_after
            for seq in request.seqs:
                seq.grammar = self.structured_outputs.matcher(compiled)
                if marker is not None:  # free until the output has written the marker
                    seq.grammar = GatedMatcher(seq.grammar, marker)
                self.scheduler.add(seq)
        return failed

    def snapshot_counters(self) -> dict[str, Any]:
        """The structured-output and speculative-decoding counters of ``EngineSnapshot``."""
        so = self.structured_outputs
        return {"structured_output_requests": so.num_requests,
                "grammar_compile_buckets": tuple(so.compile_bucket_counts),
                "grammar_compile_seconds": so.compile_seconds_sum,
                "grammar_compile_count": so.compile_count, **self.spec_stats.snapshot(),
                "engine_resident_memory_bytes": _resident_memory_bytes()}

    def _execute(self, sched: SchedulerOutput) -> list[SeqStepOutput]:
        if self.tp_group is None:
            return self.runner.execute(sched)
        from rvllm.executor.parallel import WorkerDiedError

        self.tp_group.check_alive()
        try:
            return self.runner.execute(sched)
        except RuntimeError as e:
            # A collective that fails because a peer vanished is a dead worker.
            if isinstance(e, WorkerDiedError):
                raise
            self.tp_group.check_alive(grace=_WORKER_EXIT_GRACE_S)
            raise

    def _append_later_tokens(self, seq: Sequence, tokens: tuple[tuple[int, float], ...],
                             now: float,
                             tops: tuple[tuple[list[int], list[float]], ...] = ()) -> None:
        """The tokens of a multi-step decode's later steps (or a verifying step's kept
        drafts), each as if its own step had made it, with its top logprobs where
        ``tops`` has them; those after the sequence has finished are dropped."""
        for i, (token, logprob) in enumerate(tokens):
            if seq.status.is_finished:
                return
            seq.num_computed_tokens += 1  # the step that made it computed its input
            self.block_manager.cache_full_blocks(seq)
            top_ids, top_lps = tops[i] if i < len(tops) else (None, None)
            self._append_token(seq, token, logprob, top_ids, top_lps, now)

    def _append_token(self, seq: Sequence, token: int, logprob: float,
                      top_ids: list[int] | None, top_logprobs: list[float] | None,
                      now: float) -> None:
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        self.stats["generation_tokens"] += 1
        if seq.logprobs is not None:
            seq.logprobs.append(logprob_entry(self.tokenizer, token, logprob, top_ids,
                                              top_logprobs))
        delta = seq.detokenizer.add_token(token) if seq.detokenizer is not None else ""
        seq.text += delta
        metrics = self.requests[seq.request_id].metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        status = check_stop(seq, self.max_model_len, len(delta))
        if seq.grammar is not None and status is None:
            status = self._advance_grammar(seq, token)
        if status is not None:
            if seq.detokenizer is not None and not isinstance(seq.stop_reason, str):
                # A character cut off by the end of generation still gets its bytes out.
                seq.text += seq.detokenizer.flush()
            self.scheduler.finish(seq, status)

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> SequenceStatus | None:
        """Move the sequence's grammar past ``token``: the sequence stops where the grammar
        is complete, and ends with finish reason "error" if the token broke it (the mask
        allowed nothing, e.g. under a ``logit_bias`` of -100 on every allowed token)."""
        if not seq.grammar.accept(token):
            seq.stop_reason = f"the grammar cannot continue: {seq.grammar.error() or token}"
            return SequenceStatus.FINISHED_ERROR
        return SequenceStatus.FINISHED_STOPPED if seq.grammar.is_terminated() else None

    def _add_prompt_logprobs(self, out: SeqStepOutput) -> None:
        seq = out.seq
        assert out.prompt_logprobs is not None and out.prompt_next_ids is not None
        next_lps, top_ids, top_lps = out.prompt_logprobs
        for j, token in enumerate(out.prompt_next_ids):
            seq.prompt_logprobs.append(  # type: ignore[union-attr]
                logprob_entry(self.tokenizer, token, next_lps[j], top_ids[j], top_lps[j])
            )

    def _make_output(self, request: Request, now: float) -> RequestOutput:
        output = make_output(request, now)
        if output.finished:
            self.requests.pop(request.request_id, None)
        return output


def _resident_memory_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return 0


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]

"""What ``LLMEngine`` checks and starts before its first step: the kernel backend (and the
numba kernels loading on a thread meanwhile), the scheduler's configuration and
preemption mode, and tensor parallelism's worker processes."""

from __future__ import annotations

import logging
import threading
import time

import torch

from rvllm.config import EngineArgs, ModelConfig, SchedulerConfig

logger = logging.getLogger("rvllm")


class KernelWarmUp(threading.Thread):
    """The numba kernels loading (or compiling) on a thread while the engine loads the
    tokenizer and the weights; ``join`` re-raises what the loading raised."""

    def __init__(self, kv_dtype: torch.dtype, int8: bool, multi_step: bool,
                 packed: bool = False) -> None:
        super().__init__(name="rvllm-numba-warm-up", daemon=True)
        self.error: BaseException | None = None
        self.kv_dtype, self.int8, self.multi_step = kv_dtype, int8, multi_step
        self.packed = packed
        self.start()

    def run(self) -> None:
        from rvllm.kernels.cpu import warm_up_numba

        start = time.perf_counter()
        try:
            warm_up_numba(self.kv_dtype, self.int8, self.multi_step, packed=self.packed)
        except BaseException as error:  # noqa: BLE001 - handed to the joining thread
            self.error = error
            return
        logger.info("numba kernels (decode attention, one-row GEMV, decoder steps) ready in "
                    "%.1fs", time.perf_counter() - start)

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


def select_kernels(requested: str, device: torch.device, dtype: torch.dtype,
                    kv_dtype: torch.dtype, int8: bool, multi_step: bool,
                    packed: bool = False, quantization: str | None = None,
                    fused_gemv: bool = False) -> tuple[str, KernelWarmUp | None]:
    """Choose the kernel backend and, for Triton, compile and check every kernel against
    its reference once, so a broken kernel stops start-up instead of corrupting output.
    The numba kernels start loading from numba's cache (or compiling) on a thread: join
    it before the first step."""
    from rvllm.layers.backend import (
        resolve_kernel_backend,
        set_fused_decode_gemv,
        set_kernel_backend,
    )

    backend = resolve_kernel_backend(requested, device, dtype)
    if fused_gemv and backend != "triton":
        raise ValueError("--fused-decode-gemv runs Triton kernels; this engine's kernel "
                         f"backend is {backend}. Run on a GPU (or with --kernel-backend "
                         "triton) or leave the flag out.")
    if kv_dtype == torch.float8_e4m3fn and backend != "triton":
        raise ValueError("--kv-cache-dtype fp8 is read by the Triton kernels only; run with "
                         "--kernel-backend triton (the GPU's default)")
    # Only the forms this engine runs: each one loaded is start-up time.
    warming = (KernelWarmUp(kv_dtype, int8, multi_step, packed) if backend == "numba"
               else None)
    if backend == "triton":
        from rvllm.kernels.triton import OPTIONAL_KERNEL_NAMES, check_kernels

        start = time.perf_counter()
        checked = check_kernels(device, dtype)
        for extra in (quantization, "fp8_kv_cache" if kv_dtype == torch.float8_e4m3fn
                      else None, "fused_gemv" if fused_gemv else None):
            if extra in OPTIONAL_KERNEL_NAMES:
                checked += check_kernels(device, dtype, OPTIONAL_KERNEL_NAMES[extra])
        logger.info("checked %d Triton kernels against their references in %.1fs",
                    len(checked), time.perf_counter() - start)
    set_kernel_backend(backend)
    if fused_gemv:
        from rvllm.kernels.triton.fused_gemv import MAX_ROWS

        set_fused_decode_gemv(MAX_ROWS)
    else:
        set_fused_decode_gemv(0)
    return backend, warming


def resolve_quantization(requested: str | None, model: str, device: torch.device,
                         dtype: torch.dtype, tensor_parallel_size: int = 1,
                         load_format: str = "auto", model_impl: str = "auto") -> str | None:
    """``--quantization`` as the engine runs it. Unset: a GGUF file whose linear weights
    are quantized runs on them packed (``gguf``) on the CPU in float32 on one rank (the
    torch modules' path: under ``--model-impl jax`` the file loads dequantized), and
    an int4 checkpoint (AWQ, GPTQ, compressed-tensors) as its config says; anything
    else in the checkpoint's own dtype. ``none``: every weight widened to the compute
    dtype. Raises ``ValueError`` for a choice this model or machine cannot run."""
    from rvllm.layers.cpu_linear import PACKED_QUANTIZATIONS
    from rvllm.models.default_model import resolve_gguf_path
    from rvllm.models.loader import checkpoint_int4_method, gguf_has_packed_weights

    if requested == "none":
        return None
    if model_impl == "jax" and requested in ("int8", "int4"):
        return requested  # quantized at load by rvllm.jax.quant, on any device, dtype, TP size
    gguf = resolve_gguf_path(model) if load_format != "dummy" else None
    int4_method = (checkpoint_int4_method(model) if gguf is None and load_format != "dummy"
                   else None)
    on_cpu_f32 = device.type == "cpu" and dtype == torch.float32
    if requested is None:
        if int4_method is not None and device.type == "cpu":
            return int4_method
        if int4_method is not None:
            logger.warning("%s checkpoint: its int4 weights run dequantized to %s on this "
                           "device (the packed int4 path is the CPU's; on a GPU, "
                           "--quantization int4 quantizes a float checkpoint at load)",
                           int4_method, str(dtype).removeprefix("torch."))
            return None
        if gguf is not None and on_cpu_f32 and model_impl != "jax" \
                and gguf_has_packed_weights(gguf):
            if tensor_parallel_size == 1:
                return "gguf"
            logger.warning("%s: its quantized weights run packed on one rank only; with "
                           "--tensor-parallel-size %d they are widened to float32 (about "
                           "4-7 times the file's bytes in memory)", gguf,
                           tensor_parallel_size)
        return None
    if requested == "gguf" and gguf is None:
        raise ValueError(f"--quantization gguf keeps a GGUF file's quantized weights packed; "
                         f"{model} is not a GGUF file")
    if requested in ("awq", "gptq", "compressed-tensors") and requested != int4_method:
        raise ValueError(f"--quantization {requested}: {model} is not a {requested} "
                         f"checkpoint (its config.json's quantization_config says "
                         f"{int4_method or 'nothing'})")
    if requested == "fp8" and device.type == "cpu":
        raise ValueError("--quantization fp8 needs a CUDA GPU; on the CPU use gguf (a "
                         "quantized GGUF file), int4 or int8")
    if requested in PACKED_QUANTIZATIONS and device.type == "cpu":
        if not on_cpu_f32:
            raise ValueError(f"--quantization {requested} computes in float32 on the CPU; "
                             "run it with --dtype float32 (the CPU default)")
        if tensor_parallel_size > 1:
            raise ValueError(f"--quantization {requested} runs on one rank on the CPU; "
                             "leave --tensor-parallel-size at 1")
    if requested == "gguf" and device.type != "cpu":
        raise ValueError("--quantization gguf runs on the CPU; on a GPU the file's weights "
                         "are widened to --dtype (or use --quantization fp8 or int4)")
    if requested in ("awq", "gptq", "compressed-tensors") and device.type != "cpu":
        raise ValueError(f"--quantization {requested}: int4 checkpoints run packed on the "
                         "CPU; on a GPU leave --quantization unset (they run dequantized)")
    if requested in ("int8", "fp16") and device.type != "cpu":
        raise ValueError(f"--quantization {requested} is a CPU path (fbgemm); on a GPU use "
                         "int4 or fp8")
    return requested


def check_scheduler_steps(args: EngineArgs, kernel_backend: str) -> None:
    """Multi-step decoding runs only in the CPU's compiled decode (numba kernels, one
    rank) and the JAX backend: refuse it elsewhere rather than ignore it."""
    if args.num_scheduler_steps > 1 and args.model_impl != "jax" and (
            kernel_backend != "numba" or args.tensor_parallel_size > 1):
        raise ValueError(
            f"num_scheduler_steps={args.num_scheduler_steps} needs the CPU's numba decode "
            f"path on one rank, or --model-impl jax; this engine runs the {kernel_backend} "
            f"kernels with tensor_parallel_size={args.tensor_parallel_size}. Leave it at 1.")


def check_packed_activations(args: EngineArgs, quantization: str | None,
                             packed: bool) -> None:
    """``--packed-activations`` names what packed weights multiply: refused where the
    model's weights do not run packed (``packed`` false)."""
    from rvllm.layers.cpu_linear import PACKED_ACTIVATIONS

    if args.packed_activations not in PACKED_ACTIVATIONS:
        raise ValueError(f"--packed-activations must be one of "
                         f"{', '.join(PACKED_ACTIVATIONS)}, got {args.packed_activations!r}")
    if args.packed_activations != "int16" and not packed:
        raise ValueError(f"--packed-activations {args.packed_activations} is for weights "
                         "kept packed on the CPU (a quantized GGUF file, int4); this model "
                         f"runs with --quantization {quantization or 'none'}"
                         + (" under --model-impl jax" if args.model_impl == "jax" else ""))


def report_fused_decode_gemv(model: torch.nn.Module) -> None:
    """Log whether ``--fused-decode-gemv`` applies to this model's layers (a warning where
    it does not: its steps then run the separate kernels)."""
    from rvllm.layers.backend import fused_decode_gemv_rows

    fuses = getattr(getattr(model, "model", None), "fuses_decode_gemv", None)
    if fuses is not None and fuses():
        logger.info("fused decode GEMVs: on, for steps of up to %d tokens",
                    fused_decode_gemv_rows())
    else:
        logger.warning("--fused-decode-gemv: this model's layers run the separate kernels "
                       "(the fused GEMVs take Llama-shaped layers with plain, unquantized "
                       "weights on one tensor-parallel rank)")


def check_async_scheduling(args: EngineArgs) -> None:
    """What ``--async-scheduling`` does not overlap, refused at start-up rather than run
    without it: speculative decoding and multi-step decoding (their steps propose from,
    or run past, the tokens the host has yet to take), tensor parallelism (its workers
    follow rank 0's steps in order), and the JAX backend (its own runner)."""
    if not args.async_scheduling:
        return
    clashes = [name for name, on in (
        ("--speculative-config", args.speculative_config is not None),
        (f"--num-scheduler-steps {args.num_scheduler_steps}", args.num_scheduler_steps > 1),
        (f"--tensor-parallel-size {args.tensor_parallel_size}",
         args.tensor_parallel_size > 1),
        ("--model-impl jax", args.model_impl == "jax"),
    ) if on]
    if clashes:
        raise ValueError(f"--async-scheduling does not run with {', '.join(clashes)}; "
                         "drop one of them.")


def check_speculative(args: EngineArgs) -> None:
    """What speculative decoding cannot run with, refused at start-up: a model-based
    proposer (draft model, self-draft) runs on one rank only."""
    config = args.speculative_config
    if config is not None and config.method != "ngram" and args.tensor_parallel_size > 1:
        raise ValueError(f"speculative_config method {config.method!r} runs on one rank; "
                         f"this engine has tensor_parallel_size={args.tensor_parallel_size}. "
                         "Use \"ngram\" (prompt lookup), or one rank.")


def check_lora(args: EngineArgs) -> None:
    """What LoRA adapters cannot run with, refused at start-up."""
    if not args.enable_lora:
        return
    for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        value = getattr(args, name)
        if name == "max_cpu_loras" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise ValueError(f"max_cpu_loras ({args.max_cpu_loras}) must be at least max_loras "
                         f"({args.max_loras}).")
    refused = []
    if args.tensor_parallel_size > 1:
        refused.append("tensor parallelism (one rank only)")
    if args.model_impl == "jax":
        refused.append("--model-impl jax")
    if args.runner_type() == "pooling":
        refused.append("a pooling model")
    if refused:
        raise ValueError(f"LoRA adapters (enable_lora) do not run with {', '.join(refused)} "
                         "yet.")


def check_pooling(args: EngineArgs) -> None:
    """What a pooling model (``--runner pooling``) cannot run with, refused at start-up."""
    if args.runner_type() != "pooling":
        return
    if args.model_impl == "jax":
        raise ValueError("a pooling model (runner='pooling') runs on rvllm's torch modules; "
                         "--model-impl jax generates text only.")
    if args.speculative_config is not None:
        raise ValueError("speculative decoding speeds up generation: a pooling model "
                         "(runner='pooling') has nothing to speculate on.")


def start_drafter(args: EngineArgs, model: torch.nn.Module, model_config: ModelConfig,
                  num_blocks: int, kv_dtype: torch.dtype, device: torch.device
                  ):  # noqa: ANN205 - spec_decode.draft.ModelDrafter | None
    """The model-based proposer ``--speculative-config`` asks for, or None (none, or
    n-gram lookup, which needs no model). A draft model is loaded with a KV cache of its
    own of ``num_blocks`` blocks (the target's count, so one block table indexes both);
    ValueError for a draft whose vocabulary is not the target's. A self-draft is a view
    of the target's first layers and uses the target's cache."""
    config = args.speculative_config
    if config is None or config.method == "ngram":
        return None
    from rvllm.spec_decode.draft import ModelDrafter, self_draft_model

    if config.method == "self_draft":
        layers = config.draft_layers(model_config.num_layers)
        logger.info("speculative decoding: self-draft from the first %d of %d layers, k=%d",
                    layers, model_config.num_layers, config.num_speculative_tokens)
        return ModelDrafter(self_draft_model(model, layers), args.block_size, device,
                            own_cache=False)
    from rvllm.executor.model_runner import ModelRunner
    from rvllm.layers.cpu_linear import finish_linear_weights
    from rvllm.models.loader import load_model

    assert config.model is not None
    draft_config = ModelConfig.from_path(config.model, model_config.dtype)
    if draft_config.max_model_len < model_config.max_model_len:
        raise ValueError(f"speculative_config model {config.model!r} takes "
                         f"{draft_config.max_model_len} positions, fewer than the target's "
                         f"max_model_len ({model_config.max_model_len}): lower "
                         "--max-model-len, or use a draft with the target's context.")
    if draft_config.vocab_size != model_config.vocab_size:
        raise ValueError(f"speculative_config model {config.model!r} has a vocabulary of "
                         f"{draft_config.vocab_size} tokens, the target's has "
                         f"{model_config.vocab_size}: a draft model must share the target's "
                         "tokenizer.")
    quantization = resolve_quantization(None, config.model, device, model_config.dtype)
    draft = load_model(draft_config, device, quantization=quantization)
    finish_linear_weights(draft)
    # A runner of its own only to lay out the draft's cache as the target's is laid out.
    ModelRunner(draft, args.block_size, device).allocate_kv_cache(
        num_blocks, draft_config.num_kv_heads, draft_config.head_dim, kv_dtype)
    logger.info("speculative decoding: draft model %s (%s, %d layers), k=%d", config.model,
                draft_config.architecture, draft_config.num_layers,
                config.num_speculative_tokens)
    return ModelDrafter(draft, args.block_size, device, own_cache=True)


def preemption_mode(args: EngineArgs) -> str:
    if args.num_cpu_blocks < 0:
        raise ValueError(f"num_cpu_blocks must be >= 0, got {args.num_cpu_blocks}.")
    mode = args.preemption_mode or ("swap" if args.num_cpu_blocks else "recompute")
    if mode not in ("swap", "recompute"):
        raise ValueError(f"preemption_mode must be swap or recompute, got {mode!r}.")
    if mode == "swap" and not args.num_cpu_blocks:
        raise ValueError("preemption_mode=swap needs CPU swap space: set --num-cpu-blocks.")
    return mode


def start_tensor_parallel(args: EngineArgs, model_config: ModelConfig, num_blocks: int,
                           device: torch.device):  # noqa: ANN202 - TensorParallelGroup | None
    tp = args.tensor_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}.")
    if tp == 1:
        from rvllm.distributed import set_tp

        set_tp(0, 1)
        return None
    heads, kv_heads = model_config.num_heads, model_config.num_kv_heads
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        raise ValueError(
            f"the model's {heads} attention heads and {kv_heads} KV heads cannot be split "
            f"over tensor_parallel_size={tp}: heads must divide by it, and KV heads must "
            "divide by it or it by them."
        )
    for key in ("intermediate_size",):
        size = model_config.hf_config.get(key)
        if isinstance(size, int) and size % tp:
            raise ValueError(f"{key}={size} does not divide by tensor_parallel_size={tp}.")
    if device.type == "cuda" and tp > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size={tp} needs {tp} GPUs; {torch.cuda.device_count()} found."
        )
    if args.distributed_executor_backend == "ray":
        from rvllm.executor.ray_executor import RayTensorParallelGroup

        return RayTensorParallelGroup(args, tp, num_blocks, device)
    if args.distributed_executor_backend != "mp":
        raise ValueError(
            f"distributed_executor_backend must be mp or ray, got "
            f"{args.distributed_executor_backend!r}."
        )
    from rvllm.executor.tp_workers import TensorParallelGroup

    return TensorParallelGroup(args, tp, num_blocks, device)


def scheduler_config(args: EngineArgs, max_model_len: int) -> SchedulerConfig:
    budget = args.max_num_batched_tokens
    if budget is None:
        budget = 2048 if args.enable_chunked_prefill else max(2048, max_model_len)
    if not args.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) is smaller than max_model_len "
            f"({max_model_len}) with chunked prefill off: long prompts could never run. "
            "Raise it or enable chunked prefill."
        )
    return SchedulerConfig(args.max_num_seqs, budget, args.enable_chunked_prefill,
                           args.num_scheduler_steps, args.scheduling_policy,
                           args.max_loras if args.enable_lora else 0)


def check_jax_backend(args: EngineArgs, device: torch.device, kv_dtype: torch.dtype,
                      quantization: str | None) -> None:
    """Refuse, before anything runs, what ``--model-impl jax`` does not cover yet."""
    import importlib.util

    if importlib.util.find_spec("jax") is None:
        raise ValueError("--model-impl jax needs JAX: pip install 'rvllm[jax]' (or jax).")
    refused = []
    if device.type not in ("cpu", "cuda"):
        refused.append(f"--device {device.type} (the CPU and CUDA GPUs only)")
    if device.type == "cuda" and args.num_gpu_blocks is None:
        refused.append("a GPU cache sized by profiling (give --num-gpu-blocks)")
    if args.jax_platform in ("gpu", "tpu") and args.num_gpu_blocks is None:
        refused.append(f"a {args.jax_platform.upper()} cache sized from the host's memory "
                       "(give --num-gpu-blocks)")
    if args.jax_platform == "tpu" and device.type != "cpu":
        refused.append(f"--jax-platform tpu with --device {device.type} (the engine's own "
                       "tensors stay on the CPU: --device cpu)")
    if args.tensor_parallel_size > 1 and args.distributed_executor_backend == "ray":
        refused.append("--distributed-executor-backend ray (one process drives JAX's mesh)")
    if args.speculative_config is not None:
        refused.append("--speculative-config")
    if args.num_cpu_blocks or args.preemption_mode == "swap":
        refused.append("swap preemption (--num-cpu-blocks, --preemption-mode swap)")
    if quantization not in (None, "int8", "int4"):
        refused.append(f"--quantization {quantization} (int8 and int4 only)")
    if args.load_format != "auto":
        refused.append(f"--load-format {args.load_format}")
    if kv_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        refused.append(f"a {str(kv_dtype).removeprefix('torch.')} KV cache")
    if refused:
        raise ValueError("--model-impl jax does not support " + "; ".join(refused)
                         + " yet. Run without them, or with --model-impl torch.")


class NoTorchModel(torch.nn.Module):
    """Where the engine keeps its torch model, under ``--model-impl jax``: nothing (the
    JAX runner holds the weights, so they are not loaded twice)."""

    linear_backend = "jax"
    load_seconds = 0.0


def start_jax_runner(args: EngineArgs, model_config: ModelConfig,
                     sched_config: SchedulerConfig, device: torch.device):  # noqa: ANN201
    """The JAX backend's model runner (``rvllm.jax.runner.JaxModelRunner``), once
    ``check_jax_backend`` has passed: JAX is imported here, and only here."""
    from rvllm.jax.runner import JaxModelRunner

    return JaxModelRunner(model_config, sched_config, args.block_size, device,
                          progress=args.show_progress, platform=args.jax_platform,
                          tensor_parallel_size=args.tensor_parallel_size,
                          quantization=args.quantization
                          if args.quantization in ("int8", "int4") else None)

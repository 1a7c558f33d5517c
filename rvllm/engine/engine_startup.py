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

    def __init__(self, kv_dtype: torch.dtype, int8: bool, multi_step: bool) -> None:
        super().__init__(name="rvllm-numba-warm-up", daemon=True)
        self.error: BaseException | None = None
        self.kv_dtype, self.int8, self.multi_step = kv_dtype, int8, multi_step
        self.start()

    def run(self) -> None:
        from rvllm.kernels.cpu import warm_up_numba

        start = time.perf_counter()
        try:
            warm_up_numba(self.kv_dtype, self.int8, self.multi_step)
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
                    kv_dtype: torch.dtype, int8: bool, multi_step: bool
                    ) -> tuple[str, KernelWarmUp | None]:
    """Choose the kernel backend and, for Triton, compile and check every kernel against
    its reference once, so a broken kernel stops start-up instead of corrupting output.
    The numba kernels start loading from numba's cache (or compiling) on a thread: join
    it before the first step."""
    from rvllm.layers.backend import resolve_kernel_backend, set_kernel_backend

    backend = resolve_kernel_backend(requested, device, dtype)
    # Only the forms this engine runs: each one loaded is start-up time.
    warming = KernelWarmUp(kv_dtype, int8, multi_step) if backend == "numba" else None
    if backend == "triton":
        from rvllm.kernels.triton import check_kernels

        start = time.perf_counter()
        checked = check_kernels(device, dtype)
        logger.info("checked %d Triton kernels against their references in %.1fs",
                    len(checked), time.perf_counter() - start)
    set_kernel_backend(backend)
    return backend, warming


def check_scheduler_steps(args: EngineArgs, kernel_backend: str) -> None:
    """Multi-step decoding runs only in the CPU's compiled decode (numba kernels, one
    rank): refuse it elsewhere rather than ignore it."""
    if args.num_scheduler_steps > 1 and (kernel_backend != "numba"
                                         or args.tensor_parallel_size > 1):
        raise ValueError(
            f"num_scheduler_steps={args.num_scheduler_steps} needs the CPU's numba decode "
            f"path on one rank; this engine runs the {kernel_backend} kernels with "
            f"tensor_parallel_size={args.tensor_parallel_size}. Leave it at 1.")


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
                           args.num_scheduler_steps)

"""Kernels, each in its own module beside the plain-torch reference it must match:
Triton kernels for the GPU path, and numba kernels for the CPU (``cpu_*.py``).

The kernel modules import triton or numba, so import them directly where their path is
chosen (``from rvllm.kernels.decode_attention import paged_decode_attention``); this
package itself imports without either.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterable

import torch

KERNEL_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding_with_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "silu_and_mul",
    "greedy_sample",
)


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` for the attention kernels' ``tl.dot``: full float32 ("ieee")
    for float32 inputs, so the float32 path matches the reference token for token (Triton
    would otherwise round them to TF32 on a GPU); half-precision inputs are unaffected."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Per calling thread: torch's thread count when last matched, and numba's count then.
_matched = threading.local()


def match_torch_threads() -> int:
    """Give numba's kernels as many threads as torch has in the calling thread, and
    return that count (what a kernel takes as its thread count). Both counts are per
    calling thread, and torch's is set per process (a tensor-parallel rank, a
    data-parallel replica: a share of the cores), so the thread that steps the engine
    checks once per decode step (``cpu_decode_attention.step_arrays``). When torch's
    count is the one this thread last matched, numba is not asked again: the two calls
    into numba cost 20-30 us of a one-row decode step, run on code that the step's
    weights had pushed out of the caches (this package alone sets numba's count)."""
    torch_threads = torch.get_num_threads()
    known = getattr(_matched, "counts", None)
    if known is not None and known[0] == torch_threads:
        return known[1]
    import numba

    want = min(torch_threads, numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)
    _matched.counts = (torch_threads, want)
    return want


def warm_up_numba(kv_dtype: torch.dtype = torch.float32, int8: bool = True,
                  multi_step: bool = False, float32: bool = True) -> None:
    """Compile (or load from numba's cache) the CPU's numba kernels on tiny inputs, for a
    KV cache of ``kv_dtype`` and (``int8``) int8 weights as well as float32 ones, and the
    multi-step decode (``multi_step``), so the first decode step does not pay for it.
    Each form loaded costs start-up time. Without ``float32``: only the int8 weights'
    forms (and int8 quantization), which another process may compile meanwhile
    (``scripts/setup.sh``)."""
    from rvllm.kernels import cpu_dequant

    if float32:
        cpu_dequant.warm_up()  # first, even before the other modules' imports (0.05-0.07
        # s): a GGUF model's loading waits for these
    from rvllm.kernels import (
        cpu_batch_step,
        cpu_decode_attention,
        cpu_decoder_step,
        cpu_f32_gemm,
        cpu_gemv,
        cpu_greedy,
        cpu_int8_gemm,
        cpu_prefill_attention,
        cpu_quantize,
    )

    if int8:
        cpu_quantize.warm_up()  # then its int8 quantization
        cpu_int8_gemm.warm_up()
    if float32:
        cpu_decode_attention.warm_up(kv_dtype)
        cpu_prefill_attention.warm_up()
        cpu_f32_gemm.warm_up()
    cpu_gemv.warm_up(int8, float32)
    cpu_decoder_step.warm_up(kv_dtype, int8, float32)
    cpu_batch_step.warm_up(kv_dtype, int8, float32)
    if float32:
        cpu_greedy.warm_up()
    if multi_step:
        from rvllm.kernels import cpu_decode_steps

        cpu_decode_steps.warm_up(kv_dtype, int8, float32)


# (device, dtype, kernel) already checked in this process: once is enough.
_CHECKED: set[tuple[str, torch.dtype, str]] = set()


def check_kernels(device: torch.device | str, dtype: torch.dtype,
                  kernels: Iterable[str] | None = None) -> list[str]:
    """Compile each kernel (all, or those named) and compare it with its reference on a
    small input, once per process; returns the names checked.

    Raises RuntimeError naming the kernel and what to do when triton is missing, a
    kernel fails to compile or run, or its output does not match.
    """
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError(
            "The Triton kernels need the `triton` package, which is not installed: "
            "`pip install triton` (the version your PyTorch build pins), or use the "
            "plain-torch path."
        )
    from rvllm.kernels.check import run_check

    names = list(KERNEL_NAMES if kernels is None else kernels)
    for name in names:
        key = (str(device), dtype, name)
        if key not in _CHECKED:
            run_check(name, torch.device(device), dtype)
            _CHECKED.add(key)
    return names

"""The GPU's kernels, in Triton (``--kernel-backend triton``), each beside the plain-torch
reference it must match, and run in Triton's interpreter on the CPU for tests
(``TRITON_INTERPRET=1``):
  ``rms_norm``           RMSNorm and fused residual add + RMSNorm
  ``rotary_kv``          RoPE fused with the paged KV-cache write
  ``decode_attention``   paged decode attention (split-KV)
  ``prefill_attention``  paged prefill attention over a cached prefix
  ``activation``         SiLU * mul
  ``greedy``             argmax sampling
  ``w4a16``              int4 weight-only linear layers (GEMV and GEMM, split-K)
  ``fp8_linear``         FP8 (E4M3) weight-only linear layers
  ``kv_fp8``             the FP8 KV cache's scales (plain torch; the kernels above read it)
  ``fused_gemv``         decode GEMVs with RMSNorm or SiLU * mul folded in (--fused-decode-gemv)
  ``check``              the start-up self-check of each against its reference

The kernel modules import triton, so import them where their path is chosen; this
package itself imports without it.
"""

from __future__ import annotations

import importlib.util
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
# Checked only by engines that run them (pass them as ``kernels``): the GPU's quantized
# linear layers (--quantization int4 | fp8), the FP8 KV cache (--kv-cache-dtype fp8) and
# the fused decode GEMVs (--fused-decode-gemv).
OPTIONAL_KERNEL_NAMES = {
    "int4": ("w4a16_linear",),
    "fp8": ("fp8_linear",),
    "fp8_kv_cache": ("fp8_kv_cache",),
    "fused_gemv": ("fused_gemv",),
}

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
    from rvllm.kernels.triton.check import run_check

    names = list(KERNEL_NAMES if kernels is None else kernels)
    for name in names:
        key = (str(device), dtype, name)
        if key not in _CHECKED:
            run_check(name, torch.device(device), dtype)
            _CHECKED.add(key)
    return names

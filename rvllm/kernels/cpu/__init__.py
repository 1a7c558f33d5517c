"""The CPU's kernels, compiled with numba (``--kernel-backend numba``, the CPU's default
in float32). Each module says what it computes and which measured number justifies it;
each has a plain-torch reference it is tested against (``tests/test_cpu_*.py``,
``tests/test_layers.py``).

Building blocks:
  ``vectors``       16-lane vector code in LLVM IR (dot products, scores, value runs)
  ``numerics``      exp, max, prefetch, KV-cache element access (float32 / bfloat16 bits)
  ``sync``          work claimed in phases inside one parallel region
  ``threads``       numba's thread count matched to torch's
  ``numba_cache``   numba's on-disk cache, checked against every kernel's source
Linear layers over weights kept in 16-row panels:
  ``gemv``          one-row GEMV at the memory's bandwidth; the panels themselves
  ``f32_gemm``      float32 GEMMs over the same panels
  ``int8_gemm``     int8 weights' GEMMs (activations at 16 bits per row)
  ``quantize``      float32 -> int8 per-row weights
  ``dequant``       GGUF blocks -> float32
Attention over the paged KV cache:
  ``decode_attention``, ``prefill_attention``
Whole steps (a model hands them a plan of arrays and addresses: ``models/cpu_step.py``):
  ``decoder_step``  a decode step of a few rows through every layer in one call
  ``decode_steps``  K greedy decode steps in one call (``--num-scheduler-steps``)
  ``batch_step``    the kernels between the GEMMs of a wider step
  ``step_parts``    pieces the steps share (norms, RoPE, the LM head's greedy merge)
  ``greedy``        argmax and its logprob in one pass over each row of logits

Import the kernel modules where their path is chosen: this package itself imports no
numba.
"""

from __future__ import annotations

import torch


def warm_up_numba(kv_dtype: torch.dtype = torch.float32, int8: bool = True,
                  multi_step: bool = False, float32: bool = True,
                  packed: bool = False) -> None:
    """Compile (or load from numba's cache) the CPU's numba kernels on tiny inputs, for a
    KV cache of ``kv_dtype`` and (``int8``) int8 weights as well as float32 ones, packed
    GGUF weights (``packed``), and the multi-step decode (``multi_step``), so the first
    decode step does not pay for it.
    Each form loaded costs start-up time. Without ``float32``: only the int8 weights'
    forms (and int8 quantization), which another process may compile meanwhile
    (``scripts/setup.sh``)."""
    from rvllm.kernels.cpu import dequant

    if float32:
        dequant.warm_up()  # first, even before the other modules' imports (0.05-0.07
        # s): a GGUF model's loading waits for these
    from rvllm.kernels.cpu import (
        batch_step,
        decode_attention,
        decoder_step,
        f32_gemm,
        gemv,
        greedy,
        int8_gemm,
        prefill_attention,
        quantize,
    )

    if int8:
        quantize.warm_up()  # then its int8 quantization
        int8_gemm.warm_up()
    if float32:
        decode_attention.warm_up(kv_dtype)
        prefill_attention.warm_up()
        f32_gemm.warm_up()
    gemv.warm_up(int8, float32, packed)
    if packed:
        f32_gemm.warm_up_packed()
    decoder_step.warm_up(kv_dtype, int8, float32, packed)
    batch_step.warm_up(kv_dtype, int8, float32)
    if float32:
        greedy.warm_up()
    if multi_step:
        from rvllm.kernels.cpu import decode_steps

        decode_steps.warm_up(kv_dtype, int8, float32, packed)

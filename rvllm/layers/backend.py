"""Which kernels the layers run: plain torch, the Triton kernels of ``rvllm.kernels``, or
on the CPU the numba ones.

One choice per process, made at start-up (``--kernel-backend``) before the first forward
pass and logged. The numba backend (the CPU's default in float32) replaces decode
attention over the paged cache and one-row linear layers; everything else runs the
torch code. The Triton path replaces fused residual-add + RMSNorm, RoPE + KV-cache
write, paged decode and prefill attention, SiLU * mul and greedy sampling; with
``--fused-decode-gemv``, steps of up to four tokens on Llama-shaped layers also fold
each norm and SiLU * mul into the GEMV after it (``kernels.triton.fused_gemv``). Every layer
keeps its plain-torch code as the reference and for what the kernels do not cover
(Gemma's 1 + w norms, logit soft-capping on the Triton path, sampling with penalties
or logprobs).

The Triton kernels need a CUDA device, or ``TRITON_INTERPRET=1`` set before triton is first
imported, which runs them in Triton's interpreter on CPU tensors (slow; for tests).
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

logger = logging.getLogger("rvllm")

KERNEL_BACKENDS = ("auto", "torch", "triton", "numba")
_STATE = {"backend": "torch", "fused_gemv_rows": 0}


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_kernel_backend(requested: str, device: torch.device,
                           dtype: torch.dtype = torch.float32) -> str:
    """``auto`` is triton on a CUDA device when triton is installed, numba on the CPU in
    float32, else torch. Asking for a backend where it cannot run is an error that says
    what to do."""
    if requested not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend must be one of {KERNEL_BACKENDS}, got {requested!r}.")
    has_triton = importlib.util.find_spec("triton") is not None
    if requested == "auto":
        if device.type == "cuda":
            if not has_triton:
                logger.warning("triton is not installed: the plain-torch kernels run on the "
                               "GPU (pip install triton for the fused kernels)")
            return "triton" if has_triton else "torch"
        return "numba" if dtype == torch.float32 else "torch"
    if requested == "numba" and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError("--kernel-backend numba is the CPU's float32 kernels; this "
                         f"engine runs {dtype} on {device.type}. Use --kernel-backend auto.")
    if requested == "triton":
        if not has_triton:
            raise ValueError("--kernel-backend triton needs the `triton` package: pip install "
                             "triton (the version your PyTorch pins), or use --kernel-backend "
                             "torch.")
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError("--kernel-backend triton needs a CUDA device; on the CPU the "
                             "kernels run only in Triton's interpreter (TRITON_INTERPRET=1, "
                             "for tests). Use --kernel-backend torch.")
    return requested


def set_kernel_backend(name: str) -> None:
    if name not in KERNEL_BACKENDS[1:]:
        raise ValueError(f"set_kernel_backend takes one of {KERNEL_BACKENDS[1:]}, got {name!r}.")
    _STATE["backend"] = name


def use_triton() -> bool:
    return _STATE["backend"] == "triton"


def use_numba() -> bool:
    return _STATE["backend"] == "numba"


def set_fused_decode_gemv(max_rows: int) -> None:
    """``--fused-decode-gemv``: steps of up to ``max_rows`` tokens (0: none) fold each
    RMSNorm into the projection after it and SiLU * mul into the down projection (Triton
    path, Llama-shaped layers; ``kernels.triton.fused_gemv``)."""
    _STATE["fused_gemv_rows"] = int(max_rows)


def fused_decode_gemv_rows() -> int:
    """Tokens up to which a step takes the fused decode GEMVs; 0 where it does not."""
    return int(_STATE["fused_gemv_rows"]) if use_triton() else 0

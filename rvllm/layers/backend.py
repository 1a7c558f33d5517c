"""Which kernels the layers run: plain torch, or the Triton kernels of ``rvllm.kernels``.

One choice per process, made at start-up (``--kernel-backend``) before the first forward
pass and logged. The Triton path replaces fused residual-add + RMSNorm, RoPE + KV-cache
write, paged decode and prefill attention, SiLU * mul and greedy sampling; every layer
keeps its plain-torch code as the reference and for what the kernels do not cover (Gemma's
1 + w norms, logit soft-capping, sampling with penalties or logprobs).

The kernels need a CUDA device, or ``TRITON_INTERPRET=1`` set before triton is first
imported, which runs them in Triton's interpreter on CPU tensors (slow; for tests).
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

logger = logging.getLogger("rvllm")

KERNEL_BACKENDS = ("auto", "torch", "triton")
_STATE = {"backend": "torch"}


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_kernel_backend(requested: str, device: torch.device) -> str:
    """``auto`` is triton on a CUDA device when triton is installed, else torch. Asking for
    triton where it cannot run is an error that says what to do."""
    if requested not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend must be one of {KERNEL_BACKENDS}, got {requested!r}.")
    has_triton = importlib.util.find_spec("triton") is not None
    if requested == "auto":
        if device.type == "cuda" and not has_triton:
            logger.warning("triton is not installed: the plain-torch kernels run on the GPU "
                           "(pip install triton for the fused kernels)")
        return "triton" if device.type == "cuda" and has_triton else "torch"
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
    if name not in ("torch", "triton"):
        raise ValueError(f"set_kernel_backend takes torch or triton, got {name!r}.")
    _STATE["backend"] = name


def use_triton() -> bool:
    return _STATE["backend"] == "triton"

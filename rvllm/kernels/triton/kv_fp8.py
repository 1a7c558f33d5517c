"""The FP8 KV cache (``--kv-cache-dtype fp8``, CUDA with the Triton kernels): keys and
values stored as float8 E4M3, one float32 scale for the keys and one for the values of
each layer, ``stored = clamp(x / scale, -448, 448)`` rounded to nearest.

The scales are computed, not fixed at 1.0: a layer's first step with prefill tokens
after its cache is allocated (``Attention.kv_scale_pending``) sets them from that step's
new keys and values, ``max |k| * KV_SCALE_HEADROOM / 448`` (and the same for v), and they
stay fixed afterwards, as the cache holds values written with them. The keys are
measured before RoPE, which can grow a coordinate by up to sqrt(2); the headroom of 2
covers that and some growth in later prompts, at the cost of one of E4M3's 17 binades
of range at the small end (its relative precision, 3 mantissa bits, is the same at every
scale). Values past the range later saturate at +-448 * scale rather than overflow.

They live in a tensor of the layer's (``Attention.kv_scale``, [k_scale, v_scale] float32
on the GPU) that the kernels read through a pointer: CUDA graphs captured before the
first prefill (with the initial scales of 1) see the calibrated ones. The cache write
(``rotary_kv``) divides by them; the attention kernels (``decode_attention``,
``prefill_attention``) fold them into their arithmetic instead of dequantizing each
element: the key scale into the softmax scale, the value scale into the output.

This module is plain torch (the engine imports it without triton).
"""

from __future__ import annotations

import torch

KV_FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
KV_SCALE_HEADROOM = 2.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == KV_FP8_DTYPE


def new_kv_scale(device: torch.device | str) -> torch.Tensor:
    """A layer's [k_scale, v_scale], 1.0 until :func:`calibrate_kv_scale` sets them."""
    return torch.ones(2, dtype=torch.float32, device=device)


def calibrate_kv_scale(kv_scale: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Set ``kv_scale`` in place (graph-safe, no host sync) from new keys and values
    [T, Hk, D]: max |x| * KV_SCALE_HEADROOM / 448 each; 1.0 for all-zero inputs."""
    amax = torch.stack((k.detach().abs().amax(), v.detach().abs().amax())).float()
    kv_scale.copy_(torch.where(amax > 0, amax * (KV_SCALE_HEADROOM / FP8_MAX),
                               torch.ones_like(amax)))


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x (any float dtype) as stored in an FP8 cache under ``scale``: the reference for
    the kernels' write."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(KV_FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Float32 values of an FP8 cache's entries stored under ``scale``."""
    return x.float() * scale

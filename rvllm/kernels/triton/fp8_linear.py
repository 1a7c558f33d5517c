"""FP8 weight-only linear layers on the GPU (W8A16): weights stored as float8 E4M3 with
one float32 scale per output row, arithmetic in the activations' dtype.

``quantize_fp8_weight`` scales each row so its largest magnitude maps to E4M3's largest
finite value, 448, and rounds to nearest. The kernels read the weight as it is,
``torch.float8_e4m3fn`` [N, K] row-major (Triton's ``float8e4nv``), and widen it in
registers: every E4M3 value is exact in float16 and bfloat16, so the only rounding is
the quantization's. The row's scale does not depend on k, so it multiplies each output
once, after the sum: ``y[m, n] = scale[n] * sum_k x[m, k] q[n, k]``.

As for the int4 kernels (``w4a16``): a GEMV for a few rows (broadcast multiply-adds in
float32) and a ``tl.dot`` GEMM for more, both with split-K (``split_k``). Triton's
interpreter loads and stores float8 tensors itself (its float32-to-E4M3 rounding of
subnormals differs from a GPU's, which only quantizing, not these kernels, would meet),
so the weight stays in the float8 dtype on every path; no bit decoding. The E4M3
conversions need an sm_89 or newer GPU (Ada, Hopper).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rvllm.kernels.triton.decode_attention import dot_precision
from rvllm.kernels.triton.split_k import (
    gemm_tiles,
    reduce_partials,
    split_target,
    store_tile,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # E4M3's largest finite magnitude
# Rows up to which fp8_linear takes the GEMV (as w4a16.GEMV_MAX_ROWS).
GEMV_MAX_ROWS = 4


def quantize_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [N, K], scale float32 [N]) with ``w ~= q * scale[:, None]``: per
    output row, symmetric, scale = max |w_row| / 448 (rows of zeros get scale 1), round to
    nearest even, on w's device."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K, blocks_per_split,
    x_stride_m, w_stride_n, out_stride_s, out_stride_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
):
    split = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    kb = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride_n
    x_rows = x_ptr + m.to(tl.int64)[:, None] * x_stride_m
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = split * blocks_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + blocks_per_split * BLOCK_K, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + kb
        k_mask = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)  # [BN, BK]
        xv = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                     other=0.0).to(tl.float32)  # [BM, BK]
        acc += tl.sum(xv[:, None, :] * w[None, :, :], axis=2)
    acc *= tl.load(scale_ptr + n, mask=n_mask, other=0.0)[None, :]
    store_tile(acc, out_ptr, bias_ptr, m, n, m_mask, n_mask, split, out_stride_s,
               out_stride_m, HAS_BIAS, SPLIT)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K, blocks_per_split,
    x_stride_m, w_stride_n, out_stride_s, out_stride_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    split = tl.program_id(2)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    kb = tl.arange(0, BLOCK_K)
    w_cols = w_ptr + n.to(tl.int64)[None, :] * w_stride_n
    x_rows = x_ptr + m.to(tl.int64)[:, None] * x_stride_m
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = split * blocks_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + blocks_per_split * BLOCK_K, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + kb
        k_mask = kk < K
        xv = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                     other=0.0)  # [BM, BK]
        w = tl.load(w_cols + kk[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0).to(xv.dtype)  # [BK, BN]
        acc = tl.dot(xv, w, acc, input_precision=PRECISION)
    acc *= tl.load(scale_ptr + n, mask=n_mask, other=0.0)[None, :]
    store_tile(acc, out_ptr, bias_ptr, m, n, m_mask, n_mask, split, out_stride_s,
               out_stride_m, HAS_BIAS, SPLIT)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None, *, gemv_max_rows: int = GEMV_MAX_ROWS,
               split_k: int | None = None, block_n: int | None = None,
               block_k: int | None = None) -> torch.Tensor:
    """x [..., K] times the E4M3 weight [N, K] (scaled per row by ``scale`` [N] float32),
    transposed, + bias [N]: [..., N] in x's dtype. Knobs as ``w4a16.w4a16_linear``;
    ``block_k``: inputs per loop step (None: 256 / rows rounded up to a power of two for the
    GEMV, 64 for the GEMM)."""
    n, k = weight.shape
    if weight.dtype != FP8_DTYPE or weight.stride(1) != 1:
        raise ValueError("fp8_linear takes a row-major float8_e4m3fn weight "
                         "(quantize_fp8_weight's).")
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the fp8 weight takes {k}.")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out.view(*lead, n)
    gemv = rows <= gemv_max_rows
    if gemv:
        block_m, m_tiles = triton.next_power_of_2(rows), 1
        # The broadcast product is [BLOCK_M, BLOCK_N, BLOCK_K]: keep it at 8K elements.
        block_n, block_k = block_n or 32, block_k or 256 // block_m
    else:
        block_m, block_n, m_tiles = gemm_tiles(rows, block_n)
        block_k = block_k or 64
    n_tiles = triton.cdiv(n, block_n)
    split, per_split, target = split_target(split_k, m_tiles * n_tiles,
                                            triton.cdiv(k, block_k), out)
    args = (x2, weight, scale, bias if bias is not None else x2, target,
            rows, n, k, per_split, x2.stride(0), weight.stride(0),
            target.stride(0), target.stride(1))
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                HAS_BIAS=bias is not None, SPLIT=split > 1, num_warps=4)
    if gemv:
        _fp8_gemv_kernel[(n_tiles, split)](*args, **meta)
    else:
        _fp8_gemm_kernel[(m_tiles, n_tiles, split)](
            *args, PRECISION=dot_precision(x.dtype), **meta)
    if split > 1:
        reduce_partials(target, bias, out)
    return out.view(*lead, n)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch reference for ``fp8_linear``: the dequantized weight, float32
    throughout, rounded to x's dtype at the end."""
    w = weight.float() * scale.float()[:, None]
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)

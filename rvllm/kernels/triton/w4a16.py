"""Int4 weight-only linear layers on the GPU (W4A16): x W^T with 4-bit weights dequantized
in registers and the arithmetic in the activations' dtype.

The checkpoint's form (``models.int4_checkpoint.Int4Weight``) is q uint8 [N, K] holding
0..15, with a scale and a zero per ``group`` consecutive inputs of a row:
``w[n, k] = scale[n, k // group] * (q[n, k] - zero[n, k // group])``.
:func:`pack_w4a16` turns that into the layout the kernels read (:class:`W4A16Weight`):

- ``qweight`` int32 [N, K_pad / 8], eight nibbles a word. The inputs go in chunks of
  ``8 * plane`` (``plane`` = 32, or 16 for groups of 16 or 48); within chunk c, word
  ``c * plane + i`` holds in its nibble j (bits 4j..4j+3) input ``c * 8 * plane +
  j * plane + i``. So one load of ``plane`` words per row yields, nibble by nibble, eight
  "planes" of ``plane`` consecutive inputs each: every weight byte is read once, the
  activations they multiply are contiguous, and a plane lies inside one group (``group``
  is a multiple of ``plane``), so it needs one scale and one zero per row. K is padded
  with zero weights to a whole chunk.
- ``scale``, ``zero`` [groups, N], transposed so a plane's scales for a tile of rows are
  one contiguous load; float16 where that holds them (half the bytes: the scales and zeros
  then add 1/16 to the weight's traffic at group 128), else float32.

Two kernels, chosen by :func:`w4a16_linear` from the number of rows:

- a GEMV for a few rows (decode): each program multiplies a tile of ``BLOCK_N`` weight
  rows by every input row with broadcast multiply-adds in float32 (no tensor cores, which
  few rows cannot fill), the scale and zero factored out of each plane's sum:
  ``sum_k x_k s (q_k - z) = s (sum_k x_k q_k - z sum_k x_k)``;
- a GEMM for more rows: each plane is dequantized to the activations' dtype as a
  [plane, BLOCK_N] tile and fed to ``tl.dot``, eight dots per chunk.

Both split the reduction over K when the output tiles alone would leave the GPU idle
(``split_k``). The nibbles become floats without an int-to-float conversion, which runs
at a quarter of the float rate and would bound the GEMV: ``q | 0x4B000000`` is the
float32 bit pattern of 2^23 + q.
"""

from __future__ import annotations

from dataclasses import dataclass

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

# Rows up to which w4a16_linear takes the GEMV: past a few rows its float32 multiply-adds
# per weight, not the weight's bytes, would bound it, and tl.dot's tiles of 16 rows win.
GEMV_MAX_ROWS = 4
_PACK_ROWS = 4096
_FP16_NORMAL_MIN = 2.0**-14
_FP16_MAX = 65504.0


@dataclass(slots=True)
class W4A16Weight:
    """A packed int4 weight (module docstring): ``qweight`` int32 [N, K_pad // 8];
    ``scale``, ``zero`` [groups_pad, N] float16 or float32; ``group`` inputs per scale;
    ``in_features`` K and ``out_features`` N of the unpadded weight; ``plane`` inputs per
    nibble plane (a chunk is ``8 * plane`` inputs)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int
    in_features: int
    out_features: int
    plane: int

    @property
    def num_chunks(self) -> int:
        return self.qweight.shape[1] // self.plane

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.qweight, self.scale, self.zero))


def plane_for_group(group: int) -> int:
    """Inputs per nibble plane: 32 where the group is a multiple of 32, else 16."""
    if group <= 0 or group % 16:
        raise ValueError(f"int4 group size must be a positive multiple of 16, got {group}.")
    return 32 if group % 32 == 0 else 16


def _scale_dtype(scale: torch.Tensor, zero: torch.Tensor) -> torch.dtype:
    """float16 when it holds every scale as a normal number and every zero exactly
    (checkpoints' zeros are integers 0..15), else float32."""
    s = scale.abs().float()
    s = s[s > 0]
    fits = bool(s.numel() == 0 or (s.min() >= _FP16_NORMAL_MIN and s.max() <= _FP16_MAX))
    z = zero.float()
    exact = bool((z.abs().max() <= _FP16_MAX) and torch.equal(z.half().float(), z))
    return torch.float16 if fits and exact else torch.float32


def pack_w4a16(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
               scale_dtype: torch.dtype | None = None) -> W4A16Weight:
    """The kernels' layout of an int4 weight: q uint8 [N, K] (0..15, one value a byte),
    scale and zero [N, K // group] (``w = scale * (q - zero)``). ``scale_dtype``: float16
    or float32 for the packed scales and zeros (None: float16 where exact enough, see
    :func:`_scale_dtype`). Runs on q's device."""
    if q.dim() != 2:
        raise ValueError(f"int4 weight must be [N, K], got shape {tuple(q.shape)}.")
    n, k = q.shape
    plane = plane_for_group(group)
    if k % group:
        raise ValueError(f"int4 weight of {k} inputs is not a whole number of groups of "
                         f"{group}.")
    groups = k // group
    if scale.shape != (n, groups) or zero.shape != (n, groups):
        raise ValueError(f"int4 scale and zero must be [{n}, {groups}], got "
                         f"{tuple(scale.shape)} and {tuple(zero.shape)}.")
    if q.numel() and int(q.max()) > 15:
        raise ValueError("int4 weight values must lie in 0..15.")
    chunk = 8 * plane
    k_pad = triton.cdiv(k, chunk) * chunk
    groups_pad = triton.cdiv(k_pad, group)
    qweight = torch.empty(n, k_pad // 8, dtype=torch.int32, device=q.device)
    for r in range(0, n, _PACK_ROWS):  # int64 temporaries of a slice of rows at a time
        qp = F.pad(q[r:r + _PACK_ROWS].to(torch.int64), (0, k_pad - k))
        qp = qp.view(qp.shape[0], k_pad // chunk, 8, plane)
        words = torch.zeros(qp.shape[0], k_pad // chunk, plane, dtype=torch.int64,
                            device=q.device)
        for j in range(8):
            words |= qp[:, :, j] << (4 * j)
        words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement int32
        qweight[r:r + _PACK_ROWS] = words.view(-1, k_pad // 8)
    dtype = scale_dtype or _scale_dtype(scale, zero)

    def columns(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t.float(), (0, groups_pad - groups)).t().contiguous().to(dtype)

    return W4A16Weight(qweight, columns(scale), columns(zero), group, k, n, plane)


def unpack_w4a16(packed: W4A16Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K], scale float32 [N, K // group], zero float32 [N, K // group]) back
    from the packed form; for tests and for moving a packed weight elsewhere."""
    n, k, plane = packed.out_features, packed.in_features, packed.plane
    words = packed.qweight.to(torch.int64).view(n, -1, 1, plane)
    shifts = (4 * torch.arange(8, device=words.device)).view(1, 1, 8, 1)
    q = ((words >> shifts) & 15).reshape(n, -1)[:, :k].to(torch.uint8)
    groups = k // packed.group
    return (q, packed.scale[:groups].t().float().contiguous(),
            packed.zero[:groups].t().float().contiguous())


@triton.jit
def _nibbles(words, j: tl.constexpr):
    """Nibble j of each int32 word as float32 (exact): 2^23 + q reinterpreted, less 2^23."""
    bits = ((words >> (4 * j)) & 0xF) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qweight_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr,
    M, N, K, num_chunks, chunks_per_split,
    x_stride_m, qweight_stride_n, out_stride_s, out_stride_m,
    GROUP: tl.constexpr, PLANE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
):
    split = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    i = tl.arange(0, PLANE)
    row_ptrs = qweight_ptr + n.to(tl.int64)[:, None] * qweight_stride_n + i[None, :]
    x_rows = x_ptr + m.to(tl.int64)[:, None] * x_stride_m
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    c_lo = split * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, num_chunks)
    for c in range(c_lo, c_hi):
        words = tl.load(row_ptrs + c * PLANE, mask=n_mask[:, None], other=0)  # [BN, PLANE]
        for j in tl.static_range(8):
            k0 = (c * 8 + j) * PLANE
            g = k0 // GROUP
            s = tl.load(scale_ptr + g * N + n, mask=n_mask, other=0.0).to(tl.float32)
            z = tl.load(zero_ptr + g * N + n, mask=n_mask, other=0.0).to(tl.float32)
            kk = k0 + i
            xv = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :],
                         other=0.0).to(tl.float32)  # [BM, PLANE]
            q = _nibbles(words, j)
            xq = tl.sum(xv[:, None, :] * q[None, :, :], axis=2)  # [BM, BN]
            x_sum = tl.sum(xv, axis=1)
            acc += s[None, :] * (xq - x_sum[:, None] * z[None, :])
    store_tile(acc, out_ptr, bias_ptr, m, n, m_mask, n_mask, split, out_stride_s,
               out_stride_m, HAS_BIAS, SPLIT)


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, qweight_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr,
    M, N, K, num_chunks, chunks_per_split,
    x_stride_m, qweight_stride_n, out_stride_s, out_stride_m,
    GROUP: tl.constexpr, PLANE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    split = tl.program_id(2)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    i = tl.arange(0, PLANE)
    col_ptrs = qweight_ptr + n.to(tl.int64)[None, :] * qweight_stride_n + i[:, None]
    x_rows = x_ptr + m.to(tl.int64)[:, None] * x_stride_m
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    c_lo = split * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, num_chunks)
    for c in range(c_lo, c_hi):
        words = tl.load(col_ptrs + c * PLANE, mask=n_mask[None, :], other=0)  # [PLANE, BN]
        for j in tl.static_range(8):
            k0 = (c * 8 + j) * PLANE
            g = k0 // GROUP
            s = tl.load(scale_ptr + g * N + n, mask=n_mask, other=0.0).to(tl.float32)
            z = tl.load(zero_ptr + g * N + n, mask=n_mask, other=0.0).to(tl.float32)
            kk = k0 + i
            xv = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :],
                         other=0.0)  # [BM, PLANE]
            w = ((_nibbles(words, j) - z[None, :]) * s[None, :]).to(xv.dtype)
            acc = tl.dot(xv, w, acc, input_precision=PRECISION)
    store_tile(acc, out_ptr, bias_ptr, m, n, m_mask, n_mask, split, out_stride_s,
               out_stride_m, HAS_BIAS, SPLIT)


def w4a16_linear(x: torch.Tensor, packed: W4A16Weight, bias: torch.Tensor | None = None,
                 *, gemv_max_rows: int = GEMV_MAX_ROWS, split_k: int | None = None,
                 block_n: int | None = None) -> torch.Tensor:
    """x [..., K] times the int4 weight, transposed (+ bias [N]): [..., N] in x's dtype.

    At most ``gemv_max_rows`` rows take the GEMV, more the ``tl.dot`` GEMM.
    ``split_k``: slices of the reduction (None: enough to fill the GPU, ``split_k``
    module); ``block_n``: output features per program (None: 32 for the GEMV, 64 or 128
    for the GEMM). Float32 activations compute in full float32 (no TF32)."""
    k, n = packed.in_features, packed.out_features
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the int4 weight takes {k}.")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out.view(*lead, n)
    num_chunks = packed.num_chunks
    gemv = rows <= gemv_max_rows
    if gemv:
        block_m, block_n, m_tiles = triton.next_power_of_2(rows), block_n or 32, 1
    else:
        block_m, block_n, m_tiles = gemm_tiles(rows, block_n)
    n_tiles = triton.cdiv(n, block_n)
    split, per_split, target = split_target(split_k, m_tiles * n_tiles, num_chunks, out)
    args = (x2, packed.qweight, packed.scale, packed.zero,
            bias if bias is not None else x2, target,
            rows, n, k, num_chunks, per_split,
            x2.stride(0), packed.qweight.stride(0), target.stride(0), target.stride(1))
    meta = dict(GROUP=packed.group, PLANE=packed.plane, BLOCK_M=block_m, BLOCK_N=block_n,
                HAS_BIAS=bias is not None, SPLIT=split > 1, num_warps=4)
    if gemv:
        _w4a16_gemv_kernel[(n_tiles, split)](*args, **meta)
    else:
        _w4a16_gemm_kernel[(m_tiles, n_tiles, split)](
            *args, PRECISION=dot_precision(x.dtype), **meta)
    if split > 1:
        reduce_partials(target, bias, out)
    return out.view(*lead, n)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int
                    ) -> torch.Tensor:
    """The float32 weight [N, K] of an unpacked int4 weight: scale * (q - zero) per group."""
    return ((q.float() - zero.float().repeat_interleave(group, dim=1))
            * scale.float().repeat_interleave(group, dim=1))


def w4a16_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    zero: torch.Tensor, group: int, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Plain-torch reference for ``w4a16_linear`` on the unpacked weight (q uint8 [N, K],
    scale and zero [N, K // group]): float32 throughout, rounded to x's dtype at the end."""
    y = F.linear(x.float(), dequantize_int4(q, scale, zero, group),
                 None if bias is None else bias.float())
    return y.to(x.dtype)

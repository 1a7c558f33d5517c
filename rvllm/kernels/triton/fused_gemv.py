"""Decode GEMVs with the op in front of them folded in: RMSNorm (with the residual add) in
front of the QKV and gate/up projections, SiLU * mul in front of the down projection.

At one to four rows a decode step's linear layers stream their weights once, and the
small ops between them (the norm, the activation) are launches of their own that read
and write a row each. Here those ops run inside the GEMV, on the input tile each program
loads: the layer's norm and activation stop being separate kernels.

- ``norm_gemv``: ``(norm(x + residual) * w_norm) W^T`` and ``x + residual``. Each
  program first sums the squares of the whole row (a few KB, from L2), then normalizes
  each input tile before its multiply-adds; the first column of programs also writes the
  new residual.
- ``silu_mul_gemv``: ``(silu(gate) * up) W^T`` with gate and up side by side in x.

Each element is rounded exactly as the separate kernels round it (``rms_norm``,
``activation``), so the GEMV's input is bit for bit theirs; the multiply-adds are float32
broadcasts, in a different order from cuBLAS (not bit-identical to it; tested against a
float32 reference). A program covers ``BLOCK_N`` outputs over all of K: no split, no
second kernel, and ``BLOCK_N`` shrinks until the grid fills the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rvllm.kernels.triton.rms_norm import _rows
from rvllm.kernels.triton.split_k import PROGRAMS_PER_SM, num_sms

# Rows up to which a step takes the fused GEMVs (as the int4 GEMV, ``w4a16``): past a few
# rows their broadcast multiply-adds, not the weight's bytes, would bound them.
MAX_ROWS = 4

_NONE, _NORM, _SILU_MUL = 0, 1, 2


@triton.jit
def _fused_gemv_kernel(
    x_ptr, residual_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, residual_out_ptr,
    M, N, K, eps,
    x_stride, residual_stride, w_stride, out_stride, residual_out_stride,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    k_range = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * x_stride
    residual_rows = residual_ptr + m.to(tl.int64)[:, None] * residual_stride
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride
    dtype = x_ptr.dtype.element_ty

    rstd = tl.zeros([BLOCK_M], tl.float32)
    if PROLOGUE == 1:
        squares = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k_range
            mask = m_mask[:, None] & (kk < K)[None, :]
            v = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(residual_rows + kk[None, :], mask=mask, other=0.0)
                v = (v.to(tl.float32) + r.to(tl.float32)).to(dtype)
            vf = v.to(tl.float32)
            squares += tl.sum(vf * vf, axis=1)
        rstd = 1.0 / tl.sqrt(squares / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k_range
        k_mask = kk < K
        mask = m_mask[:, None] & k_mask[None, :]
        if PROLOGUE == 1:
            v = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(residual_rows + kk[None, :], mask=mask, other=0.0)
                v = (v.to(tl.float32) + r.to(tl.float32)).to(dtype)
                if pid_n == 0:
                    tl.store(residual_out_ptr + m.to(tl.int64)[:, None] * residual_out_stride
                             + kk[None, :], v, mask=mask)
            # As the rms_norm kernel: normalized, rounded, times the weight, rounded.
            normed = (v.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
            nw = tl.load(norm_w_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            xv = (normed * nw[None, :]).to(dtype).to(tl.float32)
        elif PROLOGUE == 2:
            gate = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
            up = tl.load(x_rows + K + kk[None, :], mask=mask, other=0.0)
            g = gate.to(tl.float32)
            # As the silu_and_mul kernel: silu rounded, then the product rounded.
            silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            xv = (silu * up.to(tl.float32)).to(dtype).to(tl.float32)
        else:
            xv = tl.load(x_rows + kk[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)  # [BN, BK]
        acc += tl.sum(xv[:, None, :] * w[None, :, :], axis=2)  # [BM, BN]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + m.to(tl.int64)[:, None] * out_stride + n[None, :]
    tl.store(out_ptrs, acc.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


def choose_block_n(n: int, device: torch.device) -> int:
    """Outputs per program: the largest of 32, 16, 8, 4 whose grid still gives about
    ``PROGRAMS_PER_SM`` programs per SM (4 where even 4 does not)."""
    want = PROGRAMS_PER_SM * num_sms(device)
    for block in (32, 16, 8):
        if triton.cdiv(n, block) >= want:
            return block
    return 4


def _launch(prologue: int, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            k: int, residual2: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            block_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows = x2.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"the fused GEMVs take at most {MAX_ROWS} rows, got {rows}.")
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, {k}] with dense rows, got {tuple(weight.shape)}.")
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x2.dtype, device=x2.device)
    residual_out = torch.empty_like(x2) if residual2 is not None else None
    if rows == 0 or n == 0:
        return out, residual_out
    block_n = block_n or choose_block_n(n, x2.device)
    block_m = triton.next_power_of_2(rows)
    # Keep the [BM, BN, BK] product to about 4K float32s: 32 registers a thread.
    block_k = max(32, min(triton.next_power_of_2(k), 4096 // (block_m * block_n)))
    _fused_gemv_kernel[(triton.cdiv(n, block_n),)](
        x2, residual2 if residual2 is not None else x2,
        norm_weight if norm_weight is not None else x2, weight,
        bias if bias is not None else x2, out,
        residual_out if residual_out is not None else out,
        rows, n, k, eps,
        x2.stride(0), residual2.stride(0) if residual2 is not None else 0, weight.stride(0),
        out.stride(0), residual_out.stride(0) if residual_out is not None else 0,
        PROLOGUE=prologue, HAS_RESIDUAL=residual2 is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out, residual_out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         *, block_n: int | None = None) -> torch.Tensor:
    """x [rows <= MAX_ROWS, K] W^T (+ bias): the plain GEMV, for timing the fused ones
    against."""
    x2 = _rows(x)
    return _launch(_NONE, x2, weight, bias, x2.shape[1], block_n=block_n)[0]


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
              eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
              *, block_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * norm_weight) W^T (+ bias), and x + residual (x itself without
    ``residual``); x [rows <= MAX_ROWS, K]. Inputs are not modified."""
    x2 = _rows(x)
    residual2 = _rows(residual) if residual is not None else None
    out, residual_out = _launch(_NORM, x2, weight, bias, x2.shape[1], residual2,
                                norm_weight, eps, block_n)
    return out, residual_out if residual_out is not None else x2


def silu_mul_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  *, block_n: int | None = None) -> torch.Tensor:
    """(silu(gate) * up) W^T (+ bias) for x = [gate | up]: [rows <= MAX_ROWS, 2 K]."""
    x2 = _rows(x)
    return _launch(_SILU_MUL, x2, weight, bias, x2.shape[1] // 2, block_n=block_n)[0]


def norm_gemv_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                  eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference for ``norm_gemv``: the Triton path's norm kernel's rounding,
    then a float32 matmul rounded to x's dtype."""
    from rvllm.kernels.triton.rms_norm import fused_add_rms_norm_ref, rms_norm_ref

    if residual is None:
        normed, residual_out = rms_norm_ref(x, norm_weight, eps), x
    else:
        normed, residual_out = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    return _linear_ref(normed, weight, bias), residual_out


def silu_mul_gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Plain-torch reference for ``silu_mul_gemv``."""
    from rvllm.kernels.triton.activation import silu_and_mul_ref

    return _linear_ref(silu_and_mul_ref(x), weight, bias)


def _linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)

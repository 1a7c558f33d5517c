"""RMSNorm, optionally with the residual add fused in front, as one Triton kernel.

One program per row; the whole row sits in registers, so the add, the float32
statistics and the weight multiply read and write each element once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    x_stride, residual_stride, out_stride, residual_out_stride,
    hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        # Rounded to the model dtype before the statistics, as the torch path does.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * residual_out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden_size + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (normed * weight).to(x.dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, hidden] with a dense last dimension (the kernel's addressing)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty_like(x2)
    residual2 = residual_out = None
    if residual is not None:
        residual2 = _rows(residual)
        residual_out = torch.empty_like(x2)
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, residual2 if residual2 is not None else x2, weight, out,
        residual_out if residual_out is not None else out,
        x2.stride(0), residual2.stride(0) if residual2 is not None else 0, out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0,
        hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(max(block // 512, 1), 8),
    )
    if residual_out is not None:
        residual_out = residual_out.view(x.shape)
    return out.view(x.shape), residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x) * weight over the last dimension; float32 statistics, output in x's dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual), in one pass; inputs are not modified."""
    out, residual_out = _launch(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-torch reference for ``rms_norm`` (the arithmetic of layers.norm.RMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference for ``fused_add_rms_norm``."""
    x = residual + x
    return rms_norm_ref(x, weight, eps), x

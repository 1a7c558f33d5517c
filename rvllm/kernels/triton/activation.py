"""SiLU(gate) * up for gated MLPs, as one Triton kernel.

The gate_up projection writes gate and up side by side in the last dimension;
reading both halves in one pass saves the two intermediates torch would make.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # silu is rounded to the model dtype before the multiply, as in the torch path.
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x: [..., 2 * d] (gate then up) -> silu(gate) * up: [..., d]."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(block, triton.next_power_of_2(d))
    grid = (x2.shape[0], triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), d, BLOCK=block,
                               num_warps=4)
    return out.view(*x.shape[:-1], d)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference for ``silu_and_mul`` (layers.activation.SiluAndMul)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

"""Split-K for the weight-only quantized linear kernels (``w4a16``, ``fp8_linear``).

A decode step multiplies one or a few rows by each weight: a grid over output tiles
alone leaves most of the GPU's SMs idle for the narrower projections (a 7B model's
3584 outputs are 112 tiles of 32 on 132 SMs, one pass of the weight's bytes), and those
kernels are bound by how fast the weight streams in. Cutting the reduction dimension
into ``split`` slices gives ``split`` times the programs; each writes its float32
partial sum and :func:`reduce_partials` adds them up (and the bias) in a second kernel,
in a fixed order, so results do not depend on scheduling as atomics would.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Programs a split-K launch aims for per SM: a few resident programs per SM keep enough
# weight loads in flight to cover the memory's latency.
PROGRAMS_PER_SM = 4


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 4 elsewhere (Triton's interpreter, where only the result of
    a split matters, not its speed)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_split(tiles: int, steps: int, device: torch.device) -> int:
    """Slices of the reduction for a grid of ``tiles`` output tiles whose reduction is
    ``steps`` loop iterations: enough for about ``PROGRAMS_PER_SM`` programs per SM, at
    most one per iteration."""
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms(device), max(tiles, 1))
    return max(1, min(want, steps))


@triton.jit
def _reduce_kernel(
    partial_ptr, bias_ptr, out_ptr, N, split, partial_stride_s, partial_stride_m,
    out_stride_m,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for s in range(split):
        acc += tl.load(partial_ptr + s * partial_stride_s + row * partial_stride_m + n,
                       mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride_m + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def reduce_partials(partial: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
                    ) -> torch.Tensor:
    """out [M, N] = sum over s of partial [split, M, N] (float32), + bias [N]; in out's dtype."""
    split, rows, n = partial.shape
    block = min(1024, triton.next_power_of_2(n))
    _reduce_kernel[(rows, triton.cdiv(n, block))](
        partial, bias if bias is not None else partial, out, n, split,
        partial.stride(0), partial.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block, num_warps=4,
    )
    return out

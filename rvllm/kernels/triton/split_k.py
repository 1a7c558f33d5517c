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


def split_target(split_k: int | None, tiles: int, steps: int, out: torch.Tensor
                 ) -> tuple[int, int, torch.Tensor]:
    """(split, loop iterations per slice, what the kernel writes) for a launch over
    ``tiles`` output tiles whose reduction is ``steps`` iterations, into ``out`` [M, N]:
    ``split_k`` slices (None: ``choose_split``'s), as many as the iterations cut evenly
    into need. Split, the kernel writes float32 partial sums [split, M, N] that
    ``reduce_partials`` adds up; else ``out`` itself, as [1, M, N]."""
    split = split_k or choose_split(tiles, steps, out.device)
    per_split = triton.cdiv(steps, max(1, min(split, steps)))
    split = triton.cdiv(steps, per_split)
    if split == 1:
        return split, per_split, out.unsqueeze(0)
    rows, n = out.shape
    return split, per_split, torch.empty(split, rows, n, dtype=torch.float32,
                                         device=out.device)


def gemm_tiles(rows: int, block_n: int | None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, row tiles) of the quantized kernels' ``tl.dot`` GEMMs: tiles of
    16 to 64 rows, 64 or 128 outputs unless ``block_n`` says."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    return block_m, block_n or (64 if rows <= 64 else 128), triton.cdiv(rows, block_m)


@triton.jit
def store_tile(acc, out_ptr, bias_ptr, m, n, m_mask, n_mask, split, out_stride_s,
               out_stride_m, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """A program's float32 sums [BLOCK_M, BLOCK_N] for rows ``m`` and outputs ``n``:
    under split-K its slice's partial sums at ``split`` (``reduce_partials`` adds them up
    and the bias), else with the bias added, in the output's dtype."""
    mask = m_mask[:, None] & n_mask[None, :]
    ptrs = out_ptr + m.to(tl.int64)[:, None] * out_stride_m + n[None, :]
    if SPLIT:
        tl.store(ptrs + split * out_stride_s, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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

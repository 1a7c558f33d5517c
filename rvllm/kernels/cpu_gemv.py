"""Matrix-vector products for decode on the CPU, compiled with numba.

A decode step of one sequence multiplies one row of activations by every weight matrix:
the time is the time to read the weights. oneDNN's packed GEMM and fbgemm read them at
about 10 GB/s at one row on this class of CPU; a plain loop over the row-major weight,
one output row after another, streams them at the memory bandwidth (20-25 GB/s here).
So a linear layer with this path keeps its weight row-major beside the packed copy
(``layers.cpu_linear``), and one-row inputs come here.

- ``gemv_f32``: float32 weight [N, K].
- ``gemv_int8``: int8 weight [N, K] with one float32 scale per output row; the
  activations stay float32 (each weight widened in registers), so this computes exactly
  ``F.linear(x, q.float() * scale[:, None])`` up to summation order.

Output rows are shared out in chunks over numba's threads. Float32 accumulation with
``fastmath``: the same numbers as ``F.linear`` up to the order of the sums.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

# Output rows per parallel work item: enough to amortise the scheduling, few enough to
# balance two threads on the smallest projections (576 rows in SmolLM2).
_CHUNK = 32


@numba.njit(parallel=True, fastmath=True, cache=True)
def _gemv_f32(x, weight, out):
    n, k = weight.shape
    for chunk in numba.prange((n + _CHUNK - 1) // _CHUNK):
        for row in range(chunk * _CHUNK, min(n, (chunk + 1) * _CHUNK)):
            acc = np.float32(0.0)
            for i in range(k):
                acc += weight[row, i] * x[i]
            out[row] = acc


@numba.njit(parallel=True, fastmath=True, cache=True)
def _gemv_int8(x, weight, scale, out):
    n, k = weight.shape
    for chunk in numba.prange((n + _CHUNK - 1) // _CHUNK):
        for row in range(chunk * _CHUNK, min(n, (chunk + 1) * _CHUNK)):
            acc = np.float32(0.0)
            for i in range(k):
                acc += np.float32(weight[row, i]) * x[i]
            out[row] = acc * scale[row]


def gemv_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [K] or [1, K] float32; weight: [N, K] float32, contiguous. Returns [..., N]."""
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)
    _gemv_f32(x.reshape(-1).contiguous().numpy(), weight.numpy(), out.view(-1).numpy())
    return out


def gemv_int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [K] or [1, K] float32; weight: [N, K] int8, contiguous; scale: [N] float32."""
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)
    _gemv_int8(x.reshape(-1).contiguous().numpy(), weight.numpy(), scale.numpy(),
               out.view(-1).numpy())
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) both kernels on tiny inputs."""
    x = torch.zeros(1, 4)
    gemv_f32(x, torch.zeros(2, 4))
    gemv_int8(x, torch.zeros(2, 4, dtype=torch.int8), torch.ones(2))

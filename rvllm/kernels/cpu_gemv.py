"""Matrix-vector products for decode on the CPU, compiled with numba.

A decode step of one sequence multiplies one row of activations by every weight matrix:
the time is the time to read the weights. oneDNN's packed GEMM and fbgemm read them at
10-14 GB/s at one row on this class of CPU; a plain loop over the row-major weight, one
output row after another, streams them at 18-19 GB/s, about what a streaming read gets
from this machine's memory (20-22 GB/s).
So a linear layer with this path keeps its weight row-major beside the packed copy
(``layers.cpu_linear``), and one-row inputs come here.

- float32 weight [N, K];
- int8 weight [N, K] with one float32 scale per output row; the activations stay
  float32 (each weight widened in registers), so this computes
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
                acc += weight[row, i] * x[0, i]
            out[0, row] = acc


@numba.njit(parallel=True, fastmath=True, cache=True)
def _gemv_int8(x, weight, scale, out):
    n, k = weight.shape
    for chunk in numba.prange((n + _CHUNK - 1) // _CHUNK):
        for row in range(chunk * _CHUNK, min(n, (chunk + 1) * _CHUNK)):
            acc = np.float32(0.0)
            for i in range(k):
                acc += np.float32(weight[row, i]) * x[0, i]
            out[0, row] = acc * scale[row]


def row_major(weight: torch.Tensor, scale: torch.Tensor | None = None) -> tuple:
    """What a linear layer keeps for ``gemv``: numpy views of its row-major weight [N, K]
    (float32, or int8 with its float32 scales [N]), made once so a call converts only x."""
    arrays = (weight.contiguous().numpy(),)
    return arrays if scale is None else arrays + (scale.float().contiguous().numpy(),)


def gemv(x: torch.Tensor, weights: tuple) -> torch.Tensor:
    """x: [1, K] float32, contiguous; ``weights`` from ``row_major``. Returns [1, N].
    Runs on as many threads as numba has; ``step_arrays`` of the decode attention kernel
    matches that to torch's once per step."""
    out = torch.empty(1, weights[0].shape[0], dtype=torch.float32)
    if len(weights) == 1:
        _gemv_f32(x.numpy(), weights[0], out.numpy())
    else:
        _gemv_int8(x.numpy(), weights[0], weights[1], out.numpy())
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) both kernels on tiny inputs."""
    x = torch.zeros(1, 4)
    gemv(x, row_major(torch.zeros(2, 4)))
    gemv(x, row_major(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2)))

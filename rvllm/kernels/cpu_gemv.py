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
``fastmath``: the same numbers as ``F.linear`` up to the order of the sums. ``_matvec``
also takes a few rows at once (each weight row read from memory once for all of them)
and a bias: the compiled decoder step (``cpu_decoder_step``) calls it too.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

# Output rows per parallel work item: enough to amortise the scheduling, few enough to
# balance two threads on the smallest projections (576 rows in SmolLM2).
_CHUNK = 32


@numba.njit(fastmath=True, cache=True, inline="always")
def _dot(w, r, x, b):
    acc = np.float32(0.0)
    for i in range(w.shape[1]):
        acc += np.float32(w[r, i]) * x[b, i]
    return acc


@numba.njit(fastmath=True, cache=True, inline="always")
def _widen(w, r, buf):
    """Weight row r as float32 in buf: an int8 row widened once for all B dot products
    (a float32 row is copied, from cache: the cost is the same one read from memory)."""
    for i in range(w.shape[1]):
        buf[0, i] = np.float32(w[r, i])


@numba.njit(parallel=True, fastmath=True, cache=True)
def _matvec(x, w, scale, bias, out):
    """out [B, N] = x [B, K] W^T (times the per-row scale of an int8 W) (+ bias); empty
    scale / bias arrays mean none. Each weight row is read from memory once and stays in
    cache for the B dot products."""
    n, k = w.shape
    rows = x.shape[0]
    has_scale, has_bias = scale.shape[0] > 0, bias.shape[0] > 0
    for chunk in numba.prange((n + _CHUNK - 1) // _CHUNK):
        buf = np.empty((1, k), np.float32)
        for r in range(chunk * _CHUNK, min(n, (chunk + 1) * _CHUNK)):
            if rows > 1:
                _widen(w, r, buf)
            for b in range(rows):
                acc = _dot(w, r, x, b) if rows == 1 else _dot(x, b, buf, 0)
                if has_scale:
                    acc *= scale[r]
                if has_bias:
                    acc += bias[r]
                out[b, r] = acc


_EMPTY = np.empty(0, np.float32)


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
    scale = weights[1] if len(weights) > 1 else _EMPTY
    _matvec(x.numpy(), weights[0], scale, _EMPTY, out.numpy())
    return out


def warm_up(int8: bool = True) -> None:
    """Compile (or load from numba's cache) the kernel for float32 weights, and for int8
    weights too when ``int8``."""
    x = torch.zeros(1, 4)
    gemv(x, row_major(torch.zeros(2, 4)))
    if int8:
        gemv(x, row_major(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2)))

"""Matrix-vector products for decode on the CPU, compiled with numba.

A decode step of one sequence multiplies one row of activations by every weight matrix:
the time is the time to read the weights. oneDNN's packed GEMM and fbgemm read them at
10-14 GB/s at one row (measured on an AMD machine of this class); a loop over the
row-major weight reads them as fast as the memory delivers, when it keeps enough
streams going (``LANES``).
So a linear layer with this path keeps its weight row-major beside the packed copy
(``layers.cpu_linear``), and one-row inputs come here.

- float32 weight [N, K];
- int8 weight [N, K] with one float32 scale per output row; the activations stay
  float32 (each weight widened in registers), so this computes
  ``F.linear(x, q.float() * scale[:, None])`` up to summation order.

Each of numba's threads takes a contiguous share of the output rows. Float32
accumulation with ``fastmath``: the same numbers as ``F.linear`` up to the order of the
sums. ``_matvec`` also takes a few rows of x at once (each weight row read from memory
once for all of them) and a bias: the compiled decoder step (``cpu_decoder_step``) calls
it too.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from rvllm.kernels import numba_cache  # noqa: F401 - stamps the kernels' cache

# Weight rows each thread streams at once. One row after another, a thread reads one
# stream and the hardware prefetchers keep too few lines in flight: 25-27 GB/s on this
# machine. Eight rows far apart (one in each eighth of the thread's share) are eight
# streams: 36-46 GB/s for the same bytes (a 300 MB weight, K 576-1536, both threads).
LANES = 8


@numba.njit(fastmath=True, cache=True, inline="always")
def _dot(w, r, x):
    """Weight row r (widened to float32 in registers) with the vector x [K]."""
    acc = np.float32(0.0)
    for i in range(w.shape[1]):
        acc += np.float32(w[r, i]) * x[i]
    return acc


@numba.njit(fastmath=True, cache=True, inline="always")
def _dot8(w, r0, r1, r2, r3, r4, r5, r6, r7, x):
    """Eight dot products with the vector x [K] in one pass: weight rows r0..r7, each
    widened to float32 in registers (an int8 row); each sum runs over its own row alone."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for i in range(w.shape[1]):
        xi = x[i]
        a0 += np.float32(w[r0, i]) * xi
        a1 += np.float32(w[r1, i]) * xi
        a2 += np.float32(w[r2, i]) * xi
        a3 += np.float32(w[r3, i]) * xi
        a4 += np.float32(w[r4, i]) * xi
        a5 += np.float32(w[r5, i]) * xi
        a6 += np.float32(w[r6, i]) * xi
        a7 += np.float32(w[r7, i]) * xi
    return a0, a1, a2, a3, a4, a5, a6, a7


@numba.njit(cache=True, inline="always")
def _share(n, part, parts, lanes):
    """Rows [lo, hi) of ``part`` of ``parts`` near-equal contiguous shares of n rows, and
    q, the rows of each of its ``lanes`` lanes (lo + j * q + [0, q)); rows [lo + lanes *
    q, hi) are left over, fewer than ``lanes``."""
    lo, hi = n * part // parts, n * (part + 1) // parts
    return lo, hi, (hi - lo) // lanes


@numba.njit(fastmath=True, cache=True, inline="always")
def _put(out, r, acc, scale, bias):
    """out[r] (one row of the output) = acc, times row r's scale, plus its bias."""
    if scale.shape[0] > 0:
        acc *= scale[r]
    if bias.shape[0] > 0:
        acc += bias[r]
    out[r] = acc


@numba.njit(parallel=True, fastmath=True, cache=True)
def _matvec(x, w, scale, bias, out, parts):
    """out [B, N] = x [B, K] W^T (times the per-row scale of an int8 W) (+ bias); empty
    scale / bias arrays mean none. Each of ``parts`` work items (numba's thread count:
    one each) takes a contiguous share of the rows and streams it as ``LANES`` lanes at
    once; with B > 1 the lanes' rows are read from memory once and from cache for the
    other rows of x. (The count is an argument: calling ``numba.get_num_threads`` in
    here would keep numba from caching the kernel.)

    One row of x (every N=1 decode step) has a loop of its own: with the loop over the
    rows of x inside the loop over weight rows, the same streams ran 8-20% slower
    (float32, K 576 and 1536, both threads)."""
    n = w.shape[0]
    for part in numba.prange(parts):
        lo, hi, q = _share(n, part, parts, LANES)
        if x.shape[0] == 1:
            x0, out0 = x[0], out[0]
            for r in range(lo, lo + q):
                d = _dot8(w, r, r + q, r + 2 * q, r + 3 * q, r + 4 * q, r + 5 * q,
                          r + 6 * q, r + 7 * q, x0)
                for j in range(LANES):
                    _put(out0, r + j * q, d[j], scale, bias)
        else:
            for r in range(lo, lo + q):
                for b in range(x.shape[0]):
                    d = _dot8(w, r, r + q, r + 2 * q, r + 3 * q, r + 4 * q, r + 5 * q,
                              r + 6 * q, r + 7 * q, x[b])
                    for j in range(LANES):
                        _put(out[b], r + j * q, d[j], scale, bias)
        for r in range(lo + LANES * q, hi):
            for b in range(x.shape[0]):
                _put(out[b], r, _dot(w, r, x[b]), scale, bias)


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
    _matvec(x.numpy(), weights[0], scale, _EMPTY, out.numpy(), numba.get_num_threads())
    return out


def warm_up(int8: bool = True) -> None:
    """Compile (or load from numba's cache) the kernel for float32 weights, and for int8
    weights too when ``int8``."""
    x = torch.zeros(1, 4)
    gemv(x, row_major(torch.zeros(2, 4)))
    if int8:
        gemv(x, row_major(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2)))

"""Rows of float32 activations times a float32 weight's panels, with numba.

The one-row GEMV keeps every float32 linear weight as panels [P, K, 16] (``gemv``):
16 output rows a panel, column by column, so a panel is already the right-hand operand
of ``vectors.rows_times_tile`` (a 16-lane tile row per column: six rows of x by the
panel, 12 sums in registers). Over many rows that is a GEMM: each thread takes an even
share of the panels, and each panel stays in its L1 for every six rows of a chunk of rows
that fits in the L2. An odd last row is taken as a pair of itself, and a last panel
past N goes through a scratch tile.

oneDNN's packed float32 GEMM (``torch.ops.mkldnn._linear_pointwise``) ran SmolLM2's four
projections a layer, 30 layers' weights read from memory, at 40-41 GFLOP/s with 8 rows,
91-104 with 32 and 133-139 with 128 on this 2-core Zen 2; this kernel, in the same runs,
60-63, 117-128 and 159-168 (``benchmarks/bench_int8_gemm.py --float32``). Results are
``F.linear``'s up to the order of the sums (tested in ``tests/test_cpu_linear.py``).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the cache
from rvllm.kernels.cpu.byte_dots import rounded_rows_parallel
from rvllm.kernels.cpu.gemv import _EMPTY, PANEL, Panels, _matvec
from rvllm.kernels.cpu.packed import PASS_ROWS, eight_bit_x, packed_dots
from rvllm.kernels.cpu.threads import match_torch_threads
from rvllm.kernels.cpu.vectors import ROWS, rows_times_tile

_CHUNK_BYTES = 192 * 1024  # a chunk of rows of x: within the L2


@numba.njit(cache=True, inline="always")
def _rows_by_panel(rows, x, k, panel, c, c_stride):
    """c rows [0, rows) (stride c_stride) = x's rows times the panel: pairs and sixes,
    and an odd last row as a pair of it with itself (both sums stored to its place)."""
    even = rows - rows % 2
    if even > 0:
        rows_times_tile(even, x, k, panel, PANEL, k, c, c_stride, 0)
    if rows % 2:
        rows_times_tile(2, x + even * k * 4, 0, panel, PANEL, k, c + even * c_stride * 4, 0,
                        0)


@numba.njit(cache=True, inline="always")
def _chunk_by_panel(x, r0, count, panel, out, p, edge):
    """Outputs 16p.. of out's rows [r0, r0 + count) = those rows of x times the float32
    panel at address ``panel``; a last panel past N through the scratch tile edge."""
    k, n = x.shape[1], out.shape[1]
    if (p + 1) * PANEL <= n:
        _rows_by_panel(count, x[r0].ctypes.data, k, panel, out[r0, p * PANEL:].ctypes.data, n)
        return
    _rows_by_panel(count, x[r0].ctypes.data, k, panel, edge.ctypes.data, PANEL)
    for i in range(count):
        for j in range(n - p * PANEL):
            out[r0 + i, p * PANEL + j] = edge[i, j]


@numba.njit(parallel=True, cache=True)
def matmul_into(x, w, out, threads):
    """out [M, N] = x [M, K] times the float32 panels w (``float32_matmul``'s arrays;
    threads: numba's thread count), in one call from Python."""
    m, k = x.shape
    panels = w.shape[0]
    chunk = max(ROWS, _CHUNK_BYTES // (4 * k) // ROWS * ROWS)
    for t in prange(threads):
        lo, hi = panels * t // threads, panels * (t + 1) // threads
        edge = np.empty((min(chunk, m), PANEL), np.float32)
        for r0 in range(0, m, chunk):
            count = min(chunk, m - r0)
            for p in range(lo, hi):
                _chunk_by_panel(x, r0, count, w[p].ctypes.data, out, p, edge)


@numba.njit(cache=True, inline="always")
def _int_chunk(xq, r0, count, w, p, out, sums):
    """Outputs 16p.. of out's rows [r0, r0 + count) = those rows times packed panel p,
    four rows at a time from their integer roundings xq."""
    n = out.shape[1]
    for b0 in range(r0, r0 + count, PASS_ROWS):
        rows = min(PASS_ROWS, r0 + count - b0)
        packed_dots(w, p, xq, b0, rows, sums.ctypes.data)
        for b in range(rows):
            for j in range(min(PANEL, n - p * PANEL)):
                out[b0 + b, p * PANEL + j] = sums[b, j]


@numba.njit(parallel=True, cache=True)
def packed_matmul_into(x, w, out, threads):
    """``matmul_into`` for packed panels w (``packed``): each panel read from its bytes
    for every four rows of a chunk, with their integer roundings (as ``gemv``'s few rows:
    each row's outputs are the same numbers in any batch)."""
    m, k = x.shape
    panels = w.shape[0]
    chunk = max(ROWS, _CHUNK_BYTES // (4 * k) // ROWS * ROWS)
    xq = rounded_rows_parallel(x, threads, eight_bit_x(w))
    for t in prange(threads):
        lo, hi = panels * t // threads, panels * (t + 1) // threads
        sums = np.empty((PASS_ROWS, PANEL), np.float32)
        for r0 in range(0, m, chunk):
            count = min(chunk, m - r0)
            for p in range(lo, hi):
                _int_chunk(xq, r0, count, w, p, out, sums)


def panels_matmul(x: torch.Tensor, weight: Panels) -> torch.Tensor:
    """x [M, K] (float32, contiguous) times a packed weight (``packed``) transposed, for
    any M: a few rows through ``gemv._matvec`` (read straight from the packed bytes),
    more through ``packed_matmul_into``."""
    threads = numba.get_num_threads()
    out = torch.empty(x.shape[0], weight.rows)
    if x.shape[0] > 2 * PASS_ROWS:
        packed_matmul_into(x.numpy(), weight.weight, out.numpy(), np.int64(threads))
    else:
        _matvec(x.numpy(), weight.weight, weight.scale, _EMPTY, out.numpy(), threads)
    return out


def float32_matmul(x: torch.Tensor, panels: Panels) -> torch.Tensor:
    """x [M, K] (float32) times the float32 weight of ``panels`` transposed."""
    match_torch_threads()
    out = torch.empty(x.shape[0], panels.rows)
    matmul_into(x.contiguous().numpy(), panels.weight, out.numpy(),
                np.int64(numba.get_num_threads()))
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels on a tiny input."""
    from rvllm.kernels.cpu.gemv import panels

    float32_matmul(torch.zeros(3, 4), panels(torch.zeros(17, 4)))


def warm_up_packed() -> None:
    """Compile (or load from numba's cache) ``packed_matmul_into`` on a tiny input."""
    from rvllm.kernels.cpu.packed import Q8_0, TYPE_BYTES, QuantizedRows, pack_rows

    data = np.zeros((17, TYPE_BYTES[Q8_0]), np.uint8)
    panels_matmul(torch.zeros(9, 32), pack_rows([QuantizedRows(Q8_0, data, 32)], 17))

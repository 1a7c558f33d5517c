"""Rows of activations times an int8 weight, on AVX2's 16-bit multiply-adds, with numba.

fbgemm's int8 GEMM (``torch.ops.quantized.linear_dynamic``) multiplies unsigned 8-bit
activations by the signed 8-bit weight with ``vpmaddubsw``, widens the 16-bit pair sums
with ``vpmaddwd``, and adds them up in 32 bits. On a CPU without VNNI both are
integer multiplies, which a Zen 2 runs on one of its four vector pipes only: 16
multiply-adds a cycle a core, no more than float32 FMAs on two pipes. Its activations are
7-bit (to keep the pair sums from saturating), quantized with one scale and zero point
for the whole input; and each call pays for the Python around it, its allocations and an
OpenMP fork and join: at SmolLM2's shapes, 25-40 us a call on 2 threads, 120 calls a step.

Here the activations are quantized a row at a time to 16-bit integers, as many levels as
the 32-bit sums leave room for (``levels``: 29,356 at K = 576, 11,008 at K = 1536, against
fbgemm's 127), and ``vpmaddwd`` multiplies them by the weight widened to 16 bits: one
integer multiply for 16 multiply-adds, as many a cycle as fbgemm's pair of them for 32,
so no slower, and a result within 1e-4 of the float32 product with the dequantized weight
(fbgemm's: 1-2e-2).

The weight is read from the one-row path's int8 panels (``gemv.panels``: [P, K, 16],
16 output rows a panel, column by column), so it takes no memory of its own: two columns
of a panel are 32 bytes, whose bytes interleaved (an unpack) and sign-extended are the
two 16-lane vectors of 8 outputs' (k, k + 1) pairs that ``vpmaddwd`` multiplies by the
broadcast pair of a row's activations. ``_tile`` takes 4 rows by one panel, eight 32-bit
sums in registers, then scales them to float32 (the panel's 16 weight scales and the
row's own) and stores them. Each thread takes an even share of the panels, each panel
in its L1 for every 4 rows of a chunk of rows whose activations fit in the L2.

On this Zen 2 (``benchmarks/bench_int8_gemm.py``: SmolLM2's four projections, 30 layers'
weights read from memory, GOP/s on 2 threads, fbgemm's in the same run): 8 rows 132
against 113, 32 rows 167 against 159, 128 rows 180 against 173, 512 rows 178 against 177;
its LM head (576 x 49152) at 32 rows 177 against 187, at 8 rows 179 against 166. One
thread's tile alone, its operands in the L1, ran at 100 GOP/s: the integer multiplier's
whole rate at 3.1 GHz. The first tile of each panel asks for the next panel's lines as it
goes (8 rows, from memory: 116-126 GOP/s against 107-108 without).

The reduction dimension K must be even (``layers.cpu_linear`` keeps fbgemm for the
rest, and without numba). Tested against ``F.linear`` on the dequantized weight
(``tests/test_cpu_linear.py``).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the cache
from rvllm.kernels.cpu.gemv import PANEL, Panels
from rvllm.kernels.cpu.numerics import prefetch_line
from rvllm.kernels.cpu.threads import match_torch_threads
from rvllm.kernels.cpu.vectors import _F32, _I16, _I32, _int

ROWS = 4  # rows a tile: 4 x 2 sums of 8 lanes in registers
_CHUNK_BYTES = 192 * 1024  # a chunk of rows' 16-bit activations: within the L2
_I8 = ir.IntType(8)
_PAIRS, _SUMS, _FLOATS = (ir.VectorType(_I16, 16), ir.VectorType(_I32, 8),
                          ir.VectorType(_F32, 8))
_TWO_COLUMNS = ir.VectorType(_I8, 2 * PANEL)
# Bytes of two panel columns (k: 0-15, k + 1: 16-31) as outputs' (k, k + 1) pairs,
# outputs 0-7 and 8-15.
_INTERLEAVE = [ir.Constant(ir.VectorType(_I32, 16), [i for j in js for i in (j, PANEL + j)])
               for js in (range(8), range(8, 16))]
_BROADCAST = ir.Constant(ir.VectorType(_I32, 8), [0] * 8)


def _pointer(builder: ir.IRBuilder, address: ir.Value, kind: ir.Type) -> ir.Value:
    return builder.inttoptr(address, kind.as_pointer())


def _splat(builder: ir.IRBuilder, value: ir.Value, kind: ir.VectorType) -> ir.Value:
    vector = builder.insert_element(ir.Constant(kind, ir.Undefined), value,
                                    ir.Constant(_I32, 0))
    return builder.shuffle_vector(vector, vector, _BROADCAST)


@intrinsic
def _tile(typingctx, a, pairs, w, scales, row_scales, out, out_stride, ahead):
    """out[r * out_stride + j] = row_scales[r] * scales[j] * the sum over k of a[r, k] *
    w[k, j], for r < 4 and j < 16. a: int16 rows of 2 * pairs elements each; w: an int8
    panel [2 * pairs, 16]; scales, row_scales, out: float32; ahead: a panel to ask the
    memory for meanwhile, a line every other step (0: none). Addresses, counts in
    elements."""
    def codegen(context, builder, signature, args):
        a, pairs, w, scales, row_scales, out, out_stride, ahead = args
        madd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_SUMS, [_PAIRS, _PAIRS]), "llvm.x86.avx2.pmadd.wd")
        zero = ir.Constant(_SUMS, [0] * 8)
        sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(2)]
                for _ in range(ROWS)]  # registers, after LLVM's mem2reg
        row_bytes = builder.mul(pairs, _int(4))
        asks = builder.icmp_signed("!=", ahead, _int(0))
        with cgutils.for_range(builder, pairs) as step:
            even = builder.icmp_signed("==", builder.and_(step.index, _int(1)), _int(0))
            with builder.if_then(builder.and_(asks, even)):
                prefetch_line(builder, builder.add(ahead, builder.mul(step.index, _int(32))))
            raw = builder.load(_pointer(builder, builder.add(w, builder.mul(step.index,
                                                                            _int(32))),
                                        _TWO_COLUMNS), align=1)
            weights = [builder.sext(builder.shuffle_vector(raw, raw, order), _PAIRS)
                       for order in _INTERLEAVE]
            for r in range(ROWS):
                at = builder.add(a, builder.add(builder.mul(_int(r), row_bytes),
                                                builder.mul(step.index, _int(4))))
                pair = builder.load(_pointer(builder, at, _I32), align=4)
                x = builder.bitcast(_splat(builder, pair, _SUMS), _PAIRS)
                for s, wv in zip(sums[r], weights):
                    builder.store(builder.add(builder.load(s), builder.call(madd, [x, wv])), s)
        lane_scales = [builder.load(_pointer(builder, builder.add(scales, _int(32 * j)),
                                             _FLOATS), align=4) for j in range(2)]
        for r in range(ROWS):
            row_scale = builder.load(_pointer(builder, builder.add(row_scales, _int(4 * r)),
                                              _F32), align=4)
            row_scale = _splat(builder, row_scale, _FLOATS)
            for j, s in enumerate(sums[r]):
                value = builder.fmul(builder.fmul(builder.sitofp(builder.load(s), _FLOATS),
                                                  lane_scales[j]), row_scale)
                at = builder.add(out, builder.mul(builder.add(builder.mul(_int(r), out_stride),
                                                              _int(8 * j)), _int(4)))
                builder.store(value, _pointer(builder, at, _FLOATS), align=4)
        return context.get_dummy_value()

    return types.void(*(types.int64,) * 8), codegen


@numba.njit(cache=True)
def levels(k):
    """The largest magnitude a row's activations are quantized to, for a reduction
    dimension of k: k products of it and 127 (the weight's) fit a 32-bit sum."""
    return min(32767, (2 ** 31 - 1) // (127 * k))


@numba.njit(parallel=True, fastmath=True, cache=True)
def _quantize(x, a, row_scales, top_level):
    """a [M', K] = x [M, K] a row at a time to integers in [-top_level, top_level] (rows
    past M: zeros); row_scales[r] = what a row's integer sums are multiplied by (its
    largest magnitude over top_level)."""
    for r in prange(a.shape[0]):
        if r >= x.shape[0]:
            a[r, :] = 0
            row_scales[r] = 0.0
            continue
        top = np.float32(1e-10)
        for i in range(x.shape[1]):
            top = max(top, abs(x[r, i]))
        f = np.float32(top_level) / top
        for i in range(x.shape[1]):
            a[r, i] = np.int16(np.rint(x[r, i] * f))
        row_scales[r] = top / np.float32(top_level)


@numba.njit(parallel=True, cache=True)
def _gemm(a, row_scales, rows, w, scales, out, threads):
    """out [rows, N] = the quantized rows a [M', K] (M' a multiple of 4, rows past
    ``rows`` zeros) times the panels w [P, K, 16], scaled by each row's and each output's
    scale (scales [16 P], as ``Panels`` pads them)."""
    k = a.shape[1]
    n = out.shape[1]
    panels = w.shape[0]
    chunk = max(ROWS, _CHUNK_BYTES // (2 * k) // ROWS * ROWS)
    for t in prange(threads):
        lo, hi = panels * t // threads, panels * (t + 1) // threads
        edge = np.empty((ROWS, PANEL), np.float32)
        for r0 in range(0, a.shape[0], chunk):
            for p in range(lo, hi):
                whole = (p + 1) * PANEL <= n
                # The first tile of a panel asks for the next one.
                ahead = w[p + 1].ctypes.data if p + 1 < hi else 0
                for r in range(r0, min(a.shape[0], r0 + chunk), ROWS):
                    if whole and r + ROWS <= rows:
                        _tile(a[r].ctypes.data, k // 2, w[p].ctypes.data,
                              scales[p * PANEL:].ctypes.data, row_scales[r:].ctypes.data,
                              out[r, p * PANEL:].ctypes.data, n, ahead)
                    else:  # the last rows or outputs: through a tile of scratch
                        _tile(a[r].ctypes.data, k // 2, w[p].ctypes.data,
                              scales[p * PANEL:].ctypes.data, row_scales[r:].ctypes.data,
                              edge.ctypes.data, PANEL, ahead)
                        for i in range(min(ROWS, rows - r)):
                            for j in range(min(PANEL, n - p * PANEL)):
                                out[r + i, p * PANEL + j] = edge[i, j]
                    ahead = 0


@numba.njit(cache=True)
def matmul_into(x, w, scales, out, threads):
    """out [M, N] = x [M, K] times the panels w with their scales (``int8_matmul``'s
    arrays; threads: numba's thread count), in one call from Python for both passes:
    what a caller that has them saves is 12 us a call of Python (4 us left)."""
    rows, k = x.shape
    a = np.empty(((rows + ROWS - 1) // ROWS * ROWS, k), np.int16)
    row_scales = np.empty(a.shape[0], np.float32)
    _quantize(x, a, row_scales, levels(k))
    _gemm(a, row_scales, rows, w, scales, out, threads)


def int8_matmul(x: torch.Tensor, panels: Panels) -> torch.Tensor:
    """x [M, K] (float32) times the int8 weight of ``panels`` transposed, times its
    per-output scales: ``F.linear(x, q.float() * scale[:, None])`` to within the
    activations' quantization (``levels``)."""
    match_torch_threads()
    out = torch.empty(x.shape[0], panels.rows)
    matmul_into(x.contiguous().numpy(), panels.weight, panels.scale, out.numpy(),
                np.int64(numba.get_num_threads()))
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels on a tiny input."""
    from rvllm.kernels.cpu.gemv import panels

    int8_matmul(torch.zeros(5, 4), panels(torch.zeros(17, 4, dtype=torch.int8),
                                          torch.ones(17)))

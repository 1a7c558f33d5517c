"""Scalar math for the numba kernels that LLVM can vectorise.

numba compiles ``np.exp`` on a float32 to a call into the C library, one element at a
time: in decode attention, one exponential per score, that call was a third of the
kernel. ``exp32`` is the same function as straight-line float32 arithmetic (a range
reduction to 2^n e^r with |r| <= ln2 / 2, a degree-6 polynomial for e^r, and 2^n built
in the exponent bits), which a loop over a row of scores turns into AVX2 code.
Relative error under 3e-7 (a few float32 ulps) on [-87, 88]; arguments are clamped to
[-87.3, 88.3] first, so far below it gives e^-87.3 (about 1e-38) rather than 0, which
a softmax or a SiLU cannot tell apart, and it never overflows.

``row_max`` is a row's largest element on eight running maxima: one running maximum (a
softmax's first pass, as written plainly) is a chain of dependent compares that LLVM does
not vectorise, 0.77 ns an element on this Zen 2 against 0.20.

``widen_kv``, ``widen_kv_row`` and ``narrow_kv`` read and write KV-cache elements
whatever the cache's storage (``--kv-cache-dtype``): float32 as is, bfloat16 as its
uint16 bit pattern (torch tensors of bfloat16 reach numba through ``kv_array``). Widening
a bfloat16 is a 16-bit shift, which vectorises; narrowing rounds to nearest even,
bit-identical to torch's ``.to(torch.bfloat16)`` (NaNs aside, which stay NaNs).

``fetch_rows`` asks the memory for a row of an array ahead of its use (``llvm.prefetch``),
for access patterns the hardware prefetchers cannot follow, such as the jumps from one
paged-cache block to the next.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the kernels' cache

_LOG2E = np.float32(1.4426950408889634)
# ln 2 split in two so that n * _LN2_HI is exact for the |n| <= 128 used here.
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
# Taylor-like minimax coefficients of (e^r - 1 - r) / r^2 on |r| <= ln2 / 2.
_C0, _C1, _C2 = np.float32(5.0000001201e-1), np.float32(1.6666665459e-1), \
    np.float32(4.1665795894e-2)
_C3, _C4, _C5 = np.float32(8.3334519073e-3), np.float32(1.3981999507e-3), \
    np.float32(1.9875691500e-4)


@intrinsic
def _float_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 ``bits``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def _bits_from_float(typingctx, value):
    """The int32 bit pattern of the float32 ``value``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


def prefetch_line(builder: ir.IRBuilder, address: ir.Value) -> None:
    """Emit a hint to bring the cache line at the integer ``address`` into the L2 and the
    L3 (``llvm.prefetch``: a read, locality 2, x86's ``prefetcht1``). It never faults.
    Into the L1 too (locality 3), the lines of a paged-cache block asked for ahead took
    the L1's few miss slots from the loads of the block being computed on: decode
    attention over the serving replay's steps ran 14% slower than with locality 2."""
    pointer = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    # Named for the pointer type, as this llvmlite's LLVM spells it ("p0" or "p0i8").
    fn = builder.module.declare_intrinsic(
        "llvm.prefetch", [pointer], ir.FunctionType(ir.VoidType(), [pointer, i32, i32, i32]))
    builder.call(fn, [builder.inttoptr(address, pointer), ir.Constant(i32, 0),
                      ir.Constant(i32, 2), ir.Constant(i32, 1)])


@intrinsic
def _prefetch(typingctx, address):
    """``prefetch_line`` at the integer ``address``."""
    def codegen(context, builder, signature, args):
        prefetch_line(builder, args[0])
        return context.get_dummy_value()
    return types.void(types.int64), codegen


@numba.njit(cache=True, inline="always")
def fetch_rows(array, row):
    """Prefetch ``array[row]`` (C-contiguous), a line of 64 bytes at a time."""
    part = array[row]
    start = part.ctypes.data
    for offset in range(0, part.size * part.itemsize, 64):
        _prefetch(start + offset)


@numba.njit(fastmath=True, cache=True, inline="always")
def exp32(x):
    """e^x for a float32 x, vectorisable (see the module note for range and error)."""
    x = min(max(x, np.float32(-87.3)), np.float32(88.3))
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    p = p * r + _C1
    p = p * r + _C0
    e = p * (r * r) + r + np.float32(1.0)
    return e * _float_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@numba.njit(fastmath=True, cache=True, inline="always")
def row_max(row):
    """The largest element of the 1-D ``row`` (-inf when empty)."""
    n = row.shape[0]
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = np.float32(-np.inf)
    i = 0
    while i + 8 <= n:
        m0, m1 = max(m0, row[i]), max(m1, row[i + 1])
        m2, m3 = max(m2, row[i + 2]), max(m3, row[i + 3])
        m4, m5 = max(m4, row[i + 4]), max(m5, row[i + 5])
        m6, m7 = max(m6, row[i + 6]), max(m7, row[i + 7])
        i += 8
    top = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
    while i < n:
        top = max(top, row[i])
        i += 1
    return top


def kv_array(cache: torch.Tensor) -> np.ndarray:
    """A KV-cache tensor as the numpy array the kernels take: float32 as is, bfloat16 as
    its uint16 bit patterns."""
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.uint16).numpy()
    return cache.numpy()


def widen_kv(x):  # noqa: ANN001, ANN201 - numba-only; see the overload below
    """A cache element (float32, or a bfloat16 as uint16 bits) as a float32."""
    raise NotImplementedError("numba-compiled code only")


@overload(widen_kv, inline="always")
def _widen_kv(x):  # noqa: ANN001, ANN202
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:
        return lambda x: _float_from_bits(np.int32(x) << np.int32(16))
    return None


def widen_kv_row(row, buffer):  # noqa: ANN001, ANN201 - numba-only
    """A row of cache elements as float32: the row itself when it is float32, else
    ``buffer`` (float32, as long) filled with its widened elements."""
    raise NotImplementedError("numba-compiled code only")


@overload(widen_kv_row, inline="always")
def _widen_kv_row(row, buffer):  # noqa: ANN001, ANN202
    if row.dtype == types.float32:
        return lambda row, buffer: row

    def widen(row, buffer):  # noqa: ANN001, ANN202
        for i in range(row.shape[0]):
            buffer[i] = widen_kv(row[i])
        return buffer
    return widen


def narrow_kv(x, cache):  # noqa: ANN001, ANN201 - numba-only
    """The float32 ``x`` as an element of ``cache``'s storage type."""
    raise NotImplementedError("numba-compiled code only")


@overload(narrow_kv, inline="always")
def _narrow_kv(x, cache):  # noqa: ANN001, ANN202
    if cache.dtype == types.float32:
        return lambda x, cache: x
    if cache.dtype != types.uint16:
        return None

    def to_bfloat16(x, cache):  # noqa: ANN001, ANN202
        bits = np.uint32(_bits_from_float(np.float32(x)))
        if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            return np.uint16(0x7FC0)  # a NaN stays a (quiet) NaN
        # Round to nearest, ties to the even 16-bit pattern.
        bits += np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        return np.uint16(bits >> np.uint32(16))
    return to_bfloat16

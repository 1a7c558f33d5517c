"""Scalar math for the numba kernels that LLVM can vectorise.

numba compiles ``np.exp`` on a float32 to a call into the C library, one element at a
time: in decode attention, one exponential per score, that call was a third of the
kernel. ``exp32`` is the same function as straight-line float32 arithmetic (a range
reduction to 2^n e^r with |r| <= ln2 / 2, a degree-6 polynomial for e^r, and 2^n built
in the exponent bits), which a loop over a row of scores turns into AVX2 code.
Relative error under 3e-7 (a few float32 ulps) on [-87, 88]; arguments are clamped to
[-87.3, 88.3] first, so far below it gives e^-87.3 (about 1e-38) rather than 0, which
a softmax or a SiLU cannot tell apart, and it never overflows.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

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

"""GGUF's simple block types (Q8_0, Q4_0, Q4_1) dequantized by numba, in parallel.

``models.dequant`` decodes every type with torch, block-vectorised; for the types here
those few passes over the tensor (nibble split, concatenation, widening, scale, offset)
took most of a SmolLM2 start-up's weight loading. These loops do one pass, on numba's
threads, with the same float32 arithmetic in the same order (no fused multiply-add:
no ``fastmath``), so the output is bit-identical to the torch decoders, which stay the
reference (``tests/test_gguf.py``). Each block's float16 scale (and Q4_1's offset) is
widened in the loop too (``_half``): numba has no float16 on the CPU, and widening
those columns with numpy first took a third of the decode.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the kernels' cache
from rvllm.kernels.cpu.numerics import _bits_from_float, _float_from_bits

_TWO_112 = np.float32(2.0 ** 112)


@numba.njit(cache=True, inline="always")
def _half(lo, hi):
    """The float16 stored little-endian in bytes lo, hi, widened exactly to float32.
    The 15 bits of exponent and mantissa shifted into a float32's place are the value
    times 2^-112, subnormals included; infinities and NaNs are set apart."""
    h = np.int32(lo) | (np.int32(hi) << 8)
    magnitude = h & 0x7FFF
    if magnitude >= 0x7C00:
        value = _float_from_bits(np.int32(0x7F800000 | ((magnitude & 0x3FF) << 13)))
    else:
        value = _float_from_bits(np.int32(magnitude << 13)) * _TWO_112
    return _float_from_bits(_bits_from_float(value) | np.int32((h & 0x8000) << 16))


@numba.njit(parallel=True, cache=True)
def _q8_0(blocks, out):
    for i in prange(blocks.shape[0]):
        d = _half(blocks[i, 0], blocks[i, 1])
        for j in range(out.shape[1]):
            out[i, j] = d * np.float32(np.int8(blocks[i, 2 + j]))


@numba.njit(parallel=True, cache=True)
def _q4_0(blocks, out):
    half = out.shape[1] // 2
    for i in prange(blocks.shape[0]):
        d = _half(blocks[i, 0], blocks[i, 1])
        for j in range(half):
            byte = blocks[i, 2 + j]
            out[i, j] = d * np.float32(np.int16(byte & 15) - 8)
            out[i, j + half] = d * np.float32(np.int16(byte >> 4) - 8)


@numba.njit(parallel=True, cache=True)
def _q4_1(blocks, out):
    half = out.shape[1] // 2
    for i in prange(blocks.shape[0]):
        d, m = _half(blocks[i, 0], blocks[i, 1]), _half(blocks[i, 2], blocks[i, 3])
        for j in range(half):
            byte = blocks[i, 4 + j]
            out[i, j] = d * np.float32(byte & 15) + m
            out[i, j + half] = d * np.float32(byte >> 4) + m


TYPES = ("Q8_0", "Q4_0", "Q4_1")
_KERNELS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1}


def dequantize_into(type_name: str, blocks: np.ndarray, out: np.ndarray) -> None:
    """Decode ``blocks`` (uint8 [n, type_size]) of ``type_name`` (one of ``TYPES``) into
    ``out`` (float32 [n, block_size])."""
    _KERNELS[type_name](blocks, out)


def warm_up() -> None:
    """Load (or compile) the decoders for the read-only bytes of a memory-mapped file and
    for writable bytes (numba compiles each apart; a GGUF's loading passes both)."""
    for name, type_size, block_size in (("Q8_0", 34, 32), ("Q4_0", 18, 32), ("Q4_1", 20, 32)):
        for writeable in (False, True):
            blocks = np.zeros((1, type_size), np.uint8)
            blocks.flags.writeable = writeable
            dequantize_into(name, blocks, np.empty((1, block_size), np.float32))

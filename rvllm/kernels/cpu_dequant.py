"""GGUF's simple block types (Q8_0, Q4_0, Q4_1) dequantized by numba, in parallel.

``models.dequant`` decodes every type with torch, block-vectorised; for the types here
those few passes over the tensor (nibble split, concatenation, widening, scale, offset)
took most of a SmolLM2 start-up's weight loading. These loops do one pass, on numba's
threads, with the same float32 arithmetic in the same order (no fused multiply-add:
no ``fastmath``), so the output is bit-identical to the torch decoders, which stay the
reference (``tests/test_gguf.py``). The float16 scales are widened by numpy first.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange


@numba.njit(parallel=True, cache=True)
def _q8_0(blocks, d, out):
    for i in prange(blocks.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = d[i] * np.float32(np.int8(blocks[i, 2 + j]))


@numba.njit(parallel=True, cache=True)
def _q4_0(blocks, d, out):
    half = out.shape[1] // 2
    for i in prange(blocks.shape[0]):
        for j in range(half):
            byte = blocks[i, 2 + j]
            out[i, j] = d[i] * np.float32(np.int16(byte & 15) - 8)
            out[i, j + half] = d[i] * np.float32(np.int16(byte >> 4) - 8)


@numba.njit(parallel=True, cache=True)
def _q4_1(blocks, d, m, out):
    half = out.shape[1] // 2
    for i in prange(blocks.shape[0]):
        for j in range(half):
            byte = blocks[i, 4 + j]
            out[i, j] = d[i] * np.float32(byte & 15) + m[i]
            out[i, j + half] = d[i] * np.float32(byte >> 4) + m[i]


def _f16_column(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16)[:, 0] \
        .astype(np.float32)


TYPES = ("Q8_0", "Q4_0", "Q4_1")


def dequantize_into(type_name: str, blocks: np.ndarray, out: np.ndarray) -> None:
    """Decode ``blocks`` (uint8 [n, type_size]) of ``type_name`` (one of ``TYPES``) into
    ``out`` (float32 [n, block_size])."""
    d = _f16_column(blocks, 0)
    if type_name == "Q8_0":
        _q8_0(blocks, d, out)
    elif type_name == "Q4_0":
        _q4_0(blocks, d, out)
    else:
        _q4_1(blocks, d, _f16_column(blocks, 2), out)


def warm_up() -> None:
    """Load (or compile) the decoders for the read-only bytes of a memory-mapped file."""
    for name, type_size, block_size in (("Q8_0", 34, 32), ("Q4_0", 18, 32), ("Q4_1", 20, 32)):
        blocks = np.zeros((1, type_size), np.uint8)
        blocks.flags.writeable = False
        dequantize_into(name, blocks, np.empty((1, block_size), np.float32))

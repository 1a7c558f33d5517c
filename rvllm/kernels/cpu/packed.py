"""GGUF's quantized weights kept packed on the CPU (``--quantization gguf``), in numba.

A GGUF file stores each weight row as blocks of a few bytes: 32 or 256 weights, their
4-, 5-, 6- or 8-bit integers and one or two float16 scales (plus, for the k-quants,
6- or 8-bit scales of 16- or 32-weight sub-blocks). Widened to float32 they take 4-7
times their bytes, and a decode step of one sequence, which reads every weight once,
takes that many times longer to read them. Here they stay in their blocks.

**Panels.** At load each weight [N, K] is repacked once into panels of 16 output rows,
as the float32 and int8 ones are (``gemv``), so that one 16-lane vector is one column
of 16 rows: panel p is a 64-byte header (its format's code, K, and the panel's bytes
over 16) and then, for each of the row's blocks in K order, the 16 rows' blocks with
each field turned lane-innermost: a k-quant's sub-block scales (6-bit ones unpacked to a
byte each) become a 16-byte vector a sub-block, and the float16 scales a 32-byte vector
of 16. The integers' bytes (nibbles, Q5_K's and Q6_K's high bits, Q8_0's bytes) go four
byte columns together, each row's four bytes one int32 lane (``_dword_groups``), as the
byte products take them. The bytes are the file's, but for Q4_K's and Q5_K's sub-block
scales and minima, unpacked from 12 bytes to 16 (+2.8% and
+2.3% of those formats' bytes). Rows past N are zero blocks. Panels of one weight may
differ in format (a fused Q/K/V whose V rows are Q6_K and the others Q4_K): each panel
is read by its own header, and each part's panels are as long as its format needs. The
weight's panels then lie in up to three runs of one length each, which the first
panel's header lists (``panel_address``); a weight of more runs than that pads them all
to the longest.

**Formats.** Q4_0, Q4_1, Q8_0 (blocks of 32) and Q4_K, Q5_K, Q6_K (blocks of 256). Each
weight is ``scale * q - offset`` for an integer q and a (scale, offset) pair per sub-
block of 16 or 32 columns (Q4_0: d, 8 d; Q4_1: d, -m; Q8_0: d, 0; Q4_K/Q5_K: d sc,
dmin m; Q6_K: d sc, 32 d sc).

**Arithmetic.** Every format multiplies x rounded to 16-bit integers per block of 32,
held as two bytes (``byte_dots``), or, where the panels' headers say so (``set_x_bits``,
``--packed-activations int8``), to 8-bit ones held as the high bytes, whose products
skip the low bytes: half the byte products, at 8 bits' precision. Bytes by bytes:
``_int_dots`` takes 1-4 rows of x a pass over the panel for any number of rows, and
gives each row the same number whatever the batch. Q8_0 panels are stored in pairs of
columns (``_pair_groups``, panel code ``Q8_0_PAIRS``): a pair widened to int16 is one
``vpmaddwd`` (``byte_dots.dot_words``) by x's int16 pair, where its signed bytes by x's
two bytes (``byte_dots.dot_signed``, still read for the plain layout) took two signed
byte products and their sign fixes. On a 2-vCPU AMD EPYC (Zen 4, AVX-512 VNNI), one
thread, from the cache, G multiply-adds/s at 1, 4 and 32 rows: 30, 35 and 39 plain, 47,
75 and 79 in pairs. A Q4_K or Q5_K block is eight sub-blocks of 32, each with its own
scale and minimum, so it adds eight such block products (Q5_K's fifth bits are put on
the nibbles in registers); a Q6_K block is sixteen sub-blocks of 16 columns with a
signed scale, whose unsigned 6-bit q have their offset of 32 taken off with x's integer
sums over 16 columns, in the integers. The result is the float32 product of the
dequantized weight with that rounded x (tested within 1e-5 of a float64 product), about
2e-5 of the largest output off the product with x itself on random data. Widening these
weights to float32 instead kept a thread at about 20 G weights/s of Q4_1 from the cache
on a 2-vCPU Xeon with AVX-512 VNNI, below its memory's read, and each more row of x cost
nearly as much again; the byte products run one row at about 50 G weights/s from the
cache and four rows at about 20 each, so that from memory one thread read SmolLM2-shaped
Q4_1 panels at 22 G weights/s for one row and 18.5 for four (widened: 16 and 11.5).

**AVX2 without AVX-512.** AVX2 has 16 registers of 8 lanes, and the walks above, 16
lanes wide, kept more vectors alive than that: a third of a four-row pass's instructions
were spills, and passes of 2-4 rows ran slower per row than one row's. There
(``narrow_cpu``), Q4_0, Q4_1, Q8_0, Q4_K and Q6_K panels are walked once for lanes 0-7
and again for 8-15 (``_narrow_dots``), each weight vector taken by every row as it
comes: the same integers and the same float32 operations per lane, so the same numbers.
Q5_K keeps the 16-lane walk. (Q8_0's pairs were first made for AVX2, where x's two
bytes took two ``vpmaddubsw`` and two ``vpmaddwd`` a pair of columns.)

- ``_int_dots1`` .. ``_int_dots4``: one panel times 1-4 rounded rows of x: the one-row
  GEMV of decode, and every four rows of a wider step.
- ``_narrow1`` .. ``_narrow4``: the same on AVX2 for the formats above.
- ``_dequant_panel``: one panel widened into a float32 [K, 16]: embedding rows are looked
  up through it, and tools read a whole weight back with it.

``gemv._panels_into`` and the compiled decode steps take these panels (uint8
``Panels``) beside the float32 and int8 ones; ``packed_rows`` dequantizes embedding rows
on lookup.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the kernels' cache
from rvllm.kernels.cpu.byte_dots import (
    V32,
    _call,
    _features,
    dot_bytes_sum,
    dot_signed,
    dot_words,
    rounded_rows,
    signed_weights,
    splat_i32,
)
from rvllm.kernels.cpu.numerics import prefetch_line
from rvllm.kernels.cpu.panels import Panels, packed_bytes, panel_offset, panel_runs
from rvllm.kernels.cpu.vectors import (
    _F32,
    _FAST,
    _I32,
    _I64,
    _VEC,
    LANES,
    _fma,
    _int,
    _lanes,
    _splat,
)

PANEL = LANES
# Bytes of a panel's header, eight int64: format code, K, the panel's bytes / 16, and
# where the weight's second and third runs of panels begin (panel index, panels' bytes /
# 16 in that run; the first panel's are read, ``panel_address``).
HEADER = 64
# The header field that says how x is rounded for the panel: 0 to 16 bits, 8 to 8 bits
# (``set_x_bits``; ``byte_dots.quantize_rows``).
X_BITS = 7
PASS_ROWS = 4  # rows of x a pass over a panel multiplies (``_int_dots1`` .. ``_int_dots4``)

# GGML type codes (``models.ggml_types.GGMLType``) of the formats kept packed.
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
FORMAT_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
                Q6_K: "Q6_K"}
# Q8_0 laid out for ``byte_dots.dot_words`` (the default): a panel's code, beside
# the GGML types'.
PAIRS = 0x100
Q8_0_PAIRS = Q8_0 | PAIRS
# Columns a block covers, bytes of a GGUF block (one row), bytes of a panel block (16).
BLOCK_COLS = {Q4_0: 32, Q4_1: 32, Q8_0: 32, Q4_K: 256, Q5_K: 256, Q6_K: 256}
TYPE_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_K: 144, Q5_K: 176, Q6_K: 210}
PANEL_BLOCK_BYTES = {Q4_0: 288, Q4_1: 320, Q8_0: 544, Q4_K: 2368, Q5_K: 2880, Q6_K: 3360}

_I8 = ir.IntType(8)
_B16 = ir.VectorType(_I8, LANES)
_B64 = ir.VectorType(_I8, 4 * LANES)
_B32 = ir.VectorType(_I8, 2 * LANES)
_W32 = ir.VectorType(ir.IntType(16), 2 * LANES)
_H16 = ir.VectorType(ir.HalfType(), LANES)


# --- panel layouts ---------------------------------------------------------------------

def _lanes_inner(field: np.ndarray) -> np.ndarray:
    """[P, 16, nb, width] bytes of one field of every row's blocks -> [P, nb, width, 16]
    flattened to [P, nb, width * 16]: the 16 rows innermost."""
    p, _, nb, width = field.shape
    return field.transpose(0, 2, 3, 1).reshape(p, nb, width * PANEL)


def _pair_groups(field: np.ndarray) -> np.ndarray:
    """[P, 16, nb, width] bytes of a field -> [P, nb, width * 16]: for each pair of byte
    columns, the 16 rows' 2 bytes in row order (an int16 pair a row, once widened)."""
    p, _, nb, width = field.shape
    grouped = field.reshape(p, PANEL, nb, width // 2, 2)
    return np.ascontiguousarray(grouped.transpose(0, 2, 3, 1, 4)).reshape(p, nb, width * PANEL)


def _dword_groups(field: np.ndarray) -> np.ndarray:
    """[P, 16, nb, width] bytes of a field -> [P, nb, width * 16]: for each group of 4
    byte columns, the 16 rows' 4 bytes in row order (an int32 lane a row)."""
    p, _, nb, width = field.shape
    grouped = field.reshape(p, PANEL, nb, width // 4, 4)
    return np.ascontiguousarray(grouped.transpose(0, 2, 3, 1, 4)).reshape(p, nb, width * PANEL)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of Q4_K/Q5_K's 12 bytes [..., 12], a byte each."""
    low, high, mixed = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate((low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)), axis=-1)
    return sc, mn


def _halves_inner(field: np.ndarray) -> np.ndarray:
    """[P, 16, nb, 2] bytes of a float16 field -> [P, nb, 32]: the 16 rows' values
    innermost."""
    halves = np.ascontiguousarray(field).view(np.uint16)[..., 0]  # [P, 16, nb]
    return np.ascontiguousarray(halves.transpose(0, 2, 1)).view(np.uint8)


def _panel_blocks(fmt: int, blocks: np.ndarray) -> np.ndarray:
    """[P, 16, nb, type bytes] GGUF blocks -> [P, nb, panel block bytes], the fields of
    each block turned lane-innermost (see the module note)."""
    if fmt == Q8_0:
        fields = [_halves_inner(blocks[..., 0:2]), _dword_groups(blocks[..., 2:34])]
    elif fmt == Q8_0_PAIRS:
        fields = [_halves_inner(blocks[..., 0:2]), _pair_groups(blocks[..., 2:34])]
    elif fmt == Q4_0:
        fields = [_halves_inner(blocks[..., 0:2]), _dword_groups(blocks[..., 2:18])]
    elif fmt == Q4_1:
        fields = [_halves_inner(blocks[..., 0:2]), _halves_inner(blocks[..., 2:4]),
                  _dword_groups(blocks[..., 4:20])]
    elif fmt in (Q4_K, Q5_K):
        sc, mn = _k_scales(blocks[..., 4:16])
        quants = ([_dword_groups(blocks[..., 16:48]), _dword_groups(blocks[..., 48:176])]
                  if fmt == Q5_K else [_dword_groups(blocks[..., 16:144])])
        fields = [_halves_inner(blocks[..., 0:2]), _halves_inner(blocks[..., 2:4]),
                  _lanes_inner(sc), _lanes_inner(mn), *quants]
    elif fmt == Q6_K:
        fields = [_halves_inner(blocks[..., 208:210]), _lanes_inner(blocks[..., 192:208]),
                  _dword_groups(blocks[..., 0:128]), _dword_groups(blocks[..., 128:192])]
    else:
        raise ValueError(f"no packed layout for GGML type {fmt}")
    return np.concatenate(fields, axis=-1)


def panel_bytes(fmt: int, cols: int) -> int:
    """Bytes of one panel of a [*, cols] weight in ``fmt`` (a GGML type or a panel code)."""
    fmt &= ~PAIRS
    return HEADER + cols // BLOCK_COLS[fmt] * PANEL_BLOCK_BYTES[fmt]


def panel_code(fmt: int, pairs: bool = True) -> int:
    """The panel code a GGML type is packed as: Q8_0 in pairs of columns for
    ``byte_dots.dot_words`` (unless not ``pairs``), else the type's own layout."""
    return Q8_0_PAIRS if fmt == Q8_0 and pairs else fmt


@dataclass(frozen=True, slots=True)
class QuantizedRows:
    """Rows of a GGUF weight as stored: ``data`` [rows, row bytes] uint8 of GGML type
    ``fmt`` (e.g. a view of the file's memory map), each row ``cols`` weights."""

    fmt: int
    data: np.ndarray
    cols: int

    @property
    def rows(self) -> int:
        return self.data.shape[0]


def int4_rows(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> QuantizedRows:
    """4-bit weights ``scale * (q - zero)`` (q uint8 [N, K] in 0..15, scale and zero
    float32 [N, K / group], the group a multiple of 32) as Q4_1 blocks: d = scale and
    m = -scale * zero, each rounded to float16 (AWQ's and GPTQ's scales are float16
    already): a weight moves by at most 1/2048 of 15 d + |m|, under 2% of a step d."""
    n, k = q.shape
    group = k // scale.shape[1]
    if k % 32 or group % 32:
        raise ValueError(f"int4 weights pack in blocks of 32 columns; got K={k}, "
                         f"group {group}")
    per = group // 32
    d = scale.repeat_interleave(per, dim=1).to(torch.float16)
    m = (-scale * zero).repeat_interleave(per, dim=1).to(torch.float16)
    nib = q.reshape(n, k // 32, 2, 16).to(torch.uint8)
    qs = nib[:, :, 0] | (nib[:, :, 1] << 4)  # byte j: weight j low, weight j + 16 high
    blocks = torch.cat((d.unsqueeze(-1).view(torch.uint8), m.unsqueeze(-1).view(torch.uint8),
                        qs), dim=-1)
    return QuantizedRows(Q4_1, blocks.reshape(n, -1).numpy(), k)


def _headers(weight: np.ndarray) -> list[np.ndarray]:
    """Each panel's header of a packed weight, int64 [8] views of its memory (panels of
    a longer run lie past the array's shape: ``pack_rows``)."""
    runs = panel_runs(weight)
    memory = np.frombuffer((ctypes.c_uint8 * packed_bytes(weight)).from_address(
        weight.ctypes.data), np.uint8)
    return [memory[o:o + HEADER].view(np.int64)
            for o in (panel_offset(runs, p) for p in range(weight.shape[0]))]


def panel_formats(weight: np.ndarray) -> set[int]:
    """The GGML type codes of a packed weight's panels, from their headers."""
    return {int(head[0]) & ~PAIRS for head in _headers(weight)}


def packable(fmt: int, cols: int) -> bool:
    """Whether rows of this GGML type and width can be kept packed."""
    return fmt in BLOCK_COLS and cols % BLOCK_COLS[fmt] == 0


def _runs(parts: list[QuantizedRows], cols: int) -> list[tuple[int, int]]:
    """(first panel, panel bytes) of each run of panels of one length, three of them
    (the last ones empty where there are fewer): each part's panels as long as its format
    needs, or all as long as the longest where that makes more than three runs."""
    runs: list[tuple[int, int]] = []
    first = 0
    for part in parts:
        size = -(-panel_bytes(part.fmt, cols) // 64) * 64
        if not runs or runs[-1][1] != size:
            runs.append((first, size))
        first += -(-part.rows // PANEL)
    if len(runs) > 3:
        runs = [(0, max(size for _, size in runs))]
    return runs + [(first, runs[-1][1])] * (3 - len(runs))


def pack_rows(parts: list[QuantizedRows], rows: int, pairs: bool = True) -> Panels:
    """The packed panels of a weight [rows, K] made of ``parts`` (consecutive row ranges,
    each of one GGML type; every part but the last a multiple of 16 rows); Q8_0 in pairs
    of columns or not as ``panel_code`` says. The array is [panels, bytes / 16 of the
    shortest panel, 16]: panels of other lengths lie further on in its memory, where
    ``panel_address`` finds them."""
    from rvllm.host_memory import empty_huge_pages

    cols = parts[0].cols
    if sum(p.rows for p in parts) != rows or any(p.cols != cols for p in parts):
        raise ValueError("packed parts do not cover the weight's rows")
    if any(p.rows % PANEL for p in parts[:-1]):
        raise ValueError("packed parts must start on a panel of 16 rows")
    runs = _runs(parts, cols)
    total = -(-rows // PANEL)
    memory = empty_huge_pages((panel_offset(runs, total),), torch.uint8).numpy()
    shortest = min(size for _, size in runs)
    first = 0
    for part in parts:
        fmt = part.fmt
        n = part.rows
        count = -(-n // PANEL)
        data = part.data
        nb = cols // BLOCK_COLS[fmt]
        blocks = data.reshape(n, nb, TYPE_BYTES[fmt])
        if n % PANEL:
            pad = np.zeros((count * PANEL - n, nb, TYPE_BYTES[fmt]), np.uint8)
            blocks = np.concatenate((blocks, pad))
        code = panel_code(fmt, pairs)
        body = _panel_blocks(code, blocks.reshape(count, PANEL, nb, TYPE_BYTES[fmt]))
        size = body.shape[1] * body.shape[2]
        start = panel_offset(runs, first)
        stride = panel_offset(runs, first + 1) - start  # the part's panels: one run's length
        flat = memory[start:start + count * stride].reshape(count, stride)
        head = flat[:, :HEADER].view(np.int64)
        head[:, 0], head[:, 1], head[:, 2] = code, cols, stride // PANEL
        head[:, 3], head[:, 4] = runs[1][0], runs[1][1] // PANEL
        head[:, 5], head[:, 6] = runs[2][0], runs[2][1] // PANEL
        head[:, 7] = 0
        flat[:, HEADER:HEADER + size] = body.reshape(count, size)
        flat[:, HEADER + size:] = 0
        first += count
    out = memory[:total * shortest].reshape(total, shortest // PANEL, PANEL)
    return Panels(out, np.empty(0, np.float32), rows)


def set_x_bits(weight: np.ndarray, bits: int) -> None:
    """Have the packed weight's products take x rounded to ``bits`` (16 or 8) per block
    of 32: a field of every panel's header (``X_BITS``), read by ``rounded_x`` and the
    kernels. Eight bits skip half the byte products (x's low bytes) at a loss of
    precision: llama.cpp's activations, per block of 32."""
    if bits not in (8, 16):
        raise ValueError(f"packed weights take x rounded to 16 or 8 bits, not {bits}")
    for head in _headers(weight):
        head[X_BITS] = 8 if bits == 8 else 0


# --- the formats' walks over a block, in LLVM IR ---------------------------------------

@dataclass
class _Loop:
    """``count`` groups of 4 columns (``_dword_groups``) of each of a few streams, one
    sub-block each: stream s covers columns cols[s] + 4 i (i < count) of the block, whose
    weights are scales[s] * q - offsets[s] (None: no offset), q from ``decode(i)``[s]."""

    count: int
    cols: list[int]
    scales: list[ir.Value]
    offsets: list[ir.Value | None]
    decode: Callable[[ir.Value], list[ir.Value]]


def _bytes(builder: ir.IRBuilder, address: ir.Value) -> ir.Value:
    return builder.load(builder.inttoptr(address, _B16.as_pointer()), align=1)


def _halves(builder: ir.IRBuilder, address: ir.Value) -> ir.Value:
    raw = builder.load(builder.inttoptr(address, _H16.as_pointer()), align=1)
    return builder.fpext(raw, _VEC)


def _byte_splat(value: int) -> ir.Constant:
    return ir.Constant(_B16, [value] * LANES)


def _at(builder: ir.IRBuilder, base: ir.Value, offset: int | ir.Value) -> ir.Value:
    return builder.add(base, offset if isinstance(offset, ir.Value) else _int(offset))


def _column_bytes(builder: ir.IRBuilder, base: ir.Value, first: int, i: ir.Value) -> ir.Value:
    """The 16 lanes' bytes of column (or byte) ``first + i`` of a lane-innermost field."""
    return _bytes(builder, _at(builder, base, builder.mul(builder.add(i, _int(first)),
                                                          _int(PANEL))))


def _unsigned(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    return builder.uitofp(v, _VEC)


def _fmul(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    return builder.fmul(a, b, flags=_FAST)


def _scalar_splat(value: float) -> ir.Constant:
    return ir.Constant(_VEC, [value] * LANES)


def _product(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """a * b rounded once, as ``fma(a, b, -0.0)``: numba gives the kernels' plain float
    multiplies fast-math flags, under which LLVM reassociated products such as d * sc *
    dx differently in the one-row and the four-row passes (so a row's result depended
    on its batch)."""
    return _fma(builder, a, b, _scalar_splat(-0.0))


def _group_columns(builder: ir.IRBuilder, base: ir.Value, i: ir.Value) -> list[ir.Value]:
    """The 16 lanes' bytes of each of the 4 byte columns of group i of a ``_dword_groups``
    field: byte j of each row's int32."""
    group = builder.load(builder.inttoptr(_at(builder, base, builder.mul(i, _int(64))),
                                          _B64.as_pointer()), align=1)
    return [builder.shuffle_vector(group, group, _lanes([4 * r + j for r in range(PANEL)]))
            for j in range(4)]


def _pair_columns(builder: ir.IRBuilder, base: ir.Value, i: ir.Value) -> list[ir.Value]:
    """The 16 lanes' bytes of columns 4i .. 4i + 3 of a ``_pair_groups`` field (two pairs
    of 32 bytes)."""
    group = builder.load(builder.inttoptr(_at(builder, base, builder.mul(i, _int(64))),
                                          _B64.as_pointer()), align=1)
    return [builder.shuffle_vector(group, group, _lanes(
        [32 * (j // 2) + 2 * r + j % 2 for r in range(PANEL)])) for j in range(4)]


def _loops(builder: ir.IRBuilder, fmt: int, blk: ir.Value) -> list[_Loop]:
    """The loops of one panel block of ``fmt`` at address ``blk``."""
    lo = _byte_splat(0x0F)
    four = _byte_splat(4)
    if fmt in (Q4_0, Q4_1):
        d = _halves(builder, blk)
        if fmt == Q4_0:
            offset = _fmul(builder, d, _scalar_splat(8.0))
            nib = _at(builder, blk, 32)
        else:
            offset = builder.fsub(_scalar_splat(0.0), _halves(builder, _at(builder, blk, 32)),
                                  flags=_FAST)
            nib = _at(builder, blk, 64)

        def nibbles(i: ir.Value) -> list[ir.Value]:
            cols = _group_columns(builder, nib, i)
            return ([_unsigned(builder, builder.and_(b, lo)) for b in cols]
                    + [_unsigned(builder, builder.lshr(b, four)) for b in cols])

        return [_Loop(4, [0, 1, 2, 3, 16, 17, 18, 19], [d] * 8, [offset] * 8, nibbles)]
    if fmt in (Q8_0, Q8_0_PAIRS):
        d = _halves(builder, blk)
        q = _at(builder, blk, 32)

        def ints(i: ir.Value) -> list[ir.Value]:
            cols = (_group_columns(builder, q, i) if fmt == Q8_0
                    else _pair_columns(builder, q, i))
            return [builder.sitofp(b, _VEC) for b in cols]

        return [_Loop(8, [0, 1, 2, 3], [d] * 4, [None] * 4, ints)]
    if fmt in (Q4_K, Q5_K):
        d, dmin = _halves(builder, blk), _halves(builder, _at(builder, blk, 32))
        sc, mn = _at(builder, blk, 64), _at(builder, blk, 64 + 128)
        qh, qs = _at(builder, blk, 320), _at(builder, blk, 320 + (512 if fmt == Q5_K else 0))
        one = _byte_splat(1)
        loops = []
        for chunk in range(4):  # 64 columns: low nibbles 0-31, high ones 32-63
            scales, offsets = [], []
            for s in (2 * chunk, 2 * chunk + 1):
                scale = _unsigned(builder, _column_bytes(builder, sc, s, _int(0)))
                offset = _unsigned(builder, _column_bytes(builder, mn, s, _int(0)))
                scales += [_fmul(builder, d, scale)] * 4
                offsets += [_fmul(builder, dmin, offset)] * 4

            def k_groups(i: ir.Value, chunk: int = chunk) -> list[ir.Value]:
                cols = _group_columns(builder, _at(builder, qs, 512 * chunk), i)
                nibbles = ([builder.and_(b, lo) for b in cols]
                           + [builder.lshr(b, four) for b in cols])
                if fmt == Q5_K:  # bit 5: bits 2 chunk (low) and 2 chunk + 1 (high) of qh
                    tops = _group_columns(builder, qh, i)
                    nibbles = [builder.or_(n, builder.shl(builder.and_(builder.lshr(
                        tops[g % 4], _byte_splat(2 * chunk + g // 4)), one), four))
                        for g, n in enumerate(nibbles)]
                return [_unsigned(builder, n) for n in nibbles]

            first = 64 * chunk
            loops.append(_Loop(8, [first + j for j in range(4)]
                               + [first + 32 + j for j in range(4)], scales, offsets,
                               k_groups))
        return loops
    if fmt == Q6_K:
        d = _halves(builder, blk)
        sc, ql, qh = _at(builder, blk, 32), _at(builder, blk, 288), _at(builder, blk, 2336)
        three = _byte_splat(3)
        loops = []
        for half in range(2):  # 128 columns each
            for part in range(2):  # columns 16 part .. 16 part + 15 of each 32 (quarter t)
                subs = [8 * half + 2 * t + part for t in range(4)]
                scales = []
                for s in subs:
                    scales += [_fmul(builder, d, builder.sitofp(_column_bytes(
                        builder, sc, s, _int(0)), _VEC))] * 4
                offsets = [_fmul(builder, s, _scalar_splat(32.0)) for s in scales]

                def six_bits(i: ir.Value, half: int = half, part: int = part) -> list[ir.Value]:
                    g = builder.add(i, _int(4 * part))
                    a = _group_columns(builder, _at(builder, ql, 64 * 16 * half), g)
                    b = _group_columns(builder, _at(builder, ql, 64 * (16 * half + 8)), g)
                    h = _group_columns(builder, _at(builder, qh, 64 * 8 * half), g)
                    qs = []
                    for t in range(4):
                        src = a if t % 2 == 0 else b
                        for j in range(4):
                            low = (builder.and_(src[j], lo) if t < 2
                                   else builder.lshr(src[j], four))
                            top = builder.and_(builder.lshr(h[j], _byte_splat(2 * t)), three)
                            qs.append(_unsigned(builder, builder.or_(low, builder.shl(top,
                                                                                      four))))
                    return qs

                cols = [128 * half + 32 * t + 16 * part + j for t in range(4) for j in range(4)]
                loops.append(_Loop(4, cols, scales, offsets, six_bits))
        return loops
    raise AssertionError(fmt)


def _for_each_format(builder: ir.IRBuilder, panel: ir.Value,
                     body: Callable[..., None], eights: bool = False) -> None:
    """Run ``body(fmt, first block's address, block count, panel bytes)`` for the format
    the panel's header names (a switch over the formats; any other code does nothing).
    With ``eights``, ``body(..., eight)`` twice, for x of 16 bits and of 8 (``X_BITS``),
    with a branch on the header between them (Q8_0 in pairs: once, with 16)."""
    fmt = builder.load(builder.inttoptr(panel, _I64.as_pointer()), align=8)
    cols = builder.load(builder.inttoptr(_at(builder, panel, 8), _I64.as_pointer()), align=8)
    stride16 = builder.load(builder.inttoptr(_at(builder, panel, 16), _I64.as_pointer()),
                            align=8)
    stride = builder.mul(stride16, _int(PANEL))
    data = _at(builder, panel, HEADER)
    end = builder.append_basic_block("packed.end")
    switch = builder.switch(fmt, end)
    for code in [*BLOCK_COLS, Q8_0_PAIRS]:
        case = builder.append_basic_block(f"packed.{code}")
        switch.add_case(ir.Constant(_I64, code), case)
        builder.position_at_end(case)
        blocks = builder.sdiv(cols, _int(BLOCK_COLS[code & ~PAIRS]))
        if not eights:
            body(code, data, blocks, stride)
        elif code == Q8_0_PAIRS:  # x's int16 words: the same products for either
            body(code, data, blocks, stride, False)
        else:
            bits = builder.load(builder.inttoptr(_at(builder, panel, 8 * X_BITS),
                                                 _I64.as_pointer()), align=8)
            with builder.if_else(builder.icmp_signed("==", bits, _int(8))) as (eight, wide):
                with eight:
                    body(code, data, blocks, stride, True)
                with wide:
                    body(code, data, blocks, stride, False)
        builder.branch(end)
    builder.position_at_end(end)


def _store_rows(builder: ir.IRBuilder, acc: list[ir.Value], out: ir.Value) -> None:
    """out[b, 0:16] (float32, an address) = accumulator b, for each b."""
    for b, a in enumerate(acc):
        at = builder.add(out, _int(b * PANEL * 4))
        builder.store(builder.load(a), builder.inttoptr(at, _VEC.as_pointer()), align=4)


# Offsets in a rounded row of x (``byte_dots.quantize_rows``) of K = cols values.

def _x_pair(builder: ir.IRBuilder, cols: ir.Value, xblock: ir.Value) -> ir.Value:
    """Block xblock's float32 pair (d, d * sum q)."""
    return builder.add(builder.mul(cols, _int(2)), builder.mul(xblock, _int(8)))


def _x_sixteen(builder: ir.IRBuilder, cols: ir.Value, xblock: ir.Value,
               part: ir.Value) -> ir.Value:
    """The int32 sum of block xblock's integers over its columns 16 part .. 16 part + 15."""
    return builder.add(builder.add(builder.mul(cols, _int(2)), builder.sdiv(cols, _int(4))),
                       builder.add(builder.mul(xblock, _int(8)), builder.mul(part, _int(4))))


def _x_words(builder: ir.IRBuilder, cols: ir.Value, xblock: ir.Value) -> ir.Value:
    """Block xblock's integers as int16."""
    return builder.add(builder.add(builder.mul(cols, _int(2)), builder.sdiv(cols, _int(2))),
                       builder.mul(xblock, _int(64)))


def _splat_i(value: int) -> ir.Constant:
    return ir.Constant(V32, [value] * LANES)


def _ask_share(builder: ir.IRBuilder, block: ir.Value, part: ir.Value, parts: int,
               size: int) -> None:
    """Ask for share ``part`` of ``parts`` of the lines of the ``size``-byte block at
    ``block`` (the same block of the next panel), as this one is walked. Asked for all
    at once (37-53 lines a k-quant block), the AVX2 walks ran from memory at under half
    the memory's read rate, as if the block's own loads waited behind them; one row, two
    threads, G weights/s all at once and spread out: Q6_K 12 and 21.5, Q4_1 26 and 32.5,
    Q4_K 22-25 and 21-29; the 16-lane walks on AVX-512 (Zen 4), medians of six: Q6_K
    26.6 and 34.9, Q4_K 49.4 and 52.5 (docs/performance.md)."""
    each = -(-size // 64 // parts)
    first = builder.add(block, builder.mul(part, _int(64 * each)))
    for line in range(each):
        prefetch_line(builder, _at(builder, first, 64 * line))


def _int_dots(rows: int):
    """An intrinsic: out[b, 0:16] = the panel's 16 rows (Q4_0, Q4_1, Q8_0 or Q4_K, at
    address ``panel``) times rounded row b of x (``byte_dots.quantize_rows``: at xq + b *
    xq_step, bytes), for ``rows`` rows; out float32 [rows, 16].

    A block's weights come as groups of 4 byte columns, one int32 lane a row. Q4_0/Q4_1:
    4 groups, whose low nibbles are columns 4g..4g+3 and high ones 16 + 4g..; each is
    multiplied by the row's same 4 bytes in every lane (``dot_bytes``). Q8_0: 8 groups of
    signed bytes (``dot_signed``). Q4_K: each 64 columns 8 groups, their low nibbles one
    sub-block of 32 and their high ones the next. Each block of 32 columns takes these
    products for x's high bytes and again for its low bytes, in four chains, and its
    integer sum s = 255 * high + low then adds ``d * dx * s + offset * (dx * sum q)`` to
    the row's float32 lanes (offset m for Q4_1, -8 d for Q4_0, none for Q8_0; Q4_K's d sc
    and -dmin m), in block order whatever the number of rows: each row's result is the
    same number alone or in any batch."""

    @intrinsic
    def dots(typingctx, panel, xq, xq_step, out):
        def codegen(context, builder, signature, args):
            panel, xq, xq_step, out = args
            zero = ir.Constant(_VEC, [0.0] * LANES)
            mask = ir.Constant(V32, [0x0F0F0F0F] * LANES)
            four = ir.Constant(V32, [4] * LANES)
            eight_bits = ir.Constant(V32, [8] * LANES)
            ones = ir.Constant(V32, [0x01010101] * LANES)
            acc = [cgutils.alloca_once_value(builder, zero) for _ in range(rows)]
            cols = builder.load(builder.inttoptr(_at(builder, panel, 8), _I64.as_pointer()),
                                align=8)

            def groups(base: ir.Value, count: int) -> list[ir.Value]:
                return [builder.load(builder.inttoptr(_at(builder, base, 64 * g),
                                                      V32.as_pointer()), align=1)
                        for g in range(count)]

            def nibble_dots(nibbles: list[ir.Value],
                            top: int = 15) -> Callable[[list[ir.Value]], ir.Value]:
                """The products of groups of unsigned weights up to ``top`` by x's words."""
                fits = 32767 // (2 * top * 127)  # vpmaddubsw's pairs summed in 16 bits

                def dots(words: list[ir.Value]) -> ir.Value:
                    return dot_bytes_sum(context, builder, [
                        (nib, splat_i32(builder, word)) for nib, word in zip(nibbles, words)],
                        fits)
                return dots

            def add_block(b: int, xblock: ir.Value, dots: Callable[[list[ir.Value]], ir.Value],
                          d: ir.Value, offset: ir.Value | None, eight: bool,
                          part: ir.Value | None = None) -> None:
                """Row b's products with x's block ``xblock`` of 32 columns, added:
                ``dots(x's 8 words)`` for its high bytes and its low ones, then d * dx *
                (255 high + low) + offset * (dx * sum q); with ``eight`` (x of 8 bits, its
                integers the high bytes) the high bytes' alone, d * dx * high + ....
                With ``part`` (i64 0 or 1), only that half of the block's columns: ``dots``
                of its 4 words, and the weights' offset of 32 (Q6_K's q - 32) taken off in
                the integers."""
                row = builder.add(xq, builder.mul(_int(b), xq_step))
                first = builder.mul(xblock, _int(32))
                if part is not None:
                    first = builder.add(first, builder.mul(part, _int(16)))
                chains = []
                for half in range(1 if eight else 2):  # the high bytes, then the low ones
                    qs = builder.add(builder.add(row, builder.mul(cols, _int(half))), first)
                    chains.append(dots([builder.load(builder.inttoptr(
                        _at(builder, qs, 4 * c), _I32.as_pointer()), align=1)
                        for c in range(8 if part is None else 4)]))  # x's bytes 4c..4c+3
                high = chains[0]  # x's integers themselves where they have 8 bits
                total = high if eight else builder.add(
                    builder.sub(builder.shl(high, eight_bits), high), chains[1])
                if part is not None:  # the int32 sums over 16 columns, after the pairs
                    at = builder.add(row, _x_sixteen(builder, cols, xblock, part))
                    sixteen = builder.load(builder.inttoptr(at, _I32.as_pointer()), align=4)
                    total = builder.sub(total, splat_i32(builder, builder.shl(
                        sixteen, ir.Constant(_I32, 5))))
                add_total(b, xblock, total, d, offset)

            def add_total(b: int, xblock: ir.Value, total: ir.Value, d: ir.Value,
                          offset: ir.Value | None) -> None:
                """Row b's float32 lanes plus d * dx * total + offset * (dx * sum q), for
                the integer products ``total`` (<16 x i32>) with x's block ``xblock``."""
                row = builder.add(xq, builder.mul(_int(b), xq_step))
                scales = builder.add(row, _x_pair(builder, cols, xblock))
                dx = builder.load(builder.inttoptr(scales, _F32.as_pointer()), align=4)
                value = _fma(builder, _product(builder, d, _splat(builder, dx)),
                             builder.sitofp(total, _VEC), builder.load(acc[b]))
                if offset is not None:
                    sx = builder.load(builder.inttoptr(_at(builder, scales, 4),
                                                       _F32.as_pointer()), align=4)
                    value = _fma(builder, offset, _splat(builder, sx), value)
                builder.store(value, acc[b])

            def six_bit_blocks(index: ir.Value, blk: ir.Value, d: ir.Value,
                               ask: Callable[[ir.Value], None], eight: bool) -> None:
                """A Q6_K block: 16 sub-blocks of 16 columns, each q - 32 times d and its
                signed 8-bit scale. Its 128 columns h are four quarters of 32 t, whose
                low 4 bits are the low (t = 0, 1) or high (t = 2, 3) nibbles of bytes
                32 (t % 2) + column of ql, their top 2 bits bits 2 t of byte column of qh."""
                ql, qh = _at(builder, blk, 288), _at(builder, blk, 2336)
                m30 = ir.Constant(V32, [0x30303030] * LANES)
                # A loop, not unrolled: a whole block's code for four rows of x was too
                # long for the core's caches of decoded instructions.
                with cgutils.for_range(builder, _int(4)) as step:
                    ask(step.index)
                    h = builder.lshr(step.index, _int(1))
                    part = builder.and_(step.index, _int(1))  # columns 16 part.. of quarters
                    lows = builder.add(ql, builder.mul(builder.add(builder.mul(h, _int(4)),
                                                                   part), _int(256)))
                    tops = groups(builder.add(qh, builder.mul(builder.add(
                        builder.mul(h, _int(2)), part), _int(256))), 4)
                    for t in range(4):  # a quarter's vectors at a time
                        low = groups(_at(builder, lows, 512 * (t % 2)), 4)
                        # bits 2t, 2t + 1 of qh's bytes to bits 4, 5
                        quarter = [builder.or_(
                            builder.and_(v if t < 2 else builder.lshr(v, four), mask),
                            builder.and_(builder.shl(u, _splat_i(4 - 2 * t)) if t < 2
                                         else builder.lshr(u, _splat_i(2 * t - 4)), m30))
                            for v, u in zip(low, tops)]
                        sub = builder.add(builder.mul(h, _int(8)), _at(builder, part, 2 * t))
                        scale = _product(builder, d, builder.sitofp(_column_bytes(
                            builder, _at(builder, blk, 32), 0, sub), _VEC))
                        xblock = builder.add(builder.mul(index, _int(8)),
                                             _at(builder, builder.mul(h, _int(4)), t))
                        for r in range(rows):
                            add_block(r, xblock, nibble_dots(quarter, 63), scale, None, eight,
                                      part)

            def nibbles_of(base: ir.Value, count: int, halves: tuple[int, ...] = (0, 1)
                           ) -> list[ir.Value]:
                """``count`` groups of nibble bytes as vectors of groups: their low
                nibbles (half 0), then their high ones (half 1)."""
                packed = groups(base, count)
                return [builder.and_(v if h == 0 else builder.lshr(v, four), mask)
                        for h in halves for v in packed]

            def walk(fmt: int, data: ir.Value, blocks: ir.Value, stride: ir.Value,
                     eight: bool) -> None:
                for a in acc:
                    builder.store(zero, a)
                with cgutils.for_range(builder, blocks) as block:
                    blk = builder.add(data, builder.mul(block.index,
                                                        _int(PANEL_BLOCK_BYTES[fmt & ~PAIRS])))
                    # The same block of the next panel: a small block's lines at once, a
                    # k-quant block's in four shares (``_ask_share``).
                    size = PANEL_BLOCK_BYTES[fmt & ~PAIRS]
                    ahead = builder.add(blk, stride)
                    spread = fmt in (Q4_K, Q5_K, Q6_K)
                    for line in range(0 if spread else -(-size // 64)):
                        prefetch_line(builder, builder.add(ahead, _int(64 * line)))

                    def ask(step: ir.Value) -> None:
                        if spread:
                            _ask_share(builder, ahead, step, 4, size)
                    d = _halves(builder, blk)
                    if fmt == Q6_K:
                        six_bit_blocks(block.index, blk, d, ask, eight)
                        return
                    if fmt in (Q4_K, Q5_K):  # 8 sub-blocks of 32 columns, 6-bit scale/min
                        dmin = _halves(builder, _at(builder, blk, 32))
                        # A loop over 64 columns at a time (see six_bit_blocks).
                        with cgutils.for_range(builder, _int(4)) as step:
                            ask(step.index)
                            base = builder.add(_at(builder, blk, 832 if fmt == Q5_K else 320),
                                               builder.mul(step.index, _int(512)))
                            for half in range(2):  # a sub-block's vectors at a time
                                s = _at(builder, builder.mul(step.index, _int(2)), half)
                                nibbles = nibbles_of(base, 8, (half,))
                                if fmt == Q5_K:  # the fifth bits: bit s of qh's bytes
                                    bit = splat_i32(builder, builder.trunc(s, ir.IntType(32)))
                                    nibbles = [builder.or_(n, builder.shl(builder.and_(
                                        builder.lshr(f, bit), ones), four))
                                        for n, f in zip(nibbles, groups(_at(builder, blk, 320),
                                                                        8))]
                                scale = _product(builder, d, _unsigned(builder, _column_bytes(
                                    builder, _at(builder, blk, 64), 0, s)))
                                offset = _product(builder, dmin, _unsigned(builder, _column_bytes(
                                    builder, _at(builder, blk, 192), 0, s)))
                                offset = builder.fneg(offset)
                                xblock = builder.add(builder.mul(block.index, _int(8)), s)
                                dots = nibble_dots(nibbles, 31 if fmt == Q5_K else 15)
                                for b in range(rows):
                                    add_block(b, xblock, dots, scale, offset, eight)
                        return
                    if fmt == Q8_0_PAIRS:
                        # Each pair of columns widened to int16 once for every row, then
                        # one vpmaddwd by x's int16 pair of those columns.
                        q = _at(builder, blk, 32)
                        wide = [builder.sext(builder.load(builder.inttoptr(
                            _at(builder, q, 32 * c), _B32.as_pointer()), align=1), _W32)
                            for c in range(16)]
                        for b in range(rows):
                            words = builder.add(builder.add(xq, builder.mul(_int(b), xq_step)),
                                                _x_words(builder, cols, block.index))
                            pair = [ir.Constant(V32, [0] * LANES)] * 2
                            for c in range(16):
                                word = builder.load(builder.inttoptr(
                                    _at(builder, words, 4 * c), _I32.as_pointer()), align=1)
                                pair[c % 2] = dot_words(context, builder, pair[c % 2], wide[c],
                                                        builder.bitcast(splat_i32(builder, word),
                                                                        _W32))
                            add_total(b, block.index, builder.add(pair[0], pair[1]), d, None)
                        return
                    offset = None
                    if fmt == Q8_0:
                        signed = signed_weights(context, builder,
                                                groups(_at(builder, blk, 32), 8))

                        def dots(words: list[ir.Value]) -> ir.Value:
                            return dot_signed(context, builder, signed, words)
                    else:
                        if fmt == Q4_1:
                            offset = _halves(builder, _at(builder, blk, 32))
                            nib = _at(builder, blk, 64)
                        else:
                            offset = _product(builder, d, _scalar_splat(-8.0))
                            nib = _at(builder, blk, 32)
                        # Low nibbles by x's bytes 4g.., high ones by 16 + 4g..
                        dots = nibble_dots(nibbles_of(nib, 4))
                    for b in range(rows):
                        add_block(b, block.index, dots, d, offset, eight)

            _for_each_format(builder, panel, walk, eights=True)
            _store_rows(builder, acc, out)
            return context.get_dummy_value()

        return types.void(*(types.int64,) * 4), codegen

    return dots


_int_dots1, _int_dots2, _int_dots3, _int_dots4 = (_int_dots(rows)
                                                  for rows in range(1, PASS_ROWS + 1))


# --- AVX2 without AVX-512: eight lanes a walk --------------------------------------------

HALF = PANEL // 2
NARROW_FORMATS = (Q4_0, Q4_1, Q8_0_PAIRS, Q4_K, Q6_K)
_N32, _NF = ir.VectorType(_I32, HALF), ir.VectorType(_F32, HALF)
_NB, _NW = ir.VectorType(_I8, 4 * HALF), ir.VectorType(ir.IntType(16), 2 * HALF)


def _narrow_cpu(context) -> bool:  # noqa: ANN001
    features = _features(context)
    return "+avx2" in features and "+avx512f" not in features


@intrinsic
def narrow_cpu(typingctx):
    """Whether numba compiles for AVX2 without AVX-512 (``_narrow_dots``): a constant."""
    def codegen(context, builder, signature, args):
        return ir.Constant(ir.IntType(1), _narrow_cpu(context))
    return types.boolean(), codegen


def _narrow_dots(rows: int):
    """``_int_dots`` for Q4_0, Q4_1, Q8_0 (in pairs), Q4_K and Q6_K, on AVX2's 16
    registers of 8 lanes: the panel walked once for lanes 0-7 and again for 8-15, and
    each block's weight vectors taken by every row as they come, a group at a time: the
    16-lane walk kept more vectors alive than AVX2 has registers, and its passes of 2-4
    rows ran slower per row than one row's. The same integers and the same float32
    operations per lane as ``_int_dots``, so the same numbers."""

    @intrinsic
    def dots(typingctx, panel, xq, xq_step, out):
        def codegen(context, builder, signature, args):
            panel, xq, xq_step, out = args
            zero = ir.Constant(_NF, [0.0] * HALF)
            mask = ir.Constant(_N32, [0x0F0F0F0F] * HALF)
            four = ir.Constant(_N32, [4] * HALF)
            ones16 = ir.Constant(_NW, [1] * (2 * HALF))
            cols = builder.load(builder.inttoptr(_at(builder, panel, 8), _I64.as_pointer()),
                                align=8)
            row_at = [builder.add(xq, builder.mul(_int(b), xq_step)) for b in range(rows)]

            def fma(a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
                return _call(builder, f"llvm.fma.v{HALF}f32", _NF, [a, b, c])

            def splat(value: ir.Value, kind: ir.VectorType) -> ir.Value:
                vector = builder.insert_element(ir.Constant(kind, ir.Undefined), value,
                                                ir.Constant(_I32, 0))
                return builder.shuffle_vector(vector, vector, ir.Constant(
                    ir.VectorType(_I32, kind.count), [0] * kind.count))

            def word(address: ir.Value) -> ir.Value:
                return builder.load(builder.inttoptr(address, _I32.as_pointer()), align=1)

            def halves8(address: ir.Value) -> ir.Value:
                raw = builder.load(builder.inttoptr(address, ir.VectorType(
                    ir.HalfType(), HALF).as_pointer()), align=1)
                return builder.fpext(raw, _NF)

            def vector(address: ir.Value, kind: ir.Type) -> ir.Value:
                return builder.load(builder.inttoptr(address, kind.as_pointer()), align=1)

            def add_total(acc: ir.Value, b: int, block: ir.Value, total: ir.Value,
                          d: ir.Value, offset: ir.Value | None) -> ir.Value:
                scales = builder.add(row_at[b], _x_pair(builder, cols, block))
                dx = builder.load(builder.inttoptr(scales, _F32.as_pointer()), align=4)
                product = fma(d, splat(dx, _NF), ir.Constant(_NF, [-0.0] * HALF))
                value = fma(product, builder.sitofp(total, _NF), acc)
                if offset is not None:
                    sx = builder.load(builder.inttoptr(_at(builder, scales, 4),
                                                       _F32.as_pointer()), align=4)
                    value = fma(offset, splat(sx, _NF), value)
                return value

            def byte_totals(weights: list[ir.Value], first: ir.Value, fits: int, eight: bool
                            ) -> list[ir.Value]:
                """Per row: 255 (w . h) + (w . l) for x's high bytes h and low ones l
                (w . h with ``eight``: x's 8-bit integers are its high bytes), weights[c]
                (4-bit or 6-bit, unsigned) by x's word c at ``first`` + 4c: each group taken
                by every row as it comes, ``fits`` 16-bit sums of ``vpmaddubsw`` before a
                ``vpmaddwd`` widens them."""
                parts = 1 if eight else 2
                short = [[None, None] for _ in range(rows)]
                wide = [[None, None] for _ in range(rows)]
                for c, weights_c in enumerate(weights):
                    w = builder.bitcast(weights_c, _NB)
                    for b in range(rows):
                        for part in range(parts):  # x's high bytes, then its low ones
                            at = builder.add(builder.add(row_at[b], builder.mul(
                                cols, _int(part))), _at(builder, first, 4 * c))
                            x = builder.bitcast(splat(word(at), _N32), _NB)
                            product = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _NW, [w, x])
                            last = short[b][part]
                            short[b][part] = product if last is None else builder.add(
                                last, product)
                    if (c + 1) % fits and c + 1 < len(weights):
                        continue
                    for b in range(rows):
                        for part in range(parts):
                            widened = _call(builder, "llvm.x86.avx2.pmadd.wd", _N32,
                                            [short[b][part], ones16])
                            last = wide[b][part]
                            wide[b][part] = widened if last is None else builder.add(
                                last, widened)
                            short[b][part] = None
                bits = ir.Constant(_N32, [8] * HALF)
                return [high if eight else
                        builder.add(builder.sub(builder.shl(high, bits), high), low)
                        for high, low in wide]

            def nibbles(raw: ir.Value, high: int) -> ir.Value:
                return builder.and_(builder.lshr(raw, four) if high else raw, mask)

            def groups8(base: ir.Value, count: int, half: int) -> list[ir.Value]:
                """The half's 8 lanes of ``count`` groups of a ``_dword_groups`` field."""
                return [vector(_at(builder, base, 64 * g + 32 * half), _N32)
                        for g in range(count)]

            def lane_bytes(address: ir.Value, signed: bool) -> ir.Value:
                raw = vector(address, ir.VectorType(_I8, HALF))
                return builder.sitofp(raw, _NF) if signed else builder.uitofp(raw, _NF)

            def negative_zero() -> ir.Constant:
                return ir.Constant(_NF, [-0.0] * HALF)

            def walk(fmt: int, data: ir.Value, blocks: ir.Value, stride: ir.Value,
                     eight: bool) -> None:
                if fmt not in NARROW_FORMATS:
                    return
                size = PANEL_BLOCK_BYTES[fmt & ~PAIRS]
                for half in range(2):
                    acc = [cgutils.alloca_once_value(builder, zero) for _ in range(rows)]

                    def add_all(block: ir.Value, totals: list[ir.Value], d: ir.Value,
                                offset: ir.Value | None, acc: list = acc) -> None:
                        for b in range(rows):
                            builder.store(add_total(builder.load(acc[b]), b, block,
                                                    totals[b], d, offset), acc[b])

                    with cgutils.for_range(builder, blocks) as block:
                        blk = builder.add(data, builder.mul(block.index, _int(size)))
                        # The same block of the next panel, asked for a share of its
                        # lines at a time as this one is walked (``_ask_share``).
                        if fmt not in (Q4_K, Q6_K):
                            _ask_share(builder, builder.add(blk, stride), _int(half), 2, size)
                        d = halves8(_at(builder, blk, 16 * half))
                        if fmt == Q8_0_PAIRS:
                            # Each pair of columns widened once, then taken by every row.
                            pair = [[ir.Constant(_N32, [0] * HALF)] * 2 for _ in range(rows)]
                            first = _x_words(builder, cols, block.index)
                            for c in range(16):
                                w = builder.sext(vector(_at(builder, blk, 32 + 32 * c + 16 * half),
                                                        ir.VectorType(_I8, 2 * HALF)), _NW)
                                for b in range(rows):
                                    x = builder.bitcast(splat(word(builder.add(
                                        row_at[b], _at(builder, first, 4 * c))), _N32), _NW)
                                    product = _call(builder, "llvm.x86.avx2.pmadd.wd", _N32,
                                                    [w, x])
                                    pair[b][c % 2] = builder.add(pair[b][c % 2], product)
                            add_all(block.index, [builder.add(a, b) for a, b in pair], d, None)
                        elif fmt in (Q4_0, Q4_1):
                            if fmt == Q4_1:
                                offset = halves8(_at(builder, blk, 32 + 16 * half))
                                nib = _at(builder, blk, 64)
                            else:
                                offset = fma(d, ir.Constant(_NF, [-8.0] * HALF), negative_zero())
                                nib = _at(builder, blk, 32)
                            raw = groups8(nib, 4, half)
                            # x's words 0-3 by the low nibbles, 4-7 by the high ones
                            weights = [nibbles(v, 0) for v in raw] + [nibbles(v, 1) for v in raw]
                            add_all(block.index, byte_totals(
                                weights, builder.mul(block.index, _int(32)), 8, eight), d,
                                offset)
                        elif fmt == Q4_K:  # 8 sub-blocks of 32 columns, 6-bit scale/min
                            dmin = halves8(_at(builder, blk, 32 + 16 * half))
                            with cgutils.for_range(builder, _int(4)) as step:  # 64 columns
                                _ask_share(builder, builder.add(blk, stride), builder.add(
                                    step.index, _int(4 * half)), 8, size)
                                raw = groups8(builder.add(_at(builder, blk, 320),
                                                          builder.mul(step.index, _int(512))),
                                              8, half)
                                for high in range(2):  # a sub-block's low nibbles, high ones
                                    s = _at(builder, builder.mul(step.index, _int(2)), high)
                                    at = builder.add(builder.mul(s, _int(PANEL)), _int(8 * half))
                                    scale = fma(d, lane_bytes(_at(builder, builder.add(
                                        blk, at), 64), False), negative_zero())
                                    offset = builder.fneg(fma(dmin, lane_bytes(_at(
                                        builder, builder.add(blk, at), 192), False),
                                        negative_zero()))
                                    xblock = builder.add(builder.mul(block.index, _int(8)), s)
                                    add_all(xblock, byte_totals(
                                        [nibbles(v, high) for v in raw],
                                        builder.mul(xblock, _int(32)), 8, eight), scale, offset)
                        else:  # Q6_K: see ``_int_dots``'s six_bit_blocks
                            ql, qh = _at(builder, blk, 288), _at(builder, blk, 2336)
                            m30 = ir.Constant(_N32, [0x30303030] * HALF)
                            with cgutils.for_range(builder, _int(4)) as step:
                                _ask_share(builder, builder.add(blk, stride), builder.add(
                                    step.index, _int(4 * half)), 8, size)
                                h = builder.lshr(step.index, _int(1))
                                part = builder.and_(step.index, _int(1))
                                lows = builder.add(ql, builder.mul(builder.add(
                                    builder.mul(h, _int(4)), part), _int(256)))
                                tops = groups8(builder.add(qh, builder.mul(builder.add(
                                    builder.mul(h, _int(2)), part), _int(256))), 4, half)
                                for t in range(4):
                                    low = groups8(_at(builder, lows, 512 * (t % 2)), 4, half)
                                    quarter = [builder.or_(
                                        nibbles(v, t >= 2),
                                        builder.and_(builder.shl(u, ir.Constant(
                                            _N32, [4 - 2 * t] * HALF)) if t < 2 else
                                            builder.lshr(u, ir.Constant(
                                                _N32, [2 * t - 4] * HALF)), m30))
                                        for v, u in zip(low, tops)]
                                    sub = builder.add(builder.mul(h, _int(8)),
                                                      _at(builder, part, 2 * t))
                                    scale = fma(d, lane_bytes(builder.add(_at(
                                        builder, blk, 32 + 8 * half), builder.mul(
                                            sub, _int(PANEL))), True), negative_zero())
                                    xblock = builder.add(builder.mul(block.index, _int(8)),
                                                         _at(builder, builder.mul(h, _int(4)), t))
                                    first = builder.add(builder.mul(xblock, _int(32)),
                                                        builder.mul(part, _int(16)))
                                    totals = byte_totals(quarter, first, 2, eight)
                                    # the offset of 32: x's integer sums over 16 columns
                                    at = _x_sixteen(builder, cols, xblock, part)
                                    for b in range(rows):
                                        sixteen = builder.load(builder.inttoptr(builder.add(
                                            row_at[b], at), _I32.as_pointer()), align=4)
                                        totals[b] = builder.sub(totals[b], splat(builder.shl(
                                            sixteen, ir.Constant(_I32, 5)), _N32))
                                    add_all(xblock, totals, scale, None)
                    for b in range(rows):
                        at = builder.add(out, _int(b * PANEL * 4 + HALF * 4 * half))
                        builder.store(builder.load(acc[b]),
                                      builder.inttoptr(at, _NF.as_pointer()), align=4)

            _for_each_format(builder, panel, walk, eights=True)
            return context.get_dummy_value()

        return types.void(*(types.int64,) * 4), codegen

    return dots


_narrow1, _narrow2, _narrow3, _narrow4 = (_narrow_dots(rows)
                                          for rows in range(1, PASS_ROWS + 1))


@intrinsic
def _dequant_panel(typingctx, panel, out):
    """out float32 [K, 16] (an address) = the panel at address ``panel``, widened: column
    k of its 16 rows at out + 64 k."""

    def codegen(context, builder, signature, args):
        panel, out = args

        def walk(fmt: int, data: ir.Value, blocks: ir.Value, stride: ir.Value) -> None:
            with cgutils.for_range(builder, blocks) as block:
                blk = builder.add(data, builder.mul(block.index,
                                                    _int(PANEL_BLOCK_BYTES[fmt & ~PAIRS])))
                col0 = builder.mul(block.index, _int(BLOCK_COLS[fmt & ~PAIRS]))
                for loop in _loops(builder, fmt, blk):
                    negs = [None if o is None else builder.fsub(_scalar_splat(0.0), o,
                                                                flags=_FAST)
                            for o in loop.offsets]
                    with cgutils.for_range(builder, _int(loop.count)) as step:
                        i = step.index
                        for s, q in enumerate(loop.decode(i)):
                            value = (_fmul(builder, loop.scales[s], q) if negs[s] is None
                                     else _fma(builder, loop.scales[s], q, negs[s]))
                            col = builder.add(col0, builder.add(
                                builder.mul(i, _int(4)), _int(loop.cols[s])))
                            at = builder.add(out, builder.mul(col, _int(PANEL * 4)))
                            builder.store(value, builder.inttoptr(at, _VEC.as_pointer()),
                                          align=4)

        _for_each_format(builder, panel, walk)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


# --- numba entry points ----------------------------------------------------------------

def is_packed(w):  # noqa: ANN001, ANN201 - numba-only; see the overload below
    """Whether panels ``w`` are packed (uint8): a constant when compiled."""
    return w.dtype == np.uint8


@overload(is_packed, inline="always")
def _is_packed(w):  # noqa: ANN001, ANN202
    packed = w.dtype == types.uint8
    return lambda w: packed


@intrinsic
def _load_i64(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], _I64.as_pointer()), align=8)
    return types.int64(types.int64), codegen


@numba.njit(cache=True, inline="always")
def _header(address, field):
    """Field ``field`` (0: format, 1: K, 2: panel bytes / 16) of the panel header at
    ``address``."""
    return _load_i64(address + 8 * field)


@numba.njit(cache=True, inline="always")
def panel_address(w, p):
    """Where panel p of the packed weight w begins: its runs of panels of one length
    (``pack_rows``) from the first panel's header."""
    base = w.ctypes.data
    s0, q1, s1, q2, s2 = (_header(base, 2), _header(base, 3), _header(base, 4),
                          _header(base, 5), _header(base, 6))
    return base + PANEL * (p * s0 + max(p - q1, 0) * (s1 - s0) + max(p - q2, 0) * (s2 - s1))


@numba.njit(cache=True, inline="always")
def panel_stride16(address):
    """A packed weight's shortest panel's bytes over 16 (its array's shape[1]), from its
    first panel's header."""
    return min(_header(address, 2), _header(address, 4), _header(address, 6))


@numba.njit(cache=True, inline="always")
def rounded_x(x, w):
    """x's rows rounded to integers (``byte_dots.rounded_rows``) where w is packed, to be
    passed to ``packed_dots`` beside x; else an empty array."""
    if is_packed(w):
        return rounded_rows(x, eight_bit_x(w))
    return np.empty((0, 0), np.uint8)


@numba.njit(cache=True, inline="always")
def eight_bit_x(w):
    """Whether the packed weight w takes x rounded to 8 bits (``X_BITS``)."""
    return _header(w.ctypes.data, X_BITS) == 8


@numba.njit(cache=True, inline="always")
def _narrow_format(code):
    return code != Q5_K and code != Q8_0


@numba.njit(cache=True)
def packed_dots(w, p, xq, b0, rows, out_address):
    """16 sums per row (float32 [rows, 16] at ``out_address``) of rows b0 .. b0 + rows
    (rows <= 4) of x times packed panel p of w, read straight from its bytes, from the
    rows' integer roundings xq (``byte_dots.quantize_rows``)."""
    panel = panel_address(w, p)
    qa, q_step = xq.ctypes.data + b0 * xq.strides[0], xq.strides[0]
    if narrow_cpu() and _narrow_format(_header(panel, 0)):
        if rows == 1:
            _narrow1(panel, qa, q_step, out_address)
        elif rows == 2:
            _narrow2(panel, qa, q_step, out_address)
        elif rows == 3:
            _narrow3(panel, qa, q_step, out_address)
        else:
            _narrow4(panel, qa, q_step, out_address)
    elif rows == 1:
        _int_dots1(panel, qa, q_step, out_address)
    elif rows == 2:
        _int_dots2(panel, qa, q_step, out_address)
    elif rows == 3:
        _int_dots3(panel, qa, q_step, out_address)
    else:
        _int_dots4(panel, qa, q_step, out_address)


@numba.njit(cache=True)
def dequant_panel(w, p, scratch):
    """Packed panel p of w widened into scratch float32 [1, K, 16]."""
    _dequant_panel(panel_address(w, p), scratch.ctypes.data)


@numba.njit(parallel=True, cache=True)
def _rows_of(w, ids, out):
    """out[i] = row ids[i] of the packed weight w (its panel widened; its lane kept)."""
    k = out.shape[1]
    for i in numba.prange(ids.shape[0]):
        scratch = np.empty((1, k, PANEL), np.float32)
        r = ids[i]
        dequant_panel(w, r // PANEL, scratch)
        for c in range(k):
            out[i, c] = scratch[0, c, r % PANEL]


def packed_rows(weight: np.ndarray, ids: torch.Tensor, cols: int) -> torch.Tensor:
    """Rows ``ids`` of a packed weight (an embedding), dequantized: [*ids.shape, cols]."""
    flat = ids.reshape(-1).to(torch.int64)
    out = torch.empty(flat.shape[0], cols)
    _rows_of(weight, flat.numpy(), out.numpy())
    return out.view(*ids.shape, cols)


def dequantize_panels(weight: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """The whole packed weight widened to float32 [rows, cols] (for tests and tools)."""
    return packed_rows(weight, torch.arange(rows), cols)


def warm_up() -> None:
    """Compile (or load from numba's cache) the packed kernels on a tiny weight."""
    data = np.zeros((2, TYPE_BYTES[Q8_0]), np.uint8)
    panels = pack_rows([QuantizedRows(Q8_0, data, 32)], 2)
    packed_rows(panels.weight, torch.zeros(1, dtype=torch.int64), 32)

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
each field turned lane-innermost. A field of one byte a weight (a k-quant's 6-bit
sub-block scales, unpacked to a byte each) becomes a 16-byte vector a column; two
nibbles a byte become a 16-byte vector holding two columns (low and high nibble); the
float16 scales a 32-byte vector of 16. Q4_0's, Q4_1's and Q4_K's nibble bytes and Q8_0's
integers go four byte columns together instead, each row's four bytes one int32 lane
(``_dword_groups``), as the byte products take them. The bytes are the file's, but for
Q4_K's and Q5_K's sub-block scales and minima, unpacked from 12 bytes to 16 (+2.8% and
+2.3% of those formats' bytes). Rows past N are zero blocks. Panels of one weight may
differ in format (a fused Q/K/V whose V rows are Q6_K and the others Q4_K): each panel
is read by its own header, and panels of a weight are all as long as the longest.

**Formats.** Q4_0, Q4_1, Q8_0 (blocks of 32) and Q4_K, Q5_K, Q6_K (blocks of 256). Each
weight is ``scale * q - offset`` for an integer q and a (scale, offset) pair per sub-
block of 16 or 32 columns (Q4_0: d, 8 d; Q4_1: d, -m; Q8_0: d, 0; Q4_K/Q5_K: d sc,
dmin m; Q6_K: d sc, 32 d sc).

**Arithmetic.** Q4_0, Q4_1, Q8_0 and Q4_K panels (``INT_FORMATS``: the default SmolLM2
file's layers and its tied LM head, every int4 weight, most of a Q4_K_M file) multiply x
rounded to 16-bit integers per block of 32, held as two bytes (``byte_dots``), bytes by
bytes: ``_int_dots`` takes 1-4 rows of x a pass over the panel for any number of rows,
and gives each row the same number whatever the batch. Q8_0's signed integers go through
``byte_dots.dot_signed``; a Q4_K block is eight sub-blocks of 32, each with its own
scale and minimum, so it adds eight such block products.
The result is the float32 product of the dequantized weight with that rounded x (tested
within 1e-5 of a float64 product), about 2e-5 of the largest output off the product with
x itself on random data. Widening these weights to float32 instead kept a thread at about
20 G weights/s of Q4_1 from the cache on a 2-vCPU Xeon with AVX-512 VNNI, below its
memory's read, and each more row of x cost nearly as much again; the byte products run
one row at about 50 G weights/s from the cache and four rows at about 20 each, so that
from memory one thread read SmolLM2-shaped Q4_1 panels at 22 G weights/s for one row
and 18.5 for four (widened: 16 and 11.5).

Q5_K and Q6_K keep x in float32. For each sub-block and row of x the kernel sums
``q * x`` over its columns (the integers widened to float32 in registers, one multiply-
add per column for 16 rows) and then adds ``scale * sum - offset * (sum of x over the
sub-block)``; the sums of x over every 16 columns are made once per call. So the result
is the float32 product with the dequantized weight up to the order of the sums (tested
within 1e-5 relative of a float64 product with ``models.dequant``'s weights).

- ``_int_dots1`` .. ``_int_dots4``: one Q4_0/Q4_1/Q8_0/Q4_K panel times 1-4 rounded rows
  of x.
- ``_dots1`` .. ``_dots4``: one panel of another format times 1-4 rows of x, straight
  from the packed bytes: the one-row GEMV of decode and the few-row steps.
- ``_dequant_panel``: one panel widened into a float32 scratch panel [K, 16]: with more
  rows than ``DIRECT_ROWS`` a panel of another format is widened once and then
  multiplied by every four rows of x with ``gemv``'s float32 passes (past 8 rows, by
  ``f32_gemm``'s six-row tiles), its scratch in the L1/L2 cache; embedding rows are
  looked up through it.

``gemv._panels_into`` and the compiled decode steps take these panels (uint8
``Panels``) beside the float32 and int8 ones; ``packed_rows`` dequantizes embedding rows
on lookup.
"""

from __future__ import annotations

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
    dot_bytes,
    dot_signed,
    rounded_rows,
    signed_weights,
    splat_i32,
)
from rvllm.kernels.cpu.numerics import prefetch_line
from rvllm.kernels.cpu.panels import Panels
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
HEADER = 64  # bytes of a panel's header: format code, K, panel bytes / 16
# With more rows of x than this a panel is widened to float32 once, then multiplied
# (``_dequant_panel``); with at most this many it is read packed for each four rows.
DIRECT_ROWS = 4

# GGML type codes (``models.ggml_types.GGMLType``) of the formats kept packed.
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
FORMAT_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
                Q6_K: "Q6_K"}
# Columns a block covers, bytes of a GGUF block (one row), bytes of a panel block (16).
BLOCK_COLS = {Q4_0: 32, Q4_1: 32, Q8_0: 32, Q4_K: 256, Q5_K: 256, Q6_K: 256}
# Formats multiplied by rounded integer activations (``_int_dots``), and by float32 ones
# (``_dots``).
INT_FORMATS = (Q4_0, Q4_1, Q8_0, Q4_K)
FLOAT_FORMATS = tuple(f for f in BLOCK_COLS if f not in INT_FORMATS)
TYPE_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_K: 144, Q5_K: 176, Q6_K: 210}
PANEL_BLOCK_BYTES = {Q4_0: 288, Q4_1: 320, Q8_0: 544, Q4_K: 2368, Q5_K: 2880, Q6_K: 3360}

_I8 = ir.IntType(8)
_B16 = ir.VectorType(_I8, LANES)
_B64 = ir.VectorType(_I8, 4 * LANES)
_H16 = ir.VectorType(ir.HalfType(), LANES)


# --- panel layouts ---------------------------------------------------------------------

def _lanes_inner(field: np.ndarray) -> np.ndarray:
    """[P, 16, nb, width] bytes of one field of every row's blocks -> [P, nb, width, 16]
    flattened to [P, nb, width * 16]: the 16 rows innermost."""
    p, _, nb, width = field.shape
    return field.transpose(0, 2, 3, 1).reshape(p, nb, width * PANEL)


def _dword_groups(field: np.ndarray) -> np.ndarray:
    """[P, 16, nb, 16] nibble bytes of a 32-column block -> [P, nb, 256]: for each group
    of 4 byte columns, the 16 rows' 4 bytes in row order (an int32 lane a row)."""
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
    elif fmt == Q4_0:
        fields = [_halves_inner(blocks[..., 0:2]), _dword_groups(blocks[..., 2:18])]
    elif fmt == Q4_1:
        fields = [_halves_inner(blocks[..., 0:2]), _halves_inner(blocks[..., 2:4]),
                  _dword_groups(blocks[..., 4:20])]
    elif fmt in (Q4_K, Q5_K):
        sc, mn = _k_scales(blocks[..., 4:16])
        quants = ([_lanes_inner(blocks[..., 16:48]), _lanes_inner(blocks[..., 48:176])]
                  if fmt == Q5_K else [_dword_groups(blocks[..., 16:144])])
        fields = [_halves_inner(blocks[..., 0:2]), _halves_inner(blocks[..., 2:4]),
                  _lanes_inner(sc), _lanes_inner(mn), *quants]
    elif fmt == Q6_K:
        fields = [_halves_inner(blocks[..., 208:210]), _lanes_inner(blocks[..., 192:208]),
                  _lanes_inner(blocks[..., 0:128]), _lanes_inner(blocks[..., 128:192])]
    else:
        raise ValueError(f"no packed layout for GGML type {fmt}")
    return np.concatenate(fields, axis=-1)


def panel_bytes(fmt: int, cols: int) -> int:
    """Bytes of one panel of a [*, cols] weight in ``fmt``."""
    return HEADER + cols // BLOCK_COLS[fmt] * PANEL_BLOCK_BYTES[fmt]


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


def panel_formats(weight: np.ndarray) -> set[int]:
    """The GGML type codes of a packed weight's panels, from their headers."""
    return set(weight.reshape(weight.shape[0], -1)[:, 0:8].view(np.int64)[:, 0].tolist())


def packable(fmt: int, cols: int) -> bool:
    """Whether rows of this GGML type and width can be kept packed."""
    return fmt in BLOCK_COLS and cols % BLOCK_COLS[fmt] == 0


def pack_rows(parts: list[QuantizedRows], rows: int) -> Panels:
    """The packed panels of a weight [rows, K] made of ``parts`` (consecutive row ranges,
    each of one GGML type; every part but the last a multiple of 16 rows)."""
    from rvllm.host_memory import empty_huge_pages

    cols = parts[0].cols
    if sum(p.rows for p in parts) != rows or any(p.cols != cols for p in parts):
        raise ValueError("packed parts do not cover the weight's rows")
    if any(p.rows % PANEL for p in parts[:-1]):
        raise ValueError("packed parts must start on a panel of 16 rows")
    stride = max(panel_bytes(p.fmt, cols) for p in parts)
    stride = -(-stride // 64) * 64
    total = -(-rows // PANEL)
    out = empty_huge_pages((total, stride // PANEL, PANEL), torch.uint8).numpy()
    flat = out.reshape(total, stride)
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
        body = _panel_blocks(fmt, blocks.reshape(count, PANEL, nb, TYPE_BYTES[fmt]))
        size = body.shape[1] * body.shape[2]
        head = flat[first:first + count, :HEADER].view(np.int64)
        head[:, 0], head[:, 1], head[:, 2] = fmt, cols, stride // PANEL
        head[:, 3:] = 0
        flat[first:first + count, HEADER:HEADER + size] = body.reshape(count, size)
        flat[first:first + count, HEADER + size:] = 0
        first += count
    return Panels(out, np.empty(0, np.float32), rows)


# --- the formats' walks over a block, in LLVM IR ---------------------------------------

@dataclass
class _Loop:
    """``count`` columns of each of a few streams, one sub-block each: stream s covers
    columns cols[s] + step * i (i < count) of the block, whose weights are scales[s] * q
    - offsets[s] (None: no offset), q from ``decode(i)``[s]."""

    count: int
    cols: list[int]
    scales: list[ir.Value]
    offsets: list[ir.Value | None]
    decode: Callable[[ir.Value], list[ir.Value]]
    step: int = 1


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


def _group_columns(builder: ir.IRBuilder, base: ir.Value, i: ir.Value) -> list[ir.Value]:
    """The 16 lanes' bytes of each of the 4 byte columns of group i of a ``_dword_groups``
    field: byte j of each row's int32."""
    group = builder.load(builder.inttoptr(_at(builder, base, builder.mul(i, _int(64))),
                                          _B64.as_pointer()), align=1)
    return [builder.shuffle_vector(group, group, _lanes([4 * r + j for r in range(PANEL)]))
            for j in range(4)]


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

        return [_Loop(4, [0, 1, 2, 3, 16, 17, 18, 19], [d] * 8, [offset] * 8, nibbles,
                      step=4)]
    if fmt == Q8_0:
        d = _halves(builder, blk)
        q = _at(builder, blk, 32)

        def ints(i: ir.Value) -> list[ir.Value]:
            return [builder.sitofp(b, _VEC) for b in _group_columns(builder, q, i)]

        return [_Loop(8, [0, 1, 2, 3], [d] * 4, [None] * 4, ints, step=4)]
    if fmt == Q4_K:
        d, dmin = _halves(builder, blk), _halves(builder, _at(builder, blk, 32))
        sc, mn = _at(builder, blk, 64), _at(builder, blk, 64 + 128)
        loops = []
        for chunk in range(4):  # 64 columns: low nibbles 0-31, high ones 32-63
            scales, offsets = [], []
            for s in (2 * chunk, 2 * chunk + 1):
                scale = _unsigned(builder, _column_bytes(builder, sc, s, _int(0)))
                offset = _unsigned(builder, _column_bytes(builder, mn, s, _int(0)))
                scales += [_fmul(builder, d, scale)] * 4
                offsets += [_fmul(builder, dmin, offset)] * 4

            def k_groups(i: ir.Value, chunk: int = chunk) -> list[ir.Value]:
                cols = _group_columns(builder, _at(builder, blk, 320 + 512 * chunk), i)
                return ([_unsigned(builder, builder.and_(b, lo)) for b in cols]
                        + [_unsigned(builder, builder.lshr(b, four)) for b in cols])

            first = 64 * chunk
            loops.append(_Loop(8, [first + j for j in range(4)]
                               + [first + 32 + j for j in range(4)], scales, offsets,
                               k_groups, step=4))
        return loops
    if fmt == Q5_K:
        d, dmin = _halves(builder, blk), _halves(builder, _at(builder, blk, 32))
        sc, mn = _at(builder, blk, 64), _at(builder, blk, 64 + 128)
        qh = _at(builder, blk, 320)
        nib = _at(builder, blk, 320 + 512)
        loops = []
        for chunk in range(4):
            subs = (2 * chunk, 2 * chunk + 1)
            scales = [_fmul(builder, d, _unsigned(builder, _column_bytes(builder, sc, s,
                                                                        _int(0))))
                      for s in subs]
            offsets = [_fmul(builder, dmin, _unsigned(builder, _column_bytes(builder, mn, s,
                                                                            _int(0))))
                       for s in subs]

            def k_nibbles(i: ir.Value, chunk: int = chunk) -> list[ir.Value]:
                b = _column_bytes(builder, nib, 32 * chunk, i)
                low, high = builder.and_(b, lo), builder.lshr(b, four)
                h = _column_bytes(builder, qh, 0, i)
                one = _byte_splat(1)
                low = builder.or_(low, builder.shl(builder.and_(
                    builder.lshr(h, _byte_splat(2 * chunk)), one), four))
                high = builder.or_(high, builder.shl(builder.and_(
                    builder.lshr(h, _byte_splat(2 * chunk + 1)), one), four))
                return [_unsigned(builder, low), _unsigned(builder, high)]

            loops.append(_Loop(32, [64 * chunk, 64 * chunk + 32], scales, offsets, k_nibbles))
        return loops
    if fmt == Q6_K:
        d = _halves(builder, blk)
        sc, ql, qh = _at(builder, blk, 32), _at(builder, blk, 288), _at(builder, blk, 2336)
        three = _byte_splat(3)
        loops = []
        for half in range(2):  # 128 columns each
            for part in range(2):  # columns l = 16 part .. 16 part + 15 of each quarter
                subs = [8 * half + part + 2 * t for t in range(4)]
                scales = [_fmul(builder, d, builder.sitofp(_column_bytes(builder, sc, s,
                                                                         _int(0)), _VEC))
                          for s in subs]
                offsets = [_fmul(builder, s, _scalar_splat(32.0)) for s in scales]

                def six_bits(i: ir.Value, half: int = half, part: int = part) -> list[ir.Value]:
                    a = _column_bytes(builder, ql, 64 * half + 16 * part, i)
                    b = _column_bytes(builder, ql, 64 * half + 32 + 16 * part, i)
                    h = _column_bytes(builder, qh, 32 * half + 16 * part, i)
                    tops = [builder.shl(builder.and_(builder.lshr(h, _byte_splat(2 * t)),
                                                     three), four) for t in range(4)]
                    qs = [builder.or_(builder.and_(a, lo), tops[0]),
                          builder.or_(builder.and_(b, lo), tops[1]),
                          builder.or_(builder.lshr(a, four), tops[2]),
                          builder.or_(builder.lshr(b, four), tops[3])]
                    return [_unsigned(builder, q) for q in qs]

                cols = [128 * half + 16 * part + 32 * t for t in range(4)]
                loops.append(_Loop(16, cols, scales, offsets, six_bits))
        return loops
    raise AssertionError(fmt)


def _for_each_format(builder: ir.IRBuilder, panel: ir.Value,
                     body: Callable[[int, ir.Value, ir.Value, ir.Value], None],
                     formats: tuple[int, ...] = tuple(BLOCK_COLS)) -> None:
    """Run ``body(fmt, first block's address, block count, panel bytes)`` for the format
    the panel's header names (a switch over ``formats``; any other code does nothing)."""
    fmt = builder.load(builder.inttoptr(panel, _I64.as_pointer()), align=8)
    cols = builder.load(builder.inttoptr(_at(builder, panel, 8), _I64.as_pointer()), align=8)
    stride16 = builder.load(builder.inttoptr(_at(builder, panel, 16), _I64.as_pointer()),
                            align=8)
    stride = builder.mul(stride16, _int(PANEL))
    data = _at(builder, panel, HEADER)
    end = builder.append_basic_block("packed.end")
    switch = builder.switch(fmt, end)
    for code in formats:
        case = builder.append_basic_block(f"packed.{FORMAT_NAMES[code]}")
        switch.add_case(ir.Constant(_I64, code), case)
        builder.position_at_end(case)
        body(code, data, builder.sdiv(cols, _int(BLOCK_COLS[code])), stride)
        builder.branch(end)
    builder.position_at_end(end)


def _store_rows(builder: ir.IRBuilder, acc: list[ir.Value], out: ir.Value) -> None:
    """out[b, 0:16] (float32, an address) = accumulator b, for each b."""
    for b, a in enumerate(acc):
        at = builder.add(out, _int(b * PANEL * 4))
        builder.store(builder.load(a), builder.inttoptr(at, _VEC.as_pointer()), align=4)


def _dots(rows: int):
    """An intrinsic: out[b, 0:16] = x[b] . the panel's 16 rows, for the ``rows`` rows of
    x at x + b * x_step (bytes; float32), xs their sums over every 16 columns at xs + b *
    xs_step, the panel at address ``panel``, out float32 [rows, 16]. Each block asks
    for the same block of the next panel as it goes: widening the blocks keeps the
    core busy, and the hardware's prefetchers alone left a thread reading the panels
    from memory at half the rate it computes them from the cache (SmolLM2's Q4_1
    layers: 9.6 against 20 G weights/s on one thread)."""

    @intrinsic
    def dots(typingctx, panel, x, x_step, xs, xs_step, out):
        def codegen(context, builder, signature, args):
            panel, x, x_step, xs, xs_step, out = args
            zero = ir.Constant(_VEC, [0.0] * LANES)
            acc = [cgutils.alloca_once_value(builder, zero) for _ in range(rows)]

            def walk(fmt: int, data: ir.Value, blocks: ir.Value, stride: ir.Value) -> None:
                for a in acc:
                    builder.store(zero, a)
                with cgutils.for_range(builder, blocks) as block:
                    blk = builder.add(data, builder.mul(block.index,
                                                        _int(PANEL_BLOCK_BYTES[fmt])))
                    ahead = builder.add(blk, stride)
                    for line in range(-(-PANEL_BLOCK_BYTES[fmt] // 64)):
                        prefetch_line(builder, builder.add(ahead, _int(64 * line)))
                    col0 = builder.mul(block.index, _int(BLOCK_COLS[fmt]))
                    for loop in _loops(builder, fmt, blk):
                        sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(rows)]
                                for _ in loop.cols]
                        for per in sums:
                            for s in per:
                                builder.store(zero, s)
                        with cgutils.for_range(builder, _int(loop.count)) as step:
                            i = step.index
                            qs = loop.decode(i)
                            for s, (first, q) in enumerate(zip(loop.cols, qs)):
                                col = builder.add(col0, builder.add(i, _int(first)))
                                for b in range(rows):
                                    at = builder.add(builder.add(x, builder.mul(_int(b), x_step)),
                                                     builder.mul(col, _int(4)))
                                    xv = builder.load(builder.inttoptr(at, _F32.as_pointer()),
                                                      align=4)
                                    builder.store(_fma(builder, _splat(builder, xv), q,
                                                       builder.load(sums[s][b])), sums[s][b])
                        for s, first in enumerate(loop.cols):
                            group = builder.sdiv(builder.add(col0, _int(first)), _int(16))
                            for b in range(rows):
                                total = _fma(builder, loop.scales[s], builder.load(sums[s][b]),
                                             builder.load(acc[b]))
                                if loop.offsets[s] is not None:
                                    row_xs = builder.add(xs, builder.mul(_int(b), xs_step))
                                    xsum = None
                                    for g in range(loop.count // 16):
                                        at = builder.add(row_xs, builder.mul(
                                            builder.add(group, _int(g)), _int(4)))
                                        v = builder.load(builder.inttoptr(at, _F32.as_pointer()),
                                                         align=4)
                                        xsum = v if xsum is None else builder.fadd(
                                            xsum, v, flags=_FAST)
                                    neg = builder.fsub(_scalar_splat(0.0), loop.offsets[s],
                                                       flags=_FAST)
                                    total = _fma(builder, neg, _splat(builder, xsum), total)
                                builder.store(total, acc[b])

            _for_each_format(builder, panel, walk, FLOAT_FORMATS)
            _store_rows(builder, acc, out)
            return context.get_dummy_value()

        return types.void(*(types.int64,) * 6), codegen

    return dots


_dots1, _dots2, _dots3, _dots4 = (_dots(rows) for rows in range(1, DIRECT_ROWS + 1))


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
            izero = ir.Constant(V32, [0] * LANES)
            mask = ir.Constant(V32, [0x0F0F0F0F] * LANES)
            four = ir.Constant(V32, [4] * LANES)
            eight = ir.Constant(V32, [8] * LANES)
            acc = [cgutils.alloca_once_value(builder, zero) for _ in range(rows)]
            cols = builder.load(builder.inttoptr(_at(builder, panel, 8), _I64.as_pointer()),
                                align=8)

            def groups(base: ir.Value, count: int) -> list[ir.Value]:
                return [builder.load(builder.inttoptr(_at(builder, base, 64 * g),
                                                      V32.as_pointer()), align=1)
                        for g in range(count)]

            def nibble_dots(nibbles: list[ir.Value]) -> Callable[[list[ir.Value]], ir.Value]:
                def dots(words: list[ir.Value]) -> ir.Value:
                    # Two chains: one chain for a one-row pass waited on each product's
                    # latency.
                    pair = [izero, izero]
                    for g in range(8):
                        pair[g % 2] = dot_bytes(context, builder, pair[g % 2], nibbles[g],
                                                splat_i32(builder, words[g]))
                    return builder.add(pair[0], pair[1])
                return dots

            def add_block(b: int, xblock: ir.Value, dots: Callable[[list[ir.Value]], ir.Value],
                          d: ir.Value, offset: ir.Value | None) -> None:
                """Row b's products with x's block ``xblock`` of 32 columns, added:
                ``dots(x's 8 words)`` for its high bytes and its low ones, then d * dx *
                (255 high + low) + offset * (dx * sum q)."""
                row = builder.add(xq, builder.mul(_int(b), xq_step))
                chains = []
                for half in range(2):  # the high bytes, then the low ones
                    qs = builder.add(builder.add(row, builder.mul(cols, _int(half))),
                                     builder.mul(xblock, _int(32)))
                    chains.append(dots([builder.load(builder.inttoptr(
                        _at(builder, qs, 4 * c), _I32.as_pointer()), align=1)
                        for c in range(8)]))  # x's bytes 4c..4c+3 of the block
                high, low = chains
                total = builder.add(builder.sub(builder.shl(high, eight), high), low)
                scales = builder.add(builder.add(row, builder.mul(cols, _int(2))),
                                     builder.mul(xblock, _int(8)))
                dx = builder.load(builder.inttoptr(scales, _F32.as_pointer()), align=4)
                # Products without fast-math flags: reassociated (d sc dx for Q4_K), they
                # came out differently for another CPU's vector width.
                value = _fma(builder, builder.fmul(d, _splat(builder, dx)),
                             builder.sitofp(total, _VEC), builder.load(acc[b]))
                if offset is not None:
                    sx = builder.load(builder.inttoptr(_at(builder, scales, 4),
                                                       _F32.as_pointer()), align=4)
                    value = _fma(builder, offset, _splat(builder, sx), value)
                builder.store(value, acc[b])

            def nibbles_of(base: ir.Value, count: int) -> list[ir.Value]:
                """``count`` groups of nibble bytes as 2 * count vectors of groups: their
                low nibbles, then their high ones."""
                packed = groups(base, count)
                return ([builder.and_(v, mask) for v in packed]
                        + [builder.and_(builder.lshr(v, four), mask) for v in packed])

            def walk(fmt: int, data: ir.Value, blocks: ir.Value, stride: ir.Value) -> None:
                for a in acc:
                    builder.store(zero, a)
                with cgutils.for_range(builder, blocks) as block:
                    blk = builder.add(data, builder.mul(block.index,
                                                        _int(PANEL_BLOCK_BYTES[fmt])))
                    ahead = builder.add(blk, stride)
                    for line in range(-(-PANEL_BLOCK_BYTES[fmt] // 64)):
                        prefetch_line(builder, builder.add(ahead, _int(64 * line)))
                    d = _halves(builder, blk)
                    if fmt == Q4_K:  # 8 sub-blocks of 32 columns, each its 6-bit scale/min
                        dmin = _halves(builder, _at(builder, blk, 32))
                        for chunk in range(4):
                            nibbles = nibbles_of(_at(builder, blk, 320 + 512 * chunk), 8)
                            for half in range(2):
                                s = 2 * chunk + half
                                scale = builder.fmul(d, _unsigned(builder, _column_bytes(
                                    builder, _at(builder, blk, 64), s, _int(0))))
                                offset = builder.fmul(dmin, _unsigned(builder, _column_bytes(
                                    builder, _at(builder, blk, 192), s, _int(0))))
                                offset = builder.fmul(offset, _scalar_splat(-1.0))
                                xblock = builder.add(builder.mul(block.index, _int(8)), _int(s))
                                for b in range(rows):
                                    add_block(b, xblock,
                                              nibble_dots(nibbles[8 * half:8 * half + 8]),
                                              scale, offset)
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
                            offset = builder.fmul(d, _scalar_splat(-8.0))
                            nib = _at(builder, blk, 32)
                        # Low nibbles by x's bytes 4g.., high ones by 16 + 4g..
                        dots = nibble_dots(nibbles_of(nib, 4))
                    for b in range(rows):
                        add_block(b, block.index, dots, d, offset)

            _for_each_format(builder, panel, walk, INT_FORMATS)
            _store_rows(builder, acc, out)
            return context.get_dummy_value()

        return types.void(*(types.int64,) * 4), codegen

    return dots


_int_dots1, _int_dots2, _int_dots3, _int_dots4 = (_int_dots(rows)
                                                  for rows in range(1, DIRECT_ROWS + 1))


@intrinsic
def _dequant_panel(typingctx, panel, out):
    """out float32 [K, 16] (an address) = the panel at address ``panel``, widened: column
    k of its 16 rows at out + 64 k."""

    def codegen(context, builder, signature, args):
        panel, out = args

        def walk(fmt: int, data: ir.Value, blocks: ir.Value, stride: ir.Value) -> None:
            with cgutils.for_range(builder, blocks) as block:
                blk = builder.add(data, builder.mul(block.index, _int(PANEL_BLOCK_BYTES[fmt])))
                col0 = builder.mul(block.index, _int(BLOCK_COLS[fmt]))
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
                                builder.mul(i, _int(loop.step)), _int(loop.cols[s])))
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
def panel_stride16(address):
    """A packed weight's panel bytes over 16 (its panels' shape[1]), from its header."""
    return _header(address, 2)


@numba.njit(cache=True, inline="always")
def rounded_x(x, w):
    """x's rows rounded to integers (``byte_dots.rounded_rows``) where w is packed, to be
    passed to ``packed_dots`` beside x; else an empty array."""
    if is_packed(w):
        return rounded_rows(x)
    return np.empty((0, 0), np.uint8)


@numba.njit(fastmath=True, cache=True, inline="always")
def x_sums(x):
    """Sums of each row of x [B, K] over every 16 columns: [B, ceil(K / 16)]."""
    k = x.shape[1]
    groups = (k + 15) // 16
    out = np.zeros((x.shape[0], groups), np.float32)
    for b in range(x.shape[0]):
        for g in range(groups):
            total = np.float32(0.0)
            for i in range(g * 16, min(k, g * 16 + 16)):
                total += x[b, i]
            out[b, g] = total
    return out


@numba.njit(cache=True, inline="always")
def int_panel(w, p):
    """Whether packed panel p of w is multiplied by rounded activations
    (``INT_FORMATS``)."""
    fmt = _header(w.ctypes.data + p * w.shape[1] * PANEL, 0)
    return fmt == Q4_0 or fmt == Q4_1 or fmt == Q8_0 or fmt == Q4_K


@numba.njit(cache=True)
def packed_dots(w, p, x, b0, rows, xs, xq, out_address):
    """16 sums per row (float32 [rows, 16] at ``out_address``) of x[b0 : b0 + rows]
    (rows <= 4) times packed panel p of w, read straight from its bytes: with the rows'
    integer roundings xq (``byte_dots.quantize_rows``) for a panel of ``INT_FORMATS``,
    else with x itself and its sums over every 16 columns xs (``x_sums``)."""
    panel = w.ctypes.data + p * w.shape[1] * PANEL
    if int_panel(w, p):
        qa, q_step = xq.ctypes.data + b0 * xq.strides[0], xq.strides[0]
        if rows == 1:
            _int_dots1(panel, qa, q_step, out_address)
        elif rows == 2:
            _int_dots2(panel, qa, q_step, out_address)
        elif rows == 3:
            _int_dots3(panel, qa, q_step, out_address)
        else:
            _int_dots4(panel, qa, q_step, out_address)
        return
    xa, step = x.ctypes.data + b0 * x.strides[0], x.strides[0]
    xsa, xs_step = xs.ctypes.data + b0 * xs.strides[0], xs.strides[0]
    if rows == 1:
        _dots1(panel, xa, step, xsa, xs_step, out_address)
    elif rows == 2:
        _dots2(panel, xa, step, xsa, xs_step, out_address)
    elif rows == 3:
        _dots3(panel, xa, step, xsa, xs_step, out_address)
    else:
        _dots4(panel, xa, step, xsa, xs_step, out_address)


@numba.njit(cache=True)
def dequant_panel(w, p, scratch):
    """Packed panel p of w widened into scratch float32 [1, K, 16]."""
    _dequant_panel(w.ctypes.data + p * w.shape[1] * PANEL, scratch.ctypes.data)


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

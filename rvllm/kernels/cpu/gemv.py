"""Matrix-vector products for decode on the CPU, compiled with numba.

A decode step of one sequence multiplies one row of activations by every weight matrix:
the time is the time to read the weights. oneDNN's packed GEMM and fbgemm read them at
10-14 GB/s at one row (measured on an AMD machine of this class); the kernel here reads
them as fast as the memory delivers. So a linear layer with this path keeps a copy of
its weight in panels (below) beside the packed one (``layers.cpu_linear``), and one-row
inputs come here.

**Panels.** The weight [N, K] is kept as [ceil(N / 16), K, 16]: panel p holds output rows
16p..16p+15, column by column, so one 16-lane vector of a panel is one column of those
rows (rows past N are zeros). A panel is then a dot product of x with 16 rows at once
without any horizontal sum: for each column i, one vector load of the panel and one
multiply-add with x[i] broadcast. Row-major rows need a load of x beside each load of the
weight and a horizontal sum per row; read that way (one row after another, or eight rows
far apart at once) the same weights came in at 46-51 GB/s on a 2-core AMD Zen 5 where a
plain read of them ran at 58-62, and the panels at 64-67 (SmolLM2-shaped and
random-Llama-shaped stacks, alternated).

**Streams.** Each thread cuts its share of the panels into four runs (two with more than
one row of x) and reads them side by side, a column of each in turn: four streams a
thread, each in memory order, whose sums are the independent chains of multiply-adds. On
a 2-core AMD Zen 3 one stream a thread came in at 19-20 GB/s where four came in at 25-30
and a plain read at 25-33 (400 MB of random-Llama-shaped panels, alternated): its
prefetchers keep one stream a thread from filling the memory's queues. The panels sit in
transparent huge pages (``rvllm.host_memory``): no TLB miss every 4 KiB of a stream.
Panels made in a weight's own memory (``panels_in_place``, a server's start) move into
huge pages when the layer's deferred reorder runs (``layers.cpu_linear``).

- float32 weight [N, K];
- int8 weight [N, K] with one float32 scale per output row; the activations stay
  float32 (each weight widened in registers), so this computes
  ``F.linear(x, q.float() * scale[:, None])`` up to summation order.

Float32 accumulation: the same numbers as ``F.linear`` up to the order of the sums.
``_matvec`` also takes a few rows of x at once (each panel read from memory once for all
of them, from the cache again for every fourth row) and a bias: the compiled decoder
step (``decoder_step``) calls it too.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from rvllm.host_memory import empty_huge_pages
from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the kernels' cache
from rvllm.kernels.cpu.packed import (
    PASS_ROWS,
    packed_dots,
    packed_rows,
    rounded_x,
)
from rvllm.kernels.cpu.panels import Panels, packed_cols
from rvllm.kernels.cpu.vectors import _F32, _FAST, _VEC, LANES, _fma, _int, _splat, _vector_at

PANEL = LANES  # output rows a panel holds: one vector of each column
ROWS = 4  # rows of x a panel's pass takes at most (their sums stay in registers)
SUMS = 2 * ROWS  # rows of a pass's scratch: two streams of ROWS rows, or four of one


def panel_shape(rows: int, cols: int) -> tuple[int, int, int]:
    """The shape of the panels of a [rows, cols] weight."""
    return -(-rows // PANEL), cols, PANEL


def _panel_column(builder: ir.IRBuilder, w: ir.Value, i: ir.Value, int8: bool) -> ir.Value:
    """Column i of the panel at address w: 16 weights, widened to float32."""
    if not int8:
        return builder.load(_vector_at(builder, w, builder.mul(i, _int(PANEL))), align=4)
    raw_type = ir.VectorType(ir.IntType(8), PANEL)
    address = builder.add(w, builder.mul(i, _int(PANEL)))
    raw = builder.load(builder.inttoptr(address, raw_type.as_pointer()), align=1)
    return builder.sitofp(raw, _VEC)


def _x_splat(builder: ir.IRBuilder, x: ir.Value, i: ir.Value) -> ir.Value:
    """x[i] (float32, x an address) in every lane of a vector."""
    at = builder.add(x, builder.mul(i, _int(4)))
    return _splat(builder, builder.load(builder.inttoptr(at, _F32.as_pointer()), align=4))


def _panel_pass(rows: int):
    """An intrinsic: out[b, 0:16] = sum over i < k of x[b, i] * panel[i, 0:16] for the
    ``rows`` rows of x at x + b * x_step (bytes; float32), panel at the address w (the
    element type of ``like``: float32 or int8), out: float32 [rows, 16] at address out.
    Fewer rows keep more sums a row, so that enough multiply-adds are in flight: columns
    i, i + 1, ... go to sums of their own, added at the end."""
    sums_a_row = ROWS // rows

    @intrinsic
    def panel_pass(typingctx, w, x, x_step, k, out, like):
        int8 = like.dtype == types.int8

        def codegen(context, builder, signature, args):
            w, x, x_step, k, out, _ = args
            zero = ir.Constant(_VEC, [0.0] * LANES)
            sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(sums_a_row)]
                    for _ in range(rows)]  # registers, after LLVM's mem2reg

            def column(i: ir.Value, s: int) -> None:
                wv = _panel_column(builder, w, i, int8)
                for b in range(rows):
                    xb = _x_splat(builder, builder.add(x, builder.mul(_int(b), x_step)), i)
                    builder.store(_fma(builder, xb, wv, builder.load(sums[b][s])),
                                  sums[b][s])

            whole = builder.sdiv(k, _int(sums_a_row))
            with cgutils.for_range(builder, whole) as step:
                first = builder.mul(step.index, _int(sums_a_row))
                for s in range(sums_a_row):
                    column(builder.add(first, _int(s)), s)
            done = builder.mul(whole, _int(sums_a_row))
            with cgutils.for_range(builder, builder.sub(k, done)) as rest:
                column(builder.add(done, rest.index), 0)
            for b in range(rows):
                total = builder.load(sums[b][0])
                for s in range(1, sums_a_row):
                    total = builder.fadd(total, builder.load(sums[b][s]), flags=_FAST)
                builder.store(total, _vector_at(builder, out, _int(b * PANEL)), align=4)
            return context.get_dummy_value()

        return types.void(types.int64, types.int64, types.int64, types.int64, types.int64,
                          like), codegen

    return panel_pass


_pass1, _pass2, _pass3, _pass4 = (_panel_pass(rows) for rows in range(1, ROWS + 1))


def _stream_pass(rows: int, streams: int):
    """An intrinsic: out[s * rows + b, 0:16] = x[b] . the 16 rows of panel s, for s <
    ``streams`` (2 or 4) panels read side by side, a column of each in turn: panel s at
    the address w + (s % 2) * inner + (s // 2) * outer (bytes); the rest as
    ``_panel_pass``. One sum a row and panel: the streams are the independent chains."""

    @intrinsic
    def stream_pass(typingctx, w, inner, outer, x, x_step, k, out, like):
        int8 = like.dtype == types.int8

        def codegen(context, builder, signature, args):
            w, inner, outer, x, x_step, k, out, _ = args
            zero = ir.Constant(_VEC, [0.0] * LANES)
            sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(rows)]
                    for _ in range(streams)]
            starts = [builder.add(builder.add(w, builder.mul(inner, _int(s % 2))),
                                  builder.mul(outer, _int(s // 2))) for s in range(streams)]
            with cgutils.for_range(builder, k) as loop:
                i = loop.index
                xs = [_x_splat(builder, builder.add(x, builder.mul(_int(b), x_step)), i)
                      for b in range(rows)]
                for s in range(streams):
                    wv = _panel_column(builder, starts[s], i, int8)
                    for b in range(rows):
                        builder.store(_fma(builder, xs[b], wv, builder.load(sums[s][b])),
                                      sums[s][b])
            for s in range(streams):
                for b in range(rows):
                    builder.store(builder.load(sums[s][b]),
                                  _vector_at(builder, out, _int((s * rows + b) * PANEL)),
                                  align=4)
            return context.get_dummy_value()

        return types.void(types.int64, types.int64, types.int64, types.int64, types.int64,
                          types.int64, types.int64, like), codegen

    return stream_pass


_s4r1 = _stream_pass(1, 4)
_s2r1, _s2r2, _s2r3, _s2r4 = (_stream_pass(rows, 2) for rows in range(1, ROWS + 1))


def _pieces_pass(panels: int):
    """An intrinsic: out[p, 0:16] = x . the 16 rows of panel p, for ``panels`` (1 or 2)
    panels at w + p * inner (bytes) and one row of x (float32, at address x), each panel
    read as 4 / ``panels`` pieces of ``piece`` columns side by side (a panel has that
    many pieces' columns): four streams in all, each piece's sums added at the end."""
    pieces = 4 // panels

    @intrinsic
    def pieces_pass(typingctx, w, inner, x, piece, out, like):
        int8 = like.dtype == types.int8

        def codegen(context, builder, signature, args):
            w, inner, x, piece, out, _ = args
            zero = ir.Constant(_VEC, [0.0] * LANES)
            piece_bytes = builder.mul(piece, _int(PANEL * (1 if int8 else 4)))
            streams = [(p, c) for c in range(pieces) for p in range(panels)]
            starts = [builder.add(builder.add(w, builder.mul(inner, _int(p))),
                                  builder.mul(piece_bytes, _int(c))) for p, c in streams]
            x_starts = [builder.add(x, builder.mul(piece, _int(4 * c))) for c in range(pieces)]
            sums = [cgutils.alloca_once_value(builder, zero) for _ in streams]
            with cgutils.for_range(builder, piece) as loop:
                i = loop.index
                xs = [_x_splat(builder, base, i) for base in x_starts]
                for (_, c), start, total in zip(streams, starts, sums):
                    wv = _panel_column(builder, start, i, int8)
                    builder.store(_fma(builder, xs[c], wv, builder.load(total)), total)
            for p in range(panels):
                total = builder.load(sums[p])
                for c in range(1, pieces):
                    total = builder.fadd(total, builder.load(sums[c * panels + p]),
                                         flags=_FAST)
                builder.store(total, _vector_at(builder, out, _int(p * PANEL)), align=4)
            return context.get_dummy_value()

        return types.void(types.int64, types.int64, types.int64, types.int64, types.int64,
                          like), codegen

    return pieces_pass


_halves_pass, _quarters_pass = _pieces_pass(2), _pieces_pass(1)


@numba.njit(cache=True, inline="always")
def _streams(batch):
    """How many panels a pass over ``batch`` rows of x reads side by side: four for one
    row, two for more (their sums then fill the registers)."""
    return 4 if batch == 1 else 2


@numba.njit(cache=True, inline="always")
def _panel_dots(w, p, x, b0, rows, sums):
    """sums[b, j] = x[b0 + b] . weight row 16p + j, for b < rows (at most ROWS): panel p
    of the panels w [P, K, 16], x [B, K] float32 and C-contiguous, sums float32 [SUMS,
    16]."""
    k = w.shape[1]
    address = w.ctypes.data + p * k * PANEL * w.itemsize
    xa, step, out = x.ctypes.data + b0 * x.strides[0], x.strides[0], sums.ctypes.data
    if rows == 1:
        _pass1(address, xa, step, k, out, w)
    elif rows == 2:
        _pass2(address, xa, step, k, out, w)
    elif rows == 3:
        _pass3(address, xa, step, k, out, w)
    else:
        _pass4(address, xa, step, k, out, w)


@numba.njit(cache=True, inline="always")
def _group_dots(w, p, inner, outer, streams, x, b0, rows, sums):
    """sums[s * rows + b, j] = x[b0 + b] . weight row 16 p_s + j for the panels p_s = p +
    (s % 2) * inner + (s // 2) * outer, s < streams (four with one row, else two), read
    side by side; b < rows (at most ROWS)."""
    k = w.shape[1]
    size = k * PANEL * w.itemsize
    address = w.ctypes.data + p * size
    xa, step, out = x.ctypes.data + b0 * x.strides[0], x.strides[0], sums.ctypes.data
    if streams == 4:
        _s4r1(address, inner * size, outer * size, xa, step, k, out, w)
    elif rows == 1:
        _s2r1(address, inner * size, outer * size, xa, step, k, out, w)
    elif rows == 2:
        _s2r2(address, inner * size, outer * size, xa, step, k, out, w)
    elif rows == 3:
        _s2r3(address, inner * size, outer * size, xa, step, k, out, w)
    else:
        _s2r4(address, inner * size, outer * size, xa, step, k, out, w)


@numba.njit(cache=True, inline="always")
def _share(n, part, parts):
    """Items [lo, hi) of ``part`` of ``parts`` near-equal contiguous shares of n."""
    return n * part // parts, n * (part + 1) // parts


@numba.njit(fastmath=True, cache=True, inline="always")
def _put(out, r, acc, scale, bias):
    """out[r] (one row of the output) = acc, times row r's scale, plus its bias."""
    if scale.shape[0] > 0:
        acc *= scale[r]
    if bias.shape[0] > 0:
        acc += bias[r]
    out[r] = acc


@numba.njit(fastmath=True, cache=True, inline="always")
def _put_panel(out, p, s, rows, b0, sums, scale, bias):
    """Rows 16p.. of out[b0 + b] for b < rows from sums[s * rows + b] (as ``_put``)."""
    first = p * PANEL
    count = min(PANEL, out.shape[1] - first)
    for b in range(rows):
        for j in range(count):
            _put(out[b0 + b], first + j, sums[s * rows + b, j], scale, bias)


@numba.njit(fastmath=True, cache=True)
def _packed_into(x, w, scale, bias, out, lo, hi, sums, xq):
    """``_panels_into`` for packed panels (``packed``): each read straight from its bytes
    for every four rows of x, with x's integer roundings xq (``rounded_x``)."""
    batch = x.shape[0]
    for p in range(lo, hi):
        for b0 in range(0, batch, PASS_ROWS):
            rows = min(PASS_ROWS, batch - b0)
            packed_dots(w, p, xq, b0, rows, sums.ctypes.data)
            _put_panel(out, p, 0, rows, b0, sums, scale, bias)


@numba.njit(fastmath=True, cache=True, inline="always")
def _float_panels_into(x, w, scale, bias, out, lo, hi, sums):
    """Rows [16 lo, 16 hi) of out [B, N] = x [B, K] W^T (times the per-row scale of an
    int8 W) (+ bias), from W's panels [lo, hi); sums: scratch float32 [SUMS, 16]. The
    share is cut into ``_streams`` runs, read side by side: panel j of each run together.
    With one row of x the last few panels go in pairs, each panel of a pair read as its
    two halves (``_halves_pass``: four streams), and a last one as its four quarters; with
    more rows one at a time. (One at a time, one stream, they kept SmolLM2's layer GEMVs
    in the one-region step at 90-91% of the read; in pairs of two streams, and with that
    step's tail items of two panels or more, 93-94%: the step 1.8-2.8% faster, traced
    with a runtime switch. The halves took the step 0.35% (SmolLM2) and 0.6% (the random
    Llama) further, the quarters 0.3% (SmolLM2), 720 steps of each.)"""
    batch = x.shape[0]
    streams = _streams(batch)
    run = (hi - lo) // streams
    for j in range(run):
        for b0 in range(0, batch, ROWS):
            rows = min(ROWS, batch - b0)
            _group_dots(w, lo + j, run, 2 * run, streams, x, b0, rows, sums)
            for s in range(streams):
                _put_panel(out, lo + j + s * run, s, rows, b0, sums, scale, bias)
    first = lo + streams * run
    if batch == 1:
        k = w.shape[1]
        size = k * PANEL * w.itemsize
        while first + 2 <= hi:  # panels first and first + 1, side by side
            if k % 2 == 0:  # each as its two halves: four streams
                _halves_pass(w.ctypes.data + first * size, size, x.ctypes.data, k // 2,
                             sums.ctypes.data, w)
            else:
                _group_dots(w, first, 1, 2, 2, x, 0, 1, sums)
            _put_panel(out, first, 0, 1, 0, sums, scale, bias)
            _put_panel(out, first + 1, 1, 1, 0, sums, scale, bias)
            first += 2
        if first < hi and k % 4 == 0:  # the last one as its four quarters
            _quarters_pass(w.ctypes.data + first * size, size, x.ctypes.data, k // 4,
                           sums.ctypes.data, w)
            _put_panel(out, first, 0, 1, 0, sums, scale, bias)
            first += 1
    for p in range(first, hi):
        for b0 in range(0, batch, ROWS):
            rows = min(ROWS, batch - b0)
            _panel_dots(w, p, x, b0, rows, sums)
            _put_panel(out, p, 0, rows, b0, sums, scale, bias)


def _panels_into(x, w, scale, bias, out, lo, hi, sums, xq):  # noqa: ANN001, ANN202
    """Rows [16 lo, 16 hi) of out [B, N] = x [B, K] W^T (times an int8 W's per-row
    scale) (+ bias) from W's panels [lo, hi): ``_float_panels_into``, or
    ``_packed_into`` for packed panels (xq: ``rounded_x(x, w)``), chosen when compiled
    (numba-only)."""
    raise NotImplementedError("numba-only")


@overload(_panels_into, inline="always")
def _panels_into_overload(x, w, scale, bias, out, lo, hi, sums, xq):  # noqa: ANN001, ANN202
    if w.dtype == types.uint8:
        def impl(x, w, scale, bias, out, lo, hi, sums, xq):  # noqa: ANN001, ANN202
            _packed_into(x, w, scale, bias, out, lo, hi, sums, xq)
    else:
        def impl(x, w, scale, bias, out, lo, hi, sums, xq):  # noqa: ANN001, ANN202
            _float_panels_into(x, w, scale, bias, out, lo, hi, sums)
    return impl


@numba.njit(parallel=True, fastmath=True, cache=True)
def _matvec(x, w, scale, bias, out, parts):
    """out [B, N] = x [B, K] W^T (times the per-row scale of an int8 W) (+ bias); W as
    its panels w [ceil(N / 16), K, 16]; empty scale / bias arrays mean none. Each of
    ``parts`` work items (numba's thread count: one each) takes a contiguous share of the
    panels. (The count is an argument: calling ``numba.get_num_threads`` in here would
    keep numba from caching the kernel.)"""
    xq = rounded_x(x, w)
    for part in numba.prange(parts):
        lo, hi = _share(w.shape[0], part, parts)
        _panels_into(x, w, scale, bias, out, lo, hi, np.empty((SUMS, PANEL), np.float32), xq)


_EMPTY = np.empty(0, np.float32)


@numba.njit(parallel=True, cache=True)
def _fill_panels(w, out):
    """out [P, K, 16] = the panels of w [N, K] (rows past N zero). Written in order, a
    column of 16 rows at a time: 538 MB of SmolLM2's weights in 0.06 s, against 0.4 s
    writing each row's column down the panel (a store every 64 bytes)."""
    n, k = w.shape
    for p in numba.prange(out.shape[0]):
        first = p * PANEL
        rows = min(PANEL, n - first)
        for i in range(k):
            for j in range(PANEL):
                out[p, i, j] = w[first + j, i] if j < rows else 0


def panels(weight: torch.Tensor, scale: torch.Tensor | None = None) -> Panels:
    """The panels of a weight [N, K] (float32, or int8 with its scales [N])."""
    w = weight.contiguous().numpy()
    out = empty_huge_pages(panel_shape(*w.shape), weight.dtype).numpy()
    _fill_panels(w, out)
    scales = _EMPTY
    if scale is not None:
        scales = np.zeros(out.shape[0] * PANEL, np.float32)
        scales[:w.shape[0]] = scale.float().numpy()
    return Panels(out, scales, w.shape[0])


@numba.njit(parallel=True, cache=True)
def _turn_panels(blocks):
    """blocks [P, 16 * K]: each one's 16 rows of K turned, in place, into K columns of 16
    (through a copy of the block: 36-98 KB, in the cache)."""
    k = blocks.shape[1] // PANEL
    for p in numba.prange(blocks.shape[0]):
        rows = blocks[p].copy()
        for i in range(k):
            for j in range(PANEL):
                blocks[p, i * PANEL + j] = rows[j * k + i]


def panels_in_place(weight: torch.Tensor) -> Panels:
    """The panels of a contiguous float32 weight [N, K] with N a multiple of 16, made in
    the weight's own memory: panel p takes the bytes rows 16p..16p+15 held, so loading
    touches no second copy of the weight (fresh memory costs its page faults: 0.15-0.4 s
    for SmolLM2's 538 MB here, against 0.03 s to write memory already mapped). The
    weight's rows are gone afterwards."""
    n, k = weight.shape
    if n % PANEL or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"panels in place need a contiguous float32 weight of a multiple "
                         f"of {PANEL} rows, got {weight.dtype} {tuple(weight.shape)}")
    _turn_panels(weight.view(n // PANEL, PANEL * k).numpy())
    return Panels(weight.view(n // PANEL, k, PANEL).numpy(), _EMPTY, n)


def embedding_table(weight: torch.Tensor) -> torch.Tensor:
    """An embedding's rows as a table [N / P, K, P] that ``embedding_rows`` and the
    compiled decode step read: the panels [N / 16, K, 16] that a tied LM head made in the
    rows' memory (``weight.row_panels``, left by ``layers.cpu_linear``), else the rows
    themselves viewed as [N, K, 1]."""
    panels = getattr(weight, "row_panels", None)
    if panels is not None:
        return torch.from_numpy(panels.weight)
    return weight.detach().view(weight.shape[0], weight.shape[1], 1)


def embedding_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The rows ``ids`` of an ``embedding_table``: a copy, [*ids.shape, K] (of packed
    panels, dequantized)."""
    if table.dtype == torch.uint8:
        weight = table.numpy()
        return packed_rows(weight, ids, packed_cols(weight))
    per = table.shape[2]
    if per == 1:
        return table.view(table.shape[0], table.shape[1])[ids]
    flat = ids.reshape(-1)
    rows = table[flat // per, :, flat % per]  # row r is column r % 16 of panel r // 16
    return rows.contiguous().view(*ids.shape, table.shape[1])


def gemv(x: torch.Tensor, weight: Panels) -> torch.Tensor:
    """x: [1, K] float32, contiguous. Returns [1, N]. Runs on as many threads as numba
    has; ``step_arrays`` of the decode attention kernel matches that to torch's once per
    step."""
    out = torch.empty(1, weight.rows)
    _matvec(x.numpy(), weight.weight, weight.scale, _EMPTY, out.numpy(),
            numba.get_num_threads())
    return out


def warm_up(int8: bool = True, float32: bool = True, packed: bool = False) -> None:
    """Compile (or load from numba's cache) the kernel for float32 weights (unless not
    ``float32``), for int8 weights too when ``int8``, and for packed ones when
    ``packed``."""
    if packed:
        from rvllm.kernels.cpu.packed import Q8_0, TYPE_BYTES, QuantizedRows, pack_rows
        from rvllm.kernels.cpu.packed import warm_up as warm_up_packed

        warm_up_packed()
        data = np.zeros((2, TYPE_BYTES[Q8_0]), np.uint8)
        gemv(torch.zeros(1, 32), pack_rows([QuantizedRows(Q8_0, data, 32)], 2))
        _matvec(np.zeros((3, 32), np.float32), pack_rows([QuantizedRows(Q8_0, data, 32)],
                                                         2).weight,
                _EMPTY, _EMPTY, np.empty((3, 2), np.float32), numba.get_num_threads())
    x = torch.zeros(1, 4)
    if float32:
        gemv(x, panels(torch.zeros(2, 4)))
        panels_in_place(torch.zeros(PANEL, 4))
    if int8:
        gemv(x, panels(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2)))

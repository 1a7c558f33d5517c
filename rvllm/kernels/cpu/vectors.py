"""Decode attention's inner products on 16-lane float32 vectors, written in LLVM IR.

numba has no vector types: a kernel's loops are vectorised, or not, by LLVM. In decode
attention that went badly both ways. A score is a dot product over the head dimension,
which LLVM vectorised as a reduction: a few multiply-adds, then a horizontal sum of
their lanes, a shuffle and an add at a time, for every score. The weighted sum of values
updated each head's accumulator through memory a token at a time. Over a bfloat16 cache
the widening came on top: the kernel was bound by its arithmetic, as slow over a
bfloat16 cache as over a float32 one of twice the bytes.

These two intrinsics take one run of at most 16 tokens of a paged-cache block (every KV
head, and the query heads that share each) on ``<16 x float>`` values, which LLVM maps
onto the machine's vector registers (one AVX-512 register, two AVX2 ones):

- ``run_scores``: for each query head and token, one vector of partial sums (16 lanes of
  the head dimension at a time); then per head one transposing reduction tree over its
  16 tokens' vectors (pairs of vectors shuffled together and added, four levels) leaves
  token t's score in lane t: 15 vector adds for 16 scores, not a horizontal sum each;
- ``run_values``: each query head's accumulator gets a step's token rows weighted per
  load and store, 16 lanes at a time.

Both walk the run in memory order, a few token rows at a time for all KV heads (two
float32 rows, four bfloat16 ones), and ask for the same rows of the block to come next
(``ahead``) as they go, a share of those lines before each query head's work on the
rows. Both orders matter once the cache is far larger than the L3, as under serving: an
earlier version that took one KV head at a time across the run (the 16 tokens' rows, a
third of each) and asked for the whole next block up front ran 20% slower there than the
plain loops, though 1.7x faster with the cache in the L3. How the asks are spread
matters as much, on a Zen 2 (2 cores, 16 MB L3, serving's recorded steps over 30 layers'
float32 caches): all of a step's lines asked for at once, four rows of them, took 1.21 to
1.39 ms a layer, as slow as asking for nothing (1.27 ms), since those asks fill the
core's few miss slots and then hold up the loads the arithmetic waits on; one share
before each head's work, 0.81 ms; and with steps of two rows, 0.66 to 0.69 ms, where
only reading the same blocks takes 0.60 ms. Two rows cost 14% more arithmetic than
four with the cache in the L3, a price paid there alone; a bfloat16 cache, half the
bytes, is bound by its arithmetic and keeps four (0.47 ms against 0.51 with two and
0.53 to 0.57 before the asks were spread).

Over bfloat16 rows, with 1 to 4 query heads a KV head (``GROUPS``), both take another
order, bound by the arithmetic as that cache is: run_scores a token at a time, each 16
lanes of its key row widened once for the whole query group, whose sums stay in registers;
run_values 16 lanes of the group's accumulators at a time, held in registers down the
run's tokens (the next block asked for a share at each 16 lanes of each KV head). With the
block in the L1 a run of 16 tokens of SmolLM2's heads (3 KV heads of 3 query heads, 64
lanes) took 1134 cycles' time for the scores against 1504, and 802 for the values against
1273 (the FMAs alone need 576 each); serving's recorded steps over 30 layers' caches, 0.41
ms a layer's call against 0.46-0.48. Over float32 rows, whose walk is bound by the memory,
the values' order across the rows cost 7-15% there (the scores' order: no change), so
they keep the loops above.

A third, ``rows_times_tile``, is prefill attention's (``prefill_attention``): rows
of a matrix times a tile 16 columns wide, six rows at a time, each row's 16 sums in one
vector, the tile's rows loaded once for all six (a register-blocked matrix product).

Tokens past the run's length read its last row again, and are dropped (masked stores,
zero weights): nothing past the run is read. The head dimension must be a multiple of 16
(``supports``); ``decode_attention`` keeps its plain loops for the rest, and those
loops (and the torch path) are what these are tested against. Rows are float32 or
bfloat16 bit patterns (``--kv-cache-dtype bfloat16``), widened in registers.

Arguments are addresses and element counts (int64), computed by the caller, and an
array whose dtype is the cache's element type.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
from llvmlite import ir
from llvmlite.ir import types as ir_types
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the kernels' cache
from rvllm.kernels.cpu.numerics import prefetch_line

LANES = 16
# Token rows taken together, by the cache's element bytes: each query row (scores) or
# accumulator (values) is loaded once for them. Fewer with float32 rows, so that a step
# asks for fewer lines ahead (see the module note).
TOKENS = {4: 2, 2: 4}
_F32, _I1, _I16, _I32, _I64 = (ir.FloatType(), ir.IntType(1), ir.IntType(16), ir.IntType(32),
                               ir.IntType(64))
_VEC = ir.VectorType(_F32, LANES)
_MASK = ir.VectorType(_I1, LANES)
_FAST = ("fast",)


@numba.njit(cache=True, inline="always")
def supports(head_dim):
    """Whether the head dimension is one these intrinsics take."""
    return head_dim > 0 and head_dim % LANES == 0


def _int(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def _lanes(values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, LANES), values)


def _function(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list) -> ir.Function:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _vector_suffix(pointer: ir.Type) -> str:
    """How a masked load's or store's name spells its pointer: ``p0`` where pointers are
    opaque, ``p0v16f32`` where this llvmlite still writes typed ones."""
    typed = getattr(ir_types, "ir_layer_typed_pointers_enabled", False)
    return "p0v16f32" if typed and not pointer.is_opaque else "p0"


def _min(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    return builder.select(builder.icmp_signed("<", a, b), a, b)


def _vector_at(builder: ir.IRBuilder, address: ir.Value, index: ir.Value) -> ir.Value:
    """A pointer to the 16 float32 elements at element ``index`` from ``address``."""
    return builder.inttoptr(builder.add(address, builder.mul(index, _int(4))), _VEC.as_pointer())


def _load_row(builder: ir.IRBuilder, address: ir.Value, index: ir.Value,
              bfloat16: bool) -> ir.Value:
    """16 cache elements from element ``index`` on, as float32 (a bfloat16 is the high
    half of its float32)."""
    if not bfloat16:
        return builder.load(_vector_at(builder, address, index), align=4)
    halves = ir.VectorType(_I16, LANES)
    byte = builder.add(address, builder.mul(index, _int(2)))
    raw = builder.load(builder.inttoptr(byte, halves.as_pointer()), align=2)
    wide = builder.zext(raw, ir.VectorType(_I32, LANES))
    return builder.bitcast(builder.shl(wide, _lanes([16] * LANES)), _VEC)


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    return builder.call(_function(builder, "llvm.fma.v16f32", _VEC, [_VEC] * 3), [a, b, c])


def _splat(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    vector = builder.insert_element(ir.Constant(_VEC, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vector, vector, _lanes([0] * LANES))


def _first(builder: ir.IRBuilder, n: ir.Value) -> ir.Value:
    """The mask of lanes [0, n)."""
    splat = builder.insert_element(ir.Constant(ir.VectorType(_I64, LANES), ir.Undefined), n,
                                   ir.Constant(_I32, 0))
    splat = builder.shuffle_vector(splat, splat, _lanes([0] * LANES))
    lanes = ir.Constant(ir.VectorType(_I64, LANES), list(range(LANES)))
    return builder.icmp_signed("<", lanes, splat)


def _sums_of_lanes(builder: ir.IRBuilder, vectors: list[ir.Value]) -> ir.Value:
    """The vector whose lane t is the sum of vectors[t]'s 16 lanes. Each level pairs up
    the vectors: both halves of every row's lanes are gathered into two vectors (one
    shuffle each) and added, so a vector holding R rows of W lanes each becomes, with its
    partner, one holding 2R rows of W / 2."""
    rows, width = 1, LANES
    while len(vectors) > 1:
        half = width // 2
        low, high = [], []
        for lane in range(LANES):
            row, i = divmod(lane, half)
            start = row * width if row < rows else LANES + (row - rows) * width
            low.append(start + i)
            high.append(start + half + i)
        vectors = [builder.fadd(builder.shuffle_vector(a, b, _lanes(low)),
                                builder.shuffle_vector(a, b, _lanes(high)), flags=_FAST)
                   for a, b in zip(vectors[0::2], vectors[1::2])]
        rows, width = rows * 2, half
    return vectors[0]


class _Run:
    """The geometry of one run, shared by both intrinsics' code: n tokens, each a row of
    ``kv_heads * head_dim`` elements of ``element_bytes`` each."""

    def __init__(self, builder: ir.IRBuilder, n: ir.Value, head_dim: ir.Value,
                 kv_heads: ir.Value, element_bytes: int) -> None:
        self.builder, self.n, self.head_dim, self.kv_heads = builder, n, head_dim, kv_heads
        self.take = TOKENS[element_bytes]
        self.chunks = builder.sdiv(head_dim, _int(LANES))
        self.row_elements = builder.mul(kv_heads, head_dim)
        self.row_bytes = builder.mul(self.row_elements, _int(element_bytes))
        self.steps = builder.sdiv(builder.add(n, _int(self.take - 1)), _int(self.take))
        self.last = builder.sub(n, _int(1))

    def tokens(self, step: ir.Value) -> list[ir.Value]:
        first = self.builder.mul(step, _int(self.take))
        return [self.builder.add(first, _int(j)) for j in range(self.take)]

    def row_offsets(self, tokens: list[ir.Value]) -> list[ir.Value]:
        """Element offsets of the tokens' rows, a token past the run at the last row."""
        return [self.builder.mul(_min(self.builder, t, self.last), self.row_elements)
                for t in tokens]

    def prefetch(self, ahead: ir.Value, tokens: list[ir.Value], share: ir.Value,
                 shares: ir.Value) -> None:
        """Ask for share ``share`` of ``shares`` (as even as can be) of the lines of the
        same token rows of the block at ``ahead`` (0: none)."""
        b = self.builder
        with b.if_then(b.icmp_signed("!=", ahead, _int(0))):
            start = b.add(ahead, b.mul(tokens[0], self.row_bytes))
            lines = b.sdiv(b.add(b.mul(_int(self.take), self.row_bytes), _int(63)), _int(64))
            per = b.sdiv(b.add(lines, b.sub(shares, _int(1))), shares)
            first = b.mul(share, per)
            count = b.sub(_min(b, b.add(first, per), lines), first)
            with cgutils.for_range(b, count) as line:
                prefetch_line(b, b.add(start, b.mul(b.add(first, line.index), _int(64))))


_ARGS = (types.int64,) * 10
# Query heads a KV head for which bfloat16 rows take the loops below, that query group's
# sums or accumulators held in registers (see the module note).
GROUPS = (1, 2, 3, 4)


def _switch_on_group(builder: ir.IRBuilder, group: ir.Value, name: str, bfloat16: bool,
                     emit: Callable[[int], None]) -> ir.Block:
    """Branch on the query group's size: a block of ``emit(size)``'s code for each of
    ``GROUPS`` (over bfloat16 rows; none over float32 ones), the builder left in the block
    for any other size. Returns the block where they all meet, which the caller's code for
    the other sizes branches to."""
    fn = builder.function
    done = fn.append_basic_block(f"{name}_done")
    generic = fn.append_basic_block(f"{name}_generic")
    switch = builder.switch(group, generic)
    for size in GROUPS if bfloat16 else ():
        block = fn.append_basic_block(f"{name}_group_{size}")
        switch.add_case(ir.Constant(_I64, size), block)
        builder.position_at_end(block)
        emit(size)
        builder.branch(done)
    builder.position_at_end(generic)
    return done


def _group_values(builder: ir.IRBuilder, run: _Run, p: ir.Value, p_stride: ir.Value,
                  v: ir.Value, size: int, acc: ir.Value, ahead: ir.Value,
                  bfloat16: bool) -> None:
    """run_values where each KV head has ``size`` query heads: 16 lanes of their
    accumulators held in registers down the run's tokens, each value row's 16 lanes
    widened once for all of them. The next block's rows are asked for a share at each
    16 lanes of each KV head."""
    head_dim = run.head_dim
    accs = [cgutils.alloca_once(builder, _VEC) for _ in range(size)]  # registers
    lines = builder.sdiv(builder.add(builder.mul(run.n, run.row_bytes), _int(63)), _int(64))
    shares = builder.mul(run.kv_heads, run.chunks)
    per = builder.sdiv(builder.add(lines, builder.sub(shares, _int(1))), shares)
    with cgutils.for_range(builder, run.kv_heads) as kv:
        kv_col = builder.mul(kv.index, head_dim)
        first_head = builder.mul(kv.index, _int(size))
        with cgutils.for_range(builder, run.chunks) as chunk:
            with builder.if_then(builder.icmp_signed("!=", ahead, _int(0))):
                share = builder.add(builder.mul(kv.index, run.chunks), chunk.index)
                first = builder.mul(share, per)
                count = builder.sub(_min(builder, builder.add(first, per), lines), first)
                with cgutils.for_range(builder, count) as line:
                    prefetch_line(builder, builder.add(ahead, builder.mul(
                        builder.add(first, line.index), _int(64))))
            col = builder.mul(chunk.index, _int(LANES))
            dsts = [_vector_at(builder, acc, builder.add(builder.mul(
                builder.add(first_head, _int(g)), head_dim), col)) for g in range(size)]
            for a, dst in zip(accs, dsts):
                builder.store(builder.load(dst, align=4), a)
            weights = [builder.add(p, builder.mul(builder.mul(builder.add(
                first_head, _int(g)), p_stride), _int(4))) for g in range(size)]
            with cgutils.for_range(builder, run.n) as token:
                v_row = _load_row(builder, v, builder.add(builder.mul(
                    token.index, run.row_elements), builder.add(kv_col, col)), bfloat16)
                for a, w in zip(accs, weights):
                    at = builder.add(w, builder.mul(token.index, _int(4)))
                    weight = builder.load(builder.inttoptr(at, _F32.as_pointer()), align=4)
                    builder.store(_fma(builder, _splat(builder, weight), v_row,
                                       builder.load(a)), a)
            for a, dst in zip(accs, dsts):
                builder.store(builder.load(a), dst, align=4)


def _group_scores(builder: ir.IRBuilder, run: _Run, q: ir.Value, k: ir.Value, size: int,
                  partials: ir.Value, ahead: ir.Value, bfloat16: bool) -> None:
    """run_scores' partial sums where each KV head has ``size`` query heads: a token at a
    time, each 16 lanes of a key row widened once for all of them."""
    zero = ir.Constant(_VEC, [0.0] * LANES)
    head_dim, element = run.head_dim, 2 if bfloat16 else 4
    sums = [cgutils.alloca_once(builder, _VEC) for _ in range(size)]  # registers
    part_bytes = builder.mul(head_dim, _int(element))
    part_lines = builder.sdiv(builder.add(part_bytes, _int(63)), _int(64))
    with cgutils.for_range(builder, run.n) as token:
        row = builder.mul(token.index, run.row_elements)
        with cgutils.for_range(builder, run.kv_heads) as kv:
            kv_col = builder.mul(kv.index, head_dim)
            with builder.if_then(builder.icmp_signed("!=", ahead, _int(0))):
                start = builder.add(ahead, builder.mul(builder.add(row, kv_col), _int(element)))
                with cgutils.for_range(builder, part_lines) as line:
                    prefetch_line(builder, builder.add(start, builder.mul(line.index, _int(64))))
            for s in sums:
                builder.store(zero, s)
            first_head = builder.mul(kv.index, _int(size))
            with cgutils.for_range(builder, run.chunks) as chunk:
                col = builder.mul(chunk.index, _int(LANES))
                kv_row = _load_row(builder, k, builder.add(row, builder.add(kv_col, col)),
                                   bfloat16)
                for g, s in enumerate(sums):
                    h = builder.add(first_head, _int(g))
                    qv = builder.load(_vector_at(builder, q, builder.add(
                        builder.mul(h, head_dim), col)), align=4)
                    builder.store(_fma(builder, qv, kv_row, builder.load(s)), s)
            for g, s in enumerate(sums):
                h = builder.add(first_head, _int(g))
                slot = builder.add(builder.mul(h, _int(LANES * LANES)),
                                   builder.mul(token.index, _int(LANES)))
                builder.store(builder.load(s), _vector_at(builder, partials, slot), align=4)


@intrinsic
def run_scores(typingctx, q, k, n, head_dim, group, kv_heads, partials, out, out_stride, ahead,
               like):
    """out[h * out_stride + t] = q[h] . k[t, h // group] for the run's tokens t < n
    (1 <= n <= 16) and every query head h < kv_heads * group. q: the address of the
    queries [heads, head_dim] (float32, contiguous); k: of the run's first row [kv_heads,
    head_dim] (``like``'s dtype: float32, or uint16 bfloat16 bits); partials: of scratch
    float32 [heads, 16, 16]; out: float32; ahead: of a block whose same rows to ask for,
    or 0."""
    bfloat16 = like.dtype == types.uint16

    def codegen(context, builder, signature, args):
        q, k, n, head_dim, group, kv_heads, partials, out, out_stride, ahead, _ = args
        run = _Run(builder, n, head_dim, kv_heads, 2 if bfloat16 else 4)
        zero = ir.Constant(_VEC, [0.0] * LANES)
        done = _switch_on_group(builder, group, "scores", bfloat16, lambda size: _group_scores(
            builder, run, q, k, size, partials, ahead, bfloat16))
        sums = [cgutils.alloca_once(builder, _VEC) for _ in range(run.take)]  # registers
        with cgutils.for_range(builder, run.steps) as step:
            tokens = run.tokens(step.index)
            rows = run.row_offsets(tokens)
            with cgutils.for_range(builder, kv_heads) as kv:
                kv_col = builder.mul(kv.index, head_dim)
                with cgutils.for_range(builder, group) as member:
                    h = builder.add(builder.mul(kv.index, group), member.index)
                    run.prefetch(ahead, tokens, h, builder.mul(kv_heads, group))
                    for s in sums:
                        builder.store(zero, s)
                    with cgutils.for_range(builder, run.chunks) as chunk:
                        col = builder.mul(chunk.index, _int(LANES))
                        qv = builder.load(_vector_at(builder, q, builder.add(
                            builder.mul(h, head_dim), col)), align=4)
                        for row, s in zip(rows, sums):
                            kv_row = _load_row(builder, k, builder.add(row, builder.add(kv_col,
                                                                                       col)),
                                               bfloat16)
                            builder.store(_fma(builder, qv, kv_row, builder.load(s)), s)
                    for t, s in zip(tokens, sums):
                        slot = builder.add(builder.mul(h, _int(LANES * LANES)),
                                           builder.mul(t, _int(LANES)))
                        builder.store(builder.load(s), _vector_at(builder, partials, slot),
                                      align=4)
        builder.branch(done)
        builder.position_at_end(done)
        # Each head's 16 token vectors (those past n unwritten: their lanes are dropped).
        mask = _first(builder, n)
        with cgutils.for_range(builder, builder.mul(kv_heads, group)) as head:
            base = builder.mul(head.index, _int(LANES * LANES))
            vectors = [builder.load(_vector_at(builder, partials, builder.add(base, _int(
                t * LANES))), align=4) for t in range(LANES)]
            dst = _vector_at(builder, out, builder.mul(head.index, out_stride))
            store = _function(builder, "llvm.masked.store.v16f32." + _vector_suffix(dst.type),
                              ir.VoidType(), [_VEC, dst.type, _I32, _MASK])
            builder.call(store, [_sums_of_lanes(builder, vectors), dst, ir.Constant(_I32, 4),
                                 mask])
        return context.get_dummy_value()

    return types.void(*_ARGS, like), codegen


@intrinsic
def run_values(typingctx, p, p_stride, v, n, head_dim, group, kv_heads, acc, ahead, like):
    """acc[h] += sum over the run's tokens t < n (1 <= n <= 16) of p[h * p_stride + t] *
    v[t, h // group], for every query head h. p: float32 weights (those past n are not
    read); v: the address of the run's first row; acc: of the accumulators [heads,
    head_dim] (float32, contiguous); ahead and like as ``run_scores``'."""
    bfloat16 = like.dtype == types.uint16

    def codegen(context, builder, signature, args):
        p, p_stride, v, n, head_dim, group, kv_heads, acc, ahead, _ = args
        run = _Run(builder, n, head_dim, kv_heads, 2 if bfloat16 else 4)
        done = _switch_on_group(builder, group, "values", bfloat16, lambda size: _group_values(
            builder, run, p, p_stride, v, size, acc, ahead, bfloat16))
        with cgutils.for_range(builder, run.steps) as step:
            tokens = run.tokens(step.index)
            rows = run.row_offsets(tokens)
            with cgutils.for_range(builder, kv_heads) as kv:
                kv_col = builder.mul(kv.index, head_dim)
                with cgutils.for_range(builder, group) as member:
                    h = builder.add(builder.mul(kv.index, group), member.index)
                    run.prefetch(ahead, tokens, h, builder.mul(kv_heads, group))
                    weights = []
                    for t in tokens:
                        index = builder.add(builder.mul(h, p_stride), _min(builder, t, run.last))
                        address = builder.add(p, builder.mul(index, _int(4)))
                        w = builder.load(builder.inttoptr(address, _F32.as_pointer()), align=4)
                        inside = builder.icmp_signed("<", t, n)
                        weights.append(_splat(builder, builder.select(
                            inside, w, ir.Constant(_F32, 0.0))))
                    with cgutils.for_range(builder, run.chunks) as chunk:
                        col = builder.mul(chunk.index, _int(LANES))
                        dst = _vector_at(builder, acc, builder.add(builder.mul(h, head_dim), col))
                        total = builder.load(dst, align=4)
                        for row, w in zip(rows, weights):
                            v_row = _load_row(builder, v, builder.add(row, builder.add(kv_col,
                                                                                      col)),
                                              bfloat16)
                            total = _fma(builder, w, v_row, total)
                        builder.store(total, dst, align=4)
        builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return types.void(*_ARGS[:9], like), codegen


def _rows_times_tile(rows: int) -> Callable:
    """``rows_times_tile`` for this many rows: their sums stay in 2 * rows AVX2 registers,
    beside the tile's row."""
    @intrinsic
    def rows_times_tile(typingctx, a, a_stride, b, b_stride, k, c, c_stride, accumulate):
        def codegen(context, builder, signature, args):
            a, a_stride, b, b_stride, k, c, c_stride, accumulate = args
            zero = ir.Constant(_VEC, [0.0] * LANES)
            keep = builder.icmp_signed("!=", accumulate, _int(0))
            sums = []
            for i in range(rows):
                s = cgutils.alloca_once(builder, _VEC)  # a register
                old = builder.load(_vector_at(builder, c, builder.mul(_int(i), c_stride)),
                                   align=4)
                builder.store(builder.select(keep, old, zero), s)
                sums.append(s)
            with cgutils.for_range(builder, k) as t:
                row = builder.load(_vector_at(builder, b, builder.mul(t.index, b_stride)),
                                   align=4)
                for i, s in enumerate(sums):
                    index = builder.add(builder.mul(_int(i), a_stride), t.index)
                    x = builder.load(builder.inttoptr(builder.add(a, builder.mul(index, _int(4))),
                                                      _F32.as_pointer()), align=4)
                    builder.store(_fma(builder, _splat(builder, x), row, builder.load(s)), s)
            for i, s in enumerate(sums):
                builder.store(builder.load(s),
                              _vector_at(builder, c, builder.mul(_int(i), c_stride)), align=4)
            return context.get_dummy_value()

        return types.void(*(types.int64,) * 8), codegen

    return rows_times_tile


# Six rows' 12 sums outlast the FMAs' latency on two pipes (5 cycles x 2), where four
# rows' 8 did not: alone, with its operands in the L1, one thread ran 99 GFLOP/s against
# 76 on this Zen 2 (head size 64). Row counts that are not a multiple of 6 end in pairs.
ROWS = 6
_six_rows, _two_rows = _rows_times_tile(ROWS), _rows_times_tile(2)


@numba.njit(cache=True, inline="always")
def rows_times_tile(rows, a, a_stride, b, b_stride, k, c, c_stride, accumulate):
    """c[i * c_stride + l] = (c[i * c_stride + l] if accumulate else 0) + the sum over t < k
    of a[i * a_stride + t] * b[t * b_stride + l], for the rows i < ``rows`` (even) and
    lanes l < 16: a register-blocked matrix product. a, b, c: addresses of float32
    elements; strides in elements."""
    i = 0
    while i + ROWS <= rows:
        _six_rows(a + i * a_stride * 4, a_stride, b, b_stride, k, c + i * c_stride * 4,
                  c_stride, accumulate)
        i += ROWS
    while i < rows:
        _two_rows(a + i * a_stride * 4, a_stride, b, b_stride, k, c + i * c_stride * 4,
                  c_stride, accumulate)
        i += 2

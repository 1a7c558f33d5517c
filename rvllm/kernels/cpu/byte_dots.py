"""Activations rounded to 16-bit integers per block of 32, held as two bytes, and
byte-by-byte dot products in LLVM IR: what the packed 4- and 8-bit kernels (``packed``)
multiply with.

Widening every 4-bit weight to float32 for one multiply-add a row of activations kept
the packed kernels bound by their arithmetic: a thread widened about 20 G weights/s of
Q4_1, and each more row of x cost nearly as much again. Rounding each row of x to
integers per block of 32 turns a block's products into integer multiply-adds of bytes,
64 at a time:

- ``quantize_rows``: each block of 32 values of a row becomes 32 integers ``q =
  rint(x * 32385 / amax)`` (within +-32385 = 127 * 255) and the float32 pair (``d = amax /
  32385``, ``d * sum(q)``). Each q is split as ``255 h + l`` with h = q / 255 rounded and
  both bytes signed within +-127. A row's bytes are its K high bytes, its K low bytes,
  its K / 32 pairs, the int32 sums of its integers over every 16 columns, for weights
  stored with an offset per 16 columns (Q6_K's q - 32), then its K integers as int16
  (``x_row_bytes``, ``words_offset``).
- ``dot_bytes``: 16 int32 lanes, each plus the sum of its four unsigned bytes of one
  vector times the four signed bytes of another: one ``vpdpbusd`` with AVX-512 VNNI;
  without it ``vpmaddubsw`` then ``vpmaddwd`` (AVX-512BW, or AVX2 on two halves), and
  plain integer IR on anything else. Weights of 4 bits (0-15) times bytes within +-127
  never saturate ``vpmaddubsw``'s 16-bit pairs.
- ``dot_words``: 16 int32 lanes, each plus the sum of its two int16 of one vector times
  its two of another (``vpmaddwd``): a signed 8-bit weight widened to 16 bits times x's
  int16 integers is one multiply for two products, where the two bytes of x took
  ``vpmaddubsw`` twice and ``vpmaddwd`` twice. Without VNNI the panels of Q8_0 are laid
  out for it (``packed``).
- ``signed_weights`` / ``dot_signed``: the same for signed 8-bit weights (Q8_0). With
  VNNI x's bytes go in offset by 128 (unsigned) and 128 times the weights' sum comes off;
  without, the weights' magnitudes go in and x's bytes take their signs, so that a pair
  of products stays within 2 * 128 * 127.

Every machine computes the same integers, so a packed product is the same float32 number
on every CPU. A weight row's block product is ``255 * (w . h) + (w . l) = w . q``,
exactly: the activations carry 16 bits, as the int8 weights' GEMMs (``int8_gemm``) keep
them, for twice the byte products of 8-bit ones (llama.cpp's Q8 activations). Eight bits
alone moved SmolLM2's logprobs by up to 0.3 a token and turned near-ties: its answer to
"What is the capital of France?" began with "L'" where float32's begins with "The"
(-1.99 against -2.06, float32: -1.97 against -1.88). So 8 bits are a choice
(``--packed-activations int8``, ``packed.set_x_bits``): ``quantize_rows(..., eight)``
rounds a block to q = rint(x * 127 / amax) and stores q as the high bytes, with low
bytes 0 (the same layout), and the products take w . q from the high bytes alone.

Which instructions is decided when numba compiles (the features it compiles for:
``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``, else the host's); numba's cache keeps
machine code per CPU name and features, so a cache made on one machine is not run on
another.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the kernels' cache

BLOCK = 32  # columns of x rounded together
_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
V32 = ir.VectorType(_I32, 16)  # 16 int32 lanes: one AVX-512 register, two AVX2 ones
_B64 = ir.VectorType(_I8, 64)
_B32 = ir.VectorType(_I8, 32)
_W32 = ir.VectorType(_I16, 32)
_W16 = ir.VectorType(_I16, 16)
_V8 = ir.VectorType(_I32, 8)


SCALE = 32385  # 127 * 255: the largest magnitude of a block's integers


@numba.njit(cache=True, inline="always")
def words_offset(k):
    """Where a rounded row of K values keeps its integers as int16 (``quantize_rows``)."""
    return 2 * k + 16 * (k // BLOCK)


@numba.njit(cache=True, inline="always")
def x_row_bytes(k):
    """Bytes of one rounded row of K values (``quantize_rows``), a multiple of 64."""
    return (words_offset(k) + 2 * k + 63) // 64 * 64


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def quantize_rows(x, out, eight):
    """Rows of x [B, K] (float32) rounded per block of 32 into out [B, >= x_row_bytes(K)]
    uint8: row b's K high bytes, K low bytes (int8), K / 32 float32 pairs (d, d * sum
    of the block's integers), K / 16 int32 sums of its integers over 16 columns and its
    K integers (int16). A block of zeros is integers 0 with d = 0. With ``eight`` the
    integers are rounded to 8 bits instead, q = rint(x * 127 / amax) with d = amax / 127,
    and are the high bytes themselves: the low bytes are 0, and the products take the
    high bytes' alone for w . q (``packed``'s ``--packed-activations int8``)."""
    k = x.shape[1]
    blocks = k // BLOCK
    at = words_offset(k)
    q = np.empty(BLOCK, np.float32)
    for b in range(x.shape[0]):
        high = out[b, :k].view(np.int8)
        low = out[b, k:2 * k].view(np.int8)
        pairs = out[b, 2 * k:2 * k + 8 * blocks].view(np.float32)
        sixteens = out[b, 2 * k + 8 * blocks:2 * k + 16 * blocks].view(np.int32)
        ints = out[b, at:at + 2 * k].view(np.int16)
        for j in range(blocks):
            first = j * BLOCK
            amax = np.float32(0.0)
            for i in range(BLOCK):
                amax = max(amax, abs(x[b, first + i]))
            top = np.float32(127.0) if eight else np.float32(SCALE)
            inv = top / amax if amax > 0 else np.float32(0.0)
            for i in range(BLOCK):
                q[i] = np.rint(x[b, first + i] * inv)
            # Sums of integers under 2^24: exact in float32, in any order.
            head, tail = np.float32(0.0), np.float32(0.0)
            for i in range(16):
                head += q[i]
                tail += q[16 + i]
            if eight:  # the integers themselves are the high bytes
                for i in range(BLOCK):
                    high[first + i] = np.int8(q[i])
                    low[first + i] = 0
                    ints[first + i] = np.int16(q[i])
            else:
                # In float32, where it vectorizes: q / 255 lies at least 0.002 from a
                # tie, so its rounding h leaves |q - 255 h| <= 127.
                for i in range(BLOCK):
                    h = np.rint(q[i] * np.float32(1.0 / 255.0))
                    high[first + i] = np.int8(h)
                    low[first + i] = np.int8(q[i] - np.float32(255.0) * h)
                    ints[first + i] = np.int16(q[i])
            sixteens[2 * j] = np.int32(head)
            sixteens[2 * j + 1] = np.int32(tail)
            d = amax / top
            pairs[2 * j] = d
            pairs[2 * j + 1] = d * (head + tail)


@numba.njit(cache=True)
def rounded_rows(x, eight):
    """``quantize_rows`` of x into a new buffer [B, x_row_bytes(K)]."""
    out = np.empty((x.shape[0], x_row_bytes(x.shape[1])), np.uint8)
    quantize_rows(x, out, eight)
    return out


@numba.njit(parallel=True, cache=True)
def rounded_rows_parallel(x, parts, eight):
    """``rounded_rows`` for many rows, ``parts`` shares of them side by side."""
    m = x.shape[0]
    out = np.empty((m, x_row_bytes(x.shape[1])), np.uint8)
    for part in numba.prange(parts):
        lo, hi = m * part // parts, m * (part + 1) // parts
        quantize_rows(x[lo:hi], out[lo:hi], eight)
    return out


def _features(context) -> str:  # noqa: ANN001 - numba's target context
    """The CPU features numba compiles for ("+avx2,+avx512vnni,..."), or ""."""
    return getattr(context.codegen(), "_tm_features", "") or ""


def _vnni(context) -> bool:  # noqa: ANN001
    return "+avx512vnni" in _features(context)


def _call(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    fn = builder.module.declare_intrinsic(name, (), ir.FunctionType(ret, [a.type for a in args]))
    return builder.call(fn, args)


def _lanes(values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(values)), values)


def _halves(builder: ir.IRBuilder, v: ir.Value) -> tuple[ir.Value, ir.Value]:
    low = builder.shuffle_vector(v, v, _lanes(list(range(8))))
    high = builder.shuffle_vector(v, v, _lanes(list(range(8, 16))))
    return low, high


def dot_bytes(context, builder: ir.IRBuilder, acc: ir.Value, a: ir.Value,  # noqa: ANN001
              b: ir.Value) -> ir.Value:
    """acc (<16 x i32>) plus, in each lane, the sum of the lane's four bytes of a
    (unsigned) times its four bytes of b (signed). Without VNNI, a pair of these
    products must stay within int16 (``vpmaddubsw`` saturates)."""
    features = _features(context)
    if _vnni(context):
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", V32, [acc, a, b])
    if "+avx512bw" in features:
        pairs = _call(builder, "llvm.x86.avx512.pmaddubs.w.512", _W32,
                      [builder.bitcast(a, _B64), builder.bitcast(b, _B64)])
        ones = ir.Constant(_W32, [1] * 32)
        return builder.add(acc, _call(builder, "llvm.x86.avx512.pmaddw.d.512", V32,
                                      [pairs, ones]))
    if "+avx2" in features:
        ones = ir.Constant(_W16, [1] * 16)
        sums = []
        for ah, bh in zip(_halves(builder, a), _halves(builder, b)):
            pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16,
                          [builder.bitcast(ah, _B32), builder.bitcast(bh, _B32)])
            sums.append(_call(builder, "llvm.x86.avx2.pmadd.wd", _V8, [pairs, ones]))
        whole = builder.shuffle_vector(sums[0], sums[1], _lanes(list(range(16))))
        return builder.add(acc, whole)
    wide = ir.VectorType(_I32, 64)
    products = builder.mul(builder.zext(builder.bitcast(a, _B64), wide),
                           builder.sext(builder.bitcast(b, _B64), wide))
    for j in range(4):
        part = builder.shuffle_vector(products, products, _lanes([4 * i + j for i in range(16)]))
        acc = builder.add(acc, part)
    return acc


def dot_words(context, builder: ir.IRBuilder, acc: ir.Value, a: ir.Value,  # noqa: ANN001
              b: ir.Value) -> ir.Value:
    """acc (<16 x i32>) plus, in each lane, the sum of the lane's two int16 of a (<32 x
    i16>) times its two of b: ``vpmaddwd`` on one AVX-512BW register or two AVX2 halves,
    plain integer IR on anything else. Exact unless a lane's pair is -32768 twice."""
    features = _features(context)
    if "+avx512bw" in features:
        return builder.add(acc, _call(builder, "llvm.x86.avx512.pmaddw.d.512", V32, [a, b]))
    if "+avx2" in features:
        sums = []
        for half in range(2):
            pick = _lanes(list(range(16 * half, 16 * half + 16)))
            sums.append(_call(builder, "llvm.x86.avx2.pmadd.wd", _V8, [
                builder.shuffle_vector(a, a, pick), builder.shuffle_vector(b, b, pick)]))
        return builder.add(acc, builder.shuffle_vector(sums[0], sums[1], _lanes(list(range(16)))))
    wide = ir.VectorType(_I32, 32)
    products = builder.mul(builder.sext(a, wide), builder.sext(b, wide))
    for j in range(2):
        acc = builder.add(acc, builder.shuffle_vector(products, products,
                                                      _lanes([2 * i + j for i in range(16)])))
    return acc


def dot_bytes_sum(context, builder: ir.IRBuilder, pairs: list[tuple[ir.Value, ir.Value]],  # noqa: ANN001
                  fits: int) -> ir.Value:
    """<16 x i32>: the sum of ``dot_bytes`` over ``pairs`` (unsigned a, signed b), exactly.
    Without VNNI, ``vpmaddubsw``'s 16-bit pairs of up to ``fits`` of them are summed as
    16-bit integers before one ``vpmaddwd`` widens them (the caller's bound: e.g. 4-bit
    weights by bytes within +-127 make pairs of up to 2 * 15 * 127, 8 of which fit), where
    each ``vpmaddubsw`` took a ``vpmaddwd`` of its own: nearly half the multiplies."""
    features = _features(context)
    zero = ir.Constant(V32, [0] * 16)
    if _vnni(context) or fits < 2 or ("+avx512bw" not in features and "+avx2" not in features):
        # Two chains: one chain for a one-row pass waited on each product's latency.
        chains = [zero, zero]
        for g, (a, b) in enumerate(pairs):
            chains[g % 2] = dot_bytes(context, builder, chains[g % 2], a, b)
        return builder.add(chains[0], chains[1])
    if "+avx512bw" in features:
        parts = [[(builder.bitcast(a, _B64), builder.bitcast(b, _B64))] for a, b in pairs]
        madd, wide, words, widen = "llvm.x86.avx512.pmaddubs.w.512", V32, _W32, \
            "llvm.x86.avx512.pmaddw.d.512"
    else:
        parts = [[(builder.bitcast(x, _B32), builder.bitcast(y, _B32))
                  for x, y in zip(_halves(builder, a), _halves(builder, b))] for a, b in pairs]
        madd, wide, words, widen = "llvm.x86.avx2.pmadd.ub.sw", _V8, _W16, \
            "llvm.x86.avx2.pmadd.wd"
    ones = ir.Constant(words, [1] * words.count)
    sums = []
    for h in range(len(parts[0])):  # each register's lanes (two halves on AVX2)
        total = None
        for first in range(0, len(parts), fits):
            short = None
            for part in parts[first:first + fits]:
                product = _call(builder, madd, words, list(part[h]))
                short = product if short is None else builder.add(short, product)
            widened = _call(builder, widen, wide, [short, ones])
            total = widened if total is None else builder.add(total, widened)
        sums.append(total)
    if len(sums) == 1:
        return sums[0]
    return builder.shuffle_vector(sums[0], sums[1], _lanes(list(range(16))))


def splat_i32(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """<16 x i32> of one int32 in every lane."""
    vector = builder.insert_element(ir.Constant(V32, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vector, vector, _lanes([0] * 16))


def signed_weights(context, builder: ir.IRBuilder,  # noqa: ANN001
                   weights: list[ir.Value]) -> tuple[list[ir.Value], list[ir.Value] | ir.Value]:
    """Groups of signed weight bytes (<16 x i32>: four of a row's columns to a lane) made
    ready for ``dot_signed``, once for every row of x. With VNNI: the weights, and 128
    times each lane's sum of them (x's bytes go in offset by 128, unsigned). Without:
    the weights' magnitudes, and where they are negative (x's bytes take their sign),
    so that ``vpmaddubsw``'s pairs stay within 2 * 128 * 127."""
    if _vnni(context):
        ones = ir.Constant(V32, [0x01010101] * 16)
        sums = ir.Constant(V32, [0] * 16)
        for w in weights:
            sums = dot_bytes(context, builder, sums, ones, w)
        return weights, builder.shl(sums, ir.Constant(V32, [7] * 16))
    zero = ir.Constant(_B64, [0] * 64)
    magnitudes, negative = [], []
    for w in weights:
        b = builder.bitcast(w, _B64)
        below = builder.icmp_signed("<", b, zero)
        magnitudes.append(builder.bitcast(builder.select(below, builder.sub(zero, b), b), V32))
        negative.append(below)
    return magnitudes, negative


def dot_signed(context, builder: ir.IRBuilder,  # noqa: ANN001
               prepared: tuple[list[ir.Value], list[ir.Value] | ir.Value],
               words: list[ir.Value]) -> ir.Value:
    """<16 x i32>: each lane's sum over the groups of ``signed_weights`` of its four
    signed weight bytes times x's four bytes of the group (``words``: an i32 of x's
    signed bytes a group), exactly: the same integers with and without VNNI."""
    weights, extra = prepared
    pair = [ir.Constant(V32, [0] * 16)] * 2
    for g, word in enumerate(words):
        if isinstance(extra, list):
            xb = builder.bitcast(splat_i32(builder, word), _B64)
            signed = builder.select(extra[g], builder.sub(ir.Constant(_B64, [0] * 64), xb), xb)
            pair[g % 2] = dot_bytes(context, builder, pair[g % 2], weights[g],
                                    builder.bitcast(signed, V32))
        else:  # x + 128 in each byte, the scalar flipped before it is splat
            offset = splat_i32(builder, builder.xor(word, ir.Constant(_I32, -0x7F7F7F80)))
            pair[g % 2] = dot_bytes(context, builder, pair[g % 2], offset, weights[g])
    total = builder.add(pair[0], pair[1])
    return total if isinstance(extra, list) else builder.sub(total, extra)


"""The pieces of the compiled decode steps (``decoder_step``, ``batch_step``)
between and around their GEMVs, in numba: RMSNorm, RoPE and the KV-cache write, the
fused gate/up projection with SiLU*mul, and the LM head's greedy pass.

Each piece that a step shares out among threads comes as a share (``_gate_up_share``,
``_head_share``: items [lo, hi) of the whole), so that the one-row step's parallel region
can run it (``decoder_step._one_region``); the ``prange`` wrappers (``_gate_up_silu``,
``_head_greedy``) run the same shares as a loop of their own, for steps of more rows, and
are what the tests hold to torch.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the cache
from rvllm.kernels.cpu.gemv import (
    PANEL,
    ROWS,
    SUMS,
    _group_dots,
    _panels_into,
    _share,
    _streams,
)
from rvllm.kernels.cpu.numerics import exp32, narrow_kv
from rvllm.kernels.cpu.packed import (
    PASS_ROWS,
    packed_dots,
    rounded_x,
)


@numba.njit(fastmath=True, cache=True, inline="always")
def _silu_put(out, r, g, u, scale, bias, inter):
    """out[r] (one row of the output) = SiLU(g) * u, g from gate row r and u from up row
    r + inter, each with its row's scale and bias."""
    if scale.shape[0] > 0:
        g *= scale[r]
        u *= scale[r + inter]
    if bias.shape[0] > 0:
        g += bias[r]
        u += bias[r + inter]
    out[r] = g / (np.float32(1.0) + exp32(-g)) * u


@numba.njit(fastmath=True, cache=True, inline="always")
def _silu_panel(out, p, t, rows, b0, sums, scale, bias, inter):
    """Rows 16p.. of out[b0 + b] for b < rows: gate and up panel pair t of a pass's sums
    (``gemv._group_dots``: the gate's at 2t, the up's at 2t + 1)."""
    for b in range(rows):
        for j in range(PANEL):
            _silu_put(out[b0 + b], p * PANEL + j, sums[2 * t * rows + b, j],
                      sums[(2 * t + 1) * rows + b, j], scale, bias, inter)


@numba.njit(fastmath=True, cache=True)
def _packed_gate_up_share(x, w, scale, bias, out, lo, hi, sums, xq):
    """``_gate_up_share`` over packed panels (``packed``; xq: ``rounded_x``): each gate
    panel and its up panel read from their bytes for every four rows of x."""
    batch = x.shape[0]
    gate_panels = out.shape[1] // PANEL
    for p in range(lo, hi):
        for b0 in range(0, batch, PASS_ROWS):
            rows = min(PASS_ROWS, batch - b0)
            packed_dots(w, p, xq, b0, rows, sums.ctypes.data)
            packed_dots(w, p + gate_panels, xq, b0, rows, sums.ctypes.data + rows * PANEL * 4)
            _silu_panel(out, p, 0, rows, b0, sums, scale, bias, gate_panels * PANEL)


def _gate_up_share(x, w, scale, bias, out, lo, hi, sums, xq):  # noqa: ANN001, ANN202
    """Gate panels [lo, hi) of ``_gate_up_silu`` (and the up panels beside them):
    ``_float_gate_up_share``, or ``_packed_gate_up_share`` for packed panels (xq:
    ``rounded_x(x, w)``), chosen when compiled (numba-only)."""
    raise NotImplementedError("numba-only")


@overload(_gate_up_share, inline="always")
def _gate_up_share_overload(x, w, scale, bias, out, lo, hi, sums, xq):  # noqa: ANN001, ANN202
    if w.dtype == types.uint8:
        def impl(x, w, scale, bias, out, lo, hi, sums, xq):  # noqa: ANN001, ANN202
            _packed_gate_up_share(x, w, scale, bias, out, lo, hi, sums, xq)
    else:
        def impl(x, w, scale, bias, out, lo, hi, sums, xq):  # noqa: ANN001, ANN202
            _float_gate_up_share(x, w, scale, bias, out, lo, hi, sums)
    return impl


@numba.njit(fastmath=True, cache=True, inline="always")
def _float_gate_up_share(x, w, scale, bias, out, lo, hi, sums):
    """Gate panels [lo, hi) of ``_gate_up_silu`` (and the up panels beside them), read
    side by side: with one row of x two runs of the share, four streams (gate and up of
    each), else two; sums: scratch float32 [SUMS, 16]."""
    inter, batch = out.shape[1], x.shape[0]
    gate_panels = inter // PANEL
    pairs = _streams(batch) // 2
    run = (hi - lo) // pairs
    for j in range(run):
        for b0 in range(0, batch, ROWS):
            rows = min(ROWS, batch - b0)
            _group_dots(w, lo + j, gate_panels, run, 2 * pairs, x, b0, rows, sums)
            for t in range(pairs):
                _silu_panel(out, lo + j + t * run, t, rows, b0, sums, scale, bias, inter)
    for p in range(lo + pairs * run, hi):
        for b0 in range(0, batch, ROWS):
            rows = min(ROWS, batch - b0)
            _group_dots(w, p, gate_panels, 0, 2, x, b0, rows, sums)
            _silu_panel(out, p, 0, rows, b0, sums, scale, bias, inter)


@numba.njit(parallel=True, fastmath=True, cache=True)
def _gate_up_silu(x, w, scale, bias, out, parts):
    """The merged gate/up projection (rows [0, I) gate, [I, 2I) up; its panels w, I a
    multiple of 16) and SiLU(gate) * up: the [B, 2I] intermediate never exists. Each of
    ``parts`` work items takes a share of the gate panels and the up panels beside them
    (``_gate_up_share``)."""
    gate_panels = out.shape[1] // PANEL
    xq = rounded_x(x, w)
    for part in prange(parts):
        lo, hi = _share(gate_panels, part, parts)
        _gate_up_share(x, w, scale, bias, out, lo, hi, np.empty((SUMS, PANEL), np.float32), xq)


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _rms_norm(x, weight, eps, out):
    """Each row of x [B, H]."""
    for b in range(x.shape[0]):
        total = np.float32(0.0)
        for i in range(x.shape[1]):
            total += x[b, i] * x[b, i]
        inv = np.float32(1.0) / np.sqrt(total / x.shape[1] + eps)
        for i in range(x.shape[1]):
            out[b, i] = x[b, i] * inv * weight[i]


@numba.njit(fastmath=True, cache=True)
def _rope(x, cos, sin):
    """Rotate-half RoPE in place on one row's heads x [H, D], with its position's cos/sin
    rows [D]."""
    half = x.shape[1] // 2
    for h in range(x.shape[0]):
        for i in range(half):
            a, b = x[h, i], x[h, i + half]
            x[h, i] = a * cos[i] - b * sin[i]
            x[h, i + half] = b * cos[i + half] + a * sin[i + half]


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _rope_and_cache(qkv, q, scale, key_cache, value_cache, positions, slots, cos_table,
                    sin_table):
    """For each row of qkv [B, Hq D + 2 Hk D] (one layer's projection): RoPE on its query
    and key heads, the queries times ``scale`` into q [B, Hq, D], and its key and value
    into the layer's caches [blocks, block_size, Hk, D] at its slot (-1: nowhere)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    for b in range(qkv.shape[0]):
        row = qkv[b]
        qb = row[:q_size].reshape((num_heads, head_dim))
        k = row[q_size:q_size + kv_size].reshape((num_kv_heads, head_dim))
        v = row[q_size + kv_size:].reshape((num_kv_heads, head_dim))
        cos, sin = cos_table[positions[b]], sin_table[positions[b]]
        _rope(qb, cos, sin)
        _rope(k, cos, sin)
        for h in range(num_heads):
            for d in range(head_dim):
                q[b, h, d] = qb[h, d] * scale
        if slots[b] >= 0:
            block, offset = slots[b] // block_size, slots[b] % block_size
            for h in range(num_kv_heads):
                for d in range(head_dim):
                    key_cache[block, offset, h, d] = narrow_kv(k[h, d], key_cache)
                    value_cache[block, offset, h, d] = narrow_kv(v[h, d], value_cache)


@numba.njit(fastmath=True, cache=True, inline="always")
def _head_share(x, w, scale, logits, tops, firsts, totals, part, lo, hi, sums, xq):
    """Panels [lo, hi) of the LM head's logits [B, V] = x [B, H] W^T (panels w; int8:
    times its scale; packed: xq is ``rounded_x(x, w)``); then, while they are in the
    cache, each row's largest logit of the
    share (tops[part, b]), the first index holding it (firsts; -1 for an empty share)
    and the sum of exp(logit - largest) (totals). Empty tops: the logits only."""
    _panels_into(x, w, scale, np.empty(0, np.float32), logits, lo, hi, sums, xq)
    if tops.shape[0] == 0:
        return
    vocab = logits.shape[1]
    r0, r1 = lo * PANEL, min(hi * PANEL, vocab)
    for b in range(x.shape[0]):
        firsts[part, b] = -1
        if r1 <= r0:
            continue
        row = logits[b]
        top = row[r0]
        for i in range(r0, r1):
            top = max(top, row[i])
        for i in range(r0, r1):
            if row[i] == top:
                firsts[part, b] = i
                break
        total = np.float32(0.0)
        for i in range(r0, r1):
            total += exp32(row[i] - top)
        tops[part, b], totals[part, b] = top, total


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _merge_greedy(tops, firsts, totals, token_ids, logprobs):
    """Each row's greedy token (the first index of its largest logit, as ``torch.argmax``)
    and its log-softmax logprob (``kernels.cpu.greedy``'s numbers) from the shares'
    maxima, first indices and sums of ``_head_share``."""
    parts = tops.shape[0]
    for b in range(token_ids.shape[0]):
        top, best = np.float32(0.0), -1
        for p in range(parts):
            if firsts[p, b] >= 0 and (best < 0 or tops[p, b] > top):
                top, best = tops[p, b], firsts[p, b]
        total = np.float32(0.0)
        for p in range(parts):
            if firsts[p, b] >= 0:
                total += totals[p, b] * exp32(tops[p, b] - top)
        token_ids[b], logprobs[b] = best, -np.log(total)


@numba.njit(parallel=True, fastmath=True, cache=True)
def _head_greedy(x, w, scale, logits, token_ids, logprobs, parts):
    """logits [B, V] of the final hidden states x [B, H] through the LM head's panels w,
    and each row's greedy token with its logprob: ``parts`` shares of the vocabulary
    (``_head_share``), merged (``_merge_greedy``)."""
    batch = x.shape[0]
    tops = np.empty((parts, batch), np.float32)
    totals = np.empty((parts, batch), np.float32)
    firsts = np.empty((parts, batch), np.int64)
    xq = rounded_x(x, w)
    for part in prange(parts):
        lo, hi = _share(w.shape[0], part, parts)
        _head_share(x, w, scale, logits, tops, firsts, totals, part, lo, hi,
                    np.empty((SUMS, PANEL), np.float32), xq)
    _merge_greedy(tops, firsts, totals, token_ids, logprobs)

"""Causal prefill attention for the CPU, compiled with numba.

A prompt's (or a chunk's) queries attend to its context and to their own rows, each to
the keys at or before its position (within the sliding window, if any). torch's SDPA on
the CPU ran these at 46-55 GFLOP/s on this Zen 2 (SmolLM2's heads, 290 to 512 tokens),
and serving's replay spent a tenth of its time there. This kernel runs them as small
register-blocked matrix products (``vectors.rows_times_tile``) at 95-120 GFLOP/s.

One work item is one KV head and one tile of 16 query positions, for all the query heads
that share the KV head (GQA: group x 16 rows, each key read once for them). Two passes
over the keys it can see, as the decode kernel does: the scores of every row against
every tile of 16 keys (the keys transposed once per call, a tile 16 lanes wide), one
exact softmax per row (positions past a row's own, or before its window, weigh 0), then
the weighted values, tile by tile. The items alternate long and short (the last query
tiles see the most keys), so both threads get as much work.

The head dimension must be a multiple of 16 and the inputs float32 (the CPU's compute
dtype); no soft cap. ``layers.attention.Attention`` keeps SDPA for the rest, and its
plain-torch attention is what this is tested against (``tests/test_kernels.py``).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the cache
from rvllm.kernels.cpu.numerics import exp32, row_max
from rvllm.kernels.cpu.threads import match_torch_threads
from rvllm.kernels.cpu.vectors import LANES, rows_times_tile, supports


@numba.njit(parallel=True, cache=True)
def _transpose_keys(keys, keys_t):
    """keys_t[h, t, d, j] = keys[16 t + j, h, d] (those past the last key left as they are:
    zeros)."""
    total, kv_heads, dim = keys.shape
    tiles = keys_t.shape[1]
    for item in prange(kv_heads * tiles):
        h, t = item // tiles, item % tiles
        for j in range(min(LANES, total - t * LANES)):
            for d in range(dim):
                keys_t[h, t, d, j] = keys[t * LANES + j, h, d]


@numba.njit(fastmath=True, cache=True, inline="always")
def _softmax_rows(scores, first_key, context_len, p0, valid, group, window, inv_sums):
    """Each row's softmax over its visible keys, in place (the rest of its row 0), and one
    over its sum; rows of positions past the chunk (``valid`` and on) all 0. Row m * 16 + i
    is query position context_len + p0 + i; column c is key first_key + c."""
    width = scores.shape[1]
    for m in range(group):
        for i in range(LANES):
            r = m * LANES + i
            if i >= valid:
                for c in range(width):
                    scores[r, c] = 0.0
                continue
            pos = context_len + p0 + i
            c0 = max(0, pos - window + 1) - first_key if window > 0 else 0
            c1 = pos + 1 - first_key
            for c in range(c0):
                scores[r, c] = 0.0
            for c in range(c1, width):
                scores[r, c] = 0.0
            live = scores[r, c0:c1]
            top = row_max(live)
            total = np.float32(0.0)
            for c in range(live.shape[0]):
                p = exp32(live[c] - top)
                live[c] = p
                total += p
            inv_sums[r] = np.float32(1.0) / total


@numba.njit(parallel=True, fastmath=True, cache=True)
def _prefill(q, keys, values, context_len, scale, window, out):
    """out[i, h * D:(h + 1) * D] = attention of q[i, h] (position context_len + i) over
    keys and values [context_len + n, Hk, D] up to its own position; all C-contiguous
    float32."""
    n, num_heads, dim = q.shape
    total, kv_heads = keys.shape[0], keys.shape[1]
    group = num_heads // kv_heads
    keys_t = np.zeros((kv_heads, (total + LANES - 1) // LANES, dim, LANES), np.float32)
    _transpose_keys(keys, keys_t)
    q_tiles = (n + LANES - 1) // LANES
    rows = group * LANES
    row_stride = kv_heads * dim  # of keys and values, in elements
    for item in prange(kv_heads * q_tiles):
        kv, k = item % kv_heads, item // kv_heads
        tile = k // 2 if k % 2 == 0 else q_tiles - 1 - k // 2  # long and short in turn
        p0 = tile * LANES
        valid = min(LANES, n - p0)
        queries = np.zeros((rows, dim), np.float32)
        for m in range(group):
            for i in range(valid):
                for d in range(dim):
                    queries[m * LANES + i, d] = q[p0 + i, kv * group + m, d] * scale
        end = context_len + p0 + valid  # keys [start, end) are seen by some row
        start = max(0, context_len + p0 - window + 1) if window > 0 else 0
        t_lo, t_hi = start // LANES, (end + LANES - 1) // LANES
        width = (t_hi - t_lo) * LANES
        scores = np.empty((rows, width), np.float32)
        for t in range(t_lo, t_hi):
            rows_times_tile(rows, queries.ctypes.data, dim, keys_t[kv, t].ctypes.data, LANES,
                            dim, scores.ctypes.data + (t - t_lo) * LANES * 4, width, 0)
        inv_sums = np.zeros(rows, np.float32)
        _softmax_rows(scores, t_lo * LANES, context_len, p0, valid, group, window, inv_sums)
        acc = np.empty((rows, dim), np.float32)
        for t in range(t_lo, t_hi):
            count = min(LANES, total - t * LANES)
            for chunk in range(0, dim, LANES):
                first_value = values.ctypes.data + (t * LANES * row_stride + kv * dim
                                                    + chunk) * 4
                rows_times_tile(rows, scores.ctypes.data + (t - t_lo) * LANES * 4, width,
                                first_value, row_stride, count, acc.ctypes.data + chunk * 4,
                                dim, 1 if t > t_lo else 0)
        for m in range(group):
            for i in range(valid):
                r = m * LANES + i
                for d in range(dim):
                    out[p0 + i, (kv * group + m) * dim + d] = acc[r, d] * inv_sums[r]


def supported(head_dim: int, dtype: torch.dtype, soft_cap: float | None) -> bool:
    """Whether this kernel takes a layer's prefill attention."""
    return supports(head_dim) and dtype == torch.float32 and soft_cap is None


def prefill_attention_cpu(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          context_len: int, scale: float, sliding_window: int | None
                          ) -> torch.Tensor:
    """q: [n, Hq, D], the chunk's queries at positions context_len to context_len + n - 1;
    keys, values: [context_len + n, Hk, D], its whole context then its own rows. Returns
    [n, Hq * D]: each query's attention over the keys at or before its position (the last
    ``sliding_window`` of them, when given)."""
    match_torch_threads()
    n, heads, dim = q.shape
    out = torch.empty(n, heads * dim)
    _prefill(q.contiguous().numpy(), keys.contiguous().numpy(), values.contiguous().numpy(),
             np.int64(context_len), np.float32(scale), np.int64(sliding_window or 0),
             out.numpy())
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel on a tiny input."""
    x = torch.zeros(2, 1, LANES)
    prefill_attention_cpu(x, x, x, 0, 1.0, None)

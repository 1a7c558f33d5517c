"""Paged decode attention for the CPU, compiled with numba.

The plain-torch decode path (``layers.attention.Attention._decode``) first gathers
every context position of every sequence out of the paged cache into a dense tensor,
then lets SDPA read it again: the keys and values cross memory three times, and a
batch of mixed lengths pays for its padding or for one SDPA call per sequence. At
20 sequences of 500 tokens that is more time than all the linear layers of a
SmolLM2 decode step. This kernel reads each key and value row once, straight from its
block, for all the query heads that share it (GQA), with no padding.

One work item is one sequence, or a run of its blocks when there are fewer sequences
than threads to keep busy (split-KV, merged after). It walks its blocks in order, each
a contiguous run of memory, twice: the scores of all query heads, then (after a softmax
over each head's scores) the weighted values. Items run in parallel on numba's threads
(as many as torch's), each thread down its own list of them, shared out by their lengths
(``_share_out``: equal counts in index order left one thread 8% more to read on average
under serving's mixed lengths). It computes in float32, the CPU's compute dtype, over a float32
or bfloat16 cache (``--kv-cache-dtype bfloat16``: half the bytes to read, each row
widened once for the query heads that share it); the torch path is the reference it is
tested against, and what runs in other dtypes.

Before it computes on a block, it asks the memory for the next one (in the scores pass,
after the last block of keys, the first block of values). The blocks lie anywhere in the
cache: without that, a thread waited for memory at every block, then computed with the
memory idle. 32 sequences of ~340 tokens, a cache far larger than the L3: 0.85 ms a layer
without, 0.42 ms with, 0.40 ms to only read the same blocks.

Past that it was bound by its arithmetic (as fast with the cache in the L3): each score
was a horizontal sum and each value row a reload of the accumulator. With a head
dimension that is a multiple of 16, the scores and the weighted values of a block go
through ``vectors`` (16-lane vectors written in LLVM IR): 0.50 to 0.26 ms a layer at
32 sequences of 32-400 tokens (SmolLM2's heads), float32 or bfloat16 cache alike.

numba compiles the kernel on its first call (a few seconds) and caches the machine
code next to this file, or under ``NUMBA_CACHE_DIR``, so later processes load it in
a fraction of a second; ``warm_up()`` does that at engine start.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the cache
from rvllm.kernels.cpu.numerics import exp32, fetch_rows, kv_array, row_max, widen_kv_row
from rvllm.kernels.cpu.threads import match_torch_threads
from rvllm.kernels.cpu.vectors import LANES, run_scores, run_values, supports


@numba.njit(fastmath=True, cache=True, inline="always")
def _scores_run(queries, keys, ahead, s0, n, base, group, scores, partials):
    """``run_scores`` on the n tokens of the block from token s0 on. Called with n the
    constant ``LANES`` for a full run, so that LLVM compiles that copy for its length:
    the scores of full runs took 12% less time (SmolLM2's heads, 2 cores), the values 5%
    less."""
    row_bytes = keys.shape[1] * keys.shape[2] * keys.itemsize
    run_scores(queries.ctypes.data, keys.ctypes.data + s0 * row_bytes, n, queries.shape[1],
               group, keys.shape[1], partials.ctypes.data,
               scores.ctypes.data + (base + s0) * 4, scores.shape[1],
               ahead.ctypes.data + s0 * row_bytes, keys)


@numba.njit(fastmath=True, cache=True, inline="always")
def _values_run(scores, values, ahead, fetch, s0, n, base, group, acc):
    """``run_values`` on the n tokens of the block from token s0 on, as ``_scores_run``."""
    row_bytes = values.shape[1] * values.shape[2] * values.itemsize
    run_values(scores.ctypes.data + (base + s0) * 4, scores.shape[1],
               values.ctypes.data + s0 * row_bytes, n, acc.shape[1], group, values.shape[1],
               acc.ctypes.data, ahead.ctypes.data + s0 * row_bytes if fetch else 0, values)


@numba.njit(fastmath=True, cache=True, inline="always")
def _block_scores(queries, keys, ahead, t0, t1, base, group, row, scores, partials):
    """Scores of the block's tokens [t0, t1) into scores[:, base + t], while the same rows
    of the block ``ahead`` are asked for: in runs of up to 16 tokens with
    ``vectors.run_scores``, or where the head dimension is not a multiple of 16, in
    plain loops (one dot product a token and query head, each key row read once for the
    query heads that share it)."""
    head_dim, num_kv_heads = queries.shape[1], keys.shape[1]
    if supports(head_dim):
        for s0 in range(t0, t1, LANES):
            if t1 - s0 >= LANES:  # a full run, its length a constant: see _scores_run
                _scores_run(queries, keys, ahead, s0, LANES, base, group, scores, partials)
            else:
                _scores_run(queries, keys, ahead, s0, t1 - s0, base, group, scores, partials)
        return
    for t in range(t0, t1):
        fetch_rows(ahead, t)
        for kv in range(num_kv_heads):
            key = widen_kv_row(keys[t, kv], row)
            for h in range(kv * group, (kv + 1) * group):
                s = np.float32(0.0)
                for d in range(head_dim):
                    s += queries[h, d] * key[d]
                scores[h, base + t] = s


@numba.njit(fastmath=True, cache=True, inline="always")
def _block_values(scores, values, ahead, fetch, t0, t1, base, group, row, acc):
    """acc[h] += the block's value rows [t0, t1) weighted by scores[h, base + t], asking
    for the same rows of ``ahead`` when ``fetch``, as ``_block_scores``."""
    head_dim, num_kv_heads = acc.shape[1], values.shape[1]
    if supports(head_dim):
        for s0 in range(t0, t1, LANES):
            if t1 - s0 >= LANES:  # as in _block_scores
                _values_run(scores, values, ahead, fetch, s0, LANES, base, group, acc)
            else:
                _values_run(scores, values, ahead, fetch, s0, t1 - s0, base, group, acc)
        return
    for t in range(t0, t1):
        if fetch:
            fetch_rows(ahead, t)
        for kv in range(num_kv_heads):
            value = widen_kv_row(values[t, kv], row)
            for h in range(kv * group, (kv + 1) * group):
                p = scores[h, base + t]
                for d in range(head_dim):
                    acc[h, d] += p * value[d]


@numba.njit(cache=True, inline="always")
def split_range(end, window, block_size, num_splits, split):
    """The blocks [lo, hi) of a context of ``end`` tokens (the last ``window`` of them
    where 0 < window < end) that split ``split`` of ``num_splits`` covers, and its tokens
    [t_lo, t_hi) (none: t_hi <= t_lo)."""
    start = end - window if 0 < window < end else 0
    first_block, last_block = start // block_size, (end - 1) // block_size
    per_split = (last_block - first_block) // num_splits + 1
    lo = first_block + split * per_split
    hi = min(lo + per_split, last_block + 1)
    return lo, hi, max(lo * block_size, start), min(hi * block_size, end)


@numba.njit(fastmath=True, cache=True, inline="always")
def _attend_part(q, key_cache, value_cache, block_tables, seq_lens, scale, window, soft_cap,
                 num_splits, part_max, part_sum, part_out, item, out):
    """One sequence's attention over one contiguous run of its blocks, as an unnormalised
    partial result: per query head the max score, the sum of exp(score - max), and the
    exp-weighted sum of values; over the whole context (one split), the result itself,
    into out. Two passes over the run: every score first (each key row read once for the
    query heads that share it), one softmax per head over its row of scores (``exp32``:
    vectorised), then the weighted values."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    seq, split = item // num_splits, item % num_splits
    lo, hi, t_lo, t_hi = split_range(seq_lens[seq], window, block_size, num_splits, split)
    count = max(t_hi - t_lo, 0)

    queries = np.empty((num_heads, head_dim), np.float32)
    for h in range(num_heads):
        for d in range(head_dim):
            queries[h, d] = q[seq, h, d] * scale
    scores = np.empty((num_heads, count), np.float32)
    row = np.empty(head_dim, np.float32)  # a bfloat16 cache's row, widened
    # vectors' scratch; zeros, so that lanes it drops never hold denormals.
    partials = np.zeros((num_heads, LANES, LANES), np.float32)
    for b in range(lo, hi):
        # A block's keys (and values) are one contiguous run of memory: read it in order,
        # while asking for the next one (the blocks lie anywhere in the cache); after the
        # last keys, the first values.
        ahead = (key_cache[block_tables[seq, b + 1]] if b + 1 < hi
                 else value_cache[block_tables[seq, lo]])
        t0, t1 = max(t_lo - b * block_size, 0), min(t_hi - b * block_size, block_size)
        _block_scores(queries, key_cache[block_tables[seq, b]], ahead, t0, t1,
                      b * block_size - t_lo, group, row, scores, partials)
    for h in range(num_heads):
        if soft_cap > 0:
            for i in range(count):
                scores[h, i] = soft_cap * np.tanh(scores[h, i] / soft_cap)
        top = row_max(scores[h])
        total = np.float32(0.0)
        for i in range(count):
            p = exp32(scores[h, i] - top)
            scores[h, i] = p
            total += p
        part_max[seq, split, h] = top
        part_sum[seq, split, h] = total
    acc = np.zeros((num_heads, head_dim), np.float32)
    for b in range(lo, hi):
        t0, t1 = max(t_lo - b * block_size, 0), min(t_hi - b * block_size, block_size)
        ahead = value_cache[block_tables[seq, min(b + 1, hi - 1)]]
        _block_values(scores, value_cache[block_tables[seq, b]], ahead, b + 1 < hi, t0, t1,
                      b * block_size - t_lo, group, row, acc)
    if num_splits == 1:  # the whole context: the result itself, nothing to merge
        for h in range(num_heads):
            for d in range(head_dim):
                out[seq, h, d] = acc[h, d] / part_sum[seq, 0, h]
        return
    for h in range(num_heads):
        for d in range(head_dim):
            part_out[seq, split, h, d] = acc[h, d]


MERGE_HERE = 4  # split sequences merged on the calling thread, at most


@numba.njit(parallel=True, fastmath=True, cache=True)
def _paged_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, window, soft_cap,
                  num_splits, threads, out):
    """out [B, Hq, D]: each sequence's attention (``_attend_part``), its context split in
    ``num_splits`` parts (merged after) when there are few sequences; ``threads``:
    numba's thread count (asked for here, it would keep this function out of numba's
    cache)."""
    num_seqs, num_heads, head_dim = q.shape
    part_max = np.empty((num_seqs, num_splits, num_heads), np.float32)
    part_sum = np.empty((num_seqs, num_splits, num_heads), np.float32)
    part_out = np.empty((num_seqs if num_splits > 1 else 0, num_splits, num_heads, head_dim),
                        np.float32)
    items = num_seqs * num_splits
    if threads > 1 and items > threads:
        # One iteration a thread, each taking the items _share_out gave it.
        order, starts = _share_out(seq_lens, window, key_cache.shape[1], num_splits, threads)
        for thread in numba.prange(threads):
            for i in range(starts[thread], starts[thread + 1]):
                _attend_part(q, key_cache, value_cache, block_tables, seq_lens, scale,
                             window, soft_cap, num_splits, part_max, part_sum, part_out,
                             order[i], out)
    else:
        for item in numba.prange(items):
            _attend_part(q, key_cache, value_cache, block_tables, seq_lens, scale, window,
                         soft_cap, num_splits, part_max, part_sum, part_out, item, out)
    if num_splits == 1:
        return  # each item wrote its sequence's result
    if num_seqs <= MERGE_HERE:
        # A few thousand floats: here, not in a parallel loop, which cost a fork and join
        # of numba's threads (3 us) every layer of every N=1 decode step.
        for seq in range(num_seqs):
            _merge(part_max, part_sum, part_out, seq, out)
    else:
        for seq in numba.prange(num_seqs):
            _merge(part_max, part_sum, part_out, seq, out)


ITEM_OVERHEAD = 16  # what an item costs beside its tokens, in tokens' worth


@numba.njit(cache=True)
def _share_out(seq_lens, window, block_size, num_splits, threads):
    """The items (sequence * num_splits + split) in the order the threads take them:
    thread t the items order[starts[t]:starts[t + 1]]. A prange over the items hands each
    thread an equal count in index order, and a batch's contexts differ in length (32 to
    768 tokens under serving's load): one thread had 8% more tokens to read than the
    other on average, up to 25%. Here the longest item goes first to the thread with the
    least work so far, until every item has one."""
    items = seq_lens.shape[0] * num_splits
    cost = np.empty(items, np.int64)
    for item in range(items):
        seq, split = item // num_splits, item % num_splits
        _, _, t_lo, t_hi = split_range(seq_lens[seq], window, block_size, num_splits, split)
        cost[item] = max(t_hi - t_lo, 0) + ITEM_OVERHEAD
    owner = np.empty(items, np.int64)
    load = np.zeros(threads, np.int64)
    counts = np.zeros(threads + 1, np.int64)
    for item in np.argsort(-cost, kind="mergesort"):
        least = 0
        for t in range(1, threads):
            if load[t] < load[least]:
                least = t
        owner[item] = least
        load[least] += cost[item]
        counts[least + 1] += 1
    starts = np.cumsum(counts)
    order = np.empty(items, np.int64)
    filled = starts[:threads].copy()
    for item in range(items):
        order[filled[owner[item]]] = item
        filled[owner[item]] += 1
    return order, starts


@numba.njit(fastmath=True, cache=True, inline="always")
def _merge(part_max, part_sum, part_out, seq, out):
    """out[seq] from its splits' partial results: each rescaled to the overall max (an
    empty split has max -inf and weighs nothing)."""
    num_splits, num_heads, head_dim = part_out.shape[1], part_out.shape[2], part_out.shape[3]
    for h in range(num_heads):
        top = part_max[seq, 0, h]
        for split in range(1, num_splits):
            top = max(top, part_max[seq, split, h])
        total = np.float32(0.0)
        for d in range(head_dim):
            out[seq, h, d] = 0.0
        for split in range(num_splits):
            if part_max[seq, split, h] == -np.inf:
                continue  # an empty split
            weight = np.exp(part_max[seq, split, h] - top)
            total += weight * part_sum[seq, split, h]
            for d in range(head_dim):
                out[seq, h, d] += weight * part_out[seq, split, h, d]
        for d in range(head_dim):
            out[seq, h, d] /= total


@numba.njit(cache=True)
def num_splits_for(num_seqs, threads):
    """How many parts each context is split into: fewer sequences than twice the threads
    are split so that every thread works."""
    return 1 if num_seqs >= 2 * threads else -(-2 * threads // num_seqs)


def step_arrays(block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple:
    """What every layer of one decode step passes the same: the block tables and lengths
    as int64 numpy arrays, and how many parts each context is split into (fewer
    sequences than twice the threads: split them so every thread works)."""
    match_torch_threads()
    threads = numba.get_num_threads()
    num_seqs = block_tables.shape[0]
    num_splits = num_splits_for(num_seqs, threads)
    return (block_tables.to(torch.int64).contiguous().numpy(),
            seq_lens.to(torch.int64).contiguous().numpy(), np.int64(num_splits))


def paged_decode_attention_cpu(q: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                               soft_cap: float | None, arrays: tuple | None = None
                               ) -> torch.Tensor:
    """q: [B, Hq, D] float32, one new token per sequence; caches: [num_blocks, block_size,
    Hk, D], float32 or bfloat16; block_tables: [B, max_blocks]; seq_lens: [B] context
    lengths including the new token. Returns [B, Hq, D]. A sliding window keeps the last
    ``sliding_window`` positions; ``soft_cap`` squashes scores as cap * tanh(score / cap)
    (Gemma 2).
    ``arrays``: ``step_arrays(block_tables, seq_lens)``, made once per step."""
    tables, lens, num_splits = arrays or step_arrays(block_tables, seq_lens)
    out = torch.empty(q.shape, dtype=torch.float32)
    # One compiled signature: contiguous arrays, int64 indices, float32 scalars.
    _paged_decode(q.contiguous().numpy(), kv_array(key_cache), kv_array(value_cache), tables,
                  lens, np.float32(scale), np.int64(sliding_window or 0),
                  np.float32(soft_cap or 0.0), num_splits, np.int64(numba.get_num_threads()),
                  out.numpy())
    return out


def warm_up(kv_dtype: torch.dtype = torch.float32) -> None:
    """Compile (or load from numba's cache) the kernel on a tiny input over a cache of
    ``kv_dtype``, so the first decode step does not pay for it."""
    cache = torch.zeros(1, 1, 1, 1, dtype=kv_dtype)
    paged_decode_attention_cpu(torch.zeros(1, 1, 1), cache, cache,
                               torch.zeros(1, 1, dtype=torch.int64),
                               torch.ones(1, dtype=torch.int64), 1.0, None, None)

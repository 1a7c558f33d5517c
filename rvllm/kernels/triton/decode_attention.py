"""Paged decode attention: one query token per sequence against its cached context.

Grid: (sequence, KV head, partition). A program loads the query heads that
share one KV head (GQA) as the rows of one tile, so every key and value is
read from the cache once per group, and walks its partition of the context in
tiles of BLOCK_N tokens, gathering each token's slot through the block table.
With more than one partition (split-KV) each writes a partial softmax (its
output, running max and sum) and a second kernel merges them; long contexts
then spread over many programs instead of one per (sequence, KV head).

The number of partitions comes from the width of ``block_tables``, not from the
sequence lengths, so a CUDA graph captured with a fixed-width table stays valid
for any lengths; partitions past a sequence's end exit at once.

An FP8 cache (``kv_fp8``) is widened to the query's dtype as it is loaded (exact), and
its scales are folded in, not applied per element: the key scale into the softmax
scale, the value scale into the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` for the attention kernels' ``tl.dot``: full float32 ("ieee")
    for float32 inputs, so the float32 path matches the reference token for token (Triton
    would otherwise round them to TF32 on a GPU); half-precision inputs are unaffected."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _decode_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, max_ptr, sum_ptr, kv_scale_ptr,
    scale, sliding_window, partition_size,
    q_stride_b, q_stride_h, table_stride,
    cache_stride_block, cache_stride_slot, cache_stride_head,
    out_stride_b, out_stride_h, out_stride_p, stats_stride_b, stats_stride_h,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = part * partition_size
    hi = tl.minimum(lo + partition_size, seq_len)
    if sliding_window > 0:
        lo = tl.maximum(lo, seq_len - sliding_window)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + d[None, :],
                mask=q_mask, other=0.0)
    if KV_FP8:
        scale = scale * tl.load(kv_scale_ptr)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * table_stride
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = (block * cache_stride_block + (n % BLOCK_SIZE) * cache_stride_slot
                + kv_head * cache_stride_head)
        kv_mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(key_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # An empty partition (or a zero-length padding row) leaves l_i = 0: write zeros.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * tl.load(kv_scale_ptr + 1)
    out_ptrs = out_ptr + seq * out_stride_b + heads[:, None] * out_stride_h + d[None, :]
    if SPLIT:
        tl.store(out_ptrs + part * out_stride_p, out, mask=q_mask)
        stats = seq * stats_stride_b + heads * stats_stride_h + part
        tl.store(max_ptr + stats, m_i, mask=g < GROUP)
        tl.store(sum_ptr + stats, l_i, mask=g < GROUP)
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _reduce_kernel(
    part_out_ptr, max_ptr, sum_ptr, out_ptr, num_partitions,
    part_stride_b, part_stride_h, part_stride_p, stats_stride_b, stats_stride_h,
    out_stride_b, out_stride_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    p_mask = p < num_partitions
    stats = seq * stats_stride_b + head * stats_stride_h + p
    m = tl.load(max_ptr + stats, mask=p_mask, other=float("-inf"))
    l_p = tl.load(sum_ptr + stats, mask=p_mask, other=0.0)
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    weight = l_p * tl.exp(m - m_all)
    total = tl.sum(weight, axis=0)
    d = tl.arange(0, BLOCK_D)
    mask = p_mask[:, None] & (d < HEAD_DIM)[None, :]
    part_out = tl.load(part_out_ptr + seq * part_stride_b + head * part_stride_h
                       + p[:, None] * part_stride_p + d[None, :], mask=mask, other=0.0)
    out = tl.sum(part_out * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * out_stride_b + head * out_stride_h + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def auto_partition_size(batch: int, num_kv_heads: int, block_n: int = 64) -> int:
    """Tokens per split-KV partition. A few (sequence, KV head) pairs leave most of the
    GPU idle unless each context is cut finer: at one sequence of a 7B model's 4 KV heads
    on an H200, 512-token partitions made the kernel 9 us a layer, mostly latency. Many
    pairs fill the GPU already, and coarser partitions keep the merge cheap."""
    return 2 * block_n if batch * num_kv_heads < 128 else 512


def paged_decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    sliding_window: int | None = None, partition_size: int | None | str = "auto",
    block_n: int = 64, kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    q: [B, Hq, D]; caches: [num_blocks, block_size, Hk, D] (this step's K/V already
    written); block_tables: [B, max_blocks] int32; seq_lens: [B] int32, context length
    including the new token (0 = padding row, output zeros). ``sliding_window``: attend
    to the last that many tokens. The partitions (split-KV) cover the table's width,
    ``block_tables.shape[1] * block_size`` tokens, ``partition_size`` each (a multiple of
    ``block_n``); None, or a size past the width, runs one program per (sequence, KV
    head) and no reduce. "auto" (:func:`auto_partition_size`) picks from the batch.
    ``block_n``: tokens per tile, a power of two >= 16. ``kv_scale``: [k_scale, v_scale]
    float32 of a float8_e4m3fn cache (``kv_fp8``).
    Returns [B, Hq, D] in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    assert q.stride(2) == 1 and key_cache.stride() == value_cache.stride()
    assert num_heads % num_kv_heads == 0
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    assert kv_fp8 == (kv_scale is not None), "an FP8 cache, and only one, takes kv_scale"
    out = torch.empty_like(q)
    if batch == 0:
        return out
    max_len = block_tables.shape[1] * block_size
    if partition_size == "auto":
        partition_size = auto_partition_size(batch, num_kv_heads, block_n)
    if partition_size is None or partition_size >= max_len:
        partition_size, num_partitions = max(max_len, 1), 1
    else:
        assert partition_size % block_n == 0, "partition_size must be a multiple of block_n"
        num_partitions = triton.cdiv(max_len, partition_size)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs dims >= 16 on GPU
    split = num_partitions > 1
    if split:
        part_out = torch.empty(batch, num_heads, num_partitions, head_dim,
                               dtype=torch.float32, device=q.device)
        part_max = torch.empty(batch, num_heads, num_partitions, dtype=torch.float32,
                               device=q.device)
        part_sum = torch.empty_like(part_max)
        target, strides = part_out, part_out.stride()
    else:
        part_max = part_sum = q  # unused
        target, strides = out, (*out.stride()[:2], 0)
    _decode_kernel[(batch, num_kv_heads, num_partitions)](
        q, key_cache, value_cache, block_tables, seq_lens, target, part_max, part_sum,
        kv_scale if kv_fp8 else q, scale, sliding_window or 0, partition_size,
        q.stride(0), q.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        strides[0], strides[1], strides[2],
        part_max.stride(0) if split else 0, part_max.stride(1) if split else 0,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        SPLIT=split, PRECISION=dot_precision(q.dtype), KV_FP8=kv_fp8, num_warps=4,
    )
    if split:
        _reduce_kernel[(batch, num_heads)](
            part_out, part_max, part_sum, out, num_partitions,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_max.stride(0), part_max.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_P=triton.next_power_of_2(num_partitions), num_warps=4,
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    sliding_window: int | None = None, kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch reference for ``paged_decode_attention``, one sequence at a time (an
    FP8 cache dequantized to float32 first)."""
    k_scale, v_scale = (1.0, 1.0) if kv_scale is None else (kv_scale[0], kv_scale[1])
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        if sliding_window is not None:
            pos = pos[max(0, seq_len - sliding_window):]
        blocks = block_tables[i, pos // block_size].long()
        keys = key_cache[blocks, pos % block_size].transpose(0, 1)  # [Hk, L, D]
        values = value_cache[blocks, pos % block_size].transpose(0, 1)
        group = q.shape[1] // num_kv_heads
        keys = keys.repeat_interleave(group, 0).float() * k_scale
        values = values.repeat_interleave(group, 0).float() * v_scale
        o = F.scaled_dot_product_attention(q[i].float().unsqueeze(1), keys, values, scale=scale)
        out[i] = o.squeeze(1).to(q.dtype)
    return out

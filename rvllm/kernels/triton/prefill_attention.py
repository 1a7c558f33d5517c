"""Prefill attention over the paged cache: variable-length, causal, with a cached prefix.

The batch is flat: sequence i owns query rows [query_start_loc[i],
query_start_loc[i+1]) and its keys are positions [0, seq_lens[i]) of its block
table, the first ``seq_len - query_len`` of which were cached before this step
(prefix-cache hit or an earlier chunk). Query row j sits at position
``context_len + j`` and sees keys up to and including its own position.

Grid: (query tile, sequence, query head); a flash-attention loop over the key
tiles the tile can see, gathering slots through the block table, so keys
are never copied out of the cache. An FP8 cache is read as in ``decode_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rvllm.kernels.triton.decode_attention import dot_precision


@triton.jit
def _prefill_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr,
    seq_lens_ptr, out_ptr, kv_scale_ptr,
    scale, sliding_window,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, table_stride,
    cache_stride_block, cache_stride_slot, cache_stride_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    kv_head = head // GROUP

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < q_len
    q_pos = context_len + m
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * q_stride_t + head * q_stride_h + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8:
        scale = scale * tl.load(kv_scale_ptr)

    # Keys this tile can see: up to its last row's position, from its first row's window.
    hi = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)
    window_lo = tl.maximum(context_len + tile * BLOCK_M - sliding_window + 1, 0)
    lo = tl.where(sliding_window > 0, window_lo, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * table_stride
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slots = (block * cache_stride_block + (n % BLOCK_SIZE) * cache_stride_slot
                 + kv_head * cache_stride_head)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + slots[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        if sliding_window > 0:
            visible = visible & (n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        # A row may see nothing in this tile (window or causal edge): keep exp() finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache_ptr + slots[:, None] + d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * tl.load(kv_scale_ptr + 1)
    tl.store(out_ptr + rows[:, None] * out_stride_t + head * out_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    max_query_len: int, scale: float, sliding_window: int | None = None,
    block_m: int = 64, block_n: int = 64, kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flat batch of query chunks over their paged contexts.

    q: [T, Hq, D]; caches: [num_blocks, block_size, Hk, D] with this step's K/V already
    written; block_tables: [S, max_blocks] int32; query_start_loc: [S + 1] int32 offsets
    of each sequence's rows in q; seq_lens: [S] int32, cached + new tokens;
    ``max_query_len``: the longest chunk (sizes the grid). ``sliding_window``: each query
    sees the last that many positions up to its own. ``block_m``/``block_n``: query and
    key tile sizes, powers of two >= 16. ``kv_scale``: [k_scale, v_scale] float32 of a
    float8_e4m3fn cache (``kv_fp8``). Returns [T, Hq, D] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    assert q.stride(2) == 1 and key_cache.stride() == value_cache.stride()
    assert num_heads % num_kv_heads == 0
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    assert kv_fp8 == (kv_scale is not None), "an FP8 cache, and only one, takes kv_scale"
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out,
        kv_scale if kv_fp8 else q, scale, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype), KV_FP8=kv_fp8,
        num_warps=4,
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    max_query_len: int, scale: float, sliding_window: int | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch reference for ``paged_prefill_attention``, one sequence at a time (an
    FP8 cache dequantized to float32 first)."""
    k_scale, v_scale = (1.0, 1.0) if kv_scale is None else (kv_scale[0], kv_scale[1])
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[i], starts[i + 1])
        q_len = starts[i + 1] - starts[i]
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_tables[i, pos // block_size].long()
        keys = key_cache[blocks, pos % block_size].transpose(0, 1).float() * k_scale
        values = value_cache[blocks, pos % block_size].transpose(0, 1).float() * v_scale
        q_pos = pos[seq_len - q_len:].unsqueeze(1)
        mask = pos.unsqueeze(0) <= q_pos
        if sliding_window is not None:
            mask &= pos.unsqueeze(0) > q_pos - sliding_window
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).float(), keys.repeat_interleave(group, 0),
            values.repeat_interleave(group, 0), attn_mask=mask, scale=scale,
        )
        out[rows] = o.transpose(0, 1).to(q.dtype)
    return out

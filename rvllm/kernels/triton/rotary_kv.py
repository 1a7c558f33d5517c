"""RoPE on query and key fused with the write of key and value into the paged cache.

Rotate-half layout (Hugging Face checkpoints): the first and second halves of
a head are the two coordinates of each rotated pair. One program per (token,
head): query heads are rotated in place; key heads are rotated in place and
written, with their value, to ``slot_mapping[token]``. A negative slot (padding
in a CUDA-graph batch) writes nothing to the cache. An FP8 cache (``kv_fp8``) stores
each key, rounded to the model dtype as the in-place one is, and each value divided by
the layer's scale, saturated to E4M3's range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rvllm.kernels.triton.kv_fp8 import quantize_kv


@triton.jit
def _rotate_in_place(ptr, cos_ptr, sin_ptr, offs, mask, half):
    # Tables rounded to the model dtype first, as the torch path (and transformers) do.
    x1 = tl.load(ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(ptr + half + offs, mask=mask, other=0.0)
    dtype = x1.dtype
    c1 = tl.load(cos_ptr + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + half + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + half + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    y1 = x1.to(tl.float32) * c1 - x2.to(tl.float32) * s1
    y2 = x2.to(tl.float32) * c2 + x1.to(tl.float32) * s2
    tl.store(ptr + offs, y1.to(dtype), mask=mask)
    tl.store(ptr + half + offs, y2.to(dtype), mask=mask)
    return y1, y2


@triton.jit
def _to_fp8(x):
    """Float32 to E4M3 (as torch's ``.to(torch.float8_e4m3fn)``), saturated at +-448.

    Rounded to E4M3's precision in float32 first, to nearest even, so the conversion
    itself is exact: Triton's interpreter rounds some values to the wrong binade (a
    mantissa that rounds up past 1.111b), and subnormals toward zero. Normal range: three
    mantissa bits kept by an integer add on the float's bits (a carry moves into the
    exponent, as it should); below 2^-6, multiples of 2^-9 by adding and subtracting
    1.5 * 2^14, the sign put back (so -0.0 stays -0.0, as torch keeps it)."""
    x = tl.clamp(x, -448.0, 448.0)
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    tiny = (tl.abs(x) + 24576.0) - 24576.0
    tiny = tl.where(bits < 0, -tiny, tiny)
    return tl.where(tl.abs(x) < 0.015625, tiny, normal).to(tl.float8e4nv)


@triton.jit
def _rotary_kv_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr,
    key_cache_ptr, value_cache_ptr, slot_mapping_ptr, kv_scale_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, table_stride,
    cache_stride_block, cache_stride_slot, cache_stride_head,
    num_heads, head_dim, block_size,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = head_dim // 2
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < half
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos_ptr = cos_ptr + pos * table_stride
    sin_ptr = sin_ptr + pos * table_stride
    if head < num_heads:
        _rotate_in_place(q_ptr + token * q_stride_t + head * q_stride_h,
                         cos_ptr, sin_ptr, offs, mask, half)
    else:
        kv_head = head - num_heads
        y1, y2 = _rotate_in_place(k_ptr + token * k_stride_t + kv_head * k_stride_h,
                                  cos_ptr, sin_ptr, offs, mask, half)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            dest = ((slot // block_size) * cache_stride_block
                    + (slot % block_size) * cache_stride_slot + kv_head * cache_stride_head)
            k_out = key_cache_ptr + dest
            d = tl.arange(0, BLOCK_D)
            v = tl.load(v_ptr + token * v_stride_t + kv_head * v_stride_h + d,
                        mask=d < head_dim, other=0.0)
            if KV_FP8:
                # Correctly rounded division, as torch's reference (quantize_kv) divides.
                k_scale = tl.load(kv_scale_ptr)
                v_scale = tl.load(kv_scale_ptr + 1)
                k_dtype = k_ptr.dtype.element_ty
                y1 = _to_fp8(tl.math.div_rn(y1.to(k_dtype).to(tl.float32), k_scale))
                y2 = _to_fp8(tl.math.div_rn(y2.to(k_dtype).to(tl.float32), k_scale))
                v = _to_fp8(tl.math.div_rn(v.to(tl.float32), v_scale))
            tl.store(k_out + offs, y1.to(k_out.dtype.element_ty), mask=mask)
            tl.store(k_out + half + offs, y2.to(k_out.dtype.element_ty), mask=mask)
            tl.store(value_cache_ptr + dest + d, v.to(value_cache_ptr.dtype.element_ty),
                     mask=d < head_dim)


def rotary_embedding_with_kv_cache(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place; write k and v [T, Hk, D] to the cache.

    ``cos_cache``/``sin_cache``: [max_position, D] float tables (rotary.RotaryEmbedding's);
    caches: [num_blocks, block_size, Hk, D]; ``slot_mapping``: [T], negative = no write.
    q, k and v may be strided views (e.g. of a fused qkv output) if the last dim is dense.
    ``kv_scale``: [k_scale, v_scale] float32, for a float8_e4m3fn cache (``kv_fp8``).
    Returns (q, k).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1, "head dim must be contiguous"
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1
    assert cos_cache.stride() == sin_cache.stride()
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    assert kv_fp8 == (kv_scale is not None), "an FP8 cache, and only one, takes kv_scale"
    if num_tokens == 0:
        return q, k
    _rotary_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
        positions, q, k, v, cos_cache, sin_cache, key_cache, value_cache, slot_mapping,
        kv_scale if kv_fp8 else cos_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_cache.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_heads, head_dim, key_cache.shape[1],
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        BLOCK_D=triton.next_power_of_2(head_dim), KV_FP8=kv_fp8, num_warps=1,
    )
    return q, k


def rotary_embedding_with_kv_cache_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference: same contract (rotary.RotaryEmbedding + attention's cache write)."""
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    q.copy_(q * cos + rotate_half(q) * sin)
    k.copy_(k * cos + rotate_half(k) * sin)
    written = slot_mapping >= 0
    slots = slot_mapping[written]
    if kv_scale is None:
        new_k, new_v = k[written].to(key_cache.dtype), v[written].to(value_cache.dtype)
    else:
        new_k, new_v = quantize_kv(k[written], kv_scale[0]), quantize_kv(v[written], kv_scale[1])
    key_cache.view(-1, *key_cache.shape[2:])[slots] = new_k
    value_cache.view(-1, *value_cache.shape[2:])[slots] = new_v
    return q, k

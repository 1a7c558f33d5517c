"""Attention over the paged KV cache, in plain torch.

Each layer owns a (key_cache, value_cache) pair of shape
[num_blocks, block_size, num_kv_heads, head_dim]. New keys and values are
written through ``slot_mapping``; queries then read their whole context back
through the per-step gather indices in the forward context. The cache may be stored in
another dtype than the compute dtype (``--kv-cache-dtype bfloat16`` on the CPU): writes
round into it, reads widen back, and attention computes in the compute dtype. GPU kernels can
replace ``forward`` behind the same interface.

``logits_soft_cap`` (Gemma 2) squashes scores as cap * tanh(score / cap) before the
softmax; SDPA cannot do that, so those layers take an explicit matmul-softmax path.

With the Triton backend (``layers.backend``) the cache write, and RoPE when the caller
hands its rotary embedding over, is one fused kernel, and attention reads the paged
cache directly (paged decode with split-KV, paged prefill); soft-capped layers keep
the torch path, which the kernels do not cover. An FP8 cache (``--kv-cache-dtype fp8``,
CUDA) is written and read by those kernels only, with the layer's scales
(``kernels.triton.kv_fp8``). With the numba backend (the CPU in
float32) decode attention reads the paged cache directly too
(``kernels.cpu.decode_attention``), soft caps included; ``_decode``'s torch code below is
its reference. Prefill chunks take ``kernels.cpu.prefill_attention`` there, soft caps
excepted, with ``_prefill`` (SDPA) as its reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rvllm.forward_context import AttentionMetadata, PrefillSeq, get_forward_context
from rvllm.layers.backend import use_numba, use_triton


class Attention(nn.Module):
    # An FP8 cache's [k_scale, v_scale] (float32, on its device; ``kernels.triton.kv_fp8``),
    # bound with the cache (``ModelRunner.allocate_kv_cache``); pending until the first
    # step with prefill tokens sets them from its keys and values (Triton path only).
    kv_scale: torch.Tensor | None = None
    kv_scale_pending: bool = False

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None
                 ) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                positions: torch.Tensor | None = None, rotary: nn.Module | None = None
                ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D]. Returns [T, Hq * D]. A layer reading the KV an
        earlier layer wrote this step (Gemma 4's KV sharing) passes k = v = None. With
        ``rotary`` (a rotary.RotaryEmbedding) and ``positions``, q and k are rotated here
        first (fused with the cache write on the Triton path)."""
        ctx = get_forward_context()
        assert self.kv_cache is not None, "KV cache not bound to this layer"
        if use_triton() and self.logits_soft_cap is None:
            return self._forward_triton(ctx, q, k, v, positions, rotary)
        if self.kv_scale is not None:
            raise NotImplementedError("the fp8 KV cache is read by the Triton kernels only "
                                      "(--kernel-backend triton, no logit soft-capping).")
        if rotary is not None:
            assert k is not None and positions is not None
            q, k = rotary(positions, q, k)
        key_flat = self.kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)
        value_flat = self.kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        if k is not None and v is not None:
            # A cache of another dtype than the compute dtype (--kv-cache-dtype) stores
            # the rounded values; reads widen them back (a no-op when the dtypes agree).
            key_flat.index_copy_(0, ctx.slot_mapping, k.to(key_flat.dtype))
            value_flat.index_copy_(0, ctx.slot_mapping, v.to(value_flat.dtype))

        nd = ctx.num_decode_tokens
        if nd and not ctx.prefills:
            return self._decode(ctx, q, key_flat, value_flat).reshape(nd, -1)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(ctx, q[:nd], key_flat, value_flat)
        for p in ctx.prefills:
            rows = slice(p.token_start, p.token_start + p.num_tokens)
            if self.sees_own_rows(p) and k is not None and v is not None:
                keys, values = k[rows], v[rows]
            else:
                keys = key_flat.index_select(0, p.slots).to(q.dtype)
                values = value_flat.index_select(0, p.slots).to(q.dtype)
            out[rows] = self.prefill_chunk(p, q[rows], keys, values)
        return out.view(q.shape[0], -1)

    def sees_own_rows(self, p: PrefillSeq) -> bool:
        """Whether chunk p attends to nothing but its own new rows, plainly causal (it
        starts its sequence, no window): then they need not be read back from the cache."""
        return p.context_len == 0 and self.sliding_window is None

    def prefill_chunk(self, p: PrefillSeq, q: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor) -> torch.Tensor:
        """Chunk p's attention [n, Hq, D]: its queries q [n, Hq, D] over keys and values
        [Lk, Hk, D]: its own rows (``sees_own_rows``), else its whole context then its
        own rows. Through the numba kernel where it applies (``use_numba``), else SDPA
        with p's mask (the kernel's reference)."""
        if use_numba():
            from rvllm.kernels.cpu import prefill_attention as kernel

            if kernel.supported(self.head_dim, q.dtype, self.logits_soft_cap):
                out = kernel.prefill_attention_cpu(q, keys, values, p.context_len, self.scale,
                                                   self.sliding_window)
                return out.view(q.shape)
        return self._prefill(q, keys, values, p.mask(self.sliding_window))

    def _forward_triton(self, ctx: AttentionMetadata, q: torch.Tensor, k: torch.Tensor | None,
                        v: torch.Tensor | None, positions: torch.Tensor | None,
                        rotary: nn.Module | None) -> torch.Tensor:
        from rvllm.kernels.triton.decode_attention import paged_decode_attention
        from rvllm.kernels.triton.prefill_attention import paged_prefill_attention
        from rvllm.kernels.triton.rotary_kv import rotary_embedding_with_kv_cache

        key_cache, value_cache = self.kv_cache  # type: ignore[misc]
        kv_scale = self.kv_scale
        if k is not None and v is not None:
            if kv_scale is not None and self.kv_scale_pending and ctx.prefills:
                from rvllm.kernels.triton.kv_fp8 import calibrate_kv_scale

                calibrate_kv_scale(kv_scale, k, v)
                self.kv_scale_pending = False
            if rotary is not None:
                q, k = rotary_embedding_with_kv_cache(
                    positions, q, k, v, rotary.cos_cache, rotary.sin_cache, key_cache,
                    value_cache, ctx.slot_mapping, kv_scale)
            elif kv_scale is not None:
                from rvllm.kernels.triton.kv_fp8 import quantize_kv

                # As bytes: index_copy_ has no float8 kernels.
                for cache, new, s in ((key_cache, k, kv_scale[0]), (value_cache, v, kv_scale[1])):
                    cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(
                        0, ctx.slot_mapping, quantize_kv(new, s).view(torch.uint8))
            else:
                key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, ctx.slot_mapping, k)
                value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, ctx.slot_mapping, v)
        out = torch.empty_like(q)
        nd = ctx.num_decode_tokens
        if nd:
            out[:nd] = paged_decode_attention(
                q[:nd], key_cache, value_cache, ctx.decode_block_tables, ctx.decode_lens_i32,
                self.scale, self.sliding_window, kv_scale=kv_scale)
        if ctx.prefills:
            out[nd:] = paged_prefill_attention(
                q[nd:], key_cache, value_cache, ctx.prefill_block_tables,
                ctx.prefill_query_start_loc, ctx.prefill_seq_lens, ctx.max_prefill_len,
                self.scale, self.sliding_window, kv_scale=kv_scale)
        return out.view(q.shape[0], -1)

    def _decode(self, ctx: AttentionMetadata, q: torch.Tensor, key_flat: torch.Tensor,
                value_flat: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, D], one new token per sequence, against each one's whole context."""
        if use_numba():
            from rvllm.kernels.cpu import decode_attention as kernel

            assert self.kv_cache is not None and ctx.decode_block_tables is not None
            assert ctx.decode_seq_lens is not None
            if ctx.cpu_decode_arrays is None:
                ctx.cpu_decode_arrays = kernel.step_arrays(ctx.decode_block_tables,
                                                           ctx.decode_seq_lens)
            return kernel.paged_decode_attention_cpu(
                q, self.kv_cache[0], self.kv_cache[1], ctx.decode_block_tables,
                ctx.decode_seq_lens, self.scale, self.sliding_window, self.logits_soft_cap,
                ctx.cpu_decode_arrays)
        ragged = ctx.ragged_decode()
        if ragged is not None:
            return self._decode_ragged(q, key_flat, value_flat, *ragged)
        # index_select on the flattened slots is several times faster than indexing with
        # the [B, L] tensor itself on the CPU.
        slots = ctx.gather_slots()
        assert slots is not None
        b, n = slots.shape
        flat = slots.view(-1)
        keys = key_flat.index_select(0, flat).to(q.dtype)
        keys = keys.view(b, n, *key_flat.shape[1:]).transpose(1, 2)
        values = value_flat.index_select(0, flat).to(q.dtype)
        values = values.view(b, n, *value_flat.shape[1:]).transpose(1, 2)  # [B, Hk, L, D]
        mask = ctx.decode_mask(self.sliding_window, q.dtype)
        return self._attend(q.unsqueeze(2), keys, values, mask).squeeze(2)

    def _decode_ragged(self, q: torch.Tensor, key_flat: torch.Tensor, value_flat: torch.Tensor,
                       slots: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """Decode attention one sequence at a time over its own context, unpadded: for
        batches of mixed lengths, reading no padding beats one batched call."""
        keys = key_flat.index_select(0, slots).to(q.dtype)  # [sum(lens), Hk, D]
        values = value_flat.index_select(0, slots).to(q.dtype)
        out = torch.empty_like(q)
        start, window = 0, self.sliding_window
        for i, n in enumerate(lens):
            first = start if window is None else max(start, start + n - window)
            k = keys[first : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hk, L, D]
            v = values[first : start + n].transpose(0, 1).unsqueeze(0)
            out[i] = self._attend(q[i, None, :, None], k, v, None)[0, :, 0]
            start += n
        return out

    def _prefill(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        out = self._attend(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                           values.transpose(0, 1).unsqueeze(0), mask, causal=mask is None)
        return out.squeeze(0).transpose(0, 1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        """q: [B, Hq, Lq, D]; k, v: [B, Hk, Lk, D]. ``mask``: bool (True = attend), additive,
        or None; ``causal`` (Lq == Lk, no mask) masks the future."""
        if self.logits_soft_cap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  scale=self.scale, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
        if causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)

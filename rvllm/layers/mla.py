"""Multi-head latent attention (DeepSeek-V2) over a paged cache of compressed latents.

Each token caches one vector, [kv_lora_rank normed latent c | rope key k_pe], shared
by every head; keys and values are never expanded into the cache. With the key
up-projection absorbed into the query (q_latent = W_UK^T q_nope), every head attends to
the cached vectors directly as multi-query attention:

    score = q_latent . c + q_pe . k_pe  (= q_nope . W_UK c + q_pe . k_pe)

and the values are the latents themselves; the caller applies W_UV to the result.
"""

from __future__ import annotations

import torch

from rvllm.forward_context import get_forward_context
from rvllm.layers.attention import Attention


class LatentAttention(Attention):
    """Queries [T, H, kv_lora_rank + rope_dim] against cached latents; returns the
    attention-weighted latents [T, H, kv_lora_rank]."""

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float) -> None:
        super().__init__(num_heads, kv_lora_rank + rope_dim, 1, scale)
        self.kv_lora_rank = kv_lora_rank
        # One cache tensor of [num_blocks, block_size, 1, kv_lora_rank + rope_dim].
        self.cache_entry_shapes = [(1, kv_lora_rank + rope_dim)]

    def forward(self, q: torch.Tensor, latent: torch.Tensor, _: torch.Tensor | None = None
                ) -> torch.Tensor:
        """q: [T, H, r + rope]; latent: [T, 1, r + rope]."""
        ctx = get_forward_context()
        assert self.kv_cache is not None, "KV cache not bound to this layer"
        flat = self.kv_cache[0].view(-1, 1, self.head_dim)
        flat.index_copy_(0, ctx.slot_mapping, latent.to(flat.dtype))
        rank = self.kv_lora_rank
        out = q.new_empty(q.shape[0], self.num_heads, rank)
        nd = ctx.num_decode_tokens
        if nd:
            keys = flat[ctx.gather_slots()].to(q.dtype).transpose(1, 2)  # [B, 1, L, r + rope]
            out[:nd] = self._attend(q[:nd].unsqueeze(2), keys, keys[..., :rank],
                                    ctx.decode_mask(None, q.dtype)).squeeze(2)
        for p in ctx.prefills:
            rows = slice(p.token_start, p.token_start + p.num_tokens)
            mask = p.mask(None)
            keys = latent[rows] if mask is None else flat[p.slots].to(q.dtype)
            out[rows] = self._prefill(q[rows], keys, keys[..., :rank], mask)
        return out

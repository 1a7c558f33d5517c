"""Phi-3 (and Phi-4-mini): Llama's block with the q/k/v and gate/up projections stored
fused in the checkpoint, RoPE over a fraction of each head, and LongRoPE scaling."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from rvllm.layers.attention import Attention
from rvllm.layers.linear import QKVParallelLinear, RowParallelLinear
from rvllm.layers.rotary_scaled import ScaledRotaryEmbedding, rope_type_of
from rvllm.models.base import CausalLM, DecoderModel, PreNormDecoderLayer
from rvllm.models.llama import LlamaMLP


class Phi3Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        self.head_dim = cfg.get("head_dim") or hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        params = rope_type_of(cfg)
        rotary_dim = int(self.head_dim * (params.get("partial_rotary_factor")
                                          or cfg.get("partial_rotary_factor") or 1.0))
        self.rotary_emb = ScaledRotaryEmbedding(rotary_dim, max_position, params,
                                                cfg.get("max_position_embeddings"))
        window = cfg.get("sliding_window")
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                              self.head_dim**-0.5, sliding_window=int(window) if window else None)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim)))


class Phi3ForCausalLM(CausalLM):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        layers = [
            PreNormDecoderLayer(cfg, Phi3Attention(cfg, max_position),
                                LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"],
                                         cfg.get("hidden_act", "silu")))
            for _ in range(cfg["num_hidden_layers"])
        ]
        super().__init__(cfg, DecoderModel(cfg, layers))

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        # Split the checkpoint's fused tensors back into the pieces our tensor-parallel
        # loaders shard one at a time.
        cfg = self.config
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        q_size = num_heads * head_dim
        kv_size = (cfg.get("num_key_value_heads") or num_heads) * head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
                for piece, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    yield name.replace("qkv_proj", piece), part
            elif ".gate_up_proj." in name:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace("gate_up_proj", "gate_proj"), gate
                yield name.replace("gate_up_proj", "up_proj"), up
            else:
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._unfused(weights))

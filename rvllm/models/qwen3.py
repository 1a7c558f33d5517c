"""Qwen3: Llama with an RMSNorm over each query and key head before RoPE, and optional
sliding-window layers from ``max_window_layers`` on."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rvllm.layers.attention import Attention
from rvllm.layers.linear import QKVParallelLinear, RowParallelLinear
from rvllm.layers.norm import RMSNorm
from rvllm.layers.rotary import RotaryEmbedding, rope_parameters
from rvllm.models.base import CausalLM, DecoderModel, PreNormDecoderLayer, layer_window
from rvllm.models.llama import LlamaMLP, qwen_layer_types


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int, window: int | None) -> None:
        super().__init__()
        hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        self.head_dim = cfg.get("head_dim") or hidden // num_heads
        bias = bool(cfg.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, bias)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_position, rope_parameters(cfg))
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                              self.head_dim**-0.5, sliding_window=window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim)))


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        layers = [
            PreNormDecoderLayer(
                cfg, Qwen3Attention(cfg, max_position, layer_window(cfg, t)),
                LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"],
                         cfg.get("hidden_act", "silu")),
            )
            for t in qwen_layer_types(cfg)
        ]
        super().__init__(cfg, DecoderModel(cfg, layers))

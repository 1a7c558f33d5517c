"""Phi-1/1.5/2: attention and MLP side by side off one LayerNorm, biases throughout, a
GELU MLP, and RoPE over only the first ``partial_rotary_factor`` of each head."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rvllm.layers.attention import Attention
from rvllm.layers.embedding import VocabParallelEmbedding
from rvllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rvllm.layers.rotary_scaled import ScaledRotaryEmbedding, rope_type_of
from rvllm.models.base import CausalLM

_GELU_APPROXIMATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh",
                        "gelu": "none"}


class PhiAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        self.head_dim = cfg.get("head_dim") or hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, True)
        self.dense = RowParallelLinear(num_heads * self.head_dim, hidden, bias=True)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.qk_layernorm = bool(cfg.get("qk_layernorm", False))
        if self.qk_layernorm:
            self.q_layernorm = nn.LayerNorm(self.head_dim, eps=cfg.get("layer_norm_eps", 1e-5))
            self.k_layernorm = nn.LayerNorm(self.head_dim, eps=cfg.get("layer_norm_eps", 1e-5))
        params = rope_type_of(cfg)
        factor = params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 0.5
        self.rotary_emb = ScaledRotaryEmbedding(int(self.head_dim * factor), max_position, params)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                              self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.dense(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim)))


class PhiMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        act = cfg.get("hidden_act", "gelu_new")
        if act not in _GELU_APPROXIMATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported for Phi (gelu).")
        self.approximate = _GELU_APPROXIMATIONS[act]
        self.fc1 = ColumnParallelLinear(cfg["hidden_size"], cfg["intermediate_size"], bias=True)
        self.fc2 = RowParallelLinear(cfg["intermediate_size"], cfg["hidden_size"], bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class PhiDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("layer_norm_eps", 1e-5))
        self.self_attn = PhiAttention(cfg, max_position)
        self.mlp = PhiMLP(cfg)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        return self.self_attn(positions, h) + self.mlp(h) + x


class PhiModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(PhiDecoderLayer(cfg, max_position)
                                    for _ in range(cfg["num_hidden_layers"]))
        self.final_layernorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("layer_norm_eps", 1e-5))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return self.final_layernorm(x)


class PhiForCausalLM(CausalLM):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__(cfg, PhiModel(cfg, max_position))
        # The LM head has a bias, sharded over the vocabulary like its weight.
        self.lm_head.bias = nn.Parameter(torch.zeros(self.lm_head.shard_size),
                                         requires_grad=False)
        self.lm_head.bias.weight_loader = self.lm_head.weight_loader

"""Llama, and the architectures shaped like it: Mistral (sliding window) and Qwen2 (q/k/v bias)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rvllm.layers.activation import SiluAndMul
from rvllm.layers.attention import Attention
from rvllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rvllm.layers.rotary import RotaryEmbedding, rope_parameters
from rvllm.models.base import CausalLM, DecoderModel, PreNormDecoderLayer


def sliding_window(cfg: dict[str, Any]) -> int | None:
    """Mistral attends to the last ``sliding_window`` tokens; Qwen2 only when it says so."""
    window = cfg.get("sliding_window")
    if cfg.get("model_type") == "qwen2" and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window else None


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        head_dim = cfg.get("head_dim") or hidden // num_heads
        bias = bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2"
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=bias)
        # Qwen2 has q/k/v biases but none on o_proj; Llama's attention_bias covers all four.
        o_bias = bool(cfg.get("attention_bias", False)) and cfg.get("model_type") != "qwen2"
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.rotary_emb = RotaryEmbedding(head_dim, max_position, rope_parameters(cfg))
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim**-0.5,
                              sliding_window=sliding_window(cfg))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # RoPE is applied inside attention, where the Triton path fuses it with the
        # KV-cache write.
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported for Llama-style MLPs (silu).")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate])
        self.down_proj = RowParallelLinear(intermediate, hidden)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaForCausalLM(CausalLM):
    """Pre-norm decoder layers of Llama attention and a SiLU-gated MLP under an LM head."""

    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        layers = [
            PreNormDecoderLayer(cfg, LlamaAttention(cfg, max_position),
                                LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"],
                                         cfg.get("hidden_act", "silu")))
            for _ in range(cfg["num_hidden_layers"])
        ]
        super().__init__(cfg, DecoderModel(cfg, layers))

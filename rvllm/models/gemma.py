"""Gemma 1, 2 and 3 (text).

All three scale the embedding by sqrt(hidden_size), use GeGLU MLPs and (1 + w) RMSNorms.
Gemma 2 adds a norm after attention and after the MLP, alternates sliding-window and
global layers, and soft-caps attention scores and final logits. Gemma 3 drops the
soft-caps for RMSNorms over each query and key head, and gives its sliding layers their
own RoPE base.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rvllm.layers.activation import GeluAndMul
from rvllm.layers.attention import Attention
from rvllm.layers.embedding import VocabParallelEmbedding
from rvllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rvllm.layers.norm import GemmaRMSNorm
from rvllm.layers.rotary import RotaryEmbedding, rope_parameters
from rvllm.models.base import CausalLM, PreNormDecoderLayer, layer_types, layer_window

_GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "tanh", "gelu_new": "tanh"}


def layer_rope_parameters(cfg: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """Gemma 3's RoPE for one layer type: transformers 5 nests one set per type; older
    configs give the global set as rope_theta/rope_scaling and the local base apart."""
    nested = cfg.get("rope_parameters") or {}
    if layer_type in nested:
        return rope_parameters({"rope_parameters": nested[layer_type]})
    if "sliding_attention" in nested or "full_attention" in nested:
        return rope_parameters({})
    if layer_type == "sliding_attention" and "rope_local_base_freq" in cfg:
        return rope_parameters({"rope_theta": cfg["rope_local_base_freq"]})
    return rope_parameters(cfg)


def scale_in(scale: float, dtype: torch.dtype) -> torch.Tensor:
    """An embedding scale rounded to float32 and then to the compute dtype, as transformers
    rounds it (sqrt(3072) is 55.5 in bfloat16): the checkpoints were trained that way."""
    return torch.tensor(scale, dtype=torch.float32).to(dtype)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GELU_APPROXIMATIONS:
            raise ValueError(f"hidden activation {act!r} is not supported for Gemma (gelu).")
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter])
        self.down_proj = RowParallelLinear(inter, hidden)
        self.act_fn = GeluAndMul(_GELU_APPROXIMATIONS[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int, layer_type: str) -> None:
        super().__init__()
        hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        self.head_dim = cfg.get("head_dim") or hidden // num_heads
        bias = bool(cfg.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, bias)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.qk_norm = cfg.get("model_type", "").startswith("gemma3")
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, cfg.get("rms_norm_eps", 1e-6))
            self.k_norm = GemmaRMSNorm(self.head_dim, cfg.get("rms_norm_eps", 1e-6))
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_position,
                                          layer_rope_parameters(cfg, layer_type))
        # Gemma 2/3 scale scores by query_pre_attn_scalar, which need not be head_dim.
        scale = float(cfg.get("query_pre_attn_scalar") or self.head_dim) ** -0.5
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale,
                              sliding_window=layer_window(cfg, layer_type),
                              logits_soft_cap=cfg.get("attn_logit_softcapping"))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim)))


class GemmaDecoderLayer(PreNormDecoderLayer):
    """Gemma 1: Llama's pre-norm residual block, with Gemma's (1 + w) norms."""

    def __init__(self, cfg: dict[str, Any], max_position: int, layer_type: str) -> None:
        super().__init__(cfg, GemmaAttention(cfg, max_position, layer_type), GemmaMLP(cfg),
                         norm=GemmaRMSNorm)


class Gemma2DecoderLayer(GemmaDecoderLayer):
    """Gemma 2/3: the attention and MLP outputs are normed again before the residual add."""

    def __init__(self, cfg: dict[str, Any], max_position: int, layer_type: str) -> None:
        super().__init__(cfg, max_position, layer_type)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg["hidden_size"], eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg["hidden_size"], eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.embed_scale = cfg["hidden_size"] ** 0.5
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * scale_in(self.embed_scale, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class GemmaForCausalLM(CausalLM):
    decoder_layer: type[GemmaDecoderLayer] = GemmaDecoderLayer
    sliding_every: int | None = None  # the pattern for configs without layer_types

    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        layers = [self.decoder_layer(cfg, max_position, t)
                  for t in layer_types(cfg, self.sliding_every)]
        super().__init__(cfg, GemmaModel(cfg, layers))
        self.final_logit_softcapping = cfg.get("final_logit_softcapping")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma2ForCausalLM(GemmaForCausalLM):
    decoder_layer = Gemma2DecoderLayer
    sliding_every = 2


class Gemma3ForCausalLM(GemmaForCausalLM):
    decoder_layer = Gemma2DecoderLayer
    sliding_every = 6

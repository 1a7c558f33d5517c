"""Gemma 4 (text), as transformers defines ``Gemma4ForCausalLM``.

Gemma 3's layout (sliding and global layers, q/k norms, sandwich norms, scaled
embedding) with:
- global layers of their own head size and KV heads, with proportional RoPE, and
  (``attention_k_eq_v``) values taken from the key projection;
- a value RMSNorm without weight, and attention scores left unscaled (the norms do it);
- per-layer input embeddings mixed into every layer's output (``hidden_size_per_layer_input``);
- the last ``num_kv_shared_layers`` layers reading the KV cache of the last earlier layer
  of their type instead of writing their own (they share its Attention, cache and all);
- optionally a routed-expert MoE beside each dense MLP, and a learned scale per layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rvllm.layers.activation import GeluAndMul
from rvllm.layers.attention import Attention
from rvllm.layers.embedding import VocabParallelEmbedding
from rvllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from rvllm.layers.moe import FusedMoE
from rvllm.layers.norm import RMSNorm
from rvllm.layers.rotary_scaled import ScaledRotaryEmbedding, rope_type_of
from rvllm.models.base import MoECausalLM, layer_types, layer_window
from rvllm.models.gemma import GemmaForCausalLM, GemmaMLP, scale_in


class Gemma4RMSNorm(RMSNorm):
    """Scales by ``w`` (not 1 + w) in float32 before the cast back."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (xf * self.weight.float()).to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


def layer_geometry(cfg: dict[str, Any], layer: int, layer_type: str) -> tuple[int, int]:
    """(head_dim, num_kv_heads) of one layer: global layers may differ from the rest."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    num_kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    per_layer = cfg.get("per_layer_config")
    if per_layer is not None:  # transformers 5 writes the resolved overrides
        override = per_layer.get(str(layer)) or per_layer.get(layer) or {}
        return (override.get("head_dim", head_dim),
                override.get("num_key_value_heads", num_kv_heads))
    if layer_type == "full_attention":
        head_dim = cfg.get("global_head_dim", 512)
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads"):
            num_kv_heads = cfg["num_global_key_value_heads"]
    return head_dim, num_kv_heads


def kv_producers(types: list[str], num_shared: int) -> list[int | None]:
    """For each layer, the earlier layer whose KV cache it reads, or None if it has its own."""
    first_shared = len(types) - num_shared
    producers: list[int | None] = []
    for i, t in enumerate(types):
        if i < first_shared:
            producers.append(None)
        else:
            producers.append(max(j for j in range(first_shared) if types[j] == t))
    return producers


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int, layer: int, layer_type: str,
                 shared: Attention | None) -> None:
        super().__init__()
        hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.head_dim, num_kv_heads = layer_geometry(cfg, layer, layer_type)
        eps = self.eps = cfg.get("rms_norm_eps", 1e-6)
        bias = bool(cfg.get("attention_bias", False))
        self.q_proj = ColumnParallelLinear(hidden, num_heads * self.head_dim, bias=bias)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=bias)
        tp = self.q_proj.tp_size
        if num_heads % tp or num_kv_heads % tp:
            raise ValueError(f"Gemma 4 layer {layer} has {num_heads} query and {num_kv_heads} KV "
                             f"heads, which {tp} tensor-parallel ranks cannot split evenly.")
        self.num_heads, self.num_kv_heads = num_heads // tp, num_kv_heads // tp
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        self.is_kv_shared = shared is not None
        if not self.is_kv_shared:
            self.k_proj = ColumnParallelLinear(hidden, num_kv_heads * self.head_dim, bias=bias)
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            # Global layers with attention_k_eq_v take their values from the key projection.
            if not (cfg.get("attention_k_eq_v") and layer_type == "full_attention"):
                self.v_proj = ColumnParallelLinear(hidden, num_kv_heads * self.head_dim,
                                                   bias=bias)
        rope = rope_type_of({"rope_parameters": (cfg.get("rope_parameters") or {}).get(
            layer_type, {"rope_type": "default"})})
        self.rotary_emb = ScaledRotaryEmbedding(self.head_dim, max_position, rope)
        if shared is not None:
            self.attn = shared
        else:
            self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, 1.0,
                                  sliding_window=layer_window(cfg, layer_type))
            shape = (self.num_kv_heads, self.head_dim)
            self.attn.cache_entry_shapes = [shape, shape]  # global layers differ from the rest

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q = self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim))
        if self.is_kv_shared:
            q = self.rotary_emb.rotate_one(positions, q)
            return self.o_proj(self.attn(q, None, None))
        raw_k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view_as(raw_k) if hasattr(self, "v_proj") else raw_k
        q, k = self.rotary_emb(positions, q, self.k_norm(raw_k))
        return self.o_proj(self.attn(q, k, rms_normalize(v, self.eps)))


class Gemma4Router(nn.Module):
    """Softmax top-k over experts of the normed, scaled hidden state; the chosen weights are
    renormalised and then scaled per expert."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, num_experts = cfg["hidden_size"], cfg["num_experts"]
        self.eps, self.top_k = cfg.get("rms_norm_eps", 1e-6), cfg["top_k_experts"]
        self.root_size = hidden**-0.5
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.proj.weight.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = rms_normalize(x, self.eps) * self.scale * self.root_size
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int, layer: int, layer_type: str,
                 shared: Attention | None) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = Gemma4Attention(cfg, max_position, layer, layer_type, shared)
        inter = cfg["intermediate_size"] * (2 if cfg.get("use_double_wide_mlp") and shared else 1)
        self.mlp = GemmaMLP({**cfg, "intermediate_size": inter})
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Gemma4RMSNorm(hidden, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.has_moe = bool(cfg.get("enable_moe_block"))
        if self.has_moe:
            self.router = Gemma4Router(cfg)
            self.experts = FusedMoE(cfg["num_experts"], hidden, cfg["moe_intermediate_size"],
                                    GeluAndMul("tanh"))
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        self.per_layer_size = cfg.get("hidden_size_per_layer_input") or 0
        if self.per_layer_size:
            self.per_layer_input_gate = nn.Linear(hidden, self.per_layer_size, bias=False)
            self.per_layer_projection = nn.Linear(self.per_layer_size, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                per_layer_input: torch.Tensor | None) -> torch.Tensor:
        h = self.self_attn(positions, self.input_layernorm(x))
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.has_moe:
            # The experts see the same residual stream as the dense MLP, normed apart.
            weights, ids = self.router(x)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if per_layer_input is not None:
            h = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        hidden, n = cfg["hidden_size"], cfg["num_hidden_layers"]
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], hidden)
        self.embed_scale = hidden**0.5
        types = layer_types(cfg, 6)
        producers = kv_producers(types, cfg.get("num_kv_shared_layers") or 0)
        layers: list[Gemma4DecoderLayer] = []
        for i, (t, source) in enumerate(zip(types, producers)):
            shared = None if source is None else layers[source].self_attn.attn
            layers.append(Gemma4DecoderLayer(cfg, max_position, i, t, shared))
        self.layers = nn.ModuleList(layers)
        self.norm = Gemma4RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-6))
        self.per_layer_size = cfg.get("hidden_size_per_layer_input") or 0
        if self.per_layer_size:
            self.embed_tokens_per_layer = VocabParallelEmbedding(
                cfg["vocab_size_per_layer_input"], n * self.per_layer_size)
            self.per_layer_model_projection = nn.Linear(hidden, n * self.per_layer_size,
                                                        bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer_size,
                                                           cfg.get("rms_norm_eps", 1e-6))

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, num_layers, per_layer_size]: a per-layer token embedding averaged (in
        1/sqrt(2) measure) with a normed projection of the main embedding."""
        shape = (x.shape[0], len(self.layers), self.per_layer_size)
        token = self.embed_tokens_per_layer(input_ids)
        token = token * scale_in(self.per_layer_size**0.5, x.dtype)
        context = self.per_layer_model_projection(x) * x.shape[-1] ** -0.5
        context = self.per_layer_projection_norm(context.view(shape))
        return (context + token.view(shape)) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * scale_in(self.embed_scale, x.dtype)
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer_size else None
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, None if per_layer is None else per_layer[:, i])
        return self.norm(x)


class Gemma4ForCausalLM(MoECausalLM):
    stacked_params = ((".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1))
    compute_logits = GemmaForCausalLM.compute_logits  # final logit soft-capping

    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__(cfg, Gemma4Model(cfg, max_position))
        self.final_logit_softcapping = cfg.get("final_logit_softcapping")

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers
                if not layer.self_attn.is_kv_shared]

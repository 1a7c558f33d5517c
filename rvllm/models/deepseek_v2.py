"""DeepSeek-V2: multi-head latent attention (MLA) and a mixture of shared and routed
experts after the first ``first_k_dense_replace`` dense layers.

The paged cache holds each token's compressed latent and rope key only (see
``rvllm/layers/mla.py``); the key and value up-projections in ``kv_b_proj`` are applied
to the query before attention and to the attended latents after it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rvllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from rvllm.layers.mla import LatentAttention
from rvllm.layers.moe import SparseMoeBlock
from rvllm.layers.norm import RMSNorm
from rvllm.layers.rotary_scaled import ScaledRotaryEmbedding, rope_type_of
from rvllm.models.base import (
    QKV_GATE_UP,
    DecoderModel,
    MoECausalLM,
    PreNormDecoderLayer,
    num_routed_experts,
)
from rvllm.models.llama import LlamaMLP


def softmax_scale(cfg: dict[str, Any], params: dict[str, Any]) -> float:
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    # YaRN sharpens the softmax by mscale_all_dim's factor on both queries and keys.
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] == "yarn" and mscale_all_dim and params.get("factor", 1) > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


class DeepseekV2MLAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.nope_dim, self.rope_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        self.v_dim, self.kv_lora_rank = cfg["v_head_dim"], cfg["kv_lora_rank"]
        self.q_lora_rank = cfg.get("q_lora_rank")
        num_heads = cfg["num_attention_heads"]
        qk_dim = self.nope_dim + self.rope_dim
        bias = bool(cfg.get("attention_bias", False))
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, num_heads * qk_dim)
        else:
            self.q_proj = ColumnParallelLinear(hidden, num_heads * qk_dim)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              num_heads * (self.nope_dim + self.v_dim))
        self.kv_b_proj.packable = False  # its weight is split and absorbed, never applied as is
        self.o_proj = RowParallelLinear(num_heads * self.v_dim, hidden, bias=bias)
        self.num_heads = self.kv_b_proj.output_size_per_partition // (self.nope_dim + self.v_dim)
        params = rope_type_of(cfg)
        self.rotary_emb = ScaledRotaryEmbedding(self.rope_dim, max_position, params,
                                                cfg.get("max_position_embeddings"),
                                                interleaved=True)
        self.attn = LatentAttention(self.num_heads, self.kv_lora_rank, self.rope_dim,
                                    softmax_scale(cfg, params))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        latent = torch.cat((self.kv_a_layernorm(c).unsqueeze(1), k_pe), dim=-1)
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim:]  # [H, nope|v, r]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r]
        out = self.attn(torch.cat((q_latent, q_pe), dim=-1), latent)  # [T, H, r]
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(out.reshape(out.shape[0], -1))


def deepseek_mlp(cfg: dict[str, Any], layer: int) -> nn.Module:
    hidden, act = cfg["hidden_size"], cfg.get("hidden_act", "silu")
    num_experts = num_routed_experts(cfg)
    sparse = (num_experts and layer >= cfg.get("first_k_dense_replace", 0)
              and layer % cfg.get("moe_layer_freq", 1) == 0)
    if not sparse:
        return LlamaMLP(hidden, cfg["intermediate_size"], act)
    shared = None
    if cfg.get("n_shared_experts"):
        shared = LlamaMLP(hidden, cfg["moe_intermediate_size"] * cfg["n_shared_experts"], act)
    groups = None
    if cfg.get("topk_method") == "group_limited_greedy":
        groups = (cfg["n_group"], cfg["topk_group"])
    return SparseMoeBlock(hidden, num_experts, cfg["moe_intermediate_size"],
                          cfg["num_experts_per_tok"], renormalize=cfg.get("norm_topk_prob", False),
                          scaling=cfg.get("routed_scaling_factor", 1.0), router_fp32=True,
                          shared_experts=shared, expert_groups=groups)


class DeepseekV2ForCausalLM(MoECausalLM):
    # MLA has no fused q/k/v: without a query LoRA (V2-Lite) the checkpoint's q_proj is a
    # projection of its own, which the q/k/v folding would send to a missing qkv_proj.
    stacked_params = tuple(p for p in QKV_GATE_UP if p[0] != ".qkv_proj.")

    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        layers = [PreNormDecoderLayer(cfg, DeepseekV2MLAttention(cfg, max_position),
                                      deepseek_mlp(cfg, i))
                  for i in range(cfg["num_hidden_layers"])]
        super().__init__(cfg, DecoderModel(cfg, layers))

"""Qwen3-MoE: Qwen3's attention (q/k norms) with sparse experts in most layers; layers in
``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense MLP."""

from __future__ import annotations

from typing import Any

from torch import nn

from rvllm.layers.moe import SparseMoeBlock
from rvllm.models.base import (
    DecoderModel,
    MoECausalLM,
    PreNormDecoderLayer,
    layer_window,
    num_routed_experts,
)
from rvllm.models.llama import LlamaMLP, qwen_layer_types
from rvllm.models.qwen3 import Qwen3Attention


def qwen3_moe_mlp(cfg: dict[str, Any], layer: int) -> nn.Module:
    num_experts = num_routed_experts(cfg)
    sparse = (layer not in (cfg.get("mlp_only_layers") or []) and num_experts > 0
              and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0)
    if not sparse:
        return LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("hidden_act", "silu"))
    return SparseMoeBlock(cfg["hidden_size"], num_experts, cfg["moe_intermediate_size"],
                          cfg["num_experts_per_tok"], renormalize=cfg.get("norm_topk_prob", True))


class Qwen3MoeForCausalLM(MoECausalLM):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        layers = [
            PreNormDecoderLayer(cfg, Qwen3Attention(cfg, max_position, layer_window(cfg, t)),
                                qwen3_moe_mlp(cfg, i))
            for i, t in enumerate(qwen_layer_types(cfg))
        ]
        super().__init__(cfg, DecoderModel(cfg, layers))

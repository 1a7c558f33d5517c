"""Mixtral: Mistral's attention with a top-2 sparse mixture of eight SiLU experts in place
of the MLP. Qwen3-MoE, the same with Qwen3's attention, lives in ``qwen3_moe.py``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rvllm.layers.moe import SparseMoeBlock
from rvllm.models.base import DecoderModel, MoECausalLM, PreNormDecoderLayer, num_routed_experts
from rvllm.models.llama import LlamaAttention, layer_windows


class MixtralForCausalLM(MoECausalLM):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        layers = [
            PreNormDecoderLayer(
                cfg, LlamaAttention(cfg, max_position, window),
                SparseMoeBlock(cfg["hidden_size"], num_routed_experts(cfg),
                               cfg["intermediate_size"], cfg["num_experts_per_tok"],
                               renormalize=True),
            )
            for window in layer_windows(cfg)
        ]
        super().__init__(cfg, DecoderModel(cfg, layers))

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor

"""Llama, and the architectures shaped like it: Mistral (sliding window) and Qwen2 (q/k/v bias)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rvllm.layers.activation import SiluAndMul
from rvllm.layers.attention import Attention
from rvllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from rvllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rvllm.layers.norm import RMSNorm
from rvllm.layers.rotary import RotaryEmbedding, rope_parameters

# Checkpoint names folded into our fused projections: (fused name, checkpoint name, shard).
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


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
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden,
                                        bias=bool(cfg.get("attention_bias", False)))
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
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


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


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(cfg, max_position)
        self.mlp = LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"],
                            cfg.get("hidden_act", "silu"))
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, max_position) for _ in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Hidden states for every new token from ``forward``; logits only where asked."""

    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_position)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"])
        if cfg.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into our parameters; returns the
        names of the parameters that were filled."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        tied = self.config.get("tie_word_embeddings", False)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                continue
            for fused, original, shard in STACKED_PARAMS:
                if f".{original}." in name:
                    target = name.replace(f".{original}.", f".{fused}.")
                    if target not in params:
                        raise ValueError(f"checkpoint tensor {name} has no place in the model")
                    param = params[target]
                    param.weight_loader(param, tensor.to(param.dtype), shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name} has no place in the model")
                param = params[name]
                loader = getattr(param, "weight_loader", None)
                if tensor.shape != param.shape and loader is None:
                    raise ValueError(
                        f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(param.shape)}"
                    )
                if loader is None:
                    param.data.copy_(tensor)
                else:
                    loader(param, tensor.to(param.dtype))
                loaded.add(name)
        if tied:
            loaded.add("lm_head.weight")
        return loaded

"""Rotary position embedding (rotate-half layout, as in Hugging Face checkpoints)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rvllm.layers.rope_frequencies import SUPPORTED_ROPE_TYPES, inv_freq, inv_freq_and_scale


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Rope settings from either the transformers 4 (rope_theta + rope_scaling) or the
    transformers 5 (rope_parameters) spelling of a config."""
    params = dict(hf_config.get("rope_scaling") or {})
    params.update(hf_config.get("rope_parameters") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    params["rope_type"] = rope_type
    if rope_type == "yarn" and not params.get("factor"):
        # Without a factor (DeepSeek-V3's spelling) transformers takes the ratio of the
        # context lengths.
        original = (params.get("original_max_position_embeddings")
                    or hf_config["original_max_position_embeddings"])
        params["factor"] = hf_config["max_position_embeddings"] / original
    return params


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
# id(cos table) -> (positions tensor, cos, sin) of the step in flight.
_MEMO: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _cos_sin(head_dim: int, max_position: int, params: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    # Every layer of a model uses the same tables: build them once.
    key = (head_dim, max_position, str(torch.get_default_device()), repr(sorted(params.items())))
    if key not in _TABLES:
        scale = 1.0
        if params["rope_type"] == "yarn":
            freqs_inv, scale = inv_freq_and_scale(head_dim, params, max_position, max_position)
        else:
            freqs_inv = inv_freq(head_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), freqs_inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        # YaRN's attention factor scales cos and sin, as transformers applies it: every
        # path that reads these tables (the compiled CPU step, Triton's fused write) gets
        # it for free.
        _TABLES[key] = (emb.cos() * scale, emb.sin() * scale)
    return _TABLES[key]


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key, given each token's absolute position."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        cos, sin = _cos_sin(head_dim, max_position, params)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _lookup(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer sees the same positions tensor in a step: gather cos/sin once.
        memo = _MEMO.get(id(self.cos_cache))
        if memo is not None and memo[0] is positions and memo[1].dtype == dtype:
            return memo[1], memo[2]
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        _MEMO[id(self.cos_cache)] = (positions, cos, sin)
        return cos, sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]."""
        cos, sin = self._lookup(positions, q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k

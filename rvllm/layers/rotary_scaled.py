"""RoPE over part of each head, with the scalings `rotary.py` does not know: Phi-3's
LongRoPE and DeepSeek's YaRN, both of which also scale cos/sin by an attention factor,
and Gemma 4's proportional RoPE, which rotates only the fastest pairs of the whole head.

Some checkpoints (DeepSeek-V2) rotate interleaved pairs (x0, x1), (x2, x3), ... rather than
the two halves of the rotated features; ``interleaved`` picks that layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rvllm.layers.rope_frequencies import (
    SCALED_ROPE_TYPES,
    SUPPORTED_ROPE_TYPES,
    inv_freq_and_scale,
)


def rope_type_of(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of a config (either spelling), validated against every type known."""
    params = dict(hf_config.get("rope_scaling") or {})
    params.update(hf_config.get("rope_parameters") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    if "original_max_position_embeddings" in hf_config:  # Phi-3 keeps it at the top level
        params.setdefault("original_max_position_embeddings",
                          hf_config["original_max_position_embeddings"])
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = "longrope" if rope_type == "su" else rope_type
    known = list(dict.fromkeys(SUPPORTED_ROPE_TYPES + SCALED_ROPE_TYPES))
    if rope_type not in known:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: "
                         f"{', '.join(known)}.")
    params["rope_type"] = rope_type
    return params


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


class ScaledRotaryEmbedding(nn.Module):
    """Applies RoPE to the first ``rotary_dim`` features of each query and key head."""

    def __init__(self, rotary_dim: int, max_position: int, params: dict[str, Any],
                 model_max: int | None = None, interleaved: bool = False) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq, scale = inv_freq_and_scale(rotary_dim, params, max_position,
                                             model_max or max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
        self.rotate = _rotate_pairs if interleaved else _rotate_half
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == x.shape[-1]:
            return x * cos + self.rotate(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat((rot * cos + self.rotate(rot) * sin, rest), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]."""
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def rotate_one(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """RoPE on a single [T, H, D] tensor (a query whose keys are already cached)."""
        cos = self.cos_cache[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(x.dtype)
        return self._apply(x, cos, sin)
